//! Passwords in URLs never reach a log line, an error or `--help`.

/// `url` with any password replaced by `***`. Unparseable input is not
/// echoed at all, since it might be a secret.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "<unparseable URL>".to_owned(),
    }
}

/// Replaces every occurrence of the password of `url` in `text` (errors of
/// underlying libraries may quote the URL they were given).
pub fn scrub(text: &str, url: &str) -> String {
    let password = url::Url::parse(url)
        .ok()
        .and_then(|u| u.password().map(str::to_owned))
        .filter(|p| !p.is_empty());
    match password {
        Some(p) => {
            let decoded = percent_decode(&p);
            text.replace(&p, "***").replace(&decoded, "***")
        }
        None => text.to_owned(),
    }
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
    }

    #[test]
    fn scrub_removes_encoded_and_decoded_forms() {
        let url = "amqp://guest:s3cr%40t@broker/";
        assert_eq!(
            scrub("failed s3cr%40t and s3cr@t", url),
            "failed *** and ***"
        );
        assert_eq!(scrub("nothing here", "amqp://broker/"), "nothing here");
    }
}
