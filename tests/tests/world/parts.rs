//! The moving parts a world runs: relays and consumers, in-process or as
//! processes the tests can signal.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::{KillOnDrop, database_url, suffix};
use nix::sys::signal::Signal;
use outbox::Capture;
use outbox_consumer::{Consumer, ConsumerConfig};
use outbox_relay::{Relay, RelayConfig, WalCapture};
use tokio_util::sync::CancellationToken;

use super::World;

/// How long an in-process relay or consumer may take to stop.
const STOP_DEADLINE: Duration = Duration::from_secs(120);

/// A component running in-process until `stop`.
pub(crate) struct Running<E> {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), E>>,
}

impl<E: std::fmt::Debug> Running<E> {
    pub(crate) fn spawn(
        f: impl FnOnce(CancellationToken) -> tokio::task::JoinHandle<Result<(), E>>,
    ) -> Self {
        let stop = CancellationToken::new();
        let task = f(stop.clone());
        Self { stop, task }
    }

    /// Stops it and checks it ended cleanly, within [`STOP_DEADLINE`]: a
    /// shutdown that hangs fails here, with the logs, not at the test
    /// runner's timeout.
    pub(crate) async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(STOP_DEADLINE, self.task)
            .await
            .unwrap_or_else(|_| panic!("not stopped {STOP_DEADLINE:?} after its shutdown"))
            .unwrap()
            .unwrap();
    }
}

/// A consumer the oracle stops once its queues are empty: in-process, or
/// a `fault-consumer` process (stopped with SIGTERM).
pub(crate) enum AConsumer {
    Task(Running<outbox_consumer::Error>),
    Process(KillOnDrop),
}

impl AConsumer {
    /// Stops it and checks it ended cleanly.
    async fn stop(self, deadline: Duration, scenario: &str) {
        match self {
            AConsumer::Task(running) => running.stop().await,
            AConsumer::Process(mut child) => {
                let code = e2e::stop_child(&mut child, Signal::SIGTERM, deadline).await;
                assert_eq!(code, Some(0), "{scenario}: a consumer did not stop cleanly");
            }
        }
    }
}

/// The consumers a scenario hands the oracle.
pub(crate) struct Consumers(pub(crate) Vec<AConsumer>);

impl Consumers {
    pub(crate) async fn stop(self, deadline: Duration, scenario: &str) {
        for c in self.0 {
            c.stop(deadline, scenario).await;
        }
    }
}

impl From<Running<outbox_consumer::Error>> for Consumers {
    fn from(c: Running<outbox_consumer::Error>) -> Self {
        Self(vec![AConsumer::Task(c)])
    }
}

impl From<Vec<Running<outbox_consumer::Error>>> for Consumers {
    fn from(cs: Vec<Running<outbox_consumer::Error>>) -> Self {
        Self(cs.into_iter().map(AConsumer::Task).collect())
    }
}

impl From<Vec<KillOnDrop>> for Consumers {
    fn from(cs: Vec<KillOnDrop>) -> Self {
        Self(cs.into_iter().map(AConsumer::Process).collect())
    }
}

/// The counts consumer processes print (`processed=N duplicates=M`): the
/// last line of each process, summed.
#[derive(Clone, Default)]
pub(crate) struct Counts {
    last: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl Counts {
    fn follow(&self, out: std::process::ChildStdout) {
        let last = self.last.clone();
        let slot = {
            let mut l = last.lock().unwrap();
            l.push((0, 0));
            l.len() - 1
        };
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let mut n = line
                    .split(' ')
                    .filter_map(|kv| kv.split_once('=')?.1.parse::<u64>().ok());
                if let (Some(p), Some(d)) = (n.next(), n.next()) {
                    last.lock().unwrap()[slot] = (p, d);
                }
            }
        });
    }

    pub(crate) fn duplicates(&self) -> u64 {
        self.last.lock().unwrap().iter().map(|(_, d)| d).sum()
    }
}

impl World {
    pub(crate) fn relay_config(&self, amqp: String) -> RelayConfig {
        let mut c = RelayConfig::default();
        c.amqp_url = amqp.into();
        c.schema = self.db.schema.clone();
        c.default_exchange = self.broker.exchange.clone();
        c.declare_exchange = None;
        c.batch_size = 100;
        c.poll_interval = Duration::from_millis(200);
        c.confirm_timeout = self.relay_timeout;
        c.broker_timeout = self.relay_timeout;
        c.reconnect_min = Duration::from_millis(50);
        c.reconnect_max = Duration::from_millis(500);
        if self.is_wal() {
            let mut wal = WalCapture::new(database_url());
            wal.standby_poll = Duration::from_millis(200);
            wal.sender_timeout = Duration::from_secs(3);
            c.wal = Some(wal);
        }
        c
    }

    /// An in-process relay on `amqp` whose sessions are named `app`.
    pub(crate) async fn relay(&self, app: &str, amqp: String) -> Running<outbox_relay::Error> {
        self.relay_handle(app, amqp).await.1
    }

    /// The same, with the relay's handle (its health and counters).
    pub(crate) async fn relay_handle(
        &self,
        app: &str,
        amqp: String,
    ) -> (Relay, Running<outbox_relay::Error>) {
        let pool = e2e::pool(app, 4).await;
        let relay = Relay::new(pool, self.relay_config(amqp)).await.unwrap();
        let running = Running::spawn(|stop| {
            let relay = relay.clone();
            tokio::spawn(async move { relay.run(stop).await })
        });
        (relay, running)
    }

