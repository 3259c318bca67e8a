//! The prefill node: runs the engine in the prefill role. For each `Prefill` call it queues the prompt
//! with a transfer plan; the engine thread starts the KV transfer into the decode node's blocks when the
//! prompt's final chunk is scheduled and pushes every layer as soon as the forward pass wrote it. Once the
//! decode node confirmed every layer, the held blocks are released and the first token is returned.
//!
//! Invariants: a cancelled call (the decode node gave up) cancels its transfer and frees its blocks; held
//! blocks are released exactly once, after the transfer ended. At most `--max-waiting-requests` prompts
//! are accepted and not yet computed (one more is refused at once with RESOURCE_EXHAUSTED, holding
//! nothing); a call whose `grpc-timeout` passes ends with DEADLINE_EXCEEDED and frees the same way as
//! a cancelled one.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::sched::Role;
use tandem_kv_transfer::Fabric;
use tandem_node::{Event, NodeCore, NodeError, NodeSetup, Peers, TransferPlan, admission, convert};
use tandem_proto::node::v1 as node;
use tandem_proto::node::v1::prefill_server::{Prefill, PrefillServer};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Deadline of one prompt's KV transfer.
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

/// A running prefill node.
#[derive(Debug, Clone)]
pub struct PrefillNode {
    core: Arc<NodeCore>,
    peers: Peers,
    /// KV endpoints this node has sent to (the first transfer to each is logged with its backend).
    reached: Arc<Mutex<HashSet<String>>>,
}

impl PrefillNode {
    /// Loads the model and starts the engine and the KV connector. KV is pushed only to the endpoints
    /// of decode nodes that `peers` lists.
    pub async fn start(setup: NodeSetup, fabric: &Fabric, peers: Peers) -> Result<PrefillNode, NodeError> {
        Ok(PrefillNode { core: Arc::new(NodeCore::start(setup, Role::Prefill, fabric).await?), peers, reached: Arc::default() })
    }

    /// The shared node parts (engine, connector, info).
    pub fn core(&self) -> &Arc<NodeCore> {
        &self.core
    }

    /// The gRPC service.
    pub fn service(&self) -> PrefillServer<PrefillNode> {
        PrefillServer::new(self.clone())
    }

    async fn run(self, req: node::PrefillRequest, call: Call, done: &mut oneshot::Sender<()>) -> Result<node::PrefillResponse, NodeError> {
        let PrefillNode { core, peers, reached } = self;
        let Call { mut waiting, deadline } = call;
        let started = Instant::now();
        core.check_tokens(&req.prompt)?;
        let params = convert::sampling_from_proto(req.sampling.as_ref())?;
        let descriptor = convert::descriptor_from_proto(req.kv.as_ref().ok_or_else(|| NodeError::InvalidArgument("prefill without a KV descriptor".into()))?)?;
        let prompt_blocks = req.prompt.len().div_ceil(core.block_size);
        let skip = req.skip_blocks as usize;
        if skip > prompt_blocks || descriptor.dst_blocks.len() != prompt_blocks - skip {
            return Err(NodeError::InvalidArgument(format!(
                "the prompt has {prompt_blocks} blocks; {skip} skipped + {} destination blocks do not add up",
                descriptor.dst_blocks.len()
            )));
        }
        core.geometry.check_compatible(&descriptor.geometry)?;
        if !peers.is_decode_kv_endpoint(&descriptor.endpoint).await {
            return Err(NodeError::Forbidden(format!(
                "KV endpoint {:?} is not a decode node of this cluster",
                tandem_node::convert::printable(&descriptor.endpoint)
            )));
        }
        // The KV this node computes is bound to the prompt it was given; a descriptor bound to another
        // prompt would be refused by the receiver anyway, so refuse it before computing anything.
        let binding = tandem_node::kv::kv_binding(&req.prompt, skip, core.block_size);
        if descriptor.binding != binding {
            return Err(NodeError::InvalidArgument(
                "the KV descriptor is bound to another prompt than the one to prefill".into(),
            ));
        }
        let endpoint = descriptor.endpoint.clone();
        let plan = TransferPlan { descriptor, skip_blocks: skip, binding, timeout: TRANSFER_TIMEOUT };
        // Spans: `queue` until the first chunk is scheduled, then `compute` until the first token, and
        // `kv_transfer` from then until the decode node confirmed every layer.
        let mut phase = tandem_node::trace::Phase::default();
        phase.start(tracing::info_span!("queue"));
        let (id, mut events) = core.engine.add(req.prompt.clone(), params, Some(plan)).await?;
        let mut guard = AbortOnDrop { core: &core, id: Some(id) };
        let mut kv_span = tracing::Span::none();
        let event = loop {
            let event = tokio::select! {
                e = events.recv() => e,
                _ = done.closed() => return Err(NodeError::Internal("cancelled by the caller".into())),
                _ = admission::until(deadline) => return Err(deadline_passed()),
            };
            if !matches!(event, Some(Event::Scheduled)) {
                break event;
            }
            phase.start(tracing::info_span!("compute"));
            kv_span = tracing::info_span!(
                "kv_transfer",
                direction = tandem_node::metrics::SEND,
                backend = core.connector.backend(),
                bytes = tracing::field::Empty
            );
        };
        phase.end();
        waiting.started();
        let (output, transfer) = match event {
            Some(Event::PrefillDone { output, transfer: Some(t) }) => (output, t),
            Some(Event::PrefillDone { transfer: None, .. }) => return Err(NodeError::Internal("the KV transfer never started".into())),
            Some(Event::Failed(why)) => return Err(NodeError::Internal(why)),
            Some(Event::Output(_) | Event::Scheduled) => return Err(NodeError::Internal("prefill finished without holding its blocks".into())),
            None => return Err(NodeError::Internal("the engine dropped the request".into())),
        };
        let prefill_done = Instant::now();
        let mut transfer = transfer;
        let verdict = tokio::select! {
            v = transfer.wait() => v,
            _ = done.closed() => {
                transfer.cancel().await;
                return Err(NodeError::Internal("cancelled by the caller".into()));
            }
            _ = admission::until(deadline) => {
                transfer.cancel().await;
                return Err(deadline_passed());
            }
        };
        // Either way the transfer is over: the blocks can go.
        guard.id = None;
        core.engine.release(id);
        let metrics = tandem_node::metrics::node();
        match &verdict {
            Ok(stats) => metrics.transfer_done(core.connector.backend(), tandem_node::metrics::SEND, stats),
            Err(e) => metrics.transfer_failed(core.connector.backend(), tandem_node::metrics::SEND, e),
        }
        if let Ok(stats) = &verdict {
            kv_span.record("bytes", stats.bytes);
        }
        drop(kv_span);
        let stats = verdict?;
        if lock(&reached).insert(endpoint.clone()) {
            tracing::info!(
                peer = %endpoint,
                backend = core.connector.backend(),
                bytes = stats.bytes,
                gb_per_s = tandem_node::round2(stats.bytes_per_sec() / 1e9),
                "first KV transfer to this decode node"
            );
        }
        let first = *output.token_ids.first().ok_or_else(|| NodeError::Internal("no first token".into()))?;
        tracing::info!(
            request_id = %req.request_id,
            prompt_tokens = req.prompt.len(),
            skipped_blocks = skip,
            prefill_ms = tandem_node::ms(prefill_done - started),
            transfer_bytes = stats.bytes,
            transfer_ms = tandem_node::ms(stats.elapsed),
            transfer_gb_per_s = tandem_node::round2(stats.bytes_per_sec() / 1e9),
            "prefill done"
        );
        Ok(node::PrefillResponse {
            first_token: first,
            logprob: output.logprobs.first().map(convert::logprob_to_proto),
            cached_tokens: 0,
            kv_bytes: stats.bytes,
            transfer_micros: stats.elapsed.as_micros() as u64,
            prefill_micros: (prefill_done - started).as_micros() as u64,
        })
    }
}

