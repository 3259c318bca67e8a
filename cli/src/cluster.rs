//! The cluster's processes: `tandem router`, `tandem prefill`, `tandem decode`, `tandem up` (all three in
//! one process with in-memory membership) and `tandem client`.
//!
//! Every server prints one line `tandem <role> serving on ADDR` on stdout once it accepts requests (tests
//! and scripts wait for it) and drains on SIGTERM or Ctrl-C: it leaves membership first, then finishes
//! the requests in flight, then exits. A router (or `tandem up`) that also serves the OpenAI-compatible
//! HTTP API prints `tandem router: OpenAI API on http://ADDR/v1` (`tandem up: ...`) on the next line;
//! a node given `--metrics-listen` prints `tandem <role>: metrics on http://ADDR/metrics` there.
//!
//! Every server also answers the standard gRPC health protocol on its gRPC listener, NOT_SERVING
//! from the stop signal on (see [`health`]); the drain is bounded by `--drain-timeout`. With `--check`
//! a server only validates its command line and exits (see [`check`]).

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use tandem_decode_node::{DecodeNode, DecodeOptions};
use tandem_kv_transfer::{ConnectorConfig, ConnectorSpec, Fabric};
use tandem_membership::{Load, Membership, NodeInfo, NodeRole, Registration};
use tandem_node::{NodeCore, NodeSetup, Peers, Weights};
use tandem_prefill_node::PrefillNode;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_router::{Policy, Router};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tonic::transport::server::TcpIncoming;

use crate::generate::EngineArgs;

mod check;
mod health;
mod overload;
pub(crate) mod tls;

use health::Health;
use tonic_health::ServingStatus;

/// Where membership lives.
#[derive(Args, Debug, Clone)]
pub(crate) struct EtcdArgs {
    /// etcd endpoints, comma-separated (e.g. http://127.0.0.1:2379).
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Key prefix of this cluster in etcd.
    #[arg(long, default_value = "/tandem")]
    cluster_prefix: String,
    /// Lease TTL in seconds: a node that stops answering leaves routing within it.
    #[arg(long, default_value_t = 5)]
    ttl: u64,
    #[command(flatten)]
    tls: tls::EtcdTlsArgs,
}

/// How long a server may drain.
#[derive(Args, Debug, Clone)]
pub(crate) struct DrainArgs {
    /// On SIGTERM, the longest to wait (seconds) for requests in flight before exiting with them
    /// unfinished.
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    drain_timeout: u64,
}

impl DrainArgs {
    fn timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout)
    }
}

/// The drain of servers inside `tandem up` (and the benchmarks' embedded clusters).
const EMBEDDED_DRAIN: Duration = Duration::from_secs(30);

impl EtcdArgs {
    /// Connects to etcd (over TLS with `--etcd-*`, or with the cluster's files to `https://` endpoints).
    async fn connect(&self, cluster_tls: Option<&tandem_node::tls::ClusterTls>) -> anyhow::Result<Membership> {
        anyhow::ensure!(self.ttl >= 1, "--ttl must be at least 1 second");
        let tls = self.tls.load(&self.etcd, cluster_tls)?;
        let opts = tandem_membership::EtcdOptions { ttl: Duration::from_secs(self.ttl), tls, ..Default::default() };
        Membership::etcd(&self.etcd, &self.cluster_prefix, opts)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))
    }
}

/// `tandem router`.
#[derive(Args, Debug)]
pub(crate) struct RouterArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// Address to serve the client API on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// How to pick a decode node: least-load, prefix-aware or round-robin.
    #[arg(long, default_value = "least-load")]
    policy: Policy,
    #[command(flatten)]
    limits: overload::RouterLimitArgs,
    /// Times one request may move to another decode node when the node serving it fails mid-stream
    /// (its stream continues from the next token); then, or with 0, the stream ends with UNAVAILABLE.
    #[arg(long, value_name = "N", default_value_t = tandem_router::DEFAULT_MAX_MIGRATIONS)]
    max_migrations: u32,
    /// Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health) on this address (port 0 picks one).
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Require one of the API keys in this file (one per line; re-read on SIGHUP) as
    /// `authorization: Bearer KEY` on every request [default: open to anyone who can reach it].
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    tls: tls::TlsArgs,
    #[command(flatten)]
    drain: DrainArgs,
    /// Only check the command line, then exit (nothing is reached, bound or loaded).
    #[arg(long)]
    check: bool,
}

/// `--http-listen` of `tandem up`: an address, or `off`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HttpListen(Option<SocketAddr>);

impl std::str::FromStr for HttpListen {
    type Err = std::net::AddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "off" { Ok(HttpListen(None)) } else { s.parse().map(|a| HttpListen(Some(a))) }
    }
}

/// What prefill and decode nodes share on the command line.
#[derive(Args, Debug, Clone)]
pub(crate) struct NodeArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// Address to serve the node API on (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Host other nodes use to reach this one [default: the listen IP, or 127.0.0.1 if unspecified].
    #[arg(long)]
    advertise: Option<String>,
    /// KV-transfer backend: auto (cuda-ipc for --device cuda, tcp otherwise), tcp, tcp://HOST:PORT,
    /// cuda-ipc (GPU pools of one host, written device to device), or plugin:/path/lib.so[?config].
    #[arg(long, default_value = "auto")]
    kv_connector: String,
    /// This node's id in membership [default: role-host-port].
    #[arg(long)]
    node_id: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0 picks one) [default: not served].
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    limits: overload::NodeLimitArgs,
    #[command(flatten)]
    tls: tls::TlsArgs,
    #[command(flatten)]
    drain: DrainArgs,
    /// Only check the command line, then exit (no model is pulled or loaded, nothing reached or bound).
    #[arg(long)]
    check: bool,
}

