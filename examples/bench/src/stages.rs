//! Where an event's latency goes (`--latency-stages`): each relayer's
//! batches, stamped at their start, when their `BEGIN` and their claim
//! returned, when their messages were handed to the broker connection,
//! when their confirms were in and when they committed, lined up with
//! each event's commit (as its producer saw it) and its arrival on the
//! queue.
//!
//! The relay binary traces its batches on the target
//! `outbox_relay::stages` (JSON lines on its stderr); the table's
//! hand-written loop records the same moments in a [`StageLog`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use crate::common::lock;

/// One batch of a relayer: when it started (microseconds since the Unix
/// epoch), when its `BEGIN` and its claim returned, its messages were
/// handed to the connection, its confirms were in and it committed
/// (microseconds after its start), and the ids it moved.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Batch {
    pub(crate) start_us: i64,
    pub(crate) begun_us: i64,
    pub(crate) claimed_us: i64,
    pub(crate) handed_us: i64,
    pub(crate) confirmed_us: i64,
    pub(crate) committed_us: i64,
    pub(crate) ids: Vec<String>,
}

impl Batch {
    /// A batch from its trace's fields: `us` reads a moment by its field
    /// name, `ids` is the comma-separated list.
    fn from_fields(us: impl Fn(&str) -> Result<i64>, ids: &str) -> Result<Self> {
        Ok(Batch {
            start_us: us("start_us")?,
            begun_us: us("begun_us")?,
            claimed_us: us("claimed_us")?,
            handed_us: us("handed_us")?,
            confirmed_us: us("confirmed_us")?,
            committed_us: us("committed_us")?,
            ids: ids
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        })
    }
}

/// The batches a hand-written relayer records.
pub(crate) type StageLog = Arc<Mutex<Vec<Batch>>>;

/// Microseconds since the Unix epoch, now.
pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}

/// Turns this process's `Instant`s into microseconds since the Unix epoch
/// (the clock the relay process stamps its batches with).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    instant: Instant,
    unix_us: i64,
}

impl Clock {
    pub(crate) fn now() -> Self {
        Self {
            instant: Instant::now(),
            unix_us: now_us(),
        }
    }

    pub(crate) fn unix_us(&self, at: Instant) -> i64 {
        match at.checked_duration_since(self.instant) {
            Some(after) => self.unix_us + after.as_micros() as i64,
            None => self.unix_us - self.instant.duration_since(at).as_micros() as i64,
        }
    }
}

/// Records one batch of a hand-written relayer: `start` is when it began
/// (and in Unix time), `at` the moments after it (`BEGIN`, claim, handed,
/// confirmed, committed).
pub(crate) fn record(log: &StageLog, start: (Instant, i64), at: [Instant; 5], ids: Vec<String>) {
    let after = |i: usize| at[i].duration_since(start.0).as_micros() as i64;
    let batch = Batch {
        start_us: start.1,
        begun_us: after(0),
        claimed_us: after(1),
        handed_us: after(2),
        confirmed_us: after(3),
        committed_us: after(4),
        ids,
    };
    lock(log).push(batch);
}

/// The relay's stage trace: the `outbox_relay::stages` lines of its JSON
/// log (other lines are left out).
pub(crate) fn parse_relay_trace(log: &str) -> Result<Vec<Batch>> {
    let mut batches = Vec::new();
    for line in log.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["target"] != "outbox_relay::stages" {
            continue;
        }
        let f = &v["fields"];
        let us = |k: &str| {
            f[k].as_i64()
                .with_context(|| format!("stage trace without {k}: {line}"))
        };
        batches.push(Batch::from_fields(
            us,
            f["ids"].as_str().unwrap_or_default(),
        )?);
    }
    Ok(batches)
}

/// `batch` as a line of the relay's JSON stage trace
/// ([`parse_relay_trace`] reads it back).
pub(crate) fn trace_line(batch: &Batch) -> String {
    serde_json::json!({
        "target": "outbox_relay::stages",
        "fields": {
            "start_us": batch.start_us,
            "begun_us": batch.begun_us,
            "claimed_us": batch.claimed_us,
            "handed_us": batch.handed_us,
            "confirmed_us": batch.confirmed_us,
            "committed_us": batch.committed_us,
            "ids": batch.ids.join(","),
        },
    })
    .to_string()
}

/// Where the relay's stage trace goes while its code runs in this
/// process (`--latency-relay-in-process`): the running relayer's log.
static IN_PROCESS: Mutex<Option<StageLog>> = Mutex::new(None);

/// Catches the relay's stage trace in this process from now on (once per
/// process); a run sends it to its log with [`trace_in_process_to`].
pub(crate) fn catch_in_process() -> Result<()> {
    use tracing_subscriber::prelude::*;
    tracing_subscriber::registry()
        .with(catch_layer())
        .try_init()
        .context("a tracing subscriber is already set")
}

