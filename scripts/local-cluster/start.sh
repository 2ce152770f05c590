#!/usr/bin/env bash
# start.sh - a REAL single-node Slurm cluster (munge, MariaDB + slurmdbd, slurmctld, slurmd)
# and a REAL OpenSSH server on 127.0.0.1, for tgi-hpc's tests and demos.
#
# Idempotent: daemons already up with the same config are left alone; a changed config
# restarts them; TGI_HPC_CLUSTER_FRESH=1 wipes the state first. Installs missing Debian
# packages itself (a CI machine starts bare). Needs root: apt-get, slurmd and sshd.
# Knobs: see config.sh. Prints the path of the env file that tests and demos source.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=config.sh
. "$HERE/config.sh"
# shellcheck source=render.sh
. "$HERE/render.sh"
HOST=$(uname -n); HOST=${HOST%%.*}

[ "$(id -u)" = 0 ] || die "must run as root (apt-get, slurmd and sshd need root)"

STARTED=0
PACKAGES="slurmctld slurmd slurm-client munge slurmdbd mariadb-server openssh-server"

install_packages() {
  local missing="" p
  for p in $PACKAGES; do
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  say "installing:$missing"
  export DEBIAN_FRONTEND=noninteractive
  # Postinst scripts would start the services; we start them ourselves, with our config.
  local added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; added_policy=1
  fi
  mkdir -p "$LOG"
  # wait for a dpkg lock held by another apt run instead of failing at once
  local apt="apt-get -o DPkg::Lock::Timeout=300"
  $apt update -qq > "$LOG/apt.log" 2>&1 || { cat "$LOG/apt.log" >&2; die "apt-get update failed"; }
  # shellcheck disable=SC2086
  $apt install -y -qq --no-install-recommends $missing >> "$LOG/apt.log" 2>&1 \
    || { tail -30 "$LOG/apt.log" >&2; die "apt-get install failed (full log: $LOG/apt.log)"; }
  [ "$added_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  say "installed"
}

start_munge() {
  # munged is machine-wide: reuse a working one (another instance may own it).
  if munge -n 2>/dev/null | unmunge > /dev/null 2>&1; then return 0; fi
  [ -s /etc/munge/munge.key ] || mungekey --create --force
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  # --force: a socket left by a munged that died with the previous machine state
  runuser -u munge -- /usr/sbin/munged --force --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$RUN/munged.pid"   # marks it as ours, for stop.sh
  local _
  for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge > /dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge > /dev/null || die "munged did not come up (see /var/log/munge/munged.log)"
  say "munged started"
}

db() { mariadb --no-defaults --socket="$DB/mysqld.sock" -uroot "$@"; }

start_mariadb() {
  if [ ! -d "$DB/mysql" ]; then
    # --force: works without DNS or /etc/hosts (bare chroot); grants use IPs, and we skip name resolve
    rm -rf "$DB"; mkdir -p "$DB"; chown mysql:mysql "$DB"
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB" --auth-root-authentication-method=socket \
      --skip-test-db --force --innodb-log-file-size=16M > "$LOG/mariadb-install.log" 2>&1 \
      || { cat "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  if ! pid_alive "$RUN/mariadbd.pid" mariadbd; then
    port_open "$DB_PORT" && die "port $DB_PORT (mariadb) is used by someone else; set TGI_HPC_CLUSTER_PORT_BASE"
    # mariadbd runs as mysql: its pid file and log must live in its own datadir, not in $RUN/$LOG.
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB" --socket="$DB/mysqld.sock" \
      --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$DB/mariadbd.pid" \
      --log-error="$DB/mariadb.err" --innodb-buffer-pool-size=64M --innodb-log-file-size=16M \
      --innodb-lock-wait-timeout=900 < /dev/null > /dev/null 2>&1 &
    local _
    for _ in $(seq 1 150); do db -e 'select 1' > /dev/null 2>&1 && break; sleep 0.1; done
    db -e 'select 1' > /dev/null || die "mariadbd did not come up (see $DB/mariadb.err)"
    cp "$DB/mariadbd.pid" "$RUN/mariadbd.pid"
    ln -sf "$DB/mariadb.err" "$LOG/mariadb.log"
    say "mariadbd started"
  fi
  db -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

# start_daemon PIDFILE COMM PORT CMD...: (re)start unless it runs and the config is unchanged.
start_daemon() {
  local pidfile=$1 comm=$2 port=$3; shift 3
  if pid_alive "$pidfile" "$comm" && [ "$SLURM_CHANGED" = 0 ]; then return 0; fi
  STARTED=1
  stop_pidfile "$pidfile" "$comm"
  port_open "$port" && die "port $port ($comm) is used by someone else; set TGI_HPC_CLUSTER_PORT_BASE"
  "$@" || die "$comm failed to start (see $LOG/$comm.log)"
  wait_port "$port" 300 || die "$comm is not listening on $port (see $LOG/$comm.log)"
  say "$comm started"
}

wait_node_idle() {
  local state="" _
  for _ in $(seq 1 300); do
    state=$(sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -1 || true)
    case "$state" in
      idle|mixed|allocated|completing|planned) say "node $NODE is $state"; return 0 ;;
      # a failed Prolog or an unclean stop leaves the node drained/down: put it back
      drain*|down*) scontrol update NodeName="$NODE" State=RESUME 2> /dev/null || true ;;
    esac
    sleep 0.1
  done
  die "node $NODE is not usable (state '$state'); see $LOG/slurmctld.log and $LOG/slurmd.log"
}

