//! The CUDA IPC backend (same host): the receiver pulls each chunk straight from the sender's
//! device pool into its own, no host memory and no socket on the data path, several chunks in
//! flight. A Unix socket carries the control messages: at connect the sender exports its pool (one
//! `cuIpcGetMemHandle` of the allocation holding every layer) and the receiver opens it once per
//! link (`cuIpcOpenMemHandle`; a sender in the same process is used through its own addresses,
//! which CUDA requires, and kept alive by the link). Per chunk: the sender announces the frame and
//! where its blocks lie (layer and block ids in its pool) and goes on to the next chunk at once;
//! the receiver's inbox names the destination blocks, and the receiver enqueues, on a stream of its
//! own, the copy kernel (sender's blocks → its blocks) and behind it the verification pass over the
//! destination blocks, and reads the next message. When the sender's pool lies on another GPU, the
//! receiver has that GPU push instead: it opens the pool a second time in that GPU's context (its
//! own process, so no peer process is involved), enqueues the copy on a stream there (that GPU's
//! copy engines write our blocks over NVLink/PCIe — remote writes run at the link's rate, remote
//! reads well below it) and has its own stream wait on an event recorded behind each group of
//! chunks before it verifies them; `TANDEM_KV_NO_PUSH=1` keeps pulls. A completion thread waits for each chunk's
//! event in order and reports the payload landed with the destination's checksum, which the
//! connector core compares with the sender's before anything is reported; acknowledgements tell
//! the sender which chunks' memory is no longer read.
//!
//! Since control protocol v4 a receiver that accepts also exports its own pool, and for a
//! transfer it granted (see docs/rfc-kv-sender-writes.md) the sender writes the blocks itself: it
//! turns each batch into copies of contiguous runs on its write stream, in groups that halve the
//! bytes left down to `WRITE_GROUP_MIN` (a group's copies enqueued as one `cuMemcpyBatchAsync`
//! where the driver has it) with one of its write events behind each (interprocess, or its plain
//! twin for a receiver in the same process), and announces
//! the chunks as written; the receiver verifies each group behind its event.
//!
//! Endpoint: `cuda-ipc://HOSTKEY/path/to/socket`, where HOSTKEY identifies this host's boot; a
//! sender on another host refuses the endpoint at connect (never a silent fall-back).
//!
//! Invariants (besides those of every transport):
//! - Payloads only flow from the side that connected (the sender) to the side that accepted; the
//!   copies and kernels the receiver enqueues (on its GPU, or on the sender's GPU's copy engines)
//!   are the only writers of its pool, and write only the blocks its inbox named.
//! - A sender keeps each payload (and the claim on its blocks) until the receiver acknowledged the
//!   pull, or the link closed.
//! - A peer's mapping lives as long as the link and every pull still running from it; a receiver
//!   never reads a peer pool whose layout it did not check against its own geometry at connect.
//! - Every `Delivery::Into` is answered by one `on_payload`, in delivery order, after the chunk's
//!   kernels finished (also when the link closes meanwhile); `on_link_closed` comes after the last
//!   of them, and `shutdown` returns only when no pull is running.
//! - An accepted connection must complete its handshake within 5 s; each control message is at most
//!   64 KiB.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;

use crate::core::lock;
use crate::device::{Blocks, CopyRun, DeviceKv, PULL_BATCH, PULL_SLOTS, PullEvent, PushFrom, StridedCopy, push_run, strided_copies, strided_enabled};
use crate::error::{Error, Result};
use crate::memory::KvMemory;
use crate::transport::link_state::{Closed, LinkState};
use crate::transport::spin_read::{Alert, SpinRead, spawn_reader};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

/// Where the control socket goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaIpcOptions {
    /// Directory of the socket (default: the system's temporary directory).
    pub dir: Option<PathBuf>,
    /// Test hook: flip one byte in the destination of every Nth chunk this transport sends (the
    /// receiver applies it between its copy and its verification pass, which must catch it). Also
    /// set by the environment variable `TANDEM_KV_TEST_CORRUPT_CHUNK=N` (for tests that drive whole
    /// processes).
    pub corrupt_every: Option<u64>,
}

const HANDSHAKE: Duration = Duration::from_secs(5);
/// How long `shutdown` waits for running pulls (kernels of a few milliseconds) before giving up.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
const MAX_MESSAGE: usize = 64 * 1024;
const VERSION: u16 = 4;

/// Sender → receiver: version, host, and the sender's pool.
const K_HELLO: u8 = 1;
/// Receiver → sender: the pool is open, the link is up.
const K_OK: u8 = 2;
const K_REFUSE: u8 = 3;
/// A message; with a payload, where the payload's blocks lie in the sender's pool.
const K_MSG: u8 = 4;
/// Receiver → sender: every payload up to this sequence number is pulled (no longer read).
const K_PULLED: u8 = 5;

/// Flag bit in a payload message: the test hook asks the receiver to corrupt this chunk.
const MSG_CORRUPT: u8 = 1;
/// Flag bit in a payload message: the sender wrote the payload into the receiver's blocks itself
/// (the message names those blocks and the sender's write event to wait on).
const MSG_WRITTEN: u8 = 2;

/// Whether senders write granted transfers into receivers' pools themselves
/// (`TANDEM_KV_NO_SENDER_WRITES=1` keeps the receiver-driven moves, for comparing the two).
fn sender_writes_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NO_SENDER_WRITES").is_none())
}

/// After a writing link closed, how long its sender may take to notice before its last writes are
/// waited for (a sender stops enqueuing writes once it sees the link closed).
const WRITE_GRACE: Duration = Duration::from_millis(200);
/// How long, after that grace, a closed writing link's events are polled before its transfers'
/// blocks are released regardless (a copy of a few GiB takes milliseconds; an event a dying
/// process recorded may never complete).
const QUIESCE_WAIT: Duration = Duration::from_secs(5);

/// A random number drawn once per process: with the process id, it tells a peer that is this very
/// process from one of another PID namespace that happens to have the same id.
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        getrandom::u64().unwrap_or_else(|_| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
            t ^ (u64::from(std::process::id()) << 32) ^ (&TOKEN as *const _ as u64)
        })
    })
}

/// This host's identity (its boot), so an endpoint names the host it lives on.
fn host_key() -> u64 {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let id = format!("{}|{}", read("/proc/sys/kernel/hostname").trim(), read("/proc/sys/kernel/random/boot_id").trim());
    twox_hash::XxHash3_64::oneshot(id.as_bytes())
}

/// This process's exported pools by base address, so a receiver in the same process (which uses a
/// sender's own addresses) keeps the sender's memory alive while it reads it.
fn local_pools() -> &'static Mutex<HashMap<u64, Weak<KvMemory>>> {
    static POOLS: OnceLock<Mutex<HashMap<u64, Weak<KvMemory>>>> = OnceLock::new();
    POOLS.get_or_init(Mutex::default)
}

/// A sender's pool opened for reading: where each layer's blocks start in this process's address
/// space.
struct PeerPool {
    _mapping: Option<tandem_kernels::cuda::IpcMapping>,
    /// A sender in this process: its memory, kept alive while pulls read it.
    _local: Option<Arc<KvMemory>>,
    layer_bases: Vec<u64>,
    num_blocks: u32,
    block_bytes: u64,
    /// The pool on another GPU whose copy engines can write ours: pulls are pushes from there.
    push: Option<PushSource>,
    /// The peer process (its id in its own PID namespace: for logs).
    pid: u32,
    /// The peer is this very process (same id and same [`process_token`]: processes of two
    /// containers may share an id, and then their pointers must never be taken for ours).
    same_process: bool,
    /// The pool lies on this connector's own GPU.
    same_gpu: bool,
    /// Receiver side of a link whose sender writes: the sender's write events as this process
    /// addresses them (raw `CUevent`s), and those opened from handles (destroyed with the pool).
    sender_events: Vec<u64>,
    _opened_events: Vec<crate::device::RawEvent>,
}

/// A sender's pool as that GPU's own context in this process addresses it (a second mapping, opened
/// there, for another process's pool), so its copy engines can push from it.
struct PushSource {
    device: i32,
    layer_bases: Vec<u64>,
    _mapping: Option<tandem_kernels::cuda::IpcMapping>,
}

