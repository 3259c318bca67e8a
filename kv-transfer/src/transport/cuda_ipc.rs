//! The CUDA IPC backend (same host): the sender's copy engines push each chunk straight from its
//! device pool into the receiver's, no host memory and no socket on the data path, several chunks
//! in flight. A Unix socket carries the control messages. At connect the receiver exports its pool
//! (one `cuIpcGetMemHandle` of the allocation holding every layer) and the sender opens it once per
//! link (`cuIpcOpenMemHandle`; a receiver in the same process is used through its own addresses,
//! which CUDA requires, and kept alive by the link). Then, per batch of chunks:
//! 1. the sender announces its chunks (a group of them in one socket write) and goes on;
//! 2. the receiver takes every announcement already buffered as one batch, its inbox names each
//!    chunk's destination blocks, and it answers with all of them in one message;
//! 3. the sender enqueues one copy of the batch on a stream of its own (the copy engines,
//!    `cuMemcpyBatchAsync` over the contiguous runs, NVLink writes between GPUs; the copy kernel
//!    where the driver refuses that), and a completion thread reports the batch written once its
//!    event fired, then releases the source blocks;
//! 4. the receiver enqueues, in batch order, one verification launch over the destination blocks
//!    (a checksum per chunk) on a stream of its own, and its completion thread reports each chunk
//!    landed with that checksum, which the connector core compares with the sender's.
//!
//! Endpoint: `cuda-ipc://HOSTKEY/path/to/socket`, where HOSTKEY identifies this host's boot; a
//! sender on another host refuses the endpoint at connect (never a silent fall-back).
//!
//! Invariants (besides those of every transport):
//! - Payloads only flow from the side that connected (the sender) to the side that accepted; the
//!   sender writes only blocks the receiver's inbox named for that payload, and only after they were
//!   named.
//! - A sender keeps each payload (and the claim on its blocks) until its copy completed, or until
//!   the link closed before the receiver named its destination.
//! - A peer's mapping lives as long as the link and every copy still writing through it; a sender
//!   never writes a peer pool whose layout it did not check against its own geometry.
//! - Every `Delivery::Into` is answered by one `on_payload`, in delivery order, after the chunk's
//!   verification ran — or, when the link closes after its destination was named and before it was
//!   reported written, after a grace period (a live sender's copy has ended by then), so the
//!   blocks are not reused under a copy. `on_link_closed` comes after the last of them, and
//!   `shutdown` returns only when no copy or verification of this transport runs.
//! - An accepted connection must complete its handshake within 5 s; each control message is at most
//!   64 KiB.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;

use crate::core::lock;
use crate::device::{BatchOp, Blocks, DeviceKv, PULL_BATCH, PULL_SLOTS, PullEvent};
use crate::error::{Error, Result};
use crate::memory::KvMemory;
use crate::transport::link_state::{Closed, LinkState};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

/// Where the control socket goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaIpcOptions {
    /// Directory of the socket (default: the system's temporary directory).
    pub dir: Option<PathBuf>,
    /// Test hook: flip one byte in the destination of every Nth chunk this transport copies, after
    /// the copy, so the receiver's verification must catch it. Also set by the environment variable
    /// `TANDEM_KV_TEST_CORRUPT_CHUNK=N` (for tests that drive whole processes).
    pub corrupt_every: Option<u64>,
}

const HANDSHAKE: Duration = Duration::from_secs(5);
/// How long a receiver keeps named blocks claimed after its link closed before they were reported
/// written (a live sender's copy of a batch ends within milliseconds).
const WRITE_GRACE: Duration = Duration::from_millis(250);
/// How long `shutdown` waits for running copies and verifications before giving up.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
const MAX_MESSAGE: usize = 64 * 1024;
const VERSION: u16 = 3;

/// Sender → receiver: version and host.
const K_HELLO: u8 = 1;
/// Receiver → sender: the receiver's pool.
const K_POOL: u8 = 2;
const K_REFUSE: u8 = 3;
/// A message; with a payload, its sequence number on the link.
const K_MSG: u8 = 4;
/// Receiver → sender: the destinations of a batch of payloads (or that one is not wanted).
const K_WRITE_TO: u8 = 5;
/// Sender → receiver: the batch ending at this sequence number was written (or failed).
const K_WRITTEN: u8 = 6;

/// This host's identity (its boot), so an endpoint names the host it lives on.
fn host_key() -> u64 {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let id = format!("{}|{}", read("/proc/sys/kernel/hostname").trim(), read("/proc/sys/kernel/random/boot_id").trim());
    twox_hash::XxHash3_64::oneshot(id.as_bytes())
}

/// This process's exported pools by base address, so a sender in the same process (which uses a
/// receiver's own addresses) keeps the receiver's memory alive while it writes it.
fn local_pools() -> &'static Mutex<HashMap<u64, Weak<KvMemory>>> {
    static POOLS: OnceLock<Mutex<HashMap<u64, Weak<KvMemory>>>> = OnceLock::new();
    POOLS.get_or_init(Mutex::default)
}

