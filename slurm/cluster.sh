#!/usr/bin/env bash
# A private SLURM cluster of two nodes on this machine (munged + slurmctld + one slurmd per node) for preempt's
# tests, started by hand.
#
#   slurm/cluster.sh start    install the Debian packages if missing, configure, start, wait for the nodes to be idle
#   slurm/cluster.sh stop     cancel every job, wait for them to end, stop the daemons by their recorded PIDs
#   slurm/cluster.sh status   exit 0 when the cluster answers and the slurmd of each node runs, 1 when not
#   slurm/cluster.sh env      print the line to eval for the client commands: export SLURM_CONF=...
#
# Everything (configuration, munge key and socket, state, spool, PID files, logs, job output) lives under
# $PREEMPT_SLURM_DIR (default /tmp/preempt-slurm), and the daemons listen on non-default ports
# ($PREEMPT_SLURM_PORT for slurmctld, the next ones for the slurmds; default 46817), so the cluster collides neither
# with a system SLURM nor with another copy started from another directory and port. Clients find it through
# SLURM_CONF=$PREEMPT_SLURM_DIR/slurm.conf (sbatch exports it into the jobs, so scontrol works inside them).
#
# Needs root (SlurmUser=root; slurmd starts jobs as their user) and no systemd: the daemons are started directly.
# Nothing is ever killed by name: stop signals only the PIDs the daemons recorded in their PID files, and only
# when that process still runs the daemon's binary with our configuration.
#
# Settings chosen for tests (each a measured fact on Debian 12, Slurm 22.05, munge 0.5.15):
#   ProctrackType=proctrack/pgid   with linuxproc, job processes re-parented to init survived their job
#   AuthInfo=...,cred_expire=5     a requeued job waits cred_expire s (default 120) before it may start again
#   KillWait=5                     SIGTERM -> SIGKILL grace of requeue, scancel and the time limit (default 30)
#   UnkillableStepProgram          writes $DIR/log/unkillable.JOBID.*.txt (ps of every process) when a step's
#                                  processes outlive SIGKILL by UnkillableStepTimeout (60 s, the default)
#   MinJobAge=86400                finished jobs stay visible to `scontrol show job` for a day, longer than any run
#                                  of the tests (with the default, 300 s, a job that ended early in a slow run was gone
#                                  when its test asked: "Invalid job id specified"; 0, "never purge" in the manual, is
#                                  refused by this slurmctld: "MinJobAge must be at least 2", and it purges at 2 s)
#   OverSubscribe=FORCE:4          up to 4 jobs per CPU: the test jobs mostly sleep, and run side by side
#
# The nodes (n1, n2, ...; $PREEMPT_SLURM_NODES of them, default 2) are slurmds of their own on this host
# (Debian's slurmd runs one daemon per node name with -N): each has its own port, spool directory, PID file and
# log (the %n in slurm.conf), all with this host's address, CPUs and memory. So a job with --nodes=2 gets two
# nodes whose job steps are started by two daemons, as on a real cluster, while sharing one kernel: the nodes
# see each other's loopback, and a rendezvous port must not collide between jobs.
set -euo pipefail

DIR=${PREEMPT_SLURM_DIR:-/tmp/preempt-slurm}
PORT=${PREEMPT_SLURM_PORT:-46817}
NODES=${PREEMPT_SLURM_NODES:-2}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

say() { echo "cluster.sh: $*" >&2; }

[[ $NODES =~ ^[1-9][0-9]?$ ]] || { say "PREEMPT_SLURM_NODES: expected a number of nodes from 1 to 99, found '$NODES'"; exit 2; }

node_names() { seq -f 'n%g' 1 "$NODES"; }

# The PID in FILE when that process is alive, is BINARY (argv[0]; Debian runs slurmctld as slurmctld-wlm) and
# was started on this cluster's files (its arguments name $DIR): a PID reused by another process is never ours.
live_pid() {
    local file=$1 binary=$2 pid argv0 args
    [[ -s $file ]] || return 1
    pid=$(tr -dc 0-9 <"$file")
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    args=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)
    argv0=${args%% *}
    [[ $(basename "$argv0") == "$binary" && $args == *"$DIR/"* ]] || return 1
    echo "$pid"
}

running() { answering && [[ $(slurmd_pids | wc -l) == "$NODES" ]]; }

answering() { [[ -f $CONF ]] && command -v scontrol >/dev/null && timeout 5 scontrol ping >/dev/null 2>&1; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
        command -v munged >/dev/null && command -v mungekey >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || { say "slurm or munge is missing and there is no apt-get to install them"; exit 1; }
    say "installing slurmctld slurmd slurm-client munge (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 || {
        apt-get update -q >/dev/null 2>&1
        apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
    }
}

