use std::time::Duration;

use outbox::Ident;
use outbox::redact::SecretUrl;

use crate::error::{Error, Result};

/// Where the dedup key of a message comes from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DedupKey {
    /// The AMQP `message_id` (the event id, for messages published by the
    /// outbox relay). A message without one is dead-lettered.
    #[default]
    MessageId,
    /// The named AMQP header, for producers that carry their key there. A
    /// message without the header is dead-lettered.
    Header(String),
    /// A natural key inside the JSON payload, as a JSON pointer
    /// (`"/order_id"`). Strings are used as they are; numbers and booleans as
    /// their JSON text. A message without the field is dead-lettered.
    PayloadField(String),
}

/// Default of [`ConsumerConfig::max_deferrals`].
const DEFAULT_MAX_DEFERRALS: u32 = 100;

/// Whether a consumer applies sequenced events in per-aggregate order
/// ([`docs/CONSUMER.md`](https://github.com/outbox-rs/outbox/blob/main/docs/CONSUMER.md), "Ordered consumption").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Sequencing {
    /// Every event is applied when it arrives; the `x-aggregate-seq`
    /// header is ignored.
    #[default]
    Off,
    /// Events carrying `x-aggregate-seq` are applied in sequence per
    /// aggregate (`x-aggregate-type`, `x-aggregate-id`), tracked in the
    /// `inbox_sequences` table in the same transaction as their effects: a
    /// sequence number at or below the last applied one is stale (acked,
    /// handler not run); one above the next expected is a gap (deferred:
    /// sent back through the retry queue until the missing event was
    /// applied, at most [`max_deferrals`](ConsumerConfig::max_deferrals)
    /// times, then dead-lettered). Deferrals do not count against
    /// [`max_retries`](ConsumerConfig::max_retries). Events without the
    /// header are not affected. Needs a per-event
    /// [`Handler`](crate::Handler).
    BySequence {
        /// For an aggregate this consumer has no record of, accept the
        /// lowest sequence number among the fresh events of the batch that
        /// first brings it as the start (for a consumer joining a stream
        /// whose early events it never received). When false, every
        /// aggregate starts at 1.
        accept_first_seen: bool,
    },
}

impl Sequencing {
    /// Per-aggregate ordering, every aggregate starting at sequence 1.
    pub const fn by_sequence() -> Self {
        Sequencing::BySequence {
            accept_first_seen: false,
        }
    }

    pub(crate) fn is_on(&self) -> bool {
        !matches!(self, Sequencing::Off)
    }
}

