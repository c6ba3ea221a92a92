//! A small HTTP/1.1 client over one keep-alive TCP connection: enough to
//! POST JSON with an `Idempotency-Key` and read a `Content-Length` answer.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Bound on one request/response exchange. Longer than the server's wait
/// on a concurrent request holding the same key (10 s).
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// An HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    /// The server answered with a recorded response (`Idempotent-Replayed`).
    pub(crate) replayed: bool,
    pub(crate) body: Vec<u8>,
}

/// One client connection, reopened when the server closes it.
#[derive(Debug)]
pub(crate) struct HttpClient {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

impl HttpClient {
    pub(crate) fn new(addr: SocketAddr) -> Self {
        Self { addr, conn: None }
    }

    /// POSTs `body` as JSON. A failure on a reused keep-alive connection is
    /// retried once on a fresh one: safe, since the key makes it idempotent.
    pub(crate) async fn post_json(
        &mut self,
        path: &str,
        key: &str,
        body: &[u8],
    ) -> io::Result<Reply> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             idempotency-key: {key}\r\ncontent-length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        let mut request = head.into_bytes();
        request.extend_from_slice(body);
        let reused = self.conn.is_some();
        match self.exchange(&request).await {
            Err(_) if reused => self.exchange(&request).await,
            other => other,
        }
    }

    async fn exchange(&mut self, request: &[u8]) -> io::Result<Reply> {
        let conn = match self.conn.take() {
            Some(conn) => conn,
            None => BufReader::new(TcpStream::connect(self.addr).await?),
        };
        let (conn, reply, keep) = tokio::time::timeout(EXCHANGE_TIMEOUT, round_trip(conn, request))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no HTTP answer in time"))??;
        if keep {
            self.conn = Some(conn);
        }
        Ok(reply)
    }
}

async fn round_trip(
    mut conn: BufReader<TcpStream>,
    request: &[u8],
) -> io::Result<(BufReader<TcpStream>, Reply, bool)> {
    conn.get_mut().write_all(request).await?;
    let mut line = String::new();
    if conn.read_line(&mut line).await? == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad status line"))?;
    let (mut length, mut replayed, mut keep) = (0usize, false, true);
    loop {
        line.clear();
        conn.read_line(&mut line).await?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.to_ascii_lowercase().as_str() {
            "content-length" => {
                length = value.parse().map_err(|_| {
                    io::Error::new(io::ErrorKind::InvalidData, "bad content-length")
                })?;
            }
            "idempotent-replayed" => replayed = value.eq_ignore_ascii_case("true"),
            "connection" => keep = !value.eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let mut body = vec![0; length];
    conn.read_exact(&mut body).await?;
    Ok((
        conn,
        Reply {
            status,
            replayed,
            body,
        },
        keep,
    ))
}
