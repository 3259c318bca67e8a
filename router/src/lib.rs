//! The router: serves the client API (`tandem.v1.Tandem`), tokenizes, picks a decode node (by policy)
//! and a prefill node (least load) from the live membership, and relays the decode node's token stream.
//!
//! Invariants:
//! - The router holds no request state beyond the relay: dropping the client's stream drops the decode
//!   stream, which aborts the request on the decode node (and its prefill).
//! - A node that fails a call is skipped for a few seconds even before its lease expires, so a dead decode
//!   node stops receiving requests at once.
//! - Only nodes currently in membership are ever called.
//! - Both front ends (gRPC here, the OpenAI-compatible HTTP API in [`http`]) go through the same
//!   [`Router::open`]: one place resolves the model, tokenizes, validates and routes.

mod admission;
mod auth;
mod grpc;
pub mod http;
mod metrics;
mod migrate;
pub mod policy;
mod relay;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::kv::prefix_block_hashes;
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_membership::{NodeInfo, NodeRole};
use tandem_node::{NodeError, convert, tokenizer_files_from_map};
use tandem_proto::node::v1 as node;
use tandem_proto::node::v1::decode_client::DecodeClient;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_server::Tandem;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tracing::Instrument;

pub use auth::{MAX_KEY_LEN, read_key_file};
pub use grpc::Service;
pub use policy::Policy;
pub(crate) use relay::Relay;
pub use migrate::DEFAULT_MAX_MIGRATIONS;
pub(crate) use admission::Admitted;
pub use admission::{DEADLINE_MARGIN, DEFAULT_MAX_WAITING, Limits};

/// Which front end a request came through, with what it carries of the caller's trace context.
#[derive(Clone, Copy)]
pub(crate) enum Caller<'a> {
    /// The gRPC API, with the call's metadata.
    Grpc(&'a tonic::metadata::MetadataMap),
    /// The HTTP API, with the request's headers.
    Http(&'a axum::http::HeaderMap),
}

impl Caller<'_> {
    fn api(self) -> &'static str {
        match self {
            Caller::Grpc(_) => "grpc",
            Caller::Http(_) => "http",
        }
    }

    fn adopt(self, span: &tracing::Span) {
        match self {
            Caller::Grpc(m) => tandem_node::trace::adopt_grpc(span, m),
            Caller::Http(h) => tandem_node::trace::adopt_http(span, h),
        }
    }
}

/// Longest request id a client may choose (visible ASCII).
pub const MAX_REQUEST_ID: usize = 128;

/// Bytes of prompt text allowed per token of the model's context before tokenizing: a prompt longer
/// than `max_model_len * PROMPT_BYTES_PER_TOKEN` cannot fit (tokens average ~4 bytes of text; this
/// leaves room for text that tokenizes unusually densely), so it is refused without spending CPU on it.
pub const PROMPT_BYTES_PER_TOKEN: usize = 32;

/// A client-chosen request id: empty (the router names it), or 1 to [`MAX_REQUEST_ID`] visible ASCII
/// characters (it is logged and forwarded to every node).
fn check_request_id(id: &str) -> Result<(), NodeError> {
    if id.len() > MAX_REQUEST_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(NodeError::InvalidArgument(format!(
            "request_id must be at most {MAX_REQUEST_ID} visible ASCII characters (got {} bytes)",
            id.len()
        )));
    }
    Ok(())
}

/// Chat roles the chat templates know.
fn check_roles(req: &api::GenerateRequest) -> Result<(), NodeError> {
    if let Some(api::generate_request::Prompt::Chat(chat)) = &req.prompt
        && let Some(m) = chat.messages.iter().find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
    {
        return Err(NodeError::InvalidArgument(format!(
            "chat role {:?} is not supported (system, user, assistant)",
            convert::printable(&m.role)
        )));
    }
    Ok(())
}

