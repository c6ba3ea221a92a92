//! `make bench`: measures the toolkit against ceilings taken in the same
//! run (each baseline's tuning swept, the best kept), repeats every
//! comparison in rotating order and reports the median and the spread;
//! prints a table and writes JSON. `--smoke` runs tiny counts (CI).

mod common;
mod console;
mod consumer;
mod fleet;
mod latency;
mod minimal;
mod minimal_wal;
mod publish;
mod relay;
mod stages;
mod write;

use anyhow::{Context, Result};
use clap::Parser;
use outbox::{OrderedAggregates, Wakeup};
use serde_json::{Value, json};

use crate::common::{Stats, attempt};
use crate::minimal::LoopTuning;
use crate::minimal_wal::ReaderTuning;
use crate::publish::{PUBLISH_SWEEP, PublishTuning};
use crate::write::Shape;

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
    /// The three nodes of the local cluster (`make cluster`), for the
    /// quorum section.
    #[arg(
        long,
        env = "CLUSTER_AMQP_URLS",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5701/%2f,amqp://guest:guest@127.0.0.1:5702/%2f,amqp://guest:guest@127.0.0.1:5703/%2f"
    )]
    cluster_amqp_urls: String,
    /// Tiny counts, to prove the benchmark still runs.
    #[arg(long)]
    smoke: bool,
    /// Where to write the results.
    #[arg(long, default_value = "target/bench/results.json")]
    out: std::path::PathBuf,
    /// Run only these sections (relay, growth, ordered, write,
    /// write-causes, latency, consumer, quorum, console, wal, wal-drain,
    /// wal-growth, wal-write, wal-latency, horizon, horizon-ordered,
    /// horizon-latency, inbox, fleet); all by default. `horizon` runs the table
    /// capture with unordered and with ordered events and the log's;
    /// `horizon-ordered` the ordered variant alone.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The table's latency section runs the relay's code on a runtime of
    /// its own (two workers) in this process instead of the relay binary:
    /// tells what the relay's code costs from what its being a process of
    /// its own costs, against the same hand-written path. Its CPU figures
    /// then leave out the relay's broker IO thread.
    #[arg(long)]
    latency_relay_in_process: bool,
    /// Events per second the latency sections offer. At 1,000 two cores
    /// are nearly saturated; a lower rate shows the relayers with room to
    /// spare.
    #[arg(long, default_value_t = 1000.0)]
    latency_rate: f64,
    /// The table's latency section also records each relayer's batches
    /// (the relay traces them on `outbox_relay::stages`) and reports where
    /// the events' latency went: waiting for a batch, its claim, the
    /// broker, its confirms, its settle (`*latency_stage_*` figures).
    #[arg(long)]
    latency_stages: bool,
    /// The table's latency section runs its hand-written path in a
    /// process of its own (this binary again), as the relay binary runs:
    /// a ceiling of the same shape as the deployed relay, where the
    /// default one shares the bench's process with the producers and the
    /// consumers.
    #[arg(long)]
    latency_hand_written_apart: bool,
    /// The table's hand-written path takes on the relay's load without
    /// the relay's path: it opens each batch with the relay's own `BEGIN`
    /// and claims with the relay's own claim (its probe for ordered
    /// events, all its columns), and burns this many microseconds of CPU
    /// per event after each commit, when the events are already on the
    /// queue. About 50 gives it the relay binary's CPU per event at 500
    /// events/s on two cores. Tells how much of the latency gap is the
    /// relay's extra load on shared cores rather than its path
    /// (BENCHMARKS.md, twelfth part).
    #[arg(long, value_name = "MICROSECONDS")]
    latency_hand_written_burden: Option<u64>,
    /// Internal: run a consumer for the memory measurement (queue, count).
    #[arg(long, num_args = 2, hide = true)]
    child_consumer: Option<Vec<String>>,
    /// Internal: run the table's hand-written path until SIGTERM (schema,
    /// exchange), for `--latency-hand-written-apart`.
    #[arg(long, num_args = 2, hide = true)]
    child_relayer: Option<Vec<String>>,
}

const SECTIONS: [&str; 19] = [
    "relay",
    "growth",
    "ordered",
    "write",
    "write-causes",
    "latency",
    "consumer",
    "quorum",
    "console",
    "wal",
    "wal-drain",
    "wal-growth",
    "wal-write",
    "wal-latency",
    "horizon",
    "horizon-ordered",
    "inbox",
    "horizon-latency",
    "fleet",
];

