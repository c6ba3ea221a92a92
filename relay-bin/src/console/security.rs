//! Secure by default. The console listens on loopback unless told
//! otherwise, and refuses any other address without credentials
//! (`OUTBOX_CONSOLE_PASSWORD` for HTTP basic auth, `OUTBOX_CONSOLE_TOKEN`
//! for a bearer token; from the environment only, never a flag, so they
//! stay out of `ps` and shell history). With credentials set, every
//! request needs them, loopback too. Actions are POSTs carrying a CSRF
//! token that must equal the browser's own `SameSite=Strict` cookie (a
//! page of another site can neither read nor send it). Credentials are
//! compared in constant time and never printed.

use anyhow::{Result, bail};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use base64::Engine;

use super::{Options, Shared, layout};

/// The name of the CSRF cookie and of the form field that must match it.
pub(crate) const CSRF_COOKIE: &str = "outbox_console_csrf";
pub(crate) const CSRF_FIELD: &str = "csrf";

/// Who may use the console.
#[derive(Clone)]
pub(crate) struct Credentials {
    /// Basic auth: user name and password.
    basic: Option<(String, String)>,
    /// A bearer token.
    token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())
    }
}

impl Credentials {
    /// From `OUTBOX_CONSOLE_PASSWORD` (with `user`) and
    /// `OUTBOX_CONSOLE_TOKEN`; `None` when neither is set (or both empty).
    pub(crate) fn from_env(user: &str) -> Option<Credentials> {
        let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        let basic = var("OUTBOX_CONSOLE_PASSWORD").map(|p| (user.to_owned(), p));
        let token = var("OUTBOX_CONSOLE_TOKEN");
        (basic.is_some() || token.is_some()).then_some(Credentials { basic, token })
    }

    /// What kind of credentials, for logs (never their value).
    pub(crate) fn kind(&self) -> &'static str {
        match (&self.basic, &self.token) {
            (Some(_), Some(_)) => "basic auth or bearer token",
            (Some(_), None) => "basic auth",
            _ => "bearer token",
        }
    }

    /// The principal an `Authorization` header proves, if it does.
    fn check(&self, authorization: Option<&HeaderValue>) -> Option<String> {
        let value = authorization?.to_str().ok()?;
        let (scheme, rest) = value.split_once(' ')?;
        if scheme.eq_ignore_ascii_case("bearer") {
            let token = self.token.as_deref()?;
            return constant_time_eq(rest.trim().as_bytes(), token.as_bytes())
                .then(|| "token".to_owned());
        }
        if scheme.eq_ignore_ascii_case("basic") {
            let (user, password) = self.basic.as_ref()?;
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(rest.trim())
                .ok()?;
            let decoded = String::from_utf8(decoded).ok()?;
            let (u, p) = decoded.split_once(':')?;
            // Both compared, whatever the first says.
            let ok = constant_time_eq(u.as_bytes(), user.as_bytes())
                & constant_time_eq(p.as_bytes(), password.as_bytes());
            return ok.then(|| user.clone());
        }
        None
    }
}

/// Equal bytes, in a time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for (x, y) in a.iter().zip(b.iter().cycle()) {
        diff |= x ^ y;
    }
    diff == 0
}

/// Refuses a non-loopback address without credentials.
pub(crate) fn check_bind(options: &Options) -> Result<()> {
    if options.listen.ip().is_loopback() {
        return Ok(());
    }
    if options.credentials.is_none() {
        bail!(
            "refusing to serve the console on {} without credentials: set OUTBOX_CONSOLE_PASSWORD (basic auth) or OUTBOX_CONSOLE_TOKEN (bearer token), or listen on loopback (the default)",
            options.listen
        );
    }
    tracing::warn!(
        addr = %options.listen,
        "console listening beyond loopback: serve it behind a reverse proxy with TLS, or credentials cross the network in clear"
    );
    Ok(())
}

/// Who made a request, for the audit log.
#[derive(Debug, Clone)]
pub(crate) struct Principal(pub(crate) String);