/// A receiver's pool opened for writing: where each layer's blocks start in this process's address
/// space.
struct PeerPool {
    _mapping: Option<tandem_kernels::cuda::IpcMapping>,
    /// A receiver in this process: its memory, kept alive while copies write it.
    _local: Option<Arc<KvMemory>>,
    layer_bases: Vec<u64>,
    num_blocks: u32,
    block_bytes: u64,
}

/// Work the completion thread waits for, in the order it was enqueued.
enum Job {
    /// A sender's copy of a batch: report it written, then release the payloads.
    Copy { event: PullEvent, seq: u64, link: Arc<IpcLink>, _pool: Arc<PeerPool>, _payloads: Vec<Payload>, slot: usize, _permit: OwnedSemaphorePermit },
    /// A receiver's verification of a batch: report each chunk landed.
    Verify { event: PullEvent, tokens: Vec<u64>, link: Arc<IpcLink>, slot: usize, _permit: OwnedSemaphorePermit },
}

/// What enqueuing and reporting share (the transport and its completion thread).
struct Pulls {
    device: Arc<DeviceKv>,
    inbox: Arc<dyn Inbox>,
    free_slots: Mutex<Vec<usize>>,
    /// Jobs in flight over all links (shutdown waits for zero).
    running: Mutex<usize>,
    idle: Condvar,
}

impl Pulls {
    /// Waits for a job's kernels and copies, reports it, frees its slot.
    fn finish(&self, job: Job) {
        let (link, slot) = match job {
            Job::Copy { event, seq, link, _pool, _payloads, slot, _permit } => {
                let written = event.wait(&self.device);
                super::kv_trace!("ipc copy through seq {seq} done");
                let mut report = seq.to_le_bytes().to_vec();
                match &written {
                    Ok(_) => report.push(1),
                    Err(e) => {
                        report.push(0);
                        report.extend_from_slice(e.to_string().as_bytes());
                        report.truncate(1024);
                    }
                }
                link.post(K_WRITTEN, report);
                if written.is_err() {
                    link.close();
                }
                // The payloads (claims on the source blocks) go with `_payloads` here: no longer read.
                (link, slot)
            }
            Job::Verify { event, tokens, link, slot, _permit } => {
                let result = event.wait(&self.device);
                super::kv_trace!("ipc verification of {} done", tokens.len());
                let dyn_link: Arc<dyn Link> = Arc::clone(&link) as Arc<dyn Link>;
                match result {
                    Ok(sums) => {
                        for (&token, sum) in tokens.iter().zip(sums) {
                            self.inbox.on_payload(&dyn_link, token, Ok(Landed { checksum: Some(sum) }));
                        }
                    }
                    Err(e) => {
                        for &token in &tokens {
                            self.inbox.on_payload(&dyn_link, token, Err(e.to_string()));
                        }
                        link.close();
                    }
                }
                (link, slot)
            }
        };
        lock(&self.free_slots).push(slot);
        link.in_flight.send_modify(|n| *n -= 1);
        drop(link);
        let mut running = lock(&self.running);
        *running -= 1;
        if *running == 0 {
            self.idle.notify_all();
        }
    }
}

/// Waits for jobs in the order they were enqueued and reports them (one thread per transport; it
/// ends when the transport dropped its end of the queue and every job is reported).
fn completion_thread(jobs: std::sync::mpsc::Receiver<Job>, pulls: Arc<Pulls>) {
    let _ = pulls.device.context().bind_to_thread();
    while let Ok(job) = jobs.recv() {
        pulls.finish(job);
    }
}

/// The CUDA IPC transport; see the module doc.
pub struct CudaIpcTransport {
    endpoint: String,
    path: PathBuf,
    memory: Arc<KvMemory>,
    device: Arc<DeviceKv>,
    /// The GPU the pool lies on.
    ordinal: i32,
    inbox: Arc<dyn Inbox>,
    /// Our exported pool, as sent to senders (`K_POOL` body).
    pool_message: Vec<u8>,
    host: u64,
    links: Mutex<HashMap<u64, Arc<IpcLink>>>,
    next_link: AtomicU64,
    accept: Mutex<Option<JoinHandle<()>>>,
    shut: AtomicBool,
    corrupt_every: Option<u64>,
    copied: AtomicU64,
    /// Slots of the device side's asynchronous stream: a permit per job in flight.
    slots: Arc<Semaphore>,
    pulls: Arc<Pulls>,
    /// To the completion thread (`None` after shutdown).
    jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    me: Weak<CudaIpcTransport>,
}

