#!/usr/bin/env bash
# Bring up a real multi-node Slurm cluster on this machine, for the test suite.
#
#   tests/cluster/up.sh                     # 4 nodes: node1..node4 on 127.0.0.1..4
#   SWIFTSLURM_NODES=2 tests/cluster/up.sh  # 2 nodes
#
# Installs what is missing (apt-get), then starts munged, a private MariaDB,
# slurmdbd, slurmctld and one slurmd per node, and waits until every node has
# registered (idle; or busy, when jobs survived a restart of the daemons).
# Everything lives under $SWIFTSLURM_CLUSTER_DIR (default /var/tmp/swiftslurm-cluster);
# outside it only /etc/slurm/{slurm,slurmdbd}.conf (backed up first) and /etc/hosts
# lines tagged "# swiftslurm-cluster" are written.  Needs root; no systemd.
# Idempotent: when the cluster is already up it returns at once.  See README.md.
set -euo pipefail

# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

NODES=${SWIFTSLURM_NODES:-4}
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server iperf3 fio netcat-openbsd)
INSTALLED=0

[[ $NODES =~ ^[1-9][0-9]*$ && $NODES -le 254 ]] ||
    die "SWIFTSLURM_NODES must be a whole number from 1 to 254, got '$NODES'"
[[ $(id -u) -eq 0 ]] ||
    die "needs root (it installs packages, runs the Slurm daemons as root and edits /etc/hosts)"

# True when every daemon of a cluster with $NODES nodes is running and answering.
already_up() {
    local i
    [[ $(cat "$BASE/nodes" 2>/dev/null) == "$NODES" ]] || return 1
    grep -qxF "StateSaveLocation=$BASE/state" "$SLURM_ETC/slurm.conf" 2>/dev/null || return 1
    pid_alive "$MUNGE_DIR/munged.pid" munged || return 1
    pid_alive "$RUN/mariadbd.pid" mariadbd || return 1
    pid_alive "$RUN/slurmdbd.pid" slurmdbd || return 1
    pid_alive "$RUN/slurmctld.pid" slurmctld || return 1
    for ((i = 1; i <= NODES; i++)); do
        pid_alive "$RUN/slurmd-node$i.pid" slurmd || return 1
    done
    [[ $(find "$RUN" -name 'slurmd-node*.pid' | wc -l) -eq $NODES ]] || return 1
    timeout 5 scontrol ping >/dev/null 2>&1
}

install_missing() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] ||
            missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    INSTALLED=1
    say "installing ${missing[*]}"
    # Keep the packages' init scripts from starting system-wide daemons (munge, mariadb,
    # slurm*): ours run from the base dir.  Docker images already have this file.
    local own_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q </dev/null >"$LOG/apt.log" 2>&1 ||
        say "apt-get update failed (see $LOG/apt.log); trying the install anyway"
    apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${missing[@]}" </dev/null >>"$LOG/apt.log" 2>&1 || rc=$?
    if ((own_policy)); then
        rm -f /usr/sbin/policy-rc.d
        trap - EXIT
    fi
    if ((rc)); then
        show_logs "$LOG/apt.log"
        die "apt-get install ${missing[*]} failed (exit $rc; log: $LOG/apt.log)"
    fi
}

