#!/usr/bin/env bash
# Start a real single-node SLURM cluster on this host from Debian's packages: munge,
# MariaDB + slurmdbd (job accounting), slurmctld and slurmd, with partitions over this
# node sized by its real CPUs and memory (`slurmd -C`). Used by tests/test_slurm.py and
# for trying workflow/profiles/slurm on a workstation. Stop it with slurm_down.sh.
#
#   bash workflow/scripts/slurm_up.sh [--dir DIR] [--account NAME] [--partitions "cpu gpu"]
#                                     [--gpus N] [--no-accounting]
#   eval "$(bash workflow/scripts/slurm_up.sh ...)"     # sets SLURM_CONF for sbatch/sacct/...
#
# Everything (config, spool, logs, database, munge key, pid files) lives in DIR (default
# $FEDREPRO_SLURM_DIR or /tmp/fedrepro-slurm); no system service is started. Outside DIR
# there are only a link /etc/slurm/slurm.conf -> DIR/etc/slurm.conf (commands inside jobs
# need the default location; an existing config of the host is never replaced: the script
# stops instead) and munged's socket directory /run/fedrepro-munge-<hash> (munged wants a
# socket path every user can traverse). It prints SLURM_CONF as an export line.
#
# Why slurmdbd: snakemake-executor-plugin-slurm (2.8) polls job states with `sacct`
# unless told otherwise (workflow/profiles/slurm tells it to use squeue), and checks the
# account given in slurm_account with `sacctmgr` (then `sshare`). Without an accounting
# database, `sacct` answers "Slurm accounting storage is disabled" and a workflow using
# it never sees its jobs finish. The accounting database also lets the tests read each
# job's partition, account, allocated CPUs/memory/GPUs and time limit back with sacct,
# and enforces accounts (AccountingStorageEnforce=associations). --no-accounting starts
# no database: use `--slurm-status-command squeue` then (MinJobAge is 600 s here).
#
# --gpus N declares N GPUs (gres/gpu) on the node. On a node with /dev/nvidia* they are
# bound to those devices; elsewhere they are count-only placeholders so that jobs
# submitted with --gpus=1 are scheduled (the job then runs on the CPU).
#
# Packages are installed with apt-get when missing (root only). Exit status: 0 when the
# node is idle; 3 when the packages are missing and cannot be installed (not root, no
# apt, no mirror); 1 on any other failure (see DIR/log/).
set -euo pipefail

DIR=${FEDREPRO_SLURM_DIR:-/tmp/fedrepro-slurm}
ACCOUNT=fedrepro
PARTITIONS="cpu gpu"
GPUS=0
ACCOUNTING=1
PORT_BASE=${FEDREPRO_SLURM_PORT_BASE:-6817}   # slurmctld, slurmd, slurmdbd, MariaDB = base .. base+3
TIMEOUT=${FEDREPRO_SLURM_TIMEOUT:-120}        # seconds to wait for each daemon

while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --account) ACCOUNT=$2; shift 2 ;;
    --partitions) PARTITIONS=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --no-accounting) ACCOUNTING=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 0 ;;
    *) echo "slurm_up: unknown option $1" >&2; exit 1 ;;
  esac
done

DIR=$(realpath -m "$DIR")
log() { echo "[slurm_up] $*" >&2; }
# the directory of munged's socket for state dir $1 (slurm_down.sh computes the same)
munge_sock_dir() {
  local base=/run
  [ -d /run ] && [ -w /run ] || base=/tmp
  echo "$base/fedrepro-munge-$(printf %s "$1" | md5sum | cut -c1-10)"
}
die() { log "ERROR: $*"; exit 1; }

# ------------------------------------------------------------------ packages
need_cmds=(slurmctld slurmd sbatch squeue sinfo scontrol scancel sacct munged munge)
pkgs=(slurm-wlm slurm-client munge)
if [ "$ACCOUNTING" = 1 ]; then
  need_cmds+=(slurmdbd sacctmgr mariadbd mariadb-install-db mariadb)
  pkgs+=(slurmdbd mariadb-server mariadb-client)
