//! The router's Prometheus metrics (`GET /metrics` on the HTTP listener), vLLM's names under `tandem:`:
//! request latencies measured in the [`crate::Relay`] every front end goes through, finished requests by
//! reason, tokens in and out (from the decode node's usage), requests running, routing decisions by
//! policy, membership changes, and overload protection (requests queued, refusals by reason).
//!
//! Invariants:
//! - The metrics are process-wide (one router per process); recording never blocks on I/O.
//! - A request is running from the moment its relay opens until the relay is dropped; it counts as a
//!   success (by finish reason) and adds its tokens only when its last message arrived.

use std::collections::HashMap;
use std::sync::LazyLock;

use tandem_membership::{NodeInfo, NodeRole};
use tandem_node::metrics::{Counter, CounterVec, Exposition, Gauge, Histogram, LATENCY_BUCKETS};
use tokio::sync::watch;

/// What the router records.
#[derive(Debug)]
pub(crate) struct RouterMetrics {
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) success: CounterVec,
    pub(crate) prompt_tokens: Counter,
    pub(crate) generation_tokens: Counter,
    pub(crate) running: Gauge,
    pub(crate) routing: CounterVec,
    pub(crate) membership: CounterVec,
    /// Requests moved to another decode node after theirs failed, by cause (see [`crate::migrate`]).
    pub(crate) migrations: CounterVec,
    pub(crate) rejected: CounterVec,
}

static METRICS: LazyLock<RouterMetrics> = LazyLock::new(|| RouterMetrics {
    ttft: Histogram::new(LATENCY_BUCKETS),
    itl: Histogram::new(LATENCY_BUCKETS),
    e2e: Histogram::new(LATENCY_BUCKETS),
    success: CounterVec::new(&["finished_reason"]),
    prompt_tokens: Counter::default(),
    generation_tokens: Counter::default(),
    running: Gauge::default(),
    routing: CounterVec::new(&["policy", "prefill"]),
    membership: CounterVec::new(&["role", "change"]),
    migrations: CounterVec::new(&["cause"]),
    rejected: CounterVec::new(&["reason"]),
});

/// This process's router metrics.
pub(crate) fn router() -> &'static RouterMetrics {
    &METRICS
}

fn role_name(r: NodeRole) -> &'static str {
    match r {
        NodeRole::Prefill => "prefill",
        NodeRole::Decode => "decode",
    }
}

/// Records one routing decision.
pub(crate) fn routed(policy: crate::Policy, remote_prefill: bool) {
    router()
        .routing
        .inc(&[policy.name(), if remote_prefill { "remote" } else { "none" }]);
}

/// Records a request refused or ended by overload protection (see [`crate::admission::reason`]).
pub(crate) fn rejected(reason: &str) {
    router().rejected.inc(&[reason]);
}

/// Counts nodes joining and leaving `nodes` until the sender goes away (needs a tokio runtime; without
/// one, membership changes are not counted).
pub(crate) fn watch_membership(mut nodes: watch::Receiver<Vec<NodeInfo>>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let mut known: HashMap<String, NodeRole> = HashMap::new();
        loop {
            let now: HashMap<String, NodeRole> = nodes
                .borrow_and_update()
                .iter()
                .map(|n| (n.id.clone(), n.role))
                .collect();
            let m = router();
            for (id, role) in &now {
                if !known.contains_key(id) {
                    m.membership.inc(&[role_name(*role), "join"]);
                }
            }
            for (id, role) in &known {
                if !now.contains_key(id) {
                    m.membership.inc(&[role_name(*role), "leave"]);
                }
            }
            known = now;
            if nodes.changed().await.is_err() {
                return;
            }
        }
    });
}

/// The router's metrics now, with `nodes` (live prefill, decode) counts and `queued` (requests without a
/// first token, and their bound).
pub(crate) fn render(nodes: (u32, u32), queued: (usize, usize)) -> String {
    let m = router();
    let mut e = Exposition::default();
    e.histogram(
        "tandem:time_to_first_token_seconds",
        "Time from the request reaching the router to its first token.",
        &m.ttft,
    );
    e.histogram(
        "tandem:inter_token_latency_seconds",
        "Time between streamed token messages.",
        &m.itl,
    );
    e.histogram(
        "tandem:e2e_request_latency_seconds",
        "Time from the request reaching the router to its last token.",
        &m.e2e,
    );
    e.counters(
        "tandem:request_success_total",
        "Finished requests by finish reason.",
        &m.success,
    );
    e.counter(
        "tandem:prompt_tokens_total",
        "Prompt tokens of finished requests.",
        m.prompt_tokens.get(),
    );
    e.counter(
        "tandem:generation_tokens_total",
        "Generated tokens of finished requests.",
        m.generation_tokens.get(),
    );
    e.gauge(
        "tandem:requests_running",
        "Requests being relayed now.",
        m.running.get() as f64,
    );
    e.gauge(
        "tandem:requests_queued",
        "Requests admitted and without a first token, as --max-waiting-requests bounds them.",
        queued.0 as f64,
    );
    e.gauge(
        "tandem:requests_queued_limit",
        "The bound on tandem:requests_queued (--max-waiting-requests).",
        queued.1 as f64,
    );
    e.counters(
        "tandem:requests_rejected_total",
        "Requests refused or ended by overload protection, by reason (queue_full, nodes_full, deadline, queue_time).",
        &m.rejected,
    );
    e.counters(
        "tandem:request_migrations_total",
        "Requests re-issued to another decode node after theirs failed mid-stream, by cause (stream_error, stream_ended, left_membership).",
        &m.migrations,
    );
    e.counters(
        "tandem:routing_decisions_total",
        "Requests routed, by policy and whether a prefill node was chosen.",
        &m.routing,
    );
    e.counters(
        "tandem:membership_changes_total",
        "Nodes joining and leaving membership.",
        &m.membership,
    );
    e.gauges(
        "tandem:nodes",
        "Live nodes by role.",
        "role",
        &[
            ("prefill", f64::from(nodes.0)),
            ("decode", f64::from(nodes.1)),
        ],
    );
    e.finish()
}
