#!/usr/bin/env bash
# Fails when a make target's package selection resolves a dependency's
# features differently from the whole workspace's test build: such a
# difference makes `make demo`, `make bench` or `make bench-smoke` rebuild
# dozens of crates after `make test` (and the other way round). The fix is
# a line in workspace-hack/Cargo.toml asking for the union.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}

features() {
    # One line per dependency (not the workspace's own packages): name,
    # version, enabled features.
    "$CARGO" tree "$@" -e normal,build --prefix none -f '{p} [{f}]' \
        | sed 's/ (\*)//; s/ (proc-macro)//' | grep -v '(/' | sort -u
}

reference=$(mktemp); trap 'rm -f "$reference" "$reference".sel' EXIT
features --workspace --all-features -e dev > "$reference"
status=0
# The selections of `make demo` and `make bench` / `make bench-smoke`.
for selection in "-p demo" "-p outbox-relay-ops -p bench"; do
    # shellcheck disable=SC2086
    features $selection > "$reference".sel
    differs=$(comm -13 "$reference" "$reference".sel)
    if [[ -n "$differs" ]]; then
        echo "check-feature-sets: \`cargo build $selection\` enables other features than the workspace build:" >&2
        echo "$differs" | sed 's/^/  /' >&2
        status=1
    fi
done
[[ $status == 0 ]] && echo "check-feature-sets: make targets share the workspace's feature set"
exit $status
