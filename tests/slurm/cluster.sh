#!/usr/bin/env bash
# A real one-node SLURM cluster on localhost for tests: Debian's slurm-wlm + munge, with slurmdbd on a
# private MariaDB so that `sacct` works.
#
#   tests/slurm/cluster.sh start    install (apt) if needed, write the config, start, health-check
#   tests/slurm/cluster.sh status   exit 0 when the cluster answers and its node is usable
#   tests/slurm/cluster.sh stop     stop exactly the daemons `start` recorded
#   tests/slurm/cluster.sh env      print the SLURM_CONF line clients need
#
# Needs root and apt (Debian 12: slurm-wlm 22.05). No systemd: the daemons are started directly and
# their PIDs recorded in $EFFLAB_SLURM_DIR/pids; `stop` signals those PIDs and no others. Every wait
# is bounded, every client call runs under `timeout`. Idempotent: `start` on a healthy cluster only
# checks it, `stop` on a stopped one does nothing. The config lives in $EFFLAB_SLURM_DIR (default
# /tmp/efflab-slurm); clients find it through SLURM_CONF, and job steps through a symlink
# /etc/slurm/slurm.conf made only where none exists and removed by `stop`: the Snakemake SLURM executor
# runs each job's `srun` with every SLURM_* variable stripped, so there it reads the default path.
set -euo pipefail

STATE=${EFFLAB_SLURM_DIR:-/tmp/efflab-slurm}
CONF=$STATE/slurm.conf
PIDS=$STATE/pids
ETC_CONF=/etc/slurm/slurm.conf
DB=$STATE/db  # owned by mysql: mariadbd writes its socket, pid and log here
DB_SOCKET=$DB/mysqld.sock
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
export SLURM_CONF=$CONF