/// Counts and durations; `--smoke` shrinks all of them.
struct Sizes {
    /// Comparisons repeated this many times (median and spread).
    rounds: usize,
    /// Target seconds of one measured ceiling run.
    run_secs: f64,
    /// Messages per sweep run of a baseline's tuning.
    sweep_n: usize,
    growth_small: usize,
    growth_big: usize,
    growth_window: usize,
    growth_runs: usize,
    ordered: usize,
    write_secs: f64,
    worst_secs: f64,
    latency_runs: usize,
    latency_warm: f64,
    latency_secs: f64,
    memory_n: usize,
    /// Events per round, and rounds, of the held-horizon drain.
    horizon: (usize, usize),
    /// Messages per large-inbox run, and records seeded per day (two days).
    inbox: (usize, u64),
    /// Seconds of each open-loop run at 500 events/s, clean and with a
    /// snapshot held (after the warm-up).
    horizon_latency_secs: f64,
    console: console::Seed,
    fleet: fleet::FleetSizes,
    /// `--latency-relay-in-process`.
    latency_in_process: bool,
    /// `--latency-rate`.
    latency_rate: f64,
    /// `--latency-stages`.
    latency_stages: bool,
    /// `--latency-hand-written-apart`.
    latency_hand_written_apart: bool,
    /// `--latency-hand-written-burden`.
    latency_hand_written_burden: Option<u64>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.latency_rate.is_finite() && args.latency_rate >= 1.0,
        "--latency-rate must be at least 1 event/s, not {}",
        args.latency_rate
    );
    for o in &args.only {
        anyhow::ensure!(
            SECTIONS.contains(&o.as_str()),
            "unknown section {o:?} (sections: {})",
            SECTIONS.join(", ")
        );
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&args.database_url)
        .await
        .context("connecting to the database")?;
    if let Some(child) = &args.child_relayer {
        pool.close().await;
        return latency::child_relayer(
            args.database_url.clone(),
            args.amqp_url.clone(),
            child[0].clone(),
            child[1].clone(),
            args.latency_hand_written_burden,
            args.latency_stages,
        )
        .await;
    }
    if let Some(child) = &args.child_consumer {
        let n = child[1].parse().context("--child-consumer count")?;
        return consumer::child_consumer(&pool, &args.amqp_url, &child[0], n).await;
    }
    let sizes = if args.smoke {
        Sizes {
            rounds: 1,
            run_secs: 0.3,
            sweep_n: 1_000,
            growth_small: 1_000,
            growth_big: 20_000,
            growth_window: 2_000,
            growth_runs: 2,
            ordered: 2_000,
            write_secs: 0.3,
            worst_secs: 0.3,
            latency_runs: 1,
            latency_warm: 0.5,
            latency_secs: 1.0,
            memory_n: 1_000,
            horizon: (1_000, 1),
            inbox: (1_000, 5_000),
            horizon_latency_secs: 2.0,
            console: console::Seed {
                outbox: 20_000,
                dead_letters: 2_000,
                requests: 3,
            },
            fleet: fleet::FleetSizes {
                tenants: 20,
                idle_secs: 1.0,
                rest_secs: 0.0,
                discoveries: 2,
                drain: (5, 200, 1),
                fairness: fleet::Fairness {
                    tenants: 5,
                    rate: 10.0,
                    secs: 1.0,
                    backlog: 2_000,
                },
            },
            latency_in_process: args.latency_relay_in_process,
            latency_rate: args.latency_rate,
            latency_stages: args.latency_stages,
            latency_hand_written_apart: args.latency_hand_written_apart,
            latency_hand_written_burden: args.latency_hand_written_burden,
        }
    } else {
        Sizes {
            rounds: 5,
            run_secs: 10.0,
            sweep_n: 40_000,
            growth_small: 10_000,
            growth_big: 1_000_000,
            growth_window: 100_000,
            growth_runs: 3,
            ordered: 100_000,
            write_secs: 4.0,
            worst_secs: 3.0,
            latency_runs: 4,
            latency_warm: 2.0,
            latency_secs: 10.0,
            memory_n: 50_000,
            horizon: (200_000, 4),
            inbox: (100_000, 10_000_000),
            horizon_latency_secs: 600.0,
            console: console::Seed {
                outbox: 2_000_000,
                dead_letters: 200_000,
                requests: 40,
            },
            fleet: fleet::FleetSizes {
                tenants: 1_000,
                idle_secs: 60.0,
                rest_secs: 65.0,
                discoveries: 5,
                drain: (100, 1_000, 4),
                fairness: fleet::Fairness {
                    tenants: 50,
                    rate: 10.0,
                    secs: 30.0,
                    backlog: 1_000_000,
                },
            },
            latency_in_process: args.latency_relay_in_process,
            latency_rate: args.latency_rate,
            latency_stages: args.latency_stages,
            latency_hand_written_apart: args.latency_hand_written_apart,
            latency_hand_written_burden: args.latency_hand_written_burden,
        }
    };
    let _ = common::DATABASE_URL.set(args.database_url.clone());
    let mut r = Report::default();
    r.tuning("load_average_at_start", load_average());
    if sizes.latency_in_process && sizes.latency_stages {
        stages::catch_in_process()?;
    }
    if sizes.latency_in_process {
        r.tuning(
            "latency_relay",
            "the relay's code in the bench process".to_owned(),
        );
    }
    if let Some(us) = sizes.latency_hand_written_burden {
        r.tuning(
            "latency_hand_written_burden",
            format!("the relay's BEGIN and claim, {us} us of CPU per event after the commit"),
        );
    }
    let run = |section: &str| args.only.is_empty() || args.only.iter().any(|o| o == section);
    let url = args.amqp_url.as_str();
    // The consumer section preloads with the publisher's best tuning.
    let mut best_publish = PUBLISH_SWEEP[3];
    if run("relay") {
        best_publish = relay_section(&mut r, &pool, &args.database_url, url, &sizes).await?;
    }
    if run("growth") {
        growth_section(&mut r, &pool, url, &sizes).await?;
    }
    if run("ordered") {
        ordered_section(&mut r, &pool, url, &sizes).await?;
    }
    if run("write") {
        write_section(&mut r, &pool, &sizes).await?;
    }
    if run("write-causes") {
        write_causes_section(&mut r, &pool, &sizes).await?;
    }
    if run("latency") {
        latency_section(&mut r, &pool, &args.database_url, url, &sizes, "", "<= 10").await?;
    }
    if run("consumer") {
        consumer_section(&mut r, &pool, &args.database_url, url, &sizes, best_publish).await?;
    }
    if run("quorum") {
        common::use_quorum_queues(true);
        let done = quorum_section(
            &mut r,
            &pool,
            &args.database_url,
            &args.cluster_amqp_urls,
            &sizes,
        )
        .await;
        common::use_quorum_queues(false);
        done?;
    }
    if run("console") {
        console_section(&mut r, &pool, &args.database_url, &sizes).await?;
    }
    let wal_parts =
        ["wal-drain", "wal-growth", "wal-write", "wal-latency"].map(|p| run("wal") || run(p));
    if wal_parts.contains(&true) {
        common::use_wal_capture(true);
        let done = wal_section(&mut r, &pool, &args.database_url, url, &sizes, wal_parts).await;
        common::use_wal_capture(false);
        done?;
    }
    if run("horizon") || run("horizon-ordered") {
        let only_ordered = !run("horizon");
        horizon_section(&mut r, &pool, &args.database_url, url, &sizes, only_ordered).await?;
    }
    if run("horizon-latency") {
        horizon_latency_section(&mut r, &pool, &args.database_url, url, &sizes).await?;
    }
    if run("inbox") {
        inbox_section(&mut r, &pool, url, &sizes, best_publish).await?;
    }
    if run("fleet") {
        fleet_section(&mut r, &pool, &args.database_url, url, &sizes).await?;
    }
    r.tuning("load_average_at_end", load_average());
    r.print();
    r.write(&args.out, args.smoke)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}

/// The table capture (and the log's) draining rounds of a backlog into one
/// schema while a snapshot is held from the start, against the same
/// rounds with nothing held: the last held round's rate over the clean
/// rounds' mean (issue: today 0.13 for the table, 1.03 for the log).
async fn horizon_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
    only_ordered: bool,
) -> Result<()> {
    let (n, rounds) = sizes.horizon;
    let variants = [
        (false, "", "table", OrderedAggregates::None),
        (
            false,
            "ordered_",
            "table, ordered events",
            OrderedAggregates::All,
        ),
        (true, "wal_", "WAL", OrderedAggregates::None),
    ];
    for (wal, prefix, what, ordering) in variants {
        if only_ordered && ordering == OrderedAggregates::None {
            continue;
        }
        common::use_wal_capture(wal);
        eprintln!("bench: {what} capture: {rounds} rounds of {n}, clean, then a snapshot held");
        let both = async {
            let clean =
                relay::horizon_rounds(pool, database_url, url, n, rounds, ordering.clone(), false)
                    .await?;
            let held =
                relay::horizon_rounds(pool, database_url, url, n, rounds, ordering.clone(), true)
                    .await?;
            anyhow::Ok((clean, held))
        }
        .await;
        common::use_wal_capture(false);
        let ((clean, clean_bytes, _), (held, held_bytes, released_bytes)) = both?;
        let mean = clean.iter().sum::<f64>() / clean.len() as f64;
        let last = *held.last().unwrap_or(&f64::NAN);
        r.stats(
            &format!("{prefix}horizon_clean_drain_per_s"),
            &Stats { runs: clean },
            &format!("{what}: drain events/s, rounds with nothing held"),
            "",
        );
        r.stats(
            &format!("{prefix}horizon_held_drain_per_s"),
            &Stats { runs: held },
            &format!("{what}: drain events/s, rounds with a snapshot held"),
            "",
        );
        r.add(
            &format!("{prefix}horizon_drain_ratio"),
            last / mean,
            &format!("{prefix}horizon_drain_ratio (last held round / clean mean)"),
            ">= 0.9",
        );
        if !wal && ordering == OrderedAggregates::None {
            r.add(
                "horizon_outbox_size_ratio",
                held_bytes as f64 / clean_bytes.max(1) as f64,
                "  outbox on disk after the held rounds / after the clean ones",
                "",
            );
            r.add(
                "outbox_size_after_release",
                released_bytes as f64 / clean_bytes.max(1) as f64,
                "outbox_size_after_release (on disk a minute after the snapshot's release / clean)",
                "<= 2",
            );
        }
    }
    Ok(())
}

/// The relay binary's commit-to-publish latency at 500 events/s over ten
/// minutes with a snapshot held from before the first event, against the
/// same run with nothing held: p99 over p99.
async fn horizon_latency_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
) -> Result<()> {
    let secs = sizes.horizon_latency_secs;
    let mut p99 = [f64::NAN; 2];
    for (i, hold) in [false, true].into_iter().enumerate() {
        eprintln!(
            "bench: latency at 500 events/s for {secs:.0} s, {}",
            if hold {
                "a snapshot held"
            } else {
                "nothing held"
            }
        );
        let held = if hold {
            Some(common::hold_snapshot(database_url).await?)
        } else {
            None
        };
        let res = latency::latency(
            pool,
            database_url,
            url,
            latency::Relayer::Binary,
            500.0,
            sizes.latency_warm,
            secs,
            false,
        )
        .await;
        if let Some(c) = held {
            common::release_snapshot(c).await?;
        }
        let res = res?;
        for (sample, samples) in &res.samples {
            if *sample == "publish_latency" {
                let pct = latency::percentiles(sample, samples);
                p99[i] = pct[2].1;
                let key = if hold {
                    "horizon_held"
                } else {
                    "horizon_clean"
                };
                for (k, v) in pct {
                    r.add(&format!("{key}_{k}"), v, &format!("{key}_{k}"), "");
                }
            }
        }
    }
    r.add(
        "horizon_latency_p99_ratio",
        p99[1] / p99[0],
        "horizon_latency_p99_ratio (publish p99, snapshot held / nothing held)",
        "<= 1.5",
    );
    Ok(())
}

