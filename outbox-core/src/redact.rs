//! Passwords in URLs never reach a log line, an error or `--help`
//! (reading and checking URLs is [`crate::urls`]).

use crate::urls::{misread, split_urls};

/// `url` with any password replaced by `***`. Input that does not parse
/// as `scheme://...`, or whose `@` the parser did not read as the end of
/// a user info, is not echoed at all: a malformed URL
/// (`amqp:guest:secret@host`, missing the `//`; a password with a raw `/`
/// or `?`) may hold a password where no parser looks for one.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) if misread(url, &u) => "<malformed URL, not shown>".to_owned(),
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            // libpq-style `?password=...` (and `sslpassword`) too.
            if u.query_pairs().any(|(k, _)| is_secret_param(&k)) {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if is_secret_param(&k) {
                            "***".to_owned()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        Err(_) => "<unparseable URL, not shown>".to_owned(),
    }
}

/// [`redact_url`] for each URL of a comma-separated `list` ([`split_urls`]), joined with
/// `", "`.
pub fn redact_urls(list: &str) -> String {
    split_urls(list)
        .into_iter()
        .map(redact_url)
        .collect::<Vec<_>>()
        .join(", ")
}

fn is_secret_param(name: &str) -> bool {
    name.to_ascii_lowercase().contains("password")
}

/// Replaces every occurrence of the passwords of `url` (user info and
/// `password` query parameters) in `text`: errors of underlying libraries
/// may quote the URL they were given. A URL that is malformed (no host) has
/// each occurrence of itself, and of whatever sits where a password would
/// (between the last `:` and the last `@`), replaced.
pub fn scrub(text: &str, url: &str) -> String {
    // The whole value first (a raw comma in one password), then each URL
    // of a comma-separated list.
    let pieces = split_urls(url);
    let whole = scrub_one(text, url);
    if pieces.len() > 1 {
        return pieces.into_iter().fold(whole, |t, u| scrub_one(&t, u));
    }
    whole
}

fn scrub_one(text: &str, url: &str) -> String {
    let mut secrets: Vec<String> = Vec::new();
    match url::Url::parse(url) {
        Ok(u) if !misread(url, &u) => {
            secrets.extend(u.password().map(str::to_owned));
            secrets.extend(
                u.query_pairs()
                    .filter(|(k, _)| is_secret_param(k))
                    .map(|(_, v)| v.into_owned()),
            );
        }
        _ => {
            secrets.push(url.to_owned());
            if let Some((before_at, _)) = url.rsplit_once('@')
                && let Some((_, password)) = before_at.rsplit_once(':')
            {
                secrets.push(password.trim_start_matches('/').to_owned());
            }
        }
    }
    let mut out = text.to_owned();
    for p in secrets.into_iter().filter(|p| !p.is_empty()) {
        let decoded = percent_decode(&p);
        out = out.replace(&p, "***").replace(&decoded, "***");
    }
    out
}

/// [`scrub`] for each of `urls`.
pub fn scrub_all(text: &str, urls: &[String]) -> String {
    urls.iter().fold(text.to_owned(), |t, u| scrub(&t, u))
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_else(|| s.to_owned())
}

/// A broker or database URL, or a comma-separated list of them, that may
/// hold passwords. `Debug` and `Display` show it redacted
/// ([`redact_urls`]), so a configuration holding one can derive `Debug`
/// and be logged whole; [`SecretUrl::expose`] gives the real text to the
/// code that connects.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL as given, password and all: only for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&redact_urls(&self.0), f)
    }
}

impl std::fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact_urls(&self.0))
    }
}

impl From<String> for SecretUrl {
    fn from(url: String) -> Self {
        Self(url)
    }
}

impl From<&str> for SecretUrl {
    fn from(url: &str) -> Self {
        Self(url.to_owned())
    }
}

