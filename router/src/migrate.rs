//! Request migration: when the decode node serving a stream fails mid-stream, the router re-issues the
//! request to another decode node — the prompt followed by every token already streamed, marked as
//! output (`DecodeRequest.generated`) — and the client's stream goes on from the next token.
//!
//! A node counts as failed when its stream ends with a transport-like status (UNAVAILABLE, UNKNOWN,
//! CANCELLED: a dead process or a reset connection), with INTERNAL (its engine failed), or without a
//! finish reason; or when it left membership (its lease expired) and then refuses connections or
//! stays silent on the stream for [`SILENT_AFTER_LEAVING`] (a hung or cut-off node). A node that left
//! membership and keeps streaming is draining: its streams are left to finish. A failed node is
//! quarantined (see [`crate::Router`]) so new requests avoid it before its lease expires.
//!
//! Invariants:
//! - A migrated stream never repeats or skips a token: the continuation asks for exactly the tokens
//!   after the last one relayed, and its node replays the detokenizer and stop strings over the
//!   streamed tokens, so its text continues the text the client has (see
//!   `Engine::add_resumed_request`). Greedy output equals the uninterrupted run's.
//! - `max_tokens` of a continuation counts only what is left; usage in the last message counts the
//!   original prompt and every token streamed, whichever nodes produced them.
//! - At most `--max-migrations` re-issues per request (each counted in
//!   `tandem:request_migrations_total`), each to a decode node this request has not used yet; then
//!   the stream ends with UNAVAILABLE. Statuses that say the request itself is at fault
//!   (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) end it at once.
//! - Sampled requests (temperature > 0) continue with the streamed tokens as their history and the
//!   seeded RNG where a single engine would be, but are not promised to equal the uninterrupted run.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tandem_membership::{NodeInfo, NodeRole};
use tandem_node::NodeError;
use tandem_proto::node::v1 as node;
use tandem_proto::v1 as api;
use tokio_stream::StreamExt;
use tonic::{Code, Status};

use crate::{Router, policy};

/// `--max-migrations` when not given: re-issues per request after decode-node failures.
pub const DEFAULT_MAX_MIGRATIONS: u32 = 2;

/// How long a node that left membership may take to accept a connection before it counts as dead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a node that left membership but still accepts connections (draining) is probed again.
const PROBE_EVERY: Duration = Duration::from_secs(2);

/// How long a node that left membership may stay silent on a stream before it counts as failed (a
/// draining node streams on; a hung or cut-off one does not).
pub(crate) const SILENT_AFTER_LEAVING: Duration = Duration::from_secs(10);

/// Why a stream moved to another node.
#[derive(Debug, Clone)]
pub(crate) enum Cause {
    /// The stream ended with a status that says the node failed.
    Failed(Status),
    /// The stream ended without a finish reason.
    EndedEarly,
    /// The node left membership and refuses connections or stays silent.
    LeftMembership,
}

impl Cause {
    /// The `cause` label of `tandem:request_migrations_total`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Cause::Failed(_) => "stream_error",
            Cause::EndedEarly => "stream_ended",
            Cause::LeftMembership => "left_membership",
        }
    }

    /// Whether the node should be skipped by new requests for a while (its process or connection is
    /// gone, not just one request failing inside it).
    fn quarantines(&self) -> bool {
        !matches!(self, Cause::Failed(s) if matches!(s.code(), Code::Internal | Code::ResourceExhausted))
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Failed(s) => write!(f, "{:?}: {}", s.code(), s.message()),
            Cause::EndedEarly => f.write_str("its stream ended without a finish reason"),
            Cause::LeftMembership => f.write_str("it left membership and refuses connections or stays silent"),
        }
    }
}

/// Whether a status on a decode node's stream says the node failed (so another may continue).
pub(crate) fn node_failed(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Internal)
}