/// The consumer's batch handler with an inbox of 20 million records (ten
/// million of today, ten million of a day past the window) against an
/// empty one, then retention removing the old day.
async fn inbox_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    url: &str,
    sizes: &Sizes,
    preload: PublishTuning,
) -> Result<()> {
    let (n, per_day) = sizes.inbox;
    let rounds = sizes.rounds.min(3);
    let m = consumer::large_inbox_rates(pool, url, n, rounds, per_day, preload).await?;
    r.stats(
        "inbox_empty_per_s",
        &m.empty,
        "library batch handler effects/s, empty inbox",
        "",
    );
    r.stats(
        "inbox_large_per_s",
        &m.large,
        &format!(
            "library batch handler effects/s, {} inbox records",
            m.records
        ),
        "",
    );
    r.add(
        "inbox_large_dedup_ratio",
        m.large.median() / m.empty.median(),
        "inbox_large_dedup_ratio (large inbox / empty, medians)",
        ">= 0.9",
    );
    r.add(
        "inbox_retention_s",
        m.retention_s,
        &format!("inbox_retention_s (a day of {per_day} records removed)"),
        "<= 1",
    );
    r.add(
        "inbox_retention_rows_deleted",
        m.retention_rows_deleted as f64,
        "  rows DELETEd by that pass (the day went whole)",
        "",
    );
    Ok(())
}

/// The fleet: idle tenants' cost, a new tenant's wait, and a backlog over
/// many tenants against one schema's.
async fn fleet_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
) -> Result<()> {
    let s = &sizes.fleet;
    eprintln!("bench: fleet ({} idle tenants)", s.tenants);
    let f = fleet::fleet(pool, database_url, url, s).await?;
    r.add(
        "fleet_idle_cpu_pct",
        f.idle_cpu_pct,
        &format!(
            "fleet_idle_cpu_pct ({} idle tenants, % of a core)",
            s.tenants
        ),
        "<= 2",
    );
    r.add(
        "fleet_idle_cpu_metrics_pct",
        f.idle_cpu_metrics_pct,
        "  the same with --metrics-addr (each tenant's gauges every 15 s)",
        "",
    );
    r.add(
        "fleet_idle_connections",
        f.idle_connections as f64,
        "fleet_idle_connections (the most seen, --workers 2)",
        "<= 5",
    );
    r.add(
        "fleet_idle_rss_mib",
        f.idle_rss_mib,
        "fleet_idle_rss_mib (peak RSS)",
        "<= 64",
    );
    r.stats(
        "fleet_discovery_s",
        &f.discovery_s,
        "fleet_discovery_s (migrated -> its first event published)",
        "<= 5",
    );
    let (spread, each, _) = s.drain;
    r.stats(
        "fleet_drain_per_s",
        &f.fleet_rate,
        &format!("fleet events/s, {spread} tenants x {each}"),
        "",
    );
    r.stats(
        "fleet_single_per_s",
        &f.single_rate,
        &format!("one relay events/s, {} in one schema", spread * each),
        "",
    );
    r.stats(
        "fleet_drain_ratio",
        &f.drain_ratio,
        "fleet_drain_ratio (many tenants / one schema)",
        ">= 0.9",
    );
    let fair = &s.fairness;
    let mut p99 = [f64::NAN; 2];
    for (i, (key, samples)) in [
        ("fleet_fairness_clean", &f.trickle_clean_ms),
        ("fleet_fairness_backlog", &f.trickle_backlog_ms),
    ]
    .into_iter()
    .enumerate()
    {
        let pct = latency::percentiles(key, samples);
        p99[i] = pct[2].1;
        for (k, v) in pct {
            r.add(&k, v, &k, "");
        }
    }
    r.add(
        "fleet_fairness_p99_ratio",
        p99[1] / p99[0],
        &format!(
            "fleet_fairness_p99_ratio ({} tenants at {}/s each, commit -> received p99: one tenant draining {} / no backlog)",
            fair.tenants, fair.rate, fair.backlog
        ),
        "<= 1.2",
    );
    r.add(
        "fleet_fairness_backlog_left",
        f.backlog_left as f64,
        "  events of the backlog left when its window ended (0: it drained before)",
        "",
    );
    Ok(())
}

/// The console's page times on a seeded 2M-row outbox and 200k dead
/// letters (server time, p95 and median of each page's requests).
async fn console_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    sizes: &Sizes,
) -> Result<()> {
    let s = &sizes.console;
    eprintln!(
        "bench: console pages ({} outbox rows, {} dead letters, {} requests per page)",
        s.outbox, s.dead_letters, s.requests
    );
    let t = console::measure(pool, database_url, s).await?;
    r.tuning(
        "console_seed",
        format!(
            "{} outbox rows and {} dead letters seeded in {:.0} s",
            s.outbox, s.dead_letters, t.seed_secs
        ),
    );
    for p in &t.pages {
        r.add(
            &format!("console_{}_p95_ms", p.name),
            p.p95,
            &format!("console {}: p95 server ms (median {:.1})", p.name, p.p50),
            "<= 50",
        );
    }
    // Pages and their requests; not the reconciliation's background comparison.
    let worst = t
        .pages
        .iter()
        .filter(|p| !p.name.contains("background"))
        .map(|p| p.p95)
        .fold(0.0, f64::max);
    r.add(
        "console_worst_page_p95_ms",
        worst,
        "console: the slowest page's p95 server ms, analysed or not",
        "<= 50",
    );
    for (phase, backlog, dead) in &t.estimates {
        r.add(
            &format!("console_backlog_estimate_ratio_{phase}"),
            *backlog,
            &format!("console overview backlog / exact count ({phase})"),
            "0.85-1.15",
        );
        r.add(
            &format!("console_dead_letters_estimate_ratio_{phase}"),
            *dead,
            &format!("console overview dead letters / exact count ({phase})"),
            "0.85-1.15",
        );
    }
    r.add(
        "console_refresh_p95_ms",
        t.refresh_p95,
        "console overview refresh (background): p95 ms",
        "",
    );
    Ok(())
}

/// The write-ahead-log capture, measured like the table mode and beside
/// it: the relay binary reading the slot against the raw confirmed
/// publisher (interleaved), drain rate with a 1M against a 10k backlog in
/// the log, the write path with one business insert per transaction (no
/// event, a table row, a log message; interleaved), and latency at 1,000
/// events/s.
async fn wal_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
    [drain, growth, write, latency]: [bool; 4],
) -> Result<()> {
    if drain {
        wal_drain(r, pool, database_url, url, sizes).await?;
    }
    if growth {
        wal_growth(r, pool, url, sizes).await?;
    }
    if write {
        wal_write(r, pool, sizes).await?;
    }
    if latency {
        latency_section(r, pool, database_url, url, sizes, "wal_", "<= 5").await?;
    }
    Ok(())
}

