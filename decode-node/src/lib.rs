//! The decode node: for each request it allocates the prompt's blocks after its own prefix-cache hits,
//! registers them as a KV transfer's destination, asks a prefill node to compute and push the rest, and
//! once every layer landed and verified, decodes and streams tokens. Short uncached prompts (below a
//! threshold), requests without a prefill node, and requests whose prefill node fails are prefilled here.
//!
//! Invariants:
//! - Every request runs in its own task that owns its engine request and its transfer; however it ends
//!   (finished, client gone, prefill failure) the transfer is cancelled and awaited before the engine
//!   frees the blocks, so no backend writes into reused blocks.
//! - A client that goes away aborts the request within one engine step.
//! - A migrated request (`DecodeRequest.generated` > 0: its last prompt ids are output another node
//!   already streamed) is prefilled here, never remotely, and its usage counts those ids as output.
//! - At most `--max-waiting-requests` requests are accepted and without a first token; one more is
//!   refused at once with RESOURCE_EXHAUSTED, holding nothing. A request whose `grpc-timeout` passes
//!   ends with DEADLINE_EXCEEDED and is cleaned up like a cancelled one (transfer cancelled, blocks
//!   freed, the prefill call dropped). A remote allocation that does not fit the pool now waits for
//!   blocks instead of failing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::sched::{RequestId, Role};
use tandem_engine::sampling::SamplingParams;
use tandem_kv_transfer::{Fabric, RecvHandle};
use tandem_node::{Event, NodeCore, NodeError, NodeSetup, Peers, admission, convert};
use tandem_proto::node::v1 as node;
use tandem_proto::node::v1::decode_server::{Decode, DecodeServer};
use tandem_proto::node::v1::prefill_client::PrefillClient;
use tandem_proto::v1 as api;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Decode-node settings beyond the engine's.
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    /// Prompts whose uncached part is shorter than this many tokens are prefilled here.
    pub local_prefill_below: usize,
    /// Deadline for a remote prefill including its KV transfer.
    pub remote_prefill_timeout: Duration,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions { local_prefill_below: 32, remote_prefill_timeout: Duration::from_secs(30) }
    }
}

/// A running decode node.
#[derive(Debug, Clone)]
pub struct DecodeNode {
    core: Arc<NodeCore>,
    opts: DecodeOptions,
    peers: Peers,
    prefill_clients: Arc<Mutex<HashMap<String, PrefillClient<Channel>>>>,
}

type Tx = mpsc::Sender<Result<api::GenerateResponse, Status>>;

/// Where a request stands, owned by its task so cleanup can run whatever happened.
struct State {
    engine_id: Option<RequestId>,
    recv: Option<RecvHandle>,
    /// Its place among the requests without a first token.
    waiting: admission::Waiting,
    /// When the caller's `grpc-timeout` passes.
    deadline: Option<tokio::time::Instant>,
}

impl DecodeNode {
    /// Loads the model and starts the engine and the KV connector. Prompts are sent only to prefill
    /// nodes that `peers` lists (a caller's `prefill_addr` is a choice among them, not an address to call).
    pub async fn start(setup: NodeSetup, opts: DecodeOptions, fabric: &Fabric, peers: Peers) -> Result<DecodeNode, NodeError> {
        let core = Arc::new(NodeCore::start(setup, Role::Decode, fabric).await?);
        Ok(DecodeNode { core, opts, peers, prefill_clients: Arc::default() })
    }

    /// The shared node parts.
    pub fn core(&self) -> &Arc<NodeCore> {
        &self.core
    }

    /// The gRPC service.
    pub fn service(&self) -> DecodeServer<DecodeNode> {
        DecodeServer::new(self.clone())
    }

