//! Prometheus metrics in the text exposition format (0.0.4), written by hand: counters and histograms
//! with fixed buckets (lock-free atomics), label sets fixed at first use, and the node's own families.
//! Names follow vLLM's under the `tandem:` prefix (`tandem:num_requests_running`, ...).
//!
//! Invariants:
//! - Recording never blocks on I/O and never fails; a scrape reads a consistent-enough snapshot (each
//!   value atomically; a histogram's count is read after its buckets, so `+Inf` is never below a bucket).
//! - A family's samples are written together under one `# HELP`/`# TYPE` pair, label values escaped.
//! - [`node`] is process-wide: a `tandem prefill` or `tandem decode` process serves one node.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use tandem_kv_transfer::Error as TransferError;

use crate::NodeCore;

/// The content type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Latency buckets in seconds (vLLM's TTFT buckets, a superset of its ITL ones).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }
    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (an integer: requests, blocks).
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    /// Subtracts one (saturating at zero).
    pub fn dec(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
    }
    /// The value now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A histogram over fixed bucket bounds; the sum is kept in microunits.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending, `+Inf` implied).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    /// Records one value.
    pub fn observe(&self, v: f64) {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micros
            .fetch_add((v * 1e6).round() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Release);
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    /// How many values were recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }
}

/// A family of counters keyed by label values (few, fixed at first use).
#[derive(Debug)]
pub struct CounterVec {
    labels: &'static [&'static str],
    values: Mutex<Vec<(Vec<String>, u64)>>,
}

impl CounterVec {
    /// A family with these label names.
    pub fn new(labels: &'static [&'static str]) -> CounterVec {
        CounterVec {
            labels,
            values: Mutex::new(Vec::new()),
        }
    }

    /// Adds `n` to the counter of `values` (one per label name).
    pub fn add(&self, values: &[&str], n: u64) {
        let mut all = self.values.lock().unwrap_or_else(|p| p.into_inner());
        match all
            .iter_mut()
            .find(|(k, _)| k.iter().map(String::as_str).eq(values.iter().copied()))
        {
            Some((_, v)) => *v += n,
            None => all.push((values.iter().map(|s| s.to_string()).collect(), n)),
        }
    }

    /// Adds one to the counter of `values`.
    pub fn inc(&self, values: &[&str]) {
        self.add(values, 1);
    }

    /// The counter of `values` (0 if never touched).
    pub fn get(&self, values: &[&str]) -> u64 {
        let all = self.values.lock().unwrap_or_else(|p| p.into_inner());
        all.iter()
            .find(|(k, _)| k.iter().map(String::as_str).eq(values.iter().copied()))
            .map_or(0, |(_, v)| *v)
    }
}

/// A family of histograms keyed by label values.
#[derive(Debug)]
pub struct HistogramVec {
    labels: &'static [&'static str],
    bounds: &'static [f64],
    values: Mutex<Vec<(Vec<String>, std::sync::Arc<Histogram>)>>,
}

impl HistogramVec {
    /// A family with these label names and bucket bounds.
    pub fn new(labels: &'static [&'static str], bounds: &'static [f64]) -> HistogramVec {
        HistogramVec {
            labels,
            bounds,
            values: Mutex::new(Vec::new()),
        }
    }

    /// Records `v` in the histogram of `values`.
    pub fn observe(&self, values: &[&str], v: f64) {
        let h = {
            let mut all = self.values.lock().unwrap_or_else(|p| p.into_inner());
            match all
                .iter()
                .find(|(k, _)| k.iter().map(String::as_str).eq(values.iter().copied()))
            {
                Some((_, h)) => std::sync::Arc::clone(h),
                None => {
                    let h = std::sync::Arc::new(Histogram::new(self.bounds));
                    all.push((
                        values.iter().map(|s| s.to_string()).collect(),
                        std::sync::Arc::clone(&h),
                    ));
                    h
                }
            }
        };
        h.observe(v);
    }
}