/// What the router knows of a request's output so far: enough to continue it on another node.
#[derive(Debug, Clone)]
pub(crate) struct Continuation {
    request_id: String,
    /// The routed prompt's token ids.
    prompt: Vec<u32>,
    /// The routed sampling parameters.
    sampling: api::SamplingParams,
    /// The request's `max_tokens`, resolved (the engine's default when the client left it unset).
    max_tokens: u32,
    /// Every token id relayed to the client, in order (at most `max_tokens`).
    streamed: Vec<u32>,
    /// Re-issues so far.
    migrations: u32,
}

impl Continuation {
    /// A request routed with `prompt` and `sampling`, whose `max_tokens` resolves to `max_tokens`.
    pub(crate) fn new(request_id: String, prompt: Vec<u32>, sampling: api::SamplingParams, max_tokens: u32) -> Continuation {
        Continuation { request_id, prompt, sampling, max_tokens, streamed: Vec::new(), migrations: 0 }
    }

    /// Records a message as relayed to the client. Beyond `max_tokens` nothing more is kept (a node that
    /// sends more cannot be continued; [`Self::resume`] refuses).
    pub(crate) fn observe(&mut self, msg: &api::GenerateResponse) {
        let room = (self.max_tokens as usize).saturating_sub(self.streamed.len());
        if msg.token_ids.len() > room {
            self.streamed.extend_from_slice(&msg.token_ids[..room]);
            self.max_tokens = 0; // poisoned: never resumed
        } else {
            self.streamed.extend_from_slice(&msg.token_ids);
        }
    }

    /// Fixes the usage of the last message of a migrated request: the original prompt and every token
    /// streamed, whichever nodes produced them (a node counts only its own view).
    pub(crate) fn finish(&self, msg: &mut api::GenerateResponse) {
        if self.migrations == 0 {
            return;
        }
        let prompt_tokens = self.prompt.len() as u32;
        let usage = msg.usage.get_or_insert_with(api::Usage::default);
        usage.prompt_tokens = prompt_tokens;
        usage.completion_tokens = self.streamed.len() as u32;
        usage.cached_tokens = usage.cached_tokens.min(prompt_tokens);
    }

    /// Re-issues made so far.
    pub(crate) fn migrations(&self) -> u32 {
        self.migrations
    }

    /// Tokens relayed so far.
    pub(crate) fn streamed(&self) -> usize {
        self.streamed.len()
    }

    /// The request that continues the stream on another node (counted as one more migration): the
    /// prompt followed by the streamed tokens, `generated` naming how many of them are output, and
    /// `max_tokens` what is left. A stream with nothing streamed yet is re-issued as it was routed,
    /// through `prefill_addr`; a continued one prefills on its new decode node (whose engine alone
    /// knows the streamed tokens are output).
    pub(crate) fn resume(&mut self, prefill_addr: String) -> Result<node::DecodeRequest, NodeError> {
        let left = (self.max_tokens as usize).checked_sub(self.streamed.len()).filter(|&l| l > 0).ok_or_else(|| {
            NodeError::Internal(format!(
                "the decode node streamed {} tokens of {} without finishing; the stream cannot be continued",
                self.streamed.len(),
                self.max_tokens
            ))
        })?;
        self.migrations += 1;
        let mut sampling = self.sampling.clone();
        sampling.max_tokens = Some(left as u32);
        let generated = self.streamed.len() as u32;
        Ok(node::DecodeRequest {
            request_id: self.request_id.clone(),
            prompt: self.prompt.iter().chain(&self.streamed).copied().collect(),
            sampling: Some(sampling),
            prefill_addr: if generated == 0 { prefill_addr } else { String::new() },
            generated,
        })
    }
}

/// A decode node's stream that moves to another decode node when its node fails.
pub(crate) struct Upstream {
    router: Router,
    model: String,
    cont: Continuation,
    stream: tonic::Streaming<api::GenerateResponse>,
    node: NodeInfo,
    /// Decode nodes this request has used.
    tried: Vec<String>,
    /// Resolves when `node` left membership and refuses connections or stays silent.
    gone: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// When `node` last sent a message (read by `gone`).
    heard: tokio::sync::watch::Sender<tokio::time::Instant>,
    /// The caller's deadline (the continuation's `grpc-timeout`).
    deadline: Option<tokio::time::Instant>,
    span: tracing::Span,
    finished: bool,
}

