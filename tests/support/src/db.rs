//! The test database: pools, a migrated schema per test ([`TestDb`]),
//! replication slots, and row locks.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use outbox::testing::TestSchema;

use crate::{database_url, wait_until};

/// A pool on the test database whose sessions carry `application_name`
/// (so a test can find and terminate exactly its own backends).
pub async fn pool(application_name: &str, max: u32) -> PgPool {
    let options: PgConnectOptions = database_url().parse().expect("TEST_DATABASE_URL");
    PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options.application_name(application_name))
        .await
        .expect("test database reachable (run `make services`)")
}

/// A schema of its own ([`outbox::testing::TestSchema`], named
/// `t_<prefix>_<random>`), migrated as a producer's unless made
/// [`empty`](TestDb::empty). It is dropped (with its slot) by
/// [`TestDb::cleanup`]; when the last clone goes without it (a panicking
/// test), the schema goes with its `TestSchema` and a slot it had with its
/// guard.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// Pool for the test's own queries (the schema first on its
    /// `search_path`).
    pub pool: PgPool,
    /// The schema (`t_<prefix>_<random>`).
    pub schema: String,
    /// How [`TestDb::produce`] writes events: a table row, or (schemas of
    /// [`TestDb::producer_wal`]) a message in the write-ahead log.
    pub capture: outbox::Capture,
    /// Drops the schema when the last clone goes, unless cleaned up.
    owner: Arc<TestSchema>,
    /// [`TestDb::producer_wal`]'s: drops the slot when the last clone
    /// goes, unless cleaned up.
    slot_guard: Option<Arc<SlotGuard>>,
}

/// A schema's replication slot, dropped (with its publication) when the
/// last [`TestDb`] clone goes without [`TestDb::cleanup`] (a panicking
/// test): it would keep the server's WAL for ever.
#[derive(Debug)]
struct SlotGuard {
    slot: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slot = std::mem::take(&mut self.slot);
        if slot.is_empty() {
            return;
        }
        // No runtime to await on here (and the test's may be the one
        // panicking): a thread with a runtime and a connection of its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the cleanup");
            rt.block_on(async {
                let options: PgConnectOptions = database_url().parse().expect("TEST_DATABASE_URL");
                let Ok(pool) = PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_with(options.application_name(&format!("cleanup-{slot}")))
                    .await
                else {
                    return;
                };
                drop_slot(&pool, &slot).await;
                pool.close().await;
            });
        })
        .join();
        if dropped.is_err() {
            eprintln!("TestDb: a replication slot was not dropped");
        }
    }
}

impl TestDb {
    /// A fresh schema with nothing in it.
    pub async fn empty(prefix: &str) -> Self {
        let owner = TestSchema::with_prefix(&database_url(), prefix)
            .await
            .expect("test database reachable (run `make services`)");
        Self {
            pool: owner.pool().clone(),
            schema: owner.name().to_owned(),
            capture: outbox::Capture::Table,
            owner: Arc::new(owner),
            slot_guard: None,
        }
    }

    /// A fresh schema, migrated as a producer's.
    pub async fn producer(prefix: &str) -> Self {
        let db = Self::empty(prefix).await;
        outbox::migrate(&db.pool, &db.schema)
            .await
            .expect("migrate");
        db
    }