impl CudaIpcTransport {
    /// Exports `memory` (device memory in one allocation), binds the control socket and accepts.
    pub(crate) async fn bind(
        opts: &CudaIpcOptions,
        memory: Arc<KvMemory>,
        device: Option<Arc<DeviceKv>>,
        inbox: Arc<dyn Inbox>,
    ) -> Result<Arc<CudaIpcTransport>> {
        let unsupported = |what: &str| Error::Unsupported { backend: "cuda-ipc".into(), what: what.into() };
        let device = device.ok_or_else(|| unsupported("host memory (register the GPU's KV pool)"))?;
        let allocation = memory.device_allocation().ok_or_else(|| unsupported("device memory outside one exportable allocation"))?;
        let crate::MemoryKind::Cuda { device: ordinal } = memory.kind() else {
            return Err(unsupported("host memory (register the GPU's KV pool)"));
        };
        let ctx = device.context();
        ctx.bind_to_thread().map_err(|e| Error::Device(format!("binding the context: {e}")))?;
        let mut handle = cudarc::driver::sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `allocation.base` is the start of a live cuMemAlloc allocation of this context (the
        // registered pool, kept alive by the memory this transport holds); `handle` is a valid out slot.
        unsafe { cudarc::driver::sys::cuIpcGetMemHandle(&mut handle, allocation.base) }
            .result()
            .map_err(|e| Error::Device(format!("exporting the KV pool (cuIpcGetMemHandle): {e}")))?;
        let host = host_key();
        let g = memory.geometry();
        let mut pool = Vec::with_capacity(128 + 8 * g.num_layers() as usize);
        pool.extend_from_slice(&VERSION.to_le_bytes());
        pool.extend_from_slice(&host.to_le_bytes());
        pool.extend_from_slice(&std::process::id().to_le_bytes());
        pool.extend(handle.reserved.iter().map(|&b| b as u8));
        pool.extend_from_slice(&allocation.base.to_le_bytes());
        pool.extend_from_slice(&(allocation.bytes as u64).to_le_bytes());
        pool.extend_from_slice(&memory.num_blocks().to_le_bytes());
        pool.extend_from_slice(&(g.block_bytes() as u64).to_le_bytes());
        pool.extend_from_slice(&g.num_layers().to_le_bytes());
        for l in 0..g.num_layers() {
            pool.extend_from_slice(&(memory.layer_base(l) as u64 - allocation.base).to_le_bytes());
        }
        lock(local_pools()).insert(allocation.base, Arc::downgrade(&memory));
        let dir = opts.dir.clone().unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("tandem-kv-{}-{:016x}.sock", std::process::id(), getrandom::u64().unwrap_or(0)));
        let listener = UnixListener::bind(&path).map_err(|e| Error::Invalid(format!("cannot listen on {}: {e}", path.display())))?;
        // Only this user may connect: the socket hands out write access to the GPU pool.
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        }
        let endpoint = format!("cuda-ipc://{host:016x}{}", path.display());
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
        let transport = Arc::new_cyclic(|me| CudaIpcTransport {
            endpoint,
            path,
            memory,
            ordinal,
            pool_message: pool,
            host,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            accept: Mutex::new(None),
            shut: AtomicBool::new(false),
            corrupt_every: opts.corrupt_every.or_else(super::corrupt_every_from_env),
            copied: AtomicU64::new(0),
            slots: Arc::new(Semaphore::new(PULL_SLOTS)),
            pulls: Arc::new(Pulls {
                device: Arc::clone(&device),
                inbox: Arc::clone(&inbox),
                free_slots: Mutex::new((0..PULL_SLOTS).rev().collect()),
                running: Mutex::new(0),
                idle: Condvar::new(),
            }),
            device,
            inbox,
            jobs: Mutex::new(Some(jobs_tx)),
            me: me.clone(),
        });
        let pulls = Arc::clone(&transport.pulls);
        std::thread::Builder::new()
            .name("tandem-kv-ipc".into())
            .spawn(move || completion_thread(jobs_rx, pulls))
            .map_err(|e| Error::Invalid(format!("starting the cuda-ipc completion thread: {e}")))?;
        let me = Arc::downgrade(&transport);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let Some(t) = me.upgrade() else { return };
                tokio::spawn(async move { t.accept_one(stream).await });
            }
        });
        *lock(&transport.accept) = Some(task);
        Ok(transport)
    }

    async fn accept_one(self: Arc<Self>, mut stream: UnixStream) {
        let hello = tokio::time::timeout(HANDSHAKE, read_message(&mut stream)).await;
        let verdict = match hello {
            Ok(Ok((K_HELLO, body))) if body.len() >= 10 => {
                let version = u16::from_le_bytes([body[0], body[1]]);
                let host = u64::from_le_bytes(body[2..10].try_into().expect("8 bytes"));
                if version != VERSION {
                    Err(format!("cuda-ipc version: receiver speaks {VERSION}, sender {version}"))
                } else if host != self.host {
                    Err("the sender is on another host: CUDA IPC works within one host only".to_string())
                } else {
                    Ok(())
                }
            }
            _ => return, // no handshake in time, or garbage: just close
        };
        match verdict {
            Ok(()) => {
                if write_message(&mut stream, K_POOL, &self.pool_message).await.is_err() {
                    return;
                }
                self.adopt(stream, "cuda-ipc peer".into(), None);
            }
            Err(reason) => {
                let _ = write_message(&mut stream, K_REFUSE, reason.as_bytes()).await;
            }
        }
    }

    /// `pool`: the receiver's pool on the sending side, `None` on the receiving side.
    fn adopt(&self, stream: UnixStream, peer: String, pool: Option<Arc<PeerPool>>) -> Arc<IpcLink> {
        let (rd, wr) = stream.into_split();
        let (state, closed_rx) = LinkState::new(peer);
        let (post_tx, post_rx) = tokio::sync::mpsc::unbounded_channel();
        let link = Arc::new(IpcLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            writer: tokio::sync::Mutex::new(Some(wr)),
            state,
            pool,
            announced: Mutex::new(VecDeque::new()),
            awaiting: Mutex::new(VecDeque::new()),
            next_seq: AtomicU64::new(1),
            in_flight: watch::Sender::new(0),
            posts: post_tx,
            transport: self.me.clone(),
        });
        lock(&self.links).insert(link.id, Arc::clone(&link));
        if self.shut.load(Ordering::Acquire) {
            link.close();
        }
        tokio::spawn(Arc::clone(&link).poster(post_rx));
        let reader = Reader { inbox: Arc::clone(&self.inbox), link: Arc::clone(&link), transport: self.me.clone() };
        tokio::spawn(reader.run(rd, closed_rx));
        link
    }

    /// Opens the receiver's pool from its `K_POOL` message.
    fn open_pool(&self, body: &[u8]) -> std::result::Result<PeerPool, String> {
        let mut r = Cursor { buf: body };
        let (version, host, pid) = (r.u16()?, r.u64()?, r.u32()?);
        if version != VERSION {
            return Err(format!("cuda-ipc version: sender speaks {VERSION}, receiver {version}"));
        }
        if host != self.host {
            return Err("the receiver is on another host".into());
        }
        let mut handle = [0u8; 64];
        for slot in handle.iter_mut() {
            *slot = r.u8()?;
        }
        let (base, bytes, num_blocks, block_bytes, num_layers) = (r.u64()?, r.u64()?, r.u32()?, r.u64()?, r.u32()?);
        // A pool of another geometry is refused by the connector's handshake (with the reason);
        // copies check the layout again before writing anything.
        if num_layers > 65_536 {
            return Err(format!("the receiver's pool claims {num_layers} layers"));
        }
        let layer_bytes = u64::from(num_blocks).checked_mul(block_bytes).ok_or("pool size overflows")?;
        let mut offsets = Vec::with_capacity(num_layers as usize);
        for _ in 0..num_layers {
            let off = r.u64()?;
            if off.checked_add(layer_bytes).is_none_or(|end| end > bytes) || off % 16 != 0 {
                return Err(format!("layer offset {off} lies outside the receiver's {bytes}-byte pool"));
            }
            offsets.push(off);
        }
        let (mapping, local, mapped) = if pid == std::process::id() {
            // CUDA refuses to open a handle in the process that exported it: the receiver's own
            // addresses serve (its memory kept alive through the registry), and if its pool lies on
            // another GPU, this GPU's copies need peer access to it (another process's mapping gets
            // it from the lazy flag of the open).
            let local = lock(local_pools()).get(&base).and_then(Weak::upgrade).ok_or("the receiver's pool is gone")?;
            let theirs = crate::device::device_of(self.ordinal, base).map_err(|e| e.to_string())?;
            crate::device::enable_peer_access(self.ordinal, theirs).map_err(|e| e.to_string())?;
            (None, Some(local), base)
        } else {
            let m = tandem_kernels::cuda::IpcMapping::open(&self.device.context(), &handle)
                .map_err(|e| format!("opening the receiver's pool (cuIpcOpenMemHandle): {e}"))?;
            let p = m.ptr();
            (Some(m), None, p)
        };
        Ok(PeerPool { _mapping: mapping, _local: local, layer_bases: offsets.iter().map(|o| mapped + o).collect(), num_blocks, block_bytes })
    }

    /// Hands a job to the completion thread (or, after shutdown, finishes it here).
    fn submit(&self, job: Job) {
        let tx = lock(&self.jobs).clone();
        let job = match tx {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        self.pulls.finish(job);
    }

    /// Sender side: copies a batch the receiver named destinations for into its pool.
    fn start_copy(&self, link: &Arc<IpcLink>, pool: &Arc<PeerPool>, batch: Vec<(Announced, u32, Vec<u32>)>, seq: u64, permit: OwnedSemaphorePermit) -> std::result::Result<(), String> {
        let bb = self.memory.geometry().block_bytes();
        if pool.block_bytes != bb as u64 || pool.layer_bases.len() != self.memory.geometry().num_layers() as usize {
            return Err("the receiver's pool has another layout than this one".into());
        }
        let mut chunks = Vec::with_capacity(batch.len());
        for (a, dst_layer, dst_ids) in &batch {
            let dst_base = *pool.layer_bases.get(*dst_layer as usize).ok_or_else(|| format!("destination layer {dst_layer} out of range"))?;
            if dst_ids.len() != a.ids.len() {
                return Err(format!("{} source blocks, the receiver names {}", a.ids.len(), dst_ids.len()));
            }
            chunks.push((
                Blocks { base: self.memory.layer_base(a.layer) as u64, num_blocks: self.memory.num_blocks(), ids: &a.ids },
                Blocks { base: dst_base, num_blocks: pool.num_blocks, ids: dst_ids },
            ));
        }
        let corrupt = batch.iter().position(|(a, _, _)| a.corrupt);
        let slot = lock(&self.pulls.free_slots).pop().ok_or("no free slot")?;
        super::kv_trace!("ipc copy of {} enqueueing", batch.len());
        let event = match self.device.batch(slot, &chunks, bb, corrupt, BatchOp::Copy) {
            Ok(e) => e,
            Err(e) => {
                // Part of the copy may be enqueued: let it end before the payloads (and with them
                // the claims on the source blocks) go and the receiver hears of the failure.
                let _ = self.device.context().synchronize();
                lock(&self.pulls.free_slots).push(slot);
                return Err(e.to_string());
            }
        };
        super::kv_trace!("ipc copy of {} enqueued", batch.len());
        *lock(&self.pulls.running) += 1;
        link.in_flight.send_modify(|n| *n += 1);
        let payloads = batch.into_iter().map(|(a, _, _)| a.payload).collect();
        self.submit(Job::Copy { event, seq, link: Arc::clone(link), _pool: Arc::clone(pool), _payloads: payloads, slot, _permit: permit });
        Ok(())
    }

    /// Receiver side: verifies a batch the sender reported written.
    fn start_verify(&self, link: &Arc<IpcLink>, batch: &Awaiting, permit: OwnedSemaphorePermit) -> std::result::Result<(), String> {
        let bb = self.memory.geometry().block_bytes();
        let chunks: Vec<(Blocks<'_>, Blocks<'_>)> = batch
            .chunks
            .iter()
            .map(|c| {
                let b = Blocks { base: self.memory.layer_base(c.layer) as u64, num_blocks: self.memory.num_blocks(), ids: &c.ids };
                (b, b)
            })
            .collect();
        let slot = lock(&self.pulls.free_slots).pop().ok_or("no free slot")?;
        let event = match self.device.batch(slot, &chunks, bb, None, BatchOp::Verify) {
            Ok(e) => e,
            Err(e) => {
                lock(&self.pulls.free_slots).push(slot);
                return Err(e.to_string());
            }
        };
        *lock(&self.pulls.running) += 1;
        link.in_flight.send_modify(|n| *n += 1);
        let tokens = batch.chunks.iter().map(|c| c.token).collect();
        self.submit(Job::Verify { event, tokens, link: Arc::clone(link), slot, _permit: permit });
        Ok(())
    }
}

