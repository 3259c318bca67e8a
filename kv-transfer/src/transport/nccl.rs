//! The NCCL backend: device pools on any two GPUs, of one host or of two. A TCP connection carries
//! the control messages (`wire`); the bytes go through the NCCL communicators of the link (per
//! sender → receiver pair): one made when the link opens and the link's other lanes split from it
//! (4 unless `TANDEM_KV_NCCL_LANES` says otherwise; the fewer of the two ends'), all aborted when it
//! closes. The link's NCCL operations go round-robin over the lanes, each lane on a stream of its
//! own joined into the link's first: NCCL runs one communicator's operations one after another,
//! each paying a start-up, and spread over lanes those start-ups overlap.
//!
//! At connect the sender states its control protocol, NCCL version, GPU and pool layout; the
//! receiver checks them (two different GPUs, the same NCCL major.minor), creates the rendezvous
//! (`ncclGetUniqueId`, rank 0) and answers with its own; both ends then create the communicator in
//! the background while the connector's handshake runs (blocking `ncclCommInitRankConfig`, on a
//! thread of its own that the link stops waiting for after 60 s: a nonblocking communicator would
//! start a thread for every operation, ~100 us before it reaches the stream), allocate two staging
//! buffers each (64 MiB, or one chunk if more), used in turn, and have NCCL connect the pair with a
//! one-byte send (NCCL connects point-to-point channels on their first operation, which would
//! otherwise fall on the first transfer).
//! Chunks go in batches: the chunks the connector hands over at once (the layers ready together),
//! as many as fit a staging buffer (at most 32). Nothing on the data path waits on the host: each
//! link has a stream for its NCCL operations and one for its gathers and scatters, ordered by
//! events. Per batch the sender enqueues the gather of its (scattered) blocks into a staging buffer
//! (one device pull), announces the frames in one message, enqueues one `ncclSend` of the buffer
//! behind the gather and goes on; the receiver's inbox names each chunk's destination blocks, the receiver
//! enqueues one `ncclRecv` into its own staging buffer and behind it the scatter of the chunks it
//! wants into their blocks, which also sums each chunk's destination blocks, and reads on. A
//! thread per link waits for each batch's device work in order: the sender's drops its hold on
//! the source blocks once gathered, the receiver's reports the chunks landed with their sums,
//! which the connector core compares with the sender's before anything is reported.
//!
//! Control protocol v4 sends batches direct instead: one `ncclSend` per payload (one NCCL group),
//! straight from the pool where its blocks are one run (the others alone are gathered into staging
//! first), held until the sends ran; the receiver posts one `ncclRecv` per payload, in the same
//! order and of the same lengths, straight into its blocks when every payload it wants has
//! contiguous blocks (then only verifies them where they landed), else each at its place in a
//! staging buffer, scattered as a staged batch. `TANDEM_KV_NCCL_STAGED=1` stages every batch.
//!
//! Control protocol v6 moves a transfer the receiver granted (see docs/rfc-kv-sender-writes.md)
//! ahead of its messages: the sender offered the transfer's ready layers as a plan
//! (`Link::write_ahead`) writes one `Ahead` message naming, per payload, the run of the receiver's
//! blocks it lands in (every chunk a run at both ends; otherwise the plan is declined and batches
//! go as above) and enqueues one `ncclSend` per run straight from its pool; the receiver checks
//! that the transfer is granted to this link and every run lies in its blocks
//! (`Inbox::granted_blocks`; otherwise the link closes before anything is posted), posts one
//! `ncclRecv` per run straight into its blocks — one per lane first, then rounds of two per lane,
//! an event behind each round — and answers `Landed` once they ran. The payloads' messages follow
//! as batches naming their runs by ticket; the receiver checks each wanted payload's destination
//! against its run and verifies it behind its round's event. `Link::drain` (a fenced transfer)
//! waits for `Landed` of every run sent so far; `Link::quiesce` for the reader's end (the
//! communicators aborted, every job waited for). `TANDEM_KV_NCCL_NO_AHEAD=1` turns it off.
//!
//! Endpoint: `nccl://HOST:PORT` (the control channel; NCCL's own bootstrap and data connections
//! are NCCL's: `NCCL_SOCKET_IFNAME` and friends choose their interfaces).
//!
//! Invariants (besides those of every transport):
//! - Payloads only flow from the side that connected (the sender) to the side that accepted.
//! - Every posted receive is matched by one send of the same length, on the same lane, in the same
//!   order: the sender enqueues its sends right after it announced the batch or the runs sent ahead
//!   (a sender whose gather failed sends its buffer anyway and says so in the announcement; one
//!   that cannot enqueue, or abandons the batch in between, closes the link), the receiver posts a
//!   receive for every announced batch, wanted or not, and for every run sent ahead (or closes the
//!   link, when the runs are not the granted transfer's), and both ends put the link's `n`th
//!   operation on lane `n % lanes`; a link whose NCCL operation failed is closed, and its
//!   communicators aborted.
//! - A receiver's NCCL kernels wait on its peer's host at most for the time the sender takes to
//!   enqueue a batch it announced (the announcement goes first so that the receive is posted
//!   while the send is enqueued); a link's operations are ordered on its own streams (a stalled
//!   link never holds up another).
//! - A staging buffer is reused only behind events: a gather (scatter) waits for the last NCCL
//!   operations on its buffer (every lane's, joined), an NCCL operation for the last gather
//!   (scatter) of its buffer and for the last NCCL operations on it.
//! - NCCL writes the staging buffers, and destination blocks only through a direct batch's
//!   receives into the blocks the inbox gave its chunks, or through receives of runs sent ahead
//!   into blocks the receiver granted that transfer to the link and still holds for it (a batch
//!   naming a run checks the inbox gave its chunk exactly those blocks, else the link closes);
//!   `on_payload` comes after the scatter (or, received straight into the blocks, their
//!   verification) finished — a failure, after the
//!   link's NCCL stream ran out, since a receive may still be writing the blocks — (after the
//!   communicator was aborted, if the link closed meanwhile; should the work still not finish
//!   within `DRAIN`, the chunks are reported failed and the pull slot is never reused), in
//!   delivery order; `on_link_closed` after the last of them.
//! - Every wait is bounded: communicator creation by `INIT` (60 s; NCCL's blocking creation cannot
//!   be interrupted, so a peer that never joins leaves that thread behind), device work by the
//!   link (closed at the transfer's deadline or when the peer goes; then its communicator is
//!   aborted and its work waited for at most `DRAIN`), an accepted connection's handshake by 5 s
//!   and its silence by 90 s; each control message is at most 64 KiB.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::task::JoinHandle;

use crate::MAX_CHUNK_BLOCKS;
use crate::core::lock;
use crate::device::{Blocks, DeviceKv, PULL_SLOTS, PullEvent};
use crate::error::{Error, Result};
use crate::memory::{Iov, KvMemory, MemoryKind};
use crate::transport::link_state::{Closed, LinkState};
use crate::transport::spin_read::{Alert, SpinRead, spawn_reader};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

mod ffi;
mod wire;

pub use ffi::{communicators_left_unaborted, library_version};
use ffi::{Comm, DeviceBuffer, Dir, UniqueId};
use wire::{Control, Moved, Side};

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
/// How long a closed link's device work may take to finish once its communicator was aborted
/// (then its chunks are reported failed anyway, and its pull slots never reused).
const DRAIN: Duration = Duration::from_secs(5);
/// Most accepted links open at once (each holds a communicator and staging buffers on the GPU).
const MAX_INCOMING: usize = 64;
/// Bytes of each of a link's two staging buffers on each side (more when one chunk needs more): a
/// batch of chunks goes through NCCL as one operation of at most this much.
const STAGING_TARGET: usize = 64 << 20;
/// Ranks of a link's communicator.
const RANK_RECEIVER: i32 = 0;
const RANK_SENDER: i32 = 1;

/// Communicators a link spreads its operations over unless `TANDEM_KV_NCCL_LANES` says otherwise
/// (1 to [`MAX_LANES`]). NCCL runs a communicator's point-to-point operations one after another,
/// each paying a start-up of ~8 us and running below the link's rate while it ramps up: 32 sends
/// of 8 MiB (in one group, or in 4 or 32) move at 70–80 % of one 256 MiB send on two H200s, and at
/// 88–99 % spread over 4 communicators of the same pair (measured with cupy; see BENCHMARKS.md).
const DEFAULT_LANES: u8 = 4;
const MAX_LANES: u8 = 8;

/// The lanes this process offers its peers: [`DEFAULT_LANES`], or `TANDEM_KV_NCCL_LANES`.
fn lanes_from_env() -> Result<u8> {
    match std::env::var("TANDEM_KV_NCCL_LANES") {
        Err(_) => Ok(DEFAULT_LANES),
        Ok(v) => v
            .trim()
            .parse::<u8>()
            .ok()
            .filter(|n| (1..=MAX_LANES).contains(n))
            .ok_or_else(|| Error::Invalid(format!("TANDEM_KV_NCCL_LANES={v}: expected a number of communicators from 1 to {MAX_LANES}"))),
    }
}

/// Whether batches whose payloads are contiguous runs of blocks move straight between the pools
/// (`TANDEM_KV_NCCL_STAGED=1` stages every batch, for comparing the two).
fn direct_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NCCL_STAGED").is_none())
}

/// Whether a batch's NCCL operations go in one group over every lane
/// (`TANDEM_KV_NCCL_ONE_GROUP=1`, for comparing) rather than in a group per lane, lane by lane.
fn one_group() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NCCL_ONE_GROUP").is_some())
}

/// Whether this end takes grants and moves granted transfers ahead of their messages
/// ([`Control::Ahead`]; `TANDEM_KV_NCCL_NO_AHEAD=1` keeps every payload in announced batches, for
/// comparing the two).
fn ahead_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NCCL_NO_AHEAD").is_none())
}

/// Runs a receiver keeps announced ahead and not yet claimed by a batch (older ones are dropped:
/// their sender gave up on them, and their receives finish on their own).
const AHEAD_KEPT: usize = 4 * wire::MAX_AHEAD;

/// A chunk whose blocks are one run at both ends: `(source first block, destination first block,
/// blocks)`.
type ChunkRuns = (u32, u32, u32);

/// A write plan's chunks as runs at both ends ([`ChunkRuns`]), or `None` when a chunk's blocks
/// are not one run at either end (such transfers go in announced batches). `Err`: a chunk outside
/// the plan's block lists.
fn ahead_chunks(plan: &super::WritePlan<'_>) -> std::result::Result<Option<Vec<ChunkRuns>>, String> {
    let run = |ids: &[u32]| ids.windows(2).all(|w| w[1] == w[0].wrapping_add(1));
    let mut out = Vec::with_capacity(plan.chunks.len());
    for &(at, count) in plan.chunks {
        let end = at.checked_add(count).ok_or("a chunk outside the transfer's blocks")?;
        let (Some(src), Some(dst)) = (plan.src.get(at..end), plan.dst.get(at..end)) else {
            return Err("a chunk outside the transfer's blocks".into());
        };
        let (Some(&s), Some(&d)) = (src.first(), dst.first()) else {
            return Err("an empty chunk".into());
        };
        if !run(src) || !run(dst) {
            return Ok(None);
        }
        out.push((s, d, count as u32));
    }
    Ok(Some(out))
}

