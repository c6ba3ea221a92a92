#!/bin/sh
# The shared_buffers experiment of docs/BENCHMARKS.md: the `growth` section
# (10k vs 1M backlog, one relay vs two) on a private PostgreSQL cluster,
# first with 128 MB of shared_buffers, then with 1 GB, one after the other.
# The shared instance on 5432 is never touched; the private one is stopped
# and its data directory removed at the end.
#
#   cargo build --release -p outbox-relay-ops -p bench
#   sh examples/bench/buffers.sh          # BENCH_BIN=... if the target dir moved
set -eu
BIN=${BENCH_BIN:-target/release/bench}
PORT=${BENCH_PG_PORT:-5433}
DATA=${BENCH_PG_DATA:-/tmp/bench-pg-data}
OUT=${BENCH_OUT_DIR:-target/bench}
PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)

# PostgreSQL refuses to run as root.
as_pg() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
stop() {
    as_pg "$PGBIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null 2>&1 || true
}

rm -rf "$DATA"
mkdir -p "$DATA" "$OUT"
if [ "$(id -u)" = 0 ]; then chown postgres "$DATA"; fi
as_pg "$PGBIN/initdb" -D "$DATA" -U postgres --auth=trust >/dev/null
trap 'stop; rm -rf "$DATA"' EXIT
for sb in 128MB 1GB; do
    as_pg "$PGBIN/pg_ctl" -D "$DATA" -w -l "$DATA/server.log" \
        -o "-p $PORT -k /tmp -c shared_buffers=$sb" start >/dev/null
    echo "== shared_buffers=$sb"
    "$BIN" --only growth \
        --database-url "postgres://postgres@127.0.0.1:$PORT/postgres" \
        --out "$OUT/buffers-$sb.json"
    stop
done
