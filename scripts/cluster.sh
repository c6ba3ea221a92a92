#!/usr/bin/env bash
# A local three-node RabbitMQ cluster on loopback for the cluster suite:
# outbox-c1@localhost, outbox-c2@localhost and outbox-c3@localhost with AMQP
# on 127.0.0.1:5701-5703, beside the default node (rabbit@localhost on 5672),
# which this script never touches. Each node has its own directory under
# $OUTBOX_CLUSTER_DIR (default /var/tmp/outbox-cluster), config, plugins file,
# distribution port (25701-25703) and the cluster's own Erlang cookie; the
# nodes run as user rabbitmq. Needs root (or the rabbitmq user).
#
# Beside them, outbox-solo@localhost on 127.0.0.1:5704 (distribution port
# 25704) is a standalone node, in no cluster: a test that blocks a whole
# broker for minutes (the alarm test) runs on it, so the tests of the
# default node need not wait for it to end.
#
#   start            (default) start what is down, form the cluster, start the
#                    standalone node; quick no-op when up
#   stop             stop the four nodes gracefully (data stays)
#   reset            stop, wipe the cluster directory, start fresh
#   status           one line per node: running or not, pid, port
#   ctl N ARGS...    rabbitmqctl ARGS against node N (1-3, a name, or solo)
#   kill N           SIGKILL node N (1-3 or its name), wait until its port is closed
#   stop-node N      stop node N gracefully
#   start-node N     start node N again, wait until it runs in the cluster
#   leader Q [VHOST] the node leading quorum queue Q (exit 2: no such queue or no leader)
#   messages Q...    every message of the queues Q (vhost $VHOST, default /), summed:
#                    ready, unacked, and (quorum)
#                    those waiting to be dead-lettered at-least-once
set -euo pipefail

DIR=${OUTBOX_CLUSTER_DIR:-/var/tmp/outbox-cluster}
RMQ_BIN=/usr/lib/rabbitmq/bin
# The cluster's members are 0-2; 3 is the standalone node.
NODES=(outbox-c1@localhost outbox-c2@localhost outbox-c3@localhost outbox-solo@localhost)
PORTS=(5701 5702 5703 5704)
DIST_PORTS=(25701 25702 25703 25704)
SOLO=3
# Two schedulers and no busy waiting: three nodes share a 2-core machine;
# a smaller process table (the default is 1M processes).
# How soon at-least-once dead-lettering re-sends a message a full or
# leaderless target refused.
DLX_RESEND_MS=5000
ERL_ARGS="+S 2:2 +sbwt none +sbwtdcpu none +sbwtdio none +P 262144"

say() { printf 'cluster: %s\n' "$*"; }
die() { say "$*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_for() { # name, seconds, check command...
    local name=$1 secs=$2; shift 2
    local i
    for i in $(seq 1 $((secs * 4))); do "$@" && return 0; sleep 0.25; done
    say "$name: not done within $secs s" >&2; return 1
}
as_rabbitmq() { # runs a command as the rabbitmq user from the cluster directory
    (
        cd "$DIR" 2>/dev/null || cd /
        if [ "$(id -un)" = rabbitmq ]; then "$@"
        elif [ "$(id -u)" = 0 ]; then runuser -u rabbitmq -- "$@"
        else sudo -u rabbitmq -- "$@"; fi
    )
}
node_dir() { printf '%s/%s' "$DIR" "${NODES[$1]}"; }
# The environment every server and CLI call of the cluster runs with: its own
# HOME (so its own cookie) and its own env file (not /etc/rabbitmq's, which
# names the default node).
cli_env() { printf '%s\n' "HOME=$DIR/home" "RABBITMQ_CONF_ENV_FILE=$DIR/rabbitmq-env.conf"; }
ctl() { # index, rabbitmqctl arguments...
    local i=$1; shift
    mapfile -t e < <(cli_env)
    as_rabbitmq env "${e[@]}" "$RMQ_BIN/rabbitmqctl" -n "${NODES[$i]}" "$@"
}
queues() { # index, rabbitmq-queues arguments...
    local i=$1; shift
    mapfile -t e < <(cli_env)
    as_rabbitmq env "${e[@]}" "$RMQ_BIN/rabbitmq-queues" -n "${NODES[$i]}" "$@"
}
index_of() { # 1-3, outbox-cN or outbox-cN@localhost -> 0-2
    local i
    for i in 0 1 2; do
        case $1 in "$((i + 1))" | "${NODES[$i]}" | "${NODES[$i]%@*}") echo "$i"; return 0 ;; esac
    done
    die "no such node: $1 (1-3 or a name: ${NODES[*]:0:3})"
}
any_index_of() { # a cluster node as index_of, or solo (outbox-solo, its full name) -> 0-3
    case $1 in solo | "${NODES[$SOLO]}" | "${NODES[$SOLO]%@*}") echo "$SOLO" ;; *) index_of "$1" ;; esac
}

