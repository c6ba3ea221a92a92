//! The broker's flow control: RabbitMQ blocks the connections that publish
//! while a resource alarm (memory, disk) lasts, and says so with
//! `connection.blocked` / `connection.unblocked`. lapin then writes nothing
//! on the connection, not a publish, an ack, a channel's open or the
//! connection's close, until the block lifts. A client that takes the
//! silence for a dead broker and reconnects gets a connection as blocked as
//! the last; so waits are stretched over a block instead
//! ([`bounded_unblocked`]), and a block is shown ([`BlockWatch`]).

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::Connection;

use super::BrokerError;

/// How often a wait for the lift looks again (lapin has no future for it).
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Whether the broker blocks `conn` now (a connection that is gone is not
/// blocked: it is gone).
pub fn is_blocked(conn: &Connection) -> bool {
    conn.status().connected() && conn.status().blocked()
}

/// Returns once the broker does not block `conn` (at once when it does
/// not), or once the connection is gone.
pub async fn while_blocked(conn: &Connection) {
    while is_blocked(conn) {
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

/// A broker call named `what`, bounded by `timeout` of time the broker does
/// not block `conn`: a wait that runs into a block waits for the lift, then
/// gets `timeout` again. A lasting alarm is waited out on the same
/// connection, nothing counted against the work; a connection that dies
/// meanwhile ends the wait.
pub async fn bounded_unblocked<T>(
    what: &'static str,
    timeout: Duration,
    conn: &Connection,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T, BrokerError> {
    let mut f = std::pin::pin!(f);
    loop {
        match tokio::time::timeout(timeout, f.as_mut()).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(source)) => return Err(BrokerError::Failed { what, source }),
            Err(_) if is_blocked(conn) => while_blocked(conn).await,
            Err(_) => return Err(BrokerError::TimedOut { what, timeout }),
        }
    }
}

/// A change of a connection's flow, as a [`BlockWatch`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flow {
    /// The broker blocks the connection; its reason (`"low on memory"`).
    Blocked(String),
    /// The broker lifted its block.
    Unblocked,
    /// The watch ended (its connection's session is over) while the
    /// connection was blocked.
    Gone,
}

type OnChange = std::sync::Arc<dyn Fn(Flow) + Send + Sync>;

/// Watches a connection's `connection.blocked` and `connection.unblocked`
/// while it lives, telling `on_change` of each change (and of its end, if
/// blocked then).
pub struct BlockWatch {
    task: tokio::task::JoinHandle<()>,
    blocked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    on_change: OnChange,
}

impl std::fmt::Debug for BlockWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockWatch").finish_non_exhaustive()
    }
}

impl BlockWatch {
    /// Starts watching `conn`.
    pub fn new(conn: &Connection, on_change: impl Fn(Flow) + Send + Sync + 'static) -> Self {
        use std::sync::atomic::Ordering;
        let on_change: OnChange = std::sync::Arc::new(on_change);
        let blocked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut events = Box::pin(conn.events_listener());
        // A block that came before the listener: lapin's status has it.
        if conn.status().blocked() {
            blocked.store(true, Ordering::Relaxed);
            on_change(Flow::Blocked("a resource alarm".to_owned()));
        }
        let task = tokio::spawn({
            let (blocked, on_change) = (blocked.clone(), on_change.clone());
            async move {
                while let Some(event) = events.next().await {
                    match event {
                        lapin::Event::ConnectionBlocked(reason)
                            if !blocked.swap(true, Ordering::Relaxed) =>
                        {
                            on_change(Flow::Blocked(reason));
                        }
                        lapin::Event::ConnectionUnblocked
                            if blocked.swap(false, Ordering::Relaxed) =>
                        {
                            on_change(Flow::Unblocked);
                        }
                        _ => {}
                    }
                }
            }
        });
        Self {
            task,
            blocked,
            on_change,
        }
    }
}

impl Drop for BlockWatch {
    fn drop(&mut self) {
        self.task.abort();
        if self
            .blocked
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            (self.on_change)(Flow::Gone);
        }
    }
}
