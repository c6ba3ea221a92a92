//! Passwords in URLs never reach a log line, an error or `--help`.

/// `url` with any password replaced by `***`. Unparseable input is not
/// echoed at all, since it might be a secret.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
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
        Err(_) => "<unparseable URL>".to_owned(),
    }
}

fn is_secret_param(name: &str) -> bool {
    name.to_ascii_lowercase().contains("password")
}

/// Replaces every occurrence of the passwords of `url` (user info and
/// `password` query parameters) in `text`: errors of underlying libraries
/// may quote the URL they were given.
pub fn scrub(text: &str, url: &str) -> String {
    let Ok(u) = url::Url::parse(url) else {
        return text.to_owned();
    };
    let mut secrets: Vec<String> = u.password().map(str::to_owned).into_iter().collect();
    secrets.extend(
        u.query_pairs()
            .filter(|(k, _)| is_secret_param(k))
            .map(|(_, v)| v.into_owned()),
    );
    let mut out = text.to_owned();
    for p in secrets.into_iter().filter(|p| !p.is_empty()) {
        let decoded = percent_decode(&p);
        out = out.replace(&p, "***").replace(&decoded, "***");
    }
    out
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_else(|| s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(redact_url("not a url hunter2"), "<unparseable URL>");
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
    }
}