async fn wal_drain(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
) -> Result<()> {
    eprintln!(
        "bench: WAL capture: raw publisher sweep ({} each)",
        sizes.sweep_n
    );
    let best = publish_sweep(url, sizes).await?;
    let n = ((best.1 * sizes.run_secs) as usize).clamp(1_000, 400_000);
    eprintln!(
        "bench: WAL capture: minimal reader sweep ({} each)",
        sizes.sweep_n
    );
    let design = attempt("minimal reader sweep", || {
        minimal_wal::sweep(pool, database_url, url, sizes.sweep_n)
    })
    .await?;
    r.tuning("minimal_wal_reader", design.0.to_string());
    let d = drain_rounds(
        pool,
        database_url,
        url,
        url,
        n,
        best.0,
        Some(Design::Wal(design.0)),
        sizes.rounds,
    )
    .await?;
    r.stats(
        "wal_raw_publish_per_s",
        &d.raw,
        "WAL: raw confirmed publishes/s (best tuning)",
        "",
    );
    r.stats(
        "wal_drain_per_s",
        &d.drain,
        "WAL: relay drain events/s (binary, --capture wal)",
        "",
    );
    r.ceiling(
        "wal_drain_ratio",
        &d.ratio,
        "wal_drain_ratio (relay / raw)",
        ">= 0.95",
    );
    r.add(
        "wal_relay_peak_rss_mib",
        d.rss,
        "WAL: relay peak RSS MiB",
        "<= 64",
    );
    r.add(
        "wal_drain_cpu_s_per_10k_database",
        d.drain_cpu.1 * 10_000.0 / (n * sizes.rounds) as f64,
        "  WAL drain: postgres CPU s / 10k events",
        "",
    );
    r.add(
        "wal_drain_cpu_s_per_10k_relay",
        d.drain_cpu.2 * 10_000.0 / (n * sizes.rounds) as f64,
        "  WAL drain: relay CPU s / 10k events",
        "",
    );
    design_rows(r, "wal_", "wal_drain_design_ratio", &d, |cpu: f64| {
        cpu * 10_000.0 / (n * sizes.rounds) as f64
    });
    Ok(())
}

async fn wal_growth(r: &mut Report, pool: &sqlx::PgPool, url: &str, sizes: &Sizes) -> Result<()> {
    eprintln!(
        "bench: WAL capture: backlog {} vs {}",
        sizes.growth_big, sizes.growth_small
    );
    let g = attempt("WAL growth", || {
        relay::wal_growth(
            pool,
            url,
            sizes.growth_small,
            sizes.growth_big,
            sizes.growth_window,
            sizes.growth_runs,
        )
    })
    .await?;
    r.stats(
        "wal_drain_per_s_backlog_10k",
        &g.small,
        "WAL: drain events/s, 10k backlog (in-process)",
        "",
    );
    r.stats(
        "wal_drain_per_s_backlog_1m",
        &g.big_one,
        "WAL: drain events/s, 1M backlog",
        "",
    );
    r.add(
        "wal_backlog_1m_vs_10k_ratio",
        g.big_one.median() / g.small.median(),
        "wal_backlog_1m_vs_10k_ratio",
        ">= 0.95",
    );
    Ok(())
}

async fn wal_write(r: &mut Report, pool: &sqlx::PgPool, sizes: &Sizes) -> Result<()> {
    eprintln!("bench: WAL capture: write path (one insert per transaction, 8 writers)");
    // Interleaved: no event, a row in the outbox table, a log message, the
    // ceiling of the last two (one more statement that does nothing), and
    // the design's own ceiling: a bare pg_logical_emit_message of the same
    // bytes (no slot check, no ordered-type lookup).
    let mut rates = vec![Stats::default(); 5];
    let (mut table_ratio, mut wal_ratio, mut ceiling, mut to_ceiling, mut to_bare) = (
        Stats::default(),
        Stats::default(),
        Stats::default(),
        Stats::default(),
        Stats::default(),
    );
    for round in 0..sizes.rounds {
        let mut got = [0.0; 5];
        for k in 0..5 {
            let i = (k + round) % 5;
            common::use_wal_capture(i == 2);
            let mode = (i == 1 || i == 2).then_some(Wakeup::AfterCommit);
            let shape = match i {
                3 => Shape::OneInsertAndNoop,
                4 => Shape::OneInsertAndBareEmit,
                _ => Shape::OneInsert,
            };
            got[i] = write::write_path(pool, shape, mode, sizes.worst_secs).await?;
        }
        common::use_wal_capture(true);
        eprintln!("bench:   round {}: {got:.0?} tx/s", round + 1);
        for i in 0..5 {
            rates[i].push(got[i]);
        }
        table_ratio.push(got[1] / got[0]);
        wal_ratio.push(got[2] / got[0]);
        ceiling.push(got[3] / got[0]);
        to_ceiling.push(got[2] / got[3]);
        to_bare.push(got[2] / got[4]);
    }
    r.stats(
        "wal_write_tx_per_s_baseline",
        &rates[0],
        "WAL: write tx/s, one insert, no event",
        "",
    );
    r.stats(
        "wal_write_tx_per_s_table",
        &rates[1],
        "WAL: write tx/s, one insert + outbox row",
        "",
    );
    r.stats(
        "wal_write_tx_per_s_wal",
        &rates[2],
        "WAL: write tx/s, one insert + log message",
        "",
    );
    r.stats(
        "wal_write_tx_per_s_noop",
        &rates[3],
        "WAL: write tx/s, one insert + SELECT 1 (ceiling)",
        "",
    );
    r.stats(
        "wal_write_path_ratio_table",
        &table_ratio,
        "  ratio to no event (outbox row, same rounds)",
        "",
    );
    r.stats(
        "wal_write_path_ratio",
        &wal_ratio,
        "wal_write_path_ratio (log message / no event)",
        ">= 0.9",
    );
    r.stats(
        "wal_write_statement_ceiling_ratio",
        &ceiling,
        "  ceiling: one more statement / no event",
        "",
    );
    r.ceiling(
        "wal_write_vs_ceiling_ratio",
        &to_ceiling,
        "  log message / one more statement",
        "",
    );
    r.stats(
        "wal_write_tx_per_s_bare_emit",
        &rates[4],
        "WAL: write tx/s, one insert + bare pg_logical_emit_message",
        "",
    );
    r.ceiling(
        "wal_write_path_design_ratio",
        &to_bare,
        "  log message (slot check included) / bare pg_logical_emit_message",
        ">= 0.95",
    );
    Ok(())
}

/// The relay binary's drain against the best raw confirmed publisher,
/// interleaved; returns the raw publisher's winning tuning.
async fn relay_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
) -> Result<PublishTuning> {
    eprintln!("bench: raw publisher sweep ({} each)", sizes.sweep_n);
    let best = publish_sweep(url, sizes).await?;
    let n = ((best.1 * sizes.run_secs) as usize).clamp(1_000, 400_000);
    eprintln!("bench: minimal relay loop sweep ({} each)", sizes.sweep_n);
    let design = attempt("minimal loop sweep", || {
        minimal::sweep(pool, url, sizes.sweep_n)
    })
    .await?;
    let d = drain_rounds(
        pool,
        database_url,
        url,
        url,
        n,
        best.0,
        Some(Design::Table(design.0)),
        sizes.rounds,
    )
    .await?;
    let DrainRounds {
        raw,
        drain,
        ratio,
        rss,
        raw_cpu,
        drain_cpu,
        ..
    } = &d;
    let (rss, raw_cpu, drain_cpu) = (*rss, *raw_cpu, *drain_cpu);
    r.tuning("raw_publish", best.0.to_string());
    r.tuning("minimal_loop", design.0.to_string());
    // Where the time goes: CPU seconds per 10,000 events, per process.
    let per10k = |cpu: f64| cpu * 10_000.0 / (n * sizes.rounds) as f64;
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
    r.stats(
        "raw_publish_per_s",
        raw,
        "raw confirmed publishes/s (best tuning)",
        "",
    );
    r.stats(
        "relay_drain_per_s",
        drain,
        "relay drain events/s (binary)",
        "",
    );
    r.ceiling(
        "relay_drain_ratio",
        ratio,
        "relay_drain_ratio (relay / raw)",
        ">= 0.95",
    );
    r.add("relay_peak_rss_mib", rss, "relay peak RSS MiB", "<= 64");
    design_rows(r, "", "relay_drain_design_ratio", &d, per10k);
    Ok(best.0)
}