/// Where an opened stream came from, for [`Upstream::new`].
pub(crate) struct Origin {
    pub(crate) model: String,
    pub(crate) node: NodeInfo,
    pub(crate) deadline: Option<tokio::time::Instant>,
    pub(crate) span: tracing::Span,
}

impl Upstream {
    /// The stream `node` opened for the request `cont` describes.
    pub(crate) fn new(router: Router, origin: Origin, cont: Continuation, stream: tonic::Streaming<api::GenerateResponse>) -> Upstream {
        let (heard, last) = tokio::sync::watch::channel(tokio::time::Instant::now());
        let gone = watch_gone(router.clone(), origin.node.clone(), last);
        Upstream {
            router,
            model: origin.model,
            cont,
            stream,
            tried: vec![origin.node.id.clone()],
            node: origin.node,
            gone,
            heard,
            deadline: origin.deadline,
            span: origin.span,
            finished: false,
        }
    }

    /// The next message for the client, continuing on another node when this one fails; `None` after
    /// the last message.
    pub(crate) async fn next(&mut self) -> Option<Result<api::GenerateResponse, Status>> {
        if self.finished {
            return None;
        }
        loop {
            let cause = tokio::select! {
                item = self.stream.next() => match item {
                    Some(Ok(mut msg)) => {
                        self.heard.send_replace(tokio::time::Instant::now());
                        self.cont.observe(&msg);
                        if msg.finish_reason != api::FinishReason::Unspecified as i32 {
                            self.finished = true;
                            self.cont.finish(&mut msg);
                        }
                        return Some(Ok(msg));
                    }
                    Some(Err(s)) if node_failed(s.code()) => Cause::Failed(s),
                    Some(Err(s)) => {
                        self.finished = true;
                        return Some(Err(s));
                    }
                    None => Cause::EndedEarly,
                },
                () = &mut self.gone => Cause::LeftMembership,
            };
            if let Err(s) = self.migrate(cause).await {
                self.finished = true;
                return Some(Err(s));
            }
        }
    }

    /// Moves the request off the failed node onto another, or says why it cannot.
    async fn migrate(&mut self, mut cause: Cause) -> Result<(), Status> {
        loop {
            let failed = self.node.id.clone();
            if cause.quarantines() {
                self.router.quarantine(&failed);
            }
            tracing::warn!(
                parent: &self.span,
                request_id = %self.cont.request_id,
                decode = %failed,
                streamed = self.cont.streamed(),
                %cause,
                "decode node failed mid-stream"
            );
            let max = self.router.max_migrations();
            if self.cont.migrations() >= max {
                return Err(Status::unavailable(format!(
                    "decode node {failed} failed mid-request ({cause}); gave up after {max} migrations"
                )));
            }
            let Some((decode, prefill)) = self.pick() else {
                return Err(Status::unavailable(format!(
                    "decode node {failed} failed mid-request ({cause}) and no other decode node of {} is available",
                    self.model
                )));
            };
            let call = self.cont.resume(prefill.map(|p| p.grpc_addr).unwrap_or_default()).map_err(Status::from)?;
            crate::metrics::router().migrations.inc(&[cause.label()]);
            self.tried.push(decode.id.clone());
            tracing::info!(
                parent: &self.span,
                request_id = %self.cont.request_id,
                from = %failed,
                to = %decode.id,
                resumed_tokens = call.generated,
                migration = self.cont.migrations(),
                "migrating the request"
            );
            self.span.record("decode_node", decode.id.as_str());
            match self.router.call_decode(&decode, call, self.deadline, &self.span).await {
                Ok(stream) => {
                    self.stream = stream;
                    let (heard, last) = tokio::sync::watch::channel(tokio::time::Instant::now());
                    self.heard = heard;
                    self.gone = watch_gone(self.router.clone(), decode.clone(), last);
                    self.node = decode;
                    return Ok(());
                }
                Err(e) => {
                    let s = Status::from(e);
                    if !node_failed(s.code()) && s.code() != Code::ResourceExhausted {
                        return Err(s);
                    }
                    self.node = decode;
                    cause = Cause::Failed(s);
                }
            }
        }
    }

