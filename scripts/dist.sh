#!/usr/bin/env bash
# `make dist`: the relay as shipped. Builds `outbox-relay` with the `dist`
# cargo profile (Cargo.toml) and writes, in target/dist/:
#
#   outbox-relay        stripped of its debug info (symbols kept, so a panic's
#                       backtrace still names functions), with a
#                       .gnu_debuglink to:
#   outbox-relay.debug  the debug info (line tables), zlib-compressed; gdb
#                       and perf find it next to the binary (the link) or
#                       in /usr/lib/debug/.build-id/ (the build id)
#   outbox-relay-<version>-<target triple>.tar.gz
#                       the binary, README.md, OPERATIONS.md, LICENSE files
#                       (when present) and deploy/ (when present)
#
# target/dist/ is also cargo's output directory for the profile: cargo
# writes the unstripped binary there, and this script replaces it with a new
# file (never in place: cargo's copy in deps/ stays whole for the next run).
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
target_dir=${CARGO_TARGET_DIR:-target}
dist=$target_dir/dist
max_bytes=$((25 * 1024 * 1024))

say() { printf 'dist: %s\n' "$*"; }
for tool in objcopy tar gzip; do
    command -v "$tool" >/dev/null || { say "needs $tool (binutils, tar, gzip)" >&2; exit 1; }
done

"$CARGO" build --locked --profile dist -p outbox-relay-ops --bin outbox-relay
bin=$dist/outbox-relay
tmp=$(mktemp -d "$dist/.strip.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Split: the debug info into its own file, then the binary without it and
# with a link (name and CRC) to that file. A binary without any debug
# section is one this script already stripped: cargo did not write it.
if ! objcopy --dump-section .debug_line="$tmp/probe" "$bin" /dev/null 2>/dev/null; then
    say "$bin has no debug info (already stripped?): rebuild with cargo clean --profile dist" >&2
    exit 1
fi
objcopy --only-keep-debug --compress-debug-sections=zlib "$bin" "$tmp/outbox-relay.debug"
# (The link records the file's name, not its directory.)
objcopy --strip-debug --add-gnu-debuglink="$tmp/outbox-relay.debug" "$bin" "$tmp/outbox-relay"
mv -f "$tmp/outbox-relay.debug" "$dist/outbox-relay.debug"
mv -f "$tmp/outbox-relay" "$bin"

size=$(stat -c %s "$bin")
if ((size > max_bytes)); then
    say "$bin is $size bytes, over the 25 MiB budget" >&2
    exit 1
fi

# The version as the binary itself reports it: `outbox-relay 0.1.0 (...)`.
version=$("$bin" --version | awk '{print $2}')
triple=${CARGO_BUILD_TARGET:-$(rustc -vV | sed -n 's/^host: //p')}
name=outbox-relay-$version-$triple
stage=$tmp/$name
mkdir -p "$stage"
cp "$bin" "$stage/"
cp relay-ops/README.md "$stage/README.md"
cp docs/OPERATIONS.md "$stage/OPERATIONS.md"
for license in LICENSE*; do [[ -e $license ]] && cp "$license" "$stage/"; done
[[ -d deploy ]] && cp -r deploy "$stage/deploy"
# Same bytes for the same commit: sorted names, no owner, the commit's time.
mtime=$(git log -1 --format=%ct 2>/dev/null || date +%s)
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$mtime" \
    -C "$tmp" -cf - "$name" | gzip -n -9 >"$dist/$name.tar.gz"

say "$("$bin" --version)"
say "$bin: $size bytes (stripped, symbols kept)"
say "$dist/outbox-relay.debug: $(stat -c %s "$dist/outbox-relay.debug") bytes (compressed debug info)"
say "$dist/$name.tar.gz: $(stat -c %s "$dist/$name.tar.gz") bytes"
