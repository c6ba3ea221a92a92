//! Time bounds: a handler that never returns cannot stall its consumer, nor
//! another instance on the same queue waiting behind its locks.

use std::time::Duration;

use e2e::consumer::{Env, Running, id, wait_until};
use lapin::types::AMQPValue;
use outbox_consumer::{Consumer, Event, Handler, Outcome};
use sqlx::{AssertSqlSafe, PgConnection};

/// Records each event's effect; an event whose body is `hang` writes its
/// effect, then never returns.
struct Hangs {
    sql: String,
}

impl Handler for Hangs {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        if let Err(e) = sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(event.id())
            .execute(conn)
            .await
        {
            return Outcome::retry(e);
        }
        if event.payload_bytes() == br#""hang""# {
            std::future::pending::<()>().await;
        }
        Outcome::Ack
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_never_returns_stalls_nothing_else() {
    let env = Env::new().await;
    let mut config = env.config("svc");
    config.prefetch = 10;
    config.batch_size = 10;
    config.handler_timeout = Duration::from_secs(1);
    // Longer than the handler's bound: the copy that waits on the hung
    // copy's inbox row gets it once that transaction is rolled back, and
    // then hangs (and times out) itself. With a shorter lock timeout it
    // could spend its retries on lock timeouts while the first still hangs
    // (a slow machine) and reach the DLQ for that reason instead.
    config.lock_timeout = Duration::from_secs(3);
    config.max_retries = 1;
    config.retry_delay = Duration::from_millis(50);
    let start = || {
        let h = Hangs {
            sql: format!("INSERT INTO {}.effects (event_id) VALUES ($1)", env.schema),
        };
        Running::start(Consumer::new(config.clone(), env.pool.clone(), h).unwrap())
    };
    let (a, b) = (start(), start());
    // Two copies of the hanging event, one per instance most likely: the
    // second waits on the first's inbox row.
    let hang = id();
    let mut messages = vec![(Some(hang.clone()), br#""hang""#.to_vec())];
    for _ in 0..100 {
        messages.push((Some(id()), b"{}".to_vec()));
    }
    messages.push((Some(hang.clone()), br#""hang""#.to_vec()));
    env.publish_all(&messages).await;

    wait_until("every other event applied", || async {
        env.count(&format!("{{s}}.effects WHERE event_id <> '{hang}'"))
            .await
            == 100
    })
    .await;
    // Both copies of the hanging event end in the DLQ with the reason.
    let dlq = env.take(&format!("{}.dlq", env.queue), 2).await;
    for m in &dlq {
        assert_eq!(m.properties.message_id().as_ref().unwrap().as_str(), hang);
        let reason = match m
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-dead-letter-reason").cloned())
        {
            Some(AMQPValue::LongString(s)) => s.to_string(),
            other => panic!("no reason: {other:?}"),
        };
        assert!(reason.contains("did not return within"), "{reason}");
    }
    a.stop().await;
    b.stop().await;
    // Quiet: nothing applied twice, the hanging event's effect rolled back.
    assert_eq!(env.count("{s}.effects").await, 100);
    assert_eq!(
        env.count(&format!("{{s}}.effects WHERE event_id = '{hang}'"))
            .await,
        0
    );
    env.teardown().await;
}

/// A batch whose transaction keeps failing while the database answers
/// (here: an inbox row another session holds locked) is not retried for
/// ever with its deliveries unacked: after `max_batch_attempts` its events
/// go one by one, the others are applied, and the blocked one goes through
/// the retry queue until the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_keeps_failing_is_split_and_only_the_culprit_waits() {
    let env = Env::new().await;
    let blocked = id();
    let others: Vec<String> = (0..5).map(|_| id()).collect();
    let mut messages = vec![(Some(blocked.clone()), b"{}".to_vec())];
    messages.extend(others.iter().map(|i| (Some(i.clone()), b"{}".to_vec())));
    env.publish_all(&messages).await;
    // Another session holds the blocked event's inbox row.
    let mut holder = env.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {0}.inbox_processed (consumer, event_id, event_at) VALUES ('svc', $1, {0}.inbox_event_time($1))",
        env.schema
    )))
    .bind(&blocked)
    .execute(&mut *holder)
    .await
    .unwrap();

    let mut config = env.config("svc");
    config.lock_timeout = Duration::from_millis(200);
    config.max_batch_attempts = 2;
    config.max_retries = 100;
    config.retry_delay = Duration::from_millis(50);
    config.max_retry_delay = Duration::from_millis(200);
    let h = Hangs {
        sql: format!("INSERT INTO {}.effects (event_id) VALUES ($1)", env.schema),
    };
    let c = Running::start(Consumer::new(config, env.pool.clone(), h).unwrap());
    wait_until(
        "the other events applied while the lock is held",
        || async {
            env.count(&format!("{{s}}.effects WHERE event_id <> '{blocked}'"))
                .await
                == 5
        },
    )
    .await;
    wait_until("the blocked event retried", || async {
        c.consumer.stats().retried >= 1
    })
    .await;
    holder.rollback().await.unwrap();
    wait_until(
        "the blocked event applied once the lock is gone",
        || async { env.count("{s}.effects").await == 6 },
    )
    .await;
    c.stop().await;
    assert_eq!(env.count("{s}.effects").await, 6, "an effect applied twice");
    env.teardown().await;
}
