//! The Consumers page: per consumer queue (`--consumer-queue`), the depth
//! of its work, retry and dead-letter queues (read from the broker at
//! each request, one passive declare each); per consumer name, the events
//! processed in the last minute, counted from its inbox table by a
//! background refresher (an index range on `processed_at`, never a scan).
//! Without `--amqp-url` the page says how to turn the broker side on.

use outbox_core::queues::{MAX_WORK_QUEUE_LEN, dead_letter_queue, retry_queue};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Result, bail};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outbox::Ident;
use outbox::redact::SecretUrl;
use outbox_core::sql::Template;
use tokio_util::sync::CancellationToken;

use super::amqp::Broker;
use super::layout::{count, page, time};
use super::reconcile::Reconciliations;
use super::{ConsoleState, PageResult, Shared};

/// A consumer's work queue, and the consumer name its inbox rows carry.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerQueue {
    pub(crate) consumer: Option<String>,
    pub(crate) queue: String,
}

/// The consumer pages' flags, checked.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerOptions {
    /// The broker; `None`: the broker side is off.
    pub(crate) amqp_url: Option<SecretUrl>,
    pub(crate) queues: Vec<ConsumerQueue>,
    /// Where the `inbox` table is (same database).
    pub(crate) inbox_schema: Ident,
}

impl ConsumerOptions {
    pub(crate) fn new(urls: &[String], queues: &[String], inbox_schema: &str) -> Result<Self> {
        let urls: Vec<&str> = urls
            .iter()
            .map(|u| u.trim())
            .filter(|u| !u.is_empty())
            .collect();
        let amqp_url = if urls.is_empty() {
            None
        } else {
            let list = urls.join(",");
            outbox::urls::check_urls(&list, "--amqp-url", &["amqp", "amqps"])
                .map_err(anyhow::Error::msg)?;
            Some(SecretUrl::new(list))
        };
        let queues = queues
            .iter()
            .filter(|q| !q.trim().is_empty())
            .map(|q| parse_queue(q.trim()))
            .collect::<Result<Vec<_>>>()?;
        Ok(ConsumerOptions {
            amqp_url,
            queues,
            inbox_schema: Ident::new("inbox schema", inbox_schema)?,
        })
    }

    /// The queue of the consumer named `consumer`.
    pub(crate) fn queue_of(&self, consumer: &str) -> Option<&str> {
        self.queues
            .iter()
            .find(|q| q.consumer.as_deref() == Some(consumer))
            .map(|q| q.queue.as_str())
    }

    pub(crate) fn is_queue(&self, queue: &str) -> bool {
        self.queues.iter().any(|q| q.queue == queue)
    }
}

/// `QUEUE` or `CONSUMER=QUEUE`.
fn parse_queue(text: &str) -> Result<ConsumerQueue> {
    let (consumer, queue) = match text.split_once('=') {
        Some((c, q)) => (Some(c.trim().to_owned()), q.trim().to_owned()),
        None => (None, text.to_owned()),
    };
    // Room for `.retry`: AMQP names are at most 255 bytes.
    if queue.is_empty() || queue.len() > MAX_WORK_QUEUE_LEN || consumer.as_deref() == Some("") {
        bail!(
            "--consumer-queue: expected QUEUE or CONSUMER=QUEUE (a queue name of 1 to 249 bytes), got {text:?}"
        );
    }
    Ok(ConsumerQueue { consumer, queue })
}

/// What the consumer pages share: the broker connection, the processed
/// rates and the reconciliations computed.
pub(crate) struct State {
    pub(crate) broker: Option<Broker>,
    rates: RwLock<Arc<Rates>>,
    pub(crate) reconciliations: Reconciliations,
}

impl State {
    pub(crate) fn new(options: &ConsumerOptions) -> State {
        State {
            broker: options
                .amqp_url
                .clone()
                .map(|u| Broker::new(u, Duration::from_secs(10))),
            rates: RwLock::new(Arc::new(Rates::default())),
            reconciliations: Reconciliations::default(),
        }
    }