/// Writes metric families in the text exposition format.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn label_set(names: &[&str], values: &[String], extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(n, v)| format!("{n}=\"{}\"", escape(v)))
        .collect();
    if let Some((n, v)) = extra {
        parts.push(format!("{n}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

fn number(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

impl Exposition {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One unlabelled counter (`name` ends with `_total`).
    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.head(name, "counter", help);
        let _ = writeln!(self.out, "{name} {value}");
    }

    /// One unlabelled gauge.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.head(name, "gauge", help);
        let _ = writeln!(self.out, "{name} {}", number(value));
    }

    /// A gauge family with one label.
    pub fn gauges(&mut self, name: &str, help: &str, label: &str, values: &[(&str, f64)]) {
        self.head(name, "gauge", help);
        for (l, v) in values {
            let _ = writeln!(
                self.out,
                "{name}{{{label}=\"{}\"}} {}",
                escape(l),
                number(*v)
            );
        }
    }

    /// A counter family (`name` ends with `_total`).
    pub fn counters(&mut self, name: &str, help: &str, family: &CounterVec) {
        self.head(name, "counter", help);
        let all = family.values.lock().unwrap_or_else(|p| p.into_inner());
        for (k, v) in all.iter() {
            let _ = writeln!(self.out, "{name}{} {v}", label_set(family.labels, k, None));
        }
    }

    fn histogram_samples(&mut self, name: &str, names: &[&str], values: &[String], h: &Histogram) {
        let count = h.count();
        let mut cumulative = 0;
        for (b, n) in h.bounds.iter().zip(&h.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let le = label_set(names, values, Some(("le", number(*b))));
            let _ = writeln!(self.out, "{name}_bucket{le} {}", cumulative.min(count));
        }
        let inf = label_set(names, values, Some(("le", "+Inf".into())));
        let _ = writeln!(self.out, "{name}_bucket{inf} {count}");
        let plain = label_set(names, values, None);
        let sum = h.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(self.out, "{name}_sum{plain} {}", number(sum));
        let _ = writeln!(self.out, "{name}_count{plain} {count}");
    }

    /// One unlabelled histogram.
    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.head(name, "histogram", help);
        self.histogram_samples(name, &[], &[], h);
    }

    /// A histogram family.
    pub fn histograms(&mut self, name: &str, help: &str, family: &HistogramVec) {
        self.head(name, "histogram", help);
        let all = family
            .values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for (k, h) in &all {
            self.histogram_samples(name, family.labels, k, h);
        }
    }

    /// The text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// What a node records as it serves (its load is read from the engine at scrape time).
#[derive(Debug)]
pub struct NodeMetrics {
    /// Finished KV transfers by backend and direction (`send` on prefill nodes, `recv` on decode nodes).
    pub transfers: CounterVec,
    /// Payload bytes of finished KV transfers by backend and direction.
    pub transfer_bytes: CounterVec,
    /// Seconds of finished KV transfers by backend and direction.
    pub transfer_seconds: HistogramVec,
    /// Failed KV transfers by backend, direction and kind.
    pub transfer_failures: CounterVec,
    /// Seconds a request waited in the engine's queue before its first chunk was scheduled.
    pub queue_time: Histogram,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: Counter,
    /// Prompt tokens the prefix cache served.
    pub prefix_cache_hits: Counter,
    /// Decode node: requests prefilled here, by reason (short, no_prefill_node, unlisted, remote_failed).
    pub local_prefills: CounterVec,
    /// Requests refused or ended early by overload protection, by reason ([`QUEUE_FULL`], [`DEADLINE`]).
    pub rejected: CounterVec,
}

/// `reason` of a request refused because its bounded queue was full.
pub const QUEUE_FULL: &str = "queue_full";
/// `reason` of a request ended because its deadline (`grpc-timeout`) passed.
pub const DEADLINE: &str = "deadline";

static NODE: LazyLock<NodeMetrics> = LazyLock::new(|| NodeMetrics {
    transfers: CounterVec::new(&["backend", "direction"]),
    transfer_bytes: CounterVec::new(&["backend", "direction"]),
    transfer_seconds: HistogramVec::new(&["backend", "direction"], LATENCY_BUCKETS),
    transfer_failures: CounterVec::new(&["backend", "direction", "kind"]),
    queue_time: Histogram::new(LATENCY_BUCKETS),
    prefix_cache_queries: Counter::default(),
    prefix_cache_hits: Counter::default(),
    local_prefills: CounterVec::new(&["reason"]),
    rejected: CounterVec::new(&["reason"]),
});

/// This process's node metrics.
pub fn node() -> &'static NodeMetrics {
    &NODE
}

impl NodeMetrics {
    /// Records a finished transfer (`direction`: [`SEND`] or [`RECV`]).
    pub fn transfer_done(&self, backend: &str, direction: &str, stats: &tandem_kv_transfer::TransferStats) {
        self.transfers.inc(&[backend, direction]);
        self.transfer_bytes.add(&[backend, direction], stats.bytes);
        self.transfer_seconds
            .observe(&[backend, direction], stats.elapsed.as_secs_f64());
    }

    /// Records a failed transfer.
    pub fn transfer_failed(&self, backend: &str, direction: &str, e: &TransferError) {
        self.transfer_failures.inc(&[backend, direction, failure_kind(e)]);
    }

    /// Records a prompt's prefix-cache lookup: `prompt_tokens` queried, `cached_tokens` served.
    pub fn prefix_lookup(&self, prompt_tokens: usize, cached_tokens: usize) {
        self.prefix_cache_queries.add(prompt_tokens as u64);
        self.prefix_cache_hits.add(cached_tokens.min(prompt_tokens) as u64);
    }
}

/// The `direction` of a transfer this node sent (prefill node).
pub const SEND: &str = "send";
/// The `direction` of a transfer this node received (decode node).
pub const RECV: &str = "recv";

/// A transfer error's kind, as a label value.
pub fn failure_kind(e: &TransferError) -> &'static str {
    match e {
        TransferError::Invalid(_) => "invalid",
        TransferError::Incompatible(_) => "incompatible",
        TransferError::Unreachable { .. } => "unreachable",
        TransferError::Rejected { .. } => "rejected",
        TransferError::Integrity { .. } => "integrity",
        TransferError::LinkFailed { .. } => "link_failed",
        TransferError::Timeout { .. } => "timeout",
        TransferError::Cancelled { .. } => "cancelled",
        TransferError::BlocksBusy(_) => "blocks_busy",
        TransferError::Unsupported { .. } => "unsupported",
        TransferError::Plugin { .. } => "plugin",
        TransferError::Device(_) => "device",
        TransferError::Shutdown => "shutdown",
    }
}

