//! Broker calls bounded by a timeout, the one rule for which broker errors
//! no retry can fix, connecting to the first of several nodes that
//! answers, and [`Nodes`]: the broker seam of the relay, its WAL reader
//! and the consumer (which node to try first, which one is in use).

mod flow;
mod link;
mod message;
mod nodes;

pub use flow::{BlockWatch, Flow, bounded_unblocked, is_blocked, while_blocked};
pub use link::{KEEPALIVE_BOUND, Link};
pub use message::{Envelope, event_properties, json_header_value};
pub use nodes::Nodes;

use std::future::Future;
use std::time::Duration;

use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::{Connection, ConnectionProperties};

use crate::urls::host_port;

/// What went wrong with the broker: the one broker error of the relay and
/// the consumer (their `Error::Broker`). Broker outcomes of single events
/// (nacked, returned) are not among them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker (or the connection to it) failed the operation.
    #[error("broker error during {what}: {source}")]
    Failed {
        /// The AMQP operation (`"connect"`, `"queue declare"`, ...).
        what: &'static str,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// Connecting to a node failed.
    #[error("cannot connect to the broker at {node}")]
    Connect {
        /// `host:port` of the node (never its password).
        node: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// [`connect_any`] was given no URL.
    #[error("no AMQP URL configured")]
    NoUrl,
    /// The operation did not finish within its bound.
    #[error("broker did not answer {what} within {timeout:?}")]
    TimedOut {
        /// The AMQP operation.
        what: &'static str,
        /// The bound that was exceeded.
        timeout: Duration,
    },
    /// The broker blocks this connection's publishing (a memory or disk
    /// alarm) and the operation could not finish: the relay rolls its
    /// batch back without counting an attempt and waits for the block to
    /// lift.
    #[error("the broker blocks publishing (resource alarm) during {what}")]
    Blocked {
        /// The operation that could not finish.
        what: &'static str,
    },
    /// The broker closed a channel (the relay settles the batch on it and
    /// replaces the channel).
    #[error("broker closed the channel: {0}")]
    ChannelClosed(String),
}

impl BrokerError {
    /// True when no retry can fix it ([`is_refusal`]).
    pub fn is_refusal(&self) -> bool {
        match self {
            BrokerError::Failed { what, source } => is_refusal(what, source),
            BrokerError::Connect { source, .. } => is_refusal("connect", source),
            BrokerError::NoUrl => true,
            BrokerError::TimedOut { .. }
            | BrokerError::Blocked { .. }
            | BrokerError::ChannelClosed(_) => false,
        }
    }

    /// True when a later retry may succeed: every broker error that is not
    /// a refusal.
    pub fn is_transient(&self) -> bool {
        !self.is_refusal()
    }

    /// lapin's error, where the broker (or the link) gave one.
    pub fn lapin(&self) -> Option<&lapin::Error> {
        match self {
            BrokerError::Failed { source, .. } | BrokerError::Connect { source, .. } => {
                Some(source)
            }
            _ => None,
        }
    }
}

/// Awaits a broker operation named `what`, bounded by `timeout`.
pub async fn bounded<T>(
    what: &'static str,
    timeout: Duration,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(BrokerError::Failed { what, source }),
        Err(_) => Err(BrokerError::TimedOut { what, timeout }),
    }
}

/// The broker refused `what` in a way no retry can fix: a login or
/// permission refused (403 `ACCESS_REFUSED`), a missing virtual host (530
/// `NOT_ALLOWED`), a declaration at odds with what exists (406
/// `PRECONDITION_FAILED` on a declare: another exchange or queue type,
/// other arguments). A 406 elsewhere is routine and retried (RabbitMQ's
/// `consumer_timeout` on a delivery held through a long database outage,
/// an unknown delivery tag); a missing queue (404) may be declared later.
pub fn is_refusal(what: &str, e: &lapin::Error) -> bool {
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return false;
    };
    match amqp.kind() {
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
        | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => true,
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => what.contains("declare"),
        _ => false,
    }
}

/// Connects to the first of `urls` that answers, trying them in turn from
/// index `start` (the one after the node used last, so a client moves on
/// from a node that failed), each bounded by `timeout`; returns the
/// connection, the [`Link`] that can cut it, and the index of its URL.
/// Every connection's socket carries TCP keepalive and a user timeout
/// ([`KEEPALIVE_BOUND`]).
///
/// Once every URL failed: a refusal when every node refused (a wrong
/// password, a missing virtual host), else the last failure (worth
/// retrying). One node's refusal alone is not the cluster's answer: a
/// restarting node says its virtual host is down (530 `NOT_ALLOWED`) for a
/// moment. lapin's own recovery is not used: callers supervise and
/// reconnect.
pub async fn connect_any<S: AsRef<str>>(
    urls: &[S],
    start: usize,
    timeout: Duration,
    props: ConnectionProperties,
) -> Result<(Connection, Link, usize), BrokerError> {
    let (mut refusal, mut last) = (None, None);
    for k in 0..urls.len() {
        let i = (start + k) % urls.len();
        let url = urls[i].as_ref();
        let node = host_port(url);
        let connected = match tokio::time::timeout(timeout, link::open(url, props.clone())).await {
            Ok(Ok((conn, link))) => return Ok((conn, link, i)),
            Ok(Err(source)) => BrokerError::Connect {
                node: node.clone(),
                source,
            },
            Err(_) => BrokerError::TimedOut {
                what: "connect",
                timeout,
            },
        };
        // The caller logs the outage once; each node's answer is detail.
        tracing::debug!(broker = %node, error = %connected, "broker node did not answer");
        if connected.is_refusal() {
            refusal = Some(connected);
        } else {
            last = Some(connected);
        }
    }
    Err(last.or(refusal).unwrap_or(BrokerError::NoUrl))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn no_url_is_a_refusal_not_a_timeout() {
        let urls: [&str; 0] = [];
        let err = connect_any(
            &urls,
            0,
            Duration::from_secs(1),
            ConnectionProperties::default(),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, BrokerError::NoUrl), "{err:?}");
        assert!(err.is_refusal(), "retrying cannot conjure a URL");
    }

    #[tokio::test]
    async fn an_unanswering_node_is_worth_retrying() {
        // A port nothing listens on: the connection is refused at once.
        let err = connect_any(
            &["amqp://guest:guest@127.0.0.1:1/%2f"],
            0,
            Duration::from_secs(5),
            ConnectionProperties::default(),
        )
        .await
        .unwrap_err();
        assert!(!err.is_refusal(), "{err:?}");
        assert!(!err.to_string().contains("guest:guest"), "{err}");
    }
}
