//! RFC 9457 problem documents, and the HTTP answer to each error.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::error::Error;

/// How problem documents name their `type` (RFC 9457).
#[derive(Debug, Clone, Default)]
pub(super) struct ProblemTypes {
    /// `None`: `about:blank` (with a precise `title` and a `code`).
    pub(super) base: Option<Arc<str>>,
}

impl ProblemTypes {
    fn uri(&self, code: &str) -> String {
        match &self.base {
            Some(base) => format!("{base}{code}"),
            None => "about:blank".to_owned(),
        }
    }
}

/// The HTTP answer to an error of this crate.
pub(super) fn error_response(problems: &ProblemTypes, e: &Error) -> Response {
    match e {
        Error::InvalidIdempotencyKey { .. } => problem(
            problems,
            StatusCode::BAD_REQUEST,
            "key-invalid",
            "Invalid idempotency key",
            &format!("{e}; use 1 to 255 visible ASCII characters"),
        ),
        Error::IdempotencyKeyMismatch => problem(
            problems,
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused",
            "Idempotency key reused",
            "this key was already used with a different request; use a new key for a new request",
        ),
        Error::IdempotencyKeyInUse { retry_after } => with_retry_after(
            problem(
                problems,
                StatusCode::CONFLICT,
                "key-in-use",
                "Request in progress",
                "a request with this idempotency key is still being processed; retry later",
            ),
            *retry_after,
        ),
        Error::ResponseTooLarge { .. } => problem(
            problems,
            StatusCode::INTERNAL_SERVER_ERROR,
            "response-too-large",
            "Response too large to record",
            &format!("{e}; nothing was committed"),
        ),
        e if e.is_transient() => with_retry_after(
            problem(
                problems,
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "Service unavailable",
                "the database is unavailable; nothing was committed, retry later",
            ),
            Duration::from_secs(1),
        ),
        e => {
            tracing::error!(error = %e, "idempotent request failed");
            internal_error(problems)
        }
    }
}

fn with_retry_after(mut response: Response, after: Duration) -> Response {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    response
}

/// An RFC 9457 problem document.
pub(super) fn problem(
    problems: &ProblemTypes,
    status: StatusCode,
    code: &str,
    title: &str,
    detail: &str,
) -> Response {
    let body = serde_json::json!({
        "type": problems.uri(code),
        "code": code,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// 500 for a failure of our own: nothing was committed.
pub(super) fn internal_error(problems: &ProblemTypes) -> Response {
    problem(
        problems,
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "Internal error",
        "nothing was committed; retry with the same key",
    )
}