/// The table drain against its design ceiling, the hand-written loop:
/// rates, their ratio and each process's CPU per 10,000 events (`per10k`
/// turns summed CPU seconds into that). `prefix` names the set-up (`""`
/// the table on one node, `"quorum_"` the cluster, `"wal_"` the log), `key`
/// the ratio.
fn design_rows(
    r: &mut Report,
    prefix: &str,
    key: &str,
    d: &DrainRounds,
    per10k: impl Fn(f64) -> f64,
) {
    let (minimal, ratio, relay_cpu, loop_cpu) =
        (&d.design, &d.design_ratio, d.drain_cpu, d.design_cpu);
    let on = match prefix {
        "" => "",
        "wal_" => ", WAL",
        _ => ", quorum",
    };
    r.stats(
        &format!("{prefix}minimal_loop_per_s"),
        minimal,
        &format!("hand-written drain events/s (design ceiling{on})"),
        "",
    );
    r.ceiling(
        key,
        ratio,
        &format!("{key} (relay / hand-written loop)"),
        ">= 0.95",
    );
    for (what, i) in [("broker", 0), ("database", 1), ("loop", 2)] {
        let cpu = [loop_cpu.0, loop_cpu.1, loop_cpu.2][i];
        r.add(
            &format!("{prefix}minimal_cpu_s_per_10k_{what}"),
            per10k(cpu),
            &format!("  minimal loop{on}: {what} CPU s / 10k events"),
            "",
        );
    }
    r.add(
        &format!("relay_{prefix}cpu_design_ratio"),
        relay_cpu.2 / loop_cpu.2,
        &format!("relay CPU / hand-written loop CPU per event{on}"),
        "<= 1.2",
    );
    r.add(
        &format!("database_{prefix}cpu_design_ratio"),
        relay_cpu.1 / loop_cpu.1,
        &format!("postgres CPU per event, relay / hand-written loop{on}"),
        "",
    );
}

/// On the three-node cluster with quorum queues: the relay binary (given
/// every node's URL) draining into a quorum queue against the best raw
/// confirmed publisher into the same kind of queue, interleaved; then the
/// library consumer's effects/s from a quorum queue. The queues are
/// declared through the first node, so their leader is where both
/// publishers connect.
async fn quorum_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    urls: &str,
    sizes: &Sizes,
) -> Result<()> {
    let first = outbox::urls::split_urls(urls)
        .first()
        .map(|u| (*u).to_owned())
        .context("no cluster URL")?;
    eprintln!(
        "bench: quorum queues on the cluster: raw publisher sweep ({} each)",
        sizes.sweep_n
    );
    let best = publish_sweep(&first, sizes).await?;
    let n = ((best.1 * sizes.run_secs) as usize).clamp(1_000, 400_000);
    eprintln!(
        "bench: minimal relay loop sweep, quorum ({} each)",
        sizes.sweep_n
    );
    let design = attempt("minimal loop sweep", || {
        minimal::sweep(pool, &first, sizes.sweep_n)
    })
    .await?;
    let d = drain_rounds(
        pool,
        database_url,
        &first,
        urls,
        n,
        best.0,
        Some(Design::Table(design.0)),
        sizes.rounds,
    )
    .await?;
    let DrainRounds {
        raw, drain, ratio, ..
    } = &d;
    let (raw_cpu, drain_cpu) = (d.raw_cpu, d.drain_cpu);
    r.tuning("raw_quorum_publish", best.0.to_string());
    r.tuning("minimal_loop_quorum", design.0.to_string());
    let per10k = |cpu: f64| cpu * 10_000.0 / (n * sizes.rounds) as f64;
    for (what, cpu) in [
        ("raw_quorum_cpu_s_per_10k", raw_cpu),
        ("quorum_drain_cpu_s_per_10k", drain_cpu),
    ] {
        for (part, v) in [("broker", cpu.0), ("database", cpu.1), ("client", cpu.2)] {
            r.add(
                &format!("{what}_{part}"),
                per10k(v),
                &format!("  {what}: {part} (broker: every RabbitMQ node on the machine)"),
                "",
            );
        }
    }
    design_rows(r, "quorum_", "relay_quorum_design_ratio", &d, per10k);
    r.stats(
        "raw_quorum_publish_per_s",
        raw,
        "raw confirmed publishes/s, quorum (3 nodes)",
        "",
    );
    r.stats(
        "relay_quorum_per_s",
        drain,
        "relay drain events/s, quorum (3 nodes)",
        "",
    );
    r.ceiling(
        "relay_quorum_ratio",
        ratio,
        "relay_quorum_ratio (relay / raw, quorum)",
        ">= 0.9",
    );
    eprintln!(
        "bench: consumer on a quorum queue ({} rounds)",
        sizes.rounds
    );
    let m = ((best.1 * sizes.run_secs) as usize).clamp(1_000, 200_000);
    let (batch, per_event) = consumer::library_rates(pool, &first, m, sizes.rounds, best.0).await?;
    r.stats(
        "consumer_quorum_batch_per_s",
        &batch,
        "library batch handler effects/s, quorum",
        "",
    );
    r.stats(
        "consumer_quorum_effects_per_s",
        &per_event,
        "per-event handler effects/s, quorum",
        "",
    );
    Ok(())
}

/// The raw confirmed publisher's tunings, each over `sweep_n` messages
/// into a fresh queue at `url`; the fastest and its rate.
async fn publish_sweep(url: &str, sizes: &Sizes) -> Result<(PublishTuning, f64)> {
    common::sweep_best("raw publisher", &PUBLISH_SWEEP, |t| async move {
        let (rate, _) = attempt("raw publish sweep", || {
            publish::raw_publish_rate(url, sizes.sweep_n, t)
        })
        .await?;
        Ok(rate)
    })
    .await
}

/// What [`drain_rounds`] measured.
#[derive(Default)]
struct DrainRounds {
    raw: Stats,
    drain: Stats,
    /// Relay / raw publisher, per round.
    ratio: Stats,
    /// The hand-written loop of the same design (when it ran).
    design: Stats,
    /// Relay / hand-written loop, per round.
    design_ratio: Stats,
    /// The relay's largest peak RSS, MiB.
    rss: f64,
    /// CPU seconds (broker, database, publisher) summed over the rounds.
    raw_cpu: (f64, f64, f64),
    drain_cpu: (f64, f64, f64),
    design_cpu: (f64, f64, f64),
}

/// `rounds` rounds of the raw publisher (`tuning`, at `raw_url`) against
/// the relay binary (at `relay_url`, one URL or several) draining a backlog
/// of the same `n`, and, with `design`, the hand-written loop of the
/// relay's design (at `raw_url`) draining one too; the order rotates.
#[allow(clippy::too_many_arguments)]
async fn drain_rounds(
    pool: &sqlx::PgPool,
    database_url: &str,
    raw_url: &str,
    relay_url: &str,
    n: usize,
    tuning: PublishTuning,
    design: Option<Design>,
    rounds: usize,
) -> Result<DrainRounds> {
    let mut d = DrainRounds::default();
    let parts = if design.is_some() { 3 } else { 2 };
    for round in 0..rounds {
        let mut rates = [0.0; 3];
        for k in 0..parts {
            let part = (k + round) % parts;
            if part == 0 {
                let (rate, cpu) = attempt("raw publish", || {
                    publish::raw_publish_rate(raw_url, n, tuning)
                })
                .await?;
                rates[0] = rate;
                d.raw_cpu = add3(d.raw_cpu, cpu);
            } else if part == 1 {
                let (rate, peak, cpu) = attempt("relay drain", || {
                    relay::drain_process(pool, database_url, relay_url, n)
                })
                .await?;
                rates[1] = rate;
                d.rss = d.rss.max(peak);
                d.drain_cpu = add3(d.drain_cpu, cpu);
            } else if let Some(design) = design {
                let (rate, cpu) = attempt("design ceiling", || {
                    design_rate(pool, database_url, raw_url, n, design)
                })
                .await?;
                rates[2] = rate;
                d.design_cpu = add3(d.design_cpu, cpu);
            }
        }
        eprintln!(
            "bench:   round {}: raw {:.0}/s, relay {:.0}/s, minimal loop {:.0}/s ({n} each)",
            round + 1,
            rates[0],
            rates[1],
            rates[2]
        );
        d.raw.push(rates[0]);
        d.drain.push(rates[1]);
        d.ratio.push(rates[1] / rates[0]);
        if design.is_some() {
            d.design.push(rates[2]);
            d.design_ratio.push(rates[1] / rates[2]);
        }
    }
    Ok(d)
}

