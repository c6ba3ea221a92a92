#!/usr/bin/env bash
# `make image-test`: builds the relay's image from deploy/Containerfile with
# podman and runs it against the local services (docs/OPERATIONS.md,
# "Container image").
#
# No container registry is reachable from the machines this runs on, so:
#  - the runtime base, gcr.io/distroless/cc-debian12:nonroot, is stood in for
#    by a minimal Debian 12 root made here with mmdebstrap from Debian's
#    packages (glibc, libgcc, libssl, CA certificates, tzdata, netbase; no
#    shell, no package manager) and `podman import`ed under that name for the
#    build, then untagged again (a real distroless image already present is
#    used as it is);
#  - the binary is the one `make dist` built on this host
#    (`--build-arg RELAY_FROM=prebuilt`): compiling in the build stage needs
#    the rust image and crates.io.
# Everything after the binary (user, ports, STOPSIGNAL, entrypoint) is the
# shipped file's final stage.
#
# The test: `migrate` into a schema of its own, `run` detached on the host's
# network, /readyz 200, 1,000 events inserted with SQL arrive on a queue
# bound to an exchange of its own, then `podman stop` (SIGTERM) and exit
# code 0 within the drain timeout. Prints the image's size. Installs podman,
# runc and mmdebstrap with apt when missing (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."

DATABASE_URL=${TEST_DATABASE_URL:-${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}}
AMQP_URL=${TEST_AMQP_URL:-${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}}
target_dir=${CARGO_TARGET_DIR:-target}
work=$target_dir/image-test
bin=$target_dir/dist/outbox-relay
base=gcr.io/distroless/cc-debian12:nonroot
image=localhost/outbox-relay:image-test
events=1000
drain_timeout=30