    /// A migrated schema with its write-ahead-log capture set up (what
    /// `outbox-relay migrate --capture wal` creates: an empty publication
    /// and the slot `outbox_<schema>`, recorded in `outbox_wal_capture`).
    /// [`TestDb::cleanup`] drops them;
    /// slots of test schemas that no longer exist (a failed run's) are
    /// dropped first, so none holds WAL for ever.
    pub async fn producer_wal(prefix: &str) -> Self {
        let mut db = Self::producer(prefix).await;
        db.capture = outbox::Capture::Wal;
        drop_orphan_slots(&db.pool).await;
        let slot = db.slot();
        db.slot_guard = Some(Arc::new(SlotGuard { slot: slot.clone() }));
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE PUBLICATION \"{slot}\"")))
            .execute(&db.pool)
            .await
            .expect("create publication");
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot)
            .execute(&db.pool)
            .await
            .expect("create slot (make services sets wal_level = logical)");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".outbox_wal_capture (slot) VALUES ($1)",
            db.schema
        )))
        .bind(&slot)
        .execute(&db.pool)
        .await
        .expect("record the slot");
        db
    }

    /// The schema's name as an identifier.
    pub fn ident(&self) -> outbox::Ident {
        outbox::Ident::new("schema", &self.schema).expect("a test schema is a valid name")
    }

    /// The schema's replication slot (and publication) name.
    pub fn slot(&self) -> String {
        format!("outbox_{}", self.schema)
    }

    /// The `application_name` of the session reading the schema's slot,
    /// if one does.
    pub async fn slot_reader(&self) -> Option<String> {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT a.application_name FROM pg_replication_slots s
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1",
        )
        .bind(self.slot())
        .fetch_optional(&self.pool)
        .await
        .expect("the slot's reader")
        .flatten()
    }

    /// An outbox handle on this schema writing with `capture`.
    pub async fn outbox(&self, capture: outbox::Capture) -> outbox::Outbox {
        let mut config = outbox::OutboxConfig::default();
        config.schema = self.schema.to_string();
        config.capture = capture;
        outbox::Outbox::new(&self.pool, config)
            .await
            .expect("outbox")
    }

    /// Rows in `table` of this schema.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\".{table}",
            self.schema
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count")
    }

    /// Commits events in the background, `per_tx` per transaction with
    /// `pace` between transactions, until `stop`; the task returns their
    /// ids. For faults that must land while events keep arriving.
    pub fn produce_until(
        &self,
        stop: tokio_util::sync::CancellationToken,
        per_tx: usize,
        pace: Duration,
    ) -> tokio::task::JoinHandle<Vec<String>> {
        let db = self.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            while !stop.is_cancelled() {
                ids.extend(db.produce(per_tx, per_tx, Duration::ZERO).await);
                tokio::time::sleep(pace).await;
            }
            ids
        })
    }

    /// [`produce`](Self::produce) in the background; the task returns the
    /// ids.
    pub fn spawn_produce(
        &self,
        n: usize,
        per_tx: usize,
        pace: Duration,
    ) -> tokio::task::JoinHandle<Vec<String>> {
        let db = self.clone();
        tokio::spawn(async move { db.produce(n, per_tx, pace).await })
    }

    /// Commits `n` events, `per_tx` per transaction (default wake-up; as
    /// [`TestDb::capture`] says),
    /// pausing `pace` between transactions; returns their ids in order.
    pub async fn produce(&self, n: usize, per_tx: usize, pace: Duration) -> Vec<String> {
        let ob = self.outbox(self.capture).await;
        let mut ids = Vec::with_capacity(n);
        for start in (0..n).step_by(per_tx.max(1)) {
            let events = (start..(start + per_tx).min(n)).map(|i| {
                let payload = format!("{{\"i\": {i}}}");
                outbox::NewEvent::from_json(
                    "order",
                    format!("o-{}", i % 97),
                    "OrderPlaced",
                    payload,
                )
                .expect("event")
            });
            let mut tx = self.pool.begin().await.expect("begin");
            let batch = ob.enqueue_many(&mut *tx, events).await.expect("enqueue");
            ob.commit(tx).await.expect("commit");
            ids.extend(batch.into_iter().map(|id| id.to_string()));
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
        }
        ids
    }

    /// For the oracle: waits until every event committed so far has been
    /// handled (published, or put in the outbox table by the log's reader)
    /// and the outbox table is empty. The slot's confirmed position must
    /// pass the log's end as it is now.
    pub async fn drained(&self, timeout: Duration) {
        if self.capture == outbox::Capture::Wal {
            let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
                .fetch_one(&self.pool)
                .await
                .expect("current WAL position");
            wait_until(timeout, "the slot to pass the log's end", || async {
                sqlx::query_scalar::<_, bool>(
                    "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots
                     WHERE slot_name = $1",
                )
                .bind(self.slot())
                .bind(&target)
                .fetch_optional(&self.pool)
                .await
                .ok()
                .flatten()
                .unwrap_or(false)
            })
            .await;
        }
        wait_until(timeout, "the outbox to empty", || async {
            self.count("outbox").await == 0
        })
        .await;
    }

    /// Drops the schema, and its slot and publication if it has them
    /// (ending a session still reading the slot).
    pub async fn cleanup(self) {
        drop_slot(&self.pool, &self.slot()).await;
        if let Some(Ok(mut guard)) = self.slot_guard.map(Arc::try_unwrap) {
            guard.slot.clear();
        }
        match Arc::try_unwrap(self.owner) {
            Ok(owner) => {
                if let Err(e) = owner.cleanup().await {
                    eprintln!("TestDb: schema {} not dropped: {e}", self.schema);
                }
            }
            // A clone lives on (a producer task, say): dropped now all
            // the same (its `TestSchema`'s drop finds nothing left).
            Err(shared) => {
                let dropped = sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                    shared.name()
                )))
                .execute(shared.pool())
                .await;
                if let Err(e) = dropped {
                    eprintln!("TestDb: schema {} not dropped: {e}", self.schema);
                }
            }
        }
    }
}

