//! W3C Trace Context: continue the producer's trace in the consumer.
//!
//! The relay passes the event's `traceparent` header through untouched.
//! For each message the consumer derives a child context (same trace id, a
//! new span id, the producer's span as parent) and records it on the
//! message's tracing span as `trace_id`, `parent_span_id` and `span_id`, so
//! logs and any tracing backend join the producer's trace. A handler that
//! calls further services passes [`TraceContext::traceparent`] on.

/// A span's place in a W3C trace (`traceparent` version 00).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lower-case hex digits, shared by the whole trace.
    pub trace_id: String,
    /// This span's id: 16 lower-case hex digits.
    pub span_id: String,
    /// The parent span's id (the producer's), if any.
    pub parent_span_id: Option<String>,
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceContext {
    /// A child of the span described by `traceparent`; `None` when the
    /// header is malformed (a new trace is then up to the caller).
    pub fn child_of(traceparent: &str) -> Option<Self> {
        let parts: Vec<&str> = traceparent.trim().split('-').collect();
        let [version, trace_id, parent, flags] = parts.as_slice() else {
            return None;
        };
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
        if !(hex(version, 2)
            && *version != "ff"
            && hex(trace_id, 32)
            && hex(parent, 16)
            && hex(flags, 2))
        {
            return None;
        }
        if !nonzero(trace_id) || !nonzero(parent) {
            return None;
        }
        Some(Self {
            trace_id: trace_id.to_ascii_lowercase(),
            span_id: new_span_id(),
            parent_span_id: Some(parent.to_ascii_lowercase()),
            flags: u8::from_str_radix(flags, 16).ok()?,
        })
    }

    /// The `traceparent` header naming this span, for downstream calls.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-{:02x}", self.trace_id, self.span_id, self.flags)
    }
}

fn new_span_id() -> String {
    loop {
        let id = outbox_core::random_u64();
        if id != 0 {
            return format!("{id:016x}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_a_valid_trace_with_a_new_span() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::child_of(tp).unwrap();
        assert_eq!(c.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.parent_span_id.as_deref(), Some("00f067aa0ba902b7"));
        assert_ne!(c.span_id, "00f067aa0ba902b7");
        assert_eq!(c.flags, 1);
        let next = c.traceparent();
        assert!(next.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && next.ends_with("-01"));
        assert_eq!(
            TraceContext::child_of(&next)
                .unwrap()
                .parent_span_id
                .as_deref(),
            Some(c.span_id.as_str())
        );
    }

    #[test]
    fn rejects_malformed_headers() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::child_of(bad), None, "{bad:?}");
        }
    }
}