    /// The least loaded live decode node of the model this request has not used, and for a request
    /// that has streamed nothing yet, the least loaded prefill node.
    fn pick(&self) -> Option<(NodeInfo, Option<NodeInfo>)> {
        let nodes = self.router.live();
        let of = |role: NodeRole| -> Vec<&NodeInfo> {
            nodes.iter().filter(|n| n.model == self.model && n.role == role && !self.tried.contains(&n.id)).collect()
        };
        let decode = policy::least_load(&of(NodeRole::Decode))?.clone();
        let prefill = if self.cont.streamed() == 0 { policy::least_load(&of(NodeRole::Prefill)).cloned() } else { None };
        Some((decode, prefill))
    }
}

/// Resolves once `node` is out of the router's membership snapshot and either does not accept a TCP
/// connection within [`PROBE_TIMEOUT`] or sent nothing (`heard`: when it last did) for
/// [`SILENT_AFTER_LEAVING`] since it left or last spoke, whichever is later; probed every
/// [`PROBE_EVERY`] while it stays out. Never resolves once membership is gone (the router stops).
fn watch_gone(router: Router, node: NodeInfo, heard: tokio::sync::watch::Receiver<tokio::time::Instant>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        let mut nodes = router.inner.nodes.clone();
        let listed = |ns: &Vec<NodeInfo>| ns.iter().any(|n| n.id == node.id);
        loop {
            let left = nodes.wait_for(|ns| !listed(ns)).await.map(|_| ());
            if left.is_err() {
                return std::future::pending().await;
            }
            let left_at = tokio::time::Instant::now();
            while !listed(&nodes.borrow_and_update()) {
                if !accepts(&node.grpc_addr).await {
                    return;
                }
                let quiet_until = left_at.max(*heard.borrow()) + SILENT_AFTER_LEAVING;
                let now = tokio::time::Instant::now();
                if now >= quiet_until {
                    return;
                }
                tokio::time::sleep(PROBE_EVERY.min(quiet_until - now)).await;
            }
        }
    })
}

