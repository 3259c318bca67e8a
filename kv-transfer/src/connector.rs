//! The connector: one per node, bound to that node's registered block memory and one backend. The
//! decode side calls [`Connector::expect`] for blocks it allocated and hands the resulting
//! [`TransferDescriptor`] to the prefill side, which calls [`Connector::send`] and pushes layers as it
//! computes them.
//!
//! Invariants: a connector exchanges blocks only with peers whose geometry equals its memory's (checked
//! locally against the descriptor, and by the handshake); dropping the connector shuts its transport
//! down first, then fails every transfer still in flight and releases their claims.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::core::Core;
use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::handle::{RecvHandle, SendHandle};
use crate::memory::{KvMemory, MemoryKind};
use crate::transport::{Capabilities, Inbox, Transport, cuda_ipc, inproc, nccl, plugin, tcp};

/// Tunables shared by every backend.
#[derive(Debug, Clone)]
pub struct ConnectorConfig {
    /// Largest payload of one chunk (rounded down to whole blocks, at least one block).
    pub max_chunk_bytes: usize,
    /// Deadline of a transfer that names none.
    pub transfer_timeout: Duration,
    /// How long connecting plus handshaking may take.
    pub connect_timeout: Duration,
    /// A host pool's sender, too, announces its chunks before it sums them and sends the checksums
    /// after (`ChunkUnsummed`, then `Sums`), as a device pool's always does. Off by default: a host
    /// pool's sender sums each chunk before announcing it. (The conformance suite runs both ways.)
    pub sums_follow: bool,
    /// How long a receiver waits for a direct-writing sender's `Stopped` after fencing a failed
    /// transfer before it closes that link (and waits for the link's quiesce instead).
    pub fence_wait: Duration,
}

impl Default for ConnectorConfig {
    fn default() -> Self {
        ConnectorConfig {
            max_chunk_bytes: 1 << 20,
            transfer_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            sums_follow: false,
            fence_wait: Duration::from_secs(10),
        }
    }
}

/// Everything a sender needs to push blocks into a receiver's pool. Produced by [`Connector::expect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferDescriptor {
    /// Transfer id, unique per receiving connector.
    pub id: u64,
    /// The receiving connector's endpoint.
    pub endpoint: String,
    /// Destination block ids, in the order the source blocks are given.
    pub dst_blocks: Vec<u32>,
    /// The receiver's geometry.
    pub geometry: Geometry,
    /// What the destination blocks must come to hold, as the receiver names it: an opaque tag of the
    /// content (tandem: a hash of the prompt's tokens). A sender states the binding of the content it
    /// actually sends ([`Connector::send`]); the receiver refuses a transfer whose binding differs.
    pub binding: u64,
}

/// Counters for metrics, including the bandwidth self-check of the last transfer each way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Metrics {
    /// Transfers sent and confirmed.
    pub sent_ok: u64,
    /// Sends that failed or were cancelled.
    pub sent_failed: u64,
    /// Transfers received and verified.
    pub received_ok: u64,
    /// Receives that failed or were cancelled.
    pub received_failed: u64,
    /// Payload bytes of confirmed sends.
    pub bytes_sent: u64,
    /// Payload bytes of verified receives.
    pub bytes_received: u64,
    /// Achieved bandwidth of the last confirmed send.
    pub last_send_bytes_per_sec: u64,
    /// Achieved bandwidth of the last verified receive.
    pub last_recv_bytes_per_sec: u64,
    /// Sends in flight.
    pub sending: usize,
    /// Receives in flight (expected or landing).
    pub receiving: usize,
}

