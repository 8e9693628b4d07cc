#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by slurm_up.sh: cancel its jobs, stop
# slurmd, slurmctld, slurmdbd, MariaDB and munged (by the pids in DIR/run), and remove
# DIR (config, spool, logs, database) unless --keep is given. Idempotent.
#
#   bash workflow/scripts/slurm_down.sh [--dir DIR] [--keep]
set -uo pipefail

DIR=${FEDREPRO_SLURM_DIR:-/tmp/fedrepro-slurm}
KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "slurm_down: unknown option $1" >&2; exit 1 ;;
  esac
done
export PATH="$PATH:/usr/sbin:/sbin"
DIR=$(realpath -m "$DIR")
log() { echo "[slurm_down] $*" >&2; }

[ -d "$DIR" ] || { log "nothing to stop ($DIR does not exist)"; exit 0; }
export SLURM_CONF="$DIR/etc/slurm.conf"

pid_of() { [ -s "$DIR/run/$1.pid" ] && cat "$DIR/run/$1.pid"; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

stop() {  # stop NAME: TERM the daemon in DIR/run/NAME.pid, wait, then KILL
  local pid
  pid=$(pid_of "$1") || return 0
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 60); do alive "$pid" || { log "stopped $1 ($pid)"; return 0; }; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null
  log "killed $1 ($pid)"
}

# 1. cancel the cluster's jobs while slurmctld still runs, and wait for them to end
if alive "$(pid_of slurmctld)"; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 1 30); do
      [ -z "$(squeue -h -t running,completing -o %i 2>/dev/null)" ] && break
      sleep 1
    done
  fi
fi

# 2. the daemons, clients first
stop slurmd
stop slurmctld
stop slurmdbd
stop mariadb
stop munged

# 3. anything a job of this cluster left behind: step daemons holding files in DIR, and
#    job processes whose environment names this cluster's config
for proc in /proc/[0-9]*; do
  pid=${proc#/proc/}
  [ "$pid" = $$ ] && continue
  comm=$(cat "$proc/comm" 2>/dev/null) || continue
  hit=0
  if [ "$comm" = slurmstepd ]; then
    for fd in "$proc"/fd/*; do
      case "$(readlink "$fd" 2>/dev/null)" in "$DIR"/*) hit=1; break ;; esac
    done
  else
    env=$( { tr '\0' '\n' < "$proc/environ"; } 2>/dev/null ) || continue
    if grep -qx "SLURM_CONF=$SLURM_CONF" <<< "$env" && grep -q '^SLURM_JOB_ID=' <<< "$env"; then
      hit=1
    fi
  fi
  if [ "$hit" = 1 ]; then
    kill -KILL "$pid" 2>/dev/null && log "killed leftover $comm ($pid)"
  fi
done

# 4. munged's socket directory (see munge_sock_dir in slurm_up.sh)
for base in /run /tmp; do
  sock_dir="$base/fedrepro-munge-$(printf %s "$DIR" | md5sum | cut -c1-10)"
  [ -d "$sock_dir" ] && rm -rf "$sock_dir" && log "removed $sock_dir"
done

# 5. the link slurm_up.sh made at the default config location
SYS_CONF=/etc/slurm/slurm.conf
if [ -L "$SYS_CONF" ] && [ "$(readlink "$SYS_CONF")" = "$DIR/etc/slurm.conf" ]; then
  rm -f "$SYS_CONF" && log "removed $SYS_CONF"
fi

if [ "$KEEP" = 0 ]; then
  rm -rf "$DIR"
  log "removed $DIR"
fi
exit 0
