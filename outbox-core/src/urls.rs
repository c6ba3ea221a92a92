//! Reading and checking the URLs a setting holds (a database, one broker
//! node or a comma-separated list of them) without ever quoting them: a
//! URL may hold a password ([`crate::redact`] hides those).

/// Checks that `url` is a well-formed `scheme://[user[:password]@]host...`
/// URL of one of `schemes`, before anything connects with it. The error
/// says what is wrong and never quotes the value (it may hold a password).
/// `what` names the setting (`"AMQP URL"`).
pub fn check_url(url: &str, what: &str, schemes: &[&str]) -> Result<(), String> {
    let expected = || {
        let alternatives: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
        alternatives.join(" or ")
    };
    let hidden = "the value is not shown: it may hold a password";
    let u = url::Url::parse(url).map_err(|e| {
        format!(
            "{what} is malformed ({e}); expected {}user:password@host:port/...; {hidden}",
            expected()
        )
    })?;
    if !schemes.contains(&u.scheme()) {
        return Err(format!("{what} must start with {}; {hidden}", expected()));
    }
    if misread(url, &u) {
        return Err(format!(
            "{what} is malformed (no // after the scheme, or an @ outside the user info: percent-encode /, ?, # and @ in a password); expected {}user:password@host:port/...; {hidden}",
            expected()
        ));
    }
    // PostgreSQL may name no host (a Unix socket: `postgres:///db?host=/run/postgresql`).
    if !u.has_host() && !matches!(u.scheme(), "postgres" | "postgresql") {
        return Err(format!(
            "{what} is malformed (no host); expected {}user:password@host:port/...; {hidden}",
            expected()
        ));
    }
    Ok(())
}

/// The URLs of a setting that lists several, separated by commas (a
/// broker cluster: `amqp://u:p@node1/%2f,amqp://u:p@node2/%2f`); blanks
/// around them are ignored. A comma inside a password is written `%2C`.
pub fn split_urls(list: &str) -> Vec<&str> {
    list.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// [`check_url`] for each URL of a comma-separated `list`; at least one.
/// The error says which URL (by position) is wrong, never its value.
pub fn check_urls(list: &str, what: &str, schemes: &[&str]) -> Result<(), String> {
    let urls = split_urls(list);
    if urls.is_empty() {
        return Err(format!(
            "{what} is empty; give one URL or several separated by commas"
        ));
    }
    if urls.len() == 1 {
        return check_url(urls[0], what, schemes);
    }
    for (i, url) in urls.iter().enumerate() {
        check_url(url, &format!("{what} {} of {}", i + 1, urls.len()), schemes).map_err(|e| {
            format!(
                "{e} (several URLs are separated by commas: write a comma in a password as %2C)"
            )
        })?;
    }
    Ok(())
}

/// `host:port` of `url` (the port defaulted from the scheme), to say which
/// node of a cluster is in use without any user info; `"?"` when it does
/// not parse.
pub fn host_port(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) if !misread(url, &u) => {
            let port = u.port().or(match u.scheme() {
                "amqp" => Some(5672),
                "amqps" => Some(5671),
                "postgres" | "postgresql" => Some(5432),
                _ => None,
            });
            match (u.host_str(), port) {
                (Some(h), Some(p)) => format!("{h}:{p}"),
                (Some(h), None) => h.to_owned(),
                _ => "?".to_owned(),
            }
        }
        _ => "?".to_owned(),
    }
}

/// Whether the parser cannot have found every secret of `raw`: no `//`
/// after the scheme, or an `@` that did not end a user info (a password
/// holding a raw `/`, `?` or `#` ends the authority early: `amqp://u:/p@h`
/// parses as host `u` with the password in the path).
pub(crate) fn misread(raw: &str, u: &url::Url) -> bool {
    u.cannot_be_a_base() || (raw.contains('@') && u.username().is_empty() && u.password().is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_url_says_what_is_wrong_without_the_value() {
        let amqp = ["amqp", "amqps"];
        for bad in [
            "amqp:guest:hunter2@127.0.0.1:5672/%2f",
            "amqp//guest:hunter2@host/",
            "amqp://guest:hunter2@127.0.0.1:notaport/",
            "amqp://guest:/hunter2@host/",
            "amqp://guest:12/hunter2@host/",
            "amqp://guest:?hunter2@host/",
            "http://guest:hunter2@host/",
            "guest:hunter2",
            "",
        ] {
            let e = check_url(bad, "AMQP URL", &amqp).unwrap_err();
            assert!(e.starts_with("AMQP URL "), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        assert!(check_url("amqp://guest:hunter2@127.0.0.1:5672/%2f", "AMQP URL", &amqp).is_ok());
        assert!(check_url("amqp://guest:%2Fhunter2@host/", "AMQP URL", &amqp).is_ok());
        let pg = ["postgres", "postgresql"];
        // A Unix socket names no host.
        assert!(
            check_url(
                "postgres:///shop?host=/var/run/postgresql",
                "database URL",
                &pg
            )
            .is_ok()
        );
        assert!(check_url("postgres:shop", "database URL", &pg).is_err());
    }
}
