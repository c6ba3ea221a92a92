//! The demo on the local three-node RabbitMQ cluster (`make cluster`):
//! every service of it (the relay, both consumers, their queue
//! declarations, the demo's own audit and injection) is given all three
//! URLs, and the node they all start with is SIGKILLed while orders flow.
//! Every check of the report must still pass.
//!
//! `make test` runs it (`cluster_` prefix) alone, after the rest: it stops
//! and starts a node of the cluster.

use std::process::Stdio;
use std::time::{Duration, Instant};

use e2e::cluster::Cluster;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;

const DEMO: &str = env!("CARGO_BIN_EXE_demo");
/// Orders placed: enough for the stream to outlast the kill and the
/// node's restart (about 10 s), few enough for a debug build in CI.
const ORDERS: &str = "1500";
/// Bound on the whole run, restart of the killed node included.
const DEADLINE: Duration = Duration::from_secs(150);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_demo_passes_every_check_with_a_node_killed_mid_run() {
    let cluster = Cluster::local();
    cluster.ensure_started().await.expect("make cluster");
    let started = Instant::now();
    let mut demo = Command::new(DEMO)
        .args(["--orders", ORDERS])
        .env("AMQP_URL", cluster.urls().join(","))
        .env("DATABASE_URL", e2e::database_url())
        .env("RUST_LOG", "warn,lapin=off,sqlx::postgres::notice=off")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the demo");
    let mut stderr = demo.stderr.take().unwrap();
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let mut lines = BufReader::new(demo.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    let mut restart = None;
    let run = async {
        while let Some(line) = lines.next_line().await.expect("the demo's output") {
            // A progress line: the services have run for a second, orders
            // flowing. Node 0, first in every service's list, goes.
            if restart.is_none() && line.starts_with('[') {
                assert!(!line.contains(&format!("{ORDERS}/{ORDERS}")), "{line}");
                cluster.kill(0).await.expect("kill node 0");
                out.push(format!(
                    "---- node 0 SIGKILLed at {:.1?}",
                    started.elapsed()
                ));
                let cluster = cluster.clone();
                restart = Some(tokio::spawn(async move { cluster.start(0).await }));
            }
            out.push(line);
        }
        demo.wait().await.expect("the demo's exit")
    };
    let status = tokio::time::timeout(DEADLINE, run)
        .await
        .expect("the demo to finish in time");
    let transcript = format!("{}\n{}", out.join("\n"), errors.await.unwrap());
    let restart = restart.unwrap_or_else(|| panic!("the demo printed no progress:\n{transcript}"));
    restart.await.unwrap().expect("node 0 back in the cluster");
    println!("{transcript}\ncluster demo: {:.1?}", started.elapsed());

    assert_eq!(status.code(), Some(0), "{transcript}");
    let checks: Vec<&String> = out
        .iter()
        .skip_while(|l| l.as_str() != "checks")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect();
    assert_eq!(checks.len(), 6, "the report's checks:\n{transcript}");
    for check in checks {
        assert!(
            check.trim_start().starts_with("ok "),
            "{check}\n{transcript}"
        );
    }
    let kill = out
        .iter()
        .position(|l| l.starts_with("---- node 0"))
        .unwrap();
    let all_sent = out
        .iter()
        .position(|l| l.starts_with("demo: all orders sent"))
        .expect("all orders sent");
    assert!(
        kill < all_sent,
        "the node was killed mid-stream:\n{transcript}"
    );
}
