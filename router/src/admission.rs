//! Overload protection at the router: a bounded number of requests without a first token, decode
//! nodes that reported a full queue skipped, and per-request deadlines.
//!
//! - At most `--max-waiting-requests` requests are admitted and without a first token; one more is
//!   refused at once with RESOURCE_EXHAUSTED (HTTP 429) before anything is tokenized or routed.
//! - A decode node whose published load says its queue is full (`waiting >= max_waiting`) gets no
//!   request; when every decode node of the model is full, the request is refused the same way. A
//!   prefill node that is full is skipped (the decode node prefills instead). The nodes enforce their
//!   own bounds too, so a burst that outruns the published load (~200 ms old) is still bounded there.
//! - A request ends with DEADLINE_EXCEEDED (HTTP 504) when the caller's `grpc-timeout` passes, or when
//!   it has no first token `--max-queue-time-ms` after reaching the router. Ending it drops its relay,
//!   which cancels the request on every node (blocks freed, transfer cancelled).
//!
//! Invariants: [`Admitted`] holds its place among the waiting requests until its first token arrives
//! or it is dropped, exactly once; the router's deadline of a gRPC call falls [`DEADLINE_MARGIN`]
//! before the caller's, so the caller sees DEADLINE_EXCEEDED rather than the CANCELLED tonic
//! answers for an unfinished handler at the caller's deadline.

use std::ops::Deref;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tandem_membership::NodeInfo;
use tandem_node::NodeError;
use tandem_node::admission::{Gate, Waiting};
use tandem_proto::v1 as api;
use tokio::time::{Instant, Sleep};
use tokio_stream::Stream;
use tonic::Status;

use crate::Relay;
use crate::metrics;

/// Default `--max-waiting-requests` of the router.
pub const DEFAULT_MAX_WAITING: usize = 512;

/// How much earlier than the caller's `grpc-timeout` the router ends a gRPC request.
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(2);

/// The router's overload limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most requests admitted and without a first token (`--max-waiting-requests`).
    pub max_waiting: usize,
    /// Longest a request may wait for its first token (`--max-queue-time-ms`); `None`: no limit.
    pub max_queue_time: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_waiting: DEFAULT_MAX_WAITING, max_queue_time: None }
    }
}

/// What the router admits by.
#[derive(Debug)]
pub(crate) struct Admission {
    now: Mutex<(Gate, Option<Duration>)>,
}

impl Default for Admission {
    fn default() -> Self {
        Admission::new(Limits::default())
    }
}

/// Refusal reasons, as `tandem:requests_rejected_total{reason}` counts them.
pub(crate) mod reason {
    /// The router's own bound on waiting requests.
    pub(crate) const QUEUE_FULL: &str = "queue_full";
    /// Every decode node reported a full queue (or answered RESOURCE_EXHAUSTED).
    pub(crate) const NODES_FULL: &str = "nodes_full";
    /// The caller's grpc-timeout passed.
    pub(crate) const DEADLINE: &str = "deadline";
    /// No first token within --max-queue-time-ms.
    pub(crate) const QUEUE_TIME: &str = "queue_time";
}

impl Admission {
    pub(crate) fn new(limits: Limits) -> Admission {
        Admission { now: Mutex::new(Self::state(limits)) }
    }

    fn state(limits: Limits) -> (Gate, Option<Duration>) {
        (Gate::new(tandem_node::admission::Limits { max_waiting: limits.max_waiting }), limits.max_queue_time)
    }

    /// Replaces the limits (requests admitted before keep their places in the old count).
    pub(crate) fn set(&self, limits: Limits) {
        *crate::lock(&self.now) = Self::state(limits);
    }

    /// A place among the waiting requests and the queue-time limit, or RESOURCE_EXHAUSTED.
    pub(crate) fn enter(&self) -> Result<(Waiting, Option<Duration>), NodeError> {
        let now = crate::lock(&self.now);
        let waiting = now.0.enter().inspect_err(|_| metrics::rejected(reason::QUEUE_FULL))?;
        Ok((waiting, now.1))
    }

    /// Requests admitted and without a first token now, and the bound.
    pub(crate) fn waiting(&self) -> (usize, usize) {
        let now = crate::lock(&self.now);
        (now.0.waiting(), now.0.limit())
    }
}

/// Whether a node's published load says its queue is full.
pub(crate) fn full(n: &NodeInfo) -> bool {
    n.load.max_waiting > 0 && n.load.waiting >= n.load.max_waiting
}

/// The decode nodes that can take a request: those whose queue is not full. Empty in, empty out (no
/// node is UNAVAILABLE, decided by the caller); every one full is RESOURCE_EXHAUSTED.
pub(crate) fn open_decoders<'a>(model: &str, decoders: Vec<&'a NodeInfo>) -> Result<Vec<&'a NodeInfo>, NodeError> {
    if decoders.is_empty() {
        return Ok(decoders);
    }
    let open: Vec<&NodeInfo> = decoders.iter().copied().filter(|n| !full(n)).collect();
    if open.is_empty() {
        metrics::rejected(reason::NODES_FULL);
        return Err(NodeError::Overloaded(format!(
            "every decode node of {model} has a full queue ({} of them); retry later",
            decoders.len()
        )));
    }
    Ok(open)
}

/// The deadline of a gRPC call whose caller sent `grpc-timeout` (see [`DEADLINE_MARGIN`]).
pub(crate) fn call_deadline(arrived: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| arrived + t.saturating_sub(DEADLINE_MARGIN))
}

