//! The NCCL backend: device pools on any two GPUs, of one host or of two. A TCP connection carries
//! the control messages (`wire`); the bytes go through one NCCL communicator per link (per
//! sender → receiver pair), made once when the link opens and aborted when it closes.
//!
//! At connect the sender states its control protocol, NCCL version, GPU and pool layout; the
//! receiver checks them (two different GPUs, the same NCCL major.minor), creates the rendezvous
//! (`ncclGetUniqueId`, rank 0) and answers with its own; both ends then create the communicator in
//! the background (nonblocking `ncclCommInitRankConfig`, bounded) while the connector's handshake
//! runs, and allocate one staging buffer each (64 MiB, or one chunk if more). Chunks go in batches:
//! the chunks the connector hands over at once (the layers ready together), as many as fit the
//! staging buffer (at most 32). Per batch: the sender announces the frames in one message and
//! gathers their (scattered) blocks back to back into its staging buffer (one device pull); the
//! receiver's inbox names each chunk's destination blocks, the receiver answers "go", posts one
//! `ncclRecv` into its staging buffer, the sender `ncclSend`s the batch, waits, and reports; once
//! both the bytes and the report arrived, the receiver scatters the chunks it wants into their
//! blocks and sums each chunk's destination blocks in the same device pull, and reports them
//! landed with those sums, which the connector core compares with the sender's before anything
//! is reported.
//!
//! Endpoint: `nccl://HOST:PORT` (the control channel; NCCL's own bootstrap and data connections
//! are NCCL's: `NCCL_SOCKET_IFNAME` and friends choose their interfaces).
//!
//! Invariants (besides those of every transport):
//! - Payloads only flow from the side that connected (the sender) to the side that accepted.
//! - Every posted receive is matched by one send of the same length (a sender whose staging failed
//!   sends its buffer anyway and reports the failure; a receiver that wants only some chunks of a
//!   batch receives all of it), so the pair's NCCL operations never get out of step; a link whose NCCL operation failed is closed, and its communicator aborted.
//! - NCCL only ever writes the staging buffers; destination blocks are written by the scatter
//!   pull alone, after the receive completed and before `on_payload`, so a link closing mid-batch
//!   needs no grace period: `on_payload` follows at once and the blocks are untouched.
//! - One NCCL operation at a time per GPU in the process (NCCL forbids issuing operations on
//!   communicators of one device from several threads at once, and concurrent kernels of different
//!   communicators may wait on each other); a receiver takes its GPU's turn before it says "go", a
//!   sender only after it heard "go", so a turn never waits on a peer that is itself waiting for a
//!   turn (senders only send, receivers only receive).
//! - Every wait is bounded: communicator creation by `INIT` (60 s), an operation by the link (closed at
//!   the transfer's deadline or when the peer goes), an accepted connection's handshake by 5 s and
//!   its silence by 90 s; each control message is at most 64 KiB.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::MAX_CHUNK_BLOCKS;
use crate::core::lock;
use crate::device::{Blocks, DeviceKv, PULL_SLOTS};
use crate::error::{Error, Result};
use crate::memory::{Iov, KvMemory, MemoryKind};
use crate::transport::link_state::{Closed, LinkState};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

mod ffi;
mod wire;

pub use ffi::library_version;
use ffi::{Comm, DeviceBuffer, Dir, UniqueId};
use wire::{Control, Side};

/// Where the control channel listens, what it advertises, and the integrity test hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// Listen address of the control channel; port 0 picks a free port. Peers on other hosts need
    /// an address they can reach (e.g. `0.0.0.0:PORT` with [`NcclOptions::advertise`]).
    pub bind: SocketAddr,
    /// Host name or IP peers dial (default: the bind IP, or 127.0.0.1 if that is unspecified).
    pub advertise: Option<String>,
    /// Test hook: flip one byte of every Nth chunk this transport stages for sending (at most one
    /// chunk per batch), after the gather, so the receiver's verification must catch it. Also set by the environment variable
    /// `TANDEM_KV_TEST_CORRUPT_CHUNK=N` (for tests that drive whole processes).
    pub corrupt_every: Option<u64>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            bind: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            advertise: None,
            corrupt_every: None,
        }
    }
}

const HANDSHAKE: Duration = Duration::from_secs(5);
/// How long an accepted link may stay silent between messages (senders stop reusing a link after
/// 30 s idle, see the connector core).
const IDLE: Duration = Duration::from_secs(90);
/// How long creating a link's communicator may take.
const INIT: Duration = Duration::from_secs(60);
/// Most accepted links open at once (each holds a communicator and a staging buffer on the GPU).
const MAX_INCOMING: usize = 64;
/// Bytes of each link's staging buffer on each side (more when one chunk needs more): a batch of
/// chunks goes through NCCL as one operation of at most this much.
const STAGING_TARGET: usize = 64 << 20;
/// Ranks of a link's communicator.
const RANK_RECEIVER: i32 = 0;
const RANK_SENDER: i32 = 1;