/// A batch of pulls in flight, waited for by the completion thread.
struct Job {
    pull: PullEvent,
    /// Each chunk's inbox token, in order.
    tokens: Vec<u64>,
    /// Sequence number of the batch's last message.
    seq: u64,
    link: Arc<IpcLink>,
    _pool: Arc<PeerPool>,
    slot: usize,
    _permit: OwnedSemaphorePermit,
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
    /// Our exported pool, as sent to receivers (`K_HELLO` body after version and host).
    pool_message: Vec<u8>,
    host: u64,
    links: Mutex<HashMap<u64, Arc<IpcLink>>>,
    next_link: AtomicU64,
    accept: Mutex<Option<JoinHandle<()>>>,
    shut: AtomicBool,
    corrupt_every: Option<u64>,
    sent: AtomicU64,
    /// Pull slots: a permit per pull in flight.
    slots: Arc<Semaphore>,
    pulls: Arc<Pulls>,
    /// To the completion thread (`None` after shutdown).
    jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    /// The completion thread, joined by `shutdown` (it may drop the last hold on the device side,
    /// which must not happen while the process exits).
    completion: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Arms the receiving links' readers when a transfer is expected (see `spin_read::Alert`).
    alert: Arc<Alert>,
    me: Weak<CudaIpcTransport>,
}

/// What enqueuing and reporting pulls share (the transport and its completion thread).
struct Pulls {
    device: Arc<DeviceKv>,
    inbox: Arc<dyn Inbox>,
    free_slots: Mutex<Vec<usize>>,
    /// Pulls in flight over all links (shutdown waits for zero).
    running: Mutex<usize>,
    idle: Condvar,
    rt: tokio::runtime::Handle,
}

impl Pulls {
    /// Takes a free pull slot and enqueues `enqueue` in it; the slot goes back if that fails.
    fn in_free_slot(&self, enqueue: impl FnOnce(usize) -> Result<PullEvent>) -> std::result::Result<(usize, PullEvent), String> {
        let slot = lock(&self.free_slots).pop().ok_or("no free pull slot")?;
        match enqueue(slot) {
            Ok(pull) => Ok((slot, pull)),
            Err(e) => {
                lock(&self.free_slots).push(slot);
                Err(e.to_string())
            }
        }
    }

    /// Reports a finished batch (its kernels are waited for here), frees its slot, and acknowledges
    /// it to the sender.
    fn finish(&self, job: Job) {
        let result = job.pull.wait(&self.device);
        super::kv_trace!("ipc batch of {} done", job.tokens.len());
        let dyn_link: Arc<dyn Link> = Arc::clone(&job.link) as Arc<dyn Link>;
        let failed = result.is_err();
        match result {
            Ok(sums) => {
                for (&token, sum) in job.tokens.iter().zip(sums) {
                    self.inbox.on_payload(&dyn_link, token, Ok(Landed { checksum: Some(sum) }));
                }
            }
            Err(e) => {
                for &token in &job.tokens {
                    self.inbox.on_payload(&dyn_link, token, Err(e.to_string()));
                }
            }
        }
        lock(&self.free_slots).push(job.slot);
        // Batches complete in the order the reader met their messages, and discarded messages are
        // done at once: when this link has no batch left, everything up to the last message the
        // reader handled is done; otherwise everything up to this batch's last.
        let mut ack = job.seq;
        job.link.in_flight.send_modify(|f| {
            f.running -= 1;
            if f.running == 0 {
                ack = f.last_seq;
            }
        });
        job.link.acknowledge(&self.rt, ack);
        if failed {
            job.link.close();
        }
        drop(job);
        let mut running = lock(&self.running);
        *running -= 1;
        if *running == 0 {
            self.idle.notify_all();
        }
    }
}