impl NodeArgs {
    fn check(&self, role: &str) -> anyhow::Result<()> {
        check::etcd(&self.etcd)?;
        check::engine(&self.engine, &self.kv_connector)?;
        check_tls(&self.tls, Some(&self.etcd))?;
        if let Some(a) = &self.advertise {
            anyhow::ensure!(!a.trim().is_empty(), "--advertise is empty");
        }
        check::ok(&format!("tandem {role}"))
    }
}

/// `tandem prefill`.
#[derive(Args, Debug)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    node: NodeArgs,
}

/// `tandem decode`.
#[derive(Args, Debug)]
pub(crate) struct DecodeArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// Prefill prompts here when fewer than this many of their tokens are not already cached.
    #[arg(long, default_value_t = 32)]
    local_prefill_below: usize,
    /// Prefill every prompt here, never on a prefill node (the colocated baseline that
    /// disaggregation is compared with).
    #[arg(long, conflicts_with = "local_prefill_below")]
    colocated: bool,
}

/// `tandem up`.
#[derive(Args, Debug)]
pub(crate) struct UpArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Address the router serves on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Address of the OpenAI-compatible HTTP API (port 0 picks one), or `off`. Not served with --prompt.
    #[arg(long, default_value = "127.0.0.1:8000")]
    http_listen: HttpListen,
    /// Routing policy.
    #[arg(long, default_value = "least-load")]
    policy: Policy,
    #[command(flatten)]
    limits: overload::RouterLimitArgs,
    /// Prefill on the decode node when fewer than this many prompt tokens are uncached (0: always
    /// transfer).
    #[arg(long, default_value_t = 0)]
    local_prefill_below: usize,
    /// No prefill node: the decode node prefills every prompt itself with the whole memory budget
    /// (the colocated baseline that disaggregation is compared with).
    #[arg(long, conflicts_with = "local_prefill_below")]
    colocated: bool,
    /// One node per GPU, on these GPUs (e.g. cuda:0,cuda:1) instead of every node on --device:
    /// the prefill node on the first and the decode node on the second, or with --colocated one
    /// colocated decode node on each; every node gets the whole --gpu-memory-utilization of its GPU.
    #[arg(long, value_delimiter = ',', value_name = "GPUS", value_parser = parse_gpu)]
    devices: Vec<tandem_engine::Device>,
    /// Random bf16 weights of this geometry instead of --model (benchmarks; needs --device cuda).
    #[arg(long, value_enum, value_name = "GEOMETRY")]
    random_weights: Option<crate::bench_disagg::Geometry>,
    /// With --random-weights: a directory with tokenizer.json within the geometry's vocabulary.
    #[arg(long, default_value = "tests/fixtures/tiny/llama", requires = "random_weights")]
    tokenizer_dir: std::path::PathBuf,
    /// Answer this prompt through the cluster (streamed to stdout), then shut down.
    #[arg(long)]
    prompt: Option<String>,
    /// With --prompt: render it with the chat template.
    #[arg(long)]
    chat: bool,
    /// With --prompt: most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// KV-transfer backend between the embedded nodes: auto (cuda-ipc for --device cuda, tcp
    /// otherwise), tcp, cuda-ipc, or nccl (with --devices: two GPUs).
    #[arg(long, default_value = "auto")]
    kv_connector: String,
    /// Require one of the API keys in this file (one per line; re-read on SIGHUP) on every request.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    tls: tls::TlsArgs,
    /// Only check the command line, then exit (no model is pulled or loaded, nothing bound).
    #[arg(long)]
    check: bool,
}

/// `tandem client`.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub(crate) struct ClientArgs {
    /// The router's address (HOST:PORT).
    #[arg(long)]
    router: String,
    /// The model [default: the one the cluster serves].
    #[arg(long, default_value = "")]
    model: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    top_k: Option<u32>,
    /// Seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings.
    #[arg(long)]
    stop: Vec<String>,
    /// Render the prompt with the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// The API key the router asks for (sent as `authorization: Bearer KEY`).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    tls: tls::ClientTlsArgs,
    /// The prompt.
    prompt: String,
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the tokio runtime")
}