/// GPU `ordinal`'s turn: held by a link from posting an NCCL operation until it completed.
fn gpu_turn(ordinal: i32) -> Arc<tokio::sync::Mutex<()>> {
    static TURNS: OnceLock<Mutex<HashMap<i32, Arc<tokio::sync::Mutex<()>>>>> = OnceLock::new();
    Arc::clone(
        lock(TURNS.get_or_init(Mutex::default))
            .entry(ordinal)
            .or_default(),
    )
}

/// The NCCL transport; see the module doc.
pub struct NcclTransport {
    endpoint: String,
    memory: Arc<KvMemory>,
    device: Arc<DeviceKv>,
    ordinal: i32,
    inbox: Arc<dyn Inbox>,
    /// What this end states at connect.
    side: Side,
    staging_bytes: usize,
    links: Mutex<HashMap<u64, Arc<NcclLink>>>,
    next_link: AtomicU64,
    accept: Mutex<Option<JoinHandle<()>>>,
    shut: AtomicBool,
    corrupt_every: Option<u64>,
    staged: AtomicU64,
    /// The device side's pull slots this transport's staging moves use (a permit per move).
    slots: Arc<tokio::sync::Semaphore>,
    free_slots: Mutex<Vec<usize>>,
    me: Weak<NcclTransport>,
}