impl Transport for CudaIpcTransport {
    fn name(&self) -> &str {
        "cuda-ipc"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities(Capabilities::DEVICE_MEMORY | Capabilities::CROSS_PROCESS)
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let unreachable = |reason: String| Error::Unreachable { endpoint: endpoint.to_string(), reason };
            let rest = endpoint.strip_prefix("cuda-ipc://").ok_or_else(|| unreachable("not a cuda-ipc:// endpoint".into()))?;
            let (host, path) = rest.split_at_checked(16).ok_or_else(|| unreachable("malformed cuda-ipc endpoint".into()))?;
            if u64::from_str_radix(host, 16).ok() != Some(self.host) {
                return Err(Error::Incompatible(format!(
                    "{endpoint} is on another host: cuda-ipc works within one host (use nccl or tcp across hosts)"
                )));
            }
            if self.shut.load(Ordering::Acquire) {
                return Err(Error::Shutdown);
            }
            let mut stream = UnixStream::connect(path).await.map_err(|e| unreachable(e.to_string()))?;
            let mut hello = VERSION.to_le_bytes().to_vec();
            hello.extend_from_slice(&self.host.to_le_bytes());
            write_message(&mut stream, K_HELLO, &hello).await.map_err(|e| unreachable(e.to_string()))?;
            let reply = tokio::time::timeout(HANDSHAKE, read_message(&mut stream))
                .await
                .map_err(|_| unreachable("no cuda-ipc handshake reply".into()))?
                .map_err(|e| unreachable(e.to_string()))?;
            let pool = match reply {
                (K_POOL, body) => self.open_pool(&body).map_err(Error::Incompatible)?,
                (K_REFUSE, body) => return Err(Error::Incompatible(String::from_utf8_lossy(&body).into_owned())),
                (k, _) => return Err(unreachable(format!("unexpected handshake message {k}"))),
            };
            let link: Arc<dyn Link> = self.adopt(stream, endpoint.to_string(), Some(Arc::new(pool)));
            Ok(link)
        })
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        if let Some(task) = lock(&self.accept).take() {
            task.abort();
        }
        let links: Vec<Arc<IpcLink>> = lock(&self.links).drain().map(|(_, l)| l).collect();
        for link in links {
            link.close();
        }
        let _ = std::fs::remove_file(&self.path);
        // No callback after this returns: wait until the completion thread reported every job.
        let running = lock(&self.pulls.running);
        let (running, timeout) = self.pulls.idle.wait_timeout_while(running, SHUTDOWN_WAIT, |n| *n > 0).unwrap_or_else(|e| e.into_inner());
        if timeout.timed_out() {
            tracing::warn!(running = *running, "cuda-ipc shutdown: copies still running after {SHUTDOWN_WAIT:?}");
        }
        drop(running);
        lock(&self.jobs).take();
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(a) = self.memory.device_allocation() {
            let mut pools = lock(local_pools());
            if pools.get(&a.base).is_some_and(|w| w.ptr_eq(&Arc::downgrade(&self.memory))) {
                pools.remove(&a.base);
            }
        }
    }
}

