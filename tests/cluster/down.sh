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

# Running jobs would outlive slurmd (their slurmstepd are separate processes).
cancel_jobs() {
    pid_alive "$RUN/slurmctld.pid" slurmctld || return 0
    local ids i
    ids=$(timeout 5 squeue -h -o %A 2>/dev/null || true)
    [[ -n $ids ]] || return 0
    # shellcheck disable=SC2086  # one job id per word
    timeout 5 scancel $ids 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        [[ -z $(timeout 5 squeue -h -t running,completing -o %A 2>/dev/null) ]] && return 0
        sleep 0.1
    done
    say "some jobs were still running after scancel; stopping the daemons anyway"
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
        restore_conf slurm.conf
        restore_conf slurmdbd.conf
        remove_hosts
        rm -rf "$BASE"
        say "purged $BASE"
    fi
    say "down"
}

main "$@"
