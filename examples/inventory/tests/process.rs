//! The `inventory` binary as a deployment runs it: SIGTERM (Kubernetes,
//! systemd, `docker stop`) and SIGINT drain and exit 0; no URL, however
//! malformed, puts its password into the output.

use e2e::service::{BAD_AMQP_URLS, BAD_DATABASE_URLS, Ready, run_to_exit, stop_with};
use e2e::{amqp_url, connect, database_url, suffix};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_inventory");

fn env(schema: &str, queue: &str, exchange: &str) -> Vec<(&'static str, String)> {
    vec![
        ("INVENTORY_DATABASE_URL", database_url()),
        ("AMQP_URL", amqp_url()),
        ("INVENTORY_SCHEMA", schema.to_owned()),
        ("INVENTORY_QUEUE", queue.to_owned()),
        ("OUTBOX_EXCHANGE", exchange.to_owned()),
    ]
}

#[tokio::test]
async fn sigterm_and_sigint_drain_and_exit_0() {
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let s = suffix();
        let (schema, queue, exchange) = (
            format!("t_inventory_{s}"),
            format!("test.inventory.{s}"),
            format!("test.inventory.x.{s}"),
        );
        let code = stop_with(
            BIN,
            &env(&schema, &queue, &exchange),
            &Ready::Consuming(queue.clone()),
            signal,
        )
        .await;
        assert_eq!(code, Some(0), "{signal}: exit code");
        let conn = connect().await;
        let ch = conn.create_channel().await.unwrap();
        for q in [
            queue.clone(),
            format!("{queue}.retry"),
            format!("{queue}.dlq"),
        ] {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        let _ = ch
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
        let _ = conn.close(200, "ok".into()).await;
        let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&pool)
        .await;
    }
}

#[test]
fn malformed_urls_get_one_line_and_no_password() {
    let s = suffix();
    let base = env(
        &format!("t_inventory_{s}"),
        &format!("test.inventory.{s}"),
        "unused",
    );
    let mut cases = Vec::new();
    for url in BAD_AMQP_URLS {
        let mut e = base.clone();
        e.retain(|(k, _)| *k != "AMQP_URL");
        e.push(("AMQP_URL", (*url).to_owned()));
        cases.push(e);
    }
    for url in BAD_DATABASE_URLS {
        let mut e = base.clone();
        e.retain(|(k, _)| *k != "INVENTORY_DATABASE_URL");
        e.push(("INVENTORY_DATABASE_URL", (*url).to_owned()));
        cases.push(e);
    }
    for e in cases {
        let (code, text) = run_to_exit(BIN, &e);
        assert_ne!(code, Some(0), "{text}");
        assert!(!text.contains("S3cret"), "printed a password: {text}");
        assert!(text.starts_with("inventory: "), "{text}");
    }
}