/// Resolves when the process is asked to stop.
/// SIGTERM or Ctrl-C. The handlers are installed when this is called (not when the future is first
/// polled), so call it before announcing that the process serves: a signal sent right after the
/// announcement is then a clean stop, never the default disposition's kill.
fn stop_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async move {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

fn advertised(listen: SocketAddr, advertise: &Option<String>) -> String {
    let host = match advertise {
        Some(h) => h.clone(),
        None if listen.ip().is_unspecified() => "127.0.0.1".into(),
        None => listen.ip().to_string(),
    };
    if host.contains(':') { format!("[{host}]:{}", listen.port()) } else { format!("{host}:{}", listen.port()) }
}

/// Loads the TLS files (if any) and, with `etcd`, the etcd TLS files too: `--check`'s part of TLS.
fn check_tls(args: &tls::TlsArgs, etcd: Option<&EtcdArgs>) -> anyhow::Result<()> {
    let cluster = args.load()?;
    if let Some(etcd) = etcd {
        etcd.tls.load(&etcd.etcd, cluster.as_deref())?;
    }
    Ok(())
}

fn node_setup(args: &NodeArgs) -> anyhow::Result<NodeSetup> {
    // Before the model loads: a bad TLS file fails at once.
    let tls = args.tls.load()?;
    let (dir, engine) = args.engine.prepare(true)?;
    let on_gpu = matches!(engine.device, tandem_engine::Device::Cuda { .. });
    let mut kv_spec = args.kv_connector.parse::<ConnectorSpec>()?.resolve(on_gpu);
    // A connector bound to 0.0.0.0 (tcp://, nccl://) advertises the node's host, not loopback.
    match (&mut kv_spec, &args.advertise) {
        (ConnectorSpec::Tcp(opts), Some(host)) if opts.advertise.is_none() => opts.advertise = Some(host.clone()),
        (ConnectorSpec::Nccl(opts), Some(host)) if opts.advertise.is_none() => opts.advertise = Some(host.clone()),
        _ => {}
    }
    Ok(NodeSetup {
        model_name: args.engine.model_name(&dir),
        model_dir: dir,
        weights: Weights::Dir,
        engine,
        kv_spec,
        kv_config: ConnectorConfig::default(),
        tls,
        limits: args.limits.limits(),
    })
}

type SharedRegistration = Arc<std::sync::Mutex<Option<Registration>>>;

/// Publishes the node's load into membership until the registration is taken away.
fn publish_load(core: Arc<NodeCore>, registration: SharedRegistration) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let Ok(load) = core.engine.load().await else { return };
            let guard = registration.lock().unwrap_or_else(|p| p.into_inner());
            let Some(reg) = guard.as_ref() else { return };
            // `waiting` is what the node's --max-waiting-requests bounds (accepted, not started), so a
            // router can tell a full node from its load.
            let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
            reg.update_load(Load {
                waiting: n(core.admission.waiting().max(load.waiting)),
                running: n(load.running),
                free_blocks: n(load.free_blocks),
                total_blocks: n(load.total_blocks),
                max_waiting: n(core.admission.limit()),
            });
        }
    });
}

fn node_info(id: String, role: NodeRole, core: &NodeCore, grpc_addr: String) -> NodeInfo {
    NodeInfo {
        id,
        role,
        model: core.model_name.clone(),
        grpc_addr,
        kv_endpoint: core.connector.endpoint(),
        load: Load {
            waiting: 0,
            running: 0,
            free_blocks: core.num_blocks as u32,
            total_blocks: core.num_blocks as u32,
            max_waiting: u32::try_from(core.admission.limit()).unwrap_or(u32::MAX),
        },
    }
}

/// A node kind's gRPC service.
enum NodeService {
    Prefill(PrefillNode),
    Decode(DecodeNode),
}

impl NodeService {
    fn core(&self) -> &Arc<NodeCore> {
        match self {
            NodeService::Prefill(n) => n.core(),
            NodeService::Decode(n) => n.core(),
        }
    }
    fn role(&self) -> NodeRole {
        match self {
            NodeService::Prefill(_) => NodeRole::Prefill,
            NodeService::Decode(_) => NodeRole::Decode,
        }
    }
    /// The node's service name in the gRPC health protocol.
    fn health_name(&self) -> &'static str {
        use tonic::server::NamedService;
        match self {
            NodeService::Prefill(_) => <tandem_proto::node::v1::prefill_server::PrefillServer<PrefillNode> as NamedService>::NAME,
            NodeService::Decode(_) => <tandem_proto::node::v1::decode_server::DecodeServer<DecodeNode> as NamedService>::NAME,
        }
    }
    /// The node's gRPC server: mutual TLS (callers need a certificate of the cluster CA) with TLS.
    fn router(&self, health: &Health) -> anyhow::Result<tonic::transport::server::Router> {
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &self.core().tls {
            builder = builder.tls_config(tls.node_server()).context("the node's TLS configuration")?;
        }
        let router = match self {
            NodeService::Prefill(n) => builder.add_service(n.service()),
            NodeService::Decode(n) => builder.add_service(n.service()),
        };
        Ok(router.add_service(health.server()))
    }
}

/// When a server stops, and how long its drain may take from then.
struct Stop<F> {
    signal: F,
    drain_timeout: Duration,
}

/// Whether a node prints its serving line (a process of its own) or logs it (inside `tandem up`), and
/// the listener of its metrics, if any.
enum Announce {
    Stdout { metrics: Option<TcpListener> },
    Log,
}

/// Serves `GET /metrics` for `core` on `listener` for the life of the process, and `GET /health`:
/// 200 while the node serves, 503 once it drains or its engine is gone (what its gRPC health says;
/// plain HTTP, so probes work where the node API is mutual TLS, which kubelet cannot speak).
fn serve_node_metrics(core: Arc<NodeCore>, health: Health, listener: TcpListener) {
    use axum::http::{StatusCode, header};
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let core = Arc::clone(&core);
                async move { ([(header::CONTENT_TYPE, tandem_node::metrics::CONTENT_TYPE)], tandem_node::metrics::render_node(&core).await) }
            }),
        )
        .route(
            "/health",
            axum::routing::get(move || {
                let health = health.clone();
                async move {
                    if health.serving().await {
                        (StatusCode::OK, "SERVING\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n")
                    }
                }
            }),
        );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "serving metrics stopped");
        }
    });
}

