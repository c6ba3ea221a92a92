//! The `orders` binary as a deployment runs it: SIGTERM (Kubernetes,
//! systemd, `docker stop`) and SIGINT finish the requests in flight and
//! exit 0; no database URL, however malformed, puts its password into the
//! output.

use e2e::service::{BAD_DATABASE_URLS, Ready, free_port, run_to_exit, stop_with};
use e2e::{database_url, suffix};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_orders");

#[tokio::test]
async fn sigterm_and_sigint_stop_gracefully_and_exit_0() {
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let schema = format!("t_orders_{}", suffix());
        let port = free_port();
        let env = vec![
            ("DATABASE_URL", database_url()),
            ("OUTBOX_SCHEMA", schema.clone()),
            ("LISTEN_ADDR", format!("127.0.0.1:{port}")),
        ];
        let code = stop_with(BIN, &env, &Ready::Listening(port), signal).await;
        assert_eq!(code, Some(0), "{signal}: exit code");
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
    for url in BAD_DATABASE_URLS {
        let env = vec![
            ("DATABASE_URL", (*url).to_owned()),
            ("LISTEN_ADDR", format!("127.0.0.1:{}", free_port())),
        ];
        let (code, text) = run_to_exit(BIN, &env);
        assert_ne!(code, Some(0), "{text}");
        assert!(!text.contains("S3cret"), "printed a password: {text}");
        assert!(text.starts_with("orders: "), "{text}");
    }
}