    fn rates(&self) -> Arc<Rates> {
        self.rates.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Events processed in the last minute, per consumer name.
#[derive(Debug, Default)]
struct Rates {
    taken_at: Option<DateTime<Utc>>,
    per_consumer: Vec<(String, i64)>,
    /// Why they could not be read (no inbox table there, say).
    error: Option<String>,
}

/// Reads the processed rates every `--refresh`.
pub(crate) async fn refresh_rates(console: Shared, shutdown: CancellationToken) {
    let sql = Template::unqualified(include_str!("consumers/processed_last_minute.sql"))
        .with("inbox", console.options.consumers.inbox_schema.quoted())
        .render();
    loop {
        let read = sqlx::query_as::<_, (String, i64)>(sql.clone())
            .fetch_all(&console.pool)
            .await;
        let mut rates = Rates {
            taken_at: Some(Utc::now()),
            ..Rates::default()
        };
        match read {
            Ok(rows) => rates.per_consumer = rows,
            Err(e) => rates.error = Some(super::scrub(&e.to_string())),
        }
        for q in &console.options.consumers.queues {
            if let Some(c) = &q.consumer
                && !rates.per_consumer.iter().any(|(n, _)| n == c)
            {
                rates.per_consumer.push((c.clone(), 0));
            }
        }
        *console
            .consumers
            .rates
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(rates);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(console.options.refresh) => {}
        }
    }
}

/// A queue's ready messages and consumers; `None`: no such queue.
type Depth = Result<Option<(u32, u32)>>;

/// One queue's depth as the page shows it.
fn depth_cell(id: String, d: &Depth) -> Markup {
    match d {
        Ok(Some((ready, _))) => {
            html! { td.num id=(id) data-count=(ready) { (count(i64::from(*ready))) } }
        }
        Ok(None) => html! { td.num.muted id=(id) { "missing" } },
        Err(_) => html! { td.num.err id=(id) { "unreadable" } },
    }
}

/// The three queues of each consumer queue, read concurrently.
async fn depths(broker: &Broker, queues: &[ConsumerQueue]) -> Vec<[Depth; 3]> {
    let reads = queues.iter().map(|q| async move {
        let (retry, dlq) = (retry_queue(&q.queue), dead_letter_queue(&q.queue));
        let (work, retry, dlq) = tokio::join!(
            broker.depth(&q.queue),
            broker.depth(&retry),
            broker.depth(&dlq),
        );
        [work, retry, dlq]
    });
    futures_util::future::join_all(reads).await
}

fn how_to_enable() -> Markup {
    html! {
        div.flash.warn id="consumers-off" {
            "The consumer pages read the broker: start the console with "
            code { "--amqp-url amqp://user:password@host:5672/%2f" } " (or "
            code { "OUTBOX_CONSOLE_AMQP_URL" } ") and name the consumers' queues with "
            code { "--consumer-queue CONSUMER=QUEUE" } " (repeat it for each). "
            "See docs/OPERATIONS.md, \"Console\"."
        }
    }
}

fn queue_table(console: &super::Console, queues: &[ConsumerQueue], d: &[[Depth; 3]]) -> Markup {
    html! {
        table id="consumer-queues" {
            thead { tr { th { "queue" } th { "consumer" } th.num { "ready" } th.num { "consumers" }
                th.num { "retry" } th.num { "dead letters" } th { "" } } }
            tbody {
                @for (i, (q, [work, retry, dlq])) in queues.iter().zip(d).enumerate() {
                    tr data-queue=(q.queue) {
                        td { code { (q.queue) } }
                        td { (q.consumer.as_deref().unwrap_or("")) }
                        (depth_cell(format!("work-{i}"), work))
                        td.num { @if let Ok(Some((_, c))) = work { (c) } }
                        (depth_cell(format!("retry-{i}"), retry))
                        (depth_cell(format!("dlq-{i}"), dlq))
                        td { a href=(console.url(&format!("/consumers/dlq?queue={}", urlencode(&q.queue)))) { "dead letters »" } }
                    }
                }
                @if queues.is_empty() { tr { td colspan="7" .muted { "No queue named: add --consumer-queue CONSUMER=QUEUE." } } }
            }
        }
    }
}

pub(crate) fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

fn rate_table(console: &super::Console, rates: &Rates) -> Markup {
    html! {
        @if let Some(e) = &rates.error {
            div.flash.bad id="rates-error" { "Could not read the inbox in schema " (console.options.consumers.inbox_schema.as_str()) ": " (e) }
        }
        table id="processed-rates" {
            thead { tr { th { "consumer" } th.num { "processed, last minute" } th.num { "per second" } th { "" } } }
            tbody {
                @for (name, n) in &rates.per_consumer {
                    tr data-consumer=(name) {
                        td { (name) }
                        td.num.processed data-count=(n) { (count(*n)) }
                        td.num { (format!("{:.1}", *n as f64 / 60.0)) }
                        td { @if console.options.consumers.queue_of(name).is_some() {
                            a href=(console.url(&format!("/reconcile?consumer={}", urlencode(name)))) { "reconcile »" }
                        } }
                    }
                }
                @if rates.per_consumer.is_empty() { tr { td colspan="4" .muted { "Nothing processed in the last minute." } } }
            }
        }
        p.muted { "From the inbox table in schema " (console.options.consumers.inbox_schema.as_str())
            @if let Some(t) = rates.taken_at { ", read at " (time(t)) " UTC" } "." }
    }
}

pub(crate) async fn overview(state: ConsoleState, headers: HeaderMap) -> PageResult {
    let console = &state.0;
    let queues = &console.options.consumers.queues;
    let broker_side = match &console.consumers.broker {
        None => how_to_enable(),
        Some(broker) => {
            let d = depths(broker, queues).await;
            queue_table(console, queues, &d)
        }
    };
    let body = html! {
        h1 { "Consumers" }
        h2 { "Queues" }
        (broker_side)
        h2 { "Processed events" }
        (rate_table(console, &console.consumers.rates()))
    };
    Ok(page(
        console,
        &headers,
        "/consumers",
        "Consumers",
        None,
        body,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_queue_may_name_its_consumer() {
        let q = parse_queue("stock.orders").unwrap();
        assert_eq!((q.consumer, q.queue.as_str()), (None, "stock.orders"));
        let q = parse_queue("stock=stock.orders").unwrap();
        assert_eq!(
            (q.consumer.as_deref(), q.queue.as_str()),
            (Some("stock"), "stock.orders")
        );
        assert!(parse_queue("stock=").is_err());
        assert!(parse_queue("=q").is_err());
        assert!(parse_queue(&"q".repeat(250)).is_err());
    }

    #[test]
    fn urls_are_checked_and_never_shown() {
        let o =
            ConsumerOptions::new(&["amqp://u:s3cret@h:5672/%2f".into()], &[], "public").unwrap();
        let shown = format!("{o:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        let e = ConsumerOptions::new(&["http://u:s3cret@h".into()], &[], "public").unwrap_err();
        assert!(!e.to_string().contains("s3cret"), "{e}");
    }
}
