//! Supervision: the consumer waits out a missing queue (or a broker that
//! is away) with backoff and resumes by itself.

mod common;

use common::{Env, Running, id, wait_until};
use outbox_consumer::{Consumer, Error, Event, Handler, Outcome};
use sqlx::PgConnection;

struct Ack;

impl Handler for Ack {
    async fn handle(&self, _: &mut PgConnection, _: &Event) -> Outcome {
        Outcome::Ack
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_by_itself_once_the_queue_exists() {
    let mut env = Env::new().await;
    let late = format!("{}_late", env.queue);
    let mut cfg = env.config("svc");
    cfg.queue = late.clone();
    cfg.declare_retry_queues = false;
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Ack).unwrap());
    // basic.consume fails (404) until the queue is declared; the consumer
    // keeps retrying with backoff instead of returning.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!c.task.is_finished());
    assert_eq!(c.consumer.stats().connections, 0);
    env.add_queue(&late).await;
    env.publish(Some(&id()), "{}").await;
    wait_until("processed after the queue appeared", || async {
        c.consumer.stats().processed == 1
    })
    .await;
    assert_eq!(c.consumer.stats().connections, 1);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_on_an_unmigrated_schema() {
    let env = Env::new().await;
    let cfg = env.config("svc").schema("t_c_not_migrated");
    let err = Consumer::new(cfg, env.pool.clone(), Ack)
        .unwrap()
        .run(Default::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Outbox(_)), "{err:?}");
    assert!(
        err.to_string().contains("outbox_consumer::migrate"),
        "{err}"
    );
    env.teardown().await;
}