/// Refuses prompt text that cannot fit the context, before tokenizing it.
fn check_prompt_size(req: &api::GenerateRequest, max_model_len: usize) -> Result<(), NodeError> {
    use api::generate_request::Prompt;
    let (bytes, tokens) = match &req.prompt {
        Some(Prompt::Text(t)) => (t.len(), 0),
        Some(Prompt::Chat(c)) => (c.messages.iter().map(|m| m.content.len() + m.role.len()).sum(), 0),
        Some(Prompt::TokenIds(ids)) => (0, ids.ids.len()),
        None => (0, 0),
    };
    let limit = max_model_len.saturating_mul(PROMPT_BYTES_PER_TOKEN);
    if bytes > limit {
        return Err(NodeError::InvalidArgument(format!(
            "the prompt is {bytes} bytes of text; this model's context of {max_model_len} tokens takes at most {limit}"
        )));
    }
    if tokens > max_model_len {
        return Err(NodeError::InvalidArgument(format!(
            "the prompt is {tokens} tokens; this model's context is {max_model_len}"
        )));
    }
    Ok(())
}

/// How long a node that failed a call is skipped.
const QUARANTINE: Duration = Duration::from_secs(5);

/// What a model needs at the router: its tokenizer and limits (fetched from a node once).
struct ModelEntry {
    tokenizer: Arc<Tokenizer>,
    max_model_len: u32,
    block_size: usize,
}

/// The router service.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: watch::Receiver<Vec<NodeInfo>>,
    policy: Policy,
    models: tokio::sync::Mutex<HashMap<String, Arc<ModelEntry>>>,
    clients: Mutex<HashMap<String, DecodeClient<Channel>>>,
    quarantine: Mutex<HashMap<String, Instant>>,
    prefix: Mutex<policy::PrefixIndex>,
    rr: AtomicUsize,
    next_id: AtomicUsize,
    keys: auth::ApiKeys,
    admission: admission::Admission,
    /// TLS toward the nodes (set once, before the first call).
    node_tls: std::sync::OnceLock<Arc<tandem_node::tls::ClusterTls>>,
    /// Re-issues of one request after decode-node failures (`--max-migrations`).
    max_migrations: AtomicU32,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("policy", &self.inner.policy).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The request after validation at the router.
struct Routed {
    request_id: String,
    model: String,
    prompt: Vec<u32>,
    sampling: api::SamplingParams,
    tokenizer: Arc<Tokenizer>,
}

/// What `max_tokens` means when a request leaves it unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MaxTokens {
    /// The engine's default (256, as in `tandem generate`): the gRPC API.
    EngineDefault,
    /// Whatever the context leaves after the prompt: OpenAI's chat API.
    RestOfContext,
}

/// A served model as the list APIs show it.
pub(crate) struct ModelSummary {
    pub(crate) id: String,
    /// 0 when no decode node of it answered `Info` yet.
    pub(crate) max_model_len: u32,
    pub(crate) prefill_nodes: u32,
    pub(crate) decode_nodes: u32,
}

impl Router {
    /// A router over a membership snapshot stream.
    pub fn new(nodes: watch::Receiver<Vec<NodeInfo>>, policy: Policy) -> Router {
        metrics::watch_membership(nodes.clone());
        Router {
            inner: Arc::new(Inner {
                nodes,
                policy,
                models: tokio::sync::Mutex::new(HashMap::new()),
                clients: Mutex::new(HashMap::new()),
                quarantine: Mutex::new(HashMap::new()),
                prefix: Mutex::new(policy::PrefixIndex::new(1 << 20)),
                rr: AtomicUsize::new(0),
                next_id: AtomicUsize::new(1),
                keys: auth::ApiKeys::default(),
                admission: admission::Admission::default(),
                node_tls: std::sync::OnceLock::new(),
                max_migrations: AtomicU32::new(DEFAULT_MAX_MIGRATIONS),
            }),
        }
    }

    /// Requires one of `keys` (sent as `authorization: Bearer KEY`) on every request from now on;
    /// `None` opens the router to anyone who can reach it.
    pub fn set_api_keys(&self, keys: Option<Vec<String>>) {
        self.inner.keys.set(keys);
    }

    /// Calls nodes over mutual TLS with `tls` (set before serving; a second call is ignored).
    pub fn set_node_tls(&self, tls: Arc<tandem_node::tls::ClusterTls>) {
        let _ = self.inner.node_tls.set(tls);
    }

    /// Sets the overload limits (`--max-waiting-requests`, `--max-queue-time-ms`; before serving).
    pub fn set_limits(&self, limits: Limits) {
        self.inner.admission.set(limits);
    }

    /// How many times one request may move to another decode node after the one serving it failed
    /// (`--max-migrations`; 0 turns migration off).
    pub fn set_max_migrations(&self, n: u32) {
        self.inner.max_migrations.store(n, Ordering::Relaxed);
    }

