# Shared by up.sh and down.sh: paths, PID-file handling, waiting.  Sourced, not run.
# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source this

CLUSTER_NAME=swiftslurm
BASE=${SWIFTSLURM_CLUSTER_DIR:-/var/tmp/swiftslurm-cluster}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

RUN=$BASE/run          # PID files and sockets of the root-run daemons
LOG=$BASE/log
MUNGE_DIR=$BASE/munge  # owned by the munge user: key, seed, log, PID file
MUNGE_SOCK_DIR=$BASE/munge-socket
MUNGE_SOCKET=$MUNGE_SOCK_DIR/munge.socket
DB_DIR=$BASE/mariadb
DB_SOCKET=$RUN/mariadb.sock
BACKUP=$BASE/backup    # /etc/slurm files that were there before us

SLURM_ETC=/etc/slurm
MARKER="# Managed by swiftslurm tests/cluster/up.sh"
HOSTS_TAG="# swiftslurm-cluster"

# Private ports so that a system Slurm on default ports (6817-6819) does not clash. All below 8192: the four nodes
# share this machine's ports, and swiftslurm derives every job's master/preflight ports from its job id in
# [16384, 32767] (distenv.port_for_job) and tests pick free ones in [8192, 16384). The daemons once sat at
# 16817/16819/17001..: job ids 4204 and 4251 derived exactly those ports and failed as "busy" (tests/test_cluster.py
# checks the ranges).
SLURMCTLD_PORT=7817
SLURMDBD_PORT=7819
SLURMD_PORT_BASE=7900   # nodeI listens on SLURMD_PORT_BASE + I

die() {
    echo "swiftslurm-cluster: ERROR: $*" >&2
    exit 1
}

say() {
    echo "swiftslurm-cluster: $*"
}

# Is process $1 running, and is it the program $2?  A zombie (state Z/X) has exited:
# it counts as stopped (nothing here reaps the daemons, which double-forked).
proc_alive() {
    local pid=$1 comm=$2 stat state
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    state=${stat##*) }
    state=${state%% *}
    [[ $state != Z && $state != X ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]]
}

# The PID in file $1, or nothing.  A daemon removes its file as it exits.
pid_in() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    echo "${pid//[[:space:]]/}"
}

# Is the process in PID file $1 running, and is it the program $2?
pid_alive() {
    proc_alive "$(pid_in "$1")" "$2"
}

# Stop the process in PID file $1 (program $2): TERM, wait for the process itself
# (its file may go before it does), then KILL.
stop_pidfile() {
    local pidfile=$1 comm=$2 pid i
    pid=$(pid_in "$pidfile")
    if proc_alive "$pid" "$comm"; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 150; i++)); do
            proc_alive "$pid" "$comm" || break
            sleep 0.1
        done
        if proc_alive "$pid" "$comm"; then
            say "$comm (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                proc_alive "$pid" "$comm" || break
                sleep 0.1
            done
        fi
        say "stopped $comm (pid $pid)"
    fi
    rm -f "$pidfile"
}

# PID files of the slurmd daemons that exist now, one per line.
slurmd_pidfiles() {
    local f
    for f in "$RUN"/slurmd-node*.pid; do
        [[ -e $f ]] && echo "$f"
    done
    return 0
}

# Stop every daemon we started, newest layer first.
stop_all() {
    local f
    while read -r f; do
        [[ -n $f ]] && stop_pidfile "$f" slurmd
    done < <(slurmd_pidfiles)
    stop_pidfile "$RUN/slurmctld.pid" slurmctld
    stop_pidfile "$RUN/slurmdbd.pid" slurmdbd
    stop_pidfile "$RUN/mariadbd.pid" mariadbd
    stop_pidfile "$MUNGE_DIR/munged.pid" munged
}

# Print the last lines of each log file given, for a failure report.
show_logs() {
    local f
    for f in "$@"; do
        [[ -s $f ]] || continue
        echo "----- last lines of $f -----" >&2
        tail -n 25 "$f" >&2
    done
}

# wait_for TIMEOUT_S WHAT LOGFILE -- CMD...: poll CMD every 0.1 s until it succeeds;
# on timeout, fail with WHAT and the tail of LOGFILE.
wait_for() {
    local timeout_s=$1 what=$2 logfile=$3 deadline
    shift 4
    deadline=$((SECONDS + timeout_s))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            show_logs "$logfile"
            die "$what did not come up within ${timeout_s} s (log: $logfile)"
        fi
        sleep 0.1
    done
}