say() { printf 'image-test: %s\n' "$*"; }
fail() { say "FAILED: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
podman() { as_root env CONTAINERS_CONF="$CONTAINERS_CONF" podman "$@"; }
rmq() { as_root rabbitmqctl -q "$@"; }
rmq_list() { rmq "$@" --no-table-headers; }
sql() { psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -qAt "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
# Runs "$@" until it succeeds or $1 seconds have passed (checks every 0.2 s).
within() {
    local limit=$1 start; shift
    start=$(date +%s)
    until "$@"; do
        (($(date +%s) - start < limit)) || return 1
        sleep 0.2
    done
}

[[ -x $bin ]] || fail "$bin is missing: run make dist first"

# --- tools --------------------------------------------------------------------
need=()
for tool in podman:podman runc:runc mmdebstrap:mmdebstrap amqp-consume:amqp-tools \
    amqp-declare-queue:amqp-tools psql:postgresql-client curl:curl; do
    # `type -P`: the PATH only (podman is also a shell function above).
    type -P "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if ((${#need[@]})); then
    # shellcheck disable=SC2207
    need=($(printf '%s\n' "${need[@]}" | sort -u))
    command -v apt-get >/dev/null || fail "missing ${need[*]} and no apt-get to install them"
    start=$(now)
    say "installing ${need[*]} from the system's packages"
    if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
    say "installed ${need[*]} in $(since "$start")"
fi

# This sandbox refuses crun and podman's default ulimits; cgroupfs, as
# there is no systemd to manage cgroups.
mkdir -p "$work"
export CONTAINERS_CONF=$(realpath "$work")/containers.conf
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF

# --- the base: a minimal Debian 12 root (built once, kept in $work) ------------
packages=base-files,netbase,tzdata,libc6,libgcc-s1,libssl3,ca-certificates
# (Change the 1 when the hooks below change: a new name builds it again.)
rootfs=$work/base-bookworm-$(printf '1 %s' "$packages" | sha256sum | cut -c1-12).tar
if [[ ! -s $rootfs ]]; then
    start=$(now)
    say "building the base root with mmdebstrap (bookworm: $packages)"
    # extract: unpack the packages, run none of their scripts (so no shell is
    # needed, and none is there); then what the scripts and distroless would
    # have set up: the CA bundle, the users, name service, /tmp.
    as_root mmdebstrap --quiet --mode=root --variant=extract --include="$packages" \
        --customize-hook='cat "$1"/usr/share/ca-certificates/mozilla/*.crt > "$1"/etc/ssl/certs/ca-certificates.crt' \
        --customize-hook='printf "%s\n" "root:x:0:0:root:/root:/sbin/nologin" "nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin" "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin" > "$1"/etc/passwd' \
        --customize-hook='printf "%s\n" "root:x:0:" "nobody:x:65534:" "nonroot:x:65532:" > "$1"/etc/group' \
        --customize-hook='printf "%s\n" "passwd: files" "group: files" "hosts: files dns" > "$1"/etc/nsswitch.conf' \
        --customize-hook='mkdir -p "$1"/home/nonroot && chown 65532:65532 "$1"/home/nonroot && chmod 1777 "$1"/tmp' \
        --format=tar bookworm "$rootfs.part.tar"
    mv "$rootfs.part.tar" "$rootfs"
    say "base root built in $(since "$start") ($(stat -c %s "$rootfs") bytes)"
fi
imported=
trap 'if [[ -n $imported ]]; then podman rmi "$base" >/dev/null 2>&1 || true; fi' EXIT
if podman image exists "$base" &&
    [[ $(podman image inspect --format '{{index .Labels "outbox.image-test"}}' "$base") != base ]]; then
    say "using the $base already present"
else
    # No USER here: the check below is of the Containerfile's.
    podman import --quiet --change 'LABEL outbox.image-test=base' "$rootfs" "$base" >/dev/null
    imported=1
fi

# --- build -------------------------------------------------------------------
# A context of the binary alone: the prebuilt stage copies
# target/dist/outbox-relay (the repository's target/ is gigabytes).
context=$work/context
rm -rf "$context" && mkdir -p "$context/target/dist"
cp "$bin" "$context/target/dist/outbox-relay"
dangling() { podman images -aq --no-trunc --filter dangling=true | sort; }
dangling_before=$(dangling)
start=$(now)
podman build --quiet --pull=never --build-arg RELAY_FROM=prebuilt \
    -f deploy/Containerfile -t "$image" "$context" >/dev/null
say "image built in $(since "$start")"
# Podman keeps the stages' images (the binary's); drop the ones this build
# made, and the stand-in's name, so nothing takes it for distroless later.
comm -13 <(echo "$dangling_before") <(dangling) | xargs -r podman rmi >/dev/null 2>&1 || true
if [[ -n $imported ]]; then podman rmi "$base" >/dev/null; imported=; fi

user=$(podman image inspect --format '{{.Config.User}}' "$image")
[[ $user == 65532:65532 ]] || fail "the image runs as '$user', not 65532:65532"
stop_signal=$(podman image inspect --format '{{.Config.StopSignal}}' "$image")
[[ $stop_signal == SIGTERM ]] || fail "STOPSIGNAL is '$stop_signal'"
if podman run --rm --entrypoint /bin/sh "$image" -c true >/dev/null 2>&1; then
    fail "the image has a shell"
fi
version=$(podman run --rm "$image" --version)
say "$version"
[[ $version == "outbox-relay "* ]] || fail "--version printed '$version'"

# --- run it --------------------------------------------------------------------
id=image_test_$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')
schema=$id exchange=$id queue=$id container=outbox-relay-$id
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=$((20000 + RANDOM % 20000))
while ! port_free "$port"; do port=$((20000 + RANDOM % 20000)); done
# The broker's vhost, from the URL's path (none: "/").
vhost=${AMQP_URL#*://}
[[ $vhost == */* ]] && vhost=${vhost#*/} || vhost=
vhost=${vhost%%\?*}
vhost=$(printf '%b' "${vhost//%/\\x}")
cleanup() {
    podman rm -f --time 0 "$container" >/dev/null 2>&1 || true
    if [[ -n ${consumer:-} ]]; then kill "$consumer" 2>/dev/null || true; fi
    sql -c "DROP SCHEMA IF EXISTS \"$schema\" CASCADE" 2>/dev/null || true
    amqp-delete-queue -u "$AMQP_URL" -q "$queue" >/dev/null 2>&1 || true
    rmq eval "rabbit_exchange:delete(rabbit_misc:r(<<\"${vhost:-/}\">>, exchange, <<\"$exchange\">>), false, <<\"image-test\">>)." \
        >/dev/null 2>&1 || true
}
trap cleanup EXIT
env=(-e DATABASE_URL="$DATABASE_URL" -e AMQP_URL="$AMQP_URL" -e OUTBOX_SCHEMA="$schema"
    -e OUTBOX_EXCHANGE="$exchange" -e OUTBOX_METRICS_ADDR="127.0.0.1:$port"
    -e OUTBOX_DRAIN_TIMEOUT="${drain_timeout}s")
test_start=$(now)

sql -c "CREATE SCHEMA \"$schema\""
podman run --rm --network host "${env[@]}" -e RUST_LOG=warn "$image" migrate
say "migrated schema $schema"

podman run -d --name "$container" --network host "${env[@]}" "$image" >/dev/null
ready() {
    [[ $(podman inspect --format '{{.State.Running}}' "$container") == true ]] ||
        { podman logs "$container" >&2; fail "the relay exited before it was ready"; }
    [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$port/readyz") == 200 ]]
}
within 60 ready || { podman logs "$container" >&2; fail "/readyz not 200 within 60 s"; }
say "relay ready on 127.0.0.1:$port"

# The relay declared the exchange; a queue of the test's (amqp-consume
# declares it, auto-delete), bound to it, and a consumer that stops after
# $events messages.
received=$work/received
: >"$received"
amqp-consume -u "$AMQP_URL" -q "$queue" -e "$exchange" -r '#' -c "$events" -p 200 \
    -- sh -c 'cat; echo' >"$received" &
consumer=$!
bound() {
    kill -0 "$consumer" 2>/dev/null || fail "amqp-consume exited"
    rmq_list list_bindings source_name destination_name | grep -q "^$exchange	$queue$"
}
within 30 bound || fail "the queue was not bound within 30 s"

sql -c "INSERT INTO \"$schema\".outbox (aggregate_type, aggregate_id, event_type, payload)
        SELECT 'probe', 'p-' || n, 'Probed', jsonb_build_object('n', n) FROM generate_series(1, $events) n"
publish_start=$(now)
consumed() { ! kill -0 "$consumer" 2>/dev/null; }
within 120 consumed || fail "$(wc -l <"$received") of $events events arrived within 120 s"
wait "$consumer" || fail "amqp-consume failed"
consumer=
distinct=$(grep -oE '"n": ?[0-9]+' "$received" | tr -d ' ' | sort -u | wc -l)
((distinct == events)) || fail "$distinct distinct events of $events arrived"
say "$events events published and received in $(since "$publish_start")"
outbox_empty() { [[ $(sql -c "SELECT count(*) FROM \"$schema\".outbox") == 0 ]]; }
within 30 outbox_empty || fail "events left in the outbox"
published=$(curl -s --max-time 5 "http://127.0.0.1:$port/metrics" |
    awk '$1 ~ /^outbox_relay_published_total/ { n += $2 } END { print n + 0 }')
((published == events)) || fail "the relay counts $published events published, not $events"

# --- stop: SIGTERM, drain, exit 0 --------------------------------------------------
stop_start=$(date +%s.%N)
podman stop --time $((drain_timeout + 10)) "$container" >/dev/null
stopped_in=$(since "$stop_start")
code=$(podman inspect --format '{{.State.ExitCode}}' "$container")
elapsed=$(awk -v a="$stop_start" -v b="$(now)" 'BEGIN { print int(b - a) }')
((elapsed < drain_timeout)) || fail "the relay took $stopped_in to stop (drain timeout ${drain_timeout}s)"
[[ $code == 0 ]] || { podman logs "$container" >&2; fail "exit code $code after SIGTERM"; }
say "SIGTERM: exit 0 in $stopped_in"
say "test run in $(since "$test_start")"

size=$(podman image inspect --format '{{.Size}}' "$image")
say "passed; image $image: $size bytes ($(awk -v s="$size" 'BEGIN { printf "%.1f MiB", s / 1048576 }'))"