/// Serves a node until `stop` resolves: registers, publishes load, drains on stop (health
/// NOT_SERVING, out of membership, serving on until the engine is idle; all within the drain timeout).
async fn serve_node(
    service: NodeService,
    listener: TcpListener,
    membership: &Membership,
    id: String,
    advertise: Option<String>,
    announce: Announce,
    stop: Stop<impl std::future::Future<Output = ()> + Send + 'static>,
) -> anyhow::Result<()> {
    let local = listener.local_addr()?;
    let grpc_addr = advertised(local, &advertise);
    let role = service.role();
    let core = Arc::clone(service.core());
    let health = Health::new(service.health_name(), ServingStatus::NotServing).await;
    let registration = membership.register(node_info(id, role, &core, grpc_addr.clone())).await.context("registering in membership")?;
    let registration: SharedRegistration = Arc::new(std::sync::Mutex::new(Some(registration)));
    publish_load(Arc::clone(&core), Arc::clone(&registration));
    health.set(ServingStatus::Serving).await;
    health::watch_engine(Arc::clone(&core), health.clone());
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let (deadline_tx, deadline_rx) = tokio::sync::oneshot::channel();
    let server = service.router(&health)?;
    let health_view = health.clone();
    let idle_core = Arc::clone(&core);
    let shutdown = async move {
        stop.signal.await;
        let deadline = tokio::time::Instant::now() + stop.drain_timeout;
        let _ = deadline_tx.send(deadline);
        // Probes see NOT_SERVING first, then the node leaves routing, then it finishes what is in flight.
        health.drain().await;
        let reg = registration.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(reg) = reg {
            let _ = reg.deregister().await;
        }
        health::wait_idle(&idle_core, deadline).await;
        let _ = drained_tx.send(());
    };
    let role_name = if role == NodeRole::Prefill { "prefill" } else { "decode" };
    if let Announce::Stdout { metrics } = announce {
        println!("tandem {role_name} serving on {grpc_addr}");
        if let Some(m) = metrics {
            let addr = m.local_addr()?;
            serve_node_metrics(Arc::clone(&core), health_view, m);
            println!("tandem {role_name}: metrics on http://{addr}/metrics");
        }
        let _ = std::io::stdout().flush();
    } else {
        tracing::info!(role = role_name, addr = %grpc_addr, "embedded node serving");
    }
    let serving = server.serve_with_incoming_shutdown(incoming(listener), shutdown);
    let Some(served) = health::within_drain(serving, deadline_rx).await else { return Ok(()) };
    served.context("serving the node API")?;
    let _ = drained_rx.await;
    Ok(())
}

/// The connections a server accepts, with Nagle's algorithm off (tonic sets it only on listeners it
/// binds itself): streamed tokens and small replies leave at once instead of waiting for the peer's
/// delayed ACK (~40 ms on Linux).
fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("listening on {addr}"))
}

fn default_id(role: &str, listener: &TcpListener) -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "node".into());
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    format!("{role}-{host}-{port}")
}

pub(crate) fn run_prefill(args: PrefillArgs) -> anyhow::Result<()> {
    if args.node.check {
        return args.node.check("prefill");
    }
    let setup = node_setup(&args.node)?;
    runtime()?.block_on(async {
        let membership = args.node.etcd.connect(setup.tls.as_deref()).await?;
        let listener = bind(args.node.listen).await?;
        let metrics = bind_optional(args.node.metrics_listen).await?;
        let peers = Peers::new(membership.watch().await.context("watching membership")?, setup.model_name.clone());
        let node = PrefillNode::start(setup, &Fabric::new(), peers).await?;
        let id = args.node.node_id.clone().unwrap_or_else(|| default_id("prefill", &listener));
        let announce = Announce::Stdout { metrics };
        let stop = Stop { signal: stop_signal(), drain_timeout: args.node.drain.timeout() };
        serve_node(NodeService::Prefill(node), listener, &membership, id, args.node.advertise.clone(), announce, stop).await
    })
}

pub(crate) fn run_decode(args: DecodeArgs) -> anyhow::Result<()> {
    if args.node.check {
        return args.node.check("decode");
    }
    let setup = node_setup(&args.node)?;
    let local_prefill_below = if args.colocated { usize::MAX } else { args.local_prefill_below };
    let opts = DecodeOptions { local_prefill_below, ..DecodeOptions::default() };
    runtime()?.block_on(async {
        let membership = args.node.etcd.connect(setup.tls.as_deref()).await?;
        let listener = bind(args.node.listen).await?;
        let metrics = bind_optional(args.node.metrics_listen).await?;
        let peers = Peers::new(membership.watch().await.context("watching membership")?, setup.model_name.clone());
        let node = DecodeNode::start(setup, opts, &Fabric::new(), peers).await?;
        let id = args.node.node_id.clone().unwrap_or_else(|| default_id("decode", &listener));
        let announce = Announce::Stdout { metrics };
        let stop = Stop { signal: stop_signal(), drain_timeout: args.node.drain.timeout() };
        serve_node(NodeService::Decode(node), listener, &membership, id, args.node.advertise.clone(), announce, stop).await
    })
}