/// Sender side: a payload announced and waiting for its destination.
struct Announced {
    seq: u64,
    layer: u32,
    ids: Vec<u32>,
    corrupt: bool,
    payload: Payload,
}

/// Receiver side: one chunk of a batch whose destinations were named.
struct Named {
    token: u64,
    seq: u64,
    layer: u32,
    ids: Vec<u32>,
}

/// Receiver side: a batch whose destinations were named, waiting for the sender's report.
struct Awaiting {
    chunks: Vec<Named>,
    /// The sender's report: `Ok` written, `Err` why not.
    written: Option<std::result::Result<(), String>>,
}

impl Awaiting {
    fn last_seq(&self) -> u64 {
        self.chunks.last().map_or(0, |c| c.seq)
    }
}

/// One control connection.
struct IpcLink {
    id: u64,
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    state: LinkState,
    /// Sender side: the receiver's pool, open; `None` on the receiving side.
    pool: Option<Arc<PeerPool>>,
    /// Sender side: payloads announced and not yet named, in order.
    announced: Mutex<VecDeque<Announced>>,
    /// Receiver side: batches named and not yet verified, in order.
    awaiting: Mutex<VecDeque<Awaiting>>,
    next_seq: AtomicU64,
    /// Copies (sender) or verifications (receiver) of this link not yet finished.
    in_flight: watch::Sender<usize>,
    /// Messages written in order from threads outside the runtime (the completion thread).
    posts: tokio::sync::mpsc::UnboundedSender<(u8, Vec<u8>)>,
    transport: Weak<CudaIpcTransport>,
}