impl NcclTransport {
    /// Loads NCCL, binds the control channel and accepts. Fails with `Unsupported` for a pool in
    /// host memory and with `Device` when NCCL cannot be loaded.
    pub(crate) async fn bind(
        opts: &NcclOptions,
        memory: Arc<KvMemory>,
        device: Option<Arc<DeviceKv>>,
        inbox: Arc<dyn Inbox>,
    ) -> Result<Arc<NcclTransport>> {
        let unsupported = |what: &str| Error::Unsupported {
            backend: "nccl".into(),
            what: what.into(),
        };
        let (Some(device), MemoryKind::Cuda { device: ordinal }) = (device, memory.kind()) else {
            return Err(unsupported("host memory (register the GPU's KV pool)"));
        };
        let nccl = ffi::api()?.version();
        let uuid = device
            .context()
            .uuid()
            .map_err(|e| Error::Device(format!("reading GPU {ordinal}'s UUID: {e}")))?;
        let g = memory.geometry();
        // Room for a batch of chunks: STAGING_TARGET, and at least one whole chunk.
        let staging_blocks = (STAGING_TARGET / g.block_bytes().max(1)).max(MAX_CHUNK_BLOCKS as usize);
        let staging_bytes = staging_blocks
            .checked_mul(g.block_bytes())
            .ok_or_else(|| Error::Invalid(format!("blocks of {} bytes", g.block_bytes())))?;
        let side = Side {
            version: wire::VERSION,
            nccl,
            gpu: uuid.bytes.map(|b| b as u8),
            block_bytes: g.block_bytes() as u64,
            num_layers: g.num_layers(),
        };
        let listener = TcpListener::bind(opts.bind)
            .await
            .map_err(|e| Error::Invalid(format!("cannot listen on {}: {e}", opts.bind)))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Invalid(format!("listener address: {e}")))?;
        let host = match &opts.advertise {
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => "127.0.0.1".to_string(),
            None => local.ip().to_string(),
        };
        let endpoint = if host.contains(':') && !host.starts_with('[') {
            format!("nccl://[{host}]:{}", local.port())
        } else {
            format!("nccl://{host}:{}", local.port())
        };
        let transport = Arc::new_cyclic(|me| NcclTransport {
            endpoint,
            memory,
            device,
            ordinal,
            inbox,
            side,
            staging_bytes,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            accept: Mutex::new(None),
            shut: AtomicBool::new(false),
            corrupt_every: opts.corrupt_every.or_else(super::corrupt_every_from_env),
            staged: AtomicU64::new(0),
            slots: Arc::new(tokio::sync::Semaphore::new(PULL_SLOTS)),
            free_slots: Mutex::new((0..PULL_SLOTS).rev().collect()),
            me: me.clone(),
        });
        let me = Arc::downgrade(&transport);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let Some(t) = me.upgrade() else { return };
                let incoming = lock(&t.links).values().filter(|l| !l.sender_side).count();
                if incoming >= MAX_INCOMING {
                    tracing::warn!(%peer, max = MAX_INCOMING, "nccl KV connection refused: too many incoming links are open");
                    continue;
                }
                tokio::spawn(async move { t.accept_one(stream, peer.to_string()).await });
            }
        });
        *lock(&transport.accept) = Some(task);
        Ok(transport)
    }

    async fn accept_one(self: Arc<Self>, mut stream: TcpStream, peer: String) {
        let _ = stream.set_nodelay(true);
        let theirs = match tokio::time::timeout(HANDSHAKE, wire::read(&mut stream)).await {
            Ok(Ok(Control::Hello(side))) => side,
            _ => return, // no handshake in time, or garbage: just close
        };
        let accepted = match wire::check_peer(&self.side, &theirs) {
            Ok(()) => {
                tokio::task::spawn_blocking(|| ffi::api().map_err(|e| e.to_string())?.unique_id())
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            }
            Err(reason) => Err(reason),
        };
        match accepted {
            Ok(id) => {
                if wire::write(&mut stream, &Control::Accept(self.side, id))
                    .await
                    .is_ok()
                {
                    self.adopt(stream, peer, false, theirs, id);
                }
            }
            Err(reason) => {
                let _ = wire::write(&mut stream, &Control::Refuse(reason)).await;
            }
        }
    }

    /// Registers a connection whose handshake succeeded, starts its reader and its communicator.
    fn adopt(
        &self,
        stream: TcpStream,
        peer: String,
        sender_side: bool,
        theirs: Side,
        id: UniqueId,
    ) -> Arc<NcclLink> {
        let (rd, wr) = stream.into_split();
        let (state, closed_rx) = LinkState::new(peer);
        let (gpu, _) = watch::channel(GpuState::Starting);
        let link = Arc::new(NcclLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            sender_side,
            writer: tokio::sync::Mutex::new(Some(wr)),
            state,
            closing: Closing(closed_rx.clone()),
            gpu,
            go: Mutex::new(None),
            transport: self.me.clone(),
        });
        lock(&self.links).insert(link.id, Arc::clone(&link));
        if self.shut.load(Ordering::Acquire) {
            link.close();
        }
        let reader = Reader {
            inbox: Arc::clone(&self.inbox),
            link: Arc::clone(&link),
            transport: self.me.clone(),
        };
        tokio::spawn(reader.run(rd, closed_rx));
        if self.side.same_layout(&theirs) {
            self.start_comm(
                &link,
                id,
                if sender_side {
                    RANK_SENDER
                } else {
                    RANK_RECEIVER
                },
            );
        } else {
            // The connector's handshake refuses this pair with the reason; no communicator for it.
            link.gpu.send_replace(GpuState::Failed(
                "the peer's pool has another layout".into(),
            ));
        }
        link
    }

    /// Creates the link's communicator and staging buffer in the background.
    fn start_comm(&self, link: &Arc<NcclLink>, id: UniqueId, rank: i32) {
        let (ctx, ordinal, bytes) = (self.device.context(), self.ordinal, self.staging_bytes);
        let closing = link.closing.clone();
        let link = Arc::clone(link);
        tokio::spawn(async move {
            let made = tokio::task::spawn_blocking(move || {
                LinkGpu::create(ctx, ordinal, &id, rank, bytes, &closing)
            })
            .await
            .unwrap_or_else(|e| Err(format!("the communicator task failed: {e}")));
            match made {
                Ok(gpu) => {
                    let gpu = Arc::new(gpu);
                    let mut published = false;
                    link.gpu.send_if_modified(|s| {
                        published = matches!(s, GpuState::Starting);
                        if published {
                            *s = GpuState::Ready(Arc::clone(&gpu));
                        }
                        published
                    });
                    if !published {
                        retire(gpu); // the link closed meanwhile
                    }
                }
                Err(reason) => {
                    tracing::debug!(peer = %link.state.peer(), %reason, "no NCCL communicator");
                    link.gpu.send_if_modified(|s| {
                        let starting = matches!(s, GpuState::Starting);
                        if starting {
                            *s = GpuState::Failed(reason.clone());
                        }
                        starting
                    });
                    link.state
                        .fail(format!("creating the NCCL communicator: {reason}"));
                }
            }
        });
    }

    /// Gathers the payloads' blocks into the link's staging buffer, back to back in order (the
    /// sender's half of a batch).
    async fn stage(&self, gpu: &Arc<LinkGpu>, payloads: Vec<Payload>) -> std::result::Result<(), String> {
        let bb = self.memory.geometry().block_bytes();
        let mut chunks = Vec::with_capacity(payloads.len());
        let (mut at, mut corrupt) = (0usize, None);
        for (i, payload) in payloads.iter().enumerate() {
            let Some((layer, ids)) = self.memory.blocks_of(payload.iovs()) else {
                return Err("a payload is not whole blocks of one layer of the pool".into());
            };
            let n = self.staged.fetch_add(1, Ordering::Relaxed) + 1;
            if self.corrupt_every.is_some_and(|k| n.is_multiple_of(k)) {
                corrupt = Some(i);
            }
            let count = ids.len();
            chunks.push((layer, ids, at as u32));
            at += count;
        }
        if at * bb > gpu.staging.bytes() {
            return Err(format!("{at} blocks exceed the staging buffer"));
        }
        // The payloads keep the source blocks claimed until the gather has run.
        let moved = self.staging_move(gpu, chunks, true, corrupt).await;
        drop(payloads);
        moved.map(|_| ())
    }

    /// Moves chunks `(layer, block ids, first staging block)` between the pool and the link's
    /// staging buffer on the device, in one pull of the device side: pool → staging (`gather`,
    /// the sender; `corrupt` names a chunk that gets one byte flipped in staging, the integrity
    /// test hook) or staging → pool (the receiver). Returns each chunk's checksum of its
    /// destination blocks as they are afterwards.
    async fn staging_move(
        &self,
        gpu: &Arc<LinkGpu>,
        chunks: Vec<(u32, Vec<u32>, u32)>,
        gather: bool,
        corrupt: Option<usize>,
    ) -> std::result::Result<Vec<u64>, String> {
        let bb = self.memory.geometry().block_bytes();
        let permit = Arc::clone(&self.slots).acquire_owned().await.map_err(|_| "transport shut down".to_string())?;
        let slot = lock(&self.free_slots).pop().ok_or("no free staging slot")?;
        let (memory, device, gpu) = (Arc::clone(&self.memory), Arc::clone(&self.device), Arc::clone(gpu));
        let moved = tokio::task::spawn_blocking(move || {
            let staging_blocks = (gpu.staging.bytes() / bb) as u32;
            let slots: Vec<Vec<u32>> = chunks.iter().map(|(_, ids, at)| (*at..*at + ids.len() as u32).collect()).collect();
            let pairs: Vec<(Blocks<'_>, Blocks<'_>)> = chunks
                .iter()
                .zip(&slots)
                .map(|((layer, ids, _), slots)| {
                    let pool = Blocks { base: memory.layer_base(*layer) as u64, num_blocks: memory.num_blocks(), ids };
                    let staging = Blocks { base: gpu.staging.ptr(), num_blocks: staging_blocks, ids: slots };
                    if gather { (pool, staging) } else { (staging, pool) }
                })
                .collect();
            let pull = device.pull(slot, &pairs, bb, corrupt, None).map_err(|e| e.to_string())?;
            pull.wait(&device).map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        lock(&self.free_slots).push(slot);
        drop(permit);
        moved
    }
}

impl Transport for NcclTransport {
    fn name(&self) -> &str {
        "nccl"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities(
            Capabilities::DEVICE_MEMORY | Capabilities::CROSS_HOST | Capabilities::CROSS_PROCESS,
        )
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let unreachable = |reason: String| Error::Unreachable {
                endpoint: endpoint.to_string(),
                reason,
            };
            let addr = endpoint
                .strip_prefix("nccl://")
                .ok_or_else(|| unreachable("not an nccl:// endpoint".into()))?;
            if self.shut.load(Ordering::Acquire) {
                return Err(Error::Shutdown);
            }
            let mut stream = TcpStream::connect(addr)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let _ = stream.set_nodelay(true);
            wire::write(&mut stream, &Control::Hello(self.side))
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let reply = tokio::time::timeout(HANDSHAKE, wire::read(&mut stream))
                .await
                .map_err(|_| unreachable("no nccl handshake reply".into()))?
                .map_err(unreachable)?;
            let (theirs, id) = match reply {
                Control::Accept(side, id) => (side, id),
                Control::Refuse(reason) => return Err(Error::Incompatible(reason)),
                other => {
                    return Err(unreachable(format!(
                        "unexpected handshake message {other:?}"
                    )));
                }
            };
            wire::check_peer(&self.side, &theirs).map_err(Error::Incompatible)?;
            let link: Arc<dyn Link> = self.adopt(stream, endpoint.to_string(), true, theirs, id);
            Ok(link)
        })
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        if let Some(task) = lock(&self.accept).take() {
            task.abort();
        }
        let links: Vec<Arc<NcclLink>> = lock(&self.links).drain().map(|(_, l)| l).collect();
        for link in links {
            link.close();
        }
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A link's device side: its communicator, a stream for its NCCL operations, its staging buffer.
struct LinkGpu {
    ordinal: i32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    staging: DeviceBuffer,
    /// `None` once aborted. Every NCCL call on the communicator is made under this lock.
    comm: Mutex<Option<Comm>>,
}

impl LinkGpu {
    /// Creates rank `rank` of the link's communicator (bounded by [`INIT`] and the link closing),
    /// then its stream and staging buffer. Blocking.
    fn create(
        ctx: Arc<CudaContext>,
        ordinal: i32,
        id: &UniqueId,
        rank: i32,
        staging_bytes: usize,
        closing: &Closing,
    ) -> std::result::Result<LinkGpu, String> {
        let api = ffi::api().map_err(|e| e.to_string())?;
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        let comm = Comm::start(api, id, rank, 2)?;
        let since = Instant::now();
        while !comm.ready()? {
            if closing.now() {
                return Err("link closed".into()); // dropping `comm` aborts it
            }
            if since.elapsed() > INIT {
                return Err(format!(
                    "no communicator within {INIT:?} (can the two hosts reach each other on NCCL's interfaces? see NCCL_SOCKET_IFNAME)"
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("creating the NCCL stream: {e}"))?;
        let staging = DeviceBuffer::new(&ctx, staging_bytes)?;
        Ok(LinkGpu {
            ordinal,
            ctx,
            stream,
            staging,
            comm: Mutex::new(Some(comm)),
        })
    }

    /// Runs one `ncclSend` or `ncclRecv` of the first `bytes` of the staging buffer and waits for it;
    /// a closing link ends the wait. Blocking.
    fn transfer(
        &self,
        dir: Dir,
        bytes: usize,
        closing: &Closing,
    ) -> std::result::Result<(), String> {
        if bytes > self.staging.bytes() {
            return Err(format!("a {bytes}-byte chunk exceeds the staging buffer"));
        }
        let stopped = || {
            if closing.now() {
                Err("link closed".to_string())
            } else {
                Ok(())
            }
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        let stream = self.stream.cu_stream() as *mut std::ffi::c_void;
        {
            let comm = lock(&self.comm);
            let comm = comm.as_ref().ok_or("the communicator was aborted")?;
            let peer = if dir == Dir::Send {
                RANK_RECEIVER
            } else {
                RANK_SENDER
            };
            // SAFETY: the staging buffer is this GPU's memory, at least `bytes` long, and only this
            // link's operations touch it, one at a time (the sender's writer lock, the receiver's
            // reader task); it lives as long as `self`, which outlives the wait below or the abort
            // that ends the operation; `stream` is this link's stream of the same context.
            unsafe { comm.p2p(dir, self.staging.ptr(), bytes, peer, stream) }?;
            // A nonblocking communicator may still be connecting to its peer: wait until issued.
            let since = Instant::now();
            while !comm.ready()? {
                stopped()?;
                ffi::backoff(since);
            }
        }
        ffi::wait_stream(stream, || {
            stopped()?;
            match lock(&self.comm).as_ref() {
                Some(c) => c.ready().map(|_| ()),
                None => Err("the communicator was aborted".into()),
            }
        })
    }

    /// Aborts the communicator (once). Blocking.
    fn abort(&self) {
        let comm = lock(&self.comm).take();
        if let Some(comm) = comm {
            comm.abort();
        }
    }
}

/// Aborts a link's communicator, off the async runtime (it may wait for NCCL's threads); the staging
/// buffer goes with the last holder of `gpu`.
fn retire(gpu: Arc<LinkGpu>) {
    ffi::off_runtime(move || gpu.abort());
}

/// Whether a link is closing, for blocking threads (a receiver of its state).
#[derive(Clone)]
struct Closing(watch::Receiver<Closed>);

impl Closing {
    fn now(&self) -> bool {
        *self.0.borrow() != Closed::Open
    }
}

/// Where a link's communicator is.
#[derive(Clone)]
enum GpuState {
    Starting,
    Ready(Arc<LinkGpu>),
    Failed(String),
}

/// One control connection and its communicator.
struct NcclLink {
    id: u64,
    /// Connected from here (payloads go out), or accepted (payloads come in).
    sender_side: bool,
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    state: LinkState,
    closing: Closing,
    gpu: watch::Sender<GpuState>,
    /// Sender side: the send waiting for the receiver's go-ahead.
    go: Mutex<Option<oneshot::Sender<bool>>>,
    transport: Weak<NcclTransport>,
}

impl NcclLink {
    fn link_err(&self, reason: impl Into<String>) -> Error {
        self.state.err(reason)
    }

    /// The communicator, once made.
    async fn ready_gpu(&self) -> std::result::Result<Arc<LinkGpu>, String> {
        let mut rx = self.gpu.subscribe();
        let state = rx
            .wait_for(|s| !matches!(s, GpuState::Starting))
            .await
            .map_err(|_| "link closed".to_string())?
            .clone();
        match state {
            GpuState::Ready(gpu) => Ok(gpu),
            GpuState::Failed(reason) => Err(format!("no NCCL communicator: {reason}")),
            GpuState::Starting => Err("no NCCL communicator".into()),
        }
    }

    /// Aborts the communicator (or makes sure one still being created is): the link is closing.
    fn retire_gpu(&self) {
        if let GpuState::Ready(gpu) = self
            .gpu
            .send_replace(GpuState::Failed("link closed".into()))
        {
            retire(gpu);
        }
    }

    async fn write(&self, wr: &mut OwnedWriteHalf, msg: &Control) -> Result<()> {
        let mut torn = self.state.torn_guard();
        wire::write(wr, msg)
            .await
            .map_err(|e| self.link_err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// Messages (sender side), in order: those without payload as they are, runs of those with
    /// one as batches (as many as the staging buffer and [`wire::MAX_BATCH`] allow), each one
    /// exchange: announce, gather, wait for the go-ahead, one send, report.
    async fn send_messages(&self, messages: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else {
            return Err(self.link_err("link closed"));
        };
        let capacity = self.transport.upgrade().map_or(0, |t| t.staging_bytes as u64);
        let mut group: Vec<(Vec<u8>, Payload)> = Vec::new();
        let mut bytes = 0u64;
        for (header, payload) in messages {
            let full = !group.is_empty() && (payload.is_empty() || bytes + payload.len() > capacity || group.len() == wire::MAX_BATCH);
            if full {
                self.send_group(wr, std::mem::take(&mut group)).await?;
                bytes = 0;
            }
            if payload.is_empty() {
                self.write(wr, &Control::Msg { payload_len: 0, header }).await?;
            } else {
                bytes += payload.len();
                group.push((header, payload));
            }
        }
        if !group.is_empty() {
            self.send_group(wr, group).await?;
        }
        Ok(())
    }

    /// One batch of messages with payloads (see [`NcclLink::send_messages`]).
    async fn send_group(&self, wr: &mut OwnedWriteHalf, group: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        let (Some(t), true) = (self.transport.upgrade(), self.sender_side) else {
            return Err(Error::Unsupported {
                backend: "nccl".into(),
                what: "payloads from the accepting side".into(),
            });
        };
        let bytes: u64 = group.iter().map(|(_, p)| p.len()).sum();
        if bytes > t.staging_bytes as u64 {
            return Err(Error::Invalid(format!("a {bytes}-byte payload exceeds the nccl staging buffer")));
        }
        let (items, payloads): (Vec<(u64, Vec<u8>)>, Vec<Payload>) = group.into_iter().map(|(h, p)| ((p.len(), h), p)).unzip();
        // From the announcement to the report the pair's NCCL operations are in step: abandoning
        // the batch anywhere in between (deadline, failure) closes the link.
        let mut torn = self.state.torn_guard();
        let (tx, rx) = oneshot::channel();
        *lock(&self.go) = Some(tx);
        wire::write(wr, &Control::Batch(items))
            .await
            .map_err(|e| self.link_err(e.to_string()))?;
        let gpu = self.ready_gpu().await.map_err(|e| self.link_err(e))?;
        // Gather while the receiver gets ready.
        let n = payloads.len();
        let staged = t.stage(&gpu, payloads).await;
        super::kv_trace!("nccl batch of {n} ({bytes} bytes) gathered");
        let go = rx
            .await
            .map_err(|_| self.link_err("link closed before the receiver answered"))?;
        if !go {
            torn.disarm();
            return Ok(()); // the receiver drops these payloads: nothing goes through NCCL
        }
        let turn = gpu_turn(gpu.ordinal).lock_owned().await;
        let (g, closing) = (Arc::clone(&gpu), self.closing.clone());
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            g.transfer(Dir::Send, bytes as usize, &closing)
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()))
        .map_err(|e| self.link_err(format!("sending chunks through NCCL: {e}")))?;
        super::kv_trace!("nccl batch of {n} sent");
        wire::write(wr, &Control::Sent(staged.clone()))
            .await
            .map_err(|e| self.link_err(e.to_string()))?;
        torn.disarm();
        staged.map_err(|e| Error::Device(format!("staging chunks for NCCL: {e}")))
    }

    /// A control message from the receiving side.
    async fn reply(&self, msg: &Control) -> Result<()> {
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else {
            return Err(self.link_err("link closed"));
        };
        self.write(wr, msg).await
    }
}

impl Link for NcclLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn peer(&self) -> &str {
        self.state.peer()
    }

    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.state.guarded(self.send_messages(vec![(header, payload)])))
    }

    fn send_batch(&self, messages: Vec<(Vec<u8>, Payload)>) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.state.guarded(self.send_messages(messages)))
    }

    fn close(&self) {
        self.state.close();
    }
}

