//! Trace context (W3C Trace Context, carried in the TRACE extension).
//!
//! A publish carries a trace context when [`crate::PublishOptions::trace`] is set: continue
//! the application's trace with its current span's context ([`TraceContext::from_traceparent`],
//! or with the `opentelemetry` feature [`from_span_context`]), or start one with
//! [`new_trace`]. A delivery's context is [`crate::Message::trace`]: when the broker records
//! traces (`tracing.otlp_endpoint`), it names the broker's `publish` span, so the
//! application's processing span becomes its child.

pub use aqueduct_proto::TraceContext;

/// A new trace: random trace and span ids, sampled (the broker records it if it exports traces
/// and its `tracing.sample_ratio` keeps this trace id).
pub fn new_trace() -> TraceContext {
    use ring::rand::SecureRandom;
    let rng = ring::rand::SystemRandom::new();
    let mut ids = [0u8; 24];
    loop {
        // The system RNG failing is not worth an error: fall back to the clock (ids need to be
        // unique, not secret).
        if rng.fill(&mut ids).is_err() {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            ids[..16].copy_from_slice(&t.to_le_bytes());
            ids[16..].copy_from_slice(&(t as u64).rotate_left(17).to_le_bytes());
        }
        if ids[..16] != [0; 16] && ids[16..] != [0; 8] {
            break;
        }
    }
    let mut t = TraceContext {
        trace_id: [0; 16],
        span_id: [0; 8],
        flags: TraceContext::SAMPLED,
    };
    t.trace_id.copy_from_slice(&ids[..16]);
    t.span_id.copy_from_slice(&ids[16..]);
    t
}

/// The OpenTelemetry span context of `t` (remote: it came from another process).
#[cfg(feature = "opentelemetry")]
pub fn span_context(t: &TraceContext) -> opentelemetry::trace::SpanContext {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    SpanContext::new(
        TraceId::from_bytes(t.trace_id),
        SpanId::from_bytes(t.span_id),
        TraceFlags::new(t.flags),
        true,
        TraceState::default(),
    )
}

/// The trace context of an OpenTelemetry span context, if it is valid.
#[cfg(feature = "opentelemetry")]
pub fn from_span_context(cx: &opentelemetry::trace::SpanContext) -> Option<TraceContext> {
    cx.is_valid().then(|| TraceContext {
        trace_id: cx.trace_id().to_bytes(),
        span_id: cx.span_id().to_bytes(),
        flags: cx.trace_flags().to_u8(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_traces_are_sampled_and_distinct() {
        let a = new_trace();
        let b = new_trace();
        assert!(a.is_sampled());
        assert_ne!(a.trace_id, b.trace_id);
        assert_ne!(a.trace_id, [0; 16]);
        assert_eq!(TraceContext::from_traceparent(&a.to_traceparent()), Ok(a));
    }

    #[cfg(feature = "opentelemetry")]
    #[test]
    fn converts_to_and_from_opentelemetry() {
        let t = new_trace();
        let cx = span_context(&t);
        assert!(cx.is_remote() && cx.is_sampled());
        assert_eq!(from_span_context(&cx), Some(t));
        assert_eq!(
            from_span_context(&opentelemetry::trace::SpanContext::empty_context()),
            None
        );
    }
}