/// How a receiver posts `n` runs announced ahead over `lanes` lanes: the first round one per lane
/// (each lane's first bytes move after one NCCL call's host work, not after a group's), then
/// rounds of two per lane, an event behind each round (the chunks of a round are verified once it
/// landed, while the next ones move).
fn ahead_rounds(n: usize, lanes: usize) -> Vec<std::ops::Range<usize>> {
    let mut rounds = Vec::new();
    let mut at = 0;
    while at < n {
        let len = ahead_round_len(at, lanes);
        rounds.push(at..(at + len).min(n));
        at += len;
    }
    rounds
}

/// The length of the round of [`ahead_rounds`] that starts at run `at` (no lanes count as one).
fn ahead_round_len(at: usize, lanes: usize) -> usize {
    lanes.max(1) * if at == 0 { 1 } else { 2 }
}

/// Whether a round of [`ahead_rounds`] ends after the first `k` runs (whatever their number).
fn ahead_round_ends(k: usize, lanes: usize) -> bool {
    let first = ahead_round_len(0, lanes);
    k == first || (k > first && (k - first).is_multiple_of(ahead_round_len(first, lanes)))
}

/// Writes `buf` on the socket now, without the runtime (a link's `write_ahead` is synchronous):
/// `Ok(false)` if not a byte could go (the caller may do without), `Ok(true)` once all went.
/// After a first byte the rest is waited for (a peer that reads nothing for a second fails it).
fn write_now(wr: &OwnedWriteHalf, buf: &[u8]) -> std::io::Result<bool> {
    let mut at = 0;
    let since = Instant::now();
    while at < buf.len() {
        match wr.try_write(&buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if at == 0 {
                    return Ok(false);
                }
                if since.elapsed() > Duration::from_secs(1) {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                std::thread::yield_now();
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `Ok` when every run `(layer, first block, blocks)` lies in `granted` (a transfer's destination
/// block ids, the same in every layer), else which does not.
fn runs_granted(runs: &[(u32, u32, u32)], granted: &[u32]) -> std::result::Result<(), String> {
    let mut ids = granted.to_vec();
    ids.sort_unstable();
    ids.dedup();
    for &(layer, first, count) in runs {
        let last = u64::from(first) + u64::from(count.max(1)) - 1;
        // Sorted and without repeats: the run is granted when its first and last block are, `count` apart.
        let inside = ids.binary_search(&first).is_ok_and(|i| ids.get(i + count.max(1) as usize - 1).is_some_and(|&l| u64::from(l) == last));
        if !inside {
            return Err(format!("layer {layer}, blocks {first}+{count} are not the transfer's"));
        }
    }
    Ok(())
}

/// A run a receiver received ahead (see [`Control::Ahead`]), until a batch names it.
struct AheadRun {
    layer: u32,
    first: u32,
    count: u32,
    /// Recorded behind the receives of its round.
    done: Arc<CudaEvent>,
}

/// A chunk in a staging buffer: `(layer, block ids in the pool, first staging block)`.
type StagedChunk = (u32, Vec<u32>, u32);

/// A payload of a direct batch: `(layer, block ids in the pool, the run's device address)`, the
/// address `None` when its blocks are not one run.
type DirectPayload = (u32, Vec<u32>, Option<u64>);

/// The NCCL transport; see the module doc.
pub struct NcclTransport {
    endpoint: String,
    memory: Arc<KvMemory>,
    device: Arc<DeviceKv>,
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
    /// The device side's pull slots this transport's gathers and scatters use (a permit per move).
    slots: Arc<tokio::sync::Semaphore>,
    free_slots: Arc<Mutex<Vec<usize>>>,
    /// Arms the receiving links' readers when a transfer is expected (see `spin_read::Alert`).
    alert: Arc<Alert>,
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
            lanes: if ffi::api()?.can_split() { lanes_from_env()? } else { 1 },
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
            free_slots: Arc::new(Mutex::new((0..PULL_SLOTS).rev().collect())),
            alert: Arc::default(),
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
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
        let link = Arc::new(NcclLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            sender_side,
            writer: tokio::sync::Mutex::new(Some(wr)),
            state,
            closing: Closing(closed_rx.clone()),
            gpu,
            jobs: Mutex::new(Some(jobs_tx)),
            worker: Mutex::new(None),
            transport: self.me.clone(),
            ahead: ahead_enabled() && theirs.version >= 6,
            ahead_next: AtomicU64::new(0),
            ahead_landed: watch::channel(0).0,
            ahead_runs: Mutex::new(BTreeMap::new()),
            reader_done: watch::channel(false).0,
            rt: tokio::runtime::Handle::current(),
        });
        let worker = {
            let (link, device, inbox, free) =
                (Arc::clone(&link), Arc::clone(&self.device), Arc::clone(&self.inbox), Arc::clone(&self.free_slots));
            std::thread::Builder::new().name("tandem-kv-nccl".into()).spawn(move || link_worker(jobs_rx, &link, &device, &*inbox, &free))
        };
        match worker {
            Ok(w) => *lock(&link.worker) = Some(w),
            Err(e) => link.state.fail(format!("starting the link's device thread: {e}")),
        }
        lock(&self.links).insert(link.id, Arc::clone(&link));
        if self.shut.load(Ordering::Acquire) {
            link.close();
        }
        let reader = Reader {
            inbox: Arc::clone(&self.inbox),
            link: Arc::clone(&link),
            transport: self.me.clone(),
        };
        spawn_reader(!link.sender_side, move |spin| reader.run(rd, closed_rx, spin));
        if self.side.same_layout(&theirs) {
            let rank = if sender_side { RANK_SENDER } else { RANK_RECEIVER };
            self.start_comm(&link, id, rank, self.side.lanes_with(&theirs));
        } else {
            // The connector's handshake refuses this pair with the reason; no communicator for it.
            link.gpu.send_replace(GpuState::Failed(
                "the peer's pool has another layout".into(),
            ));
        }
        link
    }

    /// Creates the link's communicators (`lanes`) and staging buffers in the background.
    fn start_comm(&self, link: &Arc<NcclLink>, id: UniqueId, rank: i32, lanes: usize) {
        let (ctx, bytes) = (self.device.context(), self.staging_bytes);
        let closing = link.closing.clone();
        let link = Arc::clone(link);
        tokio::spawn(async move {
            let made = tokio::task::spawn_blocking(move || {
                LinkGpu::create(ctx, &id, rank, lanes, bytes, &closing)
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
                    tracing::debug!(peer = %link.state.peer(), published, "nccl communicator made");
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

    /// Where a batch's payloads lie: `(layer, block ids, first staging block)` of each, back to back
    /// from the start of a staging buffer; and which of them the corruption test hook picks.
    fn locate(&self, payloads: &[Payload]) -> std::result::Result<(Vec<StagedChunk>, Option<usize>), String> {
        let mut chunks = Vec::with_capacity(payloads.len());
        let mut at = 0usize;
        let corrupt = self.pick_corrupt(payloads.len());
        for payload in payloads {
            let Some((layer, ids)) = self.memory.blocks_of(payload.iovs()) else {
                return Err("a payload is not whole blocks of one layer of the pool".into());
            };
            let count = ids.len();
            chunks.push((layer, ids, at as u32));
            at += count;
        }
        if at * self.memory.geometry().block_bytes() > self.staging_bytes {
            return Err(format!("{at} blocks exceed a staging buffer"));
        }
        Ok((chunks, corrupt))
    }

    /// Which of a batch of `n` payloads the corruption test hook picks (at most one: the first
    /// the count hits).
    fn pick_corrupt(&self, n: usize) -> Option<usize> {
        let mut corrupt = None;
        for i in 0..n {
            let k = self.staged.fetch_add(1, Ordering::Relaxed) + 1;
            if corrupt.is_none() && self.corrupt_every.is_some_and(|every| k.is_multiple_of(every)) {
                corrupt = Some(i);
            }
        }
        corrupt
    }

    /// Where each payload of a batch lies, for a direct batch: `(layer, block ids, device address
    /// of the run)`, the address `None` when its blocks are not one run (it is gathered into
    /// staging and sent from there). `None` (stage the batch): direct batches are off, or a payload
    /// is not whole blocks of one layer (the staged path reports that).
    fn direct_plan(&self, payloads: &[Payload]) -> Option<Vec<DirectPayload>> {
        if !direct_enabled() {
            return None;
        }
        direct_plan(&self.memory, payloads)
    }

    /// Takes a pull slot (waiting while all are in use, or until the link closes).
    async fn slot(&self, closing: &Closing) -> std::result::Result<(usize, OwnedSemaphorePermit), String> {
        let mut closed = closing.0.clone();
        let permit = tokio::select! {
            p = Arc::clone(&self.slots).acquire_owned() => p.map_err(|_| "transport shut down".to_string())?,
            _ = closed.wait_for(|c| *c != Closed::Open) => return Err("link closed".into()),
        };
        let slot = lock(&self.free_slots).pop().ok_or("no free pull slot")?;
        Ok((slot, permit))
    }

    /// Enqueues the move of `chunks` `(layer, block ids, first staging block)` between the pool and
    /// staging buffer `k` of the link (pool → staging: `gather`, the sender; `corrupt` names a
    /// chunk that gets one byte flipped in staging, the integrity test hook; staging → pool: the
    /// receiver, whose pull sums each chunk's destination blocks), on the link's copy stream.
    fn enqueue_move(
        &self,
        gpu: &LinkGpu,
        k: usize,
        slot: usize,
        chunks: &[StagedChunk],
        gather: bool,
        corrupt: Option<usize>,
    ) -> std::result::Result<PullEvent, String> {
        let bb = self.memory.geometry().block_bytes();
        let staging_blocks = (gpu.staging[k].bytes() / bb) as u32;
        let slots: Vec<Vec<u32>> = chunks.iter().map(|(_, ids, at)| (*at..*at + ids.len() as u32).collect()).collect();
        let pairs: Vec<(Blocks<'_>, Blocks<'_>)> = chunks
            .iter()
            .zip(&slots)
            .map(|((layer, ids, _), slots)| {
                let pool = Blocks { base: self.memory.layer_base(*layer) as u64, num_blocks: self.memory.num_blocks(), ids };
                let staging = Blocks { base: gpu.staging[k].ptr(), num_blocks: staging_blocks, ids: slots };
                if gather { (pool, staging) } else { (staging, pool) }
            })
            .collect();
        gpu.moved(k, self.device.pull_on(&gpu.copy, &gpu.net_done[k], slot, &pairs, bb, corrupt).map_err(|e| e.to_string()))
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

    fn expecting(&self) {
        self.alert.arm(super::spin_read::spin_window());
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

/// A link's device side: its communicators (one per lane), a stream per lane for its NCCL
/// operations (lane 0's, `net`, is the one the rest of the link orders against) and one for its
/// gathers and scatters (`copy`), two staging buffers used in turn, and per buffer the events that
/// order their reuse: `net_done[k]` behind the last NCCL operations on buffer `k` (recorded on
/// `net` once every lane's work of the batch joined it), `copy_done[k]` behind its last gather or
/// scatter.
struct LinkGpu {
    ctx: Arc<CudaContext>,
    // Events before streams (drop order); all of `ctx`.
    net_done: [CudaEvent; 2],
    copy_done: [CudaEvent; 2],
    /// Lanes 1..: each one's stream and the event that joins its work into `net`.
    lanes: Vec<(CudaEvent, Arc<CudaStream>)>,
    net: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    staging: [DeviceBuffer; 2],
    /// Batches so far (the next one's buffer is this modulo 2); advanced by the sender's writer or
    /// the receiver's reader alone.
    batches: AtomicUsize,
    /// NCCL operations enqueued so far: the link's `n`th operation goes on lane `n % lanes` (both
    /// ends enqueue the same operations in the same order, so each lane's communicator matches its
    /// sends and receives in order). Advanced under the `comms` lock.
    ops: AtomicUsize,
    /// One communicator per lane; empty once aborted. Every NCCL call on them is made under this
    /// lock.
    comms: Mutex<Vec<Comm>>,
}

impl LinkGpu {
    /// Creates rank `rank` of the link's communicator (bounded by [`INIT`] and the link closing),
    /// then its streams, events and staging buffers. Blocking.
    fn create(
        ctx: Arc<CudaContext>,
        id: &UniqueId,
        rank: i32,
        lanes: usize,
        staging_bytes: usize,
        closing: &Closing,
    ) -> std::result::Result<LinkGpu, String> {
        let api = ffi::api().map_err(|e| e.to_string())?;
        // NCCL's blocking creation cannot be interrupted: it runs on a thread of its own, which this
        // one gives up on (leaving it to finish, or to hang on a peer that never joins) when the
        // link closes or INIT passes; a communicator made after that is aborted.
        let (id, abandon) = (*id, Arc::new(AtomicBool::new(false)));
        let (tx, rx) = std::sync::mpsc::channel();
        let flag = Arc::clone(&abandon);
        std::thread::Builder::new()
            .name("tandem-kv-nccl-init".into())
            .spawn(move || {
                let made = LinkGpu::make(api, ctx, &id, rank, lanes, staging_bytes, &flag);
                let _ = tx.send(made); // unheard: dropped, its communicator aborted
            })
            .map_err(|e| format!("starting the communicator's thread: {e}"))?;
        let since = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(made) => return made,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Err("the communicator's thread failed".into()),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            let give_up = if closing.now() {
                Some("link closed".to_string())
            } else if since.elapsed() > INIT {
                Some(format!(
                    "no communicator within {INIT:?} (can the two hosts reach each other on NCCL's interfaces? see NCCL_SOCKET_IFNAME)"
                ))
            } else {
                None
            };
            if let Some(reason) = give_up {
                tracing::debug!(%reason, "nccl: giving up on the communicator being made");
                abandon.store(true, Ordering::Release);
                return Err(reason);
            }
        }
    }

    /// [`LinkGpu::create`]'s thread: the communicator (blocking: returns when both ranks joined; a
    /// nonblocking communicator would hand every operation to a thread NCCL starts for it, ~100 us
    /// before it reaches the stream) and `lanes - 1` more split from it, streams, events, staging
    /// buffers, and every lane connected.
    fn make(
        api: &'static ffi::Api,
        ctx: Arc<CudaContext>,
        id: &UniqueId,
        rank: i32,
        lanes: usize,
        staging_bytes: usize,
        abandon: &AtomicBool,
    ) -> std::result::Result<LinkGpu, String> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        // A communicator (or lane) whose making fails is given up unaborted, and so are those made
        // before it: see `Comm::leak`.
        let comm = Comm::start(api, id, rank, 2, true)?;
        if let Err(e) = comm.ready() {
            comm.leak();
            return Err(e);
        }
        let mut comms = vec![comm];
        for _ in 1..lanes {
            match comms[0].split(rank) {
                Ok(lane) => comms.push(lane),
                Err(e) => {
                    comms.into_iter().for_each(Comm::leak);
                    return Err(format!("splitting the communicator into {lanes} lanes: {e}"));
                }
            }
        }
        let stream = || ctx.new_stream().map_err(|e| format!("creating a stream: {e}"));
        let event = || ctx.new_event(Some(CU_EVENT_DISABLE_TIMING)).map_err(|e| format!("creating an event: {e}"));
        let gpu = LinkGpu {
            net_done: [event()?, event()?],
            copy_done: [event()?, event()?],
            lanes: (1..lanes).map(|_| Ok((event()?, stream()?))).collect::<std::result::Result<_, String>>()?,
            net: stream()?,
            copy: stream()?,
            staging: [DeviceBuffer::new(&ctx, staging_bytes)?, DeviceBuffer::new(&ctx, staging_bytes)?],
            batches: AtomicUsize::new(0),
            ops: AtomicUsize::new(0),
            comms: Mutex::new(comms),
            ctx,
        };
        // NCCL connects a pair's point-to-point channels on their first operation, with the peer:
        // do that now on every lane, one byte from the sender to the receiver each, rather than in
        // the first transfer.
        let dir = if rank == RANK_SENDER { Dir::Send } else { Dir::Recv };
        {
            let mut comms = lock(&gpu.comms);
            let peer = if dir == Dir::Send { RANK_RECEIVER } else { RANK_SENDER };
            let connected = api.group(|| {
                comms.iter().enumerate().try_for_each(|(l, comm)| {
                    // SAFETY: one byte of a staging buffer of this GPU, which nothing else uses yet
                    // (the lanes only write the same byte: the receiver never reads it); `gpu` (and
                    // so the buffer) lives until the streams ran out below, or until after the
                    // abort that ends the operations.
                    unsafe { comm.p2p(dir, gpu.staging[0].ptr(), 1, peer, gpu.lane_stream(l).cu_stream() as *mut std::ffi::c_void) }
                })
            });
            if let Err(e) = connected {
                // The lanes failed to connect (the group launched nothing): see `Comm::leak`.
                std::mem::take(&mut *comms).into_iter().for_each(Comm::leak);
                return Err(e);
            }
        }
        loop {
            gpu.issued()?;
            if gpu.net_idle()? {
                return Ok(gpu);
            }
            if abandon.load(Ordering::Acquire) {
                gpu.abort();
                return Err("given up".into());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The link's lanes (communicators; 0 once aborted).
    fn lane_count(&self) -> usize {
        lock(&self.comms).len()
    }

    /// Lane `l`'s stream (`net` for lane 0).
    fn lane_stream(&self, l: usize) -> &Arc<CudaStream> {
        match l {
            0 => &self.net,
            l => &self.lanes[l - 1].1,
        }
    }

    /// The staging buffer of the next batch.
    fn next_buffer(&self) -> usize {
        self.batches.fetch_add(1, Ordering::Relaxed) % 2
    }

    /// Records, behind a gather or scatter of buffer `k` just enqueued on the copy stream (or that
    /// failed to), that its last copy work is there; passes `moved` through.
    fn moved<T>(&self, k: usize, moved: std::result::Result<T, String>) -> std::result::Result<T, String> {
        let recorded = self
            .ctx
            .bind_to_thread()
            .and_then(|()| self.copy_done[k].record(&self.copy))
            .map_err(|e| format!("recording a staging event: {e}"));
        let moved = moved?;
        recorded.map(|()| moved)
    }

    /// Enqueues one `ncclSend` or `ncclRecv` of the first `bytes` of staging buffer `k`, behind the
    /// buffer's last gather or scatter (see [`LinkGpu::enqueue_p2p_all`]); poll
    /// [`LinkGpu::issued`], then [`LinkGpu::record_net`].
    fn enqueue_p2p(&self, dir: Dir, k: usize, bytes: usize) -> std::result::Result<(), String> {
        if bytes > self.staging[k].bytes() {
            return Err(format!("a {bytes}-byte batch exceeds a staging buffer"));
        }
        // SAFETY: the staging buffer is this GPU's memory, at least `bytes` long; only this link's
        // operations touch it, ordered by the buffer's events (the NCCL operation waits for the
        // buffer's last gather or scatter, and the next one waits for `net_done[k]`, recorded behind
        // this operation); it lives as long as `self`, which outlives the operation or the abort
        // that ends it.
        unsafe { self.enqueue_p2p_all(dir, k, &[(self.staging[k].ptr(), bytes)]) }
    }

    /// Enqueues one NCCL operation per `(device address, bytes)` of `ops` (one group), each on the
    /// next lane in turn, behind the last gather or scatter of staging buffer `k` and its last
    /// NCCL operations (receives may land there); the lanes' work then joins `net`. Poll
    /// [`LinkGpu::issued`], then [`LinkGpu::record_net`].
    ///
    /// # Safety
    /// Each range must be this GPU's memory — of the pool, claimed by the transfer (and, sending,
    /// held until the operation completed), or of staging buffer `k` — that nothing else touches
    /// until the operation completed or the communicator was aborted.
    unsafe fn enqueue_p2p_all(&self, dir: Dir, k: usize, ops: &[(u64, usize)]) -> std::result::Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| format!("binding the context: {e}"))?;
        let order = |e: cudarc::driver::DriverError| format!("ordering the NCCL operation: {e}");
        let comms = lock(&self.comms);
        if comms.is_empty() {
            return Err("the communicator was aborted".into());
        }
        let first = self.ops.fetch_add(ops.len(), Ordering::Relaxed);
        let lane = |i: usize| (first + i) % comms.len();
        // The lanes this batch uses besides `net` (the first `lanes` operations name them all).
        let others: Vec<usize> = (0..ops.len().min(comms.len())).map(lane).filter(|&l| l != 0).collect();
        // Only operations on staging buffer `k` wait for its last gather or scatter and its last
        // NCCL operations (`net` is in stream order behind `net_done[k]` already); a batch straight
        // between the pools (blocks the transfer claimed) has nothing to wait for.
        let (at, len) = (self.staging[k].ptr(), self.staging[k].bytes() as u64);
        if ops.iter().any(|&(addr, _)| addr >= at && addr < at + len) {
            self.net.wait(&self.copy_done[k]).map_err(order)?;
            for &l in &others {
                let s = self.lane_stream(l);
                s.wait(&self.copy_done[k]).map_err(order)?;
                s.wait(&self.net_done[k]).map_err(order)?;
            }
        }
        super::kv_trace!("nccl enqueue of {} operations: ordered", ops.len());
        let peer = if dir == Dir::Send { RANK_RECEIVER } else { RANK_SENDER };
        let issue = |i: usize, (buf, bytes): (u64, usize)| {
            let l = lane(i);
            // SAFETY: the caller's contract; each lane's stream is this link's, of the same context.
            unsafe { comms[l].p2p(dir, buf, bytes, peer, self.lane_stream(l).cu_stream() as *mut std::ffi::c_void) }
        };
        let lanes = comms.len();
        match ops {
            [op] => issue(0, *op)?,
            _ if lanes == 1 || one_group() => {
                ffi::api().map_err(|e| e.to_string())?.group(|| ops.iter().enumerate().try_for_each(|(i, op)| issue(i, *op)))?
            }
            _ => {
                // Lane by lane, each lane's operations a group of their own: NCCL launches a
                // group's kernels when the group ends, after ~10 us of host work per communicator
                // in it, so the first lane's operations reach their stream after one
                // communicator's share instead of after every lane's (a lane's operations stay in
                // the batch's order, so both ends still match them one for one).
                let api = ffi::api().map_err(|e| e.to_string())?;
                for j in 0..lanes.min(ops.len()) {
                    match (j..ops.len()).step_by(lanes).collect::<Vec<_>>()[..] {
                        [i] => issue(i, ops[i])?,
                        ref mine => api.group(|| mine.iter().try_for_each(|&i| issue(i, ops[i])))?,
                    }
                }
            }
        }
        super::kv_trace!("nccl enqueue of {} operations: issued", ops.len());
        for &l in &others {
            let (join, s) = &self.lanes[l - 1];
            join.record(s).map_err(order)?;
            self.net.wait(join).map_err(order)?;
        }
        Ok(())
    }

    /// An event recorded now on the net stream (behind the operations enqueued so far).
    fn net_event(&self) -> std::result::Result<CudaEvent, String> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        self.ctx.bind_to_thread().map_err(|e| format!("binding the context: {e}"))?;
        let e = self.ctx.new_event(Some(CU_EVENT_DISABLE_TIMING)).map_err(|e| format!("creating an event: {e}"))?;
        e.record(&self.net).map_err(|e| format!("recording an event: {e}"))?;
        Ok(e)
    }

    /// Whether every lane's stream ran out of work.
    fn net_idle(&self) -> std::result::Result<bool, String> {
        use cudarc::driver::sys::{CUresult, cuStreamQuery};
        for l in 0..=self.lanes.len() {
            // SAFETY: a live stream of this link's context.
            match unsafe { cuStreamQuery(self.lane_stream(l).cu_stream()) } {
                CUresult::CUDA_SUCCESS => {}
                CUresult::CUDA_ERROR_NOT_READY => return Ok(false),
                e => return Err(format!("an NCCL stream failed: {e:?}")),
            }
        }
        Ok(true)
    }

    /// Whether the last NCCL calls were issued onto the streams (a nonblocking communicator may
    /// still be connecting to its peer); `Err` when a communicator failed or they were aborted.
    fn issued(&self) -> std::result::Result<bool, String> {
        let comms = lock(&self.comms);
        if comms.is_empty() {
            return Err("the communicator was aborted".into());
        }
        for comm in comms.iter() {
            if !comm.ready()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Records `net_done[k]` behind the NCCL operation just issued on buffer `k`.
    fn record_net(&self, k: usize) -> std::result::Result<(), String> {
        self.ctx
            .bind_to_thread()
            .and_then(|()| self.net_done[k].record(&self.net))
            .map_err(|e| format!("recording a staging event: {e}"))
    }

    /// Aborts the communicators (once): their kernels stop, so the link's streams run out. Blocking.
    fn abort(&self) {
        let comms = std::mem::take(&mut *lock(&self.comms));
        let n = comms.len();
        for comm in comms {
            comm.abort();
        }
        tracing::debug!(communicators = n, "nccl: communicators aborted");
    }
}

/// Aborts a link's communicator, off the async runtime (it may wait for NCCL's threads); the staging
/// buffers go with the last holder of `gpu`.
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

impl GpuState {
    fn name(&self) -> &'static str {
        match self {
            GpuState::Starting => "starting",
            GpuState::Ready(_) => "ready",
            GpuState::Failed(_) => "failed",
        }
    }
}

/// A batch's device work, waited for in order by the link's worker thread.
enum Job {
    /// Sender: a gather (`None`: it failed to start); the payloads it reads stay held until it ran.
    Gathered {
        pull: Option<PullEvent>,
        slot: usize,
        _permit: OwnedSemaphorePermit,
        _hold: Vec<Payload>,
        /// The staging buffer it writes.
        _gpu: Arc<LinkGpu>,
    },
    /// Sender: a batch sent straight from the pool; the payloads stay held until its operations
    /// ran (`done`, recorded behind them; `None`: recording failed, the link is closing).
    Sent {
        done: Option<CudaEvent>,
        _hold: Vec<Payload>,
        gpu: Arc<LinkGpu>,
    },
    /// Receiver: a scatter into the wanted chunks' blocks (or their verification, when they were
    /// received straight into them), reported for their inbox tokens when it ran.
    Scattered {
        pull: PullEvent,
        slot: usize,
        _permit: OwnedSemaphorePermit,
        tokens: Vec<u64>,
        /// The staging buffer it reads.
        _gpu: Arc<LinkGpu>,
    },
    /// Receiver: chunks that fail (reported in their turn; with `after`, once that link's NCCL
    /// stream ran out: a direct batch's receives may still be writing their blocks).
    Failed { tokens: Vec<u64>, reason: String, after: Option<Arc<LinkGpu>> },
    /// Receiver: runs received ahead, whose landing (`done`) the sender hears of
    /// ([`Control::Landed`] up to ticket `upto`) without holding up the jobs behind.
    AheadLanded { done: Arc<CudaEvent>, upto: u64 },
}

/// A link's worker thread: waits for each job's device work in order and reports it (see [`Job`]);
/// ends when the link dropped its end of the queue and every job is done.
fn link_worker(jobs: std::sync::mpsc::Receiver<Job>, link: &Arc<NcclLink>, device: &DeviceKv, inbox: &dyn Inbox, free: &Mutex<Vec<usize>>) {
    let _ = device.context().bind_to_thread();
    let dyn_link: Arc<dyn Link> = Arc::clone(link) as Arc<dyn Link>;
    // When the link was seen closed (its communicator aborted then): bounds every later wait.
    let mut closed_at: Option<Instant> = None;
    // Runs received ahead whose landing the sender has not heard of yet, in order.
    let mut landing: VecDeque<(Arc<CudaEvent>, u64)> = VecDeque::new();
    loop {
        while let Some((done, upto)) = landing.front() {
            // (An event that fails belongs to aborted work: nothing of it lands any more.)
            if !done.try_is_complete().unwrap_or(true) {
                break;
            }
            link.reply_landed(*upto);
            landing.pop_front();
        }
        let job = if landing.is_empty() {
            match jobs.recv() {
                Ok(job) => job,
                Err(_) => break,
            }
        } else {
            match jobs.recv_timeout(Duration::from_micros(50)) {
                Ok(job) => job,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        match job {
            Job::AheadLanded { done, upto } => landing.push_back((done, upto)),
            Job::Gathered { pull, slot, .. } => {
                if let Some(pull) = pull {
                    match link.wait_for(&pull, device, &mut closed_at) {
                        Ok(_) => lock(free).push(slot),
                        Err(e) => tracing::warn!(peer = link.state.peer(), error = %e, "nccl: a gather did not finish; its pull slot is retired"),
                    }
                } else {
                    lock(free).push(slot);
                }
                super::kv_trace!("nccl batch gathered");
            }
            Job::Sent { done, gpu, .. } => {
                // Without its event (enqueueing failed part way; the link is closing), the whole net
                // stream running out is what says no send reads the payloads any more.
                let sent = match &done {
                    Some(done) => link.wait_until(|| done.try_is_complete().map_err(|e| e.to_string()), &mut closed_at),
                    None => link.wait_until(|| gpu.net_idle(), &mut closed_at),
                };
                if let Err(e) = sent {
                    tracing::warn!(peer = link.state.peer(), error = %e, "nccl: a direct send did not finish");
                }
                super::kv_trace!("nccl direct batch sent");
            }
            Job::Scattered { pull, slot, tokens, .. } => {
                match link.wait_for(&pull, device, &mut closed_at) {
                    Ok(sums) => {
                        lock(free).push(slot);
                        super::kv_trace!("nccl batch of {} received, scattered and verified", tokens.len());
                        for (token, sum) in tokens.into_iter().zip(sums) {
                            inbox.on_payload(&dyn_link, token, Ok(Landed { checksum: Some(sum) }));
                        }
                    }
                    Err(e) => {
                        // A closed link: the bytes are not the payloads (the receive was cut short).
                        if closed_at.is_none_or(|t| t.elapsed() < DRAIN) {
                            lock(free).push(slot);
                        }
                        for token in tokens {
                            inbox.on_payload(&dyn_link, token, Err(format!("the payload was not written: {e}")));
                        }
                    }
                }
            }
            Job::Failed { tokens, reason, after } => {
                if let Some(gpu) = after
                    && let Err(e) = link.wait_until(|| gpu.net_idle(), &mut closed_at)
                {
                    tracing::warn!(peer = link.state.peer(), error = %e, "nccl: failed chunks' receives did not finish");
                }
                for token in tokens {
                    inbox.on_payload(&dyn_link, token, Err(reason.clone()));
                }
            }
        }
    }
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
    /// To the worker thread (`None` once the reader ended).
    jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    /// The worker thread, joined when the reader ends (before `on_link_closed`).
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    transport: Weak<NcclTransport>,
    /// Whether the link takes grants and moves granted transfers ahead of their messages (both
    /// ends speak control protocol 6, and this one did not turn it off).
    ahead: bool,
    /// Sender: the next run's ticket (runs announced ahead so far).
    ahead_next: AtomicU64,
    /// Sender: tickets below this landed at the receiver ([`Control::Landed`]).
    ahead_landed: watch::Sender<u64>,
    /// Receiver: runs received ahead that no batch named yet, by ticket.
    ahead_runs: Mutex<BTreeMap<u64, AheadRun>>,
    /// Set once the reader ended: the communicator aborted and every job waited for.
    reader_done: watch::Sender<bool>,
    rt: tokio::runtime::Handle,
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
        let was = self.gpu.send_replace(GpuState::Failed("link closed".into()));
        tracing::debug!(peer = %self.state.peer(), state = was.name(), "nccl link retiring its communicator");
        if let GpuState::Ready(gpu) = was {
            retire(gpu);
        }
    }

    /// Receiver: tells the sender that runs below ticket `upto` landed (from the worker thread).
    fn reply_landed(self: &Arc<Self>, upto: u64) {
        let link = Arc::clone(self);
        self.rt.spawn(async move {
            let mut guard = link.writer.lock().await;
            if let Some(wr) = guard.as_mut() {
                let mut torn = link.state.torn_guard();
                if wire::write(wr, &Control::Landed { upto }).await.is_ok() {
                    torn.disarm();
                }
            }
        });
    }

    /// Hands a job to the worker thread.
    fn submit(&self, job: Job) {
        // Once the worker is gone the send fails and the job is dropped, which releases its holds
        // (only the reader submits chunks to report, and it stops the worker last).
        let tx = lock(&self.jobs).clone();
        if let Some(tx) = tx {
            let _ = tx.send(job);
        }
    }

    /// Waits for a batch's device work (the worker thread), polling so that the link closing aborts
    /// its communicator (the work then runs out) and a failed communicator closes the link; gives up
    /// [`DRAIN`] after the link closed. Returns the pull's sums.
    fn wait_for(&self, pull: &PullEvent, device: &DeviceKv, closed_at: &mut Option<Instant>) -> std::result::Result<Vec<u64>, String> {
        self.wait_until(|| pull.done().map_err(|e| e.to_string()), closed_at)?;
        pull.wait(device).map_err(|e| e.to_string())
    }

    /// Waits until `done` says the device work ran, as [`NcclLink::wait_for`] waits for a pull.
    fn wait_until(&self, mut done: impl FnMut() -> std::result::Result<bool, String>, closed_at: &mut Option<Instant>) -> std::result::Result<(), String> {
        let since = Instant::now();
        let mut polls = 0u32;
        loop {
            if done()? {
                return Ok(());
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) {
                if let GpuState::Ready(gpu) = &*self.gpu.borrow()
                    && let Err(e) = gpu.issued()
                {
                    self.state.fail(format!("NCCL failed: {e}"));
                }
                if self.closing.now() {
                    match closed_at {
                        None => {
                            *closed_at = Some(Instant::now());
                            self.retire_gpu();
                        }
                        Some(t) if t.elapsed() > DRAIN => {
                            return Err(format!("the link closed and its device work did not finish within {DRAIN:?}"));
                        }
                        Some(_) => {}
                    }
                }
            }
            // Spin (yielding) through the first millisecond — a batch takes tens to hundreds of
            // microseconds, and a sleep costs ~60 us of timer slack — then back off.
            if since.elapsed() < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                ffi::backoff(since);
            }
        }
    }

    /// Waits until the NCCL operation just enqueued was issued (the first ones may wait for NCCL to
    /// connect the pair), or the link closes.
    async fn until_issued(&self, gpu: &LinkGpu) -> std::result::Result<(), String> {
        let since = Instant::now();
        loop {
            if gpu.issued()? {
                return Ok(());
            }
            if self.closing.now() {
                return Err("link closed".into());
            }
            if since.elapsed() < Duration::from_micros(200) {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// Messages (sender side), in order: those without payload as they are, runs of those with
    /// one as batches (as many as a staging buffer and [`wire::MAX_BATCH`] allow).
    async fn send_messages(&self, messages: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else {
            return Err(self.link_err("link closed"));
        };
        super::kv_trace!("nccl send of {} messages: link locked", messages.len());
        let capacity = self.transport.upgrade().map_or(0, |t| t.staging_bytes as u64);
        let mut group: Vec<(Vec<u8>, Payload)> = Vec::new();
        let mut bytes = 0u64;
        // Messages without payload go out in one write with the next batch's announcement (a
        // transfer's `Start` with its first chunks: one socket write, tens of microseconds, fewer
        // before the receiver can post its receives) — alone first if that batch would wait
        // (see `flush_ahead`) — or at the end.
        let mut ahead: Vec<u8> = Vec::new();
        // Payloads already sent ahead (`Link::write_ahead`): announced in batches cut as the
        // receiver posted their runs (see `ahead_rounds`), so each batch's verification can start
        // once its round landed.
        let mut written: Vec<(Vec<u8>, Payload)> = Vec::new();
        let mut written_seen = 0usize;
        let lanes = match &*self.gpu.borrow() {
            GpuState::Ready(gpu) => gpu.lane_count().max(1),
            _ => 1,
        };
        for (header, payload) in messages {
            if payload.dest().is_some_and(|d| d.written.is_some()) {
                if !group.is_empty() {
                    self.send_group_after(wr, &mut ahead, std::mem::take(&mut group)).await?;
                    bytes = 0;
                }
                written.push((header, payload));
                written_seen += 1;
                if ahead_round_ends(written_seen, lanes) || written.len() == wire::MAX_BATCH {
                    self.send_written(wr, &mut ahead, std::mem::take(&mut written)).await?;
                }
                continue;
            }
            if !written.is_empty() {
                self.send_written(wr, &mut ahead, std::mem::take(&mut written)).await?;
            }
            let full = !group.is_empty() && (payload.is_empty() || bytes + payload.len() > capacity || group.len() == wire::MAX_BATCH);
            if full {
                self.send_group_after(wr, &mut ahead, std::mem::take(&mut group)).await?;
                bytes = 0;
            }
            if payload.is_empty() {
                ahead.extend_from_slice(&Control::Msg { payload_len: 0, header }.encode());
            } else {
                bytes += payload.len();
                group.push((header, payload));
            }
        }
        if !written.is_empty() {
            self.send_written(wr, &mut ahead, written).await?;
        }
        if !group.is_empty() {
            self.send_group_after(wr, &mut ahead, group).await?;
        }
        self.flush_ahead(wr, &mut ahead).await
    }

    /// Announces payloads already sent ahead (each names its run by ticket, [`Moved::Ahead`]) and
    /// holds them until those sends ran; `ahead` (encoded messages) goes first in the same write.
    async fn send_written(&self, wr: &mut OwnedWriteHalf, ahead: &mut Vec<u8>, group: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        let Some(t) = self.transport.upgrade() else { return Err(Error::Shutdown) };
        let GpuState::Ready(gpu) = self.gpu.borrow().clone() else {
            return Err(self.link_err("payloads sent ahead without a communicator"));
        };
        let corrupt = t.pick_corrupt(group.len()).map(|i| i as u32);
        let mut items = Vec::with_capacity(group.len());
        let mut tickets = Vec::with_capacity(group.len());
        let mut payloads = Vec::with_capacity(group.len());
        for (header, payload) in group {
            let Some(ticket) = payload.dest().and_then(|d| d.written) else {
                return Err(Error::Invalid("a payload not sent ahead among those sent ahead".into()));
            };
            items.push((payload.len(), header));
            tickets.push(ticket);
            payloads.push(payload);
        }
        let n = items.len();
        Self::announce(wr, ahead, &Control::Batch { items, moved: Moved::Ahead { tickets, corrupt } })
            .await
            .map_err(|e| self.link_err(e.to_string()))?;
        // Recorded behind every send enqueued so far, those of these payloads' runs among them.
        let done = gpu.net_event().ok();
        self.submit(Job::Sent { done, _hold: payloads, gpu });
        super::kv_trace!("nccl batch of {n} sent ahead announced");
        Ok(())
    }

    /// Writes `ahead` (encoded messages) now, if any: before anything that may wait (the
    /// communicator still being made, no free pull slot), so a transfer's `Start` reaches the
    /// receiver without waiting for its first batch (a receiver that times out or gives up on it
    /// meanwhile must know the sender to tell it).
    async fn flush_ahead(&self, wr: &mut OwnedWriteHalf, ahead: &mut Vec<u8>) -> Result<()> {
        if ahead.is_empty() {
            return Ok(());
        }
        let mut torn = self.state.torn_guard();
        wr.write_all(&std::mem::take(ahead)).await.map_err(|e| self.link_err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// [`NcclLink::send_group`], with `ahead` (encoded messages) written before the batch's
    /// announcement — or alone, should the batch fail before it is announced.
    async fn send_group_after(&self, wr: &mut OwnedWriteHalf, ahead: &mut Vec<u8>, group: Vec<(Vec<u8>, Payload)>) -> Result<()> {
        let sent = self.send_group(wr, ahead, group).await;
        if sent.is_err() {
            let _ = self.flush_ahead(wr, ahead).await;
        }
        sent
    }

    /// Writes `ahead` and then the announcement `msg` in one write; `ahead` is left empty.
    async fn announce(wr: &mut OwnedWriteHalf, ahead: &mut Vec<u8>, msg: &Control) -> std::io::Result<()> {
        let mut out = std::mem::take(ahead);
        out.extend_from_slice(&msg.encode());
        wr.write_all(&out).await
    }

    /// One batch of messages with payloads: enqueues the gather and the send behind it, announces
    /// the batch, and hands the payloads to the worker thread, which drops them once gathered.
    async fn send_group(&self, wr: &mut OwnedWriteHalf, ahead: &mut Vec<u8>, group: Vec<(Vec<u8>, Payload)>) -> Result<()> {
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
        if !matches!(*self.gpu.borrow(), GpuState::Ready(_)) {
            self.flush_ahead(wr, ahead).await?;
        }
        let gpu = self.ready_gpu().await.map_err(|e| self.link_err(e))?;
        super::kv_trace!("nccl batch of {} payloads: communicator ready", payloads.len());
        if let Some(plan) = t.direct_plan(&payloads) {
            return self.send_direct(wr, ahead, &t, gpu, items, payloads, plan).await;
        }
        if t.slots.available_permits() == 0 {
            self.flush_ahead(wr, ahead).await?;
        }
        let (slot, permit) = t.slot(&self.closing).await.map_err(|e| self.link_err(e))?;
        // From the announcement to the send's enqueue the pair's NCCL operations are out of step:
        // abandoning the batch in between (deadline, failure) closes the link.
        let mut torn = self.state.torn_guard();
        let k = gpu.next_buffer();
        let gathered = t.locate(&payloads).and_then(|(chunks, corrupt)| t.enqueue_move(&gpu, k, slot, &chunks, true, corrupt));
        let staged = gathered.as_ref().map(|_| ()).map_err(|e| e.clone());
        self.submit(Job::Gathered { pull: gathered.ok(), slot, _permit: permit, _hold: payloads, _gpu: Arc::clone(&gpu) });
        // The batch is announced before its send is enqueued (the receiver posts its receive
        // meanwhile), and the send goes whatever the gather did (the receiver posts a receive for
        // every batch).
        let moved = match &staged {
            Ok(()) => Moved::Staged,
            Err(reason) => Moved::StageFailed(reason.clone()),
        };
        Self::announce(wr, ahead, &Control::Batch { items, moved })
            .await
            .map_err(|e| self.link_err(e.to_string()))?;
        gpu.enqueue_p2p(Dir::Send, k, bytes as usize).map_err(|e| self.link_err(format!("sending chunks through NCCL: {e}")))?;
        super::kv_trace!("nccl batch ({bytes} bytes) announced and enqueued");
        self.until_issued(&gpu).await.map_err(|e| self.link_err(format!("sending chunks through NCCL: {e}")))?;
        gpu.record_net(k).map_err(|e| self.link_err(e))?;
        torn.disarm();
        staged.map_err(|e| Error::Device(format!("staging chunks for NCCL: {e}")))
    }
}

impl NcclLink {
    /// A direct batch (`plan`: [`NcclTransport::direct_plan`]): one send per payload, straight
    /// from the pool where its blocks are one run, else from staging after a gather of those
    /// payloads alone; announced as [`Moved::Direct`]; the worker thread drops the payloads once
    /// the sends ran.
    #[allow(clippy::too_many_arguments)]
    async fn send_direct(
        &self,
        wr: &mut OwnedWriteHalf,
        ahead: &mut Vec<u8>,
        t: &NcclTransport,
        gpu: Arc<LinkGpu>,
        items: Vec<(u64, Vec<u8>)>,
        payloads: Vec<Payload>,
        plan: Vec<DirectPayload>,
    ) -> Result<()> {
        let bb = t.memory.geometry().block_bytes();
        let scattered = plan.iter().any(|(_, _, at)| at.is_none());
        if scattered && t.slots.available_permits() == 0 {
            self.flush_ahead(wr, ahead).await?;
        }
        let slot = if scattered { Some(t.slot(&self.closing).await.map_err(|e| self.link_err(e))?) } else { None };
        let corrupt = t.pick_corrupt(payloads.len()).map(|i| i as u32);
        // (Each side uses its staging buffers in turn, batch by batch.)
        let k = gpu.next_buffer();
        let staging = gpu.staging[k].ptr();
        // Payloads whose blocks are not one run: back to back in staging buffer `k` (the batch fits
        // one: `send_messages` groups by its size).
        let mut gather: Vec<StagedChunk> = Vec::new();
        let mut at = 0u32;
        let runs: Vec<(u64, usize)> = plan
            .into_iter()
            .map(|(layer, ids, run)| {
                let bytes = ids.len() * bb;
                match run {
                    Some(addr) => (addr, bytes),
                    None => {
                        let first = at;
                        at += ids.len() as u32;
                        gather.push((layer, ids, first));
                        (staging + u64::from(first) * bb as u64, bytes)
                    }
                }
            })
            .collect();
        if let Some((slot, permit)) = slot {
            // Nothing of this batch is enqueued or announced yet: a gather that fails to start
            // fails the batch alone, the pair's NCCL operations still in step.
            let gathered = t.enqueue_move(&gpu, k, slot, &gather, true, None);
            let failed = gathered.as_ref().err().cloned();
            self.submit(Job::Gathered { pull: gathered.ok(), slot, _permit: permit, _hold: Vec::new(), _gpu: Arc::clone(&gpu) });
            if let Some(e) = failed {
                return Err(Error::Device(format!("staging chunks for NCCL: {e}")));
            }
        }
        // From the announcement to the sends' enqueue the pair's NCCL operations are out of step:
        // abandoning the batch in between (deadline, failure) closes the link. Announced first:
        // the receiver posts its receives while the sends are enqueued here.
        let mut torn = self.state.torn_guard();
        super::kv_trace!("nccl direct batch of {} planned", items.len());
        Self::announce(wr, ahead, &Control::Batch { items, moved: Moved::Direct { corrupt } })
            .await
            .map_err(|e| self.link_err(e.to_string()))?;
        super::kv_trace!("nccl direct batch announced");
        // SAFETY: each run is whole blocks of one layer of this connector's pool (`direct_plan`
        // located them), or the part of staging buffer `k` the gather above fills (the sends wait
        // for it: `enqueue_p2p_all` orders them behind the buffer's last gather); the payloads are
        // held until the worker saw the sends' event complete, or until the communicator was
        // aborted and the link's work drained.
        let sent = unsafe { gpu.enqueue_p2p_all(Dir::Send, k, &runs) };
        let done = sent.as_ref().ok().and_then(|()| gpu.net_event().ok());
        self.submit(Job::Sent { done, _hold: payloads, gpu: Arc::clone(&gpu) });
        sent.map_err(|e| self.link_err(format!("sending chunks through NCCL: {e}")))?;
        super::kv_trace!("nccl direct batch enqueued");
        self.until_issued(&gpu).await.map_err(|e| self.link_err(format!("sending chunks through NCCL: {e}")))?;
        // (A later gather into buffer `k` waits for these sends.)
        gpu.record_net(k).map_err(|e| self.link_err(e))?;
        torn.disarm();
        Ok(())
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

    fn writes_directly(&self) -> bool {
        self.ahead
    }

    fn write_ahead(&self, plan: super::WritePlan<'_>) -> Result<Option<Vec<u64>>> {
        if !self.ahead || !self.sender_side {
            return Ok(None);
        }
        if plan.layers.is_empty() || plan.chunks.is_empty() {
            return Ok(Some(Vec::new()));
        }
        // A link whose communicator is still being made sends its first transfer in batches.
        let GpuState::Ready(gpu) = self.gpu.borrow().clone() else { return Ok(None) };
        let Some(t) = self.transport.upgrade() else { return Err(Error::Shutdown) };
        // The writer lock, as `send_messages` holds it across a batch's announcement and sends:
        // the runs' operations then come in the same order on both ends.
        let Ok(guard) = self.writer.try_lock() else { return Ok(None) };
        let Some(wr) = guard.as_ref() else { return Err(self.link_err("link closed")) };
        let memory = &t.memory;
        let bad = |why: String| Error::Invalid(format!("nccl write ahead: {why}"));
        if plan.layers.end > memory.geometry().num_layers() {
            return Err(bad("a layer outside this pool".into()));
        }
        let Some(chunks) = ahead_chunks(&plan).map_err(bad)? else { return Ok(None) };
        if chunks.iter().any(|&(s, _, c)| u64::from(s) + u64::from(c) > u64::from(memory.num_blocks())) {
            return Err(bad("a source block outside this pool".into()));
        }
        let n = plan.layers.len() * chunks.len();
        if n > wire::MAX_AHEAD {
            return Ok(None);
        }
        let bb = memory.geometry().block_bytes() as u64;
        let mut runs = Vec::with_capacity(n);
        let mut ops = Vec::with_capacity(n);
        for l in plan.layers.clone() {
            let base = memory.layer_base(l) as u64;
            for &(src, dst, count) in &chunks {
                runs.push((l, dst, count));
                ops.push((base + u64::from(src) * bb, count as usize * bb as usize));
            }
        }
        // (Changed only under the writer lock.)
        let first = self.ahead_next.load(Ordering::Acquire);
        let msg = Control::Ahead { id: plan.id, first, runs }.encode();
        super::kv_trace!("nccl ahead of {n} runs: planned");
        match write_now(wr, &msg) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => {
                self.state.fail(format!("writing runs announced ahead: {e}"));
                return Err(self.link_err(e.to_string()));
            }
        }
        self.ahead_next.store(first + n as u64, Ordering::Release);
        super::kv_trace!("nccl ahead of {n} runs: announced");
        // The receiver posts these runs' receives now: the sends must follow, or the link closes.
        let head = n.min(ahead_round_len(0, gpu.lane_count()));
        // The receiver's first round (a run per lane) goes alone (its bytes move after one NCCL
        // call per side), then the rest.
        let (lead, rest) = ops.split_at(head);
        // SAFETY: each range is whole blocks of one layer of this connector's pool (checked above),
        // which the caller holds claimed for the transfer (`Link::write_ahead`) until the messages
        // it builds next hold them, until the sends ran (`send_written`); the operations are
        // matched one for one by the receives the receiver posts on reading the runs.
        let sent = unsafe { [lead, rest].into_iter().filter(|o| !o.is_empty()).try_for_each(|o| gpu.enqueue_p2p_all(Dir::Send, 0, o)) }
            .and_then(|()| gpu.issued().and_then(|ok| if ok { Ok(()) } else { Err("the communicator is not ready".into()) }));
        if let Err(e) = sent {
            self.state.fail(format!("sending runs ahead through NCCL: {e}"));
            return Err(self.link_err(e));
        }
        super::kv_trace!("nccl ahead of {n} runs: enqueued");
        Ok(Some((first..first + n as u64).collect()))
    }

    fn drain(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            // Every run sent ahead so far landed at the receiver (then nothing of ours writes its
            // blocks any more); without the link, its communicator is aborted.
            let want = self.ahead_next.load(Ordering::Acquire);
            let mut landed = self.ahead_landed.subscribe();
            let mut closed = self.closing.0.clone();
            tokio::select! {
                r = landed.wait_for(|&l| l >= want) => r.map(|_| ()).map_err(|_| self.link_err("link closed")),
                _ = closed.wait_for(|c| *c != Closed::Open) => Err(self.link_err("link closed")),
            }
        })
    }

    fn quiesce(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // The reader ends after aborting the communicator and waiting for the link's jobs.
            let mut done = self.reader_done.subscribe();
            let _ = done.wait_for(|d| *d).await;
        })
    }
}

/// The reading half of one link, run as a task.
struct Reader {
    inbox: Arc<dyn Inbox>,
    link: Arc<NcclLink>,
    transport: Weak<NcclTransport>,
}

impl Reader {
    async fn run(self, rd: OwnedReadHalf, mut closed: watch::Receiver<Closed>, spin: Duration) {
        let dyn_link: Arc<dyn Link> = Arc::clone(&self.link) as Arc<dyn Link>;
        // The receiving side polls its socket while the link is busy (see `SpinRead`): a batch's
        // announcement is what its receive waits for.
        let idle = (!self.link.sender_side).then_some(IDLE);
        let mut rd = SpinRead::new(rd, spin).idle_after(idle);
        if let Some(t) = self.transport.upgrade() {
            rd = rd.alerted_by(&t.alert);
        }
        // (A reader on a thread of its own times itself out: the runtime's timers fail there once
        // the runtime shuts down.)
        let idle = idle.filter(|_| !rd.on_own_thread());
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
            if let Err(reason) = self.one(msg, &dyn_link, &mut closed).await {
                break reason;
            }
        };
        tracing::debug!(peer = %self.link.state.peer(), reason = %natural, "nccl link reader ending");
        self.link.state.fail(natural);
        let how = closed.borrow().clone();
        // Abort the communicator (the link's device work runs out), then let the worker report
        // every job still queued before the link is reported closed.
        self.link.retire_gpu();
        lock(&self.link.jobs).take();
        let worker = lock(&self.link.worker).take();
        if let Some(worker) = worker {
            let _ = tokio::task::spawn_blocking(move || worker.join()).await;
        }
        self.link.reader_done.send_replace(true);
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

    async fn one(&self, msg: Control, link: &Arc<dyn Link>, closed: &mut watch::Receiver<Closed>) -> std::result::Result<(), String> {
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
            Control::Batch { .. } if sender_side => Err("payload from the accepting side".into()),
            Control::Batch { items, moved } => {
                super::kv_trace!("nccl batch of {} read", items.len());
                // A batch waits for the communicator before the inbox hears of it: the connector
                // then counts only the bytes' movement as the chunks', not the communicator's
                // creation (a transfer's deadline never closes the link over it).
                let gpu = tokio::select! {
                    g = self.link.ready_gpu() => g?,
                    _ = closed.wait_for(|c| *c != Closed::Open) => return Err("link closed".into()),
                };
                let mut wanted: Vec<(usize, u64, Vec<Iov>)> = Vec::new();
                let mut refused = None;
                for (i, (len, header)) in items.iter().enumerate() {
                    match self.inbox.on_message(link, header, *len) {
                        Delivery::CloseLink(reason) => {
                            refused = Some(reason);
                            break;
                        }
                        Delivery::Discard => {}
                        Delivery::Into { iovs, token } => wanted.push((i, token, iovs)),
                    }
                }
                let tokens: Vec<u64> = wanted.iter().map(|(_, token, _)| *token).collect();
                if let Some(reason) = refused {
                    self.link.submit(Job::Failed { tokens, reason: format!("the payload was not written: {reason}"), after: Some(Arc::clone(&gpu)) });
                    return Err(reason);
                }
                let lens: Vec<u64> = items.iter().map(|(len, _)| *len).collect();
                self.receive(&gpu, &lens, wanted, moved).await.inspect_err(|reason| {
                    self.link.submit(Job::Failed { tokens, reason: format!("the payload was not written: {reason}"), after: Some(Arc::clone(&gpu)) });
                })
            }
            Control::Landed { upto } if sender_side => {
                self.link.ahead_landed.send_if_modified(|l| {
                    let more = upto > *l;
                    *l = (*l).max(upto);
                    more
                });
                Ok(())
            }
            Control::Ahead { .. } if sender_side => Err("runs sent ahead from the accepting side".into()),
            Control::Ahead { id, first, runs } => {
                // Only into blocks this end granted that transfer to this link and still holds for
                // it: a sender that names others closes the link before anything lands.
                let t = self.transport.upgrade().ok_or("the transport is gone")?;
                let granted = t.inbox.granted_blocks(link, id).ok_or_else(|| format!("runs sent ahead for transfer {id:x}, which this end did not grant to the link"))?;
                runs_granted(&runs, &granted).map_err(|e| format!("runs sent ahead for transfer {id:x}: {e}"))?;
                let gpu = tokio::select! {
                    g = self.link.ready_gpu() => g?,
                    _ = closed.wait_for(|c| *c != Closed::Open) => return Err("link closed".into()),
                };
                self.receive_runs(&t, &gpu, first, runs).await
            }
            other => Err(format!("unexpected nccl control message {other:?}")),
        }
    }

    /// Posts the receives of a batch of payloads of `lens` bytes and, for those `wanted` —
    /// `(index in the batch, token, destination iovecs)` —, the device work that lands and verifies
    /// them behind; the worker thread reports them. Staged batches come as one receive into a
    /// staging buffer (back to back), scattered into their blocks. Direct ones come as one receive
    /// per payload: straight into its blocks when every wanted payload's blocks are contiguous
    /// (then verified where they landed; unwanted ones land in staging), else each at its place in
    /// staging and scattered as a staged batch.
    /// `Err`: the link must close (the wanted chunks are not reported yet).
    async fn receive(
        &self,
        gpu: &Arc<LinkGpu>,
        lens: &[u64],
        wanted: Vec<(usize, u64, Vec<Iov>)>,
        moved: Moved,
    ) -> std::result::Result<(), String> {
        if let Moved::Ahead { tickets, corrupt } = &moved {
            return self.receive_ahead(gpu, lens, wanted, tickets, *corrupt).await;
        }
        let link = &self.link;
        let t = self.transport.upgrade().ok_or("the transport is gone")?;
        let bb = t.memory.geometry().block_bytes() as u64;
        let total = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l)).unwrap_or(u64::MAX);
        if total > gpu.staging[0].bytes() as u64 {
            return Err(format!("a {total}-byte batch exceeds a staging buffer"));
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
                return Err("the destination is not whole blocks of one layer".into());
            };
            chunks.push((layer, ids, (starts[*i] / bb) as u32));
        }
        let tokens: Vec<u64> = wanted.iter().map(|(_, token, _)| *token).collect();
        let k = gpu.next_buffer();
        let into: Vec<(usize, u64, &[u32])> =
            wanted.iter().zip(&chunks).map(|((i, _, _), (layer, ids, _))| (*i, t.memory.layer_base(*layer) as u64, ids.as_slice())).collect();
        let (ops, straight) = receive_plan(lens, &moved, gpu.staging[k].ptr(), &into, bb);
        super::kv_trace!("nccl batch of {} planned", lens.len());
        // SAFETY: staging ranges lie inside buffer `k` (the batch fits it, checked above); pool
        // ranges are whole blocks of one layer of this connector's pool that the inbox gave this
        // transfer's chunks (claimed until they are reported); nothing else writes either until
        // the worker reported the batch.
        unsafe { gpu.enqueue_p2p_all(Dir::Recv, k, &ops) }.map_err(|e| format!("receiving chunks through NCCL: {e}"))?;
        link.until_issued(gpu).await.map_err(|e| format!("receiving chunks through NCCL: {e}"))?;
        gpu.record_net(k)?;
        super::kv_trace!("nccl batch of {} receive posted ({} operations)", lens.len(), ops.len());
        let corrupt = match &moved {
            Moved::StageFailed(reason) => {
                if !tokens.is_empty() {
                    link.submit(Job::Failed { tokens, reason: format!("the sender could not stage the payload: {reason}"), after: None });
                }
                return Ok(());
            }
            Moved::Staged => None,
            // (The test hook: flip a byte of that payload once landed, if it is wanted.)
            Moved::Direct { corrupt } | Moved::Ahead { corrupt, .. } => corrupt.and_then(|c| wanted.iter().position(|(i, _, _)| *i == c as usize)),
        };
        if chunks.is_empty() {
            return Ok(()); // nothing wanted: the bytes land in staging and stay there
        }
        let (slot, permit) = t.slot(&link.closing).await?;
        let landed = if straight {
            let dsts: Vec<Blocks<'_>> = chunks
                .iter()
                .map(|(layer, ids, _)| Blocks { base: t.memory.layer_base(*layer) as u64, num_blocks: t.memory.num_blocks(), ids })
                .collect();
            gpu.moved(k, t.device.verify_on(&gpu.copy, &gpu.net_done[k], slot, &dsts, bb as usize, corrupt).map_err(|e| e.to_string()))
        } else {
            t.enqueue_move(gpu, k, slot, &chunks, false, corrupt)
        };
        match landed {
            Ok(pull) => link.submit(Job::Scattered { pull, slot, _permit: permit, tokens, _gpu: Arc::clone(gpu) }),
            Err(e) => {
                // (A pull that failed to start has run out: its slot is free again.)
                lock(&t.free_slots).push(slot);
                link.submit(Job::Failed { tokens, reason: format!("landing chunks: {e}"), after: Some(Arc::clone(gpu)) });
            }
        }
        Ok(())
    }
}

impl Reader {
    /// Posts a receive straight into each run announced ahead (tickets `first`, ...), round by
    /// round with an event behind each, and keeps the runs for the batches that name them.
    /// The runs are blocks of a transfer this end granted the sender (the sender writes only
    /// those, as a cuda-ipc sender writes granted blocks itself); each is checked to lie in this
    /// pool, and what lands is verified against the sender's checksums once a batch names it.
    /// `Err`: the link must close.
    async fn receive_runs(&self, t: &NcclTransport, gpu: &Arc<LinkGpu>, first: u64, runs: Vec<(u32, u32, u32)>) -> std::result::Result<(), String> {
        let memory = &t.memory;
        let bb = memory.geometry().block_bytes() as u64;
        let (layers, blocks) = (memory.geometry().num_layers(), memory.num_blocks());
        let mut ops = Vec::with_capacity(runs.len());
        for &(layer, block, count) in &runs {
            if layer >= layers || u64::from(block) + u64::from(count) > u64::from(blocks) {
                return Err(format!("a run sent ahead outside this pool: layer {layer}, blocks {block}+{count}"));
            }
            ops.push((memory.layer_base(layer) as u64 + u64::from(block) * bb, count as usize * bb as usize));
        }
        super::kv_trace!("nccl ahead of {} runs read", runs.len());
        let mut events = Vec::new();
        for round in ahead_rounds(ops.len(), gpu.lane_count()) {
            // SAFETY: each range is whole blocks of one layer of this pool (checked above), of a
            // transfer granted to this link's sender, whose blocks stay claimed until their batch
            // is reported or, for a transfer that failed, until the sender confirmed its fence
            // (after these receives landed: `Control::Landed`) or the link's quiesce.
            unsafe { gpu.enqueue_p2p_all(Dir::Recv, 0, &ops[round.clone()]) }.map_err(|e| format!("receiving runs sent ahead: {e}"))?;
            self.link.until_issued(gpu).await.map_err(|e| format!("receiving runs sent ahead: {e}"))?;
            let done = Arc::new(gpu.net_event()?);
            events.push((round, done));
        }
        super::kv_trace!("nccl ahead of {} runs: receives posted", runs.len());
        let last = events.last().map(|(_, e)| Arc::clone(e));
        {
            let mut kept = lock(&self.link.ahead_runs);
            for (round, done) in &events {
                for i in round.clone() {
                    let (layer, first_block, count) = runs[i];
                    kept.insert(first + i as u64, AheadRun { layer, first: first_block, count, done: Arc::clone(done) });
                }
            }
            while kept.len() > AHEAD_KEPT {
                kept.pop_first();
            }
        }
        if let Some(done) = last {
            self.link.submit(Job::AheadLanded { done, upto: first + runs.len() as u64 });
        }
        Ok(())
    }

    /// A batch of payloads sent ahead: takes each one's run (wanted or not), checks that each
    /// wanted payload's destination is its run's blocks, and verifies them behind the rounds' events.
    async fn receive_ahead(
        &self,
        gpu: &Arc<LinkGpu>,
        lens: &[u64],
        wanted: Vec<(usize, u64, Vec<Iov>)>,
        tickets: &[u64],
        corrupt: Option<u32>,
    ) -> std::result::Result<(), String> {
        let link = &self.link;
        let t = self.transport.upgrade().ok_or("the transport is gone")?;
        let bb = t.memory.geometry().block_bytes() as u64;
        let runs: Vec<AheadRun> = {
            let mut kept = lock(&link.ahead_runs);
            tickets.iter().map(|k| kept.remove(k).ok_or_else(|| format!("no run was received ahead for ticket {k}"))).collect::<std::result::Result<_, _>>()?
        };
        if runs.iter().zip(lens).any(|(r, &len)| u64::from(r.count) * bb != len) {
            return Err("a payload sent ahead is not as long as its run".into());
        }
        let mut chunks: Vec<(u32, Vec<u32>)> = Vec::with_capacity(wanted.len());
        // The rounds' events are in stream order: the latest wanted run's covers the others'.
        let mut after: Option<(u64, &AheadRun)> = None;
        for (i, _, iovs) in &wanted {
            let r = &runs[*i];
            let located = t.memory.blocks_of(iovs);
            let Some((layer, ids)) = located.filter(|(layer, ids)| {
                *layer == r.layer && ids.len() == r.count as usize && ids.iter().enumerate().all(|(k, &id)| u64::from(id) == u64::from(r.first) + k as u64)
            }) else {
                return Err("a payload sent ahead landed in other blocks than the receiver gives it".into());
            };
            chunks.push((layer, ids));
            if after.is_none_or(|(k, _)| tickets[*i] > k) {
                after = Some((tickets[*i], r));
            }
        }
        let tokens: Vec<u64> = wanted.iter().map(|(_, token, _)| *token).collect();
        let Some((_, after)) = after else { return Ok(()) };
        let corrupt = corrupt.and_then(|c| wanted.iter().position(|(i, _, _)| *i == c as usize));
        let (slot, permit) = t.slot(&link.closing).await?;
        let dsts: Vec<Blocks<'_>> = chunks
            .iter()
            .map(|(layer, ids)| Blocks { base: t.memory.layer_base(*layer) as u64, num_blocks: t.memory.num_blocks(), ids })
            .collect();
        match t.device.verify_on(&gpu.copy, &after.done, slot, &dsts, bb as usize, corrupt) {
            Ok(pull) => link.submit(Job::Scattered { pull, slot, _permit: permit, tokens, _gpu: Arc::clone(gpu) }),
            Err(e) => {
                lock(&t.free_slots).push(slot);
                link.submit(Job::Failed { tokens, reason: format!("landing chunks: {e}"), after: Some(Arc::clone(gpu)) });
            }
        }
        super::kv_trace!("nccl batch of {} sent ahead: verification enqueued", lens.len());
        Ok(())
    }
}

/// [`NcclTransport::direct_plan`] over `memory`.
fn direct_plan(memory: &KvMemory, payloads: &[Payload]) -> Option<Vec<DirectPayload>> {
    let bb = memory.geometry().block_bytes() as u64;
    payloads
        .iter()
        .map(|p| {
            let (layer, ids) = memory.blocks_of(p.iovs())?;
            let first = *ids.first()?;
            let run = ids.windows(2).all(|w| w[1] == w[0].wrapping_add(1));
            let at = run.then(|| memory.layer_base(layer) as u64 + u64::from(first) * bb);
            Some((layer, ids, at))
        })
        .collect()
}

/// The receives of a batch of payloads of `lens` bytes that arrives as `moved` says, as
/// `(device address, bytes)` in posting order — one per send the sender enqueued, of its length —
/// and whether the wanted payloads land straight in their blocks. `staging`: the staging buffer the
/// batch may use (it fits); `into`: each wanted payload's `(index in the batch, its layer's base,
/// destination block ids)`.
fn receive_plan(lens: &[u64], moved: &Moved, staging: u64, into: &[(usize, u64, &[u32])], block_bytes: u64) -> (Vec<(u64, usize)>, bool) {
    match moved {
        // (No operation: the payloads came through runs sent ahead; `receive` never plans these.)
        Moved::Ahead { .. } => (Vec::new(), false),
        Moved::Staged | Moved::StageFailed(_) => (vec![(staging, lens.iter().sum::<u64>() as usize)], false),
        Moved::Direct { .. } => {
            // Each payload at its place in staging (back to back), unless every wanted payload's
            // blocks are one run: then those straight into their blocks.
            let mut at = 0u64;
            let mut ops: Vec<(u64, usize)> = lens
                .iter()
                .map(|&len| {
                    let op = (staging + at, len as usize);
                    at += len;
                    op
                })
                .collect();
            let straight = into.iter().all(|(_, _, ids)| ids.windows(2).all(|w| w[1] == w[0].wrapping_add(1)));
            if straight {
                for &(i, base, ids) in into {
                    if let (Some(op), Some(&first)) = (ops.get_mut(i), ids.first()) {
                        op.0 = base + u64::from(first) * block_bytes;
                    }
                }
            }
            (ops, straight)
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BB: u64 = 4096;
    const STAGING: u64 = 1 << 40;

    /// A payload: its block count, and if the receiver wants it, its layer base and destination ids.
    type Planned = (u32, Option<(u64, Vec<u32>)>);

    /// A batch of payloads, destinations contiguous or scattered.
    fn batch() -> impl Strategy<Value = Vec<Planned>> {
        prop::collection::vec(
            (1u32..6).prop_flat_map(|n| {
                let dst = (0u64..4, prop::bool::ANY, 0u32..1000).prop_map(move |(layer, scattered, first)| {
                    let ids: Vec<u32> = (0..n).map(|j| first + if scattered { 2 * j } else { j }).collect();
                    ((layer + 1) << 32, ids)
                });
                (Just(n), prop::option::of(dst))
            }),
            1..8,
        )
    }

    #[test]
    fn a_plan_goes_ahead_only_as_runs_at_both_ends() {
        let plan = |src: &'static [u32], dst: &'static [u32], chunks: &'static [(usize, usize)]| super::super::WritePlan { id: 1, layers: 0..2, chunks, src, dst };
        // Two chunks of contiguous blocks at both ends: their first blocks and lengths.
        assert_eq!(ahead_chunks(&plan(&[4, 5, 6, 9], &[20, 21, 22, 30], &[(0, 3), (3, 1)])).unwrap(), Some(vec![(4, 20, 3), (9, 30, 1)]));
        // A gap at either end: not ahead (announced batches take it).
        assert_eq!(ahead_chunks(&plan(&[4, 6], &[20, 21], &[(0, 2)])).unwrap(), None);
        assert_eq!(ahead_chunks(&plan(&[4, 5], &[21, 20], &[(0, 2)])).unwrap(), None);
        // A chunk outside the lists, or empty, is the caller's error.
        assert!(ahead_chunks(&plan(&[4, 5], &[20, 21], &[(1, 2)])).is_err());
        assert!(ahead_chunks(&plan(&[4, 5], &[20, 21], &[(0, 0)])).is_err());
        assert!(ahead_chunks(&plan(&[4, 5], &[20, 21], &[(usize::MAX, 2)])).is_err());
    }

    #[test]
    fn runs_ahead_must_lie_in_the_granted_blocks() {
        let granted = [9, 3, 4, 5, 20, 21, 22, 23, 6];
        assert!(runs_granted(&[(0, 3, 4), (31, 20, 4), (5, 9, 1), (2, 5, 2)], &granted).is_ok());
        // One block past a run, one before, a gap inside, a block of no run at all.
        assert!(runs_granted(&[(0, 3, 5)], &granted).unwrap_err().contains("blocks 3+5"));
        assert!(runs_granted(&[(0, 19, 2)], &granted).is_err());
        assert!(runs_granted(&[(1, 6, 4)], &granted).is_err());
        assert!(runs_granted(&[(0, 3, 4), (0, 100, 1)], &granted).is_err());
        // Nothing granted, and runs at the end of the id space.
        assert!(runs_granted(&[(0, 0, 1)], &[]).is_err());
        assert!(runs_granted(&[(0, u32::MAX, 1)], &[u32::MAX]).is_ok());
        assert!(runs_granted(&[(0, u32::MAX, 2)], &[u32::MAX]).is_err());
        // Repeated ids in the grant do not stretch a run.
        assert!(runs_granted(&[(0, 3, 3)], &[3, 3, 3]).is_err());
    }

    #[test]
    fn runs_ahead_are_posted_one_per_lane_first_then_two_per_lane() {
        assert_eq!(ahead_rounds(32, 4), vec![0..4, 4..12, 12..20, 20..28, 28..32]);
        assert_eq!(ahead_rounds(3, 4), vec![0..3]);
        assert_eq!(ahead_rounds(0, 4), vec![]);
        assert_eq!(ahead_rounds(5, 1), vec![0..1, 1..3, 3..5]);
        // No lanes (an aborted link) counts as one.
        assert_eq!(ahead_rounds(2, 0), vec![0..1, 1..2]);
        // Every run in exactly one round, in order.
        for n in 0..70 {
            for lanes in 1..9 {
                let r = ahead_rounds(n, lanes);
                assert_eq!(r.iter().map(|x| x.len()).sum::<usize>(), n);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
                // The sender cuts its batches where the receiver's full rounds end.
                for k in 1..=n {
                    assert_eq!(ahead_round_ends(k, lanes), r.iter().any(|x| x.end == k && x.len() == ahead_round_len(x.start, lanes)), "{k} of {n}, {lanes} lanes");
                }
            }
        }
    }

    #[test]
    fn a_direct_batch_sends_runs_from_the_pool_and_gathers_the_rest() {
        use crate::geometry::{DType, Geometry, GeometrySpec, Layout};
        let g = Geometry::new(GeometrySpec {
            model_id: "direct".into(),
            dtype: DType::BF16,
            block_size: 4,
            num_layers: 3,
            num_kv_heads: 1,
            head_dim: 8,
            layout: Layout::KvHeadTokenDim,
        })
        .expect("geometry");
        let memory = KvMemory::host(g, 16).expect("pool");
        let bb = memory.geometry().block_bytes() as u64;
        let hold: Arc<dyn Send + Sync> = Arc::new(());
        let payload = |layer: u32, ids: &[u32]| Payload::new(memory.iovs(layer, ids), Arc::clone(&hold));
        let plan = direct_plan(&memory, &[payload(1, &[4, 5, 6]), payload(2, &[7, 3]), payload(0, &[9])]).expect("a plan");
        assert_eq!(plan[0], (1, vec![4, 5, 6], Some(memory.layer_base(1) as u64 + 4 * bb)));
        assert_eq!(plan[1], (2, vec![7, 3], None), "blocks that are not one run are gathered");
        assert_eq!(plan[2], (0, vec![9], Some(memory.layer_base(0) as u64 + 9 * bb)));
        // A payload that is not whole blocks of one layer: the batch is staged (which reports it).
        let base = memory.layer_base(0);
        let odd = Payload::new(vec![Iov { addr: base + 1, len: bb as usize, kind: MemoryKind::Host }], Arc::clone(&hold));
        assert!(direct_plan(&memory, &[payload(0, &[1]), odd]).is_none());
    }

    proptest! {
        #[test]
        fn every_receive_matches_one_send_of_its_length_in_order(payloads in batch(), direct in prop::bool::ANY) {
            let lens: Vec<u64> = payloads.iter().map(|(n, _)| u64::from(*n) * BB).collect();
            let into: Vec<(usize, u64, &[u32])> =
                payloads.iter().enumerate().filter_map(|(i, (_, d))| d.as_ref().map(|(base, ids)| (i, *base, ids.as_slice()))).collect();
            let moved = if direct { Moved::Direct { corrupt: None } } else { Moved::Staged };
            let (ops, straight) = receive_plan(&lens, &moved, STAGING, &into, BB);
            let total: u64 = lens.iter().sum();
            if !direct {
                // The sender's one send of the whole batch, into the start of staging.
                prop_assert_eq!(ops, vec![(STAGING, total as usize)]);
                prop_assert!(!straight);
                return Ok(());
            }
            // One receive per payload, of its length, in order: the sender's sends.
            prop_assert_eq!(ops.len(), lens.len());
            for (op, len) in ops.iter().zip(&lens) {
                prop_assert_eq!(op.1 as u64, *len);
            }
            let scattered = into.iter().any(|(_, _, ids)| ids.windows(2).any(|w| w[1] != w[0] + 1));
            prop_assert_eq!(straight, !scattered);
            let mut at = STAGING;
            for (i, op) in ops.iter().enumerate() {
                match into.iter().find(|(j, _, _)| *j == i) {
                    // Straight into exactly the payload's destination run.
                    Some(&(_, base, ids)) if straight => {
                        prop_assert_eq!(op.0, base + u64::from(ids[0]) * BB);
                        prop_assert_eq!(op.0 + op.1 as u64, base + (u64::from(*ids.last().unwrap()) + 1) * BB);
                    }
                    // Otherwise at its place in staging, back to back.
                    _ => prop_assert_eq!(op.0, at),
                }
                at += op.1 as u64;
            }
            prop_assert_eq!(at, STAGING + total);
        }
    }
}
