//! A plain HTTP client for the examples' HTTP fronts and the relay's
//! health endpoints.

/// What [`post_json`] got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReply {
    /// The status code.
    pub status: u16,
    /// `Idempotent-Replayed: true` was set (a recorded response).
    pub replayed: bool,
    /// The body.
    pub body: String,
}

/// One `POST` of JSON `body` to `path` on `addr` under `Idempotency-Key:
/// key`, over a plain HTTP/1.1 connection, as any client would send it.
pub async fn post_json(addr: std::net::SocketAddr, path: &str, key: &str, body: &str) -> HttpReply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nIdempotency-Key: {key}\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.expect("receive");
    HttpReply {
        status: raw
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line"),
        replayed: raw
            .to_ascii_lowercase()
            .contains("\r\nidempotent-replayed: true\r\n"),
        body: raw.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned(),
    }
}

/// GETs `path` from `addr` with a bare HTTP/1.0 request: the status and
/// the body, or `None` when nothing answered.
pub async fn http_get(addr: impl tokio::net::ToSocketAddrs, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    Some((status, body))
}
