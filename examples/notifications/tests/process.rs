//! The `notifications` binary as a deployment runs it: SIGTERM (Kubernetes,
//! systemd, `docker stop`) and SIGINT drain and exit 0; no URL, however
//! malformed, puts its password into the output; every node's URL is
//! taken, a dead one skipped.

use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_notifications");

#[tokio::test]
async fn sigterm_and_sigint_drain_and_exit_0() {
    e2e::service::consumer_stops_cleanly(BIN, "notifications", "NOTIFICATIONS").await;
}

#[test]
fn malformed_urls_get_one_line_and_no_password() {
    e2e::service::consumer_hides_passwords(BIN, "notifications", "NOTIFICATIONS");
}

/// Given every node's URL with the first node down (a cluster that lost
/// one), it declares its queue and consumes through the next node.
#[tokio::test]
async fn a_dead_first_node_in_amqp_url_is_skipped() {
    let s = e2e::suffix();
    let (schema, queue, exchange) = (
        format!("t_notifications_{s}"),
        format!("test.notifications.{s}"),
        format!("test.notifications.x.{s}"),
    );
    let vars = e2e::service::consumer_env("NOTIFICATIONS", &schema, &queue, &exchange);
    let env: Vec<(&str, String)> = vars
        .iter()
        .map(|(k, v)| match k.as_str() {
            "AMQP_URL" => (
                k.as_str(),
                format!("amqp://guest:guest@127.0.0.1:1/%2f,{v}"),
            ),
            _ => (k.as_str(), v.clone()),
        })
        .collect();
    let ready = e2e::service::Ready::Consuming(queue.clone());
    let code = e2e::service::stop_with(BIN, &env, &ready, Signal::SIGTERM).await;

    for q in [
        queue.clone(),
        format!("{queue}.retry"),
        format!("{queue}.dlq"),
    ] {
        let exchange = exchange.clone();
        e2e::TestBroker { exchange, queue: q }.cleanup().await;
    }
    let pool = e2e::pool("notifications-test", 1).await;
    let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
        .execute(&pool)
        .await;
    assert_eq!(code, Some(0), "consumed, then stopped by SIGTERM");
}
