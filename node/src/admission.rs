//! Overload protection shared by the router and the nodes: a bounded count of accepted requests that
//! have not started yet ([`Gate`]), and per-request deadlines from gRPC's `grpc-timeout`
//! ([`grpc_timeout`]).
//!
//! A request holds a [`Waiting`] permit from the moment it is accepted until it starts (a decode node:
//! its first token is sent; a prefill node: its prompt is computed; the router: its first token
//! arrived) or ends. Past the bound, [`Gate::enter`] refuses at once with RESOURCE_EXHAUSTED instead of
//! queueing: nothing is held for a refused request.
//!
//! Invariants:
//! - [`Gate::waiting`] equals the number of live [`Waiting`] permits that have not started; it never
//!   exceeds the limit (the count is reserved with one atomic compare-and-swap before a permit exists).
//! - A permit is given back exactly once: by [`Waiting::started`] or by its drop.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::NodeError;

/// Default `--max-waiting-requests` of a prefill or decode node.
pub const DEFAULT_NODE_MAX_WAITING: usize = 256;

/// Limits of a node (or the router).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most requests accepted and not yet started; one more is refused (RESOURCE_EXHAUSTED).
    pub max_waiting: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_waiting: DEFAULT_NODE_MAX_WAITING }
    }
}

/// A bounded count of accepted requests that have not started. Cheap to clone (shared count).
#[derive(Debug, Clone)]
pub struct Gate {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    limit: usize,
    waiting: AtomicUsize,
}

impl Gate {
    /// A gate admitting at most `limits.max_waiting` waiting requests.
    pub fn new(limits: Limits) -> Gate {
        Gate { inner: Arc::new(Inner { limit: limits.max_waiting, waiting: AtomicUsize::new(0) }) }
    }

    /// Accepts one more waiting request, or refuses with [`NodeError::Overloaded`] when
    /// [`Self::limit`] are waiting already.
    pub fn enter(&self) -> Result<Waiting, NodeError> {
        let limit = self.inner.limit;
        self.inner
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| (w < limit).then_some(w + 1))
            .map_err(|w| NodeError::Overloaded(format!("{w} requests are waiting already (--max-waiting-requests {limit}); retry later")))?;
        Ok(Waiting { gate: Some(Arc::clone(&self.inner)) })
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Acquire)
    }

    /// The bound.
    pub fn limit(&self) -> usize {
        self.inner.limit
    }
}

/// One accepted request that has not started; gives its place back when started or dropped.
#[derive(Debug)]
pub struct Waiting {
    gate: Option<Arc<Inner>>,
}

impl Waiting {
    /// The request started: it no longer counts as waiting (idempotent).
    pub fn started(&mut self) {
        if let Some(g) = self.gate.take() {
            g.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.started();
    }
}

/// The `grpc-timeout` a caller sent (gRPC over HTTP/2: 1 to 8 digits and a unit `H`, `M`, `S`, `m`,
/// `u` or `n`). Absent → `Ok(None)`; malformed → INVALID_ARGUMENT.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Result<Option<Duration>, NodeError> {
    let Some(v) = metadata.get("grpc-timeout") else { return Ok(None) };
    let bad = || NodeError::InvalidArgument("grpc-timeout must be 1 to 8 digits and a unit (H, M, S, m, u, n)".into());
    let s = v.to_str().map_err(|_| bad())?;
    parse_grpc_timeout(s).map(Some).ok_or_else(bad)
}

/// Parses a `grpc-timeout` value.
pub fn parse_grpc_timeout(s: &str) -> Option<Duration> {
    let unit = s.chars().last()?;
    let digits = &s[..s.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// When a request's deadline passes: `timeout` from `start`, if the caller set one.
pub fn deadline_after(start: tokio::time::Instant, timeout: Option<Duration>) -> Option<tokio::time::Instant> {
    timeout.map(|t| start + t)
}

/// Resolves at `deadline`, or never without one.
pub async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_refuses_past_its_limit_and_counts_each_permit_once() {
        let gate = Gate::new(Limits { max_waiting: 2 });
        let mut a = gate.enter().unwrap();
        let b = gate.enter().unwrap();
        assert_eq!(gate.waiting(), 2);
        let refused = gate.enter().unwrap_err();
        assert_eq!(tonic::Status::from(refused).code(), tonic::Code::ResourceExhausted);
        assert_eq!(gate.waiting(), 2, "a refusal holds nothing");
        a.started();
        a.started();
        assert_eq!(gate.waiting(), 1, "started twice gives back once");
        let c = gate.enter().unwrap();
        drop(a);
        assert_eq!(gate.waiting(), 2, "dropping a started permit gives back nothing more");
        drop((b, c));
        assert_eq!(gate.waiting(), 0);
    }

    #[test]
    fn a_zero_limit_refuses_everything() {
        let gate = Gate::new(Limits { max_waiting: 0 });
        assert!(gate.enter().is_err());
        assert_eq!(gate.waiting(), 0);
    }

    #[test]
    fn concurrent_entries_never_pass_the_limit() {
        let gate = Gate::new(Limits { max_waiting: 7 });
        let admitted = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..2000 {
                        if let Ok(p) = gate.enter() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            peak.fetch_max(gate.waiting(), Ordering::Relaxed);
                            drop(p);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Relaxed) <= 7);
        assert!(admitted.load(Ordering::Relaxed) > 0);
        assert_eq!(gate.waiting(), 0);
    }

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("30S"), Some(Duration::from_secs(30)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("99999999u"), Some(Duration::from_micros(99_999_999)));
        assert_eq!(parse_grpc_timeout("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "S", "100", "123456789S", "1s", "-1S", "1.5S", "1 S", "é"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
        let mut m = tonic::metadata::MetadataMap::new();
        assert!(grpc_timeout(&m).unwrap().is_none());
        m.insert("grpc-timeout", "12x".parse().unwrap());
        assert_eq!(tonic::Status::from(grpc_timeout(&m).unwrap_err()).code(), tonic::Code::InvalidArgument);
        m.insert("grpc-timeout", "12m".parse().unwrap());
        assert_eq!(grpc_timeout(&m).unwrap(), Some(Duration::from_millis(12)));
    }
}
