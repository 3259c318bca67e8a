//! Logs and traces of a tandem process.
//!
//! Logs go to stderr, filtered by `TANDEM_LOG` (default `warn`): plain text, with colours only when
//! stderr is a terminal, or one JSON object per line with `TANDEM_LOG_FORMAT=json`.
//!
//! Traces: when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, tandem's
//! spans (info level and above, whatever `TANDEM_LOG` says) are exported over OTLP/gRPC with the
//! standard variables: `OTEL_SERVICE_NAME` (default `tandem-<role>`), `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_BSP_*` for batching, `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` to turn them
//! off. Only the gRPC protocol is spoken: another `OTEL_EXPORTER_OTLP_PROTOCOL` is a start-up error.
//!
//! Invariants:
//! - The exporter runs on a tokio runtime of its own (the SDK's batch thread has none, and tonic
//!   needs one), so exporting never competes with the serving runtime and works in every command.
//! - Dropping [`Telemetry`] flushes the spans not yet exported, then stops that runtime; it is
//!   dropped on the main thread, outside any runtime.
//! - The exporter's own spans (tonic, hyper) are never exported: only `tandem*` targets are.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Keeps the trace exporter alive; dropping it flushes.
pub(crate) struct Telemetry {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("warning: exporting the last traces failed: {e}");
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Whether the OTLP trace exporter is asked for.
fn traces_wanted() -> anyhow::Result<bool> {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(false);
    }
    match env("OTEL_TRACES_EXPORTER").as_deref() {
        None | Some("otlp") => {}
        Some("none") => return Ok(false),
        Some(other) => bail!("OTEL_TRACES_EXPORTER={other}: tandem exports traces with otlp (or none)"),
    }
    if env("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() && env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none() {
        return Ok(false);
    }
    for var in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Some(p) = env(var)
            && p != "grpc"
        {
            bail!("{var}={p}: tandem exports OTLP over gRPC only (set it to grpc, or unset it)");
        }
    }
    Ok(true)
}

/// Installs the global subscriber: logs, and traces when asked for (see the module doc).
/// `service` names this process in traces unless `OTEL_SERVICE_NAME` does.
pub(crate) fn init(service: &'static str) -> anyhow::Result<Telemetry> {
    use std::io::IsTerminal;
    type Boxed = Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>;
    let filter = tracing_subscriber::EnvFilter::try_from_env("TANDEM_LOG").unwrap_or_else(|_| "warn".into());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs: Boxed = if env("TANDEM_LOG_FORMAT").is_some_and(|f| f.eq_ignore_ascii_case("json")) {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).with_filter(filter).boxed()
    };
    let mut telemetry = Telemetry { provider: None, runtime: None };
    let mut layers = vec![logs];
    if traces_wanted()? {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tandem-otlp")
            .enable_all()
            .build()
            .context("starting the trace exporter's runtime")?;
        let exporter = {
            let _inside = runtime.enter();
            opentelemetry_otlp::SpanExporter::builder().with_tonic().build().context("setting up the OTLP trace exporter")?
        };
        let exporter = OnRuntime { inner: Arc::new(exporter), runtime: runtime.handle().clone() };
        let mut resource = Resource::builder();
        if env("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(service);
        }
        let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
        let tracer = provider.tracer("tandem");
        let targets = tracing_subscriber::filter::Targets::new().with_target("tandem", tracing::Level::INFO);
        layers.push(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(targets).boxed());
        telemetry = Telemetry { provider: Some(provider), runtime: Some(runtime) };
    }
    tracing_subscriber::registry().with(layers).try_init().context("installing the log subscriber")?;
    Ok(telemetry)
}

/// The OTLP exporter, run on the telemetry runtime (the SDK polls exports from a plain thread).
#[derive(Debug)]
struct OnRuntime {
    inner: Arc<opentelemetry_otlp::SpanExporter>,
    runtime: tokio::runtime::Handle,
}

impl SpanExporter for OnRuntime {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let inner = Arc::clone(&self.inner);
        let task = self.runtime.spawn(async move { inner.export(batch).await });
        async move { task.await.unwrap_or_else(|e| Err(OTelSdkError::InternalFailure(format!("the export task failed: {e}")))) }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}
