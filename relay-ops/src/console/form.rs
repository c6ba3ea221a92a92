//! Form fields, and the extractor every action goes through: a POSTed
//! form that passed the read-only and CSRF checks.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::Shared;
use super::security::{CSRF_FIELD, CsrfToken, Principal, refuse_action};

/// Form or query fields: every value of a name, in order.
pub(crate) struct Fields(Vec<(String, String)>);

impl Fields {
    pub(crate) fn parse(body: &[u8]) -> Fields {
        Fields(url::form_urlencoded::parse(body).into_owned().collect())
    }

    pub(crate) fn from_query(q: HashMap<String, String>) -> Fields {
        Fields(q.into_iter().collect())
    }

    /// The first non-empty value of `name`, trimmed.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .find(|v| !v.is_empty())
    }

    /// The first value of `name` that is not blank, as sent: for exact
    /// matches on stored text, which may begin or end with a space (an
    /// error class cut at 200 characters).
    pub(crate) fn untrimmed(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, v)| k == name && !v.trim().is_empty())
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn all(&self, name: &str) -> impl Iterator<Item = &str> {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.trim())
    }
}

/// An action's form, accepted: the console is not read-only and the
/// form carries this browser's CSRF token. Anything else is answered with
/// the refusal page before the handler runs.
pub(crate) struct ActionForm {
    pub(crate) fields: Fields,
    /// Who asked, for the audit log.
    pub(crate) who: Principal,
}

impl FromRequest<Shared> for ActionForm {
    type Rejection = Response;

    async fn from_request(req: Request, console: &Shared) -> Result<Self, Response> {
        let csrf = req.extensions().get::<CsrfToken>().cloned();
        let who = req.extensions().get::<Principal>().cloned();
        let headers = req.headers().clone();
        let body = Bytes::from_request(req, console)
            .await
            .map_err(IntoResponse::into_response)?;
        let fields = Fields::parse(&body);
        let (Some(csrf), Some(who)) = (csrf, who) else {
            // Both are set by the console's own middleware on every request.
            return Err(super::layout::error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Something went wrong",
                "the request missed the console's own checks",
            ));
        };
        if let Some(refused) = refuse_action(console, &headers, &csrf, &who, fields.get(CSRF_FIELD))
        {
            return Err(refused);
        }
        Ok(ActionForm { fields, who })
    }
}

/// A time from a form: RFC 3339, or a browser's `datetime-local` value
/// (`2026-12-01T10:30`, read as UTC).
pub(crate) fn parse_time(field: &str, text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&chrono::Utc));
    }
    ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"]
        .iter()
        .find_map(|f| chrono::NaiveDateTime::parse_from_str(text, f).ok())
        .map(|t| t.and_utc())
        .ok_or_else(|| format!("{field}: not a time ({text:?}); use 2026-12-01T10:30 (UTC)"))
}

/// A request the page cannot act on: 400 with the reason.
pub(crate) fn bad_request(message: &str) -> super::PageResult {
    Ok(super::layout::error_page(
        axum::http::StatusCode::BAD_REQUEST,
        "Cannot do that",
        message,
    ))
}

/// The end of a confirmation form: the reason (required, for the audit
/// log), the button that confirms and the way back.
pub(crate) fn confirm_controls(button: &str, danger: bool, cancel: &str) -> maud::Markup {
    maud::html! {
        div.actions {
            input #reason type="text" name="reason" required size="48" maxlength="1000"
                placeholder="why (recorded in the audit log)";
            button type="submit" id="confirm" class=(if danger { "danger" } else { "primary" }) { (button) }
            a href=(cancel) { "Cancel" }
        }
    }
}