/// Configuration of a [`Consumer`](crate::Consumer).
///
/// Like every configuration of the toolkit: start from
/// [`ConsumerConfig::new`] (the values that have no default), assign the
/// fields you change; [`Consumer::new`](crate::Consumer::new) validates the
/// result. Its `Debug` output redacts the passwords of `amqp_url`.
///
/// ```
/// use outbox_consumer::{ConsumerConfig, Sequencing};
/// let mut config = ConsumerConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "stock.orders", "stock");
/// config.schema = "stock".into();
/// config.sequencing = Sequencing::by_sequence();
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// AMQP URL of the broker (`amqp://user:pass@host:5672/%2f`), or the
    /// URLs of several nodes of one cluster separated by commas: the
    /// consumer connects to the first that answers and, on every
    /// reconnect, starts with the next one. A comma in a password is
    /// written `%2C`.
    pub amqp_url: SecretUrl,
    /// The queue to consume. Retries go through `<queue>.retry`, dead
    /// letters to `<queue>.dlq`.
    pub queue: String,
    /// The consumer name: the inbox keeps dedup state per name, so every
    /// subscriber of a fan-out is independent. Instances of one service
    /// share one name.
    pub consumer_name: String,
    /// Schema holding the inbox tables (see [`migrate`](crate::migrate)).
    pub schema: String,
    /// AMQP prefetch (unacknowledged deliveries in flight). At least
    /// `batch_size`. Default 512: twice the batch, so the next batch is
    /// already buffered while one commits.
    pub prefetch: u16,
    /// Most deliveries processed in one database transaction. Default 256
    /// (per batch: one inbox statement, the handler's work and one commit,
    /// so a larger batch spreads the commit over more events; see
    /// `docs/BENCHMARKS.md`, "Consumer").
    pub batch_size: usize,
    /// Longest wait for a batch to fill once its first delivery arrived.
    /// Default 2 ms: a batch takes every delivery already buffered (up to
    /// `batch_size`) plus those arriving within 2 ms. Under load batches
    /// fill; at low load an event waits at most 2 ms for company. Zero is
    /// pure natural batching (lowest latency, smaller batches when the
    /// broker refills the prefetch window slower than the database commits).
    pub batch_max_wait: Duration,
    /// How many times a handler may ask for a retry before the message is
    /// dead-lettered. Default 5.
    pub max_retries: u32,
    /// Delay before the first retry; doubles with every retry. Default 1 s.
    pub retry_delay: Duration,
    /// Upper bound of the retry delay, of handler retries and deferrals
    /// alike. Default 5 min.
    pub max_retry_delay: Duration,
    /// With ordering on: how many times a sequenced event may be deferred
    /// (sent back through the retry queue because of a sequence gap, or
    /// held back behind a failed earlier event of its aggregate) before it
    /// is dead-lettered. Counted in header `x-deferral-count`, separately
    /// from the handler's `max_retries`; the delay doubles from
    /// `retry_delay` up to `max_retry_delay`. Default 100: with the default
    /// delays (1 s doubling to 5 min) a gap may stay open about 7.7 hours
    /// (511 s for the first 9 deferrals, then 91 × 5 min), at least.
    pub max_deferrals: u32,
    /// Where the dedup key comes from. Default: the AMQP message id.
    pub dedup_key: DedupKey,
    /// Bound on every broker round trip (connect, declare, confirm, ack).
    /// Default 10 s.
    pub broker_timeout: Duration,
    /// Bound, from the consumer's side, on each database round trip of
    /// its own beyond the lock waits `lock_timeout` allows (taking a
    /// connection, `BEGIN`, the inbox's record of the keys, the sequence locks,
    /// savepoints, `COMMIT`; the statement after a handler call gets
    /// `handler_timeout` more). A connection that does not answer within
    /// it (a link gone silent: no RST ever comes) is closed, never given
    /// back to the pool, and the batch waited out like any unreachable
    /// database: nothing committed, nothing acked, nothing charged.
    /// Default 10 s.
    pub database_timeout: Duration,
    /// Longest pause between reconnection attempts (the pause starts at
    /// 100 ms and doubles). Default 5 s.
    pub max_reconnect_delay: Duration,
    /// Declare `<queue>.retry` and `<queue>.dlq` at start-up (idempotent).
    /// Default true. The main queue itself is not declared; see
    /// [`declare_topology`](crate::declare_topology).
    pub declare_retry_queues: bool,
    /// Type of the retry and dead-letter queues declared at start-up; the
    /// same as the topology's ([`TopologyConfig::queue_type`](crate::TopologyConfig::queue_type)).
    /// Default [`QueueType::Quorum`](crate::QueueType::Quorum).
    pub queue_type: crate::QueueType,
    /// Per-aggregate ordering of sequenced events. Default
    /// [`Sequencing::Off`].
    pub sequencing: Sequencing,
    /// Longest one handler call may take (a per-event handler's call for
    /// one event, a batch handler's call for the batch). A handler that
    /// has not returned by then is abandoned and its event retried
    /// ([`Outcome::Retry`](crate::Outcome::Retry), counted against
    /// `max_retries`), its effects rolled back. Also the batch
    /// transaction's `statement_timeout`. Default 30 s.
    pub handler_timeout: Duration,
    /// Longest any statement of the batch transaction (the inbox's record of the keys,
    /// the sequence locks, a handler's statements) waits for a row lock
    /// (`lock_timeout`): an instance never waits behind another's stuck
    /// batch for longer. Default 10 s.
    pub lock_timeout: Duration,
    /// How many times in a row a batch's transaction may fail for another
    /// reason than an unreachable database (a lock timeout, a constraint
    /// its inbox rows break) before its events go through the retry queue
    /// one by one, counted against `max_retries` like a handler's retry.
    /// An unreachable database is waited out instead: nothing is acked
    /// before its commit. A deadlock or a serialization failure is not
    /// counted here: the transaction runs again at once
    /// ([`Outcome::Conflict`](crate::Outcome::Conflict)). Default 5.
    pub max_batch_attempts: u32,
}

impl ConsumerConfig {
    /// A configuration with the defaults and schema `public`.
    pub fn new(
        amqp_url: impl Into<String>,
        queue: impl Into<String>,
        consumer_name: impl Into<String>,
    ) -> Self {
        Self {
            amqp_url: SecretUrl::new(amqp_url),
            queue: queue.into(),
            consumer_name: consumer_name.into(),
            schema: "public".to_owned(),
            prefetch: 512,
            batch_size: 256,
            batch_max_wait: Duration::from_millis(2),
            max_retries: 5,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(300),
            max_deferrals: DEFAULT_MAX_DEFERRALS,
            dedup_key: DedupKey::MessageId,
            broker_timeout: Duration::from_secs(10),
            database_timeout: Duration::from_secs(10),
            max_reconnect_delay: Duration::from_secs(5),
            declare_retry_queues: true,
            queue_type: crate::QueueType::default(),
            sequencing: Sequencing::Off,
            handler_timeout: Duration::from_secs(30),
            lock_timeout: Duration::from_secs(10),
            max_batch_attempts: 5,
        }
    }

