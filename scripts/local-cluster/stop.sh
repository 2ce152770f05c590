#!/usr/bin/env bash
# stop.sh - stop what start.sh started for one state dir; a no-op when nothing runs.
# Cancels all jobs first (running job steps survive a killed slurmd), then signals only the
# PIDs recorded in $DIR/run/*.pid whose /proc/PID/comm matches. munged is stopped only if
# this cluster started it. TGI_HPC_CLUSTER_WIPE=1 also deletes the state dir.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# The knobs start.sh used for this dir (node name, config path) win over the current ones.
ENV_SH=${TGI_HPC_CLUSTER_DIR:-/tmp/tgi-hpc-cluster}/env.sh
# shellcheck source=/dev/null
[ -f "$ENV_SH" ] && . "$ENV_SH"
# shellcheck source=config.sh
. "$HERE/config.sh"

[ "$(id -u)" = 0 ] || die "must run as root"
[ -d "$DIR" ] || { say "nothing to stop ($DIR does not exist)"; exit 0; }

cancel_jobs() {
  local jobs _
  pid_alive "$RUN/slurmctld.pid" slurmctld && command -v squeue > /dev/null || return 0
  jobs=$(squeue -h -o %A 2> /dev/null | sort -u | tr '\n' ' ')
  [ -n "${jobs// /}" ] || return 0
  # shellcheck disable=SC2086
  scancel $jobs 2> /dev/null
  for _ in $(seq 1 150); do [ -z "$(squeue -h -o %A 2> /dev/null)" ] && break; sleep 0.1; done
  say "cancelled jobs: $jobs"
}

# descendants PID: PID and all its descendants, from /proc (pgrep is not in a bare container).
descendants() {
  local c
  echo "$1"
  for c in $(cat /proc/"$1"/task/*/children 2> /dev/null); do descendants "$c"; done
}

# Job processes left behind when slurmctld had died and jobs could not be cancelled:
# slurmstepd processes of OUR slurmd and their descendants, plus every PID in this node's
# cgroup tree. Ours = cwd or an open file is our $LOG dir / slurmd.log, compared by device and
# inode (a path compare would also match another instance's identical path in a chroot).
kill_leftovers() {
  local p f id ours left="" still _
  ours=" $(stat -c %d:%i "$LOG" "$LOG/slurmd.log" 2> /dev/null | tr '\n' ' ')"
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$(cat "/proc/$p/comm" 2> /dev/null)" = slurmstepd ] || continue
    for f in "/proc/$p/cwd" /proc/"$p"/fd/*; do
      id=$(stat -L -c %d:%i "$f" 2> /dev/null) || continue
      case "$ours" in *" $id "*) left="$left $(descendants "$p" | tr '\n' ' ')"; break ;; esac
    done
  done
  if grep -q '^ProctrackType=proctrack/cgroup' "$CONF" 2> /dev/null && [ -d "/sys/fs/cgroup/freezer/slurm_$NODE" ]; then
    left="$left $(find "/sys/fs/cgroup/freezer/slurm_$NODE" -name cgroup.procs -exec cat {} + 2> /dev/null | tr '\n' ' ')"
  fi
  left=$(echo "$left" | tr ' ' '\n' | grep -E '^[0-9]+$' | sort -un | tr '\n' ' ')
  [ -n "${left// /}" ] || return 0
  say "WARNING: killing leftover job processes: $left"
  # shellcheck disable=SC2086
  kill $left 2> /dev/null
  for _ in $(seq 1 40); do
    still=""; for p in $left; do running "$p" && still="$still $p"; done
    [ -z "$still" ] && return 0
    sleep 0.05
  done
  # shellcheck disable=SC2086
  kill -9 $still 2> /dev/null
}

# unlink_system_conf: drop /etc/slurm links that point into a wiped $DIR.
unlink_system_conf() {
  local f
  for f in slurm.conf gres.conf cgroup.conf; do
    [ "$(readlink "/etc/slurm/$f" 2> /dev/null)" = "$ETC/$f" ] && rm -f "/etc/slurm/$f"
  done
}

cancel_jobs
stop_pidfile "$RUN/sshd.pid" sshd
stop_pidfile "$RUN/slurmd.pid" slurmd
stop_pidfile "$RUN/slurmctld.pid" slurmctld
stop_pidfile "$RUN/slurmdbd.pid" slurmdbd
stop_pidfile "$RUN/mariadbd.pid" mariadbd
[ "${TGI_HPC_CLUSTER_KEEP_MUNGE:-0}" = 1 ] || stop_pidfile "$RUN/munged.pid" munged
kill_leftovers
if [ "${TGI_HPC_CLUSTER_WIPE:-0}" = 1 ]; then
  unlink_system_conf
  rm -rf "$DIR"
  say "wiped $DIR"
fi
say "stopped ($DIR)"