/// Which backend to use, as written in configuration (`--kv-connector`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorSpec {
    /// `tcp` or `tcp://HOST:PORT` (bind address; port 0 picks one).
    Tcp(tcp::TcpOptions),
    /// `inproc` or `inproc://NAME`: same-process peers through an [`inproc::Fabric`].
    Inproc(Option<String>),
    /// `cuda-ipc`: device pools of the same host, written directly through CUDA IPC.
    CudaIpc(cuda_ipc::CudaIpcOptions),
    /// `nccl` or `nccl://HOST:PORT` (the control channel's bind address; port 0 picks one): device
    /// pools on any two GPUs, of one host or of two, through one NCCL communicator per sender →
    /// receiver pair ([`nccl`]). Name it for CUDA pools on different hosts: `auto` picks cuda-ipc,
    /// which works within one host only.
    Nccl(nccl::NcclOptions),
    /// `auto`: the node picks ([`ConnectorSpec::resolve`]): cuda-ipc for a CUDA pool, tcp for a host
    /// one (never nccl: a cross-host CUDA pair names `nccl` explicitly).
    Auto,
    /// `plugin:/path/lib.so` or `plugin:/path/lib.so?config`.
    Plugin {
        /// The shared library.
        path: String,
        /// Text passed to the plugin's `create`.
        config: String,
    },
}

impl FromStr for ConnectorSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "KV connector {s:?}: {why} (expected auto, tcp, tcp://HOST:PORT, cuda-ipc, nccl, nccl://HOST:PORT, inproc, or plugin:/path/lib.so[?config])"
            ))
        };
        if s == "auto" {
            return Ok(ConnectorSpec::Auto);
        }
        if s == "cuda-ipc" {
            return Ok(ConnectorSpec::CudaIpc(cuda_ipc::CudaIpcOptions::default()));
        }
        if s == "nccl" {
            return Ok(ConnectorSpec::Nccl(nccl::NcclOptions::default()));
        }
        if let Some(addr) = s.strip_prefix("nccl://") {
            let bind = addr.parse().map_err(|_| bad("not a HOST:PORT socket address"))?;
            return Ok(ConnectorSpec::Nccl(nccl::NcclOptions { bind, ..nccl::NcclOptions::default() }));
        }
        if s == "tcp" {
            return Ok(ConnectorSpec::Tcp(tcp::TcpOptions::default()));
        }
        if let Some(addr) = s.strip_prefix("tcp://") {
            let bind = addr.parse().map_err(|_| bad("not a HOST:PORT socket address"))?;
            return Ok(ConnectorSpec::Tcp(tcp::TcpOptions { bind, ..tcp::TcpOptions::default() }));
        }
        if s == "inproc" {
            return Ok(ConnectorSpec::Inproc(None));
        }
        if let Some(name) = s.strip_prefix("inproc://") {
            if name.is_empty() {
                return Err(bad("empty inproc name"));
            }
            return Ok(ConnectorSpec::Inproc(Some(name.to_string())));
        }
        if let Some(rest) = s.strip_prefix("plugin:") {
            let (path, config) = rest.split_once('?').unwrap_or((rest, ""));
            if path.is_empty() {
                return Err(bad("empty plugin path"));
            }
            return Ok(ConnectorSpec::Plugin { path: path.to_string(), config: config.to_string() });
        }
        Err(bad("unknown backend"))
    }
}

impl ConnectorSpec {
    /// Resolves `auto` for a pool in device memory (`device: true`) or host memory: cuda-ipc for a
    /// CUDA pool, tcp for a host one. Other specs are returned as they are (CUDA pools on different
    /// hosts need an explicit `nccl`).
    pub fn resolve(self, device: bool) -> ConnectorSpec {
        match self {
            ConnectorSpec::Auto if device => ConnectorSpec::CudaIpc(cuda_ipc::CudaIpcOptions::default()),
            ConnectorSpec::Auto => ConnectorSpec::Tcp(tcp::TcpOptions::default()),
            other => other,
        }
    }

    /// Whether a node on a GPU registers its pool in device memory for this backend: device backends
    /// always, a plugin when it declares `TANDEM_KV_CAP_DEVICE_MEMORY` (read from the library), others
    /// never (they get a host copy of the pool).
    pub fn uses_device_memory(&self) -> Result<bool> {
        match self {
            ConnectorSpec::Plugin { path, .. } => {
                Ok(plugin::probe_capabilities(path)?.has(crate::transport::Capabilities::DEVICE_MEMORY))
            }
            other => Ok(other.wants_device_memory()),
        }
    }

