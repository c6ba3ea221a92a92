//! The `inventory` binary as a deployment runs it: SIGTERM (Kubernetes,
//! systemd, `docker stop`) and SIGINT drain and exit 0; no URL, however
//! malformed, puts its password into the output.

const BIN: &str = env!("CARGO_BIN_EXE_inventory");

#[tokio::test]
async fn sigterm_and_sigint_drain_and_exit_0() {
    e2e::service::consumer_stops_cleanly(BIN, "inventory", "INVENTORY").await;
}

#[test]
fn malformed_urls_get_one_line_and_no_password() {
    e2e::service::consumer_hides_passwords(BIN, "inventory", "INVENTORY");
}
