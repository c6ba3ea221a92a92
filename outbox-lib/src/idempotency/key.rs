//! The client's `Idempotency-Key`, validated.

use crate::error::{Error, Result};

/// Longest accepted key, in characters.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to [`MAX_IDEMPOTENCY_KEY_LEN`] visible
/// ASCII characters (`0x21..=0x7E`).
///
/// [`IdempotencyKey::parse`] also accepts the RFC 8941 structured-field
/// string form the IETF draft uses (`"8e03978e-40d5-43e8"`): the quotes are
/// removed and `\"` and `\\` unescaped, so `abc` and `"abc"` are one key.
///
/// ```
/// use outbox::idempotency::IdempotencyKey;
/// assert_eq!(IdempotencyKey::parse("order-7f3a")?.as_str(), "order-7f3a");
/// assert_eq!(IdempotencyKey::parse("\"order-7f3a\"")?.as_str(), "order-7f3a");
/// assert!(IdempotencyKey::parse("has space").is_err());
/// # Ok::<(), outbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates a key as sent by a client (header value or body field).
    /// Fails with [`Error::InvalidIdempotencyKey`].
    pub fn parse(raw: &str) -> Result<Self> {
        let key = match raw.strip_prefix('"') {
            Some(quoted) => unquote(quoted)?,
            None => raw.to_owned(),
        };
        if key.is_empty() {
            return Err(invalid("is empty"));
        }
        if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
            return Err(invalid("is longer than 255 characters"));
        }
        if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(invalid(
                "must be visible ASCII characters only (no spaces or control characters)",
            ));
        }
        Ok(Self(key))
    }

    /// The key, without structured-field quoting.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn invalid(reason: &'static str) -> Error {
    Error::InvalidIdempotencyKey { reason }
}

// RFC 8941 sf-string after the opening quote: printable ASCII, `\` escapes
// only `"` and `\`, and the closing quote ends the value.
fn unquote(rest: &str) -> Result<String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err(invalid("has an invalid escape in its quoted form")),
            },
            '"' => {
                return if chars.as_str().is_empty() {
                    Ok(out)
                } else {
                    Err(invalid("has characters after its closing quote"))
                };
            }
            c => out.push(c),
        }
    }
    Err(invalid("has no closing quote"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_visible_ascii_and_the_quoted_form() {
        let long = "k".repeat(MAX_IDEMPOTENCY_KEY_LEN);
        for (raw, key) in [
            ("a", "a"),
            (
                "8e03978e-40d5-43e8-bc93-6894a57f9324",
                "8e03978e-40d5-43e8-bc93-6894a57f9324",
            ),
            ("!~{}\"", "!~{}\""),
            (long.as_str(), long.as_str()),
            ("\"abc\"", "abc"),
            (r#""a\"b\\c""#, r#"a"b\c"#),
        ] {
            assert_eq!(IdempotencyKey::parse(raw).unwrap().as_str(), key, "{raw:?}");
        }
    }

    #[test]
    fn rejects_everything_else() {
        let too_long = "k".repeat(MAX_IDEMPOTENCY_KEY_LEN + 1);
        for raw in [
            "",
            "\"\"",
            "a b",
            "tab\t",
            "é",
            "nul\0",
            too_long.as_str(),
            "\"unterminated",
            "\"a\"b",
            r#""bad\escape""#,
            "\"has space\"",
        ] {
            assert!(
                matches!(
                    IdempotencyKey::parse(raw),
                    Err(Error::InvalidIdempotencyKey { .. })
                ),
                "{raw:?} accepted"
            );
        }
    }
}