proc_alive() { # pid: exists and is not a zombie (here PID 1 reaps orphans late)
    local state
    state=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}
# Whether process $1 is node $2's beam: alive, not a zombie, a beam.smp,
# started for that node (when its environment can be read).
is_node_beam() { # pid, index
    proc_alive "$1" || return 1
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = beam.smp ] || return 1
    if [ -r "/proc/$1/environ" ]; then
        tr '\0' '\n' <"/proc/$1/environ" | grep -qx "RABBITMQ_NODENAME=${NODES[$2]}" || return 1
    fi
}
# pid of node i's beam if it is alive: from its pid file, or, when that is
# missing, empty or stale (stale after a SIGKILL; a stop once took a node
# whose file did not name it for one not running, and left it running), by
# looking for the node's beam among the processes.
node_pid() {
    local f pid p
    f="$(node_dir "$1")/pid"
    if [ -s "$f" ]; then
        pid=$(tr -dc 0-9 <"$f")
        if [ -n "$pid" ] && is_node_beam "$pid" "$1"; then echo "$pid"; return 0; fi
    fi
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [ "$(cat "$p/comm" 2>/dev/null)" = beam.smp ] && [ -r "$p/environ" ] || continue
        if is_node_beam "$pid" "$1"; then echo "$pid"; return 0; fi
    done
    return 1
}
gone() { ! proc_alive "$1" && ! port_open "$2"; } # pid, port
# Up: its beam is alive and its AMQP listener (opened late in boot) accepts.
node_up() { node_pid "$1" >/dev/null && port_open "${PORTS[$1]}"; }

setup() { # the directories, cookie and config files; idempotent
    local i d
    mkdir -p "$DIR/home"
    chmod 700 "$DIR/home"
    if [ ! -s "$DIR/home/.erlang.cookie" ]; then
        # Not the default node's cookie: the default node cannot join or be joined by accident.
        local cookie
        cookie=$(head -c 4096 /dev/urandom | LC_ALL=C tr -dc A-Z)
        printf '%s' "${cookie:0:32}" >"$DIR/home/.erlang.cookie"
        say "new Erlang cookie in $DIR/home"
    fi
    chmod 400 "$DIR/home/.erlang.cookie"
    cat >"$DIR/rabbitmq-env.conf" <<'EOF'
# Written by scripts/cluster.sh for the outbox-cN nodes (not the default node).
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
    echo '[rabbitmq_consistent_hash_exchange].' >"$DIR/enabled_plugins"
    for i in 0 1 2 $SOLO; do
        d=$(node_dir "$i")
        mkdir -p "$d/mnesia" "$d/log" "$d/plugins"
        cat >"$d/rabbitmq.conf" <<EOF
# Written by scripts/cluster.sh for ${NODES[$i]}.
listeners.tcp.local = 127.0.0.1:${PORTS[$i]}
loopback_users.guest = true
vm_memory_high_watermark.absolute = 1GB
disk_free_limit.absolute = 50MB
raft.wal_max_size_bytes = 67108864
EOF
        # At-least-once dead-lettering (the consumer's retry path) re-sends
        # what a full or leaderless target refused after this long; the
        # default is 3 minutes.
        cat >"$d/advanced.config" <<EOF
%% Written by scripts/cluster.sh for ${NODES[$i]}.
[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, $DLX_RESEND_MS}]}].
EOF
    done
    chown -R rabbitmq:rabbitmq "$DIR"
}

start_node() { # index: launches the node (detached), does not wait
    local i=$1 d
    d=$(node_dir "$i")
    rm -f "$d/pid"
    mapfile -t e < <(cli_env)
    as_rabbitmq env "${e[@]}" \
        RABBITMQ_NODENAME="${NODES[$i]}" \
        RABBITMQ_DIST_PORT="${DIST_PORTS[$i]}" \
        RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
        RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
        RABBITMQ_MNESIA_BASE="$d/mnesia" \
        RABBITMQ_LOG_BASE="$d/log" \
        RABBITMQ_PID_FILE="$d/pid" \
        RABBITMQ_PLUGINS_EXPAND_DIR="$d/plugins" \
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="$ERL_ARGS" \
        "$RMQ_BIN/rabbitmq-server" -detached >>"$d/log/launch.log" 2>&1 9>&-
    # (9>&-: the node must not inherit, and so hold forever, the lock below.)
}

await_node() { # index: waits until the node has booted
    wait_for "${NODES[$1]} booting" 90 port_open "${PORTS[$1]}" &&
        ctl "$1" -q await_startup --timeout 60 >/dev/null ||
        { say "${NODES[$1]} did not start; see $(node_dir "$1")/log" >&2; return 1; }
}

