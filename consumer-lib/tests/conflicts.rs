//! A batch transaction that loses to a concurrent one (a deadlock, 40P01;
//! a serialization failure, 40001) is run again at once and counted in
//! `outbox_consumer_transaction_retries_total` (`ConsumerStats`): not
//! through the retry queue, not counted against `max_retries` or
//! `max_batch_attempts`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::consumer::{Env, Running, id, wait_until};
use outbox_consumer::{
    BatchHandler, BatchOutcome, Consumer, ConsumerStats, Event, Handler, Outcome,
};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

/// What a test's handler saw: the retry count of the delivery at each
/// call. Shared with the test, which reads it.
#[derive(Default)]
struct Calls(Mutex<Vec<u32>>);

impl Calls {
    /// Records a call; true for the first one.
    fn first(&self, event: &Event) -> bool {
        let mut calls = self.0.lock().unwrap();
        calls.push(event.retry_count());
        calls.len() == 1
    }

    fn retry_counts(&self) -> Vec<u32> {
        self.0.lock().unwrap().clone()
    }
}

fn effect_sql(schema: &str) -> String {
    format!("INSERT INTO {schema}.effects (event_id) VALUES ($1)")
}

/// Runs `consumer` on one event, then judges a conflict's cost: one
/// rerun at once (`reruns`: deadlocks, serialization failures), the
/// handler called `calls` times with the same delivery (retry count 0:
/// not a copy from the retry queue), nothing retried, one effect.
async fn one_event_rerun_once(
    env: Env,
    consumer: Consumer,
    seen: &Calls,
    calls: usize,
    reruns: (u64, u64),
) {
    let c = Running::start(consumer);
    env.publish(Some(&id()), "{}").await;
    wait_until("processed", || async { c.consumer.stats().processed == 1 }).await;
    let s: ConsumerStats = c.consumer.stats();
    assert_eq!(
        (s.processed, s.retried, s.rejected),
        (1, 0, 0),
        "processed once, never sent to the retry queue: {s:?}"
    );
    assert_eq!(
        seen.retry_counts(),
        vec![0; calls],
        "the handler ran on the same delivery, not on a copy from the retry queue"
    );
    assert_eq!(
        (s.deadlock_retries, s.serialization_retries),
        reruns,
        "{s:?}"
    );
    assert_eq!(env.count("{s}.effects").await, 1, "the effect landed once");
    c.stop().await;
    env.teardown().await;
}

/// A real deadlock, this batch its victim: the handler holds row A and
/// waits for row B, which another transaction holds while it waits for A.
/// The handler waits first, so its own check after `deadlock_timeout`
/// finds the cycle and aborts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_deadlocked_by_another_transaction_reruns_its_batch_at_once() {
    struct Deadlocks {
        schema: String,
        pool: PgPool,
        calls: Arc<Calls>,
    }
    impl Handler for Deadlocks {
        async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
            let first = self.calls.first(event);
            let s = &self.schema;
            let lock = |sku: &str| format!("UPDATE {s}.stock SET qty = qty WHERE sku = '{sku}'");
            if let Err(e) = sqlx::query(AssertSqlSafe(effect_sql(s)))
                .bind(event.id())
                .execute(&mut *conn)
                .await
            {
                return e.into();
            }
            if !first {
                return Outcome::Ack;
            }
            // This transaction detects the cycle (1 s after it starts
            // waiting), the other one never does first.
            let mine = format!("SET LOCAL deadlock_timeout = '1s'; {}", lock("A"));
            if let Err(e) = sqlx::raw_sql(AssertSqlSafe(mine)).execute(&mut *conn).await {
                return e.into();
            }
            let mut other = self.pool.begin().await.unwrap();
            let theirs = format!("SET LOCAL deadlock_timeout = '60s'; {}", lock("B"));
            sqlx::raw_sql(AssertSqlSafe(theirs))
                .execute(&mut *other)
                .await
                .unwrap();
            let wants_a = lock("A");
            tokio::spawn(async move {
                // Waits for A once this handler waits for B.
                tokio::time::sleep(Duration::from_millis(200)).await;
                sqlx::raw_sql(AssertSqlSafe(wants_a))
                    .execute(&mut *other)
                    .await
                    .unwrap();
                other.commit().await.unwrap();
            });
            match sqlx::raw_sql(AssertSqlSafe(lock("B")))
                .execute(&mut *conn)
                .await
            {
                Err(e) => e.into(),
                Ok(_) => Outcome::reject("no deadlock: the test did not provoke one"),
            }
        }
    }
    let env = Env::new().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {}.stock VALUES ('B', 1)",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .unwrap();
    let calls = Arc::new(Calls::default());
    let handler = Deadlocks {
        schema: env.schema.clone(),
        pool: env.pool.clone(),
        calls: calls.clone(),
    };
    let consumer = Consumer::new(env.config("svc"), env.pool.clone(), handler).unwrap();
    one_event_rerun_once(env, consumer, &calls, 2, (1, 0)).await;
}

