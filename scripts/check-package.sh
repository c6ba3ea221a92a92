#!/usr/bin/env bash
# `make package`: what `cargo publish` would upload of each published crate,
# checked without compiling it again (the workspace's own build already
# compiles every one of these sources; a verifying dry run compiled them and
# all their dependencies a second time, three to seven minutes of a CI run).
#
# For each crate: `cargo package --list` (which also checks the manifest:
# versions of path dependencies, metadata, files that exist), then every
# file its sources need is in that list: each `.rs` under `src/`, `build.rs`,
# the README the manifest names, and every file an `include_str!` or
# `include_bytes!` reads (migrations reached through a symlink, `.sql`
# templates beside their modules). A file the package leaves out fails here
# with its name, where a user's `cargo install` would fail to compile.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
# The published crates: package name and folder.
crates=(outbox-core:outbox-core outbox:outbox-lib outbox-consumer:consumer-lib
        outbox-relay:relay outbox-relay-ops:relay-ops)

say() { printf 'check-package: %s\n' "$*"; }
status=0
for entry in "${crates[@]}"; do
    name=${entry%%:*} dir=${entry#*:}
    listed=$("$CARGO" package --list --allow-dirty -p "$name")
    needed=$(
        cd "$dir"
        find src -name '*.rs' | sort
        [[ -f build.rs ]] && echo build.rs
        [[ -f README.md ]] && echo README.md
        # Every include_str!/include_bytes! path, relative to its source.
        grep -rnoE 'include_(str|bytes)!\("[^"]+"\)' src | while IFS=: read -r file _ call; do
            rel=${call#*\(\"}; rel=${rel%\"\)}
            # Normalise the path without following symlinks: the package
            # holds the file where the crate's tree has it.
            realpath -m --no-symlinks --relative-to=. "$(dirname "$file")/$rel"
        done
    )
    missing=$(comm -23 <(sort -u <<<"$needed") <(sort -u <<<"$listed"))
    if [[ -n "$missing" ]]; then
        say "$name leaves out files its sources need:" >&2
        sed 's/^/  /' <<<"$missing" >&2
        status=1
    else
        say "$name: $(wc -l <<<"$listed") files, every one its sources need"
    fi
done
exit "$status"