ensure_accounts() {
  local have a u
  have=" $(sacctmgr -n -P list assoc format=account,user 2>/dev/null | tr '\n' ' ') "
  for a in $ACCOUNTS; do
    case "$have" in *" $a|"*) ;; *) sacctmgr -i -Q add account "$a" Description="$a" Organization="$a" > /dev/null ;; esac
    for u in $USERS; do
      case "$have" in *" $a|$u "*) continue ;; esac
      sacctmgr -i -Q add user "$u" Account="$a" > /dev/null
    done
  done
  [ -n "$DEFAULT_ACCOUNT" ] || return 0
  for u in $USERS; do
    if [ "$(sacctmgr -n -P list user "$u" format=defaultaccount 2>/dev/null)" != "$DEFAULT_ACCOUNT" ]; then
      sacctmgr -i -Q modify user "$u" set DefaultAccount="$DEFAULT_ACCOUNT" > /dev/null
    fi
  done
}

# The first scheduling pass comes ~4 s after slurmctld starts; waiting for one real job here
# (and for sacct to record it) spares every test that latency and proves accounting works.
probe_job() {
  local id state="" _
  id=$(sbatch --parsable -J tgi-hpc-probe -o /dev/null --wrap true) || die "probe sbatch failed"
  for _ in $(seq 1 300); do
    state=$(sacct -n -X -P -j "$id" -o State 2>/dev/null | head -1)
    [ "$state" = COMPLETED ] && { say "probe job $id completed (sacct)"; return 0; }
    sleep 0.1
  done
  die "probe job $id not COMPLETED in sacct after 30 s (state '$state'); see $LOG/slurmctld.log"
}

start_sshd() {
  mkdir -p /run/sshd; chmod 755 /run/sshd
  # Debian's root may be locked ("!" password): with UsePAM no sshd then refuses even keys.
  case "$(getent shadow root | cut -d: -f2)" in '!'*) usermod -p '*' root; say "unlocked root for key login" ;; esac
  if pid_alive "$RUN/sshd.pid" sshd && [ "$SSHD_CHANGED" = 0 ]; then return 0; fi
  stop_pidfile "$RUN/sshd.pid" sshd
  port_open "$SSH_PORT" && die "port $SSH_PORT (sshd) is used by someone else; set TGI_HPC_CLUSTER_SSH_PORT"
  /usr/sbin/sshd -t -f "$SSHDIR/sshd_config" || die "invalid $SSHDIR/sshd_config"
  /usr/sbin/sshd -f "$SSHDIR/sshd_config" -E "$LOG/sshd.log" || die "sshd failed (see $LOG/sshd.log)"
  wait_port "$SSH_PORT" || die "sshd is not listening on $SSH_PORT (see $LOG/sshd.log)"
  say "sshd started on 127.0.0.1:$SSH_PORT"
}