fi
export PATH="$PATH:/usr/sbin:/sbin"
missing=()
for c in "${need_cmds[@]}"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing ${missing[*]} and not root: cannot install ${pkgs[*]}"; exit 3
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "missing ${missing[*]} and no apt-get: cannot install ${pkgs[*]}"; exit 3
  fi
  log "installing ${pkgs[*]} (for ${missing[*]})"
  # Keep the packages' maintainer scripts from starting system services.
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && guard=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  APT_LOG=$(mktemp)
  ok=0
  apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$APT_LOG" 2>&1 && ok=1
  if [ "$ok" = 0 ]; then
    apt-get update -q >>"$APT_LOG" 2>&1 \
      && apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$APT_LOG" 2>&1 && ok=1
  fi
  [ -n "$guard" ] && rm -f /usr/sbin/policy-rc.d
  if [ "$ok" = 0 ]; then
    log "apt-get could not install ${pkgs[*]}:"; tail -5 "$APT_LOG" >&2; rm -f "$APT_LOG"; exit 3
  fi
  rm -f "$APT_LOG"
fi
[ "$(id -u)" = 0 ] || { log "the daemons run as root (SlurmUser=root); run this as root"; exit 3; }

# ------------------------------------------------------------------ already up?
export SLURM_CONF="$DIR/etc/slurm.conf"
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/slurmd.pid"; then
  log "already running (state in $DIR)"
  echo "export SLURM_CONF=$SLURM_CONF"
  exit 0
fi
[ -e "$DIR" ] && { log "removing stale state in $DIR"; bash "$(dirname "$0")/slurm_down.sh" --dir "$DIR" >&2 || true; }

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in $(seq "$PORT_BASE" $((PORT_BASE + 3))); do
  port_busy "$p" && die "port $p is in use (another SLURM or database?); set FEDREPRO_SLURM_PORT_BASE"
done
CTLD_PORT=$PORT_BASE; SLURMD_PORT=$((PORT_BASE + 1)); DBD_PORT=$((PORT_BASE + 2)); DB_PORT=$((PORT_BASE + 3))

mkdir -p "$DIR"/{etc,run,log,spool/ctld,spool/d,munge}
chmod 755 "$DIR" "$DIR/run"
chmod 700 "$DIR/munge"