/// The hand-written code of the relay's design, for one capture mode.
#[derive(Debug, Clone, Copy)]
enum Design {
    Table(LoopTuning),
    Wal(ReaderTuning),
}

impl std::fmt::Display for Design {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Design::Table(t) => t.fmt(f),
            Design::Wal(t) => t.fmt(f),
        }
    }
}

/// The design ceiling draining a backlog of `n`: its rate and CPU seconds
/// (broker, database, this process).
async fn design_rate(
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    n: usize,
    design: Design,
) -> Result<(f64, (f64, f64, f64))> {
    match design {
        Design::Table(t) => minimal::drain_rate(pool, url, n, t).await,
        Design::Wal(t) => minimal_wal::drain_rate(pool, database_url, url, n, t).await,
    }
}

fn add3(a: (f64, f64, f64), b: (f64, f64, f64)) -> (f64, f64, f64) {
    (a.0 + b.0, a.1 + b.1, a.2 + b.2)
}

async fn growth_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    url: &str,
    sizes: &Sizes,
) -> Result<()> {
    eprintln!(
        "bench: cost growth (backlog {} vs {}; one relay vs two)",
        sizes.growth_big, sizes.growth_small
    );
    let g = attempt("growth", || {
        relay::growth(
            pool,
            url,
            sizes.growth_small,
            sizes.growth_big,
            sizes.growth_window,
            sizes.growth_runs,
        )
    })
    .await?;
    let shared_buffers: String = sqlx::query_scalar("SHOW shared_buffers")
        .fetch_one(pool)
        .await?;
    r.tuning("growth_shared_buffers", shared_buffers);
    r.stats(
        "drain_per_s_backlog_10k",
        &g.small,
        "drain events/s, 10k backlog (in-process)",
        "",
    );
    r.stats(
        "drain_per_s_backlog_1m",
        &g.big_one,
        "drain events/s, 1M backlog, one relay",
        "",
    );
    r.add(
        "backlog_1m_vs_10k_ratio",
        g.big_one.median() / g.small.median(),
        "backlog_1m_vs_10k_ratio",
        ">= 0.9",
    );
    r.stats(
        "drain_per_s_two_relays",
        &g.big_two,
        "drain events/s, 1M backlog, two relays",
        "",
    );
    r.add(
        "two_relays_vs_one_ratio",
        g.big_two.median() / g.big_one.median(),
        "two relays / one relay (same backlog)",
        "",
    );
    Ok(())
}

async fn ordered_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    url: &str,
    sizes: &Sizes,
) -> Result<()> {
    // Same backlog shape (1,000 aggregates), same relay settings, one
    // after the other; unordered first, then every event ordered, then
    // ordered with three relays sharing the partitions.
    let n = sizes.ordered;
    eprintln!("bench: ordered vs unordered drain ({n} events, 1,000 aggregates)");
    let unordered = attempt("drain", || {
        relay::drain_rate(pool, url, n, 1, OrderedAggregates::None, 1_000)
    })
    .await?;
    let ordered = attempt("drain", || {
        relay::drain_rate(pool, url, n, 1, OrderedAggregates::All, 1_000)
    })
    .await?;
    let ordered3 = attempt("drain", || {
        relay::drain_rate(pool, url, n, 3, OrderedAggregates::All, 1_000)
    })
    .await?;
    // One event per aggregate: every event is a head (the claim's most
    // expensive shape).
    let ordered_wide = attempt("drain", || {
        relay::drain_rate(pool, url, n, 1, OrderedAggregates::All, n)
    })
    .await?;
    r.add(
        "unordered_drain_per_s",
        unordered,
        "drain events/s, unordered (in-process)",
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
        "drain events/s, ordered, three relays",
        "",
    );
    Ok(())
}

async fn write_section(r: &mut Report, pool: &sqlx::PgPool, sizes: &Sizes) -> Result<()> {
    eprintln!("bench: write path (order transaction, 8 writers, modes interleaved)");
    // The event's cost by wake-up mode and by where in the transaction it
    // is written, and the design's ceiling: the same bytes as one row of a
    // table with only a primary key.
    let modes: [(&str, Shape, Option<Wakeup>); 6] = [
        ("baseline", Shape::Order, None),
        ("after_commit", Shape::Order, Some(Wakeup::AfterCommit)),
        ("poll_only", Shape::Order, Some(Wakeup::PollOnly)),
        ("in_transaction", Shape::Order, Some(Wakeup::InTransaction)),
        (
            "event_first",
            Shape::OrderEventFirst,
            Some(Wakeup::AfterCommit),
        ),
        ("bare_row", Shape::OrderAndBareRow, None),
    ];
    // Warm-up, not counted: connections, caches, the first schema.
    write::write_path(
        pool,
        Shape::Order,
        Some(Wakeup::AfterCommit),
        sizes.worst_secs,
    )
    .await?;
    let mut rates = vec![Stats::default(); modes.len()];
    let mut ratios = vec![Stats::default(); modes.len()];
    let mut design = Stats::default();
    for round in 0..sizes.rounds {
        let mut got = [0.0; 6];
        for k in 0..modes.len() {
            let i = (k + round) % modes.len();
            let (_, shape, mode) = modes[i];
            got[i] = write::write_path(pool, shape, mode, sizes.write_secs).await?;
        }
        eprintln!("bench:   round {}: {got:.0?} tx/s", round + 1);
        for i in 0..modes.len() {
            rates[i].push(got[i]);
            ratios[i].push(got[i] / got[0]);
        }
        design.push(got[1] / got[5]);
    }
    r.stats(
        "write_tx_per_s_baseline",
        &rates[0],
        "write tx/s, order transaction, no event",
        "",
    );
    for i in 1..modes.len() {
        let name = modes[i].0;
        r.stats(
            &format!("write_tx_per_s_{name}"),
            &rates[i],
            &format!("write tx/s + event, {name}"),
            "",
        );
        let target = if name == "after_commit" {
            ">= 0.85"
        } else {
            ""
        };
        r.stats(
            &format!("write_path_ratio_{name}"),
            &ratios[i],
            &format!("  ratio to no event ({name})"),
            target,
        );
    }
    let default = ratios[1].clone();
    r.stats(
        "write_path_ratio",
        &default,
        "write_path_ratio (default wake-up)",
        ">= 0.85",
    );
    r.ceiling(
        "write_path_design_ratio",
        &design,
        "write_path_design_ratio (outbox event / bare row of its bytes)",
        ">= 0.95",
    );

    eprintln!("bench: write path, worst case (one insert per transaction)");
    let worst: [(Shape, Option<Wakeup>); 3] = [
        (Shape::OneInsert, None),
        (Shape::OneInsert, Some(Wakeup::AfterCommit)),
        (Shape::OneInsertAndBareRow, None),
    ];
    let (mut base, mut with, mut ratio) = (Stats::default(), Stats::default(), Stats::default());
    let (mut bare, mut design) = (Stats::default(), Stats::default());
    for round in 0..sizes.rounds {
        let mut got = [0.0; 3];
        for k in 0..worst.len() {
            let i = (k + round) % worst.len();
            let (shape, mode) = worst[i];
            got[i] = write::write_path(pool, shape, mode, sizes.worst_secs).await?;
        }
        base.push(got[0]);
        with.push(got[1]);
        bare.push(got[2]);
        ratio.push(got[1] / got[0]);
        design.push(got[1] / got[2]);
    }
    r.stats(
        "write_one_insert_tx_per_s_baseline",
        &base,
        "write tx/s, one insert, no event",
        "",
    );
    r.stats(
        "write_one_insert_tx_per_s_after_commit",
        &with,
        "write tx/s, one insert + event",
        "",
    );
    r.stats("write_one_insert_ratio", &ratio, "  ratio (worst case)", "");
    r.stats(
        "write_one_insert_tx_per_s_bare_row",
        &bare,
        "write tx/s, one insert + bare row of the event's bytes",
        "",
    );
    r.ceiling(
        "write_one_insert_design_ratio",
        &design,
        "  outbox event / bare row (worst case)",
        ">= 0.95",
    );
    Ok(())
}

