//! The core guarantee: one effect per event id and consumer name, whatever
//! the duplicates, races and crashes.

use std::time::Instant;

use e2e::consumer::{Env, Running, id, wait_until};
use outbox_consumer::{BatchHandler, BatchOutcome, Consumer, Event, Handler, Outcome};
use rand::Rng as _;
use rand::seq::SliceRandom as _;
use sqlx::{AssertSqlSafe, PgConnection};

/// One non-idempotent effect per event: a row in `effects` and
/// `stock.qty = qty - 1`, in one statement.
struct Effect {
    sql: String,
}

impl Effect {
    fn new(schema: &str) -> Self {
        Self {
            sql: format!(
                "WITH e AS (INSERT INTO {schema}.effects (event_id) VALUES ($1))
                 UPDATE {schema}.stock SET qty = qty - 1 WHERE sku = 'A'"
            ),
        }
    }
}

impl Handler for Effect {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        match sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(event.id())
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::retry(e),
        }
    }
}

/// The set-based form: one statement for the whole batch.
struct BatchEffect {
    sql: String,
}

impl BatchHandler for BatchEffect {
    async fn handle_batch(&self, conn: &mut PgConnection, events: &[Event]) -> BatchOutcome {
        let ids: Vec<&str> = events.iter().map(|e| e.id()).collect();
        let r = sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(&ids)
            .bind(ids.len() as i64)
            .execute(conn)
            .await;
        match r {
            Ok(_) => BatchOutcome::All(Outcome::Ack),
            Err(e) => BatchOutcome::All(Outcome::retry(e)),
        }
    }
}

async fn qty(env: &Env) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT qty FROM {}.stock",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_message_id_three_times_gives_one_effect() {
    let env = Env::new().await;
    let c = Running::start(
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Effect::new(&env.schema),
        )
        .unwrap(),
    );
    let dup = id();
    for _ in 0..3 {
        env.publish(Some(&dup), r#"{"sku":"A"}"#).await;
    }
    wait_until("3 deliveries settled", || async {
        c.consumer.stats().acked() == 3
    })
    .await;
    let s = c.consumer.stats();
    assert_eq!((s.processed, s.duplicates), (1, 2));
    assert_eq!(env.count("{s}.effects").await, 1);
    assert_eq!(qty(&env).await, 100_000 - 1);
    c.stop().await;
    env.teardown().await;
}

