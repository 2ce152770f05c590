# shellcheck shell=bash
# shellcheck disable=SC2034  # variables are used by the scripts that source this file
# config.sh - knobs, derived paths and process helpers shared by start.sh and stop.sh.
# Sourced, never run. Every knob is an environment variable with a default; $DIR/env.sh
# (written by start.sh) exports the same names, so `. env.sh; stop.sh` targets the same cluster.
#
#   TGI_HPC_CLUSTER_DIR=/tmp/tgi-hpc-cluster   state: configs, logs, pids, DB, keys, env.sh
#   TGI_HPC_CLUSTER_NAME=tgilocal              Slurm ClusterName (changing it needs FRESH=1)
#   TGI_HPC_CLUSTER_PORT_BASE=6817             slurmctld=BASE slurmd=+1 slurmdbd=+2 mariadb=+3
#   TGI_HPC_CLUSTER_SSH_PORT=2222              sshd on 127.0.0.1
#   TGI_HPC_CLUSTER_NODE=cn-g001               NodeName (NodeAddr is always 127.0.0.1)
#   TGI_HPC_CLUSTER_CPUS=16 TGI_HPC_CLUSTER_MEM_MB=128000   advertised node size (oversubscribed)
#   TGI_HPC_CLUSTER_GPUS=4 TGI_HPC_CLUSTER_GPU_TYPE=a100l   fake GPUs (char devices, harmless)
#   TGI_HPC_CLUSTER_FEATURES=x86_64,ampere,nvlink,80gb
#   TGI_HPC_CLUSTER_ACCOUNTS="def-test mila"   sacctmgr accounts, root associated to each
#   TGI_HPC_CLUSTER_DEFAULT_ACCOUNT=mila       the users' default account (jobs without --account)
#   TGI_HPC_CLUSTER_USERS="root \$SUDO_USER"    users associated to every account (with enforcement,
#                                              any other user's jobs are rejected)
#   TGI_HPC_CLUSTER_ENFORCE=associations       AccountingStorageEnforce ("" = off: unknown
#                                              accounts are then silently replaced, not rejected)
#   TGI_HPC_CLUSTER_CGROUP=auto                auto: cgroup v1 when usable; 1 force; 0 linuxproc
#   TGI_HPC_CLUSTER_SYSTEM_CONF=1              symlink /etc/slurm/{slurm,gres,cgroup}.conf to ours
#                                              (plain sbatch works without SLURM_CONF)
#   TGI_HPC_CLUSTER_LOGIN_PYTHONPATH=          PYTHONPATH for ssh sessions on the login node (a git
#                                              worktree's tgi_hpc instead of the installed one)
#   TGI_HPC_CLUSTER_PROBE=1                    start waits for one real job (first sched pass)
#   TGI_HPC_CLUSTER_FRESH=0                    start: 1 = stop and wipe state first
#   TGI_HPC_CLUSTER_WIPE=0                     stop: 1 = delete the state dir too
#   TGI_HPC_CLUSTER_KEEP_MUNGE=0               stop: 1 = leave munged running (shared by instances)

DIR=${TGI_HPC_CLUSTER_DIR:-/tmp/tgi-hpc-cluster}
CLUSTER=${TGI_HPC_CLUSTER_NAME:-tgilocal}
PORT_BASE=${TGI_HPC_CLUSTER_PORT_BASE:-6817}
CTLD_PORT=$PORT_BASE
SLURMD_PORT=$((PORT_BASE + 1))
DBD_PORT=$((PORT_BASE + 2))
DB_PORT=$((PORT_BASE + 3))
SSH_PORT=${TGI_HPC_CLUSTER_SSH_PORT:-2222}
LOGIN_PYTHONPATH=${TGI_HPC_CLUSTER_LOGIN_PYTHONPATH:-}
NODE=${TGI_HPC_CLUSTER_NODE:-cn-g001}
CPUS=${TGI_HPC_CLUSTER_CPUS:-16}
MEM_MB=${TGI_HPC_CLUSTER_MEM_MB:-128000}
GPUS=${TGI_HPC_CLUSTER_GPUS:-4}
GPU_TYPE=${TGI_HPC_CLUSTER_GPU_TYPE:-a100l}
FEATURES=${TGI_HPC_CLUSTER_FEATURES:-x86_64,ampere,nvlink,80gb}
ACCOUNTS=${TGI_HPC_CLUSTER_ACCOUNTS:-def-test mila}
DEFAULT_ACCOUNT=${TGI_HPC_CLUSTER_DEFAULT_ACCOUNT:-mila}
USERS=${TGI_HPC_CLUSTER_USERS:-root${SUDO_USER:+ $SUDO_USER}}
ENFORCE=${TGI_HPC_CLUSTER_ENFORCE-associations}
CGROUP=${TGI_HPC_CLUSTER_CGROUP:-auto}
SYSTEM_CONF=${TGI_HPC_CLUSTER_SYSTEM_CONF:-1}
PARTITIONS="main long unkillable short-unkillable main-cpu long-cpu unkillable-cpu"

ETC=$DIR/etc
RUN=$DIR/run
LOG=$DIR/log
SSHDIR=$DIR/ssh
DB=$DIR/mysql
CONF=$ETC/slurm.conf
ENV_FILE=$DIR/env.sh
export SLURM_CONF=$CONF   # every slurm command below talks to THIS cluster

T0=$(date +%s%N)
ms() { echo $(( ($(date +%s%N) - T0) / 1000000 )); }
# Progress goes to stderr: stdout of start.sh is only the env file path (`. "$(start.sh)"`).
say() { echo "[local-cluster +$(ms)ms] $*" >&2; }
die() { echo "[local-cluster] ERROR: $*" >&2; exit 1; }

# A PID is running if it exists and is not a zombie: PID 1 of the sandbox (not systemd) reaps
# orphans only every ~2 s, so `kill -0` keeps succeeding for a daemon that already died.
running() {
  local st
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

# pid_alive PIDFILE COMM: the recorded PID runs and is that daemon (a stale file from an
# earlier boot may name a PID that now belongs to something else).
pid_alive() {
  local p
  p=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$p" ] && running "$p" && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ]
}

# stop_pidfile PIDFILE COMM: SIGTERM, up to 10 s, then SIGKILL; only that PID.
stop_pidfile() {
  local p _
  if pid_alive "$1" "$2"; then
    p=$(cat "$1")
    kill "$p" 2>/dev/null || true
    for _ in $(seq 1 200); do running "$p" || break; sleep 0.05; done
    if running "$p"; then kill -9 "$p" 2>/dev/null || true; say "$2 ($p) needed SIGKILL"; fi
    say "stopped $2 ($p)"
  fi
  rm -f "$1"
}

# port_open PORT: something accepts TCP on 127.0.0.1:PORT. Uses bash's /dev/tcp because a fresh
# container has neither ss (iproute2) nor netstat.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {
  local _
  for _ in $(seq 1 "${2:-150}"); do port_open "$1" && return 0; sleep 0.1; done
  return 1
}