impl IpcLink {
    /// Queues a control message; messages queued from anywhere go out in queue order.
    fn post(&self, kind: u8, body: Vec<u8>) {
        let _ = self.posts.send((kind, body));
    }

    /// Writes queued control messages in order until the link closes.
    async fn poster(self: Arc<Self>, mut posts: tokio::sync::mpsc::UnboundedReceiver<(u8, Vec<u8>)>) {
        let mut closed = self.state.subscribe();
        loop {
            let next = tokio::select! {
                m = posts.recv() => m,
                _ = closed.wait_for(|c| *c != Closed::Open) => None,
            };
            let Some((kind, body)) = next else { return };
            if self.reply(kind, &body).await.is_err() {
                return;
            }
        }
    }

    async fn write(&self, wr: &mut OwnedWriteHalf, kind: u8, body: &[u8]) -> Result<()> {
        let mut torn = self.state.torn_guard();
        write_message(wr, kind, body).await.map_err(|e| self.state.err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// Messages (sender side), written at once; returns once they are written. A payload is held
    /// until its copy completed.
    async fn send_messages(&self, messages: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        let mut out = Vec::new();
        let mut announced = Vec::new();
        for (header, payload) in messages {
            let mut body = payload.len().to_le_bytes().to_vec();
            if !payload.is_empty() {
                let Some(transport) = self.transport.upgrade() else { return Err(Error::Shutdown) };
                if self.pool.is_none() {
                    return Err(Error::Unsupported { backend: "cuda-ipc".into(), what: "payloads from the accepting side".into() });
                }
                let bad = |why: &str| Error::Invalid(format!("cuda-ipc send: {why}"));
                let (layer, ids) =
                    transport.memory.blocks_of(payload.iovs()).ok_or_else(|| bad("the payload is not whole blocks of one layer of the pool"))?;
                if ids.is_empty() || ids.len() > crate::MAX_CHUNK_BLOCKS as usize {
                    return Err(bad("the payload is not one chunk"));
                }
                let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
                let n = transport.copied.fetch_add(1, Ordering::Relaxed) + 1;
                let corrupt = transport.corrupt_every.is_some_and(|k| n.is_multiple_of(k));
                body.extend_from_slice(&seq.to_le_bytes());
                announced.push(Announced { seq, layer, ids, corrupt, payload });
            }
            body.extend_from_slice(&header);
            if body.len() > MAX_MESSAGE {
                return Err(Error::Invalid(format!("a cuda-ipc control message of {} bytes", body.len())));
            }
            out.push(K_MSG);
            out.extend_from_slice(&(body.len() as u32).to_le_bytes());
            out.extend_from_slice(&body);
        }
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else { return Err(self.state.err("link closed")) };
        // Announced before the write: the receiver's answer may come before this task runs again.
        lock(&self.announced).extend(announced);
        let mut torn = self.state.torn_guard();
        wr.write_all(&out).await.map_err(|e| self.state.err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// A control message.
    async fn reply(&self, kind: u8, body: &[u8]) -> Result<()> {
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else { return Err(self.state.err("link closed")) };
        self.write(wr, kind, body).await
    }
}

impl Link for IpcLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn peer(&self) -> &str {
        self.state.peer()
    }

    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.state.guarded(async move { self.send_messages(vec![(header, payload)]).await }))
    }

    fn send_batch(&self, messages: Vec<(Vec<u8>, Payload)>) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.state.guarded(async move { self.send_messages(messages).await }))
    }

    fn close(&self) {
        self.state.close();
    }
}

/// The reading half of one link, run as a task.
struct Reader {
    inbox: Arc<dyn Inbox>,
    link: Arc<IpcLink>,
    transport: Weak<CudaIpcTransport>,
}