/// How a received chunk failed: only its payload (the link stays in step), or the link.
enum Failure {
    Payload(String),
    Link(String),
}

/// The reading half of one link, run as a task.
struct Reader {
    inbox: Arc<dyn Inbox>,
    link: Arc<NcclLink>,
    transport: Weak<NcclTransport>,
}

impl Reader {
    async fn run(self, mut rd: OwnedReadHalf, mut closed: watch::Receiver<Closed>) {
        let dyn_link: Arc<dyn Link> = Arc::clone(&self.link) as Arc<dyn Link>;
        let idle = (!self.link.sender_side).then_some(IDLE);
        let natural = loop {
            let next = async {
                match idle {
                    Some(d) => tokio::time::timeout(d, wire::read(&mut rd))
                        .await
                        .unwrap_or_else(|_| Err(format!("idle for {d:?}"))),
                    None => wire::read(&mut rd).await,
                }
            };
            let msg = tokio::select! {
                m = next => m,
                _ = closed.wait_for(|c| *c != Closed::Open) => break "link closed".to_string(),
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => break e,
            };
            if let Err(reason) = self.one(msg, &dyn_link, &mut rd, &mut closed).await {
                break reason;
            }
        };
        self.link.state.fail(natural);
        let how = closed.borrow().clone();
        lock(&self.link.go).take();
        self.link.retire_gpu();
        if let Some(t) = self.transport.upgrade() {
            lock(&t.links).remove(&self.link.id);
        }
        if let Some(mut wr) = self.link.writer.lock().await.take() {
            let _ = wr.shutdown().await;
        }
        if let Closed::Failed(reason) = how {
            tracing::debug!(peer = %self.link.state.peer(), %reason, "nccl link closed");
            self.inbox.on_link_closed(&dyn_link, reason);
        }
    }

