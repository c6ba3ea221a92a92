//! The relay engine in-process ([`TestRelay`]): a configuration for a
//! test's schema and exchange with fast timings, and a run
//! ([`RunningRelay`]) that stops with the test.

use std::ops::Deref;
use std::time::Duration;

use outbox_relay::{Relay, RelayConfig, WalCapture};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{TestBroker, TestDb, amqp_url, database_url};

/// How long [`RunningRelay::stop`] waits for `run` to return once
/// cancelled: past the default drain timeout (30 s) with room to spare.
const STOP_DEADLINE: Duration = Duration::from_secs(120);

/// An in-process relay for a [`TestDb`]'s schema and a [`TestBroker`]'s
/// exchange, configured step by step, then built ([`TestRelay::build`]) or
/// started ([`TestRelay::start`]).
///
/// ```ignore
/// let relay = TestRelay::new(&db, &broker).with(|c| c.max_attempts = 4).start().await;
/// // ...
/// relay.stop().await;
/// ```
#[derive(Debug)]
pub struct TestRelay {
    config: RelayConfig,
    pool: Pool,
}

/// The pool the relay is built on.
#[derive(Debug)]
enum Pool {
    /// A clone of the test's own.
    Given(PgPool),
    /// One of its own, its sessions named (see [`crate::pool`]).
    Named(String, u32),
}

impl TestRelay {
    /// The tests' usual settings: `db`'s schema, `broker`'s exchange as the
    /// default (not declared), a 200 ms poll, retries after 50 ms doubling
    /// up to 400 ms, reconnects after 50 ms up to 500 ms; everything else
    /// as [`RelayConfig::default`].
    pub fn config(db: &TestDb, broker: &TestBroker) -> RelayConfig {
        let mut c = Self::broker_config(broker);
        c.schema = db.schema.clone();
        c
    }

    /// [`TestRelay::config`] without a schema (a fleet's: each tenant's is
    /// its own).
    pub fn broker_config(broker: &TestBroker) -> RelayConfig {
        let mut c = RelayConfig::default();
        c.amqp_url = amqp_url().into();
        c.default_exchange = broker.exchange.clone();
        c.declare_exchange = None;
        c.poll_interval = Duration::from_millis(200);
        c.retry_base = Duration::from_millis(50);
        c.retry_max = Duration::from_millis(400);
        c.reconnect_min = Duration::from_millis(50);
        c.reconnect_max = Duration::from_millis(500);
        c
    }

    /// A relay of [`TestRelay::config`] on `db`'s pool.
    pub fn new(db: &TestDb, broker: &TestBroker) -> Self {
        Self::with_config(db.pool.clone(), Self::config(db, broker))
    }

    /// A relay of `config` on `pool`.
    pub fn with_config(pool: PgPool, config: RelayConfig) -> Self {
        Self {
            config,
            pool: Pool::Given(pool),
        }
    }

    /// Changes the configuration.
    pub fn with(mut self, adjust: impl FnOnce(&mut RelayConfig)) -> Self {
        adjust(&mut self.config);
        self
    }

    /// Reads the write-ahead log of the test database (a schema of
    /// [`TestDb::producer_wal`]): [`WalCapture::new`] with a 200 ms
    /// standby poll.
    pub fn wal(self) -> Self {
        self.with(|c| {
            let mut wal = WalCapture::new(database_url());
            wal.standby_poll = Duration::from_millis(200);
            c.wal = Some(wal);
        })
    }

    /// Builds on `pool` instead.
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Pool::Given(pool);
        self
    }

    /// Builds on a pool of its own, of `max` connections, whose sessions
    /// carry `application_name` (so a test can find or end them).
    pub fn own_pool(mut self, application_name: &str, max: u32) -> Self {
        self.pool = Pool::Named(application_name.to_owned(), max);
        self
    }

    /// [`Relay::new`], which may refuse (for the tests of what it refuses).
    pub async fn try_build(self) -> outbox_relay::Result<Relay> {
        let pool = match self.pool {
            Pool::Given(pool) => pool,
            Pool::Named(name, max) => crate::pool(&name, max).await,
        };
        Relay::new(pool, self.config).await
    }

    /// The relay, not running yet (for a test that wakes it, runs it more
    /// than once or drives its batches itself).
    pub async fn build(self) -> Relay {
        self.try_build().await.expect("the relay starts")
    }

    /// [`start`](Self::start), with the relay's log in the test's output
    /// as `RUST_LOG` says.
    pub async fn start_logged(self) -> RunningRelay {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        self.start().await
    }

    /// Builds the relay and runs it until stopped.
    pub async fn start(self) -> RunningRelay {
        Self::spawn(&self.build().await)
    }

    /// Runs (a clone of) `relay` until stopped.
    pub fn spawn(relay: &Relay) -> RunningRelay {
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (relay, stop) = (relay.clone(), stop.clone());
            async move { relay.run(stop).await }
        });
        RunningRelay {
            relay: relay.clone(),
            stop,
            task: Some(task),
        }
    }
}

/// A relay running in a task of the test's runtime. [`RunningRelay::stop`]
/// stops it and checks how `run` ended; dropped, it is asked to stop (a
/// panicking test's included) and nobody waits.
///
/// Derefs to the [`Relay`] (its health, counters, `wake`).
#[derive(Debug)]
pub struct RunningRelay {
    relay: Relay,
    stop: CancellationToken,
    task: Option<JoinHandle<outbox_relay::Result<()>>>,
}

impl RunningRelay {
    /// The relay that runs.
    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    /// Whether `run` has returned (or panicked).
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Asks the relay to stop, without waiting.
    pub fn cancel(&self) {
        self.stop.cancel();
    }

    /// Stops the relay (cancel, then wait up to two minutes) and panics
    /// unless `run` returned `Ok`.
    pub async fn stop(self) {
        self.cancel();
        self.join(STOP_DEADLINE)
            .await
            .expect("the relay stopped within two minutes of its cancel")
            .expect("the relay's run ended without an error");
    }

    /// What `run` returned, if it returns within `within` (a `None` leaves
    /// it running until the handle is dropped); panics if it panicked. Not
    /// a stop: see [`RunningRelay::cancel`].
    pub async fn join(mut self, within: Duration) -> Option<outbox_relay::Result<()>> {
        let task = self.task.as_mut().expect("the relay's task");
        let ended = tokio::time::timeout(within, task).await.ok()?;
        self.task = None;
        Some(ended.expect("the relay's run panicked"))
    }

    /// An abrupt end: the run is dropped where it stands (no drain, leases
    /// and slots left as they are), as if the process died.
    pub async fn abort(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Deref for RunningRelay {
    type Target = Relay;

    fn deref(&self) -> &Relay {
        &self.relay
    }
}

impl Drop for RunningRelay {
    fn drop(&mut self) {
        // A test that ends without `stop` (a panic, an early return): the
        // relay stops with the runtime's next turn, not at the end of the
        // test binary.
        self.stop.cancel();
    }
}
