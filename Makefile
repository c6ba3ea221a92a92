# Transactional outbox toolkit. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

export DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
export AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/%2f
export TEST_DATABASE_URL ?= $(DATABASE_URL)
export TEST_AMQP_URL ?= $(AMQP_URL)
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
# Locks that keep apart runs that must not overlap when run side by side
# (CI runs the benchmark smoke beside `make test`): the smoke holds both,
# shared; the tests that restart the default broker or the database take
# `default-node`, the cluster suite (it stops and starts nodes) `cluster`.
LOCKS := $(TARGET_DIR)/locks

.PHONY: help services browser cluster test-cluster package doc build test lint check-deploy fmt demo bench bench-smoke profile soak clean-test-schemas dist image-test

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-20s %s\n", $$1, $$2}'

services: ## make sure PostgreSQL and RabbitMQ run on loopback (install/start them if needed)
	@./scripts/services.sh

browser: ## make sure chromium and chromedriver are installed (the console's browser tests; installs them if needed)
	@./scripts/browser.sh

cluster: ## start a local three-node RabbitMQ cluster on ports 5701-5703 (the cluster suite) and a standalone node on 5704 (the alarm test)
	@./scripts/cluster.sh start

build: ## build everything
	$(CARGO) build --workspace --all-targets

test: ## run every test (unit, database, broker, end-to-end, browser, the cluster suite) against the real services
	@# The test brokers beside the default node (a quick no-op when they
	@# run): the three-node cluster and the standalone node.
	@./scripts/cluster.sh start
	@# The five-minute alarm runs on the standalone node (it blocks every
	@# publisher of its broker), beside the tests of the default broker; its
	@# lines have a prefix. (The cluster suite beside them too made each
	@# run half again as slow: two cores.)
	mkdir -p $(LOCKS); \
	( set -o pipefail; TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:5704/%2f TEST_RABBITMQCTL="$(CURDIR)/scripts/cluster.sh ctl solo" \
	  $(CARGO) nextest run --workspace --all-features --no-fail-fast --test-threads 1 -E 'test(/^disruptive_broker_alarm/)' 2>&1 | sed -u 's/^/alarm| /' ) & alarm=$$!; \
	$(CARGO) nextest run --workspace --all-features --no-fail-fast -E 'not test(/^disruptive_/) and not test(/^cluster_/)'; rest=$$?; \
	wait $$alarm; alarm=$$?; \
	echo "make test: the default broker's tests $$rest, the alarm $$alarm (0: passed)"; \
	test $$rest -eq 0 -a $$alarm -eq 0
	@# Tests that restart the default broker or the database run alone.
	flock $(LOCKS)/default-node $(CARGO) nextest run --workspace --all-features --no-fail-fast --test-threads 1 -E 'test(/^disruptive_/) and not test(/^disruptive_broker_alarm/)'
	@# The fault suite on the three-node cluster, one test at a time (it
	@# stops and starts the cluster's nodes).
	flock $(LOCKS)/cluster $(CARGO) nextest run --workspace --all-features --no-fail-fast --test-threads 1 -E 'test(/^cluster_/)'
	$(CARGO) test --workspace --all-features --doc

test-cluster: cluster ## the fault suite on the three-node cluster with quorum queues (stops and starts its nodes; runs alone)
	$(CARGO) nextest run --workspace --all-features --no-fail-fast --test-threads 1 -E 'test(/^cluster_/)'

package: ## cargo publish --dry-run of the published crates, without compiling them again: every file their sources need is in the package (scripts/check-package.sh)
	$(CARGO) publish --dry-run --no-verify -p outbox-core -p outbox -p outbox-consumer -p outbox-relay -p outbox-relay-ops
	./scripts/check-package.sh

lint: ## rustfmt and clippy, warnings are errors; make targets share one feature set
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	./scripts/check-feature-sets.sh
	./scripts/check-deploy.sh

check-deploy: ## check deploy/: Kubernetes manifests, systemd unit, alert rules and their tests, dashboard (installs promtool, kubernetes-validate if missing)
	./scripts/check-deploy.sh

doc: ## API docs of the published crates as docs.rs builds them (all features); rustdoc warnings are errors
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --all-features -p outbox-core -p outbox -p outbox-consumer -p outbox-relay -p outbox-relay-ops

fmt: ## format the code
	$(CARGO) fmt --all

demo: services ## the whole story on this machine: migrate, produce, relay, consume, report
	$(CARGO) run --release -q -p demo

bench: services cluster ## benchmark against the local services (about 85 minutes; `--only` in docs/BENCHMARKS.md runs a part); writes target/bench/results.json
	$(CARGO) build --release -q -p outbox-relay-ops -p bench
	$(TARGET_DIR)/release/bench --out target/bench/results.json

profile: services ## a CPU profile of the relay draining a backlog: target/profile/relay-table.svg (CAPTURE=wal for the log; installs perf and inferno if missing)
	./scripts/profile.sh

bench-smoke: cluster ## the benchmark with tiny counts (CI runs this so it cannot rot)
	$(CARGO) build -q -p outbox-relay-ops -p bench
	mkdir -p $(LOCKS)
	flock -s $(LOCKS)/default-node flock -s $(LOCKS)/cluster $(TARGET_DIR)/debug/bench --smoke --latency-stages --out target/bench/smoke.json

dist: ## the relay as shipped: stripped target/dist/outbox-relay, its .debug file and a tarball (profile dist)
	./scripts/dist.sh

image-test: services dist ## build deploy/Containerfile with podman (local base) and run it: migrate, 1,000 events, SIGTERM
	./scripts/image-test.sh

soak: services ## the fault-injection suite with 10x the events (longer; not part of CI)
	FAULT_SCALE=10 $(CARGO) nextest run --profile soak --workspace --all-features --no-fail-fast --test-threads 2 -E 'package(e2e-tests) and not test(/^disruptive_/) and not test(/^cluster_/)'
	FAULT_SCALE=10 $(CARGO) nextest run --profile soak --workspace --all-features --no-fail-fast --test-threads 1 -E 'package(e2e-tests) and test(/^disruptive_/)'

clean-test-schemas: ## drop schemas, replication slots, publications, databases and roles left behind by failed test runs
	psql "$(TEST_DATABASE_URL)" -qAt -c "SELECT 'DROP SCHEMA \"' || nspname || '\" CASCADE;' FROM pg_namespace WHERE nspname LIKE 't\_%'" | psql "$(TEST_DATABASE_URL)" -q
	psql "$(TEST_DATABASE_URL)" -qAt -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'outbox\_t\_%' AND NOT active" >/dev/null
	psql "$(TEST_DATABASE_URL)" -qAt -c "SELECT 'DROP PUBLICATION \"' || pubname || '\";' FROM pg_publication WHERE pubname LIKE 'outbox\_t\_%'" | psql "$(TEST_DATABASE_URL)" -q
	psql "$(TEST_DATABASE_URL)" -qAt -c "SELECT 'DROP DATABASE \"' || datname || '\" WITH (FORCE);' FROM pg_database WHERE datname LIKE 't\_%'" | psql "$(TEST_DATABASE_URL)" -q
	psql "$(TEST_DATABASE_URL)" -qAt -c "SELECT 'DROP ROLE \"' || rolname || '\";' FROM pg_roles WHERE rolname LIKE 't\_reader\_%'" | psql "$(TEST_DATABASE_URL)" -q