    /// Whether the backend moves blocks in device memory (the node registers its GPU pool for it
    /// instead of a host copy).
    pub fn wants_device_memory(&self) -> bool {
        matches!(self, ConnectorSpec::CudaIpc(_) | ConnectorSpec::Nccl(_))
    }
}

/// A node's KV connector. Must be created and used inside a tokio runtime.
pub struct Connector {
    core: Arc<Core>,
    transport: Arc<dyn Transport>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("backend", &self.transport.name())
            .field("endpoint", &self.transport.endpoint())
            .finish()
    }
}

impl Connector {
    /// Builds a connector over `memory` with the backend `spec` names. `fabric` is used by `inproc`.
    pub async fn from_spec(
        spec: &ConnectorSpec,
        memory: Arc<KvMemory>,
        config: ConnectorConfig,
        fabric: &inproc::Fabric,
    ) -> Result<Connector> {
        let (spec, fabric, mem) = (spec.clone(), fabric.clone(), Arc::clone(&memory));
        Connector::build_with(memory, config, |inbox, device| async move {
            match &spec {
                ConnectorSpec::CudaIpc(opts) => {
                    Ok(cuda_ipc::CudaIpcTransport::bind(opts, mem, device, inbox).await? as Arc<dyn Transport>)
                }
                ConnectorSpec::Nccl(opts) => Ok(nccl::NcclTransport::bind(opts, mem, device, inbox).await? as Arc<dyn Transport>),
                _ => make_transport(&spec, &fabric, inbox).await,
            }
        })
        .await
    }

    /// Builds a connector over any [`Transport`] (the Rust-side plug point): `make` receives the inbox
    /// the transport must deliver to.
    pub async fn build<F, Fut>(memory: Arc<KvMemory>, config: ConnectorConfig, make: F) -> Result<Connector>
    where
        F: FnOnce(Arc<dyn Inbox>) -> Fut,
        Fut: std::future::Future<Output = Result<Arc<dyn Transport>>>,
    {
        Connector::build_with(memory, config, |inbox, _| make(inbox)).await
    }