/// The router's health: `tandem.v1.Tandem` follows whether it could route a request (see [`health`]).
async fn router_health(router: &Router, nodes: tokio::sync::watch::Receiver<Vec<NodeInfo>>) -> Health {
    use tonic::server::NamedService;
    let name = <tandem_proto::v1::tandem_server::TandemServer<Router> as NamedService>::NAME;
    let health = Health::new(name, ServingStatus::NotServing).await;
    health::watch_router(router.clone(), nodes, health.clone());
    health
}

/// Serves the router's gRPC client API (TLS with `tls`'s certificate, no client certificate asked for).
async fn serve_router(
    router: Router,
    listener: TcpListener,
    health: &Health,
    tls: Option<&tandem_node::tls::ClusterTls>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls.public_server()).context("the router's TLS configuration")?;
    }
    builder
        .add_service(router.service())
        .add_service(health.server())
        .serve_with_incoming_shutdown(incoming(listener), stop)
        .await
        .context("serving the client API")
}

/// Serves the OpenAI-compatible HTTP API (HTTPS with `tls`) until `stop` resolves (then finishes the
/// responses in flight).
async fn serve_http(
    router: Router,
    listener: TcpListener,
    tls: Option<&tandem_node::tls::ClusterTls>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    match tls {
        None => tandem_router::http::serve(router, listener, stop).await,
        Some(tls) => tandem_router::http::serve_tls(router, listener, tls.https_server(), stop).await,
    }
    .context("serving the OpenAI API")
}

