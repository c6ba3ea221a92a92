//! Secure by default. The console listens on loopback unless told
//! otherwise, and refuses any other address (or a reverse proxy's path
//! prefix) without credentials (`OUTBOX_CONSOLE_PASSWORD` for HTTP basic
//! auth, `OUTBOX_CONSOLE_TOKEN` for a bearer token; from the environment
//! only, never a flag, so they stay out of `ps` and shell history). With
//! credentials set, every request needs them, loopback too. Without them,
//! a request must name a loopback host and carry no proxy headers (so a
//! web page whose DNS name points at 127.0.0.1, or a proxy on this host,
//! cannot reach it). Actions are POSTs from the console's own origin
//! carrying a CSRF token equal to the browser's `SameSite=Strict` cookie,
//! which the console signs (a cookie planted by another local site does not
//! pass). Credentials are compared in constant time and never printed.

use std::net::SocketAddr;

use anyhow::{Result, bail};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

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

/// Refuses a non-loopback address, or a path prefix for a reverse proxy,
/// without credentials.
pub(crate) fn check_bind(options: &Options) -> Result<()> {
    if options.credentials.is_none() && !options.base_path.is_empty() {
        bail!(
            "refusing to serve the console under --base-path without credentials: behind a reverse proxy every visitor would arrive from loopback; set OUTBOX_CONSOLE_PASSWORD (basic auth) or OUTBOX_CONSOLE_TOKEN (bearer token)"
        );
    }
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
pub(crate) struct Principal {
    /// The basic-auth user, `token`, or `anonymous (loopback)`.
    pub(crate) who: String,
    /// The peer's address (a reverse proxy's, behind one).
    pub(crate) peer: String,
}

fn peer_of(req: &Request) -> String {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or("unknown".to_owned(), |c| c.0.to_string())
}

/// Headers a reverse proxy adds: without credentials, a proxied request is
/// refused (every visitor of the proxy would be "loopback").
const PROXY_HEADERS: [&str; 4] = [
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-real-ip",
];

/// Without credentials: the request names a loopback host (`localhost`,
/// `127.0.0.1`, `[::1]`, any port) and no proxy forwarded it.
fn loopback_request(headers: &HeaderMap) -> bool {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    let loopback = name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    loopback && !PROXY_HEADERS.iter().any(|h| headers.contains_key(*h))
}

/// Every request needs the credentials when some are configured; without
/// them, it must be a loopback request.
pub(crate) async fn authenticate(
    State(console): State<Shared>,
    mut req: Request,
    next: Next,
) -> Response {
    let peer = peer_of(&req);
    let who = match &console.options.credentials {
        None if !loopback_request(req.headers()) => {
            tracing::warn!(%peer, path = %req.uri().path(), "console: refused a request for a non-loopback host or through a proxy (no credentials are configured)");
            return layout::error_page(
                StatusCode::FORBIDDEN,
                "Loopback only",
                "Without credentials this console answers only requests for localhost or a loopback address, made directly. Set OUTBOX_CONSOLE_PASSWORD or OUTBOX_CONSOLE_TOKEN to serve it otherwise.",
            );
        }
        None => Some("anonymous (loopback)".to_owned()),
        Some(c) => c.check(req.headers().get(header::AUTHORIZATION)),
    };
    let Some(who) = who else {
        if req.headers().contains_key(header::AUTHORIZATION) {
            tracing::warn!(%peer, path = %req.uri().path(), "console: wrong credentials");
        }
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
    req.extensions_mut().insert(Principal { who, peer });
    next.run(req).await
}

/// This browser's CSRF token: the cookie's value, or a new one (set on the
/// response).
#[derive(Debug, Clone)]
pub(crate) struct CsrfToken(pub(crate) String);

/// The key that signs CSRF tokens: random per process (a restart makes
/// browsers take a new token at their next page).
pub(crate) struct CsrfKey([u8; 32]);

impl CsrfKey {
    pub(crate) fn random() -> CsrfKey {
        let mut key = [0u8; 32];
        key[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        key[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        CsrfKey(key)
    }

    fn signature(&self, nonce: &str) -> String {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("any key length");
        mac.update(nonce.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A new token: `<nonce>.<HMAC-SHA256 of the nonce>`.
    fn issue(&self) -> String {
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let signature = self.signature(&nonce);
        format!("{nonce}.{signature}")
    }

    /// Whether `token` is one this process issued.
    fn verify(&self, token: &str) -> bool {
        token.split_once('.').is_some_and(|(nonce, signature)| {
            nonce.len() == 32
                && constant_time_eq(self.signature(nonce).as_bytes(), signature.as_bytes())
        })
    }
}

/// Every valid (signed) CSRF cookie the request carries: a browser may
/// hold one per path.
fn csrf_cookies(req: &Request, key: &CsrfKey) -> Option<String> {
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .filter(|(k, _)| *k == CSRF_COOKIE)
        .map(|(_, v)| v.to_owned())
        .find(|v| key.verify(v))
}

/// Gives every browser a signed CSRF cookie.
pub(crate) async fn csrf_cookie(
    State(console): State<Shared>,
    mut req: Request,
    next: Next,
) -> Response {
    let existing = csrf_cookies(&req, &console.csrf_key);
    let token = existing.clone().unwrap_or_else(|| console.csrf_key.issue());
    // Behind a TLS-terminating proxy (which needs credentials, so the
    // header comes from a proxy the operator set up), the cookie is
    // `Secure`: never sent over plain HTTP.
    let secure = console.options.credentials.is_some()
        && req
            .headers()
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    req.extensions_mut().insert(CsrfToken(token.clone()));
    let mut res = next.run(req).await;
    if existing.is_none() {
        let path = if console.options.base_path.is_empty() {
            "/".to_owned()
        } else {
            console.options.base_path.clone()
        };
        let secure = if secure { "; Secure" } else { "" };
        let cookie =
            format!("{CSRF_COOKIE}={token}; Path={path}; HttpOnly; SameSite=Strict{secure}");
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            res.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    res
}

/// A POST from another origin: its `Origin` names another host, or (no
/// `Origin`) its `Sec-Fetch-Site` says cross-site. A client that sends
/// neither (a script) still needs the CSRF cookie and token.
fn cross_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        return authority.is_none() || authority != host;
    }
    headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|site| !matches!(site, "same-origin" | "none"))
}

/// Refuses an action: read-only mode, a POST from another origin, or a
/// form whose CSRF token is not this browser's signed cookie. `None` when
/// the action may go ahead.
pub(crate) fn refuse_action(
    console: &Shared,
    headers: &HeaderMap,
    csrf: &CsrfToken,
    who: &Principal,
    form_token: Option<&str>,
) -> Option<Response> {
    if console.options.read_only {
        tracing::warn!(who = %who.who, peer = %who.peer, "console: refused an action: read-only");
        return Some(layout::error_page(
            StatusCode::FORBIDDEN,
            "Read-only console",
            "This console was started with --read-only: it shows the outbox but changes nothing.",
        ));
    }
    let ok = !cross_origin(headers)
        && form_token.is_some_and(|t| constant_time_eq(t.as_bytes(), csrf.0.as_bytes()));
    if !ok {
        tracing::warn!(who = %who.who, peer = %who.peer, "console: refused a POST from another origin or without this browser's CSRF token");
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

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn without_credentials_only_direct_loopback_requests_pass() {
        for host in [
            "127.0.0.1:9180",
            "localhost:9180",
            "LOCALHOST",
            "[::1]:9180",
            "127.0.0.2",
        ] {
            assert!(loopback_request(&headers(&[("host", host)])), "{host}");
        }
        for host in [
            "evil.example:9180",
            "10.0.0.5:9180",
            "127.0.0.1.evil.example",
            "",
            "[::2]:1",
        ] {
            assert!(!loopback_request(&headers(&[("host", host)])), "{host}");
        }
        assert!(!loopback_request(&HeaderMap::new()));
        for proxy in PROXY_HEADERS {
            assert!(
                !loopback_request(&headers(&[
                    ("host", "127.0.0.1:9180"),
                    (proxy, "203.0.113.9")
                ])),
                "{proxy}"
            );
        }
    }

    #[test]
    fn a_post_from_another_origin_is_cross_origin() {
        let h = |origin: Option<&str>, site: Option<&str>| {
            let mut pairs = vec![("host", "127.0.0.1:9180")];
            if let Some(o) = origin {
                pairs.push(("origin", o));
            }
            if let Some(s) = site {
                pairs.push(("sec-fetch-site", s));
            }
            cross_origin(&headers(&pairs))
        };
        assert!(!h(Some("http://127.0.0.1:9180"), Some("same-origin")));
        assert!(!h(Some("https://127.0.0.1:9180"), None));
        assert!(
            h(Some("http://127.0.0.1:8000"), None),
            "another port is another origin"
        );
        assert!(h(Some("http://evil.example"), None));
        assert!(h(Some("null"), None));
        assert!(!h(None, Some("same-origin")));
        assert!(h(None, Some("cross-site")));
        assert!(h(None, Some("same-site")));
        assert!(!h(None, None), "a script: the token decides");
    }

    #[test]
    fn csrf_tokens_are_signed_by_this_process() {
        let key = CsrfKey::random();
        let token = key.issue();
        assert!(key.verify(&token));
        let (nonce, _) = token.split_once('.').unwrap();
        assert!(
            !key.verify(&format!("{nonce}.{}", "0".repeat(64))),
            "a planted cookie"
        );
        assert!(!key.verify(nonce));
        assert!(!CsrfKey::random().verify(&token), "another process's key");
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