/// Latency at 1,000 events/s, open loop, with the producers' current
/// capture (the `wal` section sets it): figures named `<prefix><name>`,
/// `p99_target` for the publish p99.
/// Drops every index of the outbox table but its primary key, and every
/// CHECK: the outbox row with nothing but its columns.
const BARE_OUTBOX: &str = "DO $$ DECLARE r record; BEGIN
    FOR r IN SELECT indexrelid::regclass AS i FROM pg_index
             WHERE indrelid = '{s}.outbox'::regclass AND NOT indisprimary LOOP
        EXECUTE 'DROP INDEX ' || r.i;
    END LOOP;
    FOR r IN SELECT conname FROM pg_constraint
             WHERE conrelid = '{s}.outbox'::regclass AND contype = 'c' LOOP
        EXECUTE format('ALTER TABLE {s}.outbox DROP CONSTRAINT %I', r.conname);
    END LOOP;
END $$";

/// The publishable CHECKs as migration 11 wrote them (each row through
/// `outbox_unpublishable`), before migration 14 put an inline test first.
const V11_CHECKS: &str = "ALTER TABLE {s}.outbox
    DROP CONSTRAINT outbox_names_publishable,
    DROP CONSTRAINT outbox_headers_publishable,
    ADD CONSTRAINT outbox_names_publishable CHECK (attempts > 0
        OR {s}.outbox_unpublishable(aggregate_type, event_type, exchange, routing_key, NULL) IS NULL),
    ADD CONSTRAINT outbox_headers_publishable CHECK (attempts > 0
        OR {s}.outbox_unpublishable('', '', NULL, '', headers) IS NULL)";

/// What makes up the write path's price, one part of the outbox row taken
/// away at a time (one insert per transaction, where the event's share is
/// largest; 8 writers; all in the same rounds, order rotated): the CHECKs
/// as migration 11 wrote them (before migration 14), the wake-up,
/// the due index, the two CHECKs that call `outbox_unpublishable`, the
/// library's statement (its `ON CONFLICT`), the other indexes and CHECKs,
/// and what is left: the outbox's columns against a bare row of the same
/// bytes.
async fn write_causes_section(r: &mut Report, pool: &sqlx::PgPool, sizes: &Sizes) -> Result<()> {
    eprintln!("bench: write path's price, part by part (one insert per transaction)");
    let modes: [(&str, Shape, Option<Wakeup>, Option<&str>); 9] = [
        ("baseline", Shape::OneInsert, None, None),
        (
            "after_commit",
            Shape::OneInsert,
            Some(Wakeup::AfterCommit),
            None,
        ),
        (
            "after_commit_v11_checks",
            Shape::OneInsert,
            Some(Wakeup::AfterCommit),
            Some(V11_CHECKS),
        ),
        ("poll_only", Shape::OneInsert, Some(Wakeup::PollOnly), None),
        (
            "no_due_index",
            Shape::OneInsert,
            Some(Wakeup::PollOnly),
            Some("DROP INDEX {s}.outbox_due_idx"),
        ),
        (
            "no_publishable_checks",
            Shape::OneInsert,
            Some(Wakeup::PollOnly),
            Some(
                "ALTER TABLE {s}.outbox DROP CONSTRAINT outbox_names_publishable, \
                 DROP CONSTRAINT outbox_headers_publishable",
            ),
        ),
        ("hand_insert", Shape::OneInsertAndOutboxRow, None, None),
        (
            "hand_insert_bare_table",
            Shape::OneInsertAndOutboxRow,
            None,
            Some(BARE_OUTBOX),
        ),
        ("bare_row", Shape::OneInsertAndBareRow, None, None),
    ];
    let mut rates = vec![Stats::default(); modes.len()];
    for round in 0..sizes.rounds {
        let mut got = vec![0.0; modes.len()];
        for k in 0..modes.len() {
            let i = (k + round) % modes.len();
            let (_, shape, mode, alter) = modes[i];
            got[i] = write::write_path_altered(pool, shape, mode, sizes.worst_secs, alter).await?;
        }
        eprintln!("bench:   round {}: {got:.0?} tx/s", round + 1);
        for (s, g) in rates.iter_mut().zip(&got) {
            s.push(*g);
        }
    }
    for ((name, ..), s) in modes.iter().zip(&rates) {
        r.stats(
            &format!("write_causes_tx_per_s_{name}"),
            s,
            &format!("write causes: tx/s, one insert + {name}"),
            "",
        );
    }
    Ok(())
}

/// Latency at `--latency-rate` events/s (1,000 by default) offered
/// open-loop: the relay binary and the
/// design's hand-written path (the table's `LISTEN`-claim-publish-delete
/// loop, or the log's minimal reader; each with the relay's default batch
/// of 500: at this rate batches are a few events, so the tuning does not
/// matter), alternating in each run. Ours over the hand-written path, per
/// run, at p50 and p99 of the publish latency (commit to arrival on the
/// queue; the consumer side is the same code for both). Also the CPU per
/// event each spends, with PostgreSQL's, over the same span: unlike the
/// latency ratios, it holds still from run to run on a noisy machine.
async fn latency_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
    prefix: &str,
    p99_target: &'static str,
) -> Result<()> {
    let design = if prefix.is_empty() && sizes.latency_hand_written_apart {
        latency::Relayer::MinimalApart(sizes.latency_hand_written_burden)
    } else if prefix.is_empty() {
        latency::Relayer::Minimal(latency::TABLE_LOOPS, sizes.latency_hand_written_burden)
    } else {
        // As many batches on the wire as the relay's reader allows when
        // events trickle in (64, the reader's bound; the event budget
        // 500 x 64 never binds): with 4, a reader of one-event batches
        // waited for confirms that the relay does not wait for, and its
        // p50 was 1.3 times the relay's.
        latency::Relayer::MinimalWal(ReaderTuning {
            batch: 500,
            window: 64,
        })
    };
    let mut by_key: Vec<(String, Stats)> = Vec::new();
    let mut push = |k: String, v: f64| match by_key.iter_mut().find(|(key, _)| *key == k) {
        Some((_, s)) => s.push(v),
        None => {
            let mut s = Stats::default();
            s.push(v);
            by_key.push((k, s));
        }
    };
    let mut achieved = Stats::default();
    let (mut ratio_p50, mut ratio_p99) = (Stats::default(), Stats::default());
    let mut ratio_cpu = Stats::default();
    let mut offered = 0.0;
    for run in 0..sizes.latency_runs {
        let mut publish = [(0.0, 0.0); 2];
        // The relayer's CPU and PostgreSQL's, per event.
        let mut cpu = [0.0; 2];
        // The order alternates from round to round, and the full bench
        // runs an even number of rounds, so each relayer goes first in as
        // many rounds as the other: over 20 rounds of the relay binary at
        // 500 events/s, its ratio was 1.33 at the median in the rounds it
        // went first and 1.22 in the others (with three rounds it went
        // first in two).
        for k in 0..2 {
            let i = (k + run) % 2;
            let (relayer, name) = match i {
                0 if sizes.latency_in_process && prefix.is_empty() => (
                    latency::Relayer::InProcess,
                    "the relay's code in this process",
                ),
                0 => (latency::Relayer::Binary, "the relay"),
                _ if sizes.latency_hand_written_apart && prefix.is_empty() => {
                    (design, "the hand-written path in its own process")
                }
                _ => (design, "the hand-written path"),
            };
            eprintln!(
                "bench: {prefix}latency, open loop at {} events/s, run {}: {name}",
                sizes.latency_rate,
                run + 1
            );
            let res = attempt("latency", || {
                latency::latency(
                    pool,
                    database_url,
                    url,
                    relayer,
                    sizes.latency_rate,
                    sizes.latency_warm,
                    sizes.latency_secs,
                    sizes.latency_stages,
                )
            })
            .await?;
            let who = if i == 0 { "" } else { "minimal_" };
            for (sample, samples) in &res.samples {
                let pct = latency::percentiles(sample, samples);
                if *sample == "publish_latency" {
                    publish[i] = (pct[0].1, pct[2].1);
                }
                for (k, v) in pct {
                    push(format!("{prefix}{who}{k}"), v);
                }
            }
            for (k, v) in res.cpu_ms_per_event {
                push(format!("{prefix}{who}{k}"), v);
            }
            cpu[i] = res.cpu_ms_per_event[0].1 + res.cpu_ms_per_event[1].1;
            for (k, v) in &res.stages {
                push(format!("{prefix}{who}latency_{k}"), *v);
            }
            if !res.stages.is_empty() {
                let line: Vec<String> = res
                    .stages
                    .iter()
                    .map(|(k, v)| format!("{} {v:.2}", k.trim_start_matches("stage_")))
                    .collect();
                eprintln!("bench:   {name}'s stages: {}", line.join(", "));
            }
            if i == 0 {
                offered = res.offered_per_s;
                achieved.push(res.achieved_per_s);
            }
        }
        eprintln!(
            "bench:   publish p50/p99 ms: relay {:.1}/{:.1}, hand-written {:.1}/{:.1}",
            publish[0].0, publish[0].1, publish[1].0, publish[1].1
        );
        ratio_p50.push(publish[0].0 / publish[1].0);
        ratio_p99.push(publish[0].1 / publish[1].1);
        ratio_cpu.push(cpu[0] / cpu[1]);
    }
    r.add(
        &format!("{prefix}latency_offered_per_s"),
        offered,
        &format!("{prefix}latency: offered events/s"),
        "",
    );
    r.stats(
        &format!("{prefix}latency_achieved_per_s"),
        &achieved,
        &format!("{prefix}latency: achieved events/s"),
        "",
    );
    for (k, s) in &by_key {
        let target = if *k == format!("{prefix}publish_latency_p99_ms") {
            p99_target
        } else {
            ""
        };
        r.stats(k, s, k, target);
    }
    for (p, s) in [("p50", &ratio_p50), ("p99", &ratio_p99)] {
        r.stats(
            &format!("{prefix}latency_design_ratio_{p}"),
            s,
            &format!("{prefix}latency_design_ratio_{p} (relay / hand-written, publish {p})"),
            "<= 1.2",
        );
    }
    r.stats(
        &format!("{prefix}latency_cpu_design_ratio"),
        &ratio_cpu,
        &format!("{prefix}latency_cpu_design_ratio (relay / hand-written, CPU of the relayer and PostgreSQL per event)"),
        "",
    );
    Ok(())
}

