//! One trace per request across processes: the W3C trace context (`traceparent`, `tracestate`)
//! carried in gRPC metadata between the router and the nodes, and taken from an HTTP client's
//! headers. Spans are ordinary `tracing` spans; a process that exports them (see the CLI's
//! telemetry set-up: `OTEL_EXPORTER_OTLP_ENDPOINT`) turns them into OpenTelemetry spans, and these
//! helpers link them to the caller's.
//!
//! Invariants:
//! - Propagation never fails a request: a missing or malformed `traceparent` starts a new trace.
//! - Only the two W3C fields are read from or written to a carrier.
//! - Without an exporting subscriber a span has no trace context, and nothing is injected.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http::HeaderMap;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The fields of the W3C trace context.
const FIELDS: [&str; 2] = ["traceparent", "tracestate"];

struct Grpc<'a>(&'a MetadataMap);

impl Extractor for Grpc<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        FIELDS.into_iter().filter(|k| self.0.contains_key(*k)).collect()
    }
}

struct GrpcOut<'a>(&'a mut MetadataMap);

impl Injector for GrpcOut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str())) {
            self.0.insert(k, v);
        }
    }
}

struct Http<'a>(&'a HeaderMap);

impl Extractor for Http<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        FIELDS.into_iter().filter(|k| self.0.contains_key(*k)).collect()
    }
}

/// Makes `span` a child of the trace context in a gRPC request's metadata, if it carries one.
pub fn adopt_grpc(span: &tracing::Span, metadata: &MetadataMap) {
    adopt(span, &Grpc(metadata));
}

/// Makes `span` a child of the trace context in an HTTP request's headers, if it carries one.
pub fn adopt_http(span: &tracing::Span, headers: &HeaderMap) {
    adopt(span, &Http(headers));
}

fn adopt(span: &tracing::Span, carrier: &dyn Extractor) {
    if !carrier.get("traceparent").is_some_and(well_formed) {
        return;
    }
    let parent = TraceContextPropagator::new().extract(carrier);
    // Fails only when the span is disabled or already started its trace: nothing to link then.
    let _ = span.set_parent(parent);
}

/// Whether a `traceparent` has W3C's shape: `VV-TTTT…(32)-PPPP…(16)-FF`, lowercase hex (the
/// propagator alone accepts ids of any length).
fn well_formed(traceparent: &str) -> bool {
    let parts: Vec<&str> = traceparent.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    parts.len() >= 4 && hex(parts[0], 2) && hex(parts[1], 32) && hex(parts[2], 16) && hex(parts[3], 2) && (parts.len() == 4 || parts[0] != "00")
}

/// Writes `span`'s trace context into an outgoing gRPC request's metadata, so the callee's spans
/// join the trace.
pub fn inject(span: &tracing::Span, metadata: &mut MetadataMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut GrpcOut(metadata));
}

/// The span of the phase a request is in (queued, prefilling, ...): starting a phase ends the one
/// before; a span lasts from its creation until it is replaced or ended.
#[derive(Debug, Default)]
pub struct Phase(Option<tracing::Span>);

impl Phase {
    /// Ends the current phase, if any, and starts `span`.
    pub fn start(&mut self, span: tracing::Span) {
        self.0 = Some(span);
    }

    /// Ends the current phase, if any.
    pub fn end(&mut self) {
        self.0 = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips_through_grpc_metadata() {
        let mut inbound = MetadataMap::new();
        inbound.insert("traceparent", PARENT.parse().unwrap());
        let cx = TraceContextPropagator::new().extract(&Grpc(&inbound));
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote());
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let mut outbound = MetadataMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut GrpcOut(&mut outbound));
        assert_eq!(outbound.get("traceparent").unwrap().to_str().unwrap(), PARENT);
    }

    #[test]
    fn malformed_or_missing_context_is_ignored() {
        assert!(well_formed(PARENT));
        for bad in ["", "garbage", "00-4bf9-00f0-01", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", &format!("{PARENT}-x")] {
            assert!(!well_formed(bad), "{bad:?} was accepted");
        }
        // Well-formed but invalid (an all-zero trace id): the propagator refuses it.
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01".parse().unwrap());
        assert!(!TraceContextPropagator::new().extract(&Http(&headers)).span().span_context().is_valid());
        // A span without an exporting subscriber: adopting and injecting do nothing, and never panic.
        let span = tracing::info_span!("t");
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", PARENT.parse().unwrap());
        adopt_http(&span, &headers);
        let mut out = MetadataMap::new();
        inject(&span, &mut out);
        assert!(out.get("traceparent").is_none());
    }
}