/// What a call brings besides its request: its place among the waiting prompts and its deadline.
struct Call {
    waiting: admission::Waiting,
    deadline: Option<tokio::time::Instant>,
}

fn deadline_passed() -> NodeError {
    tandem_node::metrics::node().rejected.inc(&[tandem_node::metrics::DEADLINE]);
    NodeError::DeadlineExceeded("the request's deadline (grpc-timeout) passed before its prompt was computed and sent".into())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Aborts the engine request unless disarmed (the handler was cancelled or failed midway).
struct AbortOnDrop<'a> {
    core: &'a NodeCore,
    id: Option<tandem_engine::sched::RequestId>,
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.core.engine.abort(id);
        }
    }
}

#[tonic::async_trait]
impl Prefill for PrefillNode {
    async fn prefill(&self, request: Request<node::PrefillRequest>) -> Result<Response<node::PrefillResponse>, Status> {
        let (metadata, _, req) = request.into_parts();
        let deadline = admission::deadline_after(tokio::time::Instant::now(), admission::grpc_timeout(&metadata)?);
        let waiting = self.core.admission.enter().inspect_err(|_| {
            tandem_node::metrics::node().rejected.inc(&[tandem_node::metrics::QUEUE_FULL]);
        })?;
        let call = Call { waiting, deadline };
        let span = tracing::info_span!("prefill", request_id = %req.request_id, prompt_tokens = req.prompt.len());
        tandem_node::trace::adopt_grpc(&span, &metadata);
        // The work runs in its own task so that a cancelled call still cleans up (cancel the transfer
        // before freeing blocks); the task learns of the cancellation when `rx` is dropped.
        let (mut tx, rx) = oneshot::channel::<()>();
        let node = self.clone();
        let task = tokio::spawn(async move { node.run(req, call, &mut tx).await }.instrument(span));
        let _keep = rx;
        match task.await {
            Ok(r) => r.map(Response::new).map_err(Status::from),
            Err(e) => Err(Status::internal(format!("prefill task failed: {e}"))),
        }
    }

    async fn info(&self, _request: Request<node::InfoRequest>) -> Result<Response<node::InfoResponse>, Status> {
        Ok(Response::new(self.core.info_now().await?))
    }
}