    async fn one(
        &self,
        msg: Control,
        link: &Arc<dyn Link>,
        rd: &mut OwnedReadHalf,
        closed: &mut watch::Receiver<Closed>,
    ) -> std::result::Result<(), String> {
        let sender_side = self.link.sender_side;
        match msg {
            Control::Msg {
                payload_len: 0,
                header,
            } => match self.inbox.on_message(link, &header, 0) {
                Delivery::CloseLink(reason) => Err(reason),
                Delivery::Discard => Ok(()),
                Delivery::Into { token, .. } => {
                    self.inbox.on_payload(link, token, Ok(Landed::default()));
                    Ok(())
                }
            },
            Control::Msg { .. } => Err("a payload announced outside a batch".into()),
            Control::Batch(_) if sender_side => Err("payload from the accepting side".into()),
            Control::Batch(items) => {
                // A batch waits for the communicator before the inbox hears of it: the connector
                // then counts only the bytes' movement as the chunks', not the communicator's
                // creation (a transfer's deadline never closes the link over it).
                let gpu = tokio::select! {
                    g = self.link.ready_gpu() => g?,
                    _ = closed.wait_for(|c| *c != Closed::Open) => return Err("link closed".into()),
                };
                let mut wanted: Vec<(usize, u64, Vec<Iov>)> = Vec::new();
                for (i, (len, header)) in items.iter().enumerate() {
                    match self.inbox.on_message(link, header, *len) {
                        Delivery::CloseLink(reason) => {
                            for (_, token, _) in wanted {
                                self.inbox.on_payload(link, token, Err(format!("the payload was not written: {reason}")));
                            }
                            return Err(reason);
                        }
                        Delivery::Discard => {}
                        Delivery::Into { iovs, token } => wanted.push((i, token, iovs)),
                    }
                }
                if wanted.is_empty() {
                    return self.link.reply(&Control::Go(false)).await.map_err(|e| e.to_string());
                }
                let lens: Vec<u64> = items.iter().map(|(len, _)| *len).collect();
                let tokens: Vec<u64> = wanted.iter().map(|(_, token, _)| *token).collect();
                match self.receive(rd, closed, &gpu, &lens, wanted).await {
                    Ok(sums) => {
                        for (token, sum) in tokens.into_iter().zip(sums) {
                            self.inbox.on_payload(link, token, Ok(Landed { checksum: Some(sum) }));
                        }
                        Ok(())
                    }
                    Err(Failure::Payload(reason)) => {
                        for token in tokens {
                            self.inbox.on_payload(link, token, Err(reason.clone()));
                        }
                        Ok(())
                    }
                    Err(Failure::Link(reason)) => {
                        for token in tokens {
                            self.inbox.on_payload(link, token, Err(format!("the payload was not written: {reason}")));
                        }
                        Err(reason)
                    }
                }
            }
            Control::Go(ready) if sender_side => match lock(&self.link.go).take() {
                Some(tx) => {
                    let _ = tx.send(ready);
                    Ok(())
                }
                None => Err("a go-ahead nobody asked for".into()),
            },
            other => Err(format!("unexpected nccl control message {other:?}")),
        }
    }

