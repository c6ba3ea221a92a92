#!/usr/bin/env bash
# Makes sure PostgreSQL and RabbitMQ run on loopback, as the tests, the demo
# and the benchmark need them. Quick no-op when both are up; starts them when
# installed but stopped; installs them from Debian/Ubuntu packages when
# missing (needs root). Prints what it did.
set -euo pipefail

PG_HOST=127.0.0.1 PG_PORT=5432 AMQP_PORT=5672
say() { printf 'services: %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_for() { # name, check command..., waits up to 60 s
    local name=$1; shift
    for _ in $(seq 1 120); do "$@" && return 0; sleep 0.5; done
    say "$name did not come up within 60 s" >&2; return 1
}
apt_install() {
    command -v apt-get >/dev/null || { say "cannot install $*: no apt-get (install them by hand)" >&2; exit 1; }
    say "installing $* from the system's packages"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
pg_ready() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT"; }
pg_psql() { psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

# --- PostgreSQL -------------------------------------------------------------
if command -v pg_isready >/dev/null && pg_ready; then
    say "postgresql already running on $PG_HOST:$PG_PORT"
else
    if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
        apt_install postgresql postgresql-client
    fi
    ver=$(ls /etc/postgresql | sort -V | tail -n1)
    conf=/etc/postgresql/$ver/main
    # Loopback only, trust auth for local test use.
    if ! grep -q "^host all all 127.0.0.1/32 trust" "$conf/pg_hba.conf"; then
        as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\nlocal all all trust' "$conf/pg_hba.conf"
        say "postgresql: trust auth on loopback"
    fi
    grep -q "^listen_addresses" "$conf/postgresql.conf" ||
        echo "listen_addresses = '127.0.0.1'" | as_root tee -a "$conf/postgresql.conf" >/dev/null
    say "starting postgresql $ver"
    as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
    wait_for postgresql pg_ready
    say "postgresql started"
fi
# Logical decoding (the relay's write-ahead-log capture mode reads a
# logical replication slot) needs wal_level = logical; the test suite runs
# several slots and replication sessions at once (one per WAL test, two
# relays in the handover tests): 20 of each. Set once, which takes a
# restart; a no-op after that.
if [ "$(pg_psql -d postgres -c 'SHOW wal_level')" != logical ] ||
   [ "$(pg_psql -d postgres -c 'SHOW max_replication_slots')" -lt 20 ] ||
   [ "$(pg_psql -d postgres -c 'SHOW max_wal_senders')" -lt 20 ]; then
    pg_psql -d postgres -c "ALTER SYSTEM SET wal_level = logical"
    pg_psql -d postgres -c "ALTER SYSTEM SET max_replication_slots = 20"
    pg_psql -d postgres -c "ALTER SYSTEM SET max_wal_senders = 20"
    ver=$(ls /etc/postgresql | sort -V | tail -n1)
    say "postgresql: wal_level = logical, 20 replication slots and WAL senders, restarting $ver once"
    as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main restart
    wait_for postgresql pg_ready
    [ "$(pg_psql -d postgres -c 'SHOW wal_level')" = logical ] ||
        { say "postgresql: wal_level is still not logical (is it set in postgresql.conf by something else?)" >&2; exit 1; }
fi
for db in test root; do
    if [ "$(pg_psql -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
        pg_psql -d postgres -c "CREATE DATABASE \"$db\""
        say "created database $db"
    fi
done

# --- RabbitMQ ---------------------------------------------------------------
if port_open "$AMQP_PORT"; then
    say "rabbitmq already running on 127.0.0.1:$AMQP_PORT"
else
    command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
    say "starting rabbitmq"
    as_root rabbitmq-server -detached || true
    wait_for rabbitmq port_open "$AMQP_PORT"
    # The port opens before the node accepts work; wait for the app too.
    wait_for rabbitmq as_root rabbitmqctl -q await_startup
    say "rabbitmq started"
fi
# Ordered consumption with several partition queues routes through the
# consistent-hash exchange, a plugin shipped with RabbitMQ (off by default).
if ! as_root rabbitmq-plugins -q is_enabled rabbitmq_consistent_hash_exchange >/dev/null 2>&1; then
    as_root rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null
    say "rabbitmq: enabled rabbitmq_consistent_hash_exchange"
fi
# At-least-once dead-lettering (the consumer's retry path on quorum queues)
# re-sends what a full or missing target refused after this long; RabbitMQ's
# default is 3 minutes. In the config for restarts, and at once.
DLX_RESEND_MS=5000
adv=/etc/rabbitmq/advanced.config
if ! as_root grep -qs dead_letter_worker_publisher_confirm_timeout "$adv"; then
    if as_root test -s "$adv"; then
        say "rabbitmq: $adv exists: add {rabbit, [{dead_letter_worker_publisher_confirm_timeout, $DLX_RESEND_MS}]} to it by hand" >&2
    else
        echo "[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, $DLX_RESEND_MS}]}]." | as_root tee "$adv" >/dev/null
        say "rabbitmq: dead-letter resend after $DLX_RESEND_MS ms ($adv)"
    fi
fi
as_root rabbitmqctl -q eval "application:set_env(rabbit, dead_letter_worker_publisher_confirm_timeout, $DLX_RESEND_MS)." >/dev/null
say "ready: postgres://postgres@$PG_HOST:$PG_PORT/test and amqp://guest:***@127.0.0.1:$AMQP_PORT/%2f"
