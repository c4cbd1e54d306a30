#!/usr/bin/env bash
# Stop the test cluster that up.sh started (only the daemons in its PID files).
#
#   tests/cluster/down.sh          # stop the daemons; state, accounting and config stay
#   tests/cluster/down.sh --purge  # also cancel jobs, remove the base dir, restore
#                                  # /etc/slurm/*.conf and remove the /etc/hosts lines
set -euo pipefail

# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

purge=0
case "${1-}" in
"") ;;
--purge) purge=1 ;;
*) die "usage: $0 [--purge]" ;;
esac
[[ $(id -u) -eq 0 ]] || die "needs root"

# Jobs outlive slurmd (each step is a slurmstepd of its own).  Stop new ones from starting,
# cancel the rest, and give them a few seconds (KillWait=2) to end.
cancel_jobs() {
    pid_alive "$RUN/slurmctld.pid" slurmctld || return 0
    timeout 5 scontrol update PartitionName=debug State=DOWN >/dev/null 2>&1 || true
    local ids deadline=$((SECONDS + 10))
    ids=$(timeout 5 squeue -h -o %A 2>/dev/null || true)
    [[ -n $ids ]] || return 0
    # shellcheck disable=SC2086  # one job id per word
    timeout 5 scancel $ids 2>/dev/null || true
    while ((SECONDS < deadline)); do
        [[ -z $(timeout 5 squeue -h -t running,completing -o %A 2>/dev/null) ]] && return 0
        sleep 0.2
    done
    say "some jobs were still running 10 s after scancel; killing their steps below"
}

# slurmstepd processes of this cluster, one PID a line: they run in slurmd's log directory.
cluster_steps() {
    local proc cwd
    for proc in /proc/[0-9]*; do
        [[ $(cat "$proc/comm" 2>/dev/null) == slurmstepd ]] || continue
        cwd=$(readlink "$proc/cwd" 2>/dev/null) || continue
        [[ $cwd == "$LOG" || $cwd == "$LOG (deleted)" ]] && echo "${proc#/proc/}"
    done
    return 0
}

# Kill what is left of this cluster's jobs after its daemons stopped: each slurmstepd and
# every process below it (proctrack/linuxproc tracks jobs by parentage, as this does).
kill_leftover_steps() {
    local steps
    steps=$(cluster_steps)
    [[ -n $steps ]] || return 0
    local -A parent=() doomed=()
    local proc stat pid grown
    for proc in /proc/[0-9]*; do
        stat=$(cat "$proc/stat" 2>/dev/null) || continue
        stat=${stat##*) }     # past "pid (comm) ": "state ppid ..."
        stat=${stat#* }
        parent[${proc#/proc/}]=${stat%% *}
    done
    for pid in $steps; do doomed[$pid]=1; done
    grown=1
    while ((grown)); do
        grown=0
        for pid in "${!parent[@]}"; do
            if [[ -z ${doomed[$pid]-} && -n ${doomed[${parent[$pid]}]-} ]]; then
                doomed[$pid]=1
                grown=1
            fi
        done
    done
    kill -KILL "${!doomed[@]}" 2>/dev/null || true
    say "killed ${#doomed[@]} leftover job processes (slurmstepd and their children)"
}

# Put back the /etc/slurm file that was there before up.sh, or remove ours.
restore_conf() {
    local name=$1 dest=$SLURM_ETC/$1
    if [[ -e $BACKUP/$name ]]; then
        cp -p "$BACKUP/$name" "$dest"
        say "restored $dest"
    elif [[ -e $dest ]] && grep -qxF "$MARKER" "$dest"; then
        rm -f "$dest"
    fi
}

# Remove our /etc/hosts lines, writing in place (it may be a bind mount).
remove_hosts() {
    grep -q "$HOSTS_TAG\$" /etc/hosts || return 0
    local kept
    kept=$(grep -v " $HOSTS_TAG\$" /etc/hosts || true)
    printf '%s\n' "$kept" >/etc/hosts
}

main() {
    if [[ ! -d $BASE ]]; then
        say "nothing to stop: $BASE does not exist"
        ((purge)) && remove_hosts
        return 0
    fi
    exec 9>"$BASE/.lock"
    flock -w 120 9 || die "another up.sh/down.sh holds $BASE/.lock"
    ((purge)) && cancel_jobs
    stop_all
    if ((purge)); then
        kill_leftover_steps
        restore_conf slurm.conf
        restore_conf slurmdbd.conf
        remove_hosts
        rm -rf "$BASE"
        say "purged $BASE"
    fi
    say "down"
}

[[ ${BASH_SOURCE[0]} != "$0" ]] || main "$@" # sourcing only defines the functions
