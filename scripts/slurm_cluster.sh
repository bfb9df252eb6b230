#!/usr/bin/env bash
# A one-node SLURM cluster on localhost for the tests (Debian packages, run as root).
#   bash scripts/slurm_cluster.sh start   install if needed, configure, start; prints status
#   bash scripts/slurm_cluster.sh stop    stop exactly the daemons this script started
# State lives in $SLURM_TEST_ROOT (default /tmp/automodel-slurm); a fresh start wipes it, so
# job ids restart at 1 (tests use a fresh submitit folder per test).
set -euo pipefail
ROOT=${SLURM_TEST_ROOT:-/tmp/automodel-slurm}
PIDS=$ROOT/pids
CONF=/etc/slurm

stop() {
  if [ -f "$PIDS" ]; then
    tac "$PIDS" | while read -r pid name; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    tac "$PIDS" | while read -r pid name; do kill -9 "$pid" 2>/dev/null || true; done
    rm -f "$PIDS"
  fi
}

wait_for() {  # wait_for SECONDS CMD...
  local limit=$1; shift
  for _ in $(seq 1 $((limit * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "slurm_cluster: timed out waiting for: $*" >&2; return 1
}

start() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge \
      slurmdbd mariadb-server >/dev/null
  fi
  stop
  rm -rf "$ROOT"; mkdir -p "$ROOT"/{state,spool,log,db,run} "$CONF"
  : > "$PIDS"

  # munge: a key, then the daemon as its own user
  [ -s /etc/munge/munge.key ] || (mungekey --create --force 2>/dev/null || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null)
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge; chown munge:munge /run/munge /var/log/munge /var/lib/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid --socket=/run/munge/munge.socket.2
  wait_for 10 test -s /run/munge/munged.pid; echo "$(cat /run/munge/munged.pid) munged" >> "$PIDS"

  # mariadb for slurmdbd (sacct: submitit reads job states from it)
  mkdir -p "$ROOT/mysqlrun"; chown -R mysql:mysql "$ROOT/db" "$ROOT/mysqlrun"
  mariadb-install-db --user=mysql --datadir="$ROOT/db" >/dev/null 2>&1
  /usr/sbin/mariadbd --user=mysql --datadir="$ROOT/db" --socket="$ROOT/mysqlrun/mysql.sock" \
    --pid-file="$ROOT/mysqlrun/mysql.pid" --skip-networking=0 --bind-address=127.0.0.1 --port=3307 \
    >"$ROOT/log/mariadb.log" 2>&1 &
  echo "$! mariadbd" >> "$PIDS"
  wait_for 30 mariadb --socket="$ROOT/mysqlrun/mysql.sock" -e "select 1"
  mariadb --socket="$ROOT/mysqlrun/mysql.sock" -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm'; CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"

  local cpus mem
  cpus=$(nproc); mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat > "$CONF/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
CONF
  chmod 600 "$CONF/slurmdbd.conf"
  cat > "$CONF/slurm.conf" <<CONF
ClusterName=automodel
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
KillWait=2
InactiveLimit=0
MinJobAge=300
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd.log
NodeName=localhost CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

  /usr/sbin/slurmdbd -D >"$ROOT/log/slurmdbd.out" 2>&1 &
  echo "$! slurmdbd" >> "$PIDS"
  wait_for 30 sacctmgr -i list cluster
  sacctmgr -i add cluster automodel >/dev/null 2>&1 || true
  /usr/sbin/slurmctld -D -i >"$ROOT/log/slurmctld.out" 2>&1 &
  echo "$! slurmctld" >> "$PIDS"
  wait_for 30 scontrol ping
  /usr/sbin/slurmd -D -N localhost >"$ROOT/log/slurmd.out" 2>&1 &
  echo "$! slurmd" >> "$PIDS"
  wait_for 30 bash -c "sinfo -h -o %t | grep -q idle"
  sinfo
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