    /// Receives a batch of payloads of `lens` bytes (back to back, one NCCL receive) and scatters
    /// those `wanted` — `(index in the batch, token, destination iovecs)` — into their blocks (the
    /// receiver's half); returns the checksum of each wanted chunk's destination blocks after the
    /// scatter, in order. On return nothing writes the destination blocks any more.
    async fn receive(
        &self,
        rd: &mut OwnedReadHalf,
        closed: &mut watch::Receiver<Closed>,
        gpu: &Arc<LinkGpu>,
        lens: &[u64],
        wanted: Vec<(usize, u64, Vec<Iov>)>,
    ) -> std::result::Result<Vec<u64>, Failure> {
        let link = &self.link;
        let t = self
            .transport
            .upgrade()
            .ok_or(Failure::Link("the transport is gone".into()))?;
        let bb = t.memory.geometry().block_bytes() as u64;
        let total = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l)).unwrap_or(u64::MAX);
        if total > gpu.staging.bytes() as u64 {
            return Err(Failure::Link(format!("a {total}-byte batch exceeds a staging buffer")));
        }
        // Where each payload starts in the staging buffer.
        let starts: Vec<u64> = lens.iter().scan(0u64, |at, &l| { let s = *at; *at += l; Some(s) }).collect();
        let mut chunks = Vec::with_capacity(wanted.len());
        for (i, _, iovs) in &wanted {
            let len = lens[*i];
            let located = t
                .memory
                .blocks_of(iovs)
                .filter(|(_, ids)| ids.len() as u64 * bb == len && starts[*i].is_multiple_of(bb));
            let Some((layer, ids)) = located else {
                return Err(Failure::Link(
                    "the destination is not whole blocks of one layer".into(),
                ));
            };
            chunks.push((layer, ids, (starts[*i] / bb) as u32));
        }
        let turn = tokio::select! {
            t = gpu_turn(gpu.ordinal).lock_owned() => t,
            _ = closed.wait_for(|c| *c != Closed::Open) => return Err(Failure::Link("link closed".into())),
        };
        link.reply(&Control::Go(true))
            .await
            .map_err(|e| Failure::Link(e.to_string()))?;
        let (g, closing) = (Arc::clone(gpu), link.closing.clone());
        let received = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            g.transfer(Dir::Recv, total as usize, &closing)
        });
        let report = tokio::select! {
            m = wire::read(rd) => match m {
                Ok(Control::Sent(verdict)) => Ok(verdict),
                Ok(other) => Err(format!("expected the sender's report, got {other:?}")),
                Err(e) => Err(e),
            },
            _ = closed.wait_for(|c| *c != Closed::Open) => Err("link closed".to_string()),
        };
        if let Err(reason) = &report {
            link.state.fail(reason.clone()); // ends the receive's wait
        }
        let received = received.await.unwrap_or_else(|e| Err(e.to_string()));
        let verdict = report.map_err(Failure::Link)?;
        received.map_err(|e| Failure::Link(format!("receiving chunks through NCCL: {e}")))?;
        verdict.map_err(|e| {
            Failure::Payload(format!("the sender could not stage the payload: {e}"))
        })?;
        super::kv_trace!("nccl batch of {} received", lens.len());
        let sums = t
            .staging_move(gpu, chunks, false, None)
            .await
            .map_err(|e| Failure::Payload(format!("scattering chunks: {e}")))?;
        super::kv_trace!("nccl batch of {} scattered and verified", lens.len());
        Ok(sums)
    }
}