/// The scheme the OpenAI API is announced with.
fn http_scheme(tls: Option<&tandem_node::tls::ClusterTls>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// Binds `addr` if there is one.
async fn bind_optional(addr: Option<SocketAddr>) -> anyhow::Result<Option<TcpListener>> {
    Ok(match addr {
        Some(a) => Some(bind(a).await?),
        None => None,
    })
}

pub(crate) fn run_router(args: RouterArgs) -> anyhow::Result<()> {
    if args.check {
        check::etcd(&args.etcd)?;
        check_tls(&args.tls, Some(&args.etcd))?;
        return check::ok("tandem router");
    }
    if let Some(file) = &args.api_key_file {
        // Before etcd is reached: a bad key file fails at once.
        tandem_router::read_key_file(file).map_err(anyhow::Error::msg)?;
    }
    let tls = args.tls.load()?;
    runtime()?.block_on(async {
        let membership = args.etcd.connect(tls.as_deref()).await?;
        let nodes = membership.watch().await.context("watching membership")?;
        let listener = bind(args.listen).await?;
        let http = bind_optional(args.http_listen).await?;
        let router = Router::new(nodes.clone(), args.policy);
        router.set_limits(args.limits.limits());
        router.set_max_migrations(args.max_migrations);
        if let Some(t) = &tls {
            router.set_node_tls(Arc::clone(t));
        }
        api_keys(&router, args.api_key_file.as_deref(), true)?;
        let health = router_health(&router, nodes).await;
        let signal = stop_signal();
        println!("tandem router serving on {}", listener.local_addr()?);
        if let Some(h) = &http {
            println!("tandem router: OpenAI API on {}://{}/v1", http_scheme(tls.as_deref()), h.local_addr()?);
        }
        let _ = std::io::stdout().flush();
        // On the signal: health NOT_SERVING, then both front ends finish what they have in flight.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let (deadline_tx, deadline_rx) = tokio::sync::oneshot::channel();
        let drain = args.drain.timeout();
        let draining = health.clone();
        tokio::spawn(async move {
            signal.await;
            let _ = deadline_tx.send(tokio::time::Instant::now() + drain);
            draining.drain().await;
            let _ = stop_tx.send(true);
        });
        let serving = async {
            match http {
                None => serve_router(router, listener, &health, tls.as_deref(), stopped(stop_rx)).await,
                Some(http) => {
                    let (grpc, http) = tokio::join!(
                        serve_router(router.clone(), listener, &health, tls.as_deref(), stopped(stop_rx.clone())),
                        serve_http(router, http, tls.as_deref(), stopped(stop_rx))
                    );
                    grpc.and(http)
                }
            }
        };
        health::within_drain(serving, deadline_rx).await.unwrap_or(Ok(()))
    })
}

/// One GPU of `--devices`: cuda:N (or cuda, GPU 0).
pub(crate) fn parse_gpu(s: &str) -> Result<tandem_engine::Device, String> {
    match s.parse::<tandem_engine::Device>() {
        Ok(d @ tandem_engine::Device::Cuda { .. }) => Ok(d),
        Ok(tandem_engine::Device::Cpu) => Err("--devices lists GPUs (cuda:N); one CPU engine per machine is --device cpu".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// `--devices` with the node layout: at least two different GPUs; exactly two unless colocated.
pub(crate) fn check_gpus(devices: &[tandem_engine::Device], colocated: bool) -> anyhow::Result<()> {
    if devices.is_empty() {
        return Ok(());
    }
    for (i, d) in devices.iter().enumerate() {
        anyhow::ensure!(!devices[..i].contains(d), "--devices names {d} twice: one node per GPU");
    }
    anyhow::ensure!(devices.len() >= 2, "--devices {}: name two GPUs or more (one GPU is --device)", devices[0]);
    anyhow::ensure!(
        colocated || devices.len() == 2,
        "--devices: a disaggregated cluster is one prefill and one decode node, on two GPUs (got {}); \
         --colocated runs one node per GPU on any number",
        devices.len()
    );
    Ok(())
}

pub(crate) fn run_up(mut args: UpArgs) -> anyhow::Result<()> {
    check_gpus(&args.devices, args.colocated)?;
    if let Some(&first) = args.devices.first() {
        args.engine.device = first; // the model is prepared (and checked) for a GPU
    }
    if args.check {
        check::engine(&args.engine, &args.kv_connector)?;
        check_tls(&args.tls, None)?;
        return check::ok("tandem up");
    }
    if let Some(file) = &args.api_key_file {
        // Before any model loads: a bad key file fails at once.
        tandem_router::read_key_file(file).map_err(anyhow::Error::msg)?;
    }
    let tls = args.tls.load()?;
    let (dir, weights, model_name, engine) = match args.random_weights {
        Some(geometry) => {
            let engine = args.engine.config(true)?;
            anyhow::ensure!(
                matches!(engine.device, tandem_engine::Device::Cuda { .. }),
                "--random-weights needs --device cuda (the CPU engine loads only checkpoints)"
            );
            let config_json = geometry.config_json().to_string();
            let weights = Weights::Random { config_json, tokenizer_dir: args.tokenizer_dir.clone(), seed: crate::bench_disagg::SEED };
            (std::path::PathBuf::new(), weights, geometry.name().to_string(), engine)
        }
        None => {
            let (dir, engine) = args.engine.prepare(true)?;
            let name = args.engine.model_name(&dir);
            (dir, Weights::Dir, name, engine)
        }
    };
    let on_gpu = matches!(engine.device, tandem_engine::Device::Cuda { .. });
    let setup = NodeSetup {
        model_dir: dir,
        weights,
        model_name,
        engine,
        kv_spec: args.kv_connector.parse::<ConnectorSpec>()?.resolve(on_gpu),
        kv_config: ConnectorConfig::default(),
        tls: tls.clone(),
        limits: tandem_node::admission::Limits::default(),
    };
    runtime()?.block_on(async {
        // A one-shot --prompt run answers on stdout only; otherwise the HTTP port is taken before the
        // models load, so a busy port fails at once.
        let http = if args.prompt.is_some() { None } else { bind_optional(args.http_listen.0).await? };
        let opts = EmbeddedOptions {
            setup,
            listen: args.listen,
            policy: args.policy,
            local_prefill_below: args.local_prefill_below,
            colocated: args.colocated,
            devices: args.devices.clone(),
            router_limits: args.limits.limits(),
        };
        let cluster = EmbeddedCluster::start(opts).await?;
        let gpus: Vec<String> = args.devices.iter().map(ToString::to_string).collect();
        tracing::info!(
            prefill_nodes = usize::from(cluster.prefill.is_some()),
            decode_nodes = cluster.decode_nodes,
            kv_backend = %cluster.decode.kv_backend,
            gpus = %gpus.join(","),
            "embedded cluster loaded"
        );
        let keys = api_keys(&cluster.router, args.api_key_file.as_deref(), args.prompt.is_none())?;
        // Serving until a signal (installed before the announcement); a --prompt run keeps Ctrl-C's
        // default (it ends the process).
        let signal = args.prompt.is_none().then(stop_signal);
        println!("tandem up: serving on {}", cluster.addr);
        if let Some(h) = &http {
            println!("tandem up: OpenAI API on {}://{}/v1", http_scheme(tls.as_deref()), h.local_addr()?);
        }
        let _ = std::io::stdout().flush();
        let outcome = match (signal, http) {
            (Some(signal), None) => {
                signal.await;
                Ok(())
            }
            (Some(signal), Some(listener)) => serve_http(cluster.router.clone(), listener, tls.as_deref(), signal).await,
            (None, _) => {
                let prompt = args.prompt.as_deref().unwrap_or_default();
                let req = request(prompt, args.chat, None, "", sampling(args.max_tokens, 0.0, None, None, None, Vec::new()));
                let client_tls = tls.as_ref().map(|t| t.client());
                stream_to_stdout(&cluster.addr.to_string(), req, keys.first().map(String::as_str), client_tls).await
            }
        };
        cluster.shutdown().await;
        outcome
    })
}

/// How to start an [`EmbeddedCluster`].
pub(crate) struct EmbeddedOptions {
    /// Both nodes' setup; on one GPU the prefill node gets half of `engine.gpu_memory_utilization`.
    pub(crate) setup: NodeSetup,
    /// Address the router serves the client API on.
    pub(crate) listen: SocketAddr,
    /// Routing policy.
    pub(crate) policy: Policy,
    /// The decode node prefills prompts with fewer uncached tokens than this itself (0: never).
    pub(crate) local_prefill_below: usize,
    /// No prefill node: the decode node prefills every prompt with the whole memory budget.
    pub(crate) colocated: bool,
    /// One node per GPU on these GPUs ([`check_gpus`]): the prefill node on the first and the decode
    /// node on the second, or colocated one decode node on each; every node with the whole budget of
    /// its GPU. Empty: every node on `setup.engine.device`.
    pub(crate) devices: Vec<tandem_engine::Device>,
    /// The router's overload limits.
    pub(crate) router_limits: tandem_router::Limits,
}

/// What one embedded node reports about itself.
pub(crate) struct EmbeddedNode {
    /// The KV connector's backend name (`Connector::backend`).
    pub(crate) kv_backend: String,
    /// Blocks in the node's KV pool.
    pub(crate) num_blocks: usize,
}

/// Router + one prefill + one decode node serving in this process with in-memory membership (what
/// `tandem up` runs). The nodes serve on loopback ports of their own; [`Self::shutdown`] drains them.
pub(crate) struct EmbeddedCluster {
    /// Where the router serves the client API.
    pub(crate) addr: SocketAddr,
    /// The prefill node (none when colocated).
    pub(crate) prefill: Option<EmbeddedNode>,
    /// The (first) decode node.
    pub(crate) decode: EmbeddedNode,
    /// Decode nodes in all (more than one: colocated on several GPUs).
    pub(crate) decode_nodes: usize,
    /// The router (serving gRPC on `addr`; more front ends may share it).
    pub(crate) router: Router,
    stop_tx: tokio::sync::watch::Sender<bool>,
    serving: tokio::task::JoinHandle<anyhow::Result<()>>,
    nodes: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl EmbeddedCluster {
    /// Loads the nodes (prefill first), waits until all registered, and starts the router.
    pub(crate) async fn start(opts: EmbeddedOptions) -> anyhow::Result<EmbeddedCluster> {
        check_gpus(&opts.devices, opts.colocated)?;
        let setup = opts.setup;
        let setup_tls = setup.tls.clone();
        let membership = Membership::memory();
        let fabric = Fabric::new();
        let on = |device: Option<&tandem_engine::Device>| {
            let mut s = setup.clone();
            if let Some(&d) = device {
                s.engine.device = d;
            }
            s
        };
        // On one GPU both engines share the memory budget: `gpu_memory_utilization` counts what is
        // in use already, so the prefill engine (loaded first) takes half and the decode engine the rest.
        // Colocated, the decode node alone takes the whole budget and prefills every prompt. With
        // --devices every node has a GPU, and its whole budget, of its own.
        let peers = Peers::new(membership.watch().await?, setup.model_name.clone());
        let prefill = if opts.colocated {
            None
        } else {
            let mut prefill_setup = on(opts.devices.first());
            if opts.devices.is_empty() {
                prefill_setup.engine.gpu_memory_utilization /= 2.0;
            }
            Some(PrefillNode::start(prefill_setup, &fabric, peers.clone()).await?)
        };
        let local_prefill_below = if opts.colocated { usize::MAX } else { opts.local_prefill_below };
        let decode_opts = DecodeOptions { local_prefill_below, ..DecodeOptions::default() };
        let decode_devices: Vec<Option<&tandem_engine::Device>> = match (opts.devices.is_empty(), opts.colocated) {
            (true, _) => vec![None],
            (false, true) => opts.devices.iter().map(Some).collect(),
            (false, false) => vec![opts.devices.get(1)],
        };
        let mut decodes = Vec::new();
        for d in decode_devices {
            decodes.push(DecodeNode::start(on(d), decode_opts.clone(), &fabric, peers.clone()).await?);
        }
        let report = |core: &NodeCore| EmbeddedNode { kv_backend: core.connector.backend().to_string(), num_blocks: core.num_blocks };
        let prefill_report = prefill.as_ref().map(|p| report(p.core()));
        let decode_report = report(decodes[0].core());
        let decode_nodes = decodes.len();
        let mut services = Vec::new();
        if let Some(p) = prefill {
            services.push((NodeService::Prefill(p), "prefill"));
        }
        services.extend(decodes.into_iter().map(|d| (NodeService::Decode(d), "decode")));
        let node_count = services.len();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut nodes = Vec::new();
        for (service, role) in services {
            let listener = bind("127.0.0.1:0".parse()?).await?;
            let id = default_id(role, &listener);
            let membership = membership.clone();
            let stop = Stop { signal: stopped(stop_rx.clone()), drain_timeout: EMBEDDED_DRAIN };
            nodes.push(tokio::spawn(async move { serve_node(service, listener, &membership, id, None, Announce::Log, stop).await }));
        }
        let watched = membership.watch().await?;
        // Wait until both nodes registered, so the first request finds them.
        let mut watch = watched.clone();
        tokio::time::timeout(Duration::from_secs(30), watch.wait_for(|n| n.len() >= node_count))
            .await
            .context("the embedded nodes did not register")?
            .context("membership closed")?;
        let listener = bind(opts.listen).await?;
        let addr = listener.local_addr()?;
        let router = Router::new(watched.clone(), opts.policy);
        router.set_limits(opts.router_limits);
        let tls = setup_tls;
        if let Some(t) = &tls {
            router.set_node_tls(Arc::clone(t));
        }
        let health = router_health(&router, watched).await;
        let stop = {
            let health = health.clone();
            async move {
                stopped(stop_rx).await;
                health.drain().await;
            }
        };
        let serving = {
            let router = router.clone();
            tokio::spawn(async move { serve_router(router, listener, &health, tls.as_deref(), stop).await })
        };
        Ok(EmbeddedCluster { addr, prefill: prefill_report, decode: decode_report, decode_nodes, router, stop_tx, serving, nodes })
    }

    /// Stops the router and drains both nodes (each finishes its requests in flight first).
    pub(crate) async fn shutdown(self) {
        let _ = self.stop_tx.send(true);
        let _ = self.serving.await;
        for t in self.nodes {
            let _ = t.await;
        }
    }
}

/// Resolves once `rx` says stop.
async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

fn sampling(max_tokens: u32, temperature: f32, top_p: Option<f32>, top_k: Option<u32>, seed: Option<u64>, stop: Vec<String>) -> api::SamplingParams {
    api::SamplingParams { max_tokens: Some(max_tokens), temperature: Some(temperature), top_p, top_k, seed, stop, ..Default::default() }
}

fn request(prompt: &str, chat: bool, system: Option<&str>, model: &str, sampling: api::SamplingParams) -> api::GenerateRequest {
    use api::generate_request::Prompt;
    let prompt = if chat {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(api::ChatMessage { role: "system".into(), content: s.into() });
        }
        messages.push(api::ChatMessage { role: "user".into(), content: prompt.into() });
        Prompt::Chat(api::Chat { messages })
    } else {
        Prompt::Text(prompt.into())
    };
    api::GenerateRequest { model: model.into(), prompt: Some(prompt), sampling: Some(sampling), request_id: String::new() }
}

/// Loads `file`'s API keys into `router` and re-reads them on SIGHUP (a file that no longer reads
/// keeps the previous keys); returns the keys. Without a file the router stays open, and says so
/// when `warn_open`.
fn api_keys(router: &Router, file: Option<&std::path::Path>, warn_open: bool) -> anyhow::Result<Vec<String>> {
    let Some(path) = file else {
        if warn_open {
            tracing::warn!("no --api-key-file: anyone who can reach the router's ports can use it");
        }
        return Ok(Vec::new());
    };
    let keys = tandem_router::read_key_file(path).map_err(anyhow::Error::msg)?;
    router.set_api_keys(Some(keys.clone()));
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = signal(SignalKind::hangup()).context("listening for SIGHUP")?;
        let (router, path) = (router.clone(), path.to_path_buf());
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match tandem_router::read_key_file(&path) {
                    Ok(keys) => {
                        tracing::info!(keys = keys.len(), "API keys re-read");
                        router.set_api_keys(Some(keys));
                    }
                    Err(e) => tracing::warn!(error = %e, "keeping the previous API keys"),
                }
            }
        });
    }
    Ok(keys)
}