impl From<&String> for SecretUrl {
    fn from(url: &String) -> Self {
        Self(url.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::urls::{check_urls, host_port};

    #[test]
    fn url_lists_are_checked_redacted_and_scrubbed_one_by_one() {
        let list = "amqp://u:pw1@n1:5701/%2f, amqp://u:pw2@n2:5702/%2f,";
        assert_eq!(split_urls(list).len(), 2);
        assert!(check_urls(list, "AMQP URL", &["amqp"]).is_ok());
        assert_eq!(
            redact_urls(list),
            "amqp://u:***@n1:5701/%2f, amqp://u:***@n2:5702/%2f"
        );
        let said = scrub("failed: pw1 then pw2", list);
        assert_eq!(said, "failed: *** then ***");
        let e = check_urls(
            "amqp://u:pw@n1/%2f,amqp:/u:secret@n2",
            "AMQP URL",
            &["amqp"],
        )
        .unwrap_err();
        assert!(e.contains("AMQP URL 2 of 2"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        assert!(check_urls(" , ", "AMQP URL", &["amqp"]).is_err());
        // A raw comma in a password: scrubbed whole, and refused by the check.
        let raw = "amqp://u:pa,ss@n1/%2f";
        assert!(!scrub("pa,ss", raw).contains("pa,ss"));
        assert!(check_urls(raw, "AMQP URL", &["amqp"]).is_err());
        assert_eq!(host_port("amqp://u:pw@n1/%2f"), "n1:5672");
        assert_eq!(host_port("amqps://n1:5999"), "n1:5999");
        assert_eq!(host_port("amqp:u:pw@n1"), "?");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("amqp://guest:s3cr%40t@broker:5672/%2f"),
            "amqp://guest:***@broker:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://app:hunter2@db/shop?sslmode=require"),
            "postgres://app:***@db/shop?sslmode=require"
        );
        assert_eq!(
            redact_url("postgres://app@db/shop"),
            "postgres://app@db/shop"
        );
        assert_eq!(
            redact_url("not a url hunter2"),
            "<unparseable URL, not shown>"
        );
        // Missing `//`: parses, but the password sits in the "path".
        assert_eq!(
            redact_url("amqp:guest:hunter2@127.0.0.1:5672/%2f"),
            "<malformed URL, not shown>"
        );
        assert_eq!(
            redact_url("postgres://app@db/shop?password=hunter2&sslmode=require"),
            "postgres://app@db/shop?password=***&sslmode=require"
        );
    }

    #[test]
    fn scrub_removes_encoded_and_decoded_forms() {
        let url = "amqp://guest:s3cr%40t@broker/";
        assert_eq!(
            scrub("failed s3cr%40t and s3cr@t", url),
            "failed *** and ***"
        );
        assert_eq!(scrub("nothing here", "amqp://broker/"), "nothing here");
        assert_eq!(
            scrub("saw hunter2", "postgres://db/x?password=hunter2"),
            "saw ***"
        );
        for raw in [
            "amqp://guest:/hunter2@host/",
            "amqp://guest:12?hunter2@host/",
        ] {
            assert_eq!(redact_url(raw), "<malformed URL, not shown>");
            assert!(!scrub(&format!("failed: {raw}"), raw).contains("hunter2"));
        }
        let malformed = "amqp:guest:hunter2@127.0.0.1:5672/%2f";
        assert_eq!(
            scrub(&format!("Invalid URL: '{malformed}' (hunter2)"), malformed),
            "Invalid URL: '***' (***)"
        );
    }

    #[test]
    fn secret_urls_never_show_their_password() {
        let url =
            SecretUrl::from("amqp://relay:hunter2@a:5672/%2f,amqp://relay:hunter2@b:5672/%2f");
        for shown in [format!("{url:?}"), format!("{url}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(
                shown.contains("a:5672") && shown.contains("b:5672"),
                "{shown}"
            );
        }
        assert!(url.expose().contains("hunter2"));
    }
}