/// One announced chunk the reader collected for the next batch.
struct PullReq {
    token: u64,
    seq: u64,
    src_layer: u32,
    src_ids: Vec<u32>,
    dst_layer: u32,
    dst_ids: Vec<u32>,
    corrupt: bool,
    /// The sender wrote it itself, behind its write event of this index.
    written: Option<u32>,
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
        pool.extend_from_slice(&std::process::id().to_le_bytes());
        pool.extend_from_slice(&process_token().to_le_bytes());
        pool.extend(handle.reserved.iter().map(|&b| b as u8));
        pool.extend_from_slice(&allocation.base.to_le_bytes());
        pool.extend_from_slice(&(allocation.bytes as u64).to_le_bytes());
        pool.extend_from_slice(&memory.num_blocks().to_le_bytes());
        pool.extend_from_slice(&(g.block_bytes() as u64).to_le_bytes());
        pool.extend_from_slice(&g.num_layers().to_le_bytes());
        for l in 0..g.num_layers() {
            pool.extend_from_slice(&(memory.layer_base(l) as u64 - allocation.base).to_le_bytes());
        }
        // The pool's GPU, so a receiver in another process can tell which of its GPUs that is (a
        // mapping's device attribute does not say) and have it push.
        let uuid = ctx.uuid().map_err(|e| Error::Device(format!("reading GPU {ordinal}'s UUID: {e}")))?;
        pool.extend(uuid.bytes.iter().map(|&b| b as u8));
        lock(local_pools()).insert(allocation.base, Arc::downgrade(&memory));
        let dir = opts.dir.clone().unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("tandem-kv-{}-{:016x}.sock", std::process::id(), getrandom::u64().unwrap_or(0)));
        let listener = UnixListener::bind(&path).map_err(|e| Error::Invalid(format!("cannot listen on {}: {e}", path.display())))?;
        // Only this user may connect: the socket hands out read access to the GPU pool.
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
            sent: AtomicU64::new(0),
            slots: Arc::new(Semaphore::new(PULL_SLOTS)),
            pulls: Arc::new(Pulls {
                device: Arc::clone(&device),
                inbox: Arc::clone(&inbox),
                free_slots: Mutex::new((0..PULL_SLOTS).rev().collect()),
                running: Mutex::new(0),
                idle: Condvar::new(),
                rt: tokio::runtime::Handle::current(),
            }),
            device,
            inbox,
            jobs: Mutex::new(Some(jobs_tx)),
            completion: Mutex::new(None),
            alert: Arc::default(),
            me: me.clone(),
        });
        let pulls = Arc::clone(&transport.pulls);
        let thread = std::thread::Builder::new()
            .name("tandem-kv-pull".into())
            .spawn(move || completion_thread(jobs_rx, pulls))
            .map_err(|e| Error::Invalid(format!("starting the cuda-ipc completion thread: {e}")))?;
        *lock(&transport.completion) = Some(thread);
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
                    self.open_pool(&body[10..], true).and_then(|(pool, rest)| self.open_write_events(pool, rest))
                }
            }
            _ => return, // no handshake in time, or garbage: just close
        };
        match verdict {
            Ok(pool) => {
                // A sender that offers write events writes granted transfers itself: it gets our pool.
                let writes = !pool.sender_events.is_empty();
                if writes {
                    tracing::info!(sender_pid = pool.pid, "cuda-ipc: the sender writes granted transfers into our pool itself");
                }
                let ok = if writes { self.pool_message.clone() } else { Vec::new() };
                if write_message(&mut stream, K_OK, &ok).await.is_err() {
                    return;
                }
                self.adopt(stream, "cuda-ipc peer".into(), Some(Arc::new(pool)), None, writes);
            }
            Err(reason) => {
                let _ = write_message(&mut stream, K_REFUSE, reason.as_bytes()).await;
            }
        }
    }

    /// The hello's write events (after the sender's pool): a count, then each event's handle and
    /// its address in the sender's process; opened here unless the sender is this process.
    fn open_write_events(&self, mut pool: PeerPool, rest: &[u8]) -> std::result::Result<PeerPool, String> {
        let mut r = Cursor { buf: rest };
        let n = r.u32()? as usize;
        if n > 1024 {
            return Err(format!("{n} write events"));
        }
        if !sender_writes_enabled() {
            return Ok(pool);
        }
        let ctx = self.device.context();
        ctx.bind_to_thread().map_err(|e| format!("binding the context: {e}"))?;
        for _ in 0..n {
            let mut handle = cudarc::driver::sys::CUipcEventHandle { reserved: [0; 64] };
            for slot in handle.reserved.iter_mut() {
                *slot = r.u8()? as _;
            }
            let raw = r.u64()?;
            if pool.same_process {
                pool.sender_events.push(raw);
            } else {
                let mut ev: cudarc::driver::sys::CUevent = std::ptr::null_mut();
                // SAFETY: `ev` is a valid out slot; `handle` came from the sender's
                // cuIpcGetEventHandle (a bad one is an error, not undefined behaviour).
                unsafe { cudarc::driver::sys::cuIpcOpenEventHandle(&mut ev, handle) }
                    .result()
                    .map_err(|e| format!("opening the sender's write event (cuIpcOpenEventHandle): {e}"))?;
                pool.sender_events.push(ev as u64);
                pool._opened_events.push(crate::device::RawEvent(ev));
            }
        }
        Ok(pool)
    }

    /// `pool`: the sender's pool on the receiving side, `None` on the sending side; `dest`: the
    /// receiver's pool as this sender writes it (sender side, when the receiver accepted writes);
    /// `writes`: the sender writes our blocks itself (receiving side).
    fn adopt(&self, stream: UnixStream, peer: String, pool: Option<Arc<PeerPool>>, dest: Option<Arc<PeerPool>>, writes: bool) -> Arc<IpcLink> {
        let (rd, wr) = stream.into_split();
        let (state, closed_rx) = LinkState::new(peer);
        let link = Arc::new(IpcLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            writer: tokio::sync::Mutex::new(Some(wr)),
            state,
            pool,
            dest,
            writes,
            held: Mutex::new(VecDeque::new()),
            next_seq: AtomicU64::new(1),
            in_flight: watch::Sender::new(InFlight::default()),
            transport: self.me.clone(),
        });
        lock(&self.links).insert(link.id, Arc::clone(&link));
        if self.shut.load(Ordering::Acquire) {
            link.close();
        }
        let reader = Reader { inbox: Arc::clone(&self.inbox), link: Arc::clone(&link), transport: self.me.clone() };
        spawn_reader(link.pool.is_some(), move |spin| reader.run(rd, closed_rx, spin));
        link
    }

    /// Opens the sender's pool from its `K_HELLO` message, checking its layout against ours.
    /// With `pushes`, a sender's pool (its GPU may push into ours); without, a receiver's pool that
    /// this sender writes. Returns the pool and the rest of the message.
    fn open_pool<'b>(&self, body: &'b [u8], pushes: bool) -> std::result::Result<(PeerPool, &'b [u8]), String> {
        let mut r = Cursor { buf: body };
        let pid = r.u32()?;
        let token = r.u64()?;
        let same_process = pid == std::process::id() && token == process_token();
        let mut handle = [0u8; 64];
        for slot in handle.iter_mut() {
            *slot = r.u8()?;
        }
        let (base, bytes, num_blocks, block_bytes, num_layers) = (r.u64()?, r.u64()?, r.u32()?, r.u64()?, r.u32()?);
        // A pool of another geometry is refused by the connector's handshake (with the reason); pulls
        // check the layout again before reading anything.
        if num_layers > 65_536 {
            return Err(format!("the sender's pool claims {num_layers} layers"));
        }
        let layer_bytes = u64::from(num_blocks).checked_mul(block_bytes).ok_or("pool size overflows")?;
        let mut offsets = Vec::with_capacity(num_layers as usize);
        for _ in 0..num_layers {
            let off = r.u64()?;
            if off.checked_add(layer_bytes).is_none_or(|end| end > bytes) || off % 16 != 0 {
                return Err(format!("layer offset {off} lies outside the sender's {bytes}-byte pool"));
            }
            offsets.push(off);
        }
        let mut uuid = [0u8; 16];
        for slot in uuid.iter_mut() {
            *slot = r.u8()?;
        }
        let own = self.ordinal;
        let (mapping, local, mapped, push, same_gpu) = if same_process {
            // CUDA refuses to open a handle in the process that exported it: the sender's own
            // addresses serve (its memory kept alive through the registry), and if its pool lies on
            // another GPU, this GPU's kernels need peer access to it (another process's mapping gets
            // it from the lazy flag of the open), and that GPU's copy engines push into ours.
            let local = lock(local_pools()).get(&base).and_then(Weak::upgrade).ok_or("the sender's pool is gone")?;
            let theirs = crate::device::device_of(own, base).map_err(|e| e.to_string())?;
            crate::device::enable_peer_access(own, theirs).map_err(|e| e.to_string())?;
            let push = if pushes { pusher(theirs, own, || Ok((None, base))) } else { None };
            (None, Some(local), base, push, theirs == own)
        } else {
            let m = tandem_kernels::cuda::IpcMapping::open(&self.device.context(), &handle)
                .map_err(|e| format!("opening the sender's pool (cuIpcOpenMemHandle): {e}"))?;
            let p = m.ptr();
            // Which of our GPUs the pool lies on: the one with the UUID the sender named (a
            // mapping's device attribute does not say).
            let theirs = crate::device::ordinal_of(&uuid);
            let same_gpu = theirs.as_ref().is_ok_and(|&t| t == own);
            let push = match theirs {
                _ if !pushes => None,
                Ok(theirs) => pusher(theirs, own, || {
                    let ctx = crate::device::context(theirs).map_err(|e| e.to_string())?;
                    let m = tandem_kernels::cuda::IpcMapping::open(&ctx, &handle).map_err(|e| e.to_string())?;
                    let at = m.ptr();
                    Ok((Some(m), at))
                }),
                Err(e) => {
                    tracing::info!(error = %e, "cuda-ipc: cannot tell which GPU the sender's pool is on; pulling");
                    None
                }
            };
            (Some(m), None, p, push, same_gpu)
        };
        let push = push.map(|(device, mapping, at)| PushSource { device, layer_bases: offsets.iter().map(|o| at + o).collect(), _mapping: mapping });
        let rest = r.buf;
        Ok((
            PeerPool {
                _mapping: mapping,
                _local: local,
                layer_bases: offsets.iter().map(|o| mapped + o).collect(),
                num_blocks,
                block_bytes,
                push,
                pid,
                same_process,
                same_gpu,
                sender_events: Vec::new(),
                _opened_events: Vec::new(),
            },
            rest,
        ))
    }

    /// Enqueues a batch of announced chunks as one pull; the completion thread reports it. On
    /// failure every chunk of the batch is reported failed here.
    fn start_pull(&self, link: &Arc<IpcLink>, pool: &Arc<PeerPool>, batch: Vec<PullReq>, permit: OwnedSemaphorePermit) -> std::result::Result<(), String> {
        let started = self.enqueue(link, pool, &batch, permit);
        if let Err(reason) = &started {
            let dyn_link: Arc<dyn Link> = Arc::clone(link) as Arc<dyn Link>;
            for r in &batch {
                self.inbox.on_payload(&dyn_link, r.token, Err(format!("the pull could not start: {reason}")));
            }
        }
        started
    }

    fn enqueue(&self, link: &Arc<IpcLink>, pool: &Arc<PeerPool>, batch: &[PullReq], permit: OwnedSemaphorePermit) -> std::result::Result<(), String> {
        let bb = self.memory.geometry().block_bytes();
        if pool.block_bytes != bb as u64 || pool.layer_bases.len() != self.memory.geometry().num_layers() as usize {
            return Err("the sender's pool has another layout than this one".into());
        }
        if let Some(event) = batch.last().and_then(|r| r.written) {
            // Written by the sender (the reader makes batches of one kind): verify behind the
            // batch's last write event, which follows every earlier write on the sender's stream.
            let after = *pool.sender_events.get(event as usize).ok_or("an unknown write event")?;
            let dsts: Vec<Blocks<'_>> =
                batch.iter().map(|r| Blocks { base: self.memory.layer_base(r.dst_layer) as u64, num_blocks: self.memory.num_blocks(), ids: &r.dst_ids }).collect();
            let corrupt = batch.iter().position(|r| r.corrupt);
            let (slot, pull) = self.pulls.in_free_slot(|slot| self.device.verify_written(slot, &dsts, bb, corrupt, after))?;
            super::kv_trace!("ipc verification of {} written chunks enqueued", batch.len());
            return self.submit(link, pool, batch, slot, pull, permit);
        }
        let mut chunks = Vec::with_capacity(batch.len());
        for r in batch {
            let src_base = *pool.layer_bases.get(r.src_layer as usize).ok_or_else(|| format!("source layer {} out of range", r.src_layer))?;
            chunks.push((
                Blocks { base: src_base, num_blocks: pool.num_blocks, ids: &r.src_ids },
                Blocks { base: self.memory.layer_base(r.dst_layer) as u64, num_blocks: self.memory.num_blocks(), ids: &r.dst_ids },
            ));
        }
        // (Layers out of range were refused above.)
        let push_bases: Option<Vec<u64>> =
            pool.push.as_ref().and_then(|p| batch.iter().map(|r| p.layer_bases.get(r.src_layer as usize).copied()).collect());
        let push = pool.push.as_ref().zip(push_bases.as_deref()).map(|(p, src_bases)| PushFrom { device: p.device, src_bases });
        let corrupt = batch.iter().position(|r| r.corrupt);
        super::kv_trace!("ipc batch of {} enqueueing", batch.len());
        let (slot, pull) = self.pulls.in_free_slot(|slot| self.device.pull(slot, &chunks, bb, corrupt, push))?;
        super::kv_trace!("ipc batch of {} enqueued", batch.len());
        self.submit(link, pool, batch, slot, pull, permit)
    }

    /// Hands an enqueued batch to the completion thread (or, after shutdown, reports it here).
    fn submit(&self, link: &Arc<IpcLink>, pool: &Arc<PeerPool>, batch: &[PullReq], slot: usize, pull: PullEvent, permit: OwnedSemaphorePermit) -> std::result::Result<(), String> {
        let seq = batch.last().map_or(0, |r| r.seq);
        *lock(&self.pulls.running) += 1;
        link.in_flight.send_modify(|f| {
            f.running += 1;
            f.last_seq = f.last_seq.max(seq);
        });
        let tokens = batch.iter().map(|r| r.token).collect();
        let job = Job { pull, tokens, seq, link: Arc::clone(link), _pool: Arc::clone(pool), slot, _permit: permit };
        let tx = lock(&self.jobs).clone();
        let job = match tx {
            Some(tx) => match tx.send(job) {
                Ok(()) => return Ok(()),
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        // The completion thread is gone (shutdown): report here, after waiting for the kernels.
        self.pulls.finish(job);
        Ok(())
    }
}

/// Whether the GPU `theirs` holding a sender's pool can push into GPU `own`'s (another GPU, peer
/// access from it to ours, and `open` addressing the pool in its context): `(theirs, the
/// mapping if one was opened, the pool's base there)`, or `None` (pulls read it from here).
fn pusher(
    theirs: i32,
    own: i32,
    open: impl FnOnce() -> std::result::Result<(Option<tandem_kernels::cuda::IpcMapping>, u64), String>,
) -> Option<(i32, Option<tandem_kernels::cuda::IpcMapping>, u64)> {
    if theirs == own || !crate::device::push_enabled() {
        tracing::debug!(from = theirs, to = own, "cuda-ipc: pulls (one GPU, or TANDEM_KV_NO_PUSH)");
        return None;
    }
    let opened = crate::device::enable_peer_access(theirs, own).map_err(|e| e.to_string()).and_then(|()| open());
    match opened {
        Ok((mapping, at)) => {
            tracing::info!(from = theirs, to = own, "cuda-ipc: the sender's GPU pushes KV into ours");
            Some((theirs, mapping, at))
        }
        Err(e) => {
            tracing::info!(from = theirs, to = own, error = %e, "cuda-ipc: the sender's GPU cannot push into ours; pulling");
            None
        }
    }
}

/// Waits for pulls in the order they were enqueued and reports them (one thread per transport;
/// it ends when the transport dropped its end of the queue and every pull is reported).
fn completion_thread(jobs: std::sync::mpsc::Receiver<Job>, pulls: Arc<Pulls>) {
    let _ = pulls.device.context().bind_to_thread();
    while let Ok(job) = jobs.recv() {
        pulls.finish(job);
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

    fn expecting(&self) {
        self.alert.arm(super::spin_read::spin_window());
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
            hello.extend_from_slice(&self.pool_message);
            // The events a receiver waits on before verifying what this sender wrote itself (none:
            // the receiver moves every payload).
            let events = if sender_writes_enabled() { self.device.write_events()? } else { Vec::new() };
            hello.extend_from_slice(&(events.len() as u32).to_le_bytes());
            for e in &events {
                hello.extend_from_slice(&e.handle);
                hello.extend_from_slice(&e.raw.to_le_bytes());
            }
            write_message(&mut stream, K_HELLO, &hello).await.map_err(|e| unreachable(e.to_string()))?;
            let reply = tokio::time::timeout(HANDSHAKE, read_message(&mut stream))
                .await
                .map_err(|_| unreachable("no cuda-ipc handshake reply".into()))?
                .map_err(|e| unreachable(e.to_string()))?;
            let dest = match reply {
                (K_OK, body) if body.is_empty() => None,
                // The receiver's pool, which this sender writes granted transfers into.
                (K_OK, body) => Some(Arc::new(self.open_pool(&body, false).map_err(Error::Incompatible)?.0)),
                (K_REFUSE, body) => return Err(Error::Incompatible(String::from_utf8_lossy(&body).into_owned())),
                (k, _) => return Err(unreachable(format!("unexpected handshake message {k}"))),
            };
            // A pool of another layout is never written: the connectors' handshake refuses it, with
            // the geometry that differs (writes also check every block against the pool's extent).
            let dest = dest.filter(|d| {
                d.block_bytes == self.memory.geometry().block_bytes() as u64 && d.layer_bases.len() == self.memory.geometry().num_layers() as usize
            });
            if dest.is_some() {
                tracing::info!(%endpoint, "cuda-ipc: writing granted transfers into the receiver's pool");
            }
            let link: Arc<dyn Link> = self.adopt(stream, endpoint.to_string(), None, dest, false);
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
        // No callback after this returns: wait until the completion thread reported every pull.
        let running = lock(&self.pulls.running);
        let (running, timeout) = self.pulls.idle.wait_timeout_while(running, SHUTDOWN_WAIT, |n| *n > 0).unwrap_or_else(|e| e.into_inner());
        if timeout.timed_out() {
            tracing::warn!(running = *running, "cuda-ipc shutdown: pulls still running after {SHUTDOWN_WAIT:?}");
        }
        drop(running);
        lock(&self.jobs).take();
        // The thread ends once it has no sender and no job left; its device-side work (and its drop
        // of the device side, when it holds the last reference) is over when this returns.
        let thread = lock(&self.completion).take();
        if let Some(thread) = thread
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
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

/// One control connection.
struct IpcLink {
    id: u64,
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    state: LinkState,
    /// Receiver side: the sender's pool, open; `None` on the sending side.
    pool: Option<Arc<PeerPool>>,
    /// Sender side: the receiver's pool as this process addresses it, when the receiver accepted
    /// that this sender writes granted transfers itself.
    dest: Option<Arc<PeerPool>>,
    /// Receiver side: the sender writes granted transfers into our pool itself.
    writes: bool,
    /// Sender side: payloads the receiver may still be reading, by sequence number.
    held: Mutex<VecDeque<(u64, Payload)>>,
    next_seq: AtomicU64,
    /// Receiver side: pulls of this link not yet reported, and the last message the reader met.
    in_flight: watch::Sender<InFlight>,
    transport: Weak<CudaIpcTransport>,
}

/// A receiving link's pulls in flight.
#[derive(Debug, Default, Clone, Copy)]
struct InFlight {
    running: usize,
    /// Sequence number of the last payload message the reader handled (pulled or discarded).
    last_seq: u64,
}

impl IpcLink {
    /// Tells the sender that every payload up to `seq` is no longer read (from any thread).
    fn acknowledge(self: &Arc<Self>, rt: &tokio::runtime::Handle, seq: u64) {
        let link = Arc::clone(self);
        rt.spawn(async move {
            let _ = link.reply(K_PULLED, &seq.to_le_bytes()).await;
        });
    }

    async fn write(&self, wr: &mut OwnedWriteHalf, kind: u8, body: &[u8]) -> Result<()> {
        let mut torn = self.state.torn_guard();
        write_message(wr, kind, body).await.map_err(|e| self.state.err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// The `K_MSG` body of one message (sender side): with a payload, where its blocks lie, then the
    /// header. The payload is held until the receiver acknowledges the pull.
    fn encode(&self, header: &[u8], payload: Payload, written: Option<usize>) -> Result<Vec<u8>> {
        let mut msg = payload.len().to_le_bytes().to_vec();
        if let (Some(event), Some(dest)) = (written, payload.dest()) {
            // Written here already: the message names the receiver's blocks and the write event.
            let Some(transport) = self.transport.upgrade() else { return Err(Error::Shutdown) };
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let n = transport.sent.fetch_add(1, Ordering::Relaxed) + 1;
            let corrupt = transport.corrupt_every.is_some_and(|k| n.is_multiple_of(k));
            msg.extend_from_slice(&seq.to_le_bytes());
            msg.push(MSG_WRITTEN | if corrupt { MSG_CORRUPT } else { 0 });
            msg.extend_from_slice(&dest.layer.to_le_bytes());
            msg.extend_from_slice(&(dest.blocks.len() as u32).to_le_bytes());
            msg.reserve(4 * dest.blocks.len() + 4 + header.len());
            for id in &dest.blocks {
                msg.extend_from_slice(&id.to_le_bytes());
            }
            msg.extend_from_slice(&(event as u32).to_le_bytes());
            lock(&self.held).push_back((seq, payload));
        } else if !payload.is_empty() {
            let Some(transport) = self.transport.upgrade() else { return Err(Error::Shutdown) };
            if self.pool.is_some() {
                return Err(Error::Unsupported { backend: "cuda-ipc".into(), what: "payloads from the accepting side".into() });
            }
            let bad = |why: &str| Error::Invalid(format!("cuda-ipc send: {why}"));
            let (layer, ids) =
                transport.memory.blocks_of(payload.iovs()).ok_or_else(|| bad("the payload is not whole blocks of one layer of the pool"))?;
            if ids.len() > crate::MAX_CHUNK_BLOCKS as usize {
                return Err(bad("the payload exceeds a chunk"));
            }
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let n = transport.sent.fetch_add(1, Ordering::Relaxed) + 1;
            let corrupt = transport.corrupt_every.is_some_and(|k| n.is_multiple_of(k));
            msg.extend_from_slice(&seq.to_le_bytes());
            msg.push(if corrupt { MSG_CORRUPT } else { 0 });
            msg.extend_from_slice(&layer.to_le_bytes());
            msg.extend_from_slice(&(ids.len() as u32).to_le_bytes());
            for id in &ids {
                msg.extend_from_slice(&id.to_le_bytes());
            }
            lock(&self.held).push_back((seq, payload));
        }
        msg.extend_from_slice(header);
        Ok(msg)
    }

    /// Messages (sender side), written at once; returns once they are written. Payloads the
    /// receiver granted are first written into its pool here (in groups, a write event behind
    /// each: see [`write_groups`]), when the link writes.
    async fn send_messages(&self, messages: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        // Held from before the writes to after the announcement: a link seen closed writes nothing.
        let mut guard = self.writer.lock().await;
        if guard.is_none() {
            return Err(self.state.err("link closed"));
        }
        super::kv_trace!("ipc send of {} messages: link locked", messages.len());
        let mut events = match &self.dest {
            Some(dest) if messages.iter().any(|(_, p)| p.dest().is_some_and(|d| d.written.is_none())) => self.write_granted(dest, &messages)?,
            _ => Vec::new(),
        }
        .into_iter();
        let mut out = Vec::new();
        for (header, payload) in messages {
            // (Payloads written ahead carry their write event as the ticket `write_ahead` gave.)
            let w = match payload.dest() {
                Some(d) => match d.written {
                    Some(ticket) => Some(usize::try_from(ticket).map_err(|_| Error::Invalid("a write ticket".into()))?),
                    None => events.next(),
                },
                None => None,
            };
            let body = self.encode(&header, payload, w)?;
            if body.len() > MAX_MESSAGE {
                return Err(Error::Invalid(format!("a cuda-ipc control message of {} bytes", body.len())));
            }
            out.push(K_MSG);
            out.extend_from_slice(&(body.len() as u32).to_le_bytes());
            out.extend_from_slice(&body);
        }
        let Some(wr) = guard.as_mut() else { return Err(self.state.err("link closed")) };
        let mut torn = self.state.torn_guard();
        wr.write_all(&out).await.map_err(|e| self.state.err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// Writes the granted payloads of `messages` into the receiver's pool `dest` (copies on the
    /// device's write stream, in the groups [`write_groups`] cuts); returns, for each granted
    /// payload in order, the write event behind its group.
    ///
    /// The copies are made from runs, not blocks: a payload's iovecs are already its contiguous
    /// runs, and a transfer names the same destination blocks in every layer, so their runs are
    /// made once (this is on the path between `send_ready` and the first byte moving).
    fn write_granted(&self, dest: &PeerPool, messages: &[(Vec<u8>, Payload)]) -> Result<Vec<usize>> {
        let Some(transport) = self.transport.upgrade() else { return Err(Error::Shutdown) };
        let memory = &transport.memory;
        let bb = memory.geometry().block_bytes();
        let bad = |why: &str| Error::Invalid(format!("cuda-ipc write: {why}"));
        // Per granted payload: its copies `(destination, source, bytes)`, and its bytes.
        let mut per_chunk: Vec<(Vec<CopyRun>, usize)> = Vec::new();
        // The last destination's block ids, and their runs `(first block, blocks)`.
        let mut last_dest: Option<&[u32]> = None;
        let mut dst_runs: Vec<(u32, u32)> = Vec::new();
        for (_, payload) in messages {
            let Some(d) = payload.dest().filter(|d| d.written.is_none()) else { continue };
            let base = *dest.layer_bases.get(d.layer as usize).ok_or_else(|| bad("a destination layer out of range"))?;
            if last_dest != Some(&d.blocks[..]) {
                dst_runs = block_runs(&d.blocks, dest.num_blocks).map_err(bad)?;
                last_dest = Some(&d.blocks);
            }
            let (copies, blocks) = pair_runs(memory, payload.iovs(), base, &dst_runs).map_err(bad)?;
            per_chunk.push((copies, blocks * bb));
        }
        // SAFETY: every source run is whole blocks of one layer of this connector's pool
        // (`locate`), which the core holds claimed for the transfer until the receiver
        // acknowledges it; every destination run is blocks of one of the receiver's layer arrays,
        // each id checked against its extent, and they are the blocks the receiver granted this
        // transfer (the core hands over only granted payloads, with the receiver's blocks).
        unsafe { self.write_chunks(&transport, dest, per_chunk) }
    }

    /// Writes the copies of each chunk of `per_chunk` (`(copies, bytes)`) on the device's write
    /// stream, in the groups [`write_groups`] cuts, a write event behind each; returns each
    /// chunk's event.
    ///
    /// # Safety
    ///
    /// As [`DeviceKv::write`](crate::device::DeviceKv::write): the sources are blocks of this
    /// connector's pool that the transfer holds, the destinations blocks of `dest` (each id
    /// checked against its extent) that the receiver granted to the transfer.
    unsafe fn write_chunks(&self, transport: &CudaIpcTransport, dest: &PeerPool, per_chunk: Vec<(Vec<CopyRun>, usize)>) -> Result<Vec<usize>> {
        // On one GPU the verification reads as fast as the copy writes: groups buy nothing there
        // but the receiver's launches.
        let min = if dest.same_gpu { usize::MAX } else { WRITE_GROUP_MIN };
        let ends = write_groups(per_chunk.iter().map(|(_, bytes)| *bytes), min, group_share());
        super::kv_trace!("write: {} chunks located, {} groups", per_chunk.len(), ends.len());
        let mut chunks = per_chunk.into_iter();
        let mut begin = 0;
        // A group's chunks are layers of the same blocks: each run across them one strided copy.
        let strided = strided_enabled();
        let groups: Vec<Vec<StridedCopy>> = ends
            .iter()
            .map(|&end| {
                let group: Vec<Vec<CopyRun>> = chunks.by_ref().take(end - begin).map(|(copies, _)| copies).collect();
                begin = end;
                if strided { strided_copies(&group) } else { strided_copies(&[group.concat()]) }
            })
            .collect();
        // SAFETY: the caller's contract.
        let events = unsafe { transport.device.write(&groups, dest.same_process)? };
        let mut begin = 0;
        let mut per_payload = Vec::with_capacity(ends.last().copied().unwrap_or(0));
        for (&end, &event) in ends.iter().zip(&events) {
            per_payload.extend(std::iter::repeat_n(event, end - begin));
            begin = end;
        }
        Ok(per_payload)
    }

    /// A control message from the receiving side (acknowledgements).
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

    fn writes_directly(&self) -> bool {
        self.dest.is_some() || self.writes
    }

    fn write_ahead(&self, plan: super::WritePlan<'_>) -> Result<Option<Vec<u64>>> {
        let Some(dest) = &self.dest else { return Ok(None) };
        if plan.layers.is_empty() || plan.chunks.is_empty() {
            return Ok(Some(Vec::new()));
        }
        // The writer lock, as `send_messages` holds it across its writes: a link seen closed
        // writes nothing. Held by a send in progress, the payloads go with their messages.
        let Ok(guard) = self.writer.try_lock() else { return Ok(None) };
        if guard.is_none() {
            return Err(self.state.err("link closed"));
        }
        let Some(transport) = self.transport.upgrade() else { return Err(Error::Shutdown) };
        let memory = &transport.memory;
        let bb = memory.geometry().block_bytes();
        let bad = |why: &str| Error::Invalid(format!("cuda-ipc write: {why}"));
        super::kv_trace!("write ahead of layers {:?}: link locked", plan.layers);
        if plan.layers.end > memory.geometry().num_layers() {
            return Err(bad("a source layer outside this pool"));
        }
        // Each chunk's copies (and bytes) in the first layer, made once: another layer's are the
        // same runs moved by the two pools' layer offsets (the same blocks, layer arrays of the
        // same size), which costs next to nothing where pairing the runs again per layer cost
        // ~3 µs each — while the copy engines sat idle after the first chunk.
        let first = plan.layers.start;
        let base_of = |l: u32| dest.layer_bases.get(l as usize).copied().ok_or_else(|| bad("a destination layer out of range"));
        let first_base = base_of(first)?;
        let mut firsts = Vec::with_capacity(plan.chunks.len());
        for &(at, count) in plan.chunks {
            let (src, dst) = match (plan.src.get(at..at + count), plan.dst.get(at..at + count)) {
                (Some(s), Some(d)) if count > 0 => (s, d),
                _ => return Err(bad("a chunk outside the transfer's blocks")),
            };
            if src.iter().any(|&b| b >= memory.num_blocks()) {
                return Err(bad("a source block outside this pool"));
            }
            let dst_runs = block_runs(dst, dest.num_blocks).map_err(bad)?;
            let (copies, blocks) = pair_runs(memory, &memory.iovs(first, src), first_base, &dst_runs).map_err(bad)?;
            firsts.push((copies, blocks * bb));
        }
        let mut per_chunk = Vec::with_capacity(plan.layers.len() * firsts.len());
        let mut events = Vec::with_capacity(plan.layers.len() * firsts.len());
        for l in plan.layers.clone() {
            let dst_shift = base_of(l)?.wrapping_sub(first_base);
            let src_shift = (memory.layer_base(l) as u64).wrapping_sub(memory.layer_base(first) as u64);
            for (copies, bytes) in &firsts {
                let copies = copies.iter().map(|&(d, s, n)| (d.wrapping_add(dst_shift), s.wrapping_add(src_shift), n)).collect();
                per_chunk.push((copies, *bytes));
                if events.is_empty() && per_chunk.len() == 1 && plan.layers.len() * firsts.len() > 2 && !dest.same_gpu {
                    // The first chunk goes at once, a write group of its own: the copy engines
                    // start on it while the host works out the others' runs.
                    // SAFETY: as below.
                    events = unsafe { self.write_chunks(&transport, dest, std::mem::take(&mut per_chunk))? };
                }
            }
        }
        // SAFETY: every source run is whole blocks of layers of this connector's pool (located in
        // the first layer, moved to layers below `num_layers`; ids checked above), which the caller
        // holds claimed for the transfer (`Link::write_ahead`); every destination run is blocks of
        // one of the receiver's layer arrays (the first one's runs moved to another's base), each
        // id checked against its extent, that the receiver granted to the transfer (the caller
        // checked the grant).
        events.extend(unsafe { self.write_chunks(&transport, dest, per_chunk)? });
        drop(guard);
        // A ticket is the chunk's write event.
        Ok(Some(events.into_iter().map(|e| e as u64).collect()))
    }

    fn drain(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let Some(t) = self.transport.upgrade() else { return Ok(()) };
            tokio::task::spawn_blocking(move || t.device.drain_writes()).await.map_err(|e| Error::Device(format!("draining the writes: {e}")))?
        })
    }

    fn quiesce(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // The sender stops writing once it sees the link closed; then its last writes are
            // waited for through its events (those of a process that ended are over).
            tokio::time::sleep(WRITE_GRACE).await;
            let (Some(pool), Some(t)) = (self.pool.clone(), self.transport.upgrade()) else { return };
            let self_peer = self.state.peer().to_string();
            if pool.same_process {
                // A sender in this process owns its events and may have destroyed them with its
                // connector: the grace above is all (same-process pairs are benches and tests).
                return;
            }
            let _ = tokio::task::spawn_blocking(move || {
                use cudarc::driver::sys::{CUevent, CUresult, cuEventQuery};
                let _ = t.device.context().bind_to_thread();
                // Polled, not synchronized: an event whose process died mid-record might never
                // complete, and a quiesce must end (its transfer's blocks wait for it).
                let since = Instant::now();
                let mut left: Vec<u64> = pool.sender_events.clone();
                while !left.is_empty() {
                    // SAFETY: the events live as long as `pool` (held here).
                    left.retain(|&ev| matches!(unsafe { cuEventQuery(ev as CUevent) }, CUresult::CUDA_ERROR_NOT_READY));
                    if left.is_empty() {
                        break;
                    }
                    if since.elapsed() > QUIESCE_WAIT {
                        tracing::warn!(peer = self_peer, events = left.len(), "cuda-ipc: a closed link's sender writes did not finish; its blocks are released anyway");
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
            .await;
        })
    }
}

/// The reading half of one link, run as a task.
struct Reader {
    inbox: Arc<dyn Inbox>,
    link: Arc<IpcLink>,
    transport: Weak<CudaIpcTransport>,
}

/// Whether `rd` holds a whole control message already (reading it would not wait).
fn message_buffered(rd: &BufReader<SpinRead<OwnedReadHalf>>) -> bool {
    let b = rd.buffer();
    b.len() >= 5 && b.len() - 5 >= u32::from_le_bytes(b[1..5].try_into().expect("4 bytes")) as usize
}

impl Reader {
    async fn run(self, rd: OwnedReadHalf, mut closed: watch::Receiver<Closed>, spin: Duration) {
        let dyn_link: Arc<dyn Link> = Arc::clone(&self.link) as Arc<dyn Link>;
        // The receiving side polls its socket while the link is busy (see `SpinRead`): the first
        // announcement of a transfer is what its copies wait for.
        let mut rd = SpinRead::new(rd, spin);
        if let Some(t) = self.transport.upgrade() {
            rd = rd.alerted_by(&t.alert);
        }
        let mut rd = BufReader::with_capacity(4 * MAX_MESSAGE, rd);
        // Chunks announced back to back are pulled as one batch: the reader collects the messages
        // already buffered (up to PULL_BATCH) before it enqueues. A pool that pushes from another
        // GPU starts with a verification group (the copy engines start on the first chunks while
        // the reader is still taking in the rest of a big group of layers) and, while a batch of
        // this link is still moving, collects up to PULL_BATCH (fewer, longer batches: the copy
        // engines have the next queued before they finish the last).
        let push = self.link.pool.as_ref().is_some_and(|p| p.push.is_some());
        // (Written payloads are verified in batches of one write event: the sender cut the groups.)
        let limit = |batch: &[PullReq]| {
            let pushed = push && batch.last().is_some_and(|r| r.written.is_none());
            if pushed && self.link.in_flight.borrow().running == 0 { crate::device::push_group() } else { PULL_BATCH }
        };
        let mut batch: Vec<PullReq> = Vec::new();
        let natural = loop {
            let msg = tokio::select! {
                m = read_message(&mut rd) => m,
                _ = closed.wait_for(|c| *c != Closed::Open) => break "link closed".to_string(),
            };
            let (kind, body) = match msg {
                Ok(m) => m,
                Err(e) => break e.to_string(),
            };
            // Not raced against the close: a payload the inbox took must reach its pull (or its report).
            if let Err(reason) = self.one(kind, &body, &dyn_link, &mut batch).await {
                break reason;
            }
            if !batch.is_empty()
                && (batch.len() >= limit(&batch) || !message_buffered(&rd))
                && let Err(reason) = self.flush(&mut batch).await
            {
                break reason;
            }
        };
        for r in batch.drain(..) {
            self.inbox.on_payload(&dyn_link, r.token, Err(format!("link closed before the pull started: {natural}")));
        }
        self.link.state.fail(natural);
        let how = closed.borrow().clone();
        // Pulls already enqueued finish (their kernels cannot be recalled) and are reported first.
        let mut in_flight = self.link.in_flight.subscribe();
        let _ = in_flight.wait_for(|f| f.running == 0).await;
        lock(&self.link.held).clear();
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

    /// Enqueues the collected chunks as one pull (waiting for a free slot).
    async fn flush(&self, batch: &mut Vec<PullReq>) -> std::result::Result<(), String> {
        let (Some(t), Some(pool)) = (self.transport.upgrade(), self.link.pool.as_ref()) else {
            return Err("transport shut down".into());
        };
        let Ok(permit) = Arc::clone(&t.slots).acquire_owned().await else {
            return Err("transport shut down".into());
        };
        t.start_pull(&self.link, pool, std::mem::take(batch), permit)
    }

    async fn one(&self, kind: u8, body: &[u8], link: &Arc<dyn Link>, batch: &mut Vec<PullReq>) -> std::result::Result<(), String> {
        let receiver_side = self.link.pool.is_some();
        match kind {
            K_MSG => {
                let mut r = Cursor { buf: body };
                let payload_len = r.u64()?;
                if payload_len == 0 {
                    // Control frames come in order with the chunks around them: pull what came first.
                    if !batch.is_empty() {
                        self.flush(batch).await?;
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
                if !receiver_side {
                    return Err("payload from the accepting side".into());
                }
                let (seq, flags, src_layer, n) = (r.u64()?, r.u8()?, r.u32()?, r.u32()?);
                if n == 0 || n > crate::MAX_CHUNK_BLOCKS {
                    return Err(format!("a payload of {n} blocks"));
                }
                // (For a payload the sender wrote itself, these are the blocks it wrote, ours.)
                let src_ids = r.u32s(n as usize)?;
                let written = if flags & MSG_WRITTEN != 0 {
                    let event = r.u32()?;
                    let known = self.link.pool.as_ref().is_some_and(|p| (event as usize) < p.sender_events.len());
                    if !self.link.writes || !known {
                        return Err("a payload written by a sender that does not write".into());
                    }
                    Some(event)
                } else {
                    None
                };
                let Some(t) = self.transport.upgrade() else { return Err("transport shut down".into()) };
                match self.inbox.on_message(link, r.buf, payload_len) {
                    Delivery::CloseLink(reason) => Err(reason),
                    Delivery::Discard => {
                        let mut idle = false;
                        self.link.in_flight.send_modify(|f| {
                            f.last_seq = seq;
                            idle = f.running == 0;
                        });
                        if idle && batch.is_empty() {
                            self.link.reply(K_PULLED, &seq.to_le_bytes()).await.map_err(|e| e.to_string())?;
                        }
                        Ok(())
                    }
                    Delivery::Into { iovs, token } => {
                        let total: u64 = iovs.iter().map(|i| i.len as u64).sum();
                        let (src_ids, dst_layer, dst_ids) = if written.is_some() {
                            // The blocks the sender wrote must be those the transfer names here
                            // (checked without collecting them: a chunk is up to 256 blocks).
                            if total != payload_len || !t.memory.covers(&iovs, src_layer, &src_ids) {
                                self.inbox.on_payload(link, token, Err("the sender wrote other blocks than this receiver named".into()));
                                return Err("a sender wrote blocks it was not given".into());
                            }
                            (Vec::new(), src_layer, src_ids)
                        } else {
                            let located = t.memory.blocks_of(&iovs).filter(|(_, ids)| total == payload_len && ids.len() == n as usize);
                            let Some((dst_layer, dst_ids)) = located else {
                                self.inbox.on_payload(link, token, Err("the destination is not the payload's blocks of one layer".into()));
                                return Err("unusable destination".into());
                            };
                            (src_ids, dst_layer, dst_ids)
                        };
                        if batch.last().is_some_and(|b| b.written != written) {
                            // Written payloads are verified, others moved: a batch is of one kind,
                            // and written ones of one write event (each group is verified as soon
                            // as its own writes landed).
                            self.flush(batch).await?;
                        }
                        batch.push(PullReq { token, seq, src_layer, src_ids, dst_layer, dst_ids, corrupt: flags & MSG_CORRUPT != 0, written });
                        Ok(())
                    }
                }
            }
            K_PULLED if !receiver_side => {
                let seq = Cursor { buf: body }.u64()?;
                lock(&self.link.held).retain(|(s, _)| *s > seq);
                Ok(())
            }
            k => Err(format!("unexpected cuda-ipc message {k}")),
        }
    }
}

/// The copies that move the blocks of `iovs` (whole blocks of one layer of `memory`, in order) to
/// the destination runs `(first block, blocks)` of a layer array at `base`, in order: runs merged
/// where both sides continue, so O(runs) where a block-by-block walk is O(blocks). Returns the
/// copies and how many blocks they move; fails unless both sides hold the same number of blocks.
fn pair_runs(memory: &KvMemory, iovs: &[crate::memory::Iov], base: u64, dst_runs: &[(u32, u32)]) -> std::result::Result<(Vec<CopyRun>, usize), &'static str> {
    let bb = memory.geometry().block_bytes() as u64;
    let mut copies = Vec::new();
    let mut dst = dst_runs.iter().copied();
    let mut open: Option<(u32, u32)> = None;
    let mut layer = None;
    let mut blocks = 0usize;
    for iov in iovs {
        let (l, _, n) = memory.locate(iov).ok_or("the payload is not whole blocks of the pool")?;
        if *layer.get_or_insert(l) != l {
            return Err("a payload spanning layers");
        }
        let (mut src, mut left) = (iov.addr as u64, n);
        while left > 0 {
            let (first, count) = match open.take() {
                Some(r) => r,
                None => dst.next().ok_or("a destination shorter than its payload")?,
            };
            let take = left.min(count);
            push_run(&mut copies, base + u64::from(first) * bb, src, (u64::from(take) * bb) as usize);
            src += u64::from(take) * bb;
            left -= take;
            if take < count {
                open = Some((first + take, count - take));
            }
        }
        blocks += n as usize;
    }
    if open.is_some() || dst.next().is_some() {
        return Err("a destination longer than its payload");
    }
    Ok((copies, blocks))
}

/// The runs `(first block, blocks)` of consecutive ids in `ids` (a receiver's destination blocks),
/// each id checked against the receiver's `num_blocks`.
fn block_runs(ids: &[u32], num_blocks: u32) -> std::result::Result<Vec<(u32, u32)>, &'static str> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &b in ids {
        if b >= num_blocks {
            return Err("a destination block outside the receiver's pool");
        }
        match runs.last_mut() {
            Some((first, n)) if *first + *n == b => *n += 1,
            _ => runs.push((b, 1)),
        }
    }
    Ok(runs)
}

/// Below this many bytes, the writes of a batch that are left go in one group. (16 MiB and 8 MiB
/// measured slower across two H100s: every group is a batch the receiver enqueues, at tens of
/// microseconds of host time, and those must be done before the last byte lands.)
const WRITE_GROUP_MIN: usize = 32 << 20;

/// How a sender cuts a batch of chunk writes (of these sizes, in order) into groups, each with a
/// write event behind it that the receiver verifies the group behind: the ends of the groups
/// (exclusive chunk indices). Each group takes about `share` percent of the bytes left (at least
/// one chunk), until at most `min` are left, which go in one group — but for the last chunk, a
/// group of its own once the batch was cut: with `WRITE_GROUP_MIN` and half, 256 MiB of 8 MiB
/// chunks go as 128, 64, 32, 24 and 8 MiB. Few, big copies keep the copy engines at the link's
/// rate (every copy boundary costs them a few microseconds); the shrinking keeps the receiver's
/// verification of each group (several times faster than the link) done while the next group
/// still moves, so what is left after the last byte landed is the verification of a small last
/// group.
fn write_groups(sizes: impl IntoIterator<Item = usize>, min: usize, share: usize) -> Vec<usize> {
    let sizes: Vec<usize> = sizes.into_iter().collect();
    let mut left: usize = sizes.iter().sum();
    let mut ends = Vec::new();
    let mut i = 0;
    while i < sizes.len() {
        let target = if left <= min { left } else { (left as u128 * share as u128 / 100) as usize };
        let mut taken = 0;
        while i < sizes.len() && (taken == 0 || taken < target) {
            taken += sizes[i];
            i += 1;
        }
        left -= taken;
        ends.push(i);
    }
    // A batch that was cut ends with its last chunk alone: the verification of the last group is
    // what the transfer waits for after its last byte landed.
    if let [.., a, b] = ends[..]
        && b - a > 1
        && small_last_group()
    {
        ends.insert(ends.len() - 1, b - 1);
    }
    ends
}

/// The percent of the bytes left each write group takes: 50, or `TANDEM_KV_WRITE_GROUP_SHARE`
/// (1–99; 75 cuts 248 MiB of 8 MiB chunks into 192, 48 and 8 MiB — fewer copy boundaries, for
/// comparing).
fn group_share() -> usize {
    static SHARE: OnceLock<usize> = OnceLock::new();
    *SHARE.get_or_init(|| {
        std::env::var("TANDEM_KV_WRITE_GROUP_SHARE").ok().and_then(|v| v.parse().ok()).filter(|p| (1..100).contains(p)).unwrap_or(50)
    })
}

/// Whether a cut batch's last chunk is a write group of its own (`TANDEM_KV_NO_SMALL_LAST_GROUP=1`
/// leaves it with the rest, for comparing).
fn small_last_group() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NO_SMALL_LAST_GROUP").is_none())
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
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// `n` little-endian `u32`s (a chunk's block ids), read in one go.
    fn u32s(&mut self, n: usize) -> std::result::Result<Vec<u32>, String> {
        let bytes = n.checked_mul(4).filter(|&b| b <= self.buf.len()).ok_or("control message too short")?;
        let (head, tail) = self.buf.split_at(bytes);
        self.buf = tail;
        Ok(head.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes"))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn groups(sizes: &[usize]) -> Vec<usize> {
        groups_of(sizes, 50)
    }

    fn groups_of(sizes: &[usize], share: usize) -> Vec<usize> {
        let ends = write_groups(sizes.iter().copied(), WRITE_GROUP_MIN, share);
        let mut begin = 0;
        ends.iter()
            .map(|&end| {
                let bytes = sizes[begin..end].iter().sum::<usize>() / MIB;
                begin = end;
                bytes
            })
            .collect()
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn paired_runs_move_every_block_where_a_block_by_block_walk_would() {
        let memory = KvMemory::host(crate::geometry::tests::small("runs"), 64).unwrap();
        let bb = memory.geometry().block_bytes() as u64;
        let base = 0x7000_0000u64;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..300 {
            let n = 1 + (xorshift(&mut state) % 40) as usize;
            // Runs of neighbours on both sides, cut at random.
            let pick = |state: &mut u64| -> Vec<u32> {
                let mut ids: Vec<u32> = Vec::new();
                while ids.len() < n {
                    let start = (xorshift(state) % 64) as u32;
                    let len = 1 + (xorshift(state) % 6) as u32;
                    for b in start..(start + len).min(64) {
                        if ids.len() < n && !ids.contains(&b) {
                            ids.push(b);
                        }
                    }
                }
                ids
            };
            let (src, dst) = (pick(&mut state), pick(&mut state));
            let layer = (xorshift(&mut state) % 3) as u32;
            let iovs = memory.iovs(layer, &src);
            let dst_runs = block_runs(&dst, 64).unwrap();
            assert_eq!(dst_runs.iter().map(|r| r.1 as usize).sum::<usize>(), n);
            // An id past the receiver's pool is refused, wherever it is.
            let mut past = dst.clone();
            let at = (xorshift(&mut state) as usize) % n;
            past[at] = 64;
            assert!(block_runs(&past, 64).is_err());
            let (copies, blocks) = pair_runs(&memory, &iovs, base, &dst_runs).unwrap();
            assert_eq!(blocks, n);
            // Expanded block by block, the copies are exactly the pairs, in order.
            let expanded: Vec<(u64, u64)> = copies
                .iter()
                .flat_map(|&(d, s, bytes)| (0..bytes as u64 / bb).map(move |k| (d + k * bb, s + k * bb)))
                .collect();
            let want: Vec<(u64, u64)> =
                src.iter().zip(&dst).map(|(&a, &b)| (base + u64::from(b) * bb, memory.block_addr(layer, a) as u64)).collect();
            assert_eq!(expanded, want);
            // And no two neighbouring copies could have been one.
            assert!(copies.windows(2).all(|w| w[0].0 + w[0].2 as u64 != w[1].0 || w[0].1 + w[0].2 as u64 != w[1].1));
            // Destinations of another length are refused.
            assert!(pair_runs(&memory, &iovs, base, &dst_runs[..dst_runs.len() - 1]).is_err());
            let mut longer = dst_runs.clone();
            longer.push((63, 1));
            assert!(pair_runs(&memory, &iovs, base, &longer).is_err());
        }
    }

    #[test]
    fn big_batches_go_in_halving_groups_down_to_a_small_last_one() {
        assert_eq!(groups(&[8 * MIB; 32]), [128, 64, 32, 24, 8]);
        assert_eq!(groups(&[8 * MIB; 28]), [112, 56, 32, 16, 8]);
        assert_eq!(groups(&[8 * MIB; 5]), [24, 8, 8]);
        assert_eq!(groups(&[16 * MIB; 2]), [32]);
        assert_eq!(groups(&[MIB; 16]), [16]);
        assert_eq!(groups(&[64 * MIB]), [64]);
        assert!(write_groups(std::iter::empty(), WRITE_GROUP_MIN, 50).is_empty());
        assert_eq!(write_groups([8 * MIB; 32], usize::MAX, 50), [32]);
    }

    #[test]
    fn a_bigger_share_cuts_fewer_groups() {
        // What a 256 MiB transfer's write-ahead hands `write_groups` after its first chunk.
        assert_eq!(groups_of(&[8 * MIB; 31], 50), [128, 64, 32, 16, 8]);
        assert_eq!(groups_of(&[8 * MIB; 31], 75), [192, 48, 8]);
        assert_eq!(groups_of(&[8 * MIB; 31], 99), [248]);
    }

    #[test]
    fn groups_cut_every_batch_in_order_and_never_leave_a_chunk_out() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..500 {
            let n = (xorshift(&mut state) % 70) as usize;
            let sizes: Vec<usize> = (0..n).map(|i| ((state >> (i % 40)) as usize % (12 * MIB)) / 4096 * 4096 + 4096).collect();
            let ends = write_groups(sizes.iter().copied(), WRITE_GROUP_MIN, 50);
            assert_eq!(ends.last().copied().unwrap_or(0), n);
            assert!(ends.windows(2).all(|w| w[0] < w[1]) && ends.first().is_none_or(|&e| e > 0));
            // Once the batch is cut, its last chunk is a group of its own, and the one before it
            // holds at most WRITE_GROUP_MIN plus one chunk.
            if let [.., z, a, b] = ends[..] {
                assert_eq!(b - a, 1, "the last group is one chunk");
                let before: usize = sizes[z..a].iter().sum();
                assert!(before <= WRITE_GROUP_MIN + 12 * MIB, "next-to-last group of {before} bytes");
            } else if let [a, b] = ends[..] {
                assert_eq!(b - a, 1, "the last group is one chunk");
            }
        }
    }
}
