//! Buffering a request or response body, bounded.

use std::pin::Pin;

use axum::body::{Body, Bytes, HttpBody};

pub(super) enum ReadError {
    TooLarge(usize),
    Body(axum::Error),
}

/// Buffers a body, refusing more than `limit` bytes.
pub(super) async fn read_limited(mut body: Body, limit: usize) -> Result<Bytes, ReadError> {
    let lower = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX);
    if lower > limit {
        return Err(ReadError::TooLarge(lower));
    }
    let mut buf = Vec::with_capacity(lower);
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame.map_err(ReadError::Body)?.into_data() {
            if buf.len() + data.len() > limit {
                return Err(ReadError::TooLarge(buf.len() + data.len()));
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.into())
}