/// Whether `rd` holds a whole control message already (reading it would not wait).
fn message_buffered(rd: &BufReader<OwnedReadHalf>) -> bool {
    let b = rd.buffer();
    b.len() >= 5 && b.len() - 5 >= u32::from_le_bytes(b[1..5].try_into().expect("4 bytes")) as usize
}

impl Reader {
    async fn run(self, rd: OwnedReadHalf, mut closed: watch::Receiver<Closed>) {
        let dyn_link: Arc<dyn Link> = Arc::clone(&self.link) as Arc<dyn Link>;
        let mut rd = BufReader::with_capacity(4 * MAX_MESSAGE, rd);
        // Receiver: chunks announced back to back are named as one batch (the announcements already
        // buffered, up to PULL_BATCH).
        let mut batch: Vec<Named> = Vec::new();
        let natural = loop {
            let msg = tokio::select! {
                m = read_message(&mut rd) => m,
                _ = closed.wait_for(|c| *c != Closed::Open) => break "link closed".to_string(),
            };
            let (kind, body) = match msg {
                Ok(m) => m,
                Err(e) => break e.to_string(),
            };
            // Not raced against the close: a payload the inbox took must reach its report.
            if let Err(reason) = self.one(kind, &body, &dyn_link, &mut batch).await {
                break reason;
            }
            if !batch.is_empty()
                && (batch.len() >= PULL_BATCH || !message_buffered(&rd))
                && let Err(reason) = self.name(&mut batch).await
            {
                break reason;
            }
        };
        for c in batch.drain(..) {
            self.inbox.on_payload(&dyn_link, c.token, Err(format!("link closed before the destination was named: {natural}")));
        }
        self.link.state.fail(natural);
        let how = closed.borrow().clone();
        // Copies and verifications already enqueued finish (they cannot be recalled) and are
        // reported first.
        let mut in_flight = self.link.in_flight.subscribe();
        let _ = in_flight.wait_for(|n| *n == 0).await;
        lock(&self.link.announced).clear();
        let awaiting: Vec<Awaiting> = lock(&self.link.awaiting).drain(..).collect();
        if !awaiting.is_empty() {
            // The sender may be writing into these blocks right now: they stay claimed a while.
            tokio::time::sleep(WRITE_GRACE).await;
            for b in awaiting {
                for c in b.chunks {
                    self.inbox.on_payload(&dyn_link, c.token, Err("link closed before the payload was reported written".into()));
                }
            }
        }
        if let Some(t) = self.transport.upgrade() {
            lock(&t.links).remove(&self.link.id);
        }
        if let Some(mut wr) = self.link.writer.lock().await.take() {
            let _ = wr.shutdown().await;
        }
        if let Closed::Failed(reason) = how {
            tracing::debug!(peer = %self.link.state.peer(), %reason, "cuda-ipc link closed");
            self.inbox.on_link_closed(&dyn_link, reason);
        }
    }

    /// Receiver: names the destinations of the collected chunks to the sender, in one message.
    async fn name(&self, batch: &mut Vec<Named>) -> std::result::Result<(), String> {
        let chunks = std::mem::take(batch);
        let mut out = (chunks.len() as u32).to_le_bytes().to_vec();
        for c in &chunks {
            out.extend_from_slice(&c.seq.to_le_bytes());
            out.extend_from_slice(&c.layer.to_le_bytes());
            out.extend_from_slice(&(c.ids.len() as u32).to_le_bytes());
            for id in &c.ids {
                out.extend_from_slice(&id.to_le_bytes());
            }
        }
        super::kv_trace!("ipc naming {} destinations", chunks.len());
        lock(&self.link.awaiting).push_back(Awaiting { chunks, written: None });
        self.link.reply(K_WRITE_TO, &out).await.map_err(|e| e.to_string())
    }

    /// Receiver: verifies, in order, the batches at the front that the sender reported written.
    async fn verify_ready(&self, link: &Arc<dyn Link>) -> std::result::Result<(), String> {
        loop {
            let front = {
                let mut awaiting = lock(&self.link.awaiting);
                match awaiting.front() {
                    Some(b) if b.written.is_some() => awaiting.pop_front(),
                    _ => None,
                }
            };
            let Some(b) = front else { return Ok(()) };
            match b.written.clone().expect("checked") {
                Err(reason) => {
                    for c in &b.chunks {
                        self.inbox.on_payload(link, c.token, Err(format!("the sender could not write the payload: {reason}")));
                    }
                }
                Ok(()) => {
                    let Some(t) = self.transport.upgrade() else {
                        for c in &b.chunks {
                            self.inbox.on_payload(link, c.token, Err("transport shut down".into()));
                        }
                        return Err("transport shut down".into());
                    };
                    let permit = match Arc::clone(&t.slots).acquire_owned().await {
                        Ok(p) => p,
                        Err(_) => {
                            for c in &b.chunks {
                                self.inbox.on_payload(link, c.token, Err("transport shut down".into()));
                            }
                            return Err("transport shut down".into());
                        }
                    };
                    if let Err(reason) = t.start_verify(&self.link, &b, permit) {
                        for c in &b.chunks {
                            self.inbox.on_payload(link, c.token, Err(format!("the verification could not start: {reason}")));
                        }
                        return Err(reason);
                    }
                }
            }
        }
    }