/// Every request needs the credentials when some are configured.
pub(crate) async fn authenticate(
    State(console): State<Shared>,
    mut req: Request,
    next: Next,
) -> Response {
    let who = match &console.options.credentials {
        None => Some("anonymous (loopback)".to_owned()),
        Some(c) => c.check(req.headers().get(header::AUTHORIZATION)),
    };
    let Some(who) = who else {
        let mut res = layout::error_page(
            StatusCode::UNAUTHORIZED,
            "Sign-in required",
            "This console needs credentials.",
        );
        let challenge = match &console.options.credentials {
            Some(Credentials { basic: Some(_), .. }) => {
                "Basic realm=\"outbox console\", charset=\"UTF-8\""
            }
            _ => "Bearer realm=\"outbox console\"",
        };
        res.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(challenge),
        );
        return res;
    };
    req.extensions_mut().insert(Principal(who));
    next.run(req).await
}

/// This browser's CSRF token: the cookie's value, or a new one (set on the
/// response).
#[derive(Debug, Clone)]
pub(crate) struct CsrfToken(pub(crate) String);

fn cookie_value(req: &Request, name: &str) -> Option<String> {
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Gives every browser a CSRF cookie: 256 random bits.
pub(crate) async fn csrf_cookie(
    State(console): State<Shared>,
    mut req: Request,
    next: Next,
) -> Response {
    let existing = cookie_value(&req, CSRF_COOKIE);
    let token = existing.clone().unwrap_or_else(|| {
        format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        )
    });
    req.extensions_mut().insert(CsrfToken(token.clone()));
    let mut res = next.run(req).await;
    if existing.is_none() {
        let path = if console.options.base_path.is_empty() {
            "/".to_owned()
        } else {
            console.options.base_path.clone()
        };
        let cookie = format!("{CSRF_COOKIE}={token}; Path={path}; HttpOnly; SameSite=Strict");
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            res.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    res
}

/// Refuses an action: read-only mode, or a form whose CSRF token is not
/// this browser's. `None` when the action may go ahead.
pub(crate) fn refuse_action(
    console: &Shared,
    csrf: &CsrfToken,
    form_token: Option<&str>,
) -> Option<Response> {
    if console.options.read_only {
        return Some(layout::error_page(
            StatusCode::FORBIDDEN,
            "Read-only console",
            "This console was started with --read-only: it shows the outbox but changes nothing.",
        ));
    }
    let ok = form_token.is_some_and(|t| constant_time_eq(t.as_bytes(), csrf.0.as_bytes()));
    if !ok {
        tracing::warn!("console: refused a POST without this browser's CSRF token");
        return Some(layout::error_page(
            StatusCode::FORBIDDEN,
            "Request refused",
            "The form's CSRF token is missing or wrong. Reload the page and try again.",
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(basic: Option<(&str, &str)>, token: Option<&str>) -> Credentials {
        Credentials {
            basic: basic.map(|(u, p)| (u.to_owned(), p.to_owned())),
            token: token.map(str::to_owned),
        }
    }

    fn header(v: &str) -> HeaderValue {
        HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn basic_auth_needs_the_user_and_the_password() {
        let c = creds(Some(("ops", "s3cret")), None);
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        assert_eq!(
            c.check(Some(&header(&format!("Basic {}", b64("ops:s3cret"))))),
            Some("ops".to_owned())
        );
        assert_eq!(
            c.check(Some(&header(&format!("Basic {}", b64("ops:s3creT"))))),
            None
        );
        assert_eq!(
            c.check(Some(&header(&format!("Basic {}", b64("root:s3cret"))))),
            None
        );
        assert_eq!(c.check(Some(&header("Bearer s3cret"))), None);
        assert_eq!(c.check(None), None);
    }

    #[test]
    fn a_bearer_token_is_compared_whole() {
        let c = creds(None, Some("tok-123"));
        assert_eq!(
            c.check(Some(&header("Bearer tok-123"))),
            Some("token".to_owned())
        );
        assert_eq!(
            c.check(Some(&header("bearer tok-123"))),
            Some("token".to_owned())
        );
        assert_eq!(c.check(Some(&header("Bearer tok-12"))), None);
        assert_eq!(c.check(Some(&header("Bearer tok-1234"))), None);
        assert_eq!(c.check(Some(&header("Basic dG9rLTEyMw=="))), None);
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(!constant_time_eq(b"a", b""));
    }

    #[test]
    fn credentials_never_print_their_values() {
        let c = creds(Some(("ops", "s3cret")), Some("tok-123"));
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("tok-123"),
            "{shown}"
        );
    }
}