/// Drops replication slot `slot` (ending the session reading it) and its
/// publication.
pub async fn drop_slot(pool: &PgPool, slot: &str) {
    for _ in 0..100 {
        let active: Option<bool> =
            sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_optional(pool)
                .await
                .unwrap_or(Some(true));
        let step = match active {
            None => break,
            Some(true) => {
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1"
            }
            Some(false) => "SELECT pg_drop_replication_slot($1)",
        };
        let _ = sqlx::query(step).bind(slot).execute(pool).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP PUBLICATION IF EXISTS \"{slot}\""
    )))
    .execute(pool)
    .await;
}

/// Drops the slots and publications of test schemas (`outbox_t_...`) that
/// no longer exist: a failed run's leftovers.
pub async fn drop_orphan_slots(pool: &PgPool) {
    let orphans: Vec<String> = sqlx::query_scalar(
        "SELECT s.slot_name::text FROM pg_replication_slots s
         WHERE s.slot_name LIKE 'outbox\\_t\\_%' AND NOT s.active
           AND NOT EXISTS (SELECT 1 FROM pg_namespace n WHERE 'outbox_' || n.nspname = s.slot_name)
         UNION
         SELECT p.pubname::text FROM pg_publication p
         WHERE p.pubname LIKE 'outbox\\_t\\_%'
           AND NOT EXISTS (SELECT 1 FROM pg_namespace n WHERE 'outbox_' || n.nspname = p.pubname)",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    for slot in orphans {
        drop_slot(pool, &slot).await;
    }
}

/// Rows of `table` (a quoted, schema-qualified outbox table) that some
/// transaction holds locked right now: a relay's batch in flight.
pub async fn locked_rows(pool: &PgPool, table: &str) -> i64 {
    let mut tx = pool.begin().await.expect("begin");
    let (all, free): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {table}),
                (SELECT count(*) FROM (SELECT 1 FROM {table} FOR UPDATE SKIP LOCKED) f)"
    )))
    .fetch_one(&mut *tx)
    .await
    .expect("locked rows");
    tx.rollback().await.expect("rollback");
    all - free
}

/// A `REPEATABLE READ` transaction holding its snapshot, and with it the
/// database's xmin horizon (a long report, a forgotten `BEGIN` in psql),
/// on a connection of its own to `options`; checked to hold one. Ends
/// with `ROLLBACK` on it, or when it is dropped.
pub async fn hold_snapshot(options: &PgConnectOptions) -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let mut held = sqlx::PgConnection::connect_with(options)
        .await
        .expect("a connection");
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .execute(&mut held)
        .await
        .expect("the snapshot");
    let xmin: Option<String> = sqlx::query_scalar(
        "SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()",
    )
    .fetch_one(&mut held)
    .await
    .expect("its xmin");
    assert!(xmin.is_some(), "the snapshot holds the horizon");
    held
}

/// `table`'s sequential scans and the index entries its indexes returned,
/// after `pool`'s backend has flushed its statistics: give it a pool of
/// one connection (`pool(name, 1)`), so every statement runs in the
/// backend whose counts are flushed.
pub async fn scans(pool: &PgPool, schema: &str, table: &str) -> (i64, i64) {
    // The flush happens when the backend goes idle after this statement;
    // the next statement on the same backend starts after it.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .expect("flush");
    sqlx::query_as(
        "SELECT t.seq_scan, coalesce(sum(i.idx_tup_read), 0)::bigint
         FROM pg_stat_user_tables t LEFT JOIN pg_stat_user_indexes i ON i.relid = t.relid
         WHERE t.schemaname = $1 AND t.relname = $2 GROUP BY t.seq_scan",
    )
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .expect("scans")
}