wait_for() {  # wait_for DESCRIPTION COMMAND...: retry COMMAND until it succeeds or TIMEOUT
  local what=$1; shift
  local t0=$SECONDS
  until "$@" >/dev/null 2>&1; do
    if [ $((SECONDS - t0)) -ge "$TIMEOUT" ]; then
      log "timed out waiting for $what; logs:"; tail -n 20 "$DIR"/log/*.log >&2 || true
      exit 1
    fi
    sleep 1
  done
}

# ------------------------------------------------------------------ munge
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/munge/munge.key"
# munged wants every directory above its socket to be searchable by all, which DIR (e.g.
# under pytest's private tmp) need not be: the socket gets a directory of its own.
SOCK_DIR=$(munge_sock_dir "$DIR")
mkdir -p "$SOCK_DIR" && chmod 755 "$SOCK_DIR"
MUNGE_SOCKET="$SOCK_DIR/munge.socket"
munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" --log-file="$DIR/log/munged.log" \
  --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/munged.seed" --num-threads=10 \
  || die "munged did not start (see $DIR/log/munged.log)"
wait_for munged bash -c "munge -n -S '$MUNGE_SOCKET' | unmunge -S '$MUNGE_SOCKET'"
log "munged up ($MUNGE_SOCKET)"

# ------------------------------------------------------------------ node description
HOST=$(hostname -s)
# slurmd -C prints this host's real layout, e.g.
#   NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
NODE_LINE=$(slurmd -C | head -n 1)
case "$NODE_LINE" in NodeName=*) ;; *) die "unexpected 'slurmd -C' output: $NODE_LINE" ;; esac
NODE_LINE=$(echo "$NODE_LINE" | sed "s/^NodeName=[^ ]*/NodeName=$HOST/")

GRES_LINES=""
NODE_GRES=""
if [ "$GPUS" -gt 0 ]; then
  GRES_LINES="GresTypes=gpu"
  NODE_GRES=" Gres=gpu:$GPUS"
  if [ -e /dev/nvidia0 ]; then
    echo "NodeName=$HOST Name=gpu File=/dev/nvidia[0-$((GPUS - 1))]" > "$DIR/etc/gres.conf"
  else
    # Placeholders: slurmd drops a GPU without a device file, so give each one a
    # character device of its own (a copy of /dev/null) in DIR/dev.
    mkdir -p "$DIR/dev"
    for i in $(seq 0 $((GPUS - 1))); do
      mknod "$DIR/dev/fakegpu$i" c 1 3 || die "mknod $DIR/dev/fakegpu$i failed"
    done
    echo "NodeName=$HOST Name=gpu File=$DIR/dev/fakegpu[0-$((GPUS - 1))]" > "$DIR/etc/gres.conf"
  fi
else
  : > "$DIR/etc/gres.conf"
fi

if [ "$ACCOUNTING" = 1 ]; then
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET
AccountingStorageEnforce=associations
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment,job_script"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none"
fi

read -r -a parts <<< "$PARTITIONS"
PART_LINES=""
for i in "${!parts[@]}"; do
  default=NO; [ "$i" = 0 ] && default=YES
  PART_LINES+="PartitionName=${parts[$i]} Nodes=$HOST Default=$default MaxTime=INFINITE State=UP"$'\n'
done

cat > "$DIR/etc/slurm.conf" <<EOF
# Written by fedrepro's workflow/scripts/slurm_up.sh: a single-node test cluster.
ClusterName=fedrepro
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: processes are tracked through /proc, tasks are not pinned
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
# reject at submission a job no node of its partition can ever run (instead of pending forever)
EnforcePartLimits=ALL
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
JobCompType=jobcomp/none
# finished jobs stay visible to squeue for 10 minutes (the plugin's squeue mode needs >= 120 s)
MinJobAge=600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
$ACCT_LINES
$GRES_LINES
$NODE_LINE$NODE_GRES State=UNKNOWN
$PART_LINES
EOF

# Client commands inside jobs must find the config without SLURM_CONF: the executor
# plugin's job step drops every SLURM_* variable before it calls `srun`. So the default
# location, /etc/slurm/slurm.conf, links to this file (never replacing someone else's).
SYS_CONF=/etc/slurm/slurm.conf
if [ -L "$SYS_CONF" ] && [ ! -e "$SYS_CONF" ]; then
  rm -f "$SYS_CONF"   # a dangling link left by an earlier run
elif [ -e "$SYS_CONF" ]; then
  if ! grep -q "Written by fedrepro's workflow/scripts/slurm_up.sh" "$SYS_CONF" 2>/dev/null; then
    die "$SYS_CONF exists and was not written by this script: this host has its own SLURM configuration"
  fi
  rm -f "$SYS_CONF"
fi
mkdir -p /etc/slurm
ln -s "$DIR/etc/slurm.conf" "$SYS_CONF"

# ------------------------------------------------------------------ MariaDB + slurmdbd
if [ "$ACCOUNTING" = 1 ]; then
  mkdir -p "$DIR/mysql"
  mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=normal \
    --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $DIR/log/mariadb-install.log)"
  MYSQL_SOCKET="$DIR/run/mysqld.sock"
  (setsid mariadbd --no-defaults --user=root --datadir="$DIR/mysql" --socket="$MYSQL_SOCKET" \
     --bind-address=127.0.0.1 --port="$DB_PORT" --pid-file="$DIR/run/mariadb.pid" \
     --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=64M --skip-name-resolve \
     </dev/null >/dev/null 2>&1 &)
  wait_for MariaDB mariadb --no-defaults -uroot --socket="$MYSQL_SOCKET" -e "SELECT 1"
  DB_PASS=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
  mariadb --no-defaults -uroot --socket="$MYSQL_SOCKET" <<EOF
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE DATABASE slurm_acct_db;
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
  log "MariaDB up (127.0.0.1:$DB_PORT)"
  cat > "$DIR/etc/slurmdbd.conf" <<EOF
# Written by fedrepro's workflow/scripts/slurm_up.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"   # slurmdbd refuses a config others can read
  slurmdbd || die "slurmdbd did not start (see $DIR/log/slurmdbd.log)"
  wait_for slurmdbd sacctmgr -n list cluster
  sacctmgr -i add cluster fedrepro >/dev/null
  sacctmgr -i add account "$ACCOUNT" Description="fedrepro test account" Organization=fedrepro >/dev/null
  sacctmgr -i add user "$(id -un)" Account="$ACCOUNT" DefaultAccount="$ACCOUNT" >/dev/null
  log "slurmdbd up (port $DBD_PORT), account '$ACCOUNT' for user $(id -un)"
fi

# ------------------------------------------------------------------ slurmctld + slurmd
slurmctld -c || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
wait_for slurmctld scontrol ping
slurmd -N "$HOST" || die "slurmd did not start (see $DIR/log/slurmd.log)"
node_idle() { [ "$(sinfo -h -n "$HOST" -o %T | sort -u | head -n 1)" = idle ]; }
wait_for "node $HOST to become idle" node_idle
log "cluster up: $(sinfo -h -o '%P %D %c cpus %m MB %G %T' | tr '\n' ';')"
echo "export SLURM_CONF=$SLURM_CONF"
