//! Two inventory instances on one queue, every batch touching the same few
//! skus in mixed order: the stock ends exact and neither instance ever
//! deadlocks (each deadlock costs PostgreSQL's `deadlock_timeout`, 1 s).

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::{amqp_url, suffix, wait_until};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Confirmation};
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;

const SKUS: [&str; 4] = ["A-1", "A-2", "A-3", "A-4"];
const ORDERS: usize = 4_000;
const INITIAL: i64 = 1_000_000;

/// `ORDERS` orders over [`SKUS`] in a shuffled order (a fixed xorshift, so
/// a failure replays): (message id, sku, quantity).
fn orders(prefix: &str) -> Vec<(String, &'static str, i64)> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..ORDERS)
        .map(|n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let sku = SKUS[(x % SKUS.len() as u64) as usize];
            (format!("{prefix}-{n}"), sku, 1 + (x >> 8) as i64 % 3)
        })
        .collect()
}

/// Publishes the orders to `exchange` as the relay would, confirmed.
async fn publish(exchange: &str, orders: &[(String, &str, i64)]) {
    let conn = e2e::connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(orders.len());
    for (id, sku, qty) in orders {
        let body = format!(r#"{{"sku":"{sku}","qty":{qty}}}"#);
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_type("OrderPlaced".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        let c = ch
            .basic_publish(
                exchange.into(),
                "order.OrderPlaced".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                props,
            )
            .await
            .unwrap();
        confirms.push(c);
    }
    for c in confirms {
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
    let _ = conn.close(200, "published".into()).await;
}

/// Deadlocks PostgreSQL counted in this database so far (all sessions:
/// other tests running beside this one count too).
async fn deadlocks(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_hot_skus_never_deadlock_and_the_stock_is_exact() {
    let s = suffix();
    let (schema, queue, exchange) = (
        format!("t_inv_{s}"),
        format!("t_inv_{s}"),
        format!("t_inv_x_{s}"),
    );
    let pool = e2e::pool(&format!("test-{schema}"), 8).await;
    let stock = inventory::Stock::setup(&pool, &schema).await.unwrap();
    for sku in SKUS {
        stock.seed(&pool, sku, INITIAL).await.unwrap();
    }
    inventory::declare_queue(&amqp_url(), &queue, &exchange, "order.#")
        .await
        .unwrap();
    let orders = orders(&s);
    publish(&exchange, &orders).await;
    let deadlocks_before = deadlocks(&pool).await;

    let shutdown = CancellationToken::new();
    let consumers: Vec<_> = (0..2)
        .map(|_| {
            let c = inventory::consumer(&amqp_url(), &queue, &schema, pool.clone(), stock.clone())
                .unwrap();
            let (run, stop) = (c.clone(), shutdown.clone());
            (c, tokio::spawn(async move { run.run(stop).await }))
        })
        .collect();
    wait_until(
        Duration::from_secs(120),
        "every order processed",
        || async {
            consumers
                .iter()
                .map(|(c, _)| c.stats().processed)
                .sum::<u64>()
                == ORDERS as u64
        },
    )
    .await;
    let deadlocks_after = deadlocks(&pool).await;
    shutdown.cancel();
    let mut stats = Vec::new();
    for (c, task) in consumers {
        task.await.unwrap().unwrap();
        stats.push(c.stats());
    }

    let mut expected: BTreeMap<String, i64> =
        SKUS.iter().map(|s| (s.to_string(), INITIAL)).collect();
    for (_, sku, qty) in &orders {
        *expected.get_mut(*sku).unwrap() -= qty;
    }
    let levels: BTreeMap<String, i64> = stock.levels(&pool).await.unwrap().into_iter().collect();
    println!(
        "deadlocks in the database during the run (every test's): {}; stats: {stats:?}",
        deadlocks_after - deadlocks_before
    );
    assert_eq!(levels, expected, "each order taken off exactly once");
    for st in &stats {
        assert!(st.processed > 0, "both instances took part: {stats:?}");
        assert_eq!(
            (st.deadlock_retries, st.serialization_retries),
            (0, 0),
            "no instance lost a transaction to the other: {stats:?}"
        );
        assert_eq!(
            (st.retried, st.rejected),
            (0, 0),
            "nothing retried or rejected: {stats:?}"
        );
    }

    let conn = e2e::connect().await;
    let ch = conn.create_channel().await.unwrap();
    for q in [
        queue.clone(),
        format!("{queue}.retry"),
        format!("{queue}.dlq"),
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = ch
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    let _ = conn.close(200, "bye".into()).await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}