running_nodes() { # index of a running node -> the running members it reports, one a line
    ctl "$1" -q cluster_status --formatter json | jq -r '.running_nodes[]'
}
members() { ctl "$1" -q cluster_status --formatter json | jq -r '.disk_nodes[], .ram_nodes[]?'; }
all_running() { # index: true when that node reports all three as running members
    local r n
    r=$(running_nodes "$1" 2>/dev/null) || return 1
    for n in "${NODES[@]:0:3}"; do grep -qx "$n" <<<"$r" || return 1; done
}

quiet() { # runs a command, shows what it printed only when it fails
    local out
    out=$("$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
}
join() { # index: makes the node a member of outbox-c1's cluster (wipes its data)
    say "joining ${NODES[$1]} to ${NODES[0]}"
    quiet ctl "$1" -q stop_app
    quiet ctl "$1" -q reset || quiet ctl "$1" -q force_reset
    # (join_cluster logs benign feature-flag warnings and tracked-connection
    # errors on the joining node: hence quiet.)
    quiet ctl "$1" -q join_cluster "${NODES[0]}"
    quiet ctl "$1" -q start_app
}

lock() { # one mutating command at a time (tests in several processes may call start)
    mkdir -p "$(dirname "$DIR")"
    exec 9>"$DIR.lock"
    flock -w 180 9 || die "another cluster.sh holds $DIR.lock for over 180 s"
}

cmd_start() {
    local i started=() m solo=
    # The standalone node boots beside the cluster's.
    if ! node_pid "$SOLO" >/dev/null && ! port_open "${PORTS[$SOLO]}"; then
        port_open "${DIST_PORTS[$SOLO]}" && die "port ${DIST_PORTS[$SOLO]} is taken by another process"
        setup
        say "starting ${NODES[$SOLO]}"
        start_node "$SOLO"
        solo=started
    fi
    if node_up 0 && node_up 1 && node_up 2 && all_running 0; then
        say "already running"
    else
        setup
        for i in 0 1 2; do
            if node_pid "$i" >/dev/null || port_open "${PORTS[$i]}"; then continue; fi
            port_open "${DIST_PORTS[$i]}" && die "port ${DIST_PORTS[$i]} is taken by another process"
            say "starting ${NODES[$i]}"
            start_node "$i"
            started+=("$i")
        done
        # Together: after a full stop, a node waits for the peers it last saw.
        for i in 0 1 2; do await_node "$i"; done
        m=$(members 0)
        for i in 1 2; do grep -qx "${NODES[$i]}" <<<"$m" || join "$i"; done
        wait_for "three running nodes" 60 all_running 0
        say "running: ${NODES[*]:0:3}${started[*]:+ (started ${#started[@]})}"
    fi
    await_node "$SOLO"
    [ -z "$solo" ] || say "running: ${NODES[$SOLO]}"
    # Also on nodes started by an older version of this script.
    for i in 0 1 2; do
        ctl "$i" -q eval "application:set_env(rabbit, dead_letter_worker_publisher_confirm_timeout, $DLX_RESEND_MS)." >/dev/null
    done
    for i in 0 1 2; do say "amqp://guest:***@127.0.0.1:${PORTS[$i]}/%2f"; done
    say "standalone: amqp://guest:***@127.0.0.1:${PORTS[$SOLO]}/%2f"
}

stop_one() { # index: graceful stop, SIGKILL after 60 s
    local i=$1 pid
    if ! pid=$(node_pid "$i"); then
        # Never "stopped" while it still answers: the caller means to
        # take the node away.
        ! port_open "${PORTS[$i]}" || die "${NODES[$i]} answers on port ${PORTS[$i]} but its process was not found"
        say "${NODES[$i]} not running"
        return 0
    fi
    say "stopping ${NODES[$i]} (pid $pid)"
    # In the background: the wait below bounds it.
    ctl "$i" -q stop >/dev/null 2>&1 9>&- &
    # (The node removes its pid file early in the shutdown: wait for the process.)
    if ! wait_for "${NODES[$i]} stopping" 60 gone "$pid" "${PORTS[$i]}"; then
        say "${NODES[$i]} ignored the stop; SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        wait_for "${NODES[$i]} dying" 10 gone "$pid" "${PORTS[$i]}"
    fi
}

cmd_stop() {
    local i pids=()
    for i in 0 1 2 $SOLO; do stop_one "$i" & pids+=($!); done
    for i in "${pids[@]}"; do wait "$i"; done
    say "stopped (data kept in $DIR)"
}

cmd_kill() {
    local i pid
    i=$(index_of "$1")
    pid=$(node_pid "$i") || { say "${NODES[$i]} not running"; return 0; }
    kill -KILL "$pid"
    wait_for "${NODES[$i]} dying" 30 gone "$pid" "${PORTS[$i]}"
    say "killed ${NODES[$i]} (pid $pid); port ${PORTS[$i]} closed"
}

cmd_start_node() {
    local i
    i=$(index_of "$1")
    if node_up "$i"; then
        say "${NODES[$i]} already running"
    else
        node_pid "$i" >/dev/null || { setup; say "starting ${NODES[$i]}"; start_node "$i"; }
        await_node "$i"
    fi
    # Its data says it is a member: it rejoins by itself.
    wait_for "${NODES[$i]} running in the cluster" 60 all_running "$i"
    say "${NODES[$i]} running in the cluster: amqp://guest:***@127.0.0.1:${PORTS[$i]}/%2f"
}

cmd_status() {
    local i pid state note
    for i in 0 1 2 $SOLO; do
        note=
        if pid=$(node_pid "$i"); then
            if port_open "${PORTS[$i]}"; then state=running; else state=starting; fi
        else
            pid=- state=down
            [ -s "$(node_dir "$i")/pid" ] && note=" (stale pid file: killed?)"
        fi
        printf '%-22s %-8s pid %-7s port %s%s\n' "${NODES[$i]}" "$state" "$pid" "${PORTS[$i]}" "$note"
    done
}

cmd_messages() { # every message of the queues named (vhost $VHOST, default /): ready, unacked and those waiting to be dead-lettered, summed; one listing for all
    local vhost=${VHOST:-/} i listed
    for i in 0 1 2; do
        node_up "$i" || continue
        listed=$(ctl "$i" -q list_queues -p "$vhost" name messages --formatter json) || die "list_queues failed on ${NODES[$i]}"
        jq -r --args '. as $l | [$ARGS.positional[] as $q | ($l[] | select(.name == $q) | .messages) // error("no queue \($q)")] | add' "$@" <<<"$listed"
        return
    done
    die "no node of the cluster is running"
}

cmd_leader() {
    local q=$1 vhost=${2:-/} i out
    for i in 0 1 2; do
        node_up "$i" || continue
        out=$(queues "$i" -q quorum_status --vhost "$vhost" "$q" --formatter json 2>&1) || {
            say "no quorum queue '$q' in vhost '$vhost' (asked ${NODES[$i]}): ${out//$'\n'/ }" >&2
            exit 2
        }
        # Just after an election a deposed leader may still say leader: the
        # highest term wins.
        out=$(jq -r '[.[] | select(."Raft State" == "leader")] | max_by(.Term) | ."Node Name" // empty' <<<"$out")
        [ -n "$out" ] || { say "quorum queue '$q' has no leader now" >&2; exit 2; }
        echo "$out"
        return 0
    done
    die "no node of the cluster is running"
}

[ "$(id -u)" = 0 ] || [ "$(id -un)" = rabbitmq ] || command -v sudo >/dev/null ||
    die "run as root (or rabbitmq): the nodes run as user rabbitmq"
[ -x "$RMQ_BIN/rabbitmq-server" ] || die "RabbitMQ is not installed (make services installs it)"
if ! command -v jq >/dev/null; then # reads the CLI's JSON
    command -v apt-get >/dev/null || die "cannot install jq: no apt-get (install it by hand)"
    say "installing jq from the system's packages"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq jq >/dev/null
fi

case ${1:-start} in
start) lock; cmd_start ;;
stop) lock; cmd_stop ;;
reset)
    lock
    cmd_stop
    rm -rf "$DIR"
    say "wiped $DIR"
    cmd_start
    ;;
status) cmd_status ;;
kill) [ $# = 2 ] || die "usage: $0 kill N"; cmd_kill "$2" ;;
stop-node) [ $# = 2 ] || die "usage: $0 stop-node N"; lock; stop_one "$(index_of "$2")" ;;
start-node) [ $# = 2 ] || die "usage: $0 start-node N"; lock; cmd_start_node "$2" ;;
messages) [ $# -ge 2 ] || die "usage: $0 messages QUEUE..."; shift; cmd_messages "$@" ;;
leader) [ $# -ge 2 ] || die "usage: $0 leader QUEUE [VHOST]"; cmd_leader "$2" "${3:-/}" ;;
ctl) [ $# -ge 3 ] || die "usage: $0 ctl N|solo ARGS..."; i=$(any_index_of "$2"); shift 2; ctl "$i" "$@" ;;
*) die "usage: $0 [start|stop|reset|status|kill N|stop-node N|start-node N|leader QUEUE [VHOST]|messages QUEUE...|ctl N|solo ARGS...]" ;;
esac