write_env_file() {
  cat > "$ENV_FILE.new" <<EOF
# Generated by scripts/local-cluster/start.sh; source it: . $ENV_FILE
export SLURM_CONF=$CONF
export TGI_HPC_CLUSTER_DIR=$DIR
export TGI_HPC_CLUSTER_NAME=$CLUSTER
export TGI_HPC_CLUSTER_PORT_BASE=$PORT_BASE
export TGI_HPC_CLUSTER_NODE=$NODE
export TGI_HPC_CLUSTER_PARTITIONS="$PARTITIONS"
export TGI_HPC_CLUSTER_DEFAULT_PARTITION=main
export TGI_HPC_CLUSTER_ACCOUNTS="$ACCOUNTS"
export TGI_HPC_CLUSTER_DEFAULT_ACCOUNT=$DEFAULT_ACCOUNT
export TGI_HPC_CLUSTER_USERS="$USERS"
export TGI_HPC_CLUSTER_ENFORCE=$ENFORCE
export TGI_HPC_CLUSTER_GPUS=$GPUS
export TGI_HPC_CLUSTER_GPU_TYPE=$GPU_TYPE
export TGI_HPC_CLUSTER_CGROUP=$CGROUP
export TGI_HPC_CLUSTER_TMPDIR_ROOT=$DIR/tmpdir
export TGI_HPC_CLUSTER_SSH_PORT=$SSH_PORT
export TGI_HPC_CLUSTER_SSH_CONFIG=$SSHDIR/config
export TGI_HPC_CLUSTER_SSH_KEY=$SSHDIR/id_ed25519
export TGI_HPC_CLUSTER_KNOWN_HOSTS=$SSHDIR/known_hosts
export TGI_HPC_CLUSTER_HOST_KEY=$SSHDIR/host_ed25519.pub
export TGI_HPC_CLUSTER_LOGIN=tgi-login
export TGI_HPC_CLUSTER_LOGS=$LOG
export TGI_HPC_CLUSTER_LOGIN_PYTHONPATH="$LOGIN_PYTHONPATH"
export TGI_HPC_CLUSTER_PROFILE=$(cd "$HERE/../.." && pwd)/tests/cluster/local-profile.yaml
# tgi-hpc itself reads TGI_HPC_CLUSTER: export TGI_HPC_CLUSTER="\$TGI_HPC_CLUSTER_PROFILE" (CONTRIBUTING.md)
EOF
  mv -f "$ENV_FILE.new" "$ENV_FILE"; chmod 644 "$ENV_FILE"
}

main() {
  if [ "${TGI_HPC_CLUSTER_FRESH:-0}" = 1 ] && [ -d "$DIR" ]; then
    say "TGI_HPC_CLUSTER_FRESH=1: stopping and wiping $DIR"
    TGI_HPC_CLUSTER_WIPE=1 "$HERE/stop.sh" > /dev/null
  fi
  mkdir -p "$ETC" "$RUN" "$LOG" "$SSHDIR" "$DIR/state" "$DIR/spool" "$DIR/tmpdir" "$DIR/scratch"
  chmod 755 "$DIR" "$ETC" "$RUN" "$LOG"; chmod 700 "$SSHDIR"
  # tmpdir: per-job SLURM_TMPDIRs; scratch: the test profile's $SCRATCH (any user may write)
  chmod 1777 "$DIR/tmpdir" "$DIR/scratch"
  install_packages

  render_job_scripts; render_gres_conf; render_cgroup_conf; render_slurm_conf; render_slurmdbd_conf
  link_system_conf
  [ "$SLURM_CHANGED" = 1 ] && say "slurm config written to $ETC (cgroup=$CGROUP)"

  start_munge
  start_mariadb
  # slurmdbd before slurmctld: with AccountingStorageEnforce the controller needs the associations.
  start_daemon "$RUN/slurmdbd.pid" slurmdbd "$DBD_PORT" /usr/sbin/slurmdbd
  start_daemon "$RUN/slurmctld.pid" slurmctld "$CTLD_PORT" /usr/sbin/slurmctld -f "$CONF"
  start_daemon "$RUN/slurmd.pid" slurmd "$SLURMD_PORT" /usr/sbin/slurmd -f "$CONF" -N "$NODE"
  wait_node_idle
  ensure_accounts
  # A no-op re-run (nothing started) skips the probe: the cluster was proven when it started.
  if [ "$STARTED" = 1 ] && [ "${TGI_HPC_CLUSTER_PROBE:-1}" = 1 ]; then probe_job; fi

  render_ssh
  start_sshd
  write_env_file
  say "ready: cluster $CLUSTER, node $NODE ($CPUS cpus, ${MEM_MB} MB, ${GPUS}x $GPU_TYPE), partitions: $PARTITIONS"
  say "ssh:   ssh -F $SSHDIR/config tgi-login sinfo     (or $NODE: two hops)"
  say "stop:  $HERE/stop.sh"
  echo "$ENV_FILE"
}

main "$@"
