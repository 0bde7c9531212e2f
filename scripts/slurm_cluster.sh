#!/usr/bin/env bash
# A real two-node Slurm cluster on this one host, for the Slurm target's tests
# (tests/slurm) and for trying `slipstream submit --target slurm` by hand.
#
#   scripts/slurm_cluster.sh start    # idempotent: munged, slurmctld, slurmd -N n1, slurmd -N n2
#   scripts/slurm_cluster.sh status   # sinfo, or exit 1 when the controller does not answer
#   scripts/slurm_cluster.sh stop     # kill the daemons, remove the state
#
# Everything lives under $SLIPSTREAM_SLURM_DIR (default /tmp/slipstream-slurm),
# munge's socket included, so a system Slurm or munge install is left alone.
# Clients find the cluster through SLURM_CONF=$SLIPSTREAM_SLURM_DIR/slurm.conf;
# when /etc/slurm/slurm.conf does not exist it is made a link to ours (removed
# by stop), so plain `sinfo`/`sbatch` work too.
#
# Both nodes are this host: NodeAddr=127.0.0.1, one slurmd per node on its own
# port (17001, 17002), with %n in the spool and pid paths. Needs root (slurmd
# runs jobs as their user) and the Debian packages slurm-wlm and munge.
set -euo pipefail

DIR="${SLIPSTREAM_SLURM_DIR:-/tmp/slipstream-slurm}"
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket.2"
MUNGE_KEY="$DIR/munge/munge.key"
CTLD_PORT="${SLIPSTREAM_SLURM_CTLD_PORT:-16817}"
START_TIMEOUT_S="${SLIPSTREAM_SLURM_START_TIMEOUT_S:-60}"
HOST="$(hostname -s)"
# Each node declares the host's CPUs (2 here); memory: what the host has, minus 1 GiB for the rest.
CPUS="$(nproc)"
MEM_MB="$(awk '/MemTotal/ { m = int($2 / 1024) - 1024; print (m > 1024 ? m : 1024) }' /proc/meminfo)"

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

write_conf() {
    mkdir -p "$DIR"/{ctld,spool,log,munge}
    chmod 700 "$DIR/munge"
    cat >"$CONF.tmp" <<EOF
# Written by scripts/slurm_cluster.sh: two nodes (n1, n2) on this host.
ClusterName=slipstream
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s + 1).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here (containers, shared host): plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
LaunchParameters=use_interactive_step
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# No database: finished jobs are written to a text log (and stay in squeue/scontrol for MinJobAge).
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
MinJobAge=600
# Requeue: preempted jobs go back to the queue (sbatch --requeue, scontrol requeue).
JobRequeue=1
ReturnToService=2
# Short timeouts, so the tests do not wait on the defaults (300 s, 10 s, 30 s).
SlurmctldTimeout=10
SlurmdTimeout=30
MessageTimeout=5
KillWait=10
InactiveLimit=0
Waittime=0
TCPTimeout=2
NodeName=n[1-2] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
    if [ ! -e /etc/slurm/slurm.conf ] && [ -d /etc/slurm ]; then
        ln -s "$CONF" /etc/slurm/slurm.conf
    fi
}

munge_ok() { munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munge() {
    munge_ok && return 0
    if [ ! -s "$MUNGE_KEY" ]; then
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        chmod 400 "$MUNGE_KEY"
    fi
    # As root munged wants --force; its own socket, pid, seed and log files.
    munged --force --socket="$MUNGE_SOCKET" --key-file="$MUNGE_KEY" \
        --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
        --log-file="$DIR/log/munged.log"
    for _ in $(seq 50); do munge_ok && return 0; sleep 0.1; done
    die "munged did not answer on $MUNGE_SOCKET (see $DIR/log/munged.log)"
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        || die "Slurm is not installed (apt-get install slurm-wlm munge)"
    [ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as their user)"
    write_conf
    export SLURM_CONF="$CONF"
    start_munge
    if ! alive "$DIR/slurmctld.pid"; then
        slurmctld -f "$CONF"
    else
        scontrol reconfigure >/dev/null 2>&1 || true
    fi
    for n in n1 n2; do
        mkdir -p "$DIR/spool/$n"
        alive "$DIR/slurmd.$n.pid" || slurmd -f "$CONF" -N "$n"
    done
    local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')"
        # Ready: both nodes answer (idle, or already running jobs).
        if [ "$(echo "$state" | grep -Eo 'n[12] (idle|mix|alloc|comp)' | wc -l)" = 2 ]; then
            echo "slurm cluster up: ${state}(SLURM_CONF=$CONF)"
            return 0
        fi
        # A node left down/drained by an earlier run comes back once its slurmd answers.
        if echo "$state" | grep -Eq 'down|drain'; then
            scontrol update nodename=n[1-2] state=resume >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    die "nodes not idle after ${START_TIMEOUT_S} s (sinfo: '${state:-no answer}'); logs in $DIR/log"
}

stop() {
    local pidfile pid
    # Jobs first, so no slurmstepd or training process outlives its slurmd.
    if [ -f "$CONF" ] && alive "$DIR/slurmctld.pid"; then
        SLURM_CONF="$CONF" timeout 10 scancel --full --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 40); do
            [ -z "$(SLURM_CONF="$CONF" timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    for pidfile in "$DIR"/slurmd.n1.pid "$DIR"/slurmd.n2.pid "$DIR"/slurmctld.pid "$DIR"/munge/munged.pid; do
        [ -s "$pidfile" ] || continue
        pid="$(cat "$pidfile")"
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
    if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF" ]; then
        rm -f /etc/slurm/slurm.conf
    fi
    rm -rf "$DIR"
    echo "slurm cluster stopped"
}

status() {
    [ -f "$CONF" ] || die "not started ($CONF missing)"
    SLURM_CONF="$CONF" sinfo -N -o '%N %t %c %m' || die "controller does not answer"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