say() { echo "cluster.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds or time runs out.
wait_for() {
    local limit=$1 what=$2; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what"
        sleep 0.2
    done
}

install_packages() {
    local missing=()
    for bin in slurmctld slurmd sbatch sacct munged slurmdbd mariadbd; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    ((${#missing[@]} == 0)) && return
    [[ $EUID == 0 ]] || die "not root: cannot install ${PACKAGES[*]}"
    command -v apt-get >/dev/null || die "apt-get not found: install ${PACKAGES[*]} yourself"
    say "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    # Without systemd the packages' init scripts must not start services we then do not own.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && added_policy=1
    fi
    local apt=(timeout 600 apt-get install -y -q --no-install-recommends "${PACKAGES[@]}")
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" >"$STATE/apt.log" 2>&1 ||
        { timeout 300 apt-get update -q >>"$STATE/apt.log" 2>&1 &&
          DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>"$STATE/apt.log" 2>&1; } ||
        { ((added_policy)) && rm -f "$policy"; die "apt-get install failed, see $STATE/apt.log"; }
    ((added_policy)) && rm -f "$policy"
    return 0
}

write_config() {
    local hw name mem cpus
    hw=$(slurmd -C | head -1) || die "slurmd -C failed"
    name=$(sed -n 's/.*NodeName=\([^ ]*\).*/\1/p' <<<"$hw")
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    cpus=${EFFLAB_SLURM_CPUS:-$((2 * $(nproc)))}
    mkdir -p "$STATE"/{ctld,spool,log}
    cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh: one node, no cgroups, accounting through slurmdbd.
ClusterName=efflab
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job with no --mem takes the whole node and jobs run one at a time.
DefMemPerCPU=512
ReturnToService=2
SchedulerType=sched/backfill
MinJobAge=300
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
# Twice the real cores by default (EFFLAB_SLURM_CPUS): two jobs overlap their start-up and the executor's
# status-poll waits; a job's own thread count, and so its numbers, do not change.
SlurmdParameters=config_overrides
NodeName=$name NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$STATE/slurmdbd.conf"
    if [[ ! -L $ETC_CONF || $(readlink "$ETC_CONF") != "$CONF" ]]; then
        [[ -e $ETC_CONF ]] && die "$ETC_CONF exists: job steps would read it instead of $CONF"
        mkdir -p "$(dirname "$ETC_CONF")" && ln -s "$CONF" "$ETC_CONF"
    fi
}

record() { echo "$1 $2" >>"$PIDS"; }  # name pid

munge_ok() { timeout 5 munge -n </dev/null 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }
db_ok() { timeout 5 mariadb --socket="$DB_SOCKET" -u root -e "select 1" >/dev/null 2>&1; }
ctld_ok() { timeout 5 scontrol ping | grep -q 'is UP'; }
node_ok() { [[ $(timeout 5 sinfo -h -N -o %t | head -1) =~ ^(idle|mix|alloc)$ ]]; }
dbd_ok() { timeout 5 sacctmgr -n list cluster format=cluster | grep -q efflab; }

start_munge() {
    munge_ok && return  # a munged we did not start is fine to use, and not ours to stop
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- munged
    wait_for 10 munged munge_ok
    record munged "$(cat /run/munge/munged.pid)"
}

start_mariadb() {
    db_ok && return
    if [[ ! -d $DB/data/mysql ]]; then
        mkdir -p "$DB/data" && chown -R mysql:mysql "$DB"
        timeout 120 mariadb-install-db --user=mysql --datadir="$DB/data" --skip-test-db \
            --auth-root-authentication-method=socket >"$STATE/log/mariadb-install.log" 2>&1 ||
            die "mariadb-install-db failed, see $STATE/log/mariadb-install.log"
    fi
    setsid mariadbd --user=mysql --datadir="$DB/data" --socket="$DB_SOCKET" --skip-networking \
        --pid-file="$DB/mariadb.pid" --log-error="$DB/mariadb.log" </dev/null >/dev/null 2>&1 &
    record mariadbd $!
    wait_for 60 mariadb db_ok
}

start_slurm() {
    # slurmdbd reaches MariaDB by its socket (MYSQL_UNIX_PORT), so the database needs no TCP port.
    dbd_ok 2>/dev/null || {
        MYSQL_UNIX_PORT=$DB_SOCKET slurmdbd
        wait_for 20 slurmdbd test -s "$STATE/slurmdbd.pid"
        record slurmdbd "$(cat "$STATE/slurmdbd.pid")"
        wait_for 20 "slurmdbd to answer" timeout 5 sacctmgr -n list cluster
    }
    ctld_ok || {
        slurmctld
        wait_for 20 slurmctld test -s "$STATE/slurmctld.pid"
        record slurmctld "$(cat "$STATE/slurmctld.pid")"
        wait_for 30 "slurmctld to answer" ctld_ok
    }
    node_ok || {
        [[ -s $STATE/slurmd.pid ]] && kill -0 "$(cat "$STATE/slurmd.pid")" 2>/dev/null || {
            slurmd
            wait_for 20 slurmd test -s "$STATE/slurmd.pid"
            record slurmd "$(cat "$STATE/slurmd.pid")"
        }
        wait_for 30 "node to be idle" node_ok
    }
    wait_for 30 "cluster registration in slurmdbd" dbd_ok
}

cmd_start() {
    mkdir -p "$STATE"
    [[ -f $CONF ]] && cmd_status 2>/dev/null && { say "already running"; return; }
    [[ $EUID == 0 ]] || die "must run as root to start munged and the slurm daemons"
    install_packages
    write_config
    start_munge
    start_mariadb
    start_slurm
    say "up: $(timeout 5 sinfo -h -N -o '%N %t %c CPUs %m MB')"
}

cmd_status() {
    [[ -f $CONF && $(readlink "$ETC_CONF") == "$CONF" ]] || { say "not configured ($CONF, $ETC_CONF)"; return 1; }
    munge_ok || { say "munge does not answer"; return 1; }
    ctld_ok || { say "slurmctld does not answer"; return 1; }
    node_ok || { say "node not usable: $(timeout 5 sinfo -h -N -o '%t %E' 2>&1)"; return 1; }
    dbd_ok || { say "slurmdbd does not list the cluster"; return 1; }
    say "healthy: $(timeout 5 sinfo -h -N -o '%N %t')"
}

cmd_stop() {
    [[ -f $PIDS ]] || { say "nothing recorded, nothing to stop"; return; }
    local lines=() live=() name pid
    mapfile -t lines <"$PIDS"
    for ((i = ${#lines[@]} - 1; i >= 0; i--)); do  # reverse order of start; they shut down in parallel
        read -r name pid <<<"${lines[i]}"
        # Only a live process that is still the daemon we started (PIDs get reused).
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || continue
        kill -TERM "$pid" 2>/dev/null && live+=("$name:$pid")
    done
    local deadline=$((SECONDS + 15))
    for entry in "${live[@]}"; do
        name=${entry%%:*} pid=${entry##*:}
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && { say "$name ($pid) ignored SIGTERM; SIGKILL"; kill -KILL "$pid" || true; }
        say "stopped $name ($pid)"
    done
    rm -f "$PIDS" "$STATE"/{slurmctld,slurmd,slurmdbd}.pid "$DB/mariadb.pid"
    if [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]]; then rm -f "$ETC_CONF"; fi
}

case ${1:-} in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
env) echo "SLURM_CONF=$CONF" ;;
*) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