    fn prefill_client(&self, addr: &str) -> Result<PrefillClient<Channel>, NodeError> {
        let mut clients = self.prefill_clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = tandem_node::tls::endpoint(addr, self.core.tls.as_deref())
            .map_err(|e| NodeError::InvalidArgument(format!("prefill address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2));
        let client = PrefillClient::new(endpoint.connect_lazy());
        clients.insert(addr.to_string(), client.clone());
        Ok(client)
    }

    /// Runs one request to its end, streaming into `tx`; `state` records what must be cleaned up.
    async fn drive(&self, req: &node::DecodeRequest, params: SamplingParams, state: &mut State, tx: &Tx) -> Result<(), NodeError> {
        let t0 = Instant::now();
        let prompt = req.prompt.clone();
        let cached = self.core.engine.cached_prefix_len(prompt.clone()).await?;
        let uncached = prompt.len() - cached.min(prompt.len());
        // A migrated request's first new token must be sampled with the streamed tokens as output
        // (penalties, the seeded RNG's position), which only this node's engine knows: it prefills here.
        let generated = req.generated as usize;
        let mut remote = generated == 0 && !req.prefill_addr.is_empty() && uncached >= self.opts.local_prefill_below;
        if !remote {
            let reason = if generated > 0 {
                "migrated"
            } else if req.prefill_addr.is_empty() {
                "no_prefill_node"
            } else {
                "short_prompt"
            };
            tandem_node::metrics::node().local_prefills.inc(&[reason]);
        }
        let mut timings = format!("cached={cached}");
        if remote && !self.peers.is_prefill_node(&req.prefill_addr).await {
            tracing::warn!(prefill_addr = %convert::printable(&req.prefill_addr), "not a prefill node of this cluster; prefilling locally");
            timings.push_str(" remote_prefill=unlisted");
            tandem_node::metrics::node().local_prefills.inc(&["unlisted_prefill_node"]);
            remote = false;
        }
        let span = tracing::Span::current();
        span.record("cached_tokens", cached);
        let events = if remote {
            let remote_span = tracing::info_span!("remote_prefill", prefill_addr = %req.prefill_addr);
            match self.remote_prefill(req, params.clone(), state).instrument(remote_span).await {
                Ok((events, note)) => {
                    timings.push_str(&note);
                    Some(events)
                }
                Err(e) => {
                    tracing::warn!(request_id = %req.request_id, error = %e, "remote prefill failed; prefilling locally");
                    self.cleanup(state).await;
                    timings.push_str(" remote_prefill=failed");
                    // A prefill node with its queue full sheds the prompt to this node (degraded, not failed).
                    let busy = matches!(&e, NodeError::Peer(s) if s.code() == tonic::Code::ResourceExhausted);
                    tandem_node::metrics::node().local_prefills.inc(&[if busy { "prefill_busy" } else { "remote_failed" }]);
                    None
                }
            }
        } else {
            None
        };
        // Spans of a local prefill: `queue` until the first chunk is scheduled, `prefill` until the
        // first token; then (either way) `generate` until the last token.
        let mut phase = tandem_node::trace::Phase::default();
        let mut events = match events {
            Some(e) => {
                span.record("prefill", "remote");
                e
            }
            None => {
                span.record("prefill", "local");
                phase.start(tracing::info_span!("queue"));
                let (id, events) = if generated > 0 {
                    timings.push_str(&format!(" resumed={generated}"));
                    self.core.engine.add_resumed(prompt.clone(), generated, params).await?
                } else {
                    self.core.engine.add(prompt.clone(), params, None).await?
                };
                state.engine_id = Some(id);
                timings.push_str(" prefill=local");
                events
            }
        };
        // Usage counts a migrated request's streamed tokens as output, not prompt.
        let prompt_tokens = (prompt.len() - generated) as u32;
        let mut completion_tokens = generated as u32;
        let mut first_token_at = None;
        let mut generate = tracing::Span::none();
        while let Some(event) = events.recv().await {
            match event {
                Event::Scheduled => phase.start(tracing::info_span!("prefill")),
                Event::Output(out) => {
                    completion_tokens += out.token_ids.len() as u32;
                    if first_token_at.is_none() {
                        state.waiting.started();
                        phase.end();
                        tracing::info!(ttft_ms = tandem_node::ms(t0.elapsed()), "first token");
                        generate = tracing::info_span!("generate", completion_tokens = tracing::field::Empty);
                        first_token_at = Some(Instant::now());
                    }
                    let mut msg = convert::output_to_proto(&req.request_id, &out);
                    let done = out.finish.is_some();
                    if done {
                        let cached_tokens = (cached as u32).min(prompt_tokens);
                        msg.usage = Some(api::Usage { prompt_tokens, completion_tokens, cached_tokens });
                    }
                    if tx.send(Ok(msg)).await.is_err() {
                        return Err(NodeError::Internal("client went away".into()));
                    }
                    if done {
                        state.engine_id = None; // finished: the engine already freed it
                        span.record("completion_tokens", completion_tokens);
                        generate.record("completion_tokens", completion_tokens);
                        tracing::info!(
                            request_id = %req.request_id,
                            prompt_tokens,
                            completion_tokens,
                            ttft_ms = first_token_at.map(|t| tandem_node::ms(t - t0)).unwrap_or(0.0),
                            total_ms = tandem_node::ms(t0.elapsed()),
                            %timings,
                            "decode done"
                        );
                        return Ok(());
                    }
                }
                Event::Failed(why) => {
                    state.engine_id = None;
                    return Err(NodeError::Internal(why));
                }
                Event::PrefillDone { .. } => return Err(NodeError::Internal("a decode node never holds prefills".into())),
            }
        }
        state.engine_id = None;
        Err(NodeError::Internal("the engine dropped the request".into()))
    }

    /// Allocates, registers the transfer, has the prefill node fill it, and starts decoding.
    async fn remote_prefill(
        &self,
        req: &node::DecodeRequest,
        params: SamplingParams,
        state: &mut State,
    ) -> Result<(mpsc::UnboundedReceiver<Event>, String), NodeError> {
        let t0 = Instant::now();
        let (id, alloc, events) = self.core.engine.add_remote(req.prompt.clone(), params.clone()).await?;
        state.engine_id = Some(id);
        tandem_node::metrics::node().prefix_lookup(req.prompt.len(), alloc.num_cached_tokens);
        let skip = alloc.num_cached_tokens / self.core.block_size;
        let dst: Vec<u32> = alloc.block_table[skip..].iter().map(|b| b.0).collect();
        let binding = tandem_node::kv::kv_binding(&req.prompt, skip, self.core.block_size);
        let recv = self.core.connector.expect(dst, binding, Some(self.opts.remote_prefill_timeout))?;
        let descriptor = convert::descriptor_to_proto(recv.descriptor());
        state.recv = Some(recv);
        let mut client = self.prefill_client(&req.prefill_addr)?;
        let call = node::PrefillRequest {
            request_id: req.request_id.clone(),
            prompt: req.prompt.clone(),
            sampling: Some(convert::sampling_to_proto(&params)),
            kv: Some(descriptor),
            skip_blocks: skip as u32,
        };
        let mut call = Request::new(call);
        let left = state.deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
        call.set_timeout(left.map_or(self.opts.remote_prefill_timeout, |l| l.min(self.opts.remote_prefill_timeout)));
        tandem_node::trace::inject(&tracing::Span::current(), call.metadata_mut());
        let kv_span = tracing::info_span!(
            "kv_transfer",
            direction = tandem_node::metrics::RECV,
            backend = self.core.connector.backend(),
            bytes = tracing::field::Empty
        );
        let recv = state.recv.as_mut().expect("set above");
        // Both must succeed; whichever fails first ends the wait (a dead prefill node must not leave
        // us waiting for the transfer's deadline).
        let prefill = client.prefill(call);
        tokio::pin!(prefill);
        let (mut answer, mut landed) = (None, None);
        while answer.is_none() || landed.is_none() {
            tokio::select! {
                a = &mut prefill, if answer.is_none() => {
                    let a = a?.into_inner();
                    // The answer comes from another process: check it before the engine sees it (and
                    // before waiting for the KV), so a bad answer fails and falls back for this request only.
                    check_answer(&a, &params, self.core.vocab_size)?;
                    answer = Some(a);
                }
                l = recv.wait(), if landed.is_none() => {
                    let metrics = tandem_node::metrics::node();
                    match &l {
                        Ok(stats) => {
                            kv_span.record("bytes", stats.bytes);
                            metrics.transfer_done(self.core.connector.backend(), tandem_node::metrics::RECV, stats);
                        }
                        Err(e) => metrics.transfer_failed(self.core.connector.backend(), tandem_node::metrics::RECV, e),
                    }
                    landed = Some(l?);
                }
            }
        }
        drop(kv_span);
        let (answer, stats) = (answer.expect("loop ends with both"), landed.expect("loop ends with both"));
        state.recv = None;
        let logprob = answer.logprob.as_ref().map(convert::logprob_from_proto);
        self.core.engine.kv_ready(id, answer.first_token, logprob).await?;
        let note = format!(
            " skipped_blocks={skip} prefill_ms={:.1} transfer_bytes={} transfer_ms={:.1} handoff_ms={:.1}",
            answer.prefill_micros as f64 / 1e3,
            stats.bytes,
            stats.elapsed.as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok((events, note))
    }

    /// Cancels the transfer (waiting until its blocks are released), then aborts the engine request.
    async fn cleanup(&self, state: &mut State) {
        if let Some(recv) = state.recv.take() {
            recv.cancel().await;
        }
        if let Some(id) = state.engine_id.take() {
            self.core.engine.abort(id);
        }
    }

    async fn serve(self, req: node::DecodeRequest, params: SamplingParams, mut state: State, tx: Tx) {
        let deadline = state.deadline;
        let result = tokio::select! {
            r = self.drive(&req, params, &mut state, &tx) => r,
            _ = tx.closed() => Err(NodeError::Internal("client went away".into())),
            _ = admission::until(deadline) => {
                tandem_node::metrics::node().rejected.inc(&[tandem_node::metrics::DEADLINE]);
                Err(NodeError::DeadlineExceeded("the request's deadline (grpc-timeout) passed".into()))
            }
        };
        self.cleanup(&mut state).await;
        if let Err(e) = result {
            tracing::info!(request_id = %req.request_id, error = %e, "request ended before its last token; its blocks are freed");
            let _ = tx.send(Err(Status::from(e))).await;
        }
    }
}

/// Validates a prefill node's answer: the first token inside the vocabulary, and logprobs (when asked
/// for) that describe that token with finite, non-positive values and no more alternatives than asked.
fn check_answer(answer: &node::PrefillResponse, params: &SamplingParams, vocab_size: usize) -> Result<(), NodeError> {
    let bad = |why: String| Err(NodeError::Internal(format!("the prefill node's answer is invalid: {why}")));
    let in_vocab = |t: u32| (t as usize) < vocab_size;
    let fine = |lp: f32| lp.is_finite() && lp <= 1e-3;
    if !in_vocab(answer.first_token) {
        return bad(format!("first token {} is outside the vocabulary of {vocab_size}", answer.first_token));
    }
    match (&answer.logprob, params.logprobs) {
        (None, None) => Ok(()),
        (None, Some(_)) => bad("logprobs were asked for but not sent".into()),
        (Some(_), None) => bad("logprobs were sent but not asked for".into()),
        (Some(lp), Some(n)) => {
            if lp.token_id != answer.first_token || !fine(lp.logprob) {
                return bad(format!("the first token's logprob ({}, {}) does not describe it", lp.token_id, lp.logprob));
            }
            if lp.top.len() > n {
                return bad(format!("{} top logprobs for {n} asked", lp.top.len()));
            }
            match lp.top.iter().find(|t| !in_vocab(t.token_id) || !fine(t.logprob)) {
                Some(t) => bad(format!("top logprob ({}, {}) is outside the vocabulary or not a log-probability", t.token_id, t.logprob)),
                None => Ok(()),
            }
        }
    }
}

#[tonic::async_trait]
impl Decode for DecodeNode {
    type GenerateStream = ReceiverStream<Result<api::GenerateResponse, Status>>;

    async fn generate(&self, request: Request<node::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let (metadata, _, req) = request.into_parts();
        let deadline = admission::deadline_after(tokio::time::Instant::now(), admission::grpc_timeout(&metadata)?);
        self.core.check_tokens(&req.prompt)?;
        if req.generated as usize >= req.prompt.len().max(1) {
            return Err(Status::invalid_argument(format!("{} generated tokens leave no prompt among {}", req.generated, req.prompt.len())));
        }
        let params = convert::sampling_from_proto(req.sampling.as_ref())?;
        if params.n != 1 {
            return Err(Status::invalid_argument("n > 1 is not served by the cluster"));
        }
        let waiting = self.core.admission.enter().inspect_err(|_| {
            tandem_node::metrics::node().rejected.inc(&[tandem_node::metrics::QUEUE_FULL]);
        })?;
        self.core.engine.validate(req.prompt.clone(), params.clone()).await.map_err(NodeError::from)?;
        let state = State { engine_id: None, recv: None, waiting, deadline };
        let (tx, rx) = mpsc::channel(64);
        let span = tracing::info_span!(
            "decode",
            request_id = %req.request_id,
            prompt_tokens = req.prompt.len(),
            cached_tokens = tracing::field::Empty,
            prefill = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
        );
        tandem_node::trace::adopt_grpc(&span, &metadata);
        tokio::spawn(self.clone().serve(req, params, state, tx).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn info(&self, _request: Request<node::InfoRequest>) -> Result<Response<node::InfoResponse>, Status> {
        Ok(Response::new(self.core.info_now().await?))
    }
}