configure() {
    local host node hardware n i=0
    host=$(hostname -s)
    # "NodeName=h CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    node=$(slurmd -C 2>/dev/null | head -n 1)
    [[ $node == NodeName=* ]] || { say "slurmd -C did not describe this machine: $node"; exit 1; }
    hardware=${node#NodeName=* }
    mkdir -p "$DIR"/{munge,state,log}
    for n in $(node_names); do mkdir -p "$DIR/spool/$n"; done
    # munged refuses a socket directory that others can write to, or whose parents are not 755.
    chmod 755 "$DIR" "$DIR/munge"
    if [[ ! -s $DIR/munge/munge.key ]]; then
        mungekey -c -k "$DIR/munge/munge.key"
    fi
    chmod 600 "$DIR/munge/munge.key"
    cat >"$CONF" <<EOF
# Written by slurm/cluster.sh; rewritten at every start.
ClusterName=preempt
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
KillWait=5
UnkillableStepTimeout=60
UnkillableStepProgram=$DIR/unkillable.sh
MinJobAge=86400
ReturnToService=2
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
    # What a step's processes were doing when SIGKILL did not end them within UnkillableStepTimeout (the node is
    # drained "Kill task failed" then): every process, its group, state and kernel wait, for the tests' failure message.
    cat >"$DIR/unkillable.sh" <<EOF
#!/bin/sh
out=$DIR/log/unkillable.\${SLURM_JOB_ID:-unknown}.\$(date +%Y%m%dT%H%M%S).\$\$.txt
{ date; env | grep '^SLURM' | sort; ps -eo pid,ppid,pgid,sid,stat,wchan:32,etimes,args; } >"\$out" 2>&1
EOF
    chmod 755 "$DIR/unkillable.sh"
    for n in $(node_names); do
        i=$((i + 1))
        echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + i)) $hardware State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=test Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >>"$CONF"
}

# Waits until every node is up (idle, or already running jobs).
wait_idle() {
    local i states up
    for i in $(seq 1 150); do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
        up=$(grep -cE ' (idle|mixed|allocated)' <<<"$states" || true)
        [[ $up == "$NODES" ]] && return 0
        sleep 0.2
    done
    say "the nodes did not become idle within 30 s (${states:-no answer}); see $DIR/log/"
    return 1
}

# The slurmds that are alive, one PID per line.
slurmd_pids() {
    local n
    for n in $(node_names); do live_pid "$DIR/slurmd.$n.pid" slurmd || true; done
}

start() {
    if running; then
        say "already running ($DIR)"
        return 0
    fi
    [[ $(id -u) == 0 ]] || { say "needs root (SlurmUser=root and slurmd starts jobs as their user)"; exit 1; }
    install
    stop_daemons
    configure
    live_pid "$DIR/munge/munged.pid" munged >/dev/null ||
        munged -S "$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
            --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    # -c: forget the jobs of an earlier start; -i: ignore unreadable state files
    slurmctld -c -i -f "$CONF"
    for n in $(node_names); do slurmd -f "$CONF" -N "$n"; done
    wait_idle
    echo "export SLURM_CONF=$CONF" >"$DIR/env"
    say "running: $(sinfo -h -N -o '%N %T %c CPUs' | paste -sd ',' -) (SLURM_CONF=$CONF)"
}

# Sends SIGTERM to the PIDs and waits for all of them to exit; SIGKILLs what is left after 10 s.
# (Each daemon takes ~2 s to shut down, so they are stopped together.)
stop_pids() {
    local pid i left
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for i in $(seq 1 100); do
        left=()
        for pid in "$@"; do [[ -d /proc/$pid ]] && left+=("$pid"); done
        [[ ${#left[@]} == 0 ]] && return 0
        sleep 0.1
    done
    say "PIDs ${left[*]} did not stop within 10 s; killing them"
    kill -KILL "${left[@]}" 2>/dev/null || true
}

stop_daemons() {
    local pid pids
    mapfile -t pids < <(slurmd_pids)
    if pid=$(live_pid "$DIR/slurmd.pid" slurmd); then pids+=("$pid"); fi  # the one node of an older cluster.sh
    if pid=$(live_pid "$DIR/slurmctld.pid" slurmctld); then pids+=("$pid"); fi
    [[ ${#pids[@]} == 0 ]] || stop_pids "${pids[@]}"
    # munge last: the slurm daemons authenticate their last messages with it
    if pid=$(live_pid "$DIR/munge/munged.pid" munged); then stop_pids "$pid"; fi
}

# Cancels every job and waits up to 10 s for them to leave; SIGKILLs what a job script kept alive.
cancel_all() {
    local jobs i
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    [[ -n $jobs ]] || return 0
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for i in $(seq 1 50); do  # KillWait (5 s) and the epilog
        [[ -z $(squeue -h -o %A 2>/dev/null) ]] && return 0
        sleep 0.2
    done
    # A job that requeues itself on SIGTERM (an older preempt, a script of one's own) comes back: kill it.
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    # shellcheck disable=SC2086
    [[ -z $jobs ]] || { scancel --full --signal=KILL $jobs 2>/dev/null; scancel $jobs 2>/dev/null; } || true
    for i in $(seq 1 50); do
        [[ -z $(squeue -h -o %A 2>/dev/null) ]] && return 0
        sleep 0.2
    done
    say "jobs still listed after cancelling: $(squeue -h -o '%A %T' | tr '\n' ' ')"
}

stop() {
    if answering; then
        cancel_all
    fi
    stop_daemons
    rm -f "$DIR/env"
    say "stopped ($DIR)"
}

case ${1:-} in
start) start ;;
stop) stop ;;
status) running ;;
env) echo "export SLURM_CONF=$CONF" ;;
*)
    echo "usage: $0 start|stop|status|env   (state in \$PREEMPT_SLURM_DIR, default /tmp/preempt-slurm)" >&2
    exit 2
    ;;
esac