/// The node's metrics now: its load read from the engine thread, and what it recorded.
pub async fn render_node(core: &NodeCore) -> String {
    let mut e = Exposition::default();
    match core.engine.load().await {
        Ok(load) => {
            e.gauge(
                "tandem:num_requests_running",
                "Requests in the engine's running batch.",
                load.running as f64,
            );
            e.gauge(
                "tandem:num_requests_waiting",
                "Requests waiting to be scheduled.",
                load.waiting as f64,
            );
            let used = load.total_blocks.saturating_sub(load.free_blocks);
            let usage = if load.total_blocks == 0 {
                0.0
            } else {
                used as f64 / load.total_blocks as f64
            };
            e.gauge(
                "tandem:kv_cache_usage_perc",
                "KV-cache usage: 1 means every block is in use.",
                usage,
            );
            e.gauges(
                "tandem:kv_cache_blocks",
                "KV-cache blocks by state.",
                "state",
                &[("used", used as f64), ("free", load.free_blocks as f64)],
            );
        }
        Err(err) => tracing::warn!(error = %err, "metrics: the engine did not report its load"),
    }
    e.gauge(
        "tandem:requests_queued",
        "Requests accepted and not yet started (no first token yet), as --max-waiting-requests bounds them.",
        core.admission.waiting() as f64,
    );
    e.gauge(
        "tandem:requests_queued_limit",
        "The bound on tandem:requests_queued (--max-waiting-requests).",
        core.admission.limit() as f64,
    );
    let m = node();
    e.counters(
        "tandem:requests_rejected_total",
        "Requests refused or ended by overload protection, by reason (queue_full, deadline).",
        &m.rejected,
    );
    e.counters(
        "tandem:kv_transfers_total",
        "Finished KV transfers.",
        &m.transfers,
    );
    e.counters(
        "tandem:kv_transfer_bytes_total",
        "Payload bytes of finished KV transfers.",
        &m.transfer_bytes,
    );
    e.histograms(
        "tandem:kv_transfer_seconds",
        "Duration of finished KV transfers.",
        &m.transfer_seconds,
    );
    e.counters(
        "tandem:kv_transfer_failures_total",
        "Failed KV transfers by kind.",
        &m.transfer_failures,
    );
    e.counter(
        "tandem:kv_nccl_communicators_abandoned_total",
        "NCCL communicators whose making failed (a peer gone mid-handshake), left unaborted: NCCL cannot always abort one. Each keeps its threads and the buffers NCCL allocated before failing (up to a few hundred MiB of GPU memory).",
        tandem_kv_transfer::transport::nccl::communicators_left_unaborted(),
    );
    e.counters(
        "tandem:local_prefill_total",
        "Requests a decode node prefilled itself, by reason.",
        &m.local_prefills,
    );
    e.histogram(
        "tandem:request_queue_time_seconds",
        "Seconds requests waited in the engine's queue before their first chunk was scheduled.",
        &m.queue_time,
    );
    e.counter(
        "tandem:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        m.prefix_cache_queries.get(),
    );
    e.counter(
        "tandem:prefix_cache_hits_total",
        "Prompt tokens served from the prefix cache.",
        m.prefix_cache_hits.get(),
    );
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_the_count() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.5, 3.0] {
            h.observe(v);
        }
        let mut e = Exposition::default();
        e.histogram("x_seconds", "x.", &h);
        let text = e.finish();
        assert!(text.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"1\"} 3\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"+Inf\"} 4\n"), "{text}");
        assert!(text.contains("x_seconds_sum 4.05\n"), "{text}");
        assert!(text.contains("x_seconds_count 4\n"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        let c = CounterVec::new(&["k"]);
        c.inc(&["a\"b\\c\nd"]);
        c.add(&["a\"b\\c\nd"], 2);
        let mut e = Exposition::default();
        e.counters("y_total", "y.", &c);
        assert!(e.finish().contains("y_total{k=\"a\\\"b\\\\c\\nd\"} 3\n"));
    }
}
