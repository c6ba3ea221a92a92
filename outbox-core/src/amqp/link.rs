//! The TCP link under a broker connection: opened by us rather than by
//! lapin, so that it carries TCP keepalive and a user timeout, and so that
//! a connection whose polite close cannot go out can be cut.
//!
//! Why both: a link that goes silent (a dead NAT entry, a failed-over load
//! balancer: no RST ever arrives) leaves a socket that the kernel retries
//! for about fifteen minutes; keepalive probes and `TCP_USER_TIMEOUT` make
//! the kernel give up within [`KEEPALIVE_BOUND`]. And a connection that
//! RabbitMQ blocks (a resource alarm) writes nothing at all in lapin, not
//! even its `connection.close`: without a way to cut the socket, every
//! replaced connection stayed open on the broker, with its buffered
//! publishes, until the alarm cleared.

use std::net::Shutdown;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_compat::CompatExt;
use lapin::tcp::{AsyncTcpStream, TLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use socket2::{SockRef, Socket, TcpKeepalive};

/// Idle time before the first keepalive probe.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Probes unanswered before the kernel drops the connection.
const KEEPALIVE_PROBES: u32 = 3;
/// The longest the kernel keeps a silent link: idle, then the probes; and
/// (`TCP_USER_TIMEOUT`, Linux) the longest written data may stay
/// unacknowledged.
pub const KEEPALIVE_BOUND: Duration = Duration::from_secs(25);

/// A handle on the socket under one broker connection (a duplicate of its
/// descriptor), to cut it when a polite close cannot go out.
#[derive(Debug)]
pub struct Link {
    socket: Option<Socket>,
}

impl Link {
    /// Cuts the connection: the socket is shut down both ways and closed
    /// with an RST (`SO_LINGER` 0), so lapin's IO loop ends, its buffered
    /// frames are dropped, and the broker forgets the connection at its
    /// next write (a heartbeat at the latest), blocked or not.
    pub fn abort(&self) {
        if let Some(s) = &self.socket {
            let _ = s.set_linger(Some(Duration::ZERO));
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Closes `conn`: politely (`connection.close`, bounded by `timeout`)
    /// unless the broker blocks it, when nothing it writes goes out; cut
    /// ([`abort`](Self::abort)) when the polite close does not finish.
    /// Either way the connection is gone when this returns.
    pub async fn close(&self, conn: &Connection, timeout: Duration) {
        let polite = conn.status().connected()
            && !conn.status().blocked()
            && matches!(
                tokio::time::timeout(timeout, conn.close(200, "closed".into())).await,
                Ok(Ok(()))
            );
        if !polite {
            self.abort();
        }
    }
}

/// Opens a connection to `uri` on a socket of our own (keepalive, user
/// timeout, `TCP_NODELAY`; TLS for `amqps://`), returning it with the
/// [`Link`] that can cut it.
pub(crate) async fn open(
    uri: &str,
    props: ConnectionProperties,
) -> lapin::Result<(Connection, Link)> {
    let uri: AMQPUri = uri
        .parse()
        .map_err(|e: String| lapin::Error::from(std::io::Error::other(e)))?;
    let runtime = lapin::runtime::default_runtime()?;
    let socket: Arc<Mutex<Option<Socket>>> = Arc::default();
    let keep = socket.clone();
    let conn = Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, _| {
            let host = uri.authority.host.clone();
            let stream = tokio::net::TcpStream::connect((host.as_str(), uri.authority.port))
                .await
                .map_err(lapin::Error::from)?;
            let handle = configure(&stream).map_err(lapin::Error::from)?;
            *keep.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
            let stream = AsyncTcpStream::Plain(stream.compat());
            match uri.scheme {
                AMQPScheme::AMQP => Ok(stream),
                AMQPScheme::AMQPS => stream
                    .into_tls(&host, TLSConfig::default())
                    .await
                    .map_err(lapin::Error::from),
            }
        },
        props,
    )
    .await;
    let socket = socket.lock().unwrap_or_else(|p| p.into_inner()).take();
    let link = Link { socket };
    match conn {
        Ok(conn) => Ok((conn, link)),
        Err(e) => {
            // A handshake that failed or stalled leaves nothing behind.
            link.abort();
            Err(e)
        }
    }
}

/// Keepalive, user timeout and no-delay on `stream`; returns a duplicate of
/// its descriptor for [`Link::abort`].
fn configure(stream: &tokio::net::TcpStream) -> std::io::Result<Socket> {
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    sock.set_tcp_keepalive(&keepalive)?;
    #[cfg(target_os = "linux")]
    sock.set_tcp_user_timeout(Some(KEEPALIVE_BOUND))?;
    sock.try_clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_covers_idle_and_probes() {
        assert_eq!(
            KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_PROBES,
            KEEPALIVE_BOUND
        );
    }

    #[tokio::test]
    async fn a_socket_of_ours_has_keepalive_and_a_user_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let dup = configure(&stream).unwrap();
        assert!(dup.keepalive().unwrap());
        assert_eq!(dup.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        #[cfg(target_os = "linux")]
        assert_eq!(dup.tcp_user_timeout().unwrap(), Some(KEEPALIVE_BOUND));
        assert!(stream.nodelay().unwrap());
    }

    #[tokio::test]
    async fn abort_cuts_the_connection_under_the_other_handle() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut stream = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        let link = Link {
            socket: Some(configure(&stream).unwrap()),
        };
        link.abort();
        // Our side reads end-of-stream (lapin's IO loop ends) ...
        let mut buf = [0u8; 8];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 0);
        drop(stream);
        drop(link);
        // ... and the peer sees the connection end.
        let r = tokio::time::timeout(Duration::from_secs(5), peer.read(&mut buf))
            .await
            .unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
}