/// Streams a completion to stdout as it arrives; the stats line goes to stderr.
async fn stream_to_stdout(
    router: &str,
    req: api::GenerateRequest,
    api_key: Option<&str>,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> anyhow::Result<()> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{router}"))
        .with_context(|| format!("router address {router:?}"))?
        .connect_timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).context("the client's TLS configuration")?;
    }
    let channel = endpoint.connect().await.with_context(|| format!("connecting to the router at {router}"))?;
    let mut client = TandemClient::new(channel);
    let mut req = tonic::Request::new(req);
    if let Some(key) = api_key {
        let value = format!("Bearer {key}").parse().map_err(|_| anyhow::anyhow!("the API key must be visible ASCII"))?;
        req.metadata_mut().insert("authorization", value);
    }
    let mut stream = client.generate(req).await.map_err(status_error)?.into_inner();
    let mut stdout = std::io::stdout();
    while let Some(msg) = stream.next().await {
        let msg = msg.map_err(status_error)?;
        stdout.write_all(msg.text.as_bytes())?;
        stdout.flush()?;
        if let Some(u) = msg.usage {
            writeln!(stdout)?;
            let reason = api::FinishReason::try_from(msg.finish_reason).map(|r| r.as_str_name()).unwrap_or("?");
            eprintln!(
                "[{} prompt tokens ({} cached), {} completion tokens, {}]",
                u.prompt_tokens, u.cached_tokens, u.completion_tokens, reason
            );
        }
    }
    Ok(())
}

