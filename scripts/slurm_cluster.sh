#!/usr/bin/env bash
# A SLURM cluster on this one machine for the tests (Debian packages, run as root):
# - node `localhost`, partition `debug` (the default): the controller's own network;
# - nodes `node1` and `node2`, partition `two`: each in its own network namespace and hostname
#   (UTS namespace), with its own slurmd, joined to the controller by a virtual network that
#   this script creates and removes (bridge $BRIDGE, $NET.1 the controller, $NET.11 and
#   $NET.12 the nodes, names in /etc/hosts). Ranks on node1 and node2 talk over that network
#   only, so address and interface bugs show up.
#   bash scripts/slurm_cluster.sh start   install if needed, configure, start; prints status
#   bash scripts/slurm_cluster.sh stop    stop exactly what this script started, remove the
#                                         namespaces, the bridge and the /etc/hosts lines
# Without the rights to make namespaces (no CAP_NET_ADMIN), start says so and starts the
# one-node part only; the two-node tests then fail (or skip outside CI) with that message.
# State lives in $SLURM_TEST_ROOT (default /tmp/automodel-slurm); a fresh start wipes it, so
# job ids restart at 1 (tests use a fresh submitit folder per test).
set -euo pipefail
ROOT=${SLURM_TEST_ROOT:-/tmp/automodel-slurm}
PIDS=$ROOT/pids
CONF=/etc/slurm
NET=${SLURM_TEST_NET:-10.210.0}  # the virtual network's /24
BRIDGE=amslurm0
HOSTS_MARK="# automodel-slurm-cluster"
NODES="node1 node2"

stop() {
  if [ -f "$PIDS" ]; then
    tac "$PIDS" | while read -r pid name; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    tac "$PIDS" | while read -r pid name; do kill -9 "$pid" 2>/dev/null || true; done
    rm -f "$PIDS"
  fi
  net_down
}

ns_of() { echo "amslurm-$1"; }

net_down() {
  local node ns
  for node in $NODES; do
    ns=$(ns_of "$node")
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      # whatever still runs in the namespace (a job's task) goes with it
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
    grep -v "$HOSTS_MARK" /etc/hosts > /etc/hosts.amslurm && cat /etc/hosts.amslurm > /etc/hosts
    rm -f /etc/hosts.amslurm
  fi
}

net_up() {  # the bridge, a namespace and veth pair per node, the names; 1 if not allowed
  local i=0 node ns
  ip link add "$BRIDGE" type bridge 2>/dev/null || return 1
  ip addr add "$NET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up
  for node in $NODES; do
    i=$((i + 1)); ns=$(ns_of "$node")
    ip netns add "$ns" || return 1
    ip link add "amslurm-v$i" type veth peer name am0 netns "$ns" || return 1
    ip link set "amslurm-v$i" master "$BRIDGE" up
    ip netns exec "$ns" ip addr add "$NET.1$i/24" dev am0
    ip netns exec "$ns" ip link set am0 up
    ip netns exec "$ns" ip link set lo up
    echo "$NET.1$i $node $HOSTS_MARK" >> /etc/hosts
  done
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
  rm -rf "$ROOT"; mkdir -p "$ROOT"/{state,log,db,run} "$ROOT"/spool/{localhost,node1,node2} "$CONF"
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

  local cpus mem ctl="localhost" two=""
  cpus=$(nproc); mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  if net_up; then
    # the controller at its address on the virtual network: the nodes' srun reach it there.
    # (The two nodes come first in slurm.conf: slurmctld takes any name for a node called
    # localhost while it is the only node read, and would call node1 a duplicate of it.)
    ctl="$(hostname)($NET.1)"
    two="NodeName=node1 NodeAddr=$NET.11 CPUs=$cpus RealMemory=$((mem / 2)) State=UNKNOWN
NodeName=node2 NodeAddr=$NET.12 CPUs=$cpus RealMemory=$((mem / 2)) State=UNKNOWN
PartitionName=two Nodes=node1,node2 Default=NO MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
  else
    net_down
    echo "slurm_cluster: cannot create network namespaces here (ip netns / veth / bridge need" \
      "root with CAP_NET_ADMIN): starting the one-node part only, without partition 'two'" >&2
  fi
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
SlurmctldHost=$ctl
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
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
$two
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
  /usr/sbin/slurmd -D -N localhost >"$ROOT/log/slurmd-localhost.out" 2>&1 &
  echo "$! slurmd" >> "$PIDS"
  if [ -n "$two" ]; then
    local node
    for node in $NODES; do  # (its own network and hostname: what its tasks see too; nsenter,
      # not `ip netns exec`, which mounts a /sys without the cgroup tree slurmd reads)
      nsenter --net="/run/netns/$(ns_of "$node")" unshare --uts sh -c \
        "hostname $node && exec /usr/sbin/slurmd -D -N $node" >"$ROOT/log/slurmd-$node.out" 2>&1 &
      echo "$! slurmd-$node" >> "$PIDS"
    done
    wait_for 30 bash -c "[ \$(sinfo -h -N -o %t | grep -c idle) -ge 3 ]"
  fi
  wait_for 30 bash -c "sinfo -h -o %t | grep -q idle"
  sinfo
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