async fn consumer_section(
    r: &mut Report,
    pool: &sqlx::PgPool,
    database_url: &str,
    url: &str,
    sizes: &Sizes,
    preload: PublishTuning,
) -> Result<()> {
    eprintln!("bench: consumer (sweep, then {} rounds)", sizes.rounds);
    let plan = consumer::Plan {
        sweep_n: sizes.sweep_n,
        secs: sizes.run_secs,
        rounds: sizes.rounds,
        memory_n: sizes.memory_n,
        preload,
    };
    let c = consumer::measure(pool, database_url, url, &plan).await?;
    r.tuning("raw_ack_consumer", c.raw_tuning);
    r.tuning("hand_written_consumer", c.hand_tuning);
    r.stats(
        "consumer_raw_ack_per_s",
        &c.raw,
        "raw ack-only consumer msgs/s (best tuning)",
        "",
    );
    r.stats(
        "consumer_hand_written_per_s",
        &c.hand,
        "hand-written dedup loop msgs/s (best tuning)",
        "",
    );
    r.stats(
        "consumer_batch_handler_per_s",
        &c.batch,
        "library batch handler effects/s",
        "",
    );
    r.stats(
        "consumer_effects_per_s",
        &c.per_event,
        "consumer_effects_per_s (per-event handler)",
        ">= 5000",
    );
    r.ceiling(
        "consumer_ratio",
        &c.batch_vs_raw,
        "consumer_ratio (batch / raw ack)",
        ">= 0.6",
    );
    r.ceiling(
        "consumer_overhead_ratio",
        &c.batch_vs_hand,
        "consumer_overhead_ratio (library / hand)",
        ">= 0.9",
    );
    r.stats(
        "consumer_tuned_per_s",
        &c.tuned,
        "consumer: library, batch handler, the hand loop's prefetch/batch/linger",
        "",
    );
    r.ceiling(
        "consumer_overhead_ratio_same_tuning",
        &c.tuned_vs_hand,
        "  library with the hand loop's tuning / hand",
        ">= 0.9",
    );
    r.add(
        "consumer_peak_rss_mib",
        c.peak_rss_mib,
        "consumer peak RSS MiB",
        "",
    );
    Ok(())
}

/// The 1, 5 and 15 minute load averages: the machine is shared, and this
/// says how busy it was.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// A ratio to a ceiling above this means the ceiling is wrong.
const CEILING_SLACK: f64 = 1.05;

struct Row {
    key: String,
    label: String,
    stats: Stats,
    target: &'static str,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    tuning: Vec<(String, String)>,
    ceilings: Vec<String>,
}

impl Report {
    fn add(&mut self, key: &str, value: f64, label: &str, target: &'static str) {
        self.stats(key, &Stats { runs: vec![value] }, label, target);
    }

    fn stats(&mut self, key: &str, stats: &Stats, label: &str, target: &'static str) {
        self.rows.push(Row {
            key: key.to_owned(),
            label: label.to_owned(),
            stats: stats.clone(),
            target,
        });
    }

    /// A ratio of something to its ceiling: reported like any figure, and
    /// flagged when its median is above [`CEILING_SLACK`].
    fn ceiling(&mut self, key: &str, stats: &Stats, label: &str, target: &'static str) {
        self.ceilings.push(key.to_owned());
        self.stats(key, stats, label, target);
    }

    fn tuning(&mut self, what: &str, how: String) {
        self.tuning.push((what.to_owned(), how));
    }

    fn violations(&self) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| self.ceilings.contains(&r.key) && r.stats.median() > CEILING_SLACK)
            .collect()
    }

    fn print(&self) {
        println!(
            "\n{:<46} {:>12} {:>23}  target",
            "metric", "median", "[min - max] x runs"
        );
        for row in &self.rows {
            let s = &row.stats;
            let spread = if s.runs.len() > 1 {
                format!("[{:.2} - {:.2}] x{}", s.min(), s.max(), s.runs.len())
            } else {
                String::new()
            };
            println!(
                "{:<46} {:>12.2} {:>23}  {}",
                row.label,
                s.median(),
                spread,
                row.target
            );
        }
        println!("\nbaseline tunings (best of the sweep) and conditions:");
        for (what, how) in &self.tuning {
            println!("  {what}: {how}");
        }
        let bad = self.violations();
        if bad.is_empty() {
            println!("\nratios to ceilings: all <= {CEILING_SLACK}");
        } else {
            for row in bad {
                println!(
                    "\nWARNING: {} = {:.2} > {CEILING_SLACK}: the ceiling is too weak",
                    row.key,
                    row.stats.median()
                );
            }
        }
    }

    fn write(&self, out: &std::path::Path, smoke: bool) -> Result<()> {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut json = serde_json::Map::new();
        json.insert("smoke".into(), json!(smoke));
        let mut runs = serde_json::Map::new();
        for row in &self.rows {
            json.insert(row.key.clone(), json!(row.stats.median()));
            if row.stats.runs.len() > 1 {
                json.insert(format!("{}_min", row.key), json!(row.stats.min()));
                json.insert(format!("{}_max", row.key), json!(row.stats.max()));
                runs.insert(row.key.clone(), json!(row.stats.runs));
            }
        }
        json.insert("runs".into(), Value::Object(runs));
        let tuning: serde_json::Map<String, Value> = self
            .tuning
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        json.insert("tuning".into(), Value::Object(tuning));
        let bad: Vec<&str> = self.violations().iter().map(|r| r.key.as_str()).collect();
        json.insert("ceiling_violations".into(), json!(bad));
        std::fs::write(out, serde_json::to_string_pretty(&Value::Object(json))?)
            .with_context(|| format!("writing {}", out.display()))?;
        Ok(())
    }
}