pub(crate) fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{} ({:?})", s.message(), s.code())
}

pub(crate) fn run_client(args: ClientArgs) -> anyhow::Result<()> {
    if args.prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let req = request(
        &args.prompt,
        args.chat,
        args.system.as_deref(),
        &args.model,
        sampling(args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed, args.stop.clone()),
    );
    let tls = args.tls.load()?;
    runtime()?.block_on(stream_to_stdout(&args.router, req, args.api_key.as_deref(), tls))
}

#[cfg(test)]
mod tests {
    use super::{check_gpus, parse_gpu};
    use tandem_engine::Device;

    #[test]
    fn devices_are_gpus_each_named_once() {
        assert_eq!(parse_gpu("cuda:1"), Ok(Device::Cuda { ordinal: 1 }));
        assert_eq!(parse_gpu("cuda"), Ok(Device::Cuda { ordinal: 0 }));
        assert!(parse_gpu("cpu").unwrap_err().contains("GPUs"));
        assert!(parse_gpu("gpu1").is_err());
        let (a, b, c) = (Device::Cuda { ordinal: 0 }, Device::Cuda { ordinal: 1 }, Device::Cuda { ordinal: 2 });
        assert!(check_gpus(&[], false).is_ok());
        assert!(check_gpus(&[a, b], false).is_ok());
        assert!(check_gpus(&[a, b, c], true).is_ok());
        let err = |d: &[Device], colocated| check_gpus(d, colocated).unwrap_err().to_string();
        assert!(err(&[a], true).contains("two GPUs or more"));
        assert!(err(&[a, a], false).contains("twice"));
        assert!(err(&[a, b, c], false).contains("one prefill and one decode node"));
    }
}
