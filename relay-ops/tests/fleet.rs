//! The fleet: one relay process for the tenant schemas of two databases.
//! Every tenant's events published, a tenant that joins found without a
//! restart, a tenant dropped while the others publish.

use std::collections::HashSet;
use std::time::Duration;

use e2e::{Collector, TestBroker, TestDatabase, amqp_url, wait_until};
use lapin::types::FieldTable;
use outbox_relay::{Fleet, FleetConfig, RelayConfig};
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// `n` events into `schema`'s outbox, by plain SQL (the table's contract):
/// their ids.
async fn insert(pool: &PgPool, schema: &str, n: usize) -> Vec<String> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT id, 'order', id::text, 'OrderPlaced', '{{}}' FROM unnest($1::uuid[]) id"
    )))
    .bind(&ids)
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("insert into {schema}: {e}"));
    ids.iter().map(Uuid::to_string).collect()
}

fn config(broker: &TestBroker) -> RelayConfig {
    let mut c = RelayConfig::default();
    c.amqp_url = amqp_url().into();
    c.default_exchange = broker.exchange.clone();
    c.declare_exchange = None;
    c.poll_interval = Duration::from_millis(200);
    c.retry_base = Duration::from_millis(50);
    c.retry_max = Duration::from_millis(400);
    c.reconnect_min = Duration::from_millis(50);
    c.reconnect_max = Duration::from_millis(500);
    c
}

async fn relay_pool(db: &TestDatabase) -> PgPool {
    outbox_relay::pool_options(Duration::from_secs(10))
        .max_connections(4)
        .connect(&db.url)
        .await
        .unwrap()
}

#[tokio::test]
async fn one_fleet_publishes_the_tenants_of_two_databases_finds_new_ones_and_outlives_a_dropped_one()
 {
    let dbs = [
        TestDatabase::create("fleet_a").await,
        TestDatabase::create("fleet_b").await,
    ];
    let broker = TestBroker::new("fleet", FieldTable::default()).await;
    let mut ids = Vec::new();
    for db in &dbs {
        for i in 0..10 {
            let schema = format!("tenant_{i:02}");
            outbox::migrate(&db.pool, &schema).await.unwrap();
            // One tenant with a backlog, the others with a few.
            let n = if i == 0 { 2_000 } else { 20 };
            ids.extend(insert(&db.pool, &schema, n).await);
        }
    }
    // Ordered events in one tenant of each database: they need the
    // tenant's partition leases, taken once it has work.
    for db in &dbs {
        outbox::set_ordered(&db.pool, "tenant_03", "order", true)
            .await
            .unwrap();
        ids.extend(insert(&db.pool, "tenant_03", 50).await);
    }
    // Not a tenant: the pattern leaves it out.
    outbox::migrate(&dbs[0].pool, "other").await.unwrap();
    let left_out = insert(&dbs[0].pool, "other", 5).await;

    let collector = Collector::start(&broker.queue);
    let mut cfg = FleetConfig::new(
        vec![relay_pool(&dbs[0]).await, relay_pool(&dbs[1]).await],
        config(&broker),
    );
    cfg.like = Some("tenant\\_%".to_owned());
    cfg.discover_every = Duration::from_millis(500);
    let fleet = Fleet::new(cfg).unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (fleet, stop) = (fleet.clone(), stop.clone());
        async move { fleet.run(stop).await }
    });
    wait_until(
        Duration::from_secs(120),
        "every tenant's events",
        || async { ids.iter().all(|id| collector.has(id)) },
    )
    .await;
    assert_eq!(fleet.tenants().len(), 20, "{:?}", fleet.tenants());

    // A tenant that joins: found by the census, its events published.
    outbox::migrate(&dbs[1].pool, "tenant_new").await.unwrap();
    let joined = insert(&dbs[1].pool, "tenant_new", 10).await;
    wait_until(
        Duration::from_secs(30),
        "the new tenant's events",
        || async { joined.iter().all(|id| collector.has(id)) },
    )
    .await;

    // A tenant dropped while the others publish: they go on.
    sqlx::raw_sql("DROP SCHEMA tenant_05 CASCADE")
        .execute(&dbs[0].pool)
        .await
        .unwrap();
    let mut after = Vec::new();
    for db in &dbs {
        for i in [1, 2, 9] {
            after.extend(insert(&db.pool, &format!("tenant_{i:02}"), 10).await);
        }
    }
    wait_until(
        Duration::from_secs(30),
        "the other tenants' events",
        || async { after.iter().all(|id| collector.has(id)) },
    )
    .await;
    wait_until(
        Duration::from_secs(30),
        "the dropped tenant gone from the fleet",
        || async {
            !fleet
                .tenants()
                .iter()
                .any(|t| t.database == 0 && t.schema == "tenant_05")
        },
    )
    .await;

    stop.cancel();
    running.await.unwrap().expect("a clean stop");
    collector.drain(Duration::from_secs(30)).await;
    let seen: HashSet<String> = collector
        .received
        .lock()
        .unwrap()
        .counts
        .keys()
        .cloned()
        .collect();
    for id in &left_out {
        assert!(
            !seen.contains(id),
            "a schema the pattern leaves out was published"
        );
    }
    for db in dbs {
        db.cleanup().await;
    }
    broker.cleanup().await;
}