/// Whether `addr` accepts a TCP connection within [`PROBE_TIMEOUT`].
async fn accepts(addr: &str) -> bool {
    matches!(tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await, Ok(Ok(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tokens: &[u32], finish: api::FinishReason) -> api::GenerateResponse {
        api::GenerateResponse { token_ids: tokens.to_vec(), finish_reason: finish as i32, ..Default::default() }
    }

    fn sampling(max_tokens: Option<u32>) -> api::SamplingParams {
        api::SamplingParams { max_tokens, temperature: Some(0.0), stop: vec!["\n\n".into()], ..Default::default() }
    }

    #[test]
    fn a_continuation_asks_for_exactly_the_tokens_after_the_last_one_relayed() {
        let mut c = Continuation::new("r1".into(), vec![1, 2, 3], sampling(Some(10)), 10);
        c.observe(&msg(&[7], api::FinishReason::Unspecified));
        c.observe(&msg(&[8, 9], api::FinishReason::Unspecified));
        c.observe(&msg(&[], api::FinishReason::Unspecified)); // a message without tokens
        let req = c.resume("prefill:1".into()).unwrap();
        assert_eq!(req.request_id, "r1");
        assert_eq!(req.prompt, [1, 2, 3, 7, 8, 9]);
        assert_eq!(req.generated, 3);
        let s = req.sampling.unwrap();
        assert_eq!(s.max_tokens, Some(7), "max_tokens less what was streamed");
        assert_eq!((s.temperature, s.stop), (Some(0.0), vec!["\n\n".to_string()]), "the rest of the sampling unchanged");
        assert!(req.prefill_addr.is_empty(), "a continuation prefills on its decode node");
        assert_eq!(c.migrations(), 1);
        // A second failure continues from everything streamed, over both nodes.
        c.observe(&msg(&[10], api::FinishReason::Unspecified));
        let req = c.resume(String::new()).unwrap();
        assert_eq!((req.prompt.len(), req.generated, req.sampling.unwrap().max_tokens), (7, 4, Some(6)));
        assert_eq!(c.migrations(), 2);
    }

    #[test]
    fn a_stream_that_streamed_nothing_is_reissued_as_routed() {
        let mut c = Continuation::new("r".into(), vec![5, 6], sampling(None), 256);
        let req = c.resume("prefill:1".into()).unwrap();
        assert_eq!((req.prompt, req.generated, req.prefill_addr.as_str()), (vec![5, 6], 0, "prefill:1"));
        assert_eq!(req.sampling.unwrap().max_tokens, Some(256), "the resolved default, explicit");
    }

    #[test]
    fn usage_counts_the_original_prompt_and_every_streamed_token_once_migrated() {
        let mut c = Continuation::new("r".into(), vec![1, 2, 3, 4], sampling(Some(5)), 5);
        let mut last = msg(&[9], api::FinishReason::Length);
        last.usage = Some(api::Usage { prompt_tokens: 4, completion_tokens: 1, cached_tokens: 0 });
        let unmigrated = last.clone();
        c.finish(&mut last);
        assert_eq!(last, unmigrated, "an unmigrated stream's usage is the node's");
        c.observe(&msg(&[7, 8], api::FinishReason::Unspecified));
        c.resume(String::new()).unwrap();
        c.observe(&msg(&[9, 10], api::FinishReason::Unspecified));
        // The new node counted the streamed tokens as prompt (a node that predates `generated`).
        let mut last = msg(&[11], api::FinishReason::Length);
        last.usage = Some(api::Usage { prompt_tokens: 6, completion_tokens: 3, cached_tokens: 6 });
        c.observe(&last);
        c.finish(&mut last);
        assert_eq!(last.usage, Some(api::Usage { prompt_tokens: 4, completion_tokens: 5, cached_tokens: 4 }));
    }

    #[test]
    fn a_stream_with_nothing_left_or_too_many_tokens_cannot_be_continued() {
        let mut c = Continuation::new("r".into(), vec![1], sampling(Some(2)), 2);
        c.observe(&msg(&[4, 5], api::FinishReason::Unspecified));
        assert!(matches!(c.resume(String::new()), Err(NodeError::Internal(_))));
        let mut c = Continuation::new("r".into(), vec![1], sampling(Some(2)), 2);
        c.observe(&msg(&[4, 5, 6, 7], api::FinishReason::Unspecified));
        assert_eq!(c.streamed(), 2, "nothing kept beyond max_tokens");
        assert!(c.resume(String::new()).is_err());
        assert_eq!(c.migrations(), 0, "a refused continuation is no migration");
    }

    #[test]
    fn only_failures_of_the_node_move_a_stream() {
        for code in [Code::Unavailable, Code::Unknown, Code::Cancelled, Code::Internal] {
            assert!(node_failed(code), "{code:?}");
        }
        for code in [Code::InvalidArgument, Code::DeadlineExceeded, Code::ResourceExhausted, Code::NotFound, Code::PermissionDenied] {
            assert!(!node_failed(code), "{code:?}");
        }
        assert!(!Cause::Failed(Status::internal("engine step failed")).quarantines());
        assert!(!Cause::Failed(Status::resource_exhausted("queue full")).quarantines());
        assert!(Cause::Failed(Status::unavailable("reset")).quarantines());
        assert!(Cause::LeftMembership.quarantines());
    }
}