/// A bare NCCL pair between two GPUs of this process: the ceiling the nccl backend is measured
/// against (`tandem bench kv --backend nccl --device cuda:A,cuda:B`).
pub struct RawNcclPair {
    /// One thread drives both ranks at a time.
    pair: Mutex<ffi::Pair>,
    devices: [i32; 2],
}

impl std::fmt::Debug for RawNcclPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawNcclPair")
            .field("devices", &self.devices)
            .finish()
    }
}

impl RawNcclPair {
    /// Creates a communicator of GPUs `src` (rank 0) and `dst` (rank 1). Blocks while NCCL
    /// connects them.
    pub fn new(src: i32, dst: i32) -> Result<RawNcclPair> {
        if src == dst {
            return Err(Error::Invalid(format!(
                "an NCCL pair needs two GPUs, not GPU {src} twice"
            )));
        }
        let (a, b) = (crate::device::context(src)?, crate::device::context(dst)?);
        let pair = ffi::Pair::new(&a, &b).map_err(|e| {
            Error::Device(format!(
                "creating an NCCL pair of GPUs {src} and {dst}: {e}"
            ))
        })?;
        Ok(RawNcclPair {
            pair: Mutex::new(pair),
            devices: [src, dst],
        })
    }

    /// One `ncclSend`/`ncclRecv` of the first `bytes` of `src`'s allocation into `dst`'s; returns the
    /// time from issuing it to both GPUs having finished. Blocks.
    pub fn send(&self, src: &KvMemory, dst: &KvMemory, bytes: usize) -> Result<Duration> {
        let on = |m: &KvMemory, d: i32| m.kind() == MemoryKind::Cuda { device: d };
        let (Some(a), Some(b)) = (src.device_allocation(), dst.device_allocation()) else {
            return Err(Error::Invalid(
                "a raw NCCL send needs two device pools".into(),
            ));
        };
        if !on(src, self.devices[0]) || !on(dst, self.devices[1]) {
            return Err(Error::Invalid(format!(
                "the pools are not on GPUs {} and {}",
                self.devices[0], self.devices[1]
            )));
        }
        if bytes > a.bytes.min(b.bytes) {
            return Err(Error::Invalid(format!("{bytes} bytes exceed the pools")));
        }
        // SAFETY: both ranges lie inside live device allocations of their GPUs (checked above) that
        // nothing else touches during a benchmark; the call waits for both GPUs before returning.
        unsafe { lock(&self.pair).send(a.base, b.base, bytes) }
            .map_err(|e| Error::Device(format!("raw NCCL send: {e}")))
    }
}