    async fn one(&self, kind: u8, body: &[u8], link: &Arc<dyn Link>, batch: &mut Vec<Named>) -> std::result::Result<(), String> {
        let sender_side = self.link.pool.is_some();
        match kind {
            K_MSG => {
                let mut r = Cursor { buf: body };
                let payload_len = r.u64()?;
                if payload_len == 0 {
                    // Control frames come in order with the chunks around them: name what came first.
                    if !batch.is_empty() {
                        self.name(batch).await?;
                    }
                    return match self.inbox.on_message(link, r.buf, 0) {
                        Delivery::CloseLink(reason) => Err(reason),
                        Delivery::Discard => Ok(()),
                        Delivery::Into { token, .. } => {
                            self.inbox.on_payload(link, token, Ok(Landed::default()));
                            Ok(())
                        }
                    };
                }
                if sender_side {
                    return Err("payload from the accepting side".into());
                }
                let seq = r.u64()?;
                let Some(t) = self.transport.upgrade() else { return Err("transport shut down".into()) };
                match self.inbox.on_message(link, r.buf, payload_len) {
                    Delivery::CloseLink(reason) => Err(reason),
                    Delivery::Discard => {
                        if !batch.is_empty() {
                            self.name(batch).await?;
                        }
                        // One entry with no blocks: the sender drops the payload.
                        let mut out = 1u32.to_le_bytes().to_vec();
                        out.extend_from_slice(&seq.to_le_bytes());
                        out.extend_from_slice(&0u32.to_le_bytes());
                        out.extend_from_slice(&0u32.to_le_bytes());
                        self.link.reply(K_WRITE_TO, &out).await.map_err(|e| e.to_string())
                    }
                    Delivery::Into { iovs, token } => {
                        let total: u64 = iovs.iter().map(|i| i.len as u64).sum();
                        let located = t.memory.blocks_of(&iovs).filter(|(_, ids)| total == payload_len && !ids.is_empty());
                        let Some((layer, ids)) = located else {
                            self.inbox.on_payload(link, token, Err("the destination is not whole blocks of one layer".into()));
                            return Err("unusable destination".into());
                        };
                        batch.push(Named { token, seq, layer, ids });
                        Ok(())
                    }
                }
            }
            K_WRITE_TO if sender_side => {
                let mut r = Cursor { buf: body };
                let count = r.u32()?;
                if count == 0 || count as usize > PULL_BATCH {
                    return Err(format!("destinations for {count} payloads"));
                }
                let mut named = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let (seq, layer, n) = (r.u64()?, r.u32()?, r.u32()?);
                    if n > crate::MAX_CHUNK_BLOCKS {
                        return Err(format!("{n} destination blocks exceed a chunk"));
                    }
                    let ids = (0..n).map(|_| r.u32()).collect::<std::result::Result<Vec<_>, _>>()?;
                    let a = lock(&self.link.announced).pop_front().ok_or("destinations nobody asked for")?;
                    if a.seq != seq {
                        return Err(format!("destinations for payload {seq}, expected {}", a.seq));
                    }
                    if n > 0 {
                        named.push((a, layer, ids));
                    } // n == 0: not wanted; the payload goes now
                }
                let Some(last) = named.last().map(|(a, _, _)| a.seq) else { return Ok(()) };
                let (Some(t), Some(pool)) = (self.transport.upgrade(), self.link.pool.as_ref()) else {
                    return Err("transport shut down".into());
                };
                let Ok(permit) = Arc::clone(&t.slots).acquire_owned().await else { return Err("transport shut down".into()) };
                if let Err(reason) = t.start_copy(&self.link, pool, named, last, permit) {
                    let mut report = last.to_le_bytes().to_vec();
                    report.push(0);
                    report.extend_from_slice(reason.as_bytes());
                    report.truncate(1024);
                    let _ = self.link.reply(K_WRITTEN, &report).await;
                    return Err(reason);
                }
                Ok(())
            }
            K_WRITTEN if !sender_side => {
                let mut r = Cursor { buf: body };
                let (seq, ok) = (r.u64()?, r.u8()?);
                let verdict = if ok == 1 { Ok(()) } else { Err(String::from_utf8_lossy(r.buf).into_owned()) };
                {
                    let mut awaiting = lock(&self.link.awaiting);
                    let b = awaiting.iter_mut().find(|b| b.written.is_none() && b.last_seq() == seq).ok_or("a report of a batch nobody named")?;
                    b.written = Some(verdict);
                }
                super::kv_trace!("ipc written through seq {seq}");
                self.verify_ready(link).await
            }
            k => Err(format!("unexpected cuda-ipc message {k}")),
        }
    }
}

async fn write_message<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(kind);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    w.write_all(&out).await
}

async fn read_message<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            std::io::Error::new(e.kind(), "peer closed the connection")
        } else {
            e
        }
    })?;
    let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("control message of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok((head[0], body))
}

/// Reads little-endian fields; running past the end is an error, never a panic.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        if self.buf.len() < N {
            return Err("control message too short".into());
        }
        let (head, tail) = self.buf.split_at(N);
        self.buf = tail;
        Ok(head.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> std::result::Result<u16, String> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take()?))
    }
}
