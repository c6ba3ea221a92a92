//! The request fingerprint: what makes "the same request".

use sha2::{Digest, Sha256};

/// SHA-256 over the parts of a request the service considers significant.
///
/// Each part is length-prefixed before hashing, so parts cannot run
/// together (`("ab", "c")` and `("a", "bc")` differ). The same key sent
/// with a different fingerprint is rejected (HTTP 422).
///
/// ```
/// use outbox::idempotency::Fingerprint;
/// let a = Fingerprint::of_request("POST", "/orders", br#"{"sku":"A-1"}"#);
/// let b = Fingerprint::of_request("POST", "/orders", br#"{"sku":"A-2"}"#);
/// assert_ne!(a, b);
/// // Or any subset the service picks, e.g. the body alone:
/// let body_only = Fingerprint::of_parts([&br#"{"sku":"A-1"}"#[..]]);
/// # let _ = body_only;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The default fingerprint: method, path (with query) and body.
    pub fn of_request(method: &str, path: &str, body: &[u8]) -> Self {
        Self::of_parts([method.as_bytes(), path.as_bytes(), body])
    }

    /// The fingerprint of the given parts, in order.
    pub fn of_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part);
        }
        Self(hash.finalize().into())
    }

    /// The 32 digest bytes, as stored in `idempotency_keys.fingerprint`.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub(crate) fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cannot_run_together() {
        assert_ne!(
            Fingerprint::of_parts([&b"ab"[..], b"c"]),
            Fingerprint::of_parts([&b"a"[..], b"bc"])
        );
        assert_eq!(
            Fingerprint::of_request("POST", "/x", b"{}"),
            Fingerprint::of_parts([&b"POST"[..], b"/x", b"{}"])
        );
    }
}
