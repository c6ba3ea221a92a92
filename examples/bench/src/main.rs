//! `make bench`: measures the toolkit against raw ceilings taken in the same
//! run, prints a table and writes JSON. `--smoke` runs tiny counts (CI).

mod common;
mod consumer;
mod relay;
mod write;

use anyhow::{Context, Result};
use clap::Parser;
use outbox::{Ordering, Wakeup};
use serde_json::{Value, json};

/// Benchmarks the outbox toolkit against the local services.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// RabbitMQ URL (default: the local broker, guest account).
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Tiny counts, to prove the benchmark still runs.
    #[arg(long)]
    smoke: bool,
    /// Where to write the results.
    #[arg(long, default_value = "target/bench/results.json")]
    out: std::path::PathBuf,
    /// Run only these sections (relay, growth, ordered, write, latency,
    /// consumer);
    /// all by default.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Internal: run a consumer for the memory measurement (queue, count).
    #[arg(long, num_args = 2, hide = true)]
    child_consumer: Option<Vec<String>>,
}

struct Sizes {
    drain: usize,
    backlog_big: usize,
    consumer: usize,
    ordered: usize,
    write_secs: f64,
    latency_secs: f64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&args.database_url)
        .await
        .context("connecting to the database")?;
    if let Some(child) = &args.child_consumer {
        return consumer::child_consumer(&pool, &args.amqp_url, &child[0], child[1].parse()?).await;
    }
    let sizes = if args.smoke {
        Sizes {
            drain: 2_000,
            backlog_big: 20_000,
            consumer: 1_000,
            ordered: 2_000,
            write_secs: 0.5,
            latency_secs: 1.0,
        }
    } else {
        Sizes {
            drain: 100_000,
            backlog_big: 1_000_000,
            consumer: 50_000,
            ordered: 100_000,
            write_secs: 5.0,
            latency_secs: 10.0,
        }
    };
    let mut r = Report::default();
    let url = args.amqp_url.as_str();
    let run = |section: &str| args.only.is_empty() || args.only.iter().any(|o| o == section);

    if run("relay") {
        eprintln!("bench: raw confirmed publishes ({})", sizes.drain);
        let (raw, raw_cpu) = relay::raw_publish_rate(url, sizes.drain).await?;
        eprintln!("bench: relay binary draining a backlog of {}", sizes.drain);
        let (drain, relay_rss, drain_cpu) =
            relay::drain_process(&pool, &args.database_url, url, sizes.drain).await?;
        // Where the time goes: CPU seconds per 10,000 events, per process.
        let per10k = |cpu: f64| cpu * 10_000.0 / sizes.drain as f64;
        r.add(
            "raw_cpu_s_per_10k_broker",
            per10k(raw_cpu.0),
            "  raw: broker CPU s / 10k msgs",
            "",
        );
        r.add(
            "raw_cpu_s_per_10k_publisher",
            per10k(raw_cpu.2),
            "  raw: publisher CPU s / 10k msgs",
            "",
        );
        r.add(
            "drain_cpu_s_per_10k_broker",
            per10k(drain_cpu.0),
            "  drain: broker CPU s / 10k events",
            "",
        );
        r.add(
            "drain_cpu_s_per_10k_database",
            per10k(drain_cpu.1),
            "  drain: postgres CPU s / 10k events",
            "",
        );
        r.add(
            "drain_cpu_s_per_10k_relay",
            per10k(drain_cpu.2),
            "  drain: relay CPU s / 10k events",
            "",
        );
        r.add(
            "raw_publish_per_s",
            raw,
            "raw confirmed publishes/s (plain lapin, 500 in flight)",
            "",
        );
        r.add(
            "relay_drain_per_s",
            drain,
            "relay drain events/s (binary, 100k backlog)",
            "",
        );
        r.add(
            "relay_drain_ratio",
            drain / raw,
            "relay_drain_ratio",
            ">= 0.95",
        );
        r.add(
            "relay_peak_rss_mib",
            relay_rss,
            "relay peak RSS MiB",
            "<= 64",
        );
    }
    if run("growth") {
        eprintln!(
            "bench: cost growth (backlog {} vs 10,000; one relay vs two)",
            sizes.backlog_big
        );
        let small = relay::drain_rate(
            &pool,
            url,
            10_000.min(sizes.backlog_big),
            10_000.min(sizes.backlog_big),
            1,
            Ordering::None,
        )
        .await?;
        let big = relay::drain_rate(
            &pool,
            url,
            sizes.backlog_big,
            sizes.drain.min(sizes.backlog_big),
            1,
            Ordering::None,
        )
        .await?;
        let two =
            relay::drain_rate(&pool, url, sizes.drain, sizes.drain, 2, Ordering::None).await?;
        r.add(
            "drain_per_s_backlog_10k",
            small,
            "drain events/s, 10k backlog (in-process)",
            "",
        );
        r.add(
            "drain_per_s_backlog_1m",
            big,
            "drain events/s, 1M backlog (first 100k)",
            "",
        );
        r.add(
            "backlog_1m_vs_10k_ratio",
            big / small,
            "backlog_1m_vs_10k_ratio",
            ">= 0.9",
        );
        r.add(
            "drain_per_s_two_relays",
            two,
            "drain events/s, two relays",
            "",
        );
        r.add(
            "two_relays_vs_one_ratio",
            two / small,
            "two relays / one relay",
            "",
        );
    }
    if run("ordered") {
        // Same backlog shape (1,000 aggregates), same relay settings, one
        // after the other; unordered first, then every event ordered, then
        // ordered with three relays sharing the partitions.
        let n = sizes.ordered;
        eprintln!("bench: ordered vs unordered drain ({n} events, 1,000 aggregates)");
        let unordered = relay::drain_rate(&pool, url, n, n, 1, Ordering::None).await?;
        let ordered = relay::drain_rate(&pool, url, n, n, 1, Ordering::All).await?;
        let ordered3 = relay::drain_rate(&pool, url, n, n, 3, Ordering::All).await?;
        // One event per aggregate: every event is a head (the claim's most
        // expensive shape).
        let ordered_wide = relay::drain_rate_over(&pool, url, n, n, 1, Ordering::All, n).await?;
        r.add(
            "unordered_drain_per_s",
            unordered,
            "drain events/s, unordered (in-process, same run)",
            "",
        );
        r.add(
            "ordered_drain_per_s",
            ordered,
            "drain events/s, ordered mode",
            "",
        );
        r.add(
            "ordered_vs_unordered_ratio",
            ordered / unordered,
            "ordered_vs_unordered_ratio",
            ">= 0.8",
        );
        r.add(
            "ordered_drain_per_s_one_event_per_aggregate",
            ordered_wide,
            "drain events/s, ordered, one event per aggregate",
            "",
        );
        r.add(
            "ordered_one_event_per_aggregate_ratio",
            ordered_wide / unordered,
            "  ratio to unordered",
            "",
        );
        r.add(
            "ordered_drain_per_s_three_relays",
            ordered3,
            "drain events/s, ordered mode, three relays",
            "",
        );
    }
    if run("write") {
        eprintln!("bench: write path (8 writers)");
        let base = write::write_path(&pool, None, sizes.write_secs).await?;
        r.add(
            "write_tx_per_s_baseline",
            base,
            "write path tx/s, no event",
            "",
        );
        for (name, mode) in [
            ("after_commit", Wakeup::AfterCommit),
            ("in_transaction", Wakeup::InTransaction),
            ("poll_only", Wakeup::PollOnly),
        ] {
            let rate = write::write_path(&pool, Some(mode), sizes.write_secs).await?;
            r.add(
                &format!("write_tx_per_s_{name}"),
                rate,
                &format!("write path tx/s + 1 event, wake-up {name}"),
                "",
            );
            r.add(
                &format!("write_path_ratio_{name}"),
                rate / base,
                &format!("  ratio to no event ({name})"),
                "",
            );
        }
        let wp = r.get("write_path_ratio_after_commit");
        r.add(
            "write_path_ratio",
            wp,
            "write_path_ratio (default wake-up)",
            ">= 0.85",
        );
    }
    if run("latency") {
        eprintln!("bench: latency at 1,000 events/s");
        for (k, v) in relay::latency(&pool, url, sizes.latency_secs).await? {
            let target = if k == "publish_latency_p99_ms" {
                "<= 10"
            } else {
                ""
            };
            r.add(&k, v, &k, target);
        }
    }
    if run("consumer") {
        eprintln!("bench: consumer ({} messages)", sizes.consumer);
        let c = consumer::measure(&pool, &args.database_url, url, sizes.consumer).await?;
        r.add(
            "consumer_raw_ack_per_s",
            c.raw_ack_per_s,
            "raw ack-only consumer msgs/s",
            "",
        );
        r.add(
            "consumer_hand_written_per_s",
            c.hand_written_per_s,
            "hand-written batched dedup msgs/s",
            "",
        );
        r.add(
            "consumer_batch_handler_per_s",
            c.batch_per_s,
            "library batch handler effects/s",
            "",
        );
        r.add(
            "consumer_effects_per_s",
            c.per_event_per_s,
            "consumer_effects_per_s (per-event handler)",
            ">= 5000",
        );
        r.add(
            "consumer_ratio",
            c.batch_per_s / c.raw_ack_per_s,
            "consumer_ratio (batch / raw ack)",
            ">= 0.6",
        );
        r.add(
            "consumer_overhead_ratio",
            c.batch_per_s / c.hand_written_per_s,
            "consumer_overhead_ratio (library / hand)",
            ">= 0.9",
        );
        r.add(
            "consumer_peak_rss_mib",
            c.peak_rss_mib,
            "consumer peak RSS MiB",
            "",
        );
    }
    println!("\n{:<46} {:>12}  target", "metric", "value");
    for (_, label, v, target) in &r.rows {
        println!("{label:<46} {v:>12.2}  {target}");
    }
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut json = serde_json::Map::new();
    json.insert("smoke".into(), json!(args.smoke));
    for (k, _, v, _) in &r.rows {
        json.insert(k.clone(), json!(v));
    }
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&Value::Object(json))?,
    )?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}

#[derive(Default)]
struct Report {
    rows: Vec<(String, String, f64, &'static str)>,
}

impl Report {
    fn add(&mut self, key: &str, value: f64, label: &str, target: &'static str) {
        self.rows
            .push((key.to_owned(), label.to_owned(), value, target));
    }

    fn get(&self, key: &str) -> f64 {
        self.rows
            .iter()
            .find(|r| r.0 == key)
            .map_or(f64::NAN, |r| r.2)
    }
}
