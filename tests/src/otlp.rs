//! An OTLP trace collector in the test process (gRPC, `opentelemetry.proto.collector.trace.v1`): it
//! keeps every span it receives with the `service.name` of the process that sent it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// One received span.
#[derive(Debug, Clone)]
pub struct Span {
    /// The `service.name` of the exporting process.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// Trace id, lowercase hex.
    pub trace_id: String,
    /// Span id, lowercase hex.
    pub span_id: String,
    /// Parent span id, lowercase hex (empty for a root).
    pub parent_id: String,
    /// Attributes rendered as strings.
    pub attributes: Vec<(String, String)>,
    /// Event names.
    pub events: Vec<String>,
}

impl Span {
    /// An attribute's value.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn render(kv: &KeyValue) -> (String, String) {
    let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    };
    (kv.key.clone(), v)
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = Vec::new();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .map(render)
                .find(|(k, _)| k == "service.name")
                .map(|(_, v)| v)
                .unwrap_or_default();
            for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                out.push(Span {
                    service: service.clone(),
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_id: hex(&s.parent_span_id),
                    attributes: s.attributes.iter().map(render).collect(),
                    events: s.events.into_iter().map(|e| e.name).collect(),
                });
            }
        }
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend(out);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// A running collector; it stops with the runtime it was started on.
pub struct Collector {
    /// `http://127.0.0.1:PORT`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    sink: Sink,
}

impl Collector {
    /// Listens on a free loopback port (call inside a tokio runtime).
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the collector");
        let addr: SocketAddr = listener.local_addr().expect("collector address");
        let sink = Sink::default();
        let service = TraceServiceServer::new(sink.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        Collector { endpoint: format!("http://{addr}"), sink }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.sink.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits until `done` holds for the spans received (checked every 100 ms), up to `limit`;
    /// returns them either way.
    pub async fn wait_for(&self, limit: Duration, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + limit;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
