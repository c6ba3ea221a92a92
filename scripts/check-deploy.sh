#!/usr/bin/env bash
# Checks the deployment files in deploy/ (`make lint` runs it):
#   - the Kubernetes manifests against the API's schemas (kubernetes-validate,
#     schemas bundled, --strict: an unknown field is an error);
#   - the systemd unit with `systemd-analyze verify` (any warning fails) and
#     its exposure with `systemd-analyze security`;
#   - the Prometheus rules with `promtool check rules` and their unit tests
#     with `promtool test rules`;
#   - the Grafana dashboard is JSON.
# Installs what is missing, once: Debian's `prometheus` package for promtool
# (its service is not started) and kubernetes-validate into a virtualenv
# under target/. Idempotent; the metric names the rules and the dashboard
# use are checked against a running relay and consumer by
# relay-ops/tests/deploy_metrics.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBERNETES_VALIDATE_VERSION=1.37.0
# The Kubernetes API version the manifests are checked against.
KUBERNETES_VERSION=1.30
TARGET_DIR=${CARGO_TARGET_DIR:-target}
VENV=$TARGET_DIR/deploy-tools/venv

say() { echo "check-deploy: $*"; }

install_promtool() {
    command -v promtool >/dev/null && return
    say "installing promtool (Debian's prometheus package; its service is not started)"
    export DEBIAN_FRONTEND=noninteractive
    # Keep the package's postinst from starting the Prometheus server.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 0755 "$policy"
        own_policy=1
    fi
    if ! apt-get install -y -q --no-install-recommends prometheus >/dev/null; then
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends prometheus >/dev/null
    fi
    if [[ $own_policy == 1 ]]; then
        rm -f "$policy"
    fi
    # Where systemd runs, make sure the server stays off.
    if [[ -d /run/systemd/system ]]; then
        systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
}

install_kubernetes_validate() {
    if [[ -x $VENV/bin/kubernetes-validate ]] &&
        [[ $("$VENV/bin/pip" show kubernetes-validate 2>/dev/null | sed -n 's/^Version: //p') == "$KUBERNETES_VALIDATE_VERSION" ]]; then
        return
    fi
    say "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION into $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
}

install_promtool
install_kubernetes_validate

say "Kubernetes manifests (API $KUBERNETES_VERSION, strict)"
"$VENV/bin/kubernetes-validate" --strict --kubernetes-version "$KUBERNETES_VERSION" deploy/kubernetes/*.yaml deploy/kubernetes/fleet/*.yaml

say "systemd unit"
# `verify` needs ExecStart's binary to exist: check a copy that runs
# /bin/true instead of /usr/local/bin/outbox-relay (nothing else changes).
unit_dir=$(mktemp -d)
trap 'rm -rf "$unit_dir"' EXIT
sed 's|^ExecStart=/usr/local/bin/outbox-relay |ExecStart=/bin/true |' \
    deploy/systemd/outbox-relay.service > "$unit_dir/outbox-relay.service"
grep -q '^ExecStart=/bin/true run$' "$unit_dir/outbox-relay.service" ||
    { say "ExecStart of deploy/systemd/outbox-relay.service is not /usr/local/bin/outbox-relay run"; exit 1; }
# `verify` only warns about unknown keys or bad values (exit 0): any output fails.
verify_out=$(systemd-analyze verify "$unit_dir/outbox-relay.service" 2>&1) || { echo "$verify_out"; exit 1; }
if [[ -n $verify_out ]]; then
    echo "$verify_out"
    say "systemd-analyze verify warned about deploy/systemd/outbox-relay.service"
    exit 1
fi
# Exposure 0 (locked down) to 10 (unprotected); the unit scores 1.2. The
# threshold is in tenths: fail above 2.0.
systemd-analyze security --offline=true --threshold=20 --no-pager "$unit_dir/outbox-relay.service" |
    tail -n 1

say "Prometheus rules"
promtool check rules deploy/prometheus/alerts.yml
promtool test rules deploy/prometheus/alerts_test.yml

say "Grafana dashboard"
# Every panel's query must parse as PromQL: they become recording rules
# (Grafana's variables replaced by values) that promtool checks.
python3 - deploy/grafana/outbox.json "$unit_dir/dashboard-rules.yml" <<'PY'
import json, sys

dashboard = json.load(open(sys.argv[1]))
assert dashboard["schemaVersion"] >= 39, "schemaVersion"
names = [v["name"] for v in dashboard["templating"]["list"]]
assert "datasource" in names, "no datasource variable"
values = {"$__rate_interval": "5m", "$__range": "1h", "$job": ".*", "$consumer": ".*"}
rules = []
for panel in dashboard["panels"]:
    if panel["type"] == "row":
        continue
    assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert panel["targets"], f"panel {panel['title']!r} has no query"
    for target in panel["targets"]:
        expr = target["expr"]
        for var, value in values.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"panel {panel['title']!r}: unknown variable in {expr}"
        rules.append({"record": f"dashboard:panel_{panel['id']}_{target['refId']}", "expr": expr})
json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(sys.argv[2], "w"), indent=1)
print(f"{len(rules)} queries in {sum(p['type'] != 'row' for p in dashboard['panels'])} panels")
PY
promtool check rules "$unit_dir/dashboard-rules.yml" >/dev/null

say "deploy/ is valid"
