#!/usr/bin/env bash
# `make profile`: a CPU profile of the relay binary while it drains a
# backlog, as a flame graph (docs/BENCHMARKS.md, "Where the relay's CPU
# goes"). Runs the benchmark's relay section (`bench --only relay`, or the
# WAL drain with CAPTURE=wal), attaches `perf record` (software clock:
# shared machines often have no hardware counters; DWARF call graphs, the
# relay's release build keeps line tables) to the first relay process it
# starts, and renders target/profile/relay-<capture>.svg plus the folded
# stacks and a table of the hottest frames beside it.
#
# Installs linux-perf (Debian's package) and inferno (crates.io) when
# missing. Needs the services (`make services`) and release binaries
# (`make bench` builds them; this script builds them too).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
target_dir=${CARGO_TARGET_DIR:-target}
capture=${CAPTURE:-table}
out=$target_dir/profile
say() { printf 'profile: %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v perf >/dev/null; then
    say "installing linux-perf from the system's packages"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends linux-perf >/dev/null
fi
for tool in inferno-collapse-perf inferno-flamegraph; do
    command -v "$tool" >/dev/null && continue
    say "installing inferno from crates.io"
    "$CARGO" install --locked -q inferno
    break
done

case $capture in
    table) section=relay ;;
    wal) section=wal-drain ;;
    *) say "CAPTURE is table or wal, not $capture" >&2; exit 1 ;;
esac
"$CARGO" build --release -q -p outbox-relay-ops -p bench
mkdir -p "$out"
data=$out/relay-$capture.perf.data
"$target_dir/release/bench" --only "$section" --out "$out/bench-$capture.json" >"$out/bench-$capture.log" 2>&1 &
bench=$!
trap 'kill $bench 2>/dev/null || true' EXIT

# The first relay the bench starts (it starts one per measured round).
pid=
for _ in $(seq 1 1200); do
    pid=$(pgrep -P "$bench" -x outbox-relay | head -n1 || true)
    [ -n "$pid" ] && break
    kill -0 "$bench" 2>/dev/null || { say "the bench ended before it started a relay; see $out/bench-$capture.log" >&2; exit 1; }
    sleep 0.5
done
[ -n "$pid" ] || { say "no relay process within 10 minutes" >&2; exit 1; }
say "recording relay pid $pid ($capture capture) until it exits"
perf record -q -e cpu-clock -F 499 --call-graph dwarf,16384 -p "$pid" -o "$data" 2>/dev/null || true
kill "$bench" 2>/dev/null || true
wait "$bench" 2>/dev/null || true

perf script -i "$data" 2>/dev/null | inferno-collapse-perf >"$out/relay-$capture.folded"
inferno-flamegraph --title "outbox-relay draining a backlog ($capture capture)" \
    <"$out/relay-$capture.folded" >"$out/relay-$capture.svg"
# Self time by frame: the last frame of each stack, summed.
awk '{ n = $NF; $NF = ""; k = split($0, f, ";"); leaf = f[k]; sub(/ +$/, "", leaf); s[leaf] += n; t += n }
     END { for (l in s) printf "%6.2f%%  %s\n", 100 * s[l] / t, l }' "$out/relay-$capture.folded" |
    sort -rn | head -n 30 >"$out/relay-$capture.top.txt"
say "wrote $out/relay-$capture.svg, $out/relay-$capture.folded and $out/relay-$capture.top.txt"