    /// Checks the configuration; returns the validated schema name.
    pub(crate) fn validate(&self) -> Result<Ident> {
        let schema = Ident::new("schema", &self.schema)?;
        let fail = |m: &str| Err(Error::Config(m.to_owned()));
        outbox::urls::check_urls(self.amqp_url.expose(), "AMQP URL", &["amqp", "amqps"])
            .map_err(Error::Config)?;
        if outbox::urls::split_urls(self.amqp_url.expose())
            .iter()
            .any(|u| u.parse::<lapin::uri::AMQPUri>().is_err())
        {
            // lapin's own reading (its error would quote the URL).
            return fail(
                "AMQP URL is malformed (its user, host, vhost or query parameters); the value is not shown: it may hold a password",
            );
        }
        if self.queue.is_empty() || self.queue.len() > 240 {
            return fail(
                "queue must be 1 to 240 bytes (the retry and dead-letter queues add a suffix)",
            );
        }
        if self.consumer_name.is_empty() {
            return fail("consumer_name must not be empty");
        }
        if self.batch_size == 0 {
            return fail("batch_size must be at least 1");
        }
        if usize::from(self.prefetch) < self.batch_size {
            return fail("prefetch must be at least batch_size, or batches never fill");
        }
        if self.broker_timeout.is_zero() {
            return fail("broker_timeout must be positive");
        }
        if self.database_timeout.is_zero() {
            return fail("database_timeout must be positive");
        }
        if self.handler_timeout.is_zero() || self.lock_timeout.is_zero() {
            return fail("handler_timeout and lock_timeout must be positive");
        }
        if self.max_batch_attempts == 0 {
            return fail("max_batch_attempts must be at least 1");
        }
        if let DedupKey::PayloadField(p) = &self.dedup_key
            && !p.starts_with('/')
        {
            return fail("a payload dedup key is a JSON pointer and starts with '/'");
        }
        if let DedupKey::Header(h) = &self.dedup_key
            && h.is_empty()
        {
            return fail("a header dedup key needs a header name");
        }
        Ok(schema)
    }

    /// The batch transaction's BEGIN: every statement bounded by
    /// `handler_timeout`, every lock wait by `lock_timeout`, and idling
    /// inside it (a handler computing, the broker answering) by
    /// `handler_timeout` plus `broker_timeout` plus 5 s, so a stuck
    /// consumer never holds its inbox rows for long.
    pub(crate) fn begin_batch(&self) -> sqlx::SqlStr {
        let ms = |d: Duration| d.as_millis().max(1);
        let idle = self.handler_timeout + self.broker_timeout + Duration::from_secs(5);
        // `SET` takes no bind parameters: the durations are the
        // configuration's own numbers.
        outbox_core::sql::Template::unqualified(
            "BEGIN; SET LOCAL statement_timeout = '{statement_ms}ms'; \
             SET LOCAL lock_timeout = '{lock_ms}ms'; \
             SET LOCAL idle_in_transaction_session_timeout = '{idle_ms}ms'",
        )
        .with("statement_ms", ms(self.handler_timeout).to_string())
        .with("lock_ms", ms(self.lock_timeout).to_string())
        .with("idle_ms", ms(idle).to_string())
        .render()
    }

    /// Name of the retry queue.
    pub fn retry_queue(&self) -> String {
        outbox_core::queues::retry_queue(&self.queue)
    }

    /// Name of the dead-letter queue.
    pub fn dead_letter_queue(&self) -> String {
        outbox_core::queues::dead_letter_queue(&self.queue)
    }

    /// Delay before the retry number `attempt` (1 for the first retry), or
    /// before the deferral number `attempt`.
    pub(crate) fn retry_backoff(&self, attempt: u32) -> Duration {
        outbox_core::backoff::capped(self.retry_delay, self.max_retry_delay, attempt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ConsumerConfig {
        ConsumerConfig::new("amqp://x", "q", "c")
    }

    #[test]
    fn defaults_are_valid() {
        assert!(cfg().validate().is_ok());
        assert_eq!(cfg().prefetch, 512);
        assert_eq!(cfg().batch_size, 256);
    }

    #[test]
    fn rejects_bad_settings() {
        let mut c = cfg();
        c.batch_size = 1000;
        assert!(matches!(c.validate(), Err(Error::Config(_))));
        let mut c = cfg();
        c.schema = "Bad-Name".into();
        assert!(matches!(c.validate(), Err(Error::Outbox(_))));
        let mut c = cfg();
        c.dedup_key = DedupKey::PayloadField("id".into());
        assert!(matches!(c.validate(), Err(Error::Config(_))));
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let mut c = cfg();
        c.retry_delay = Duration::from_millis(100);
        c.max_retry_delay = Duration::from_millis(500);
        assert_eq!(c.retry_backoff(1), Duration::from_millis(100));
        assert_eq!(c.retry_backoff(2), Duration::from_millis(200));
        assert_eq!(c.retry_backoff(3), Duration::from_millis(400));
        assert_eq!(c.retry_backoff(4), Duration::from_millis(500));
        assert_eq!(c.retry_backoff(99), Duration::from_millis(500));
    }

    #[test]
    fn default_deferral_budget_keeps_a_gap_open_for_hours() {
        let c = cfg();
        let total: Duration = (1..=c.max_deferrals).map(|n| c.retry_backoff(n)).sum();
        // As documented on `max_deferrals`: 511 s + 91 × 5 min.
        assert_eq!(total, Duration::from_secs(511 + 91 * 300));
        assert!(total > Duration::from_secs(7 * 3600));
    }
}