# Render template $1 to $2, replacing @NAME@ with the shell variable NAME.
render() {
    local line var
    while IFS= read -r line || [[ -n $line ]]; do
        while [[ $line =~ @([A-Z_]+)@ ]]; do
            var=${BASH_REMATCH[1]}
            line=${line//"@$var@"/${!var}}
        done
        printf '%s\n' "$line"
    done <"$1" >"$2"
}

# Write /etc/slurm/$1 from template $2, keeping a copy of a file that is not ours.
install_conf() {
    local name=$1 template=$2 dest=$SLURM_ETC/$1 tmp
    mkdir -p "$SLURM_ETC" "$BACKUP"
    if [[ -e $dest ]] && ! grep -qxF "$MARKER" "$dest" && [[ ! -e $BACKUP/$name ]]; then
        cp -p "$dest" "$BACKUP/$name"
        say "backed up the existing $dest to $BACKUP/$name (down.sh --purge restores it)"
    fi
    tmp=$(mktemp "$dest.XXXXXX")
    render "$template" "$tmp"
    if [[ $name == slurm.conf ]]; then
        local i
        for ((i = 1; i <= NODES; i++)); do
            echo "NodeName=node$i NodeHostname=$HOSTNAME NodeAddr=127.0.0.$i" \
                "Port=$((SLURMD_PORT_BASE + i)) CPUs=4 RealMemory=4000 State=UNKNOWN"
        done >>"$tmp"
        echo "PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >>"$tmp"
        chmod 644 "$tmp"
    else
        chmod 600 "$tmp" # slurmdbd refuses a readable slurmdbd.conf
    fi
    mv -f "$tmp" "$dest"
}

# Add "127.0.0.I nodeI" to /etc/hosts, in place (it may be a bind mount).
add_hosts() {
    local i addr line
    [[ -z $(tail -c1 /etc/hosts) ]] || echo >>/etc/hosts
    for ((i = 1; i <= NODES; i++)); do
        line="127.0.0.$i node$i $HOSTS_TAG"
        grep -qxF "$line" /etc/hosts || echo "$line" >>/etc/hosts
        addr=$(getent hosts "node$i" | awk '{print $1; exit}')
        [[ $addr == "127.0.0.$i" ]] ||
            die "node$i resolves to '$addr', not 127.0.0.$i: another /etc/hosts line wins; remove it"
    done
}

start_munged() {
    install -d -o munge -g munge -m 0700 "$MUNGE_DIR"
    install -d -o munge -g munge -m 0755 "$MUNGE_SOCK_DIR"
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        runuser -u munge -- mungekey --create --keyfile="$MUNGE_DIR/munge.key"
    fi
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock" # stale, since munged is not running
    runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" \
        --key-file="$MUNGE_DIR/munge.key" --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
        </dev/null >>"$LOG/munged.out" 2>&1 9>&- ||
        { show_logs "$MUNGE_DIR/munged.log" "$LOG/munged.out"; die "munged failed to start"; }
}

munge_works() {
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"
}

start_mariadb() {
    local server
    server=$(command -v mariadbd || echo /usr/sbin/mariadbd)
    if [[ ! -d $DB_DIR/mysql ]]; then
        rm -rf "$DB_DIR"
        mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR" \
            --auth-root-authentication-method=socket --skip-test-db \
            </dev/null >"$LOG/mariadb-install-db.log" 2>&1 ||
            { show_logs "$LOG/mariadb-install-db.log"; die "mariadb-install-db failed"; }
    fi
    rm -f "$DB_SOCKET" "$DB_SOCKET.lock"
    setsid -f "$server" --no-defaults --user=root --datadir="$DB_DIR" \
        --socket="$DB_SOCKET" --pid-file="$RUN/mariadbd.pid" --skip-networking \
        --log-error="$LOG/mariadbd.log" --skip-log-bin \
        --innodb-buffer-pool-size=128M --innodb-log-file-size=64M \
        --innodb-lock-wait-timeout=900 --innodb-flush-log-at-trx-commit=0 \
        </dev/null >>"$LOG/mariadbd.out" 2>&1 9>&-
}

db_answers() {
    mariadb-admin --no-defaults --socket="$DB_SOCKET" -uroot ping
}

dbd_answers() {
    sacctmgr -n -P list cluster format=cluster
}

cluster_registered() {
    [[ $(sacctmgr -n -P list cluster format=cluster 2>/dev/null) == *"$CLUSTER_NAME"* ]]
}

# "NAME STATE" of each node whose slurmd registered since $1 (a local time, 2026-01-31T23:59:59).
# SlurmdStartTime matters: after a restart slurmctld shows the nodes' saved state (IDLE) before
# their slurmd has registered.
nodes_registered_since() {
    scontrol show node -o 2>/dev/null | awk -v since="$1" '
        {
            name = ""; state = ""; start = ""
            for (i = 1; i <= NF; i++) {
                split($i, kv, "=")
                if (kv[1] == "NodeName") name = kv[2]
                else if (kv[1] == "State") state = kv[2]
                else if (kv[1] == "SlurmdStartTime") start = kv[2]
            }
            if (name != "" && start >= since) print name, state
        }'
}

# How many nodes registered since $1 and take work: idle, or busy with (or cleaning up after)
# jobs that survived the restart, since slurmstepd outlives slurmd.
registered_nodes() {
    nodes_registered_since "$1" | awk '$2 ~ /^(IDLE|MIXED|ALLOCATED)/ && $2 !~ /[*]|DRAIN|NOT_RESPONDING|FAIL|POWER/ { n++ }
                                      END { print n + 0 }'
}

all_nodes_ready() {
    [[ $(registered_nodes "$1") -eq $NODES ]]
}

# Nodes whose slurmd registered since $1 but that the saved state still holds DRAIN or DOWN: an earlier life of this
# cluster left them so (e.g. "Kill task failed" when a test's step outlived UnkillableStepTimeout on a loaded
# machine). This is a fresh start of our own test cluster: put them back to work, saying so.
resume_left_over() {
    local name
    for name in $(nodes_registered_since "$1" | awk '$2 ~ /DRAIN|DOWN/ && $2 !~ /[*]|NOT_RESPONDING/ { print $1 }'); do
        scontrol update nodename="$name" state=resume 2>/dev/null &&
            say "resumed $name: an earlier run of this cluster left it drained or down"
    done
}

# A daemon that died while we wait for it: fail now, with its log.
check_alive() {
    local pidfile=$1 comm=$2
    shift 2
    pid_alive "$pidfile" "$comm" || { show_logs "$@"; die "$comm exited during start-up"; }
}

# Seconds from $1 to $2 ($EPOCHREALTIME values), one decimal.
secs() {
    awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'
}

main() {
    mkdir -p "$BASE" "$RUN" "$LOG"
    exec 9>"$BASE/.lock"
    # Every daemon is started with 9>&-: one that inherited the lock would hold it forever.
    flock -w 120 9 || die "another up.sh/down.sh holds $BASE/.lock"

    if already_up; then
        say "already up ($NODES nodes, partition debug); nothing to do"
        exit 0
    fi
    local t0=$EPOCHREALTIME
    install_missing
    local t_installed=$EPOCHREALTIME

    stop_all # whatever is left of an earlier, partial start
    HOSTNAME=$(hostname -s)
    mkdir -p "$BASE/state"
    local i
    for ((i = 1; i <= NODES; i++)); do mkdir -p "$BASE/spool/node$i"; done
    add_hosts
    install_conf slurm.conf "$HERE/slurm.conf.in"
    install_conf slurmdbd.conf "$HERE/slurmdbd.conf.in"
    echo "$NODES" >"$BASE/nodes"

    start_munged
    start_mariadb
    wait_for 10 munged "$MUNGE_DIR/munged.log" -- munge_works
    wait_for 30 MariaDB "$LOG/mariadbd.log" -- db_answers

    MYSQL_UNIX_PORT=$DB_SOCKET slurmdbd </dev/null >>"$LOG/slurmdbd.out" 2>&1 9>&- ||
        { show_logs "$LOG/slurmdbd.log" "$LOG/slurmdbd.out"; die "slurmdbd failed to start"; }
    wait_for 30 slurmdbd "$LOG/slurmdbd.log" -- dbd_answers
    check_alive "$RUN/slurmdbd.pid" slurmdbd "$LOG/slurmdbd.log"
    if ! cluster_registered; then
        sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null
    fi

    slurmctld </dev/null >>"$LOG/slurmctld.out" 2>&1 9>&- ||
        { show_logs "$LOG/slurmctld.log" "$LOG/slurmctld.out"; die "slurmctld failed to start"; }
    wait_for 30 slurmctld "$LOG/slurmctld.log" -- scontrol ping
    local slurmd_since
    slurmd_since=$(date +%Y-%m-%dT%H:%M:%S)
    for ((i = 1; i <= NODES; i++)); do
        slurmd -N "node$i" </dev/null >>"$LOG/slurmd-node$i.out" 2>&1 9>&- ||
            { show_logs "$LOG/slurmd-node$i.log" "$LOG/slurmd-node$i.out"; die "slurmd node$i failed to start"; }
    done

    local deadline=$((SECONDS + 60))
    until all_nodes_ready "$slurmd_since"; do
        resume_left_over "$slurmd_since"
        if ((SECONDS >= deadline)); then
            scontrol show node >&2 || true
            show_logs "$LOG/slurmctld.log" "$LOG"/slurmd-node*.log
            die "not all $NODES nodes registered (idle, or busy with surviving jobs) within 60 s"
        fi
        for ((i = 1; i <= NODES; i++)); do
            check_alive "$RUN/slurmd-node$i.pid" slurmd "$LOG/slurmd-node$i.log"
        done
        sleep 0.1
    done

    local t1=$EPOCHREALTIME installs=""
    if ((INSTALLED)); then
        installs="; with the package installs $(secs "$t0" "$t1") s"
    fi
    say "up: $NODES nodes node[1-$NODES] ready in partition debug;" \
        "bring-up took $(secs "$t_installed" "$t1") s$installs"
    say "logs in $LOG; stop with tests/cluster/down.sh [--purge]"
}

[[ ${BASH_SOURCE[0]} != "$0" ]] || main "$@" # sourcing only defines the functions
