/// A schema or table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid {what} {value:?}: use 1 to {max} characters of a-z, 0-9 and _, not starting with a digit"
)]
pub struct InvalidIdentifier {
    /// What the identifier names (`"schema"`, ...).
    pub what: &'static str,
    /// The rejected value.
    pub value: String,
    /// The longest accepted length.
    pub max: usize,
}

/// Longest schema name accepted. The wake-up channel is `outbox_<schema>`,
/// and PostgreSQL truncates identifiers (channel names too) at 63 bytes.
pub const MAX_SCHEMA_LEN: usize = 56;

/// A validated SQL identifier: `[a-z_][a-z0-9_]*`, so it never needs
/// escaping and means the same quoted or not.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `value` as the identifier named `what` (used in the error).
    pub fn new(what: &'static str, value: &str) -> Result<Self, InvalidIdentifier> {
        let mut chars = value.chars();
        let ok = value.len() <= MAX_SCHEMA_LEN
            && matches!(chars.next(), Some('a'..='z' | '_'))
            && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'));
        if ok {
            Ok(Self(value.to_owned()))
        } else {
            Err(InvalidIdentifier {
                what,
                value: value.to_owned(),
                max: MAX_SCHEMA_LEN,
            })
        }
    }

    /// The bare name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name double-quoted, ready for SQL text.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl std::fmt::Display for Ident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The NOTIFY channel relays of `schema` listen on.
pub fn wakeup_channel(schema: &Ident) -> String {
    format!("outbox_{}", schema.as_str())
}

/// The default name of the logical replication slot (and the
/// publication) the write-ahead-log capture of `schema` reads:
/// `outbox_<schema>`, at most 63 bytes. The name in use is the one
/// `outbox-relay migrate --capture wal [--slot NAME]` recorded in the
/// schema's table `outbox_wal_capture` (slot names are cluster-wide).
pub fn wal_slot_name(schema: &Ident) -> String {
    format!("outbox_{}", schema.as_str())
}

/// The prefix of the logical decoding messages that carry `schema`'s events
/// in the write-ahead log: `outbox:<schema>` (function `outbox_emit`).
pub fn wal_message_prefix(schema: &Ident) -> String {
    format!("outbox:{}", schema.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in ["public", "_x", "tenant_42", &"a".repeat(MAX_SCHEMA_LEN)] {
            assert_eq!(Ident::new("schema", ok).unwrap().as_str(), ok);
        }
    }

    #[test]
    fn rejects_anything_that_would_need_escaping() {
        for bad in [
            "",
            "1abc",
            "Public",
            "a-b",
            "a\"; drop table outbox; --",
            "a b",
            "é",
            &"a".repeat(MAX_SCHEMA_LEN + 1),
        ] {
            assert!(
                matches!(Ident::new("schema", bad), Err(InvalidIdentifier { .. })),
                "{bad:?} accepted"
            );
        }
    }
}