/// The error of a request whose deadline passed, counted under `why`.
pub(crate) fn expired(why: &'static str) -> NodeError {
    metrics::rejected(why);
    NodeError::DeadlineExceeded(if why == reason::QUEUE_TIME {
        "the request had no first token within the router's maximum queue time (--max-queue-time-ms)".into()
    } else {
        "the request's deadline (grpc-timeout) passed".into()
    })
}

/// The earlier of two optional deadlines, with the reason it stands for.
pub(crate) fn earliest(deadline: Option<Instant>, queue: Option<Instant>) -> Option<(Instant, &'static str)> {
    match (deadline, queue) {
        (Some(d), Some(q)) if q < d => Some((q, reason::QUEUE_TIME)),
        (Some(d), _) => Some((d, reason::DEADLINE)),
        (None, Some(q)) => Some((q, reason::QUEUE_TIME)),
        (None, None) => None,
    }
}

/// An admitted, opened request: the relay, its place among the waiting requests until its first
/// token, and its deadlines. Every front end consumes this stream.
pub(crate) struct Admitted {
    relay: Relay,
    waiting: Option<Waiting>,
    deadline: Option<Instant>,
    /// Until the first token.
    queue_deadline: Option<Instant>,
    timer: Option<(Pin<Box<Sleep>>, &'static str)>,
    ended: bool,
}

impl Admitted {
    pub(crate) fn new(relay: Relay, waiting: Waiting, deadline: Option<Instant>, queue_deadline: Option<Instant>) -> Admitted {
        let mut a = Admitted { relay, waiting: Some(waiting), deadline, queue_deadline, timer: None, ended: false };
        a.arm();
        a
    }

    fn arm(&mut self) {
        self.timer = earliest(self.deadline, self.queue_deadline).map(|(at, why)| (Box::pin(tokio::time::sleep_until(at)), why));
    }
}

impl Deref for Admitted {
    type Target = Relay;
    fn deref(&self) -> &Relay {
        &self.relay
    }
}

impl Stream for Admitted {
    type Item = Result<api::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Some((timer, why)) = self.timer.as_mut()
            && timer.as_mut().poll(cx).is_ready()
        {
            let why = *why;
            self.ended = true;
            return Poll::Ready(Some(Err(Status::from(expired(why)))));
        }
        let item = ready!(Pin::new(&mut self.relay).poll_next(cx));
        match &item {
            Some(Ok(msg)) if !msg.token_ids.is_empty() || msg.finish_reason != 0 => {
                if let Some(mut w) = self.waiting.take() {
                    w.started();
                }
                if self.queue_deadline.take().is_some() {
                    self.arm();
                }
            }
            Some(Ok(_)) => {}
            Some(Err(_)) | None => self.ended = true,
        }
        Poll::Ready(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_membership::{Load, NodeRole};

    fn node(id: &str, waiting: u32, max_waiting: u32) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            role: NodeRole::Decode,
            model: "m".into(),
            grpc_addr: format!("{id}:1"),
            kv_endpoint: String::new(),
            load: Load { waiting, running: 0, free_blocks: 1, total_blocks: 1, max_waiting },
        }
    }

    #[test]
    fn full_decode_nodes_are_skipped_and_all_full_is_resource_exhausted() {
        let (a, b, old) = (node("a", 4, 4), node("b", 3, 4), node("old", 1000, 0));
        assert!(full(&a) && !full(&b) && !full(&old), "0 = an unpublished bound, never full");
        let open = open_decoders("m", vec![&a, &b, &old]).unwrap();
        assert_eq!(open.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(), ["b", "old"]);
        assert!(open_decoders("m", vec![]).unwrap().is_empty(), "no node at all is the caller's UNAVAILABLE");
        let e = open_decoders("m", vec![&a, &node("c", 9, 2)]).unwrap_err();
        assert_eq!(Status::from(e).code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn the_router_bound_refuses_at_once_and_frees_on_drop() {
        let adm = Admission::new(Limits { max_waiting: 1, max_queue_time: Some(Duration::from_millis(7)) });
        let (w, q) = adm.enter().unwrap();
        assert_eq!(q, Some(Duration::from_millis(7)));
        assert_eq!(adm.waiting(), (1, 1));
        assert_eq!(Status::from(adm.enter().unwrap_err()).code(), tonic::Code::ResourceExhausted);
        drop(w);
        assert_eq!(adm.waiting(), (0, 1));
        adm.set(Limits { max_waiting: 3, max_queue_time: None });
        assert_eq!(adm.waiting(), (0, 3));
        assert_eq!(adm.enter().unwrap().1, None);
    }

    #[test]
    fn the_earlier_deadline_decides_and_names_its_reason() {
        let t = Instant::now();
        let (d, q) = (Some(t + Duration::from_secs(2)), Some(t + Duration::from_secs(1)));
        assert_eq!(earliest(d, q), Some((t + Duration::from_secs(1), reason::QUEUE_TIME)));
        assert_eq!(earliest(q, d), Some((t + Duration::from_secs(1), reason::DEADLINE)));
        assert_eq!(earliest(d, None), Some((t + Duration::from_secs(2), reason::DEADLINE)));
        assert_eq!(earliest(None, q), Some((t + Duration::from_secs(1), reason::QUEUE_TIME)));
        assert_eq!(earliest(None, None), None);
        assert_eq!(call_deadline(t, Some(Duration::from_secs(1))), Some(t + Duration::from_millis(998)));
        assert_eq!(call_deadline(t, Some(Duration::from_millis(1))), Some(t), "never before arrival");
        assert_eq!(call_deadline(t, None), None);
        assert_eq!(Status::from(expired(reason::DEADLINE)).code(), tonic::Code::DeadlineExceeded);
    }
}