/// The layer of [`catch_in_process`]: the relay's stage events, nothing
/// else, into the log [`trace_in_process_to`] names.
fn catch_layer<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer;
    let only_stages = tracing_subscriber::filter::Targets::new()
        .with_target("outbox_relay::stages", tracing::Level::TRACE);
    Catch.with_filter(only_stages)
}

/// Sends the relay's stage trace in this process to `log` (`None`: drops
/// it).
pub(crate) fn trace_in_process_to(log: Option<StageLog>) {
    *lock(&IN_PROCESS) = log;
}

/// The layer that turns the relay's stage events into [`Batch`]es.
struct Catch;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Catch {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let us = |k: &str| fields.us.get(k).copied().context(k.to_owned());
        // An event without the trace's fields (none is sent) is dropped.
        let Ok(batch) = Batch::from_fields(us, &fields.ids) else {
            return;
        };
        if let Some(log) = lock(&IN_PROCESS).clone() {
            lock(&log).push(batch);
        }
    }
}

/// A stage event's fields.
#[derive(Default)]
struct Fields {
    us: HashMap<&'static str, i64>,
    ids: String,
}

impl tracing::field::Visit for Fields {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.us.insert(field.name(), value as i64);
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "ids" {
            self.ids = value.to_owned();
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

/// One event as the bench saw it: id, commit returned and arrival on the
/// queue (microseconds since the Unix epoch).
pub(crate) struct Seen {
    pub(crate) id: String,
    pub(crate) committed_us: i64,
    pub(crate) arrived_us: i64,
}

/// Medians (milliseconds) of each stage of the events' latency, with
/// `batches` lined up by id (an event in two batches counts in its
/// first): `wait` from its commit to the start of the batch that claimed
/// it, `begin` that batch's start to its `BEGIN`'s return, `claim` from
/// there to its claim's return, `hand` from there until its messages were
/// handed to the connection, `arrive` from there to the event's arrival
/// on the queue, `confirm` from the hand-over to the last confirm of the
/// batch, `settle` the confirms to the batch's commit; then the batches'
/// count, the share that found nothing and the events of a batch that
/// found some (mean).
pub(crate) fn breakdown(events: &[Seen], batches: &[Batch]) -> Vec<(&'static str, f64)> {
    let mut first: HashMap<&str, &Batch> = HashMap::new();
    for b in batches {
        for id in &b.ids {
            first.entry(id.as_str()).or_insert(b);
        }
    }
    let mut stage: [Vec<f64>; 7] = Default::default();
    for e in events {
        let Some(b) = first.get(e.id.as_str()) else {
            continue;
        };
        let ms = |us: i64| us as f64 / 1e3;
        stage[0].push(ms(b.start_us - e.committed_us));
        stage[1].push(ms(b.begun_us));
        stage[2].push(ms(b.claimed_us - b.begun_us));
        stage[3].push(ms(b.handed_us - b.claimed_us));
        stage[4].push(ms(e.arrived_us - (b.start_us + b.handed_us)));
        stage[5].push(ms(b.confirmed_us - b.handed_us));
        stage[6].push(ms(b.committed_us - b.confirmed_us));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let empty = batches.iter().filter(|b| b.ids.is_empty()).count();
    let moved: usize = batches.iter().map(|b| b.ids.len()).sum();
    let [wait, begin, claim, hand, arrive, confirm, settle] = &mut stage;
    vec![
        ("stage_wait_p50_ms", median(wait)),
        ("stage_begin_p50_ms", median(begin)),
        ("stage_claim_p50_ms", median(claim)),
        ("stage_hand_p50_ms", median(hand)),
        ("stage_arrive_p50_ms", median(arrive)),
        ("stage_confirm_p50_ms", median(confirm)),
        ("stage_settle_p50_ms", median(settle)),
        ("stage_batches", batches.len() as f64),
        (
            "stage_empty_share",
            empty as f64 / batches.len().max(1) as f64,
        ),
        (
            "stage_events_per_batch",
            moved as f64 / (batches.len() - empty).max(1) as f64,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relays_trace_is_read_and_other_lines_are_left_out() {
        let log = concat!(
            r#"{"timestamp":"t","level":"WARN","fields":{"message":"slow"},"target":"outbox_relay::worker"}"#,
            "\n",
            r#"{"timestamp":"t","level":"TRACE","fields":{"message":"batch","start_us":1000,"begun_us":100,"claimed_us":300,"handed_us":350,"confirmed_us":900,"committed_us":1200,"ids":"a,b"},"target":"outbox_relay::stages"}"#,
            "\nnot json\n",
            r#"{"timestamp":"t","level":"TRACE","fields":{"message":"batch","start_us":5000,"begun_us":100,"claimed_us":200,"handed_us":200,"confirmed_us":200,"committed_us":400,"ids":""},"target":"outbox_relay::stages"}"#,
        );
        let batches = parse_relay_trace(log).unwrap();
        assert_eq!(
            batches,
            vec![
                Batch {
                    start_us: 1000,
                    begun_us: 100,
                    claimed_us: 300,
                    handed_us: 350,
                    confirmed_us: 900,
                    committed_us: 1200,
                    ids: vec!["a".into(), "b".into()],
                },
                Batch {
                    start_us: 5000,
                    begun_us: 100,
                    claimed_us: 200,
                    handed_us: 200,
                    confirmed_us: 200,
                    committed_us: 400,
                    ids: vec![],
                },
            ]
        );
    }

    #[test]
    fn the_relays_stage_event_is_caught_in_this_process_and_others_are_not() {
        use tracing_subscriber::prelude::*;
        let log = StageLog::default();
        trace_in_process_to(Some(log.clone()));
        // This thread's subscriber only: no process-wide one is installed.
        let subscriber = tracing_subscriber::registry().with(catch_layer());
        tracing::subscriber::with_default(subscriber, || {
            // As the relay's worker traces a batch (`trace_stages`).
            let ids = "a,b".to_owned();
            tracing::trace!(
                target: "outbox_relay::stages",
                start_us = 1000u64,
                begun_us = 100u64,
                claimed_us = 300u64,
                handed_us = 350u64,
                confirmed_us = 900u64,
                committed_us = 1200u64,
                ids,
                "batch"
            );
            // Another target with the same fields, and a stage event
            // missing one: neither is a batch.
            tracing::trace!(
                target: "outbox_relay::worker",
                start_us = 1u64,
                begun_us = 1u64,
                claimed_us = 1u64,
                handed_us = 1u64,
                confirmed_us = 1u64,
                committed_us = 1u64,
                ids = "c",
                "batch"
            );
            tracing::trace!(target: "outbox_relay::stages", start_us = 1u64, "batch");
        });
        trace_in_process_to(None);
        assert_eq!(
            *lock(&log),
            vec![Batch {
                start_us: 1000,
                begun_us: 100,
                claimed_us: 300,
                handed_us: 350,
                confirmed_us: 900,
                committed_us: 1200,
                ids: vec!["a".into(), "b".into()],
            }]
        );
    }

    #[test]
    fn a_hand_written_batch_is_written_as_the_relay_traces_one() {
        let batch = Batch {
            start_us: 1_764_000_000_000_000,
            begun_us: 80,
            claimed_us: 200,
            handed_us: 260,
            confirmed_us: 900,
            committed_us: 1_100,
            ids: vec!["a".into(), "b".into()],
        };
        let empty = Batch {
            ids: vec![],
            ..batch.clone()
        };
        let log = format!("{}\n{}\n", trace_line(&batch), trace_line(&empty));
        assert_eq!(parse_relay_trace(&log).unwrap(), vec![batch, empty]);
    }

    #[test]
    fn each_event_is_lined_up_with_the_first_batch_that_moved_it() {
        let batch = |start_us, ids: &[&str]| Batch {
            start_us,
            begun_us: 200,
            claimed_us: 500,
            handed_us: 600,
            confirmed_us: 2_000,
            committed_us: 2_500,
            ids: ids.iter().map(|s| s.to_string()).collect(),
        };
        // "a" is moved again by a later batch (a redelivery): its first
        // batch counts.
        let batches = [
            batch(10_000, &["a"]),
            batch(11_000, &[]),
            batch(20_000, &["b", "a"]),
        ];
        let seen = |id: &str, committed_us, arrived_us| Seen {
            id: id.into(),
            committed_us,
            arrived_us,
        };
        let events = [seen("a", 9_000, 11_500), seen("b", 19_000, 21_000)];
        let got: HashMap<_, _> = breakdown(&events, &batches).into_iter().collect();
        // a waits 1 ms, b 1 ms; a arrives 0.9 ms after its batch handed it
        // over, b 0.4 ms: the median of two is the larger.
        assert_eq!(got["stage_wait_p50_ms"], 1.0);
        assert_eq!(got["stage_begin_p50_ms"], 0.2);
        assert_eq!(got["stage_claim_p50_ms"], 0.3);
        assert_eq!(got["stage_hand_p50_ms"], 0.1);
        assert_eq!(got["stage_arrive_p50_ms"], 0.9);
        assert_eq!(got["stage_confirm_p50_ms"], 1.4);
        assert_eq!(got["stage_settle_p50_ms"], 0.5);
        assert_eq!(got["stage_batches"], 3.0);
        assert_eq!(got["stage_empty_share"], 1.0 / 3.0);
        assert_eq!(got["stage_events_per_batch"], 1.5);
    }

    #[test]
    fn an_instant_before_the_clocks_reading_is_earlier_in_unix_time() {
        let clock = Clock::now();
        let later = clock.instant + std::time::Duration::from_millis(3);
        assert_eq!(clock.unix_us(later), clock.unix_us + 3_000);
        if let Some(earlier) = clock
            .instant
            .checked_sub(std::time::Duration::from_millis(2))
        {
            assert_eq!(clock.unix_us(earlier), clock.unix_us - 2_000);
        }
    }
}