/// A batch handler that reports a deadlock (here raised on purpose, with
/// its SQLSTATE) as `e.into()`: every event of the batch waits for the
/// retry queue otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handlers_deadlock_reruns_the_batch_instead_of_retrying_its_events() {
    struct DeadlocksOnce {
        sql: String,
        calls: Arc<Calls>,
    }
    impl BatchHandler for DeadlocksOnce {
        async fn handle_batch(&self, conn: &mut PgConnection, events: &[Event]) -> BatchOutcome {
            if self.calls.first(&events[0]) {
                let raised = sqlx::raw_sql(
                    "DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40P01'; END $$",
                )
                .execute(&mut *conn)
                .await;
                return BatchOutcome::All(raised.expect_err("raised").into());
            }
            for e in events {
                if let Err(err) = sqlx::query(AssertSqlSafe(self.sql.clone()))
                    .bind(e.id())
                    .execute(&mut *conn)
                    .await
                {
                    return BatchOutcome::All(err.into());
                }
            }
            BatchOutcome::All(Outcome::Ack)
        }
    }
    let env = Env::new().await;
    let calls = Arc::new(Calls::default());
    let handler = DeadlocksOnce {
        sql: effect_sql(&env.schema),
        calls: calls.clone(),
    };
    let consumer =
        Consumer::with_batch_handler(env.config("svc"), env.pool.clone(), handler).unwrap();
    one_event_rerun_once(env, consumer, &calls, 2, (1, 0)).await;
}

/// A serialization failure of one of the library's own statements (the
/// inbox's record of the keys, failed once by a trigger): the batch runs again at once,
/// not after a backoff counted against `max_batch_attempts` (here 1: a
/// counted failure would split the batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_of_the_inbox_record_reruns_the_batch_at_once() {
    struct Effect {
        sql: String,
        calls: Arc<Calls>,
    }
    impl Handler for Effect {
        async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
            self.calls.first(event);
            match sqlx::query(AssertSqlSafe(self.sql.clone()))
                .bind(event.id())
                .execute(conn)
                .await
            {
                Ok(_) => Outcome::Ack,
                Err(e) => e.into(),
            }
        }
    }
    let env = Env::new().await;
    let s = &env.schema;
    // A sequence is not rolled back with the failed statement.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SEQUENCE {s}.claims;
         CREATE FUNCTION {s}.fail_first_claim() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('{s}.claims') = 1 THEN
                 RAISE EXCEPTION 'injected' USING ERRCODE = '40001';
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER fail_first_claim BEFORE INSERT ON {s}.inbox_processed
             FOR EACH STATEMENT EXECUTE FUNCTION {s}.fail_first_claim();"
    )))
    .execute(&env.pool)
    .await
    .unwrap();
    let mut cfg = env.config("svc");
    cfg.max_batch_attempts = 1;
    let calls = Arc::new(Calls::default());
    let handler = Effect {
        sql: effect_sql(s),
        calls: calls.clone(),
    };
    let consumer = Consumer::new(cfg, env.pool.clone(), handler).unwrap();
    // The claim failed before the handler ran: it is called once.
    one_event_rerun_once(env, consumer, &calls, 1, (0, 1)).await;
}

/// The reruns are bounded: a handler that reports a conflict every time
/// ends, after them, as an ordinary failure (the batch split, the event
/// through the retry queue and, out of retries, dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_always_conflicts_is_not_rerun_for_ever() {
    struct AlwaysConflicts;
    impl Handler for AlwaysConflicts {
        async fn handle(&self, conn: &mut PgConnection, _: &Event) -> Outcome {
            sqlx::raw_sql("DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$")
                .execute(conn)
                .await
                .expect_err("raised")
                .into()
        }
    }
    let env = Env::new().await;
    let mut cfg = env.config("svc");
    cfg.max_batch_attempts = 1;
    cfg.max_retries = 0;
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), AlwaysConflicts).unwrap());
    env.publish(Some(&id()), "{}").await;
    env.take(&format!("{}.dlq", env.queue), 1).await;
    // The dead letter can be in the queue a moment before the consumer
    // counts it (it counts once the DLQ publish is confirmed).
    wait_until("the rejection counted", || async {
        c.consumer.stats().rejected == 1
    })
    .await;
    let s = c.consumer.stats();
    assert_eq!(s.rejected, 1, "{s:?}");
    assert!(
        (10..=40).contains(&s.serialization_retries),
        "bounded reruns, each counted: {s:?}"
    );
    c.stop().await;
    env.teardown().await;
}