    /// An in-process consumer of the world's queue whose sessions are
    /// named `app` (the first partition's, in a partitioned world).
    pub(crate) async fn consumer(&self, app: &str) -> Running<outbox_consumer::Error> {
        self.consumer_of(&self.queues[0], app).await
    }

    /// One in-process consumer per queue of the world: what the oracle
    /// starts when a requeue left work behind (unless the world's
    /// consumers are processes).
    pub(crate) async fn consumers(&self) -> Consumers {
        if self.consumer_processes {
            return vec![self.consumer_process_on(0)].into();
        }
        let mut all = Vec::new();
        for q in &self.queues {
            all.push(self.consumer_of(q, &format!("c-{}", suffix())).await);
        }
        all.into()
    }

    async fn consumer_of(&self, queue: &str, app: &str) -> Running<outbox_consumer::Error> {
        let pool = e2e::pool(app, 4).await;
        self.consumer_on(queue, pool, |_| {})
    }

    /// An in-process consumer of the world's queue on the database at
    /// `url` (through a proxy, say), its configuration `adjust`ed.
    pub(crate) fn consumer_through(
        &self,
        url: &str,
        adjust: impl FnOnce(&mut ConsumerConfig),
    ) -> Running<outbox_consumer::Error> {
        let options: sqlx::postgres::PgConnectOptions = url.parse().expect("a database URL");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options);
        self.consumer_on(&self.queues[0], pool, adjust)
    }

    fn consumer_on(
        &self,
        queue: &str,
        pool: sqlx::PgPool,
        adjust: impl FnOnce(&mut ConsumerConfig),
    ) -> Running<outbox_consumer::Error> {
        let mut config = ConsumerConfig::new(self.nodes.urls(), queue, "faults");
        config.schema = self.consumer_schema.to_string();
        config.declare_retry_queues = false;
        config.max_reconnect_delay = Duration::from_millis(500);
        if self.ordered {
            // Deferred events wait in `<queue>.retry` (the judge waits for
            // it too).
            config.declare_retry_queues = true;
            config.sequencing = outbox_consumer::Sequencing::by_sequence();
            config.retry_delay = Duration::from_millis(100);
            config.max_retry_delay = Duration::from_millis(500);
            config.max_deferrals = 1_000;
        }
        adjust(&mut config);
        let effect = e2e::RecordEffect::new(&self.consumer_schema);
        let consumer = Consumer::new(config, pool, effect).unwrap();
        Running::spawn(|stop| tokio::spawn(async move { consumer.run(stop).await }))
    }

    /// A process of `bin` on the world's database, broker and schema; its
    /// stderr (logs at `info`) goes to the world's [`ProcessLogs`], shown
    /// if the scenario fails.
    fn process(&self, bin: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("DATABASE_URL", database_url())
            .env("AMQP_URL", self.nodes.urls())
            .env("SCHEMA", &self.db.schema)
            .env("EXCHANGE", &self.broker.exchange)
            .env("RUST_LOG", "info,lapin=warn,sqlx=warn")
            .stdout(Stdio::null());
        let what = std::path::Path::new(bin)
            .file_name()
            .map_or_else(|| "process".into(), |n| n.to_string_lossy());
        self.logs.attach(&mut c, &what);
        c
    }

    pub(crate) fn relay_process(&self) -> KillOnDrop {
        self.relay_process_with(&[])
    }

    /// A `fault-relay` process with `env` on top of the world's settings.
    pub(crate) fn relay_process_with(&self, env: &[(&str, &str)]) -> KillOnDrop {
        let mut c = self.process(env!("CARGO_BIN_EXE_fault-relay"));
        if self.is_wal() {
            c.env("CAPTURE", "wal");
        }
        for (k, v) in env {
            c.env(k, v);
        }
        KillOnDrop(c.spawn().unwrap())
    }

    /// `n` relay processes with `env`, each with a name of its own (its
    /// relay name and database application name).
    pub(crate) fn named_relays(&self, n: usize, env: &[(&str, &str)]) -> Vec<(String, KillOnDrop)> {
        (0..n).map(|_| self.named_relay(env)).collect()
    }

    /// A relay process with `env` and a fresh name.
    pub(crate) fn named_relay(&self, env: &[(&str, &str)]) -> (String, KillOnDrop) {
        let name = format!("r-{}", suffix());
        let mut all = env.to_vec();
        all.push(("NAME", &name));
        let child = self.relay_process_with(&all);
        (name, child)
    }

    /// A `fault-consumer` process of the world's queue on `amqp`, not yet
    /// started.
    pub(crate) fn consumer_command(&self, amqp: &str) -> Command {
        let mut c = self.process(env!("CARGO_BIN_EXE_fault-consumer"));
        c.env("SCHEMA", &self.consumer_schema)
            .env("QUEUE", &self.queues[0])
            .env("AMQP_URL", amqp);
        c
    }

    /// A consumer process on `amqp` whose counts land in `counts`.
    pub(crate) fn consumer_process(&self, amqp: &str, counts: &Counts) -> KillOnDrop {
        let mut c = self.consumer_command(amqp);
        c.stdout(Stdio::piped());
        let mut child = c.spawn().unwrap();
        counts.follow(child.stdout.take().unwrap());
        KillOnDrop(child)
    }

    /// A consumer process connected first to node `first`.
    pub(crate) fn consumer_process_on(&self, first: usize) -> KillOnDrop {
        KillOnDrop(
            self.consumer_command(&self.nodes.urls_from(first))
                .spawn()
                .unwrap(),
        )
    }

    pub(crate) fn is_wal(&self) -> bool {
        self.db.capture == Capture::Wal
    }
}