/// 10,000 deliveries, 20% duplicates (shuffled, some adjacent in a batch),
/// a relative update per event: the stock is exact.
async fn exact_after_10k(batch_handler: bool) {
    let env = Env::new().await;
    let unique: Vec<String> = (0..8_000).map(|_| id()).collect();
    let mut rng = rand::rng();
    let mut all: Vec<(Option<String>, Vec<u8>)> = unique
        .iter()
        .map(|i| (Some(i.clone()), br#"{"sku":"A"}"#.to_vec()))
        .collect();
    for _ in 0..2_000 {
        let i = unique[rng.random_range(0..unique.len())].clone();
        all.push((Some(i), br#"{"sku":"A"}"#.to_vec()));
    }
    all.shuffle(&mut rng);
    env.publish_all(&all).await;

    let consumer = if batch_handler {
        let s = &env.schema;
        let sql = format!(
            "WITH e AS (INSERT INTO {s}.effects (event_id) SELECT unnest($1::text[]))
             UPDATE {s}.stock SET qty = qty - $2 WHERE sku = 'A'"
        );
        Consumer::with_batch_handler(env.config("svc"), env.pool.clone(), BatchEffect { sql })
            .unwrap()
    } else {
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Effect::new(&env.schema),
        )
        .unwrap()
    };
    let started = Instant::now();
    let c = Running::start(consumer);
    wait_until("10,000 deliveries settled", || async {
        c.consumer.stats().acked() == 10_000
    })
    .await;
    let secs = started.elapsed().as_secs_f64();
    let s = c.consumer.stats();
    eprintln!(
        "batch_handler={batch_handler}: 10,000 deliveries ({} effects, {} duplicates) in {secs:.2}s = {:.0} deliveries/s, {} batches",
        s.processed,
        s.duplicates,
        10_000.0 / secs,
        s.batches
    );
    assert_eq!((s.processed, s.duplicates), (8_000, 2_000));
    assert_eq!(qty(&env).await, 100_000 - 8_000);
    assert_eq!(env.count("{s}.effects").await, 8_000);
    assert_eq!(
        env.count("(SELECT DISTINCT event_id FROM {s}.effects) d")
            .await,
        8_000
    );
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relative_update_is_exact_after_10k_events_with_20pc_duplicates() {
    exact_after_10k(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_is_exact_after_10k_events_with_20pc_duplicates() {
    exact_after_10k(true).await;
}

/// Two instances of one consumer name get every event at the same moment
/// (two queues bound to one exchange): the inbox key arbitrates, one
/// effect per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_racing_on_duplicates_give_one_effect() {
    let mut env = Env::new().await;
    let second = format!("{}_b", env.queue);
    env.add_queue(&second).await;
    let a = Running::start(
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Effect::new(&env.schema),
        )
        .unwrap(),
    );
    let mut cfg_b = env.config("svc");
    cfg_b.queue = second.clone();
    let b =
        Running::start(Consumer::new(cfg_b, env.pool.clone(), Effect::new(&env.schema)).unwrap());
    let n = 2_000u64;
    let msgs: Vec<_> = (0..n)
        .map(|_| (Some(id()), br#"{"sku":"A"}"#.to_vec()))
        .collect();
    env.publish_all(&msgs).await;
    wait_until("both instances settled every copy", || async {
        a.consumer.stats().acked() + b.consumer.stats().acked() == 2 * n
    })
    .await;
    let (sa, sb) = (a.consumer.stats(), b.consumer.stats());
    eprintln!(
        "race: a processed {} dup {}, b processed {} dup {}",
        sa.processed, sa.duplicates, sb.processed, sb.duplicates
    );
    assert_eq!(sa.processed + sb.processed, n);
    assert_eq!(sa.duplicates + sb.duplicates, n);
    assert_eq!(env.count("{s}.effects").await, n as i64);
    assert_eq!(qty(&env).await, 100_000 - n as i64);
    a.stop().await;
    b.stop().await;
    env.teardown().await;
}

/// A second consumer name is an independent subscriber: it applies its own
/// effect for the same event id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_consumer_name_has_its_own_dedup_state() {
    let mut env = Env::new().await;
    let second = format!("{}_b", env.queue);
    env.add_queue(&second).await;
    let a = Running::start(
        Consumer::new(
            env.config("billing"),
            env.pool.clone(),
            Effect::new(&env.schema),
        )
        .unwrap(),
    );
    let mut cfg_b = env.config("shipping");
    cfg_b.queue = second;
    let b =
        Running::start(Consumer::new(cfg_b, env.pool.clone(), Effect::new(&env.schema)).unwrap());
    env.publish(Some(&id()), "{}").await;
    wait_until("both consumers processed it", || async {
        a.consumer.stats().processed == 1 && b.consumer.stats().processed == 1
    })
    .await;
    assert_eq!(env.count("{s}.effects").await, 2);
    assert_eq!(env.count("{s}.inbox_processed").await, 2);
    a.stop().await;
    b.stop().await;
    env.teardown().await;
}

/// [`Effect`] that waits, once inside its transaction, until the test lets
/// it go.
struct Gated {
    effect: Effect,
    gate: std::sync::Arc<Gate>,
}

struct Gate {
    entered: tokio::sync::Notify,
    release: tokio::sync::Semaphore,
}

impl Handler for Gated {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        let outcome = self.effect.handle(conn, event).await;
        self.gate.entered.notify_one();
        let _ = self.gate.release.acquire().await;
        outcome
    }
}

/// The ack after COMMIT is lost (the broker link goes silent between the
/// two), then the connection dies: the broker redelivers, and the inbox
/// recognises the redelivery as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_lost_after_commit_redelivery_is_a_duplicate() {
    let env = Env::new().await;
    let proxy = e2e::Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let mut cfg = env.config("svc");
    cfg.amqp_url = proxy.url(cfg.amqp_url.expose()).into();
    let gate = std::sync::Arc::new(Gate {
        entered: tokio::sync::Notify::new(),
        release: tokio::sync::Semaphore::new(0),
    });
    let gated = Gated {
        effect: Effect::new(&env.schema),
        gate: gate.clone(),
    };
    let first = Running::start(Consumer::new(cfg, env.pool.clone(), gated).unwrap());
    env.publish(Some(&id()), "{}").await;
    // Inside the handler, before COMMIT: the link goes silent, then the
    // batch commits and its ack vanishes.
    tokio::time::timeout(e2e::consumer::DEADLINE, gate.entered.notified())
        .await
        .expect("the handler ran");
    proxy.set(e2e::Mode::Blackhole);
    gate.release.add_permits(1_000);
    wait_until("the effect committed", || async {
        env.count("{s}.effects").await == 1
    })
    .await;
    // The connection dies: the broker takes the delivery back.
    proxy.set(e2e::Mode::Reset);
    first.stop().await;
    proxy.stop();

    let fresh = Running::start(
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Effect::new(&env.schema),
        )
        .unwrap(),
    );
    wait_until("the redelivery settled", || async {
        fresh.consumer.stats().acked() == 1
    })
    .await;
    assert_eq!(fresh.consumer.stats().duplicates, 1);
    assert_eq!(env.count("{s}.effects").await, 1);
    fresh.stop().await;
    env.teardown().await;
}

/// Shutdown mid-stream: what was in flight commits and is acked, the rest
/// stays queued; a restarted consumer finishes with every effect exactly
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_loses_and_duplicates_nothing() {
    let env = Env::new().await;
    let n = 3_000u64;
    let msgs: Vec<_> = (0..n).map(|_| (Some(id()), b"{}".to_vec())).collect();
    env.publish_all(&msgs).await;
    let mut cfg = env.config("svc");
    cfg.batch_size = 16;
    cfg.prefetch = 64;
    let first =
        Running::start(Consumer::new(cfg, env.pool.clone(), Effect::new(&env.schema)).unwrap());
    wait_until("some progress", || async {
        first.consumer.stats().processed > 0
    })
    .await;
    let c1 = first.consumer.clone();
    first.stop().await;
    let done_first = c1.stats().processed;
    assert_eq!(
        env.count("{s}.effects").await,
        done_first as i64,
        "every commit was acked"
    );
    let second = Running::start(
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Effect::new(&env.schema),
        )
        .unwrap(),
    );
    wait_until("the rest processed", || async {
        second.consumer.stats().processed == n - done_first
    })
    .await;
    assert_eq!(env.count("{s}.effects").await, n as i64);
    assert_eq!(second.consumer.stats().duplicates, 0);
    second.stop().await;
    env.teardown().await;
}

/// The database connection dies mid-transaction: the batch rolls back,
/// nothing is acked, and the batch is processed again, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_error_mid_transaction_is_processed_once() {
    struct DiesOnce {
        effect: Effect,
        died: std::sync::atomic::AtomicBool,
    }
    impl Handler for DiesOnce {
        async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
            let first = self.effect.handle(&mut *conn, event).await;
            if !self.died.swap(true, std::sync::atomic::Ordering::SeqCst) {
                // Kills this transaction's own backend after the effect.
                let r = sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                    .execute(&mut *conn)
                    .await;
                return Outcome::retry(format!("{r:?}"));
            }
            first
        }
    }
    let env = Env::new().await;
    let handler = DiesOnce {
        effect: Effect::new(&env.schema),
        died: Default::default(),
    };
    let c = Running::start(Consumer::new(env.config("svc"), env.pool.clone(), handler).unwrap());
    let msgs: Vec<_> = (0..10).map(|_| (Some(id()), b"{}".to_vec())).collect();
    env.publish_all(&msgs).await;
    wait_until("all processed", || async {
        c.consumer.stats().processed == 10
    })
    .await;
    let s = c.consumer.stats();
    assert_eq!(
        (s.retried, s.duplicates),
        (0, 0),
        "the batch was retried whole, not per event"
    );
    assert_eq!(env.count("{s}.effects").await, 10);
    assert_eq!(qty(&env).await, 100_000 - 10);
    c.stop().await;
    env.teardown().await;
}