    async fn build_with<F, Fut>(memory: Arc<KvMemory>, config: ConnectorConfig, make: F) -> Result<Connector>
    where
        F: FnOnce(Arc<dyn Inbox>, Option<Arc<crate::device::DeviceKv>>) -> Fut,
        Fut: std::future::Future<Output = Result<Arc<dyn Transport>>>,
    {
        if config.max_chunk_bytes == 0 || config.transfer_timeout.is_zero() || config.connect_timeout.is_zero() {
            return Err(Error::Invalid("chunk size and timeouts must be > 0".into()));
        }
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Invalid("a KV connector needs a tokio runtime".into()))?;
        let core = Core::new(Arc::clone(&memory), config, rt)?;
        let inbox: Arc<dyn Inbox> = Arc::clone(&core) as Arc<dyn Inbox>;
        let transport: Arc<dyn Transport> = make(inbox, core.device().cloned()).await?;
        let caps = transport.capabilities();
        let needed = match memory.kind() {
            MemoryKind::Host => (Capabilities::HOST_MEMORY, "host memory"),
            // Chunks in device memory are checksummed on the device by the core (`DeviceKv`).
            MemoryKind::Cuda { .. } => (Capabilities::DEVICE_MEMORY, "device memory"),
        };
        if !caps.has(needed.0) {
            transport.shutdown();
            return Err(Error::Unsupported { backend: transport.name().to_string(), what: needed.1.to_string() });
        }
        core.set_endpoint(transport.endpoint());
        Ok(Connector { core, transport })
    }

    /// The endpoint senders use to reach this connector.
    pub fn endpoint(&self) -> String {
        self.transport.endpoint()
    }

    /// The backend's name.
    pub fn backend(&self) -> &str {
        self.transport.name()
    }

    /// The registered block memory.
    pub fn memory(&self) -> &Arc<KvMemory> {
        self.core.memory()
    }

    /// Receiver side: reserves `dst_blocks` for an incoming transfer of the content tagged `binding`
    /// and returns its handle; send `handle.descriptor()` to the sender. Transfer ids are random (a
    /// descriptor cannot be guessed). Fails with [`Error::Timeout`] if not complete within `timeout`
    /// (default: the config's `transfer_timeout`), and with [`Error::Rejected`] if the sender states
    /// another binding.
    pub fn expect(&self, dst_blocks: Vec<u32>, binding: u64, timeout: Option<Duration>) -> Result<RecvHandle> {
        let handle = self.core.expect(dst_blocks, binding, timeout.unwrap_or(self.core_config_timeout()))?;
        self.transport.expecting();
        Ok(handle)
    }

    /// Sender side: starts pushing `src_blocks` (paired in order with `desc.dst_blocks`) to the receiver.
    /// `binding` tags the content the sender actually sends (computed by the sender from what it computed,
    /// never copied from `desc`); the receiver compares it with the binding it expects before any block
    /// lands. Nothing is sent for a layer until [`SendHandle::push_layer`] announces it.
    pub fn send(&self, desc: &TransferDescriptor, src_blocks: Vec<u32>, binding: u64, timeout: Option<Duration>) -> Result<SendHandle> {
        self.core.start_send(Arc::clone(&self.transport), desc, src_blocks, binding, timeout.unwrap_or(self.core_config_timeout()), false)
    }

    /// [`Connector::send`] of KV whose every layer is already computed (a bulk transfer: after a
    /// whole prefill, out of a prefix cache): the handle starts with every layer pushed, and the
    /// transfer's steps run on the calling thread until the first that waits — the link, every
    /// announcement and, for a device pool, the sender's checksums (a few hundred microseconds for
    /// hundreds of MiB; a link to open first, or a transport whose sends wait, hands the rest to
    /// the runtime sooner) — so the receiver starts on it without waiting for a runtime thread to
    /// wake. Call it from a thread that may block that long.
    pub fn send_ready(&self, desc: &TransferDescriptor, src_blocks: Vec<u32>, binding: u64, timeout: Option<Duration>) -> Result<SendHandle> {
        self.core.start_send(Arc::clone(&self.transport), desc, src_blocks, binding, timeout.unwrap_or(self.core_config_timeout()), true)
    }

    fn core_config_timeout(&self) -> Duration {
        self.core.config().transfer_timeout
    }

    /// Counters, including the achieved bandwidth of recent transfers.
    pub fn metrics(&self) -> Metrics {
        self.core.metrics()
    }
}

/// Creates the transport `spec` names, delivering to `inbox`.
pub async fn make_transport(spec: &ConnectorSpec, fabric: &inproc::Fabric, inbox: Arc<dyn Inbox>) -> Result<Arc<dyn Transport>> {
    Ok(match spec {
        ConnectorSpec::Tcp(opts) => tcp::TcpTransport::bind(opts, inbox).await? as Arc<dyn Transport>,
        ConnectorSpec::Inproc(name) => fabric.register(name.clone(), inbox)? as Arc<dyn Transport>,
        ConnectorSpec::Plugin { path, config } => plugin::PluginTransport::load(path, config, inbox)? as Arc<dyn Transport>,
        ConnectorSpec::CudaIpc(_) | ConnectorSpec::Nccl(_) => {
            return Err(Error::Unsupported {
                backend: if matches!(spec, ConnectorSpec::Nccl(_)) { "nccl" } else { "cuda-ipc" }.into(),
                what: "creation without the connector's memory (use Connector::from_spec)".into(),
            });
        }
        ConnectorSpec::Auto => return Err(Error::Invalid("resolve the `auto` KV connector first (ConnectorSpec::resolve)".into())),
    })
}

impl Drop for Connector {
    fn drop(&mut self) {
        self.transport.shutdown();
        self.core.shutdown();
    }
}