    fn max_migrations(&self) -> u32 {
        self.inner.max_migrations.load(Ordering::Relaxed)
    }

    /// Whether the router serves requests without an API key.
    pub fn is_open(&self) -> bool {
        self.inner.keys.is_open()
    }

    /// Refuses a gRPC call without a valid key (before anything else looks at it).
    fn authorize(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let given = metadata.get("authorization").map(|v| v.as_bytes());
        if self.inner.keys.allows(given) { Ok(()) } else { Err(Status::unauthenticated(auth::REFUSED)) }
    }

    /// The gRPC service (a request that does not decode is INVALID_ARGUMENT).
    pub fn service(&self) -> grpc::Service {
        grpc::Service::new(self.clone())
    }

    fn live(&self) -> Vec<NodeInfo> {
        let q = lock(&self.inner.quarantine);
        let now = Instant::now();
        self.inner.nodes.borrow().iter().filter(|n| q.get(&n.id).is_none_or(|&until| until <= now)).cloned().collect()
    }

    fn quarantine(&self, id: &str) {
        lock(&self.inner.quarantine).insert(id.to_string(), Instant::now() + QUARANTINE);
    }

    fn client(&self, addr: &str) -> Result<DecodeClient<Channel>, NodeError> {
        let mut clients = lock(&self.inner.clients);
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = tandem_node::tls::endpoint(addr, self.inner.node_tls.get().map(Arc::as_ref))
            .map_err(|e| NodeError::Internal(format!("node address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2));
        let c = DecodeClient::new(endpoint.connect_lazy());
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// The model a request names (or the only one served).
    fn resolve_model(&self, nodes: &[NodeInfo], asked: &str) -> Result<String, NodeError> {
        let mut models: Vec<&str> = nodes.iter().map(|n| n.model.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        if models.is_empty() {
            // With no node at all, a named model may well be served again soon: unavailable, not unknown.
            return Err(NodeError::Unavailable("no decode node is available".into()));
        }
        if !asked.is_empty() {
            return if models.contains(&asked) {
                Ok(asked.to_string())
            } else {
                Err(NodeError::NotFound(format!("model {asked:?} is not served here (serving: {})", models.join(", "))))
            };
        }
        match models.as_slice() {
            [one] => Ok(one.to_string()),
            _ => Err(NodeError::InvalidArgument(format!("several models are served ({}); name one", models.join(", ")))),
        }
    }

    async fn model_entry(&self, model: &str, nodes: &[NodeInfo]) -> Result<Arc<ModelEntry>, NodeError> {
        let mut models = self.inner.models.lock().await;
        if let Some(e) = models.get(model) {
            return Ok(Arc::clone(e));
        }
        let mut last = None;
        for n in nodes.iter().filter(|n| n.model == model && n.role == NodeRole::Decode) {
            let mut client = self.client(&n.grpc_addr)?;
            let mut req = Request::new(node::InfoRequest {});
            req.set_timeout(Duration::from_secs(10));
            match client.info(req).await {
                Ok(info) => {
                    let info = info.into_inner();
                    let files = tokenizer_files_from_map(&info.tokenizer_files)?;
                    let tokenizer = Tokenizer::from_files(&files)?;
                    let block_size = info.geometry.as_ref().map(|g| g.block_size as usize).unwrap_or(16).max(1);
                    let entry = Arc::new(ModelEntry { tokenizer: Arc::new(tokenizer), max_model_len: info.max_model_len, block_size });
                    models.insert(model.to_string(), Arc::clone(&entry));
                    return Ok(entry);
                }
                Err(e) => {
                    self.quarantine(&n.id);
                    last = Some(e);
                }
            }
        }
        Err(match last {
            Some(e) => NodeError::Unavailable(format!("no decode node of {model} answered: {}", e.message())),
            None => NodeError::Unavailable(format!("no decode node serves {model}")),
        })
    }

    fn tokenize(tokenizer: &Tokenizer, req: &api::GenerateRequest) -> Result<Vec<u32>, NodeError> {
        use api::generate_request::Prompt;
        match &req.prompt {
            None => Err(NodeError::InvalidArgument("the request has no prompt".into())),
            Some(Prompt::Text(t)) => Ok(tokenizer.encode(t, true)?),
            Some(Prompt::Chat(chat)) => {
                if chat.messages.is_empty() {
                    return Err(NodeError::InvalidArgument("the chat has no messages".into()));
                }
                let messages: Vec<ChatMessage> = chat.messages.iter().map(|m| ChatMessage::new(m.role.clone(), m.content.clone())).collect();
                let text = tokenizer.apply_chat_template(&messages, true)?;
                Ok(tokenizer.encode(&text, false)?)
            }
            Some(Prompt::TokenIds(ids)) => Ok(ids.ids.clone()),
        }
    }

    async fn route(&self, req: api::GenerateRequest, max_tokens: MaxTokens) -> Result<(Routed, NodeInfo, Option<NodeInfo>), NodeError> {
        check_request_id(&req.request_id)?;
        check_roles(&req)?;
        let nodes = self.live();
        let model = self.resolve_model(&nodes, &req.model)?;
        let entry = self.model_entry(&model, &nodes).await?;
        check_prompt_size(&req, entry.max_model_len as usize)?;
        // Tokenizing is CPU work (milliseconds for a long prompt): off the async threads.
        let (tokenizer, req) = (Arc::clone(&entry.tokenizer), Arc::new(req));
        let prompt = {
            let req = Arc::clone(&req);
            tokio::task::spawn_blocking(move || Self::tokenize(&tokenizer, &req))
                .await
                .map_err(|e| NodeError::Internal(format!("tokenizing failed: {e}")))??
        };
        let req = Arc::unwrap_or_clone(req);
        if prompt.is_empty() {
            return Err(NodeError::Engine(tandem_engine::Error::EmptyPrompt));
        }
        // Fail fast on what the router can already see; the decode node checks everything again.
        let mut sampling = req.sampling.clone().unwrap_or_default();
        if sampling.max_tokens.is_none() && max_tokens == MaxTokens::RestOfContext {
            let rest = (entry.max_model_len as usize).saturating_sub(prompt.len()).max(1);
            sampling.max_tokens = Some(u32::try_from(rest).unwrap_or(u32::MAX));
        }
        let params = convert::sampling_from_proto(Some(&sampling))?;
        if prompt.len() + params.max_tokens > entry.max_model_len as usize {
            return Err(NodeError::Engine(tandem_engine::Error::PromptTooLong {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                limit: entry.max_model_len as usize,
            }));
        }
        let decoders: Vec<&NodeInfo> = nodes.iter().filter(|n| n.model == model && n.role == NodeRole::Decode).collect();
        // Nodes whose published queue is full take nothing; a full prefill node is skipped (the decode
        // node prefills), every decode node full is RESOURCE_EXHAUSTED.
        let decoders = admission::open_decoders(&model, decoders)?;
        let prefillers: Vec<&NodeInfo> =
            nodes.iter().filter(|n| n.model == model && n.role == NodeRole::Prefill && !admission::full(n)).collect();
        let hashes = prefix_block_hashes(&prompt, entry.block_size);
        let decode = match self.inner.policy {
            Policy::LeastLoad => policy::least_load(&decoders),
            Policy::PrefixAware => lock(&self.inner.prefix).pick(&hashes, &decoders),
            Policy::RoundRobin => {
                let i = self.inner.rr.fetch_add(1, Ordering::Relaxed);
                (!decoders.is_empty()).then(|| decoders[i % decoders.len()])
            }
        }
        .ok_or_else(|| NodeError::Unavailable(format!("no decode node of {model} is available")))?
        .clone();
        let prefill = match self.inner.policy {
            Policy::RoundRobin => {
                let i = self.inner.rr.load(Ordering::Relaxed);
                (!prefillers.is_empty()).then(|| prefillers[i % prefillers.len()])
            }
            _ => policy::least_load(&prefillers),
        }
        .cloned();
        lock(&self.inner.prefix).record(&hashes, &decode.id);
        metrics::routed(self.inner.policy, prefill.is_some());
        let request_id = if req.request_id.is_empty() {
            format!("req-{}", self.inner.next_id.fetch_add(1, Ordering::Relaxed))
        } else {
            req.request_id.clone()
        };
        let tokenizer = Arc::clone(&entry.tokenizer);
        Ok((Routed { request_id, model, prompt, sampling, tokenizer }, decode, prefill))
    }

    /// Admits the request (RESOURCE_EXHAUSTED past `--max-waiting-requests`), then resolves the model,
    /// tokenizes, validates, routes and opens the decode node's stream, all within the request's
    /// deadlines (the caller's `grpc-timeout`, `--max-queue-time-ms`; DEADLINE_EXCEEDED): what every front
    /// end calls. Dropping the returned stream aborts the request on every node.
    pub(crate) async fn open(&self, req: api::GenerateRequest, max_tokens: MaxTokens, caller: Caller<'_>) -> Result<Admitted, NodeError> {
        let arrived = tokio::time::Instant::now();
        let (waiting, max_queue_time) = self.inner.admission.enter()?;
        let timeout = match caller {
            Caller::Grpc(metadata) => tandem_node::admission::grpc_timeout(metadata)?,
            Caller::Http(_) => None,
        };
        let deadline = admission::call_deadline(arrived, timeout);
        let queue_deadline = max_queue_time.map(|q| arrived + q);
        let opening = self.open_relay(req, max_tokens, caller, deadline);
        let relay = match admission::earliest(deadline, queue_deadline) {
            None => opening.await?,
            Some((at, why)) => tokio::time::timeout_at(at, opening).await.map_err(|_| admission::expired(why))??,
        };
        Ok(Admitted::new(relay, waiting, deadline, queue_deadline))
    }

    /// [`Self::open`] past admission. Dropping the returned relay aborts the request on every node. The
    /// request's span (`request`, lasting as long as the relay) joins the caller's trace, if it sent one;
    /// the decode node is given what is left of `deadline` as its `grpc-timeout`.
    async fn open_relay(
        &self,
        req: api::GenerateRequest,
        max_tokens: MaxTokens,
        caller: Caller<'_>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Relay, NodeError> {
        let started = Instant::now();
        let span = tracing::info_span!(
            "request",
            api = caller.api(),
            request_id = tracing::field::Empty,
            model = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            decode_node = tracing::field::Empty,
            prefill_node = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
        );
        caller.adopt(&span);
        let route_span = tracing::info_span!(parent: &span, "route", policy = self.inner.policy.name());
        let (routed, decode, prefill) = self.route(req, max_tokens).instrument(route_span).await?;
        span.record("request_id", routed.request_id.as_str());
        span.record("model", routed.model.as_str());
        span.record("prompt_tokens", routed.prompt.len());
        span.record("decode_node", decode.id.as_str());
        span.record("prefill_node", prefill.as_ref().map(|p| p.id.as_str()).unwrap_or("local"));
        tracing::info!(
            parent: &span,
            request_id = %routed.request_id,
            model = %routed.model,
            prompt_tokens = routed.prompt.len(),
            decode = %decode.id,
            prefill = prefill.as_ref().map(|p| p.id.as_str()).unwrap_or("local"),
            "routed"
        );
        // What migration needs to continue the stream elsewhere (max_tokens resolved as the node will).
        let max_tokens = convert::sampling_from_proto(Some(&routed.sampling))?.max_tokens;
        let cont = migrate::Continuation::new(
            routed.request_id.clone(),
            routed.prompt.clone(),
            routed.sampling.clone(),
            u32::try_from(max_tokens).unwrap_or(u32::MAX),
        );
        let call = node::DecodeRequest {
            request_id: routed.request_id.clone(),
            prompt: routed.prompt,
            sampling: Some(routed.sampling),
            prefill_addr: prefill.map(|p| p.grpc_addr).unwrap_or_default(),
            generated: 0,
        };
        let stream = self.call_decode(&decode, call, deadline, &span).await?;
        let origin = migrate::Origin { model: routed.model.clone(), node: decode, deadline, span: span.clone() };
        Ok(Relay::new(
            relay::Opened { request_id: routed.request_id, model: routed.model, tokenizer: routed.tokenizer, started, span },
            migrate::Upstream::new(self.clone(), origin, cont, stream),
        ))
    }

    /// Calls `decode`'s `Generate` inside `span`, with what is left of `deadline` as its `grpc-timeout`:
    /// a new request, or one continuing on another node (migration). A node that fails the call is
    /// quarantined (UNAVAILABLE).
    async fn call_decode(
        &self,
        decode: &NodeInfo,
        call: node::DecodeRequest,
        deadline: Option<tokio::time::Instant>,
        span: &tracing::Span,
    ) -> Result<tonic::Streaming<api::GenerateResponse>, NodeError> {
        let mut client = self.client(&decode.grpc_addr)?;
        let mut call = Request::new(call);
        if let Some(d) = deadline {
            call.set_timeout(d.saturating_duration_since(tokio::time::Instant::now()));
        }
        tandem_node::trace::inject(span, call.metadata_mut());
        match client.generate(call).instrument(span.clone()).await {
            Ok(stream) => Ok(stream.into_inner()),
            Err(s) => {
                if matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled) {
                    self.quarantine(&decode.id);
                    return Err(NodeError::Unavailable(format!("decode node {} failed: {}", decode.id, s.message())));
                }
                if s.code() == Code::ResourceExhausted {
                    metrics::rejected(admission::reason::NODES_FULL);
                }
                Err(NodeError::Peer(s))
            }
        }
    }

    /// The models the live nodes serve, sorted by id, with each one's context limit (fetched from a decode
    /// node once, on first use).
    pub(crate) async fn models(&self) -> Vec<ModelSummary> {
        let nodes = self.live();
        let mut by_model: HashMap<String, ModelSummary> = HashMap::new();
        for n in &nodes {
            let m = by_model
                .entry(n.model.clone())
                .or_insert_with(|| ModelSummary { id: n.model.clone(), max_model_len: 0, prefill_nodes: 0, decode_nodes: 0 });
            match n.role {
                NodeRole::Prefill => m.prefill_nodes += 1,
                NodeRole::Decode => m.decode_nodes += 1,
            }
        }
        let mut models: Vec<ModelSummary> = by_model.into_values().collect();
        models.sort_by(|a, b| a.id.cmp(&b.id));
        for m in models.iter_mut().filter(|m| m.decode_nodes > 0) {
            // A model no decode node answers for yet is listed without its limit.
            m.max_model_len = self.model_entry(&m.id, &nodes).await.map(|e| e.max_model_len).unwrap_or(0);
        }
        models
    }

    /// Live (prefill, decode) node counts; the router can serve while a decode node is live.
    pub(crate) fn node_counts(&self) -> (u32, u32) {
        let nodes = self.live();
        let count = |r: NodeRole| nodes.iter().filter(|n| n.role == r).count() as u32;
        (count(NodeRole::Prefill), count(NodeRole::Decode))
    }
}

#[tonic::async_trait]
impl Tandem for Router {
    type GenerateStream = ReceiverStream<Result<api::GenerateResponse, Status>>;

    async fn generate(&self, request: Request<api::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let (metadata, _, request) = request.into_parts();
        self.authorize(&metadata)?;
        let mut relay = self.open(request, MaxTokens::EngineDefault, Caller::Grpc(&metadata)).await?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    item = relay.next() => item,
                    // Dropping `relay` cancels the decode node's request.
                    _ = tx.closed() => return,
                };
                let Some(item) = item else { return };
                let failed = item.is_err();
                if tx.send(item).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn generate_unary(&self, request: Request<api::GenerateRequest>) -> Result<Response<api::GenerateUnaryResponse>, Status> {
        let (metadata, _, request) = request.into_parts();
        self.authorize(&metadata)?;
        let mut relay = self.open(request, MaxTokens::EngineDefault, Caller::Grpc(&metadata)).await?;
        let mut out = api::GenerateUnaryResponse { request_id: relay.request_id().to_string(), ..Default::default() };
        while let Some(item) = relay.next().await {
            let msg = item?;
            out.text.push_str(&msg.text);
            out.token_ids.extend(msg.token_ids);
            out.logprobs.extend(msg.logprobs);
            if msg.finish_reason != 0 {
                out.finish_reason = msg.finish_reason;
                out.usage = msg.usage;
            }
        }
        Ok(Response::new(out))
    }

    async fn list_models(&self, request: Request<api::ListModelsRequest>) -> Result<Response<api::ListModelsResponse>, Status> {
        self.authorize(request.metadata())?;
        let models = self
            .models()
            .await
            .into_iter()
            .map(|m| api::Model { id: m.id, max_model_len: m.max_model_len, prefill_nodes: m.prefill_nodes, decode_nodes: m.decode_nodes })
            .collect();
        Ok(Response::new(api::ListModelsResponse { models }))
    }

    async fn health(&self, _request: Request<api::HealthRequest>) -> Result<Response<api::HealthResponse>, Status> {
        let (prefill_nodes, decode_nodes) = self.node_counts();
        Ok(Response::new(api::HealthResponse { serving: decode_nodes > 0, prefill_nodes, decode_nodes }))
    }
}
