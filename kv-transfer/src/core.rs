//! The backend-independent heart of a connector: the receiver's per-transfer state machine (handshake,
//! start, chunk validation, checksum verification, completion), the sender's per-transfer task (link
//! reuse, layer-by-layer chunking, checksums, waiting for the receiver's verdict), timeouts and
//! cancellation. Every transport feeds the same [`Inbox`] implementation, so TCP, in-process and plugins
//! get identical integrity guarantees.
//!
//! Invariants:
//! - A layer is reported landed only after every chunk of it passed its length, order and checksum
//!   checks; a transfer is complete only after every layer did. Anything else fails the whole transfer.
//! - Block claims are released exactly once, and before the handle sees a terminal state. A claim is kept
//!   while a transport may still write (receiver: until `on_payload`) or read (sender: while a `Payload`
//!   lives) the blocks.
//! - Locks are never held across an `.await` or a transport call; replies are sent from spawned tasks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch};
use tokio::task::AbortHandle;

use crate::connector::{ConnectorConfig, Metrics, TransferDescriptor};
use crate::device::{Blocks, DeviceKv};
use crate::error::{Error, Result};
use crate::frame::{self, AbortCode, ChunkHeader, Frame, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use crate::handle::{Progress, RecvHandle, SendHandle, TransferState, TransferStats};
use crate::memory::{Claim, Iov, KvMemory, MemoryKind};
use crate::transport::{Delivery, Inbox, Landed, Link, Payload, Transport};

/// Most blocks one chunk covers (so a chunk never needs more than `TANDEM_KV_MAX_IOVS` iovecs).
pub const MAX_CHUNK_BLOCKS: u32 = 256;

/// The most layers a sender of a host pool hands the transport at once (groups grow 1, 2, 4, ...
/// up to this).
const MAX_GROUP_LAYERS: u32 = 16;

/// A sender of a device pool (or whose link writes granted transfers itself) hands the link the
/// first `1 / FIRST_WRITE_DIV` of the ready layers first, then the rest (see `SendJob::body`).
const FIRST_WRITE_DIV: u32 = 8;

/// Whether a sender has a link that writes a granted transfer itself write the ready layers
/// before it builds their messages ([`Link::write_ahead`]; `TANDEM_KV_NO_WRITE_AHEAD=1` writes
/// them as the messages are sent, in two steps, for comparing).
fn write_ahead_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NO_WRITE_AHEAD").is_none())
}

/// Block ranges whose iovecs a receiver keeps per transfer (a sender cuts every layer the same
/// way, so a few; one that cuts each layer differently only misses the shortcut).
const MAX_IOV_PATTERNS: usize = 64;

/// Chunks of one transfer a receiver holds unsettled at once — landing, or landed and waiting for
/// their sender checksum (a transport that pipelines, like cuda-ipc, has several in flight; a sender
/// that announces more is refused).
const MAX_CHUNKS_IN_FLIGHT: usize = 1024;
/// Most chunks a sender announces unsummed before it sends their checksums (and most it hands the
/// transport at once): well below what a receiver holds.
const MAX_UNSUMMED: usize = 128;

/// Locks a mutex of this crate. A panic while holding one is a bug; the state stays consistent enough to
/// fail transfers and shut down, so a poisoned lock is taken anyway.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Checksum of host memory described by iovecs.
fn checksum_iovs(iovs: &[Iov]) -> u64 {
    frame::payload_checksum(iovs.iter().map(|iov| {
        debug_assert_eq!(iov.kind, MemoryKind::Host);
        // SAFETY: the iovecs come from `KvMemory::iovs` on host memory, in range, and the caller holds the
        // transfer's claim on those blocks, so no transport or owner writes them meanwhile.
        unsafe { std::slice::from_raw_parts(iov.addr as *const u8, iov.len) }
    }))
}

struct RxLink {
    link: Arc<dyn Link>,
    /// Its sender writes our blocks itself: transfers are granted to it and fenced.
    direct: bool,
}

/// A decoded `Start` frame's fields.
struct StartFrame {
    id: u64,
    num_blocks: u32,
    blocks_hash: u64,
    binding: u64,
}

/// A transfer id from the operating system's random source.
fn random_id() -> Result<u64> {
    getrandom::u64().map_err(|e| Error::Invalid(format!("no random source for transfer ids: {e}")))
}

struct RxTransfer {
    blocks: Vec<u32>,
    blocks_hash: u64,
    /// The content the receiver expects (the sender's `Start` must name the same).
    binding: u64,
    claim: Option<Claim>,
    /// Link that sent `Start`.
    link: Option<u64>,
    /// Where the next announced chunk must start (chunks come in order).
    next_layer: u32,
    next_block: u32,
    /// The iovecs of each block range `(start, count)` chunks announced, in the layer of the first
    /// one (every layer lands in the same blocks: later layers' are these, moved).
    iov_patterns: Vec<((u32, u32), u32, Vec<Iov>)>,
    /// Chunks announced and not yet settled, oldest first: landing (the transport reports them in
    /// order), or landed and waiting for their sender checksum.
    pending: VecDeque<PendingChunk>,
    /// Blocks (over all layers) whose chunks landed and passed verification.
    landed_blocks: u64,
    /// Failed while payloads were pending: finish when the last of them is reported.
    doomed: Option<Error>,
    progress: watch::Sender<Progress>,
    created: Instant,
    started: Option<Instant>,
    bytes: u64,
    timer: Option<AbortHandle>,
    /// Direct-writing links this transfer was granted to.
    granted_to: HashSet<u64>,
    /// Once the transfer failed: the direct-writing links whose `Stopped` (or quiesce, once gone)
    /// it still waits for before its blocks are released (`None`: not failed yet).
    fence_wait: Option<HashSet<u64>>,
    fence_timer: Option<AbortHandle>,
}

/// A chunk on its way in.
struct PendingChunk {
    h: ChunkHeader,
    /// The sender's checksum (`None`: announced unsummed, its `Sums` not here yet).
    expected: Option<u64>,
    /// The transport's report: the destination's checksum, or why it did not land (`None`: landing).
    landed: Option<Result<u64>>,
}

#[derive(Default)]
struct Rx {
    transfers: HashMap<u64, RxTransfer>,
    /// Incoming links whose handshake succeeded.
    links: HashMap<u64, RxLink>,
    /// Recently ended transfers: late frames for them are dropped quietly (their sender already has,
    /// or is about to get, the real verdict; an "unexpected chunk" reply racing it would mislead).
    ended: HashSet<u64>,
    ended_order: VecDeque<u64>,
    /// Direct-writing links that closed and whose quiesce has not finished.
    gone: HashSet<u64>,
}

/// How many ended transfer ids the receiver remembers.
const ENDED_MEMORY: usize = 4096;

impl Rx {
    fn remember_ended(&mut self, id: u64) {
        if self.ended.insert(id) {
            self.ended_order.push_back(id);
        }
        while self.ended_order.len() > ENDED_MEMORY {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }
}

struct OutLink {
    link: Arc<dyn Link>,
    hello: Mutex<Option<oneshot::Sender<Result<()>>>>,
    dead: AtomicBool,
    /// When the link was last handed to a transfer or last answered.
    last_active: Mutex<Instant>,
}

/// A sender reuses a link only if it was active this recently (or has transfers in flight): receivers
/// close links idle for longer (TCP: 90 s), and a transfer must never start on a link about to close.
const LINK_REUSE_IDLE: Duration = Duration::from_secs(30);

type EndpointSlot = Arc<tokio::sync::Mutex<Option<Arc<OutLink>>>>;

#[derive(Default)]
struct Tx {
    endpoints: HashMap<String, EndpointSlot>,
    links: HashMap<u64, Arc<OutLink>>,
    /// (link id, transfer id) → the sender task waiting for the receiver's verdict.
    pending: HashMap<(u64, u64), oneshot::Sender<Result<()>>>,
    /// (link id, transfer id) of the sender tasks linked and not yet ended.
    active: HashSet<(u64, u64)>,
    /// Transfers a direct-writing link's receiver granted (see `Frame::Grant`), with the
    /// destination blocks' hash and the content binding it granted them for.
    grants: HashMap<(u64, u64), (u64, u64)>,
    /// Transfers a direct-writing link's receiver fenced: never written or started on that link
    /// again (the newest `FENCED_MEMORY`).
    fenced: HashSet<(u64, u64)>,
    fenced_order: VecDeque<(u64, u64)>,
}

/// How many fenced transfers a sender remembers.
const FENCED_MEMORY: usize = 4096;

impl Tx {
    fn remember_fenced(&mut self, key: (u64, u64)) {
        if self.fenced.insert(key) {
            self.fenced_order.push_back(key);
        }
        while self.fenced_order.len() > FENCED_MEMORY {
            if let Some(old) = self.fenced_order.pop_front() {
                self.fenced.remove(&old);
            }
        }
    }
}

#[derive(Default)]
struct Counters {
    sent_ok: AtomicU64,
    sent_failed: AtomicU64,
    received_ok: AtomicU64,
    received_failed: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    last_send_bps: AtomicU64,
    last_recv_bps: AtomicU64,
    sending: AtomicUsize,
}

/// Shared state of one connector; transports hold it as their [`Inbox`].
pub(crate) struct Core {
    memory: Arc<KvMemory>,
    /// Device memory: the GPU side that checksums chunks (and that device backends copy with).
    device: Option<Arc<DeviceKv>>,
    config: ConnectorConfig,
    rt: Handle,
    endpoint: OnceLock<String>,
    rx: Mutex<Rx>,
    tx: Mutex<Tx>,
    counters: Counters,
    closed: AtomicBool,
    /// Woken whenever a sender task ends (a fence waits for the task of its transfer).
    job_ended: tokio::sync::Notify,
    me: Weak<Core>,
}

type Replies = Vec<(Arc<dyn Link>, Frame, bool)>;

impl Core {
    pub(crate) fn new(memory: Arc<KvMemory>, config: ConnectorConfig, rt: Handle) -> Result<Arc<Core>> {
        let device = match memory.kind() {
            MemoryKind::Host => None,
            MemoryKind::Cuda { device } => Some(Arc::new(DeviceKv::new(device)?)),
        };
        Ok(Arc::new_cyclic(|me| Core {
            memory,
            device,
            config,
            rt,
            endpoint: OnceLock::new(),
            rx: Mutex::new(Rx::default()),
            tx: Mutex::new(Tx::default()),
            counters: Counters::default(),
            closed: AtomicBool::new(false),
            job_ended: tokio::sync::Notify::new(),
            me: me.clone(),
        }))
    }

    /// The device side, for device memory.
    pub(crate) fn device(&self) -> Option<&Arc<DeviceKv>> {
        self.device.as_ref()
    }

    /// The checksums of chunks `(layer, first, count)` of `blocks` (a sender's claim): on the host,
    /// or on the device for device memory (one call for all of them).
    fn chunk_checksums(&self, chunks: &[(u32, usize, usize)], blocks: &[u32]) -> Result<Vec<u64>> {
        let m = &self.memory;
        match &self.device {
            None => Ok(chunks.iter().map(|&(l, first, count)| checksum_iovs(&m.iovs(l, &blocks[first..first + count]))).collect()),
            Some(device) => {
                let at: Vec<Blocks<'_>> = chunks
                    .iter()
                    .map(|&(l, first, count)| Blocks {
                        base: m.layer_base(l) as u64,
                        num_blocks: m.num_blocks(),
                        ids: &blocks[first..first + count],
                    })
                    .collect();
                device.checksums(&at, m.geometry().block_bytes())
            }
        }
    }

    /// Blocks per chunk: bounded by the configured chunk bytes on the host; device chunks take the
    /// protocol's most (a chunk is one kernel launch there, and bytes cost nothing to hold).
    fn blocks_per_chunk(&self) -> usize {
        match self.device {
            None => (self.config.max_chunk_bytes / self.memory.geometry().block_bytes()).clamp(1, MAX_CHUNK_BLOCKS as usize),
            Some(_) => MAX_CHUNK_BLOCKS as usize,
        }
    }

    pub(crate) fn set_endpoint(&self, endpoint: String) {
        let _ = self.endpoint.set(endpoint);
    }

    pub(crate) fn memory(&self) -> &Arc<KvMemory> {
        &self.memory
    }

    pub(crate) fn config(&self) -> &ConnectorConfig {
        &self.config
    }

    /// Sends frames from a spawned task (never under a lock); `close` closes the link afterwards.
    /// Sends `replies`: one task per link, each link's frames in the order given (an `Abort` must
    /// reach its sender before the `Fence` behind it, or the sender would hear "fenced" instead of
    /// why).
    fn reply(&self, replies: Replies) {
        /// A link and its frames to send, each with whether to close the link after it.
        type Queue = (Arc<dyn Link>, Vec<(Frame, bool)>);
        let mut by_link: Vec<Queue> = Vec::new();
        for (link, frame, close) in replies {
            match by_link.iter_mut().find(|(l, _)| l.id() == link.id()) {
                Some((_, frames)) => frames.push((frame, close)),
                None => by_link.push((link, vec![(frame, close)])),
            }
        }
        for (link, frames) in by_link {
            self.rt.spawn(async move {
                for (frame, close) in frames {
                    let _ = link.send(frame.encode(), Payload::empty()).await;
                    if close {
                        link.close();
                        break;
                    }
                }
            });
        }
    }

    // ---------------------------------------------------------------- receiver side

    pub(crate) fn expect(&self, blocks: Vec<u32>, binding: u64, timeout: Duration) -> Result<RecvHandle> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        let claim = self.memory.claim(&blocks, true)?;
        let mut rx = lock(&self.rx);
        // Random ids: knowing one transfer's id tells nothing about another's.
        let id = loop {
            let id = random_id()?;
            if id != 0 && !rx.transfers.contains_key(&id) && !rx.ended.contains(&id) {
                break id;
            }
        };
        let (progress, progress_rx) = watch::channel(Progress::pending());
        let descriptor = TransferDescriptor {
            id,
            endpoint: self.endpoint.get().cloned().unwrap_or_default(),
            dst_blocks: blocks.clone(),
            geometry: self.memory.geometry().clone(),
            binding,
        };
        let transfer = RxTransfer {
            blocks_hash: frame::blocks_hash(&blocks),
            binding,
            blocks,
            claim: Some(claim),
            link: None,
            next_layer: 0,
            next_block: 0,
            iov_patterns: Vec::new(),
            pending: VecDeque::new(),
            landed_blocks: 0,
            doomed: None,
            progress,
            created: Instant::now(),
            started: None,
            bytes: 0,
            timer: None,
            granted_to: HashSet::new(),
            fence_wait: None,
            fence_timer: None,
        };
        // Registered before the timer starts, so even a zero timeout finds the transfer to expire.
        rx.transfers.insert(id, transfer);
        // Direct-writing senders may write this transfer's blocks from now on (the grant is out
        // before the descriptor is returned, let alone sent to a sender).
        let direct: Vec<(u64, Arc<dyn Link>)> = rx.links.iter().filter(|(_, l)| l.direct).map(|(&lid, l)| (lid, Arc::clone(&l.link))).collect();
        let mut grants = Vec::new();
        if let Some(t) = rx.transfers.get_mut(&id) {
            for (lid, link) in direct {
                t.granted_to.insert(lid);
                grants.push((link, Frame::Grant { id, blocks_hash: t.blocks_hash, binding: t.binding }, false));
            }
        }
        let me = self.me.clone();
        let timer = self.rt.spawn(async move {
            tokio::time::sleep(timeout).await;
            if let Some(core) = me.upgrade() {
                core.rx_timeout(id, timeout);
            }
        });
        if let Some(t) = rx.transfers.get_mut(&id) {
            t.timer = Some(timer.abort_handle());
        }
        drop(rx);
        self.reply(grants);
        Ok(RecvHandle { descriptor, progress: progress_rx, core: self.me.clone() })
    }

    /// Ends transfer `id` with `outcome`. With a payload still being written, a failure is recorded and
    /// finished by `on_payload`. `notify` tells the sender why (if it is linked).
    fn rx_end(&self, rx: &mut Rx, id: u64, outcome: Result<()>, notify: Option<AbortCode>, replies: &mut Replies) {
        let Some(t) = rx.transfers.get_mut(&id) else { return };
        if let (Some(code), Err(e), Some(link)) = (notify, &outcome, t.link.and_then(|l| rx.links.get(&l)))
            && t.doomed.is_none()
        {
            replies.push((Arc::clone(&link.link), Frame::Abort { id, code, reason: e.to_string() }, false));
        }
        // Chunks that landed no longer touch the blocks; those still landing must be reported first.
        while t.pending.front().is_some_and(|p| p.landed.is_some()) {
            t.pending.pop_front();
        }
        // A failed transfer's blocks may still be written by the direct-writing senders it was
        // granted to: fence each (a gone one is waited for through its quiesce).
        if outcome.is_err() && t.fence_wait.is_none() {
            let mut wait = HashSet::new();
            for &lid in &t.granted_to {
                if let Some(l) = rx.links.get(&lid) {
                    replies.push((Arc::clone(&l.link), Frame::Fence { id }, false));
                    wait.insert(lid);
                } else if rx.gone.contains(&lid) {
                    wait.insert(lid);
                }
            }
            if !wait.is_empty() {
                let (me, after) = (self.me.clone(), self.config.fence_wait);
                let timer = self.rt.spawn(async move {
                    tokio::time::sleep(after).await;
                    if let Some(core) = me.upgrade() {
                        core.rx_fence_expired(id);
                    }
                });
                t.fence_timer = Some(timer.abort_handle());
            }
            t.fence_wait = Some(wait);
        }
        if !t.pending.is_empty() || t.fence_wait.as_ref().is_some_and(|w| !w.is_empty()) {
            if let Err(e) = outcome {
                t.doomed.get_or_insert(e);
            }
            return;
        }
        let mut t = rx.transfers.remove(&id).expect("present");
        rx.remember_ended(id);
        drop(t.claim.take()); // blocks free before anyone can observe the terminal state
        let state = match outcome {
            Ok(()) => {
                let stats = TransferStats {
                    bytes: t.bytes,
                    elapsed: t.started.unwrap_or(t.created).elapsed(),
                };
                self.counters.received_ok.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes_received.fetch_add(t.bytes, Ordering::Relaxed);
                self.counters.last_recv_bps.store(stats.bytes_per_sec() as u64, Ordering::Relaxed);
                tracing::debug!(id, bytes = t.bytes, mb_per_s = stats.bytes_per_sec() / 1e6, "KV transfer received");
                crate::transport::kv_trace!("rx {id:x} complete");
                TransferState::Complete(stats)
            }
            Err(e) => {
                self.counters.received_failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(id, error = %e, "KV transfer failed (receiver)");
                TransferState::Failed(e)
            }
        };
        let layers = if matches!(state, TransferState::Complete(_)) {
            self.memory.geometry().num_layers()
        } else {
            t.landed_blocks.checked_div(t.blocks.len() as u64).unwrap_or(0) as u32
        };
        t.progress.send_modify(|p| {
            p.layers = layers;
            p.bytes = t.bytes;
            p.state = state;
        });
        // The timers go after the outcome is out (aborting one wakes a runtime worker): one that
        // fires meanwhile finds the transfer ended.
        for timer in [t.fence_timer.take(), t.timer.take()].into_iter().flatten() {
            timer.abort();
        }
    }

    pub(crate) fn rx_cancel(&self, id: u64) {
        let mut replies = Vec::new();
        {
            let mut rx = lock(&self.rx);
            self.rx_end(&mut rx, id, Err(Error::Cancelled { id, by: "receiver" }), Some(AbortCode::Cancelled), &mut replies);
        }
        self.reply(replies);
    }

    fn rx_timeout(&self, id: u64, after: Duration) {
        let mut replies = Vec::new();
        let mut stuck = None;
        {
            let mut rx = lock(&self.rx);
            let err = Error::Timeout { id, after_ms: after.as_millis() as u64 };
            if let Some(t) = rx.transfers.get(&id)
                && !t.pending.is_empty()
            {
                // The transport is stuck writing a payload: closing the link makes it give up (and call
                // on_payload), which finishes the transfer.
                stuck = t.link.and_then(|l| rx.links.get(&l)).map(|l| Arc::clone(&l.link));
            }
            self.rx_end(&mut rx, id, Err(err), Some(AbortCode::Timeout), &mut replies);
        }
        self.reply(replies);
        if let Some(link) = stuck {
            link.close();
        }
    }

    /// A fenced transfer's senders did not all answer in time: close their links and wait for their
    /// quiesce instead.
    fn rx_fence_expired(&self, id: u64) {
        let silent: Vec<Arc<dyn Link>> = {
            let rx = lock(&self.rx);
            let Some(wait) = rx.transfers.get(&id).and_then(|t| t.fence_wait.as_ref()) else { return };
            wait.iter().filter_map(|lid| rx.links.get(lid)).map(|l| Arc::clone(&l.link)).collect()
        };
        for link in silent {
            tracing::warn!(id, peer = link.peer(), "KV transfer fence unanswered: closing the link");
            link.close();
            self.rx_link_gone(link);
        }
    }

    /// A direct-writing link is gone (closed by its peer or by us): its transfers end (the caller
    /// fails those that came over it) and every fence waiting for it waits for its quiesce.
    fn rx_link_gone(&self, link: Arc<dyn Link>) {
        let lid = link.id();
        {
            let mut rx = lock(&self.rx);
            rx.links.remove(&lid);
            rx.gone.insert(lid);
        }
        let me = self.me.clone();
        self.rt.spawn(async move {
            link.quiesce().await;
            if let Some(core) = me.upgrade() {
                core.rx_quiesced(lid);
            }
        });
    }

    /// Nothing link `lid`'s peer started can land any more: the fences waiting for it are answered.
    fn rx_quiesced(&self, lid: u64) {
        let mut replies = Vec::new();
        {
            let mut rx = lock(&self.rx);
            rx.gone.remove(&lid);
            let mut waiting = Vec::new();
            for (&id, t) in rx.transfers.iter_mut() {
                t.granted_to.remove(&lid);
                if t.fence_wait.as_mut().is_some_and(|w| w.remove(&lid)) {
                    waiting.push(id);
                }
            }
            for id in waiting {
                self.rx_settle(&mut rx, id, &mut replies);
            }
        }
        self.reply(replies);
    }

    fn rx_message(&self, link: &Arc<dyn Link>, frame: Frame, payload_len: u64) -> Delivery {
        let mut replies = Vec::new();
        let delivery = {
            let mut rx = lock(&self.rx);
            let known = rx.links.contains_key(&link.id());
            if payload_len > 0 && !matches!(frame, Frame::Chunk(_) | Frame::ChunkUnsummed(_)) {
                Delivery::CloseLink("payload on a control frame".into())
            } else {
                match frame {
                    Frame::Hello { .. } if known => Delivery::CloseLink("second hello on a link".into()),
                    Frame::Hello { version, geometry } => {
                        let verdict = if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
                            Err(format!("protocol version: receiver speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}, sender {version}"))
                        } else {
                            self.memory
                                .geometry()
                                .check_compatible(&geometry)
                                .map_err(|e| format!("receiver vs sender: {}", e.to_string().trim_start_matches("KV handshake refused: ")))
                        };
                        match verdict {
                            Ok(()) => {
                                // (Grants and fences are protocol 4: an older sender's link gets none.)
                                let direct = link.writes_directly() && version >= 4;
                                rx.links.insert(link.id(), RxLink { link: Arc::clone(link), direct });
                                replies.push((Arc::clone(link), Frame::HelloAck { version }, false));
                                if direct {
                                    // Every transfer still expected may come over this new link.
                                    for (&id, t) in rx.transfers.iter_mut().filter(|(_, t)| t.fence_wait.is_none()) {
                                        t.granted_to.insert(link.id());
                                        replies.push((Arc::clone(link), Frame::Grant { id, blocks_hash: t.blocks_hash, binding: t.binding }, false));
                                    }
                                }
                            }
                            Err(reason) => {
                                tracing::warn!(peer = link.peer(), %reason, "KV handshake refused");
                                replies.push((Arc::clone(link), Frame::HelloReject { reason }, true));
                            }
                        }
                        Delivery::Discard
                    }
                    _ if !known => Delivery::CloseLink("frame before handshake".into()),
                    Frame::Start { id, num_blocks, blocks_hash, binding } => {
                        let start = StartFrame { id, num_blocks, blocks_hash, binding };
                        self.rx_start(&mut rx, link, start, &mut replies);
                        Delivery::Discard
                    }
                    Frame::Chunk(h) => self.rx_chunk(&mut rx, link, h, true, payload_len, &mut replies),
                    Frame::ChunkUnsummed(h) => self.rx_chunk(&mut rx, link, h, false, payload_len, &mut replies),
                    Frame::Sums { id, sums } => {
                        self.rx_sums(&mut rx, link, id, sums, &mut replies);
                        Delivery::Discard
                    }
                    Frame::Abort { id, code, reason } => {
                        // From the link that started it, or, before any `Start` (a sender sends it
                        // with its first chunks, so it may give up before), from any linked sender
                        // that knows the transfer's id (as a `Start` would be).
                        if rx.transfers.get(&id).is_some_and(|t| t.link.is_none_or(|l| l == link.id())) {
                            let err = match code {
                                AbortCode::Cancelled => Error::Cancelled { id, by: "sender" },
                                _ => Error::Rejected { id, reason: format!("sender aborted: {reason}") },
                            };
                            self.rx_end(&mut rx, id, Err(err), None, &mut replies);
                        }
                        Delivery::Discard
                    }
                    Frame::Stopped { id } => {
                        // A direct-writing sender confirms a fence: the transfer may end once every
                        // link it waits for did.
                        let lid = link.id();
                        if rx.transfers.get_mut(&id).and_then(|t| t.fence_wait.as_mut()).is_some_and(|w| w.remove(&lid)) {
                            self.rx_settle(&mut rx, id, &mut replies);
                        }
                        Delivery::Discard
                    }
                    Frame::HelloAck { .. } | Frame::HelloReject { .. } | Frame::Done { .. } | Frame::Grant { .. } | Frame::Fence { .. } => {
                        Delivery::CloseLink("reply frame on an incoming link".into())
                    }
                }
            }
        };
        self.reply(replies);
        delivery
    }

    fn rx_start(&self, rx: &mut Rx, link: &Arc<dyn Link>, start: StartFrame, replies: &mut Replies) {
        let StartFrame { id, num_blocks, blocks_hash: hash, binding } = start;
        if rx.ended.contains(&id) {
            return;
        }
        let Some(t) = rx.transfers.get_mut(&id) else {
            let reason = "no such transfer is expected here (unknown id, or already finished, cancelled or timed out)";
            replies.push((Arc::clone(link), Frame::Abort { id, code: AbortCode::Rejected, reason: reason.into() }, false));
            return;
        };
        if t.link.is_some() {
            let e = Error::Integrity { id, reason: "duplicate start".into() };
            self.rx_end(rx, id, Err(e), Some(AbortCode::Integrity), replies);
            return;
        }
        t.link = Some(link.id());
        t.started = Some(Instant::now());
        if num_blocks as usize != t.blocks.len() || hash != t.blocks_hash {
            let reason = format!(
                "destination blocks differ from the {} the receiver allocated (sender names {num_blocks})",
                t.blocks.len()
            );
            self.rx_end(rx, id, Err(Error::Rejected { id, reason }), Some(AbortCode::Rejected), replies);
            return;
        }
        if binding != t.binding {
            let reason = format!(
                "the sender's KV is bound to other content ({binding:#018x}) than the receiver expects ({:#018x}): \
                 refused before any block landed",
                t.binding
            );
            tracing::warn!(peer = link.peer(), id, "KV transfer refused: content binding differs");
            self.rx_end(rx, id, Err(Error::Rejected { id, reason }), Some(AbortCode::Rejected), replies);
            return;
        }
        if t.blocks.is_empty() {
            replies.push((Arc::clone(link), Frame::Done { id }, false));
            self.rx_end(rx, id, Ok(()), None, replies);
        }
    }

    /// A chunk announced with its checksum (`summed`) or without (its `Sums` follows).
    fn rx_chunk(&self, rx: &mut Rx, link: &Arc<dyn Link>, h: ChunkHeader, summed: bool, payload_len: u64, replies: &mut Replies) -> Delivery {
        let geometry = self.memory.geometry();
        let bb = geometry.block_bytes() as u64;
        if payload_len > u64::from(MAX_CHUNK_BLOCKS) * bb {
            return Delivery::CloseLink(format!("chunk payload of {payload_len} bytes exceeds the protocol limit"));
        }
        let id = h.id;
        if rx.ended.contains(&id) {
            return Delivery::Discard;
        }
        let Some(t) = rx.transfers.get_mut(&id) else {
            let reason = "unexpected chunk: no such transfer in flight here";
            replies.push((Arc::clone(link), Frame::Abort { id, code: AbortCode::Rejected, reason: reason.into() }, false));
            return Delivery::Discard;
        };
        let n = t.blocks.len() as u64;
        let problem = if t.link != Some(link.id()) {
            Some("chunk before its start frame, or from another link".to_string())
        } else if t.doomed.is_some() {
            Some("chunk after the transfer failed".to_string())
        } else if t.pending.len() >= MAX_CHUNKS_IN_FLIGHT {
            Some(format!("more than {MAX_CHUNKS_IN_FLIGHT} chunks landing at once"))
        } else if h.layer != t.next_layer || h.block_start != t.next_block {
            Some(format!(
                "expected layer {} block {}, got layer {} block {} (reordered or duplicated chunk)",
                t.next_layer, t.next_block, h.layer, h.block_start
            ))
        } else if h.block_count == 0 || u64::from(h.block_start) + u64::from(h.block_count) > n || h.block_count > MAX_CHUNK_BLOCKS {
            Some(format!("block range {}+{} outside the transfer's {n} blocks", h.block_start, h.block_count))
        } else if h.byte_len != u64::from(h.block_count) * bb || payload_len != h.byte_len {
            Some(format!(
                "chunk of {} blocks must carry {} bytes; header says {}, payload has {payload_len} (truncated or padded)",
                h.block_count,
                u64::from(h.block_count) * bb,
                h.byte_len
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            self.rx_end(rx, id, Err(Error::Integrity { id, reason }), Some(AbortCode::Integrity), replies);
            return Delivery::Discard;
        }
        let start = h.block_start as usize;
        // Every layer lands in the same blocks: a chunk's iovecs are those of the same range one
        // layer before, moved.
        let range = (h.block_start, h.block_count);
        let iovs = match t.iov_patterns.iter().find(|p| p.0 == range) {
            Some((_, of, pattern)) => self.memory.iovs_moved(pattern, *of, h.layer),
            None => {
                let iovs = self.memory.iovs(h.layer, &t.blocks[start..start + h.block_count as usize]);
                if t.iov_patterns.len() < MAX_IOV_PATTERNS {
                    t.iov_patterns.push((range, h.layer, iovs.clone()));
                }
                iovs
            }
        };
        t.next_block += h.block_count;
        if t.next_block as usize == t.blocks.len() {
            t.next_block = 0;
            t.next_layer += 1;
        }
        t.pending.push_back(PendingChunk { h, expected: summed.then_some(h.checksum), landed: None });
        crate::transport::kv_trace!("rx {id:x} layer {} block {} announced", h.layer, h.block_start);
        Delivery::Into { iovs, token: id }
    }

    fn rx_payload(&self, token: u64, result: std::result::Result<Landed, String>) {
        let id = token;
        // The chunk this report is for: the oldest one still landing (transports report in order).
        let header = {
            let rx = lock(&self.rx);
            match rx.transfers.get(&id).and_then(|t| {
                t.pending.iter().find(|p| p.landed.is_none()).map(|p| (p.h, t.doomed.is_some(), t.blocks.clone()))
            }) {
                Some(v) => v,
                None => return,
            }
        };
        let (h, doomed, blocks) = header;
        // The destination's checksum, summed here (outside the lock) if the transport did not.
        let landed = match result {
            Err(e) => Err(Error::LinkFailed { peer: "sender".into(), reason: format!("payload not delivered: {e}") }),
            Ok(_) if doomed => Ok(0),
            Ok(landed) => match landed.checksum {
                Some(sum) => Ok(sum),
                None => {
                    let start = h.block_start as usize;
                    self.chunk_checksums(&[(h.layer, start, h.block_count as usize)], &blocks).map(|sums| sums[0])
                }
            },
        };
        let mut replies = Vec::new();
        {
            let mut rx = lock(&self.rx);
            let Some(t) = rx.transfers.get_mut(&id) else { return };
            let Some(p) = t.pending.iter_mut().find(|p| p.landed.is_none()) else { return };
            p.landed = Some(landed);
            crate::transport::kv_trace!("rx {id:x} layer {} block {} landed", h.layer, h.block_start);
            self.rx_settle(&mut rx, id, &mut replies);
        }
        self.reply(replies);
    }

    /// A `Sums` frame: the sender's checksums of the oldest chunks it announced unsummed.
    fn rx_sums(&self, rx: &mut Rx, link: &Arc<dyn Link>, id: u64, sums: Vec<u64>, replies: &mut Replies) {
        if rx.ended.contains(&id) {
            return;
        }
        let Some(t) = rx.transfers.get_mut(&id) else {
            let reason = "unexpected checksums: no such transfer in flight here";
            replies.push((Arc::clone(link), Frame::Abort { id, code: AbortCode::Rejected, reason: reason.into() }, false));
            return;
        };
        if t.link != Some(link.id()) {
            let reason = "checksums before the start frame, or from another link".to_string();
            self.rx_end(rx, id, Err(Error::Integrity { id, reason }), Some(AbortCode::Integrity), replies);
            return;
        }
        if t.doomed.is_some() {
            return;
        }
        let mut sums = sums.into_iter();
        for p in t.pending.iter_mut().filter(|p| p.expected.is_none()) {
            match sums.next() {
                Some(sum) => p.expected = Some(sum),
                None => break,
            }
        }
        if sums.next().is_some() {
            let reason = "checksums for chunks never announced".to_string();
            self.rx_end(rx, id, Err(Error::Integrity { id, reason }), Some(AbortCode::Integrity), replies);
            return;
        }
        self.rx_settle(rx, id, replies);
    }

    /// Settles transfer `id`'s oldest chunks that landed and whose checksums are known, in order:
    /// compares, counts progress, completes or fails the transfer. A failed transfer drops the
    /// chunks that landed and finishes when the last one still landing is reported.
    fn rx_settle(&self, rx: &mut Rx, id: u64, replies: &mut Replies) {
        let num_layers = self.memory.geometry().num_layers();
        loop {
            let Some(t) = rx.transfers.get_mut(&id) else { return };
            if let Some(e) = t.doomed.take() {
                // Ends the transfer once nothing is landing any more (else dooms it again).
                self.rx_end(rx, id, Err(e), None, replies);
                return;
            }
            let Some(front) = t.pending.front() else { return };
            let sum = match &front.landed {
                None => return,
                Some(Err(_)) => None,
                Some(Ok(sum)) => match front.expected {
                    None => return, // its checksum has not come yet
                    Some(expected) => Some((*sum, expected)),
                },
            };
            let mut p = t.pending.pop_front().expect("checked");
            let h = p.h;
            let verdict = match (sum, p.landed.take()) {
                (_, Some(Err(e))) => Err(e),
                (Some((sum, expected)), _) if sum == expected => Ok(()),
                _ => Err(Error::Integrity {
                    id,
                    reason: format!("checksum mismatch in layer {} blocks {}..{}", h.layer, h.block_start, h.block_start + h.block_count),
                }),
            };
            if let Err(e) = verdict {
                self.rx_end(rx, id, Err(e), Some(AbortCode::Integrity), replies);
                continue; // settles (or drops) the chunks that landed behind it
            }
            let n = t.blocks.len() as u64;
            let before = t.landed_blocks / n;
            t.bytes += h.byte_len;
            t.landed_blocks += u64::from(h.block_count);
            let layers = (t.landed_blocks / n) as u32;
            if u64::from(layers) > before && layers < num_layers {
                let bytes = t.bytes;
                t.progress.send_modify(|p| {
                    p.layers = layers;
                    p.bytes = bytes;
                });
            } else if layers == num_layers {
                if let Some(link) = t.link.and_then(|l| rx.links.get(&l)) {
                    replies.push((Arc::clone(&link.link), Frame::Done { id }, false));
                }
                self.rx_end(rx, id, Ok(()), None, replies);
                return;
            }
        }
    }

    // ---------------------------------------------------------------- sender side

    pub(crate) fn start_send(
        self: &Arc<Self>,
        transport: Arc<dyn Transport>,
        desc: &TransferDescriptor,
        src_blocks: Vec<u32>,
        binding: u64,
        timeout: Duration,
        ready: bool,
    ) -> Result<SendHandle> {
        crate::transport::kv_trace!("tx {:x} start ({} blocks)", desc.id, src_blocks.len());
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        self.memory
            .geometry()
            .check_compatible(&desc.geometry)
            .map_err(|e| Error::Incompatible(format!("descriptor vs this pool: {e}")))?;
        if src_blocks.len() != desc.dst_blocks.len() {
            return Err(Error::Invalid(format!(
                "{} source blocks for {} destination blocks",
                src_blocks.len(),
                desc.dst_blocks.len()
            )));
        }
        let mut claim = self.memory.claim(&src_blocks, false)?;
        let released = claim.on_release();
        crate::transport::kv_trace!("tx {:x} claimed", desc.id);
        let num_layers = self.memory.geometry().num_layers();
        let (pushed, pushed_rx) = watch::channel(if ready { num_layers } else { 0 });
        let (cancel, cancel_rx) = watch::channel(false);
        let (progress_tx, progress) = watch::channel(Progress::pending());
        self.counters.sending.fetch_add(1, Ordering::AcqRel);
        let job = SendJob {
            core: Arc::clone(self),
            transport,
            desc: desc.clone(),
            binding,
            claim: Arc::new(claim),
            pushed: pushed_rx,
            progress: progress_tx,
        };
        let job = job.run(cancel_rx, released, timeout);
        if ready {
            // Every layer is there: the job's steps (the link, the announcements, the sums) run
            // here, on the caller's thread, until it first waits, so the receiver hears of the
            // transfer without waiting for a runtime worker to wake up; the rest runs on the
            // runtime. (The spawned task polls the job again at once, so the no-op waker of this
            // first poll loses nothing.)
            let mut job = Box::pin(job);
            let _in_runtime = self.rt.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if job.as_mut().poll(&mut cx).is_pending() {
                self.rt.spawn(job);
            }
        } else {
            self.rt.spawn(job);
        }
        Ok(SendHandle { id: desc.id, num_layers, pushed, cancel, progress })
    }

    /// The handshaken link to `endpoint`, reusing a live one.
    async fn link_to(&self, transport: &Arc<dyn Transport>, endpoint: &str) -> Result<Arc<OutLink>> {
        let slot = Arc::clone(lock(&self.tx).endpoints.entry(endpoint.to_string()).or_default());
        let mut slot = slot.lock().await;
        if let Some(out) = slot.take() {
            let id = out.link.id();
            let busy = lock(&self.tx).pending.keys().any(|k| k.0 == id);
            let fresh = lock(&out.last_active).elapsed() < LINK_REUSE_IDLE;
            if !out.dead.load(Ordering::Acquire) && (busy || fresh) {
                *lock(&out.last_active) = Instant::now();
                *slot = Some(Arc::clone(&out));
                return Ok(out);
            }
            // Dead, or idle long enough that the receiver may be closing it: start afresh.
            out.dead.store(true, Ordering::Release);
            lock(&self.tx).links.remove(&id);
            out.link.close();
        }
        let unreachable = |reason: String| Error::Unreachable { endpoint: endpoint.to_string(), reason };
        let link = tokio::time::timeout(self.config.connect_timeout, transport.connect(endpoint))
            .await
            .map_err(|_| unreachable(format!("no connection within {:?}", self.config.connect_timeout)))??;
        let (hello_tx, hello_rx) = oneshot::channel();
        let out = Arc::new(OutLink {
            link: Arc::clone(&link),
            hello: Mutex::new(Some(hello_tx)),
            dead: AtomicBool::new(false),
            last_active: Mutex::new(Instant::now()),
        });
        lock(&self.tx).links.insert(link.id(), Arc::clone(&out));
        let hello = Frame::Hello { version: PROTOCOL_VERSION, geometry: self.memory.geometry().clone() };
        let handshake = async {
            link.send(hello.encode(), Payload::empty()).await?;
            match tokio::time::timeout(self.config.connect_timeout, hello_rx).await {
                Ok(Ok(verdict)) => verdict,
                Ok(Err(_)) => Err(unreachable("link closed during the handshake".into())),
                Err(_) => Err(unreachable("no handshake reply".into())),
            }
        };
        if let Err(e) = handshake.await {
            out.dead.store(true, Ordering::Release);
            lock(&self.tx).links.remove(&link.id());
            link.close();
            return Err(e);
        }
        *slot = Some(Arc::clone(&out));
        Ok(out)
    }

    fn tx_message(&self, out: &Arc<OutLink>, frame: Frame) -> Delivery {
        let link_id = out.link.id();
        *lock(&out.last_active) = Instant::now();
        match frame {
            Frame::HelloAck { version } => {
                // The receiver answers with the version the link speaks: ours, or an older one we
                // still speak (a newer receiver answering an older sender's hello).
                let verdict = if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
                    Ok(())
                } else {
                    Err(Error::Incompatible(format!("protocol version: sender speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}, receiver {version}")))
                };
                if let Some(tx) = lock(&out.hello).take() {
                    let _ = tx.send(verdict);
                }
                Delivery::Discard
            }
            Frame::HelloReject { reason } => {
                if let Some(tx) = lock(&out.hello).take() {
                    let _ = tx.send(Err(Error::Incompatible(reason)));
                }
                Delivery::Discard
            }
            Frame::Done { id } => {
                if let Some(tx) = lock(&self.tx).pending.remove(&(link_id, id)) {
                    let _ = tx.send(Ok(()));
                }
                Delivery::Discard
            }
            Frame::Abort { id, code, reason } => {
                if let Some(tx) = lock(&self.tx).pending.remove(&(link_id, id)) {
                    let err = match code {
                        AbortCode::Cancelled => Error::Cancelled { id, by: "receiver" },
                        AbortCode::Integrity => Error::Integrity { id, reason },
                        AbortCode::Rejected | AbortCode::Timeout | AbortCode::Internal => Error::Rejected { id, reason },
                    };
                    let _ = tx.send(Err(err));
                }
                Delivery::Discard
            }
            Frame::Grant { id, blocks_hash, binding } => {
                // (A grant that lost a race with its transfer's fence grants nothing.)
                let mut tx = lock(&self.tx);
                if !tx.fenced.contains(&(link_id, id)) {
                    tx.grants.insert((link_id, id), (blocks_hash, binding));
                }
                Delivery::Discard
            }
            Frame::Fence { id } => {
                let key = (link_id, id);
                {
                    let mut tx = lock(&self.tx);
                    tx.grants.remove(&key);
                    tx.remember_fenced(key);
                    if let Some(w) = tx.pending.remove(&key) {
                        let _ = w.send(Err(Error::Rejected { id, reason: "the receiver fenced the transfer".into() }));
                    }
                }
                // Once the transfer's task made its last transport call and the transport's writes
                // landed, confirm.
                let (me, link) = (self.me.clone(), Arc::clone(&out.link));
                self.rt.spawn(async move {
                    let Some(core) = me.upgrade() else { return };
                    loop {
                        let ended = core.job_ended.notified();
                        tokio::pin!(ended);
                        ended.as_mut().enable();
                        if !lock(&core.tx).active.contains(&key) {
                            break;
                        }
                        ended.await;
                    }
                    if link.drain().await.is_ok() {
                        let _ = link.send(Frame::Stopped { id }.encode(), Payload::empty()).await;
                    }
                });
                Delivery::Discard
            }
            Frame::Hello { .. } | Frame::Start { .. } | Frame::Chunk(_) | Frame::ChunkUnsummed(_) | Frame::Sums { .. } | Frame::Stopped { .. } => {
                Delivery::CloseLink("sender-side frame on an outgoing link".into())
            }
        }
    }

    // ---------------------------------------------------------------- bookkeeping

    pub(crate) fn metrics(&self) -> Metrics {
        let c = &self.counters;
        Metrics {
            sent_ok: c.sent_ok.load(Ordering::Relaxed),
            sent_failed: c.sent_failed.load(Ordering::Relaxed),
            received_ok: c.received_ok.load(Ordering::Relaxed),
            received_failed: c.received_failed.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            last_send_bytes_per_sec: c.last_send_bps.load(Ordering::Relaxed),
            last_recv_bytes_per_sec: c.last_recv_bps.load(Ordering::Relaxed),
            sending: c.sending.load(Ordering::Acquire),
            receiving: lock(&self.rx).transfers.len(),
        }
    }

    /// Fails everything; called after the transport stopped calling back.
    pub(crate) fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        let mut replies = Vec::new();
        {
            let mut rx = lock(&self.rx);
            let ids: Vec<u64> = rx.transfers.keys().copied().collect();
            for id in ids {
                if let Some(t) = rx.transfers.get_mut(&id) {
                    t.pending.clear(); // the transport has stopped: nothing writes any more
                    t.doomed = None;
                    t.fence_wait = Some(HashSet::new()); // nor can a sender: no fence
                }
                self.rx_end(&mut rx, id, Err(Error::Shutdown), None, &mut replies);
            }
            rx.links.clear();
        }
        let mut tx = lock(&self.tx);
        for (_, waiter) in tx.pending.drain() {
            let _ = waiter.send(Err(Error::Shutdown));
        }
        for (_, out) in tx.links.drain() {
            out.dead.store(true, Ordering::Release);
        }
        tx.endpoints.clear();
    }
}

impl Inbox for Core {
    fn on_message(&self, link: &Arc<dyn Link>, header: &[u8], payload_len: u64) -> Delivery {
        let frame = match Frame::decode(header) {
            Ok(f) => f,
            Err(e) => return Delivery::CloseLink(e.to_string()),
        };
        let out = lock(&self.tx).links.get(&link.id()).cloned();
        match out {
            Some(out) if payload_len == 0 => self.tx_message(&out, frame),
            Some(_) => Delivery::CloseLink("payload on an outgoing link".into()),
            None => self.rx_message(link, frame, payload_len),
        }
    }

    fn on_payload(&self, _link: &Arc<dyn Link>, token: u64, result: std::result::Result<Landed, String>) {
        self.rx_payload(token, result);
    }

    fn granted_blocks(&self, link: &Arc<dyn Link>, id: u64) -> Option<Vec<u32>> {
        // A transfer that failed keeps its grants and its claim until its fence is answered, so a
        // sender's writes made before the fence reached it still find their blocks here.
        let rx = lock(&self.rx);
        let t = rx.transfers.get(&id).filter(|t| t.granted_to.contains(&link.id()))?;
        t.claim.as_ref().map(|c| c.blocks().to_vec())
    }

    fn on_link_closed(&self, link: &Arc<dyn Link>, reason: String) {
        let link_id = link.id();
        let err = Error::LinkFailed { peer: link.peer().to_string(), reason };
        // Sender side: fail the handshake and every transfer waiting on this link.
        {
            let mut tx = lock(&self.tx);
            if let Some(out) = tx.links.remove(&link_id) {
                out.dead.store(true, Ordering::Release);
                if let Some(h) = lock(&out.hello).take() {
                    let _ = h.send(Err(err.clone()));
                }
                let keys: Vec<(u64, u64)> = tx.pending.keys().filter(|k| k.0 == link_id).copied().collect();
                for k in keys {
                    if let Some(w) = tx.pending.remove(&k) {
                        let _ = w.send(Err(err.clone()));
                    }
                }
                tx.grants.retain(|k, _| k.0 != link_id);
            }
        }
        // Receiver side: fail every transfer that came over it (after marking a direct-writing link
        // gone, so those transfers, and the fences already waiting for it, wait for its quiesce).
        if lock(&self.rx).links.get(&link_id).is_some_and(|l| l.direct) {
            self.rx_link_gone(Arc::clone(link));
        }
        let mut replies = Vec::new();
        {
            let mut rx = lock(&self.rx);
            rx.links.remove(&link_id);
            let ids: Vec<u64> = rx.transfers.iter().filter(|(_, t)| t.link == Some(link_id)).map(|(id, _)| *id).collect();
            for id in ids {
                if let Some(t) = rx.transfers.get_mut(&id) {
                    // The transport called on_payload for anything pending before closing the link.
                    t.pending.clear();
                    let e = t.doomed.take().unwrap_or_else(|| err.clone());
                    self.rx_end(&mut rx, id, Err(e), None, &mut replies);
                }
            }
        }
        self.reply(replies);
    }
}

/// One sender task's inputs.
struct SendJob {
    core: Arc<Core>,
    transport: Arc<dyn Transport>,
    desc: TransferDescriptor,
    /// The sender's tag of what it sends (not the descriptor's).
    binding: u64,
    claim: Arc<Claim>,
    pushed: watch::Receiver<u32>,
    progress: watch::Sender<Progress>,
}

impl SendJob {
    async fn run(mut self, mut cancel: watch::Receiver<bool>, released: oneshot::Receiver<()>, timeout: Duration) {
        let started = Instant::now();
        let id = self.desc.id;
        let mut linked: Option<Arc<dyn Link>> = None;
        let outcome = {
            // Cancellation is honoured between chunks (never by abandoning a half-sent chunk on a shared
            // link); the deadline does abandon it, and the transport then closes that stuck link.
            let body = self.body(&mut linked, &mut cancel);
            tokio::select! {
                r = body => r,
                _ = tokio::time::sleep(timeout) => Err(Error::Timeout { id, after_ms: timeout.as_millis() as u64 }),
            }
        };
        let core = Arc::clone(&self.core);
        if let Some(link) = &linked {
            {
                let mut tx = lock(&core.tx);
                tx.pending.remove(&(link.id(), id));
                tx.active.remove(&(link.id(), id));
                tx.grants.remove(&(link.id(), id));
            }
            core.job_ended.notify_waiters();
            let code = match &outcome {
                Err(Error::Cancelled { by: "sender", .. }) => Some(AbortCode::Cancelled),
                Err(Error::Timeout { .. }) => Some(AbortCode::Timeout),
                _ => None,
            };
            if let (Some(code), Err(e)) = (code, &outcome) {
                core.reply(vec![(Arc::clone(link), Frame::Abort { id, code, reason: e.to_string() }, false)]);
            }
        }
        let bytes = self.progress.borrow().bytes;
        // Wait until no transport reads the source blocks any more, then publish the verdict.
        let SendJob { claim, progress, .. } = self;
        drop(claim);
        let _ = released.await;
        let state = match outcome {
            Ok(()) => {
                let stats = TransferStats { bytes, elapsed: started.elapsed() };
                core.counters.sent_ok.fetch_add(1, Ordering::Relaxed);
                core.counters.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
                core.counters.last_send_bps.store(stats.bytes_per_sec() as u64, Ordering::Relaxed);
                tracing::debug!(id, bytes, mb_per_s = stats.bytes_per_sec() / 1e6, "KV transfer sent");
                TransferState::Complete(stats)
            }
            Err(e) => {
                core.counters.sent_failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(id, error = %e, "KV transfer failed (sender)");
                TransferState::Failed(e)
            }
        };
        core.counters.sending.fetch_sub(1, Ordering::AcqRel);
        let num_layers = core.memory.geometry().num_layers();
        progress.send_modify(|p| {
            if matches!(state, TransferState::Complete(_)) {
                p.layers = num_layers;
            }
            p.state = state;
        });
    }

    async fn body(&mut self, linked: &mut Option<Arc<dyn Link>>, cancel: &mut watch::Receiver<bool>) -> Result<()> {
        let core = Arc::clone(&self.core);
        let memory = core.memory();
        let desc = &self.desc;
        let cancelled = Error::Cancelled { id: desc.id, by: "sender" };
        let out = tokio::select! {
            r = core.link_to(&self.transport, &desc.endpoint) => r?,
            _ = cancel.wait_for(|c| *c) => return Err(cancelled),
        };
        let link = Arc::clone(&out.link);
        crate::transport::kv_trace!("tx {:x} linked", desc.id);
        let (done_tx, mut done_rx) = oneshot::channel();
        {
            let mut tx = lock(&core.tx);
            let key = (link.id(), desc.id);
            if tx.fenced.contains(&key) {
                // The receiver gave this transfer up before it started here: nothing may be written.
                return Err(Error::Rejected { id: desc.id, reason: "the receiver fenced the transfer".into() });
            }
            tx.pending.insert(key, done_tx);
            tx.active.insert(key);
        }
        *linked = Some(Arc::clone(&link));
        if out.dead.load(Ordering::Acquire) {
            return Err(Error::LinkFailed { peer: link.peer().to_string(), reason: "link closed".into() });
        }
        let blocks_hash = frame::blocks_hash(&desc.dst_blocks);
        let start = Frame::Start { id: desc.id, num_blocks: desc.dst_blocks.len() as u32, blocks_hash, binding: self.binding };
        let n = self.claim.blocks().len();
        // `Start` goes out in one write with the first chunks (one socket message and one wake-up of
        // the receiver fewer per transfer); alone when there are no blocks.
        let mut start = Some(start.encode());
        if n == 0
            && let Some(start) = start.take()
        {
            link.send(start, Payload::empty()).await?;
        }

        let bb = memory.geometry().block_bytes();
        let per_chunk = core.blocks_per_chunk();
        let num_layers = memory.geometry().num_layers();
        if n > 0 {
            // Layers go in groups of those already pushed: one layer first (the first chunk leaves
            // at once), then doubling up to MAX_GROUP_LAYERS.
            let mut layer = 0;
            let mut group = 1;
            let mut first_sent = false;
            // Chunks announced unsummed whose checksums have not been sent yet.
            let mut unsummed: Vec<(u32, usize, usize)> = Vec::new();
            // Each layer's chunks: `(first, count)` positions in the transfer's block lists.
            let chunk_ranges: Vec<(usize, usize)> = (0..n).step_by(per_chunk).map(|first| (first, per_chunk.min(n - first))).collect();
            // Each chunk's iovecs in the first layer sent: every layer sends the same blocks.
            let mut patterns: Vec<Option<(u32, Vec<Iov>)>> = vec![None; n.div_ceil(per_chunk)];
            while layer < num_layers {
                // Wait until the owner pushed this layer, unless the receiver already gave up.
                tokio::select! {
                    r = self.pushed.wait_for(|p| *p > layer) => {
                        if r.is_err() {
                            return Err(cancelled);
                        }
                    }
                    verdict = &mut done_rx => return Err(early(desc.id, verdict)),
                    _ = cancel.wait_for(|c| *c) => return Err(cancelled),
                }
                crate::transport::kv_trace!("tx {:x} layer {layer} pushed", desc.id);
                // Whether the receiver granted this transfer to this link (checked per group: a
                // fence revokes it).
                // Only for the blocks and the content the receiver expects: what it would refuse at
                // `Start` is never written into its pool.
                let granted = link.writes_directly()
                    && lock(&core.tx).grants.get(&(link.id(), desc.id)) == Some(&(blocks_hash, self.binding));
                let ready = (*self.pushed.borrow()).min(num_layers);
                // Device pools (and links that write granted transfers themselves) take the ready
                // layers in two steps: the first eighth (the link starts moving it at once), then
                // all the rest in one go, prepared while the first moves (moving it outlasts that
                // host work, so the link never waits for the host); the link cuts batches or
                // verification groups of its own. Every batch costs both hosts tens of
                // microseconds, which small batches (groups of 1, 2, 4 layers of all ready) do
                // not hide behind their bytes at hundreds of GB/s (handing a writing link the
                // first layer alone, then the rest of the eighth, measured no better: each call's
                // host work outlasted the layer before it). Host pools go in groups doubling from
                // one layer (the first chunk leaves at once, each is summed on the host while the
                // previous moves).
                let two_steps = granted || core.device.is_some();
                // A link that writes the transfer itself may write every ready layer now, before
                // the host builds their messages (its copies start after one pass over the
                // blocks, not after a batch of messages), and the messages then follow at once.
                let tickets = match granted && write_ahead_enabled() {
                    true => {
                        let plan = crate::transport::WritePlan { id: desc.id, layers: layer..ready, chunks: &chunk_ranges, src: self.claim.blocks(), dst: &desc.dst_blocks };
                        let tickets = link.write_ahead(plan)?;
                        if tickets.as_ref().is_some_and(|t| t.len() != (ready - layer) as usize * chunk_ranges.len()) {
                            return Err(Error::Invalid("the link wrote ahead another number of chunks than planned".into()));
                        }
                        tickets
                    }
                    false => None,
                };
                let end = match two_steps {
                    _ if tickets.is_some() => ready,
                    true if layer == 0 => ready.div_ceil(FIRST_WRITE_DIV),
                    true => ready,
                    false => ready.min(layer + group),
                };
                let chunks: Vec<(u32, usize, usize)> = (layer..end).flat_map(|l| chunk_ranges.iter().map(move |&(first, count)| (l, first, count))).collect();
                crate::transport::kv_trace!("tx {:x} {} chunks listed", desc.id, chunks.len());
                // Device pools checksum the whole group in one call and hand it to the transport at
                // once; host pools checksum and send chunk by chunk (the receiver works on one
                // chunk while the next is summed). The pacing test hook sends chunk by chunk too,
                // waiting before each.
                let delay = crate::transport::chunk_delay_from_env();
                let step = if core.device.is_some() { MAX_UNSUMMED } else { 1 };
                // Device pools announce a group's chunks first and sum them while they move (a
                // `Sums` frame follows), which keeps the checksum off the bytes' path; host pools
                // (unless `sums_follow`) and the pacing hook sum each chunk before announcing it.
                let later = (core.device.is_some() || core.config.sums_follow) && delay.is_none();
                for (p, part) in chunks.chunks(step).enumerate() {
                    let sums = if later {
                        None
                    } else {
                        let sums = core.chunk_checksums(part, self.claim.blocks())?;
                        crate::transport::kv_trace!("tx {:x} {} chunks from layer {} checksummed", desc.id, part.len(), part[0].0);
                        Some(sums)
                    };
                    let mut batch = Vec::with_capacity(part.len() + 1);
                    if let Some(start) = start.take() {
                        batch.push((start, Payload::empty()));
                    }
                    for (i, &(l, first, count)) in part.iter().enumerate() {
                        let blocks = &self.claim.blocks()[first..first + count];
                        let header = ChunkHeader {
                            id: desc.id,
                            layer: l,
                            block_start: first as u32,
                            block_count: count as u32,
                            byte_len: (count * bb) as u64,
                            checksum: sums.as_ref().map_or(0, |s| s[i]),
                        };
                        let frame = if sums.is_some() { Frame::Chunk(header) } else { Frame::ChunkUnsummed(header) };
                        let hold: Arc<dyn Send + Sync> = Arc::clone(&self.claim) as Arc<dyn Send + Sync>;
                        let iovs = match &patterns[first / per_chunk] {
                            Some((of, pattern)) => memory.iovs_moved(pattern, *of, l),
                            None => {
                                let iovs = memory.iovs(l, blocks);
                                patterns[first / per_chunk] = Some((l, iovs.clone()));
                                iovs
                            }
                        };
                        let mut payload = Payload::new(iovs, hold);
                        if granted {
                            // The receiver granted this transfer: the link writes its blocks itself.
                            let written = tickets.as_ref().map(|t| t[p * step + i]);
                            let dest = crate::transport::Dest { layer: l, blocks: desc.dst_blocks[first..first + count].to_vec(), written };
                            payload = payload.with_dest(dest);
                        }
                        batch.push((frame.encode(), payload));
                        if delay.is_none() && i + 1 < part.len() {
                            continue;
                        }
                        if *cancel.borrow() {
                            return Err(cancelled);
                        }
                        match done_rx.try_recv() {
                            Err(oneshot::error::TryRecvError::Empty) => {}
                            Ok(verdict) => return Err(early(desc.id, Ok(verdict))),
                            Err(oneshot::error::TryRecvError::Closed) => return Err(Error::Shutdown),
                        }
                        if let Some(delay) = delay {
                            tokio::select! {
                                _ = tokio::time::sleep(delay) => {}
                                _ = cancel.wait_for(|c| *c) => return Err(cancelled),
                            }
                        }
                        crate::transport::kv_trace!("tx {:x} {} messages handed to the link", desc.id, batch.len());
                        link.send_batch(std::mem::take(&mut batch)).await?;
                        crate::transport::kv_trace!("tx {:x} sent through layer {l} block {first}", desc.id);
                        if !first_sent {
                            first_sent = true;
                            tracing::debug!(id = desc.id, peer = link.peer(), "KV transfer: first chunk sent");
                        }
                    }
                    if later {
                        unsummed.extend_from_slice(part);
                        if unsummed.len() >= MAX_UNSUMMED {
                            send_sums(&core, &link, desc.id, &mut unsummed, self.claim.blocks()).await?;
                        }
                    }
                }
                // The announced chunks are summed (one device call) when no further layer is ready
                // to announce — so a sender with many layers ready announces them all first — or
                // when MAX_UNSUMMED wait for their checksums (above).
                if *self.pushed.borrow() <= end || end == num_layers {
                    send_sums(&core, &link, desc.id, &mut unsummed, self.claim.blocks()).await?;
                }
                let sent: u64 = chunks.iter().map(|&(_, _, count)| (count * bb) as u64).sum();
                self.progress.send_modify(|p| {
                    p.bytes += sent;
                    p.layers = end;
                });
                layer = end;
                group = (group * 2).min(MAX_GROUP_LAYERS);
            }
        }
        tokio::select! {
            verdict = done_rx => match verdict {
                Ok(verdict) => verdict,
                Err(_) => Err(Error::LinkFailed { peer: link.peer().to_string(), reason: "connector shut down".into() }),
            },
            _ = cancel.wait_for(|c| *c) => Err(cancelled),
        }
    }
}

/// Sums the chunks a sender announced unsummed (one device call) and sends their checksums, in order.
async fn send_sums(core: &Core, link: &Arc<dyn Link>, id: u64, chunks: &mut Vec<(u32, usize, usize)>, blocks: &[u32]) -> Result<()> {
    if chunks.is_empty() {
        return Ok(());
    }
    let sums = core.chunk_checksums(chunks, blocks)?;
    crate::transport::kv_trace!("tx {id:x} {} chunks from layer {} checksummed", chunks.len(), chunks[0].0);
    for sums in sums.chunks(frame::MAX_SUMS) {
        link.send(Frame::Sums { id, sums: sums.to_vec() }.encode(), Payload::empty()).await?;
    }
    chunks.clear();
    Ok(())
}

/// The receiver answered before we finished sending: that is always a failure.
fn early(id: u64, verdict: std::result::Result<Result<()>, oneshot::error::RecvError>) -> Error {
    match verdict {
        Ok(Err(e)) => e,
        Ok(Ok(())) => Error::Integrity { id, reason: "receiver reported completion before every chunk was sent".into() },
        Err(_) => Error::Shutdown,
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    //! The receiver with several chunks of one transfer landing at once (what a pipelining transport
    //! such as cuda-ipc does), driven frame by frame through the inbox.

    use super::*;
    use crate::geometry::{DType, Geometry, GeometrySpec, Layout};
    use crate::transport::BoxFuture;

    /// A link that records the frames the receiver sends back.
    struct Recorder {
        frames: Mutex<Vec<Frame>>,
    }

    impl Link for Recorder {
        fn id(&self) -> u64 {
            7
        }
        fn peer(&self) -> &str {
            "recorder"
        }
        fn send(&self, header: Vec<u8>, _payload: Payload) -> BoxFuture<'_, Result<()>> {
            lock(&self.frames).push(Frame::decode(&header).expect("the receiver sends valid frames"));
            Box::pin(async { Ok(()) })
        }
        fn close(&self) {}
    }

    const LAYERS: u32 = 3;

    fn geometry() -> Geometry {
        Geometry::new(GeometrySpec {
            model_id: "pipelined".into(),
            dtype: DType::BF16,
            block_size: 4,
            num_layers: LAYERS,
            num_kv_heads: 1,
            head_dim: 8,
            layout: Layout::KvHeadTokenDim,
        })
        .expect("valid geometry")
    }

    /// A receiver core with one handshaken link and an expected transfer of `blocks` (binding 5),
    /// not started.
    fn expecting(blocks: &[u32]) -> (Arc<Core>, Arc<dyn Link>, Arc<Recorder>, RecvHandle) {
        let memory = KvMemory::host(geometry(), 16).expect("pool");
        let core = Core::new(memory, ConnectorConfig::default(), Handle::current()).expect("core");
        let recorder = Arc::new(Recorder { frames: Mutex::new(Vec::new()) });
        let link: Arc<dyn Link> = Arc::clone(&recorder) as Arc<dyn Link>;
        let hello = Frame::Hello { version: PROTOCOL_VERSION, geometry: geometry() };
        assert!(matches!(core.on_message(&link, &hello.encode(), 0), Delivery::Discard));
        let recv = core.expect(blocks.to_vec(), 5, Duration::from_secs(30)).expect("expect");
        (core, link, recorder, recv)
    }

    /// A receiver core with one linked, started transfer of `blocks` (one chunk per layer).
    async fn started(blocks: Vec<u32>) -> (Arc<Core>, Arc<dyn Link>, Arc<Recorder>, RecvHandle) {
        let (core, link, recorder, recv) = expecting(&blocks);
        let id = recv.descriptor().id;
        let start = Frame::Start { id, num_blocks: blocks.len() as u32, blocks_hash: frame::blocks_hash(&blocks), binding: 5 };
        assert!(matches!(core.on_message(&link, &start.encode(), 0), Delivery::Discard));
        (core, link, recorder, recv)
    }

    fn chunk(core: &Core, link: &Arc<dyn Link>, id: u64, layer: u32, n: u32, checksum: u64) -> u64 {
        announce(core, link, id, layer, n, Some(checksum))
    }

    /// A chunk announced with its checksum, or (`None`) unsummed, its checksum in a later `Sums`.
    fn announce(core: &Core, link: &Arc<dyn Link>, id: u64, layer: u32, n: u32, checksum: Option<u64>) -> u64 {
        let bb = geometry().block_bytes() as u64;
        let h = ChunkHeader { id, layer, block_start: 0, block_count: n, byte_len: u64::from(n) * bb, checksum: checksum.unwrap_or(0) };
        let frame = if checksum.is_some() { Frame::Chunk(h) } else { Frame::ChunkUnsummed(h) };
        match core.on_message(link, &frame.encode(), h.byte_len) {
            Delivery::Into { iovs, token } => {
                assert_eq!(iovs.iter().map(|i| i.len as u64).sum::<u64>(), h.byte_len);
                token
            }
            other => panic!("chunk of layer {layer} not taken: {other:?}"),
        }
    }

    fn landed(sum: u64) -> std::result::Result<Landed, String> {
        Ok(Landed { checksum: Some(sum) })
    }

    /// The reason of the integrity failure the transfer ended with.
    fn integrity_failure(recv: &RecvHandle) -> String {
        match recv.progress().state {
            TransferState::Failed(Error::Integrity { reason, .. }) => reason,
            other => panic!("expected an integrity failure, got {other:?}"),
        }
    }

    /// Asserts the transfer completed, freed its blocks, and answered `Done`.
    async fn assert_completed(core: &Core, recorder: &Recorder, recv: &RecvHandle) {
        assert!(matches!(recv.progress().state, TransferState::Complete(_)));
        assert_eq!(recv.progress().layers, LAYERS);
        assert_eq!(core.memory().claimed_blocks(), 0);
        tokio::task::yield_now().await;
        assert!(lock(&recorder.frames).contains(&Frame::Done { id: recv.descriptor().id }));
    }

    #[tokio::test]
    async fn chunks_of_every_layer_land_at_once_and_complete_in_order() {
        let (core, link, recorder, recv) = started(vec![3, 1, 4]).await;
        let id = recv.descriptor().id;
        let tokens: Vec<u64> = (0..LAYERS).map(|l| chunk(&core, &link, id, l, 3, 100 + u64::from(l))).collect();
        assert_eq!(recv.progress().layers, 0, "nothing landed before any payload was reported");
        core.on_payload(&link, tokens[0], landed(100));
        assert_eq!(recv.progress().layers, 1);
        assert_eq!(core.memory().claimed_blocks(), 3, "the claim stays while payloads land");
        core.on_payload(&link, tokens[1], landed(101));
        core.on_payload(&link, tokens[2], landed(102));
        assert_completed(&core, &recorder, &recv).await;
    }

    #[tokio::test]
    async fn a_bad_chunk_fails_the_transfer_only_after_every_chunk_in_flight_reported() {
        let (core, link, recorder, recv) = started(vec![0, 2]).await;
        let id = recv.descriptor().id;
        let tokens: Vec<u64> = (0..LAYERS).map(|l| chunk(&core, &link, id, l, 2, 7)).collect();
        core.on_payload(&link, tokens[0], landed(8)); // wrong checksum
        // Two payloads are still being written into the blocks: they stay claimed, the verdict waits.
        assert_eq!(core.memory().claimed_blocks(), 2);
        assert!(matches!(recv.progress().state, TransferState::Pending));
        core.on_payload(&link, tokens[1], landed(7));
        assert_eq!(core.memory().claimed_blocks(), 2);
        core.on_payload(&link, tokens[2], Err("copy failed".into()));
        let reason = integrity_failure(&recv);
        assert!(reason.contains("checksum mismatch in layer 0"), "{reason}");
        assert_eq!(recv.progress().layers, 0, "no layer after the bad one counts as landed");
        assert_eq!(core.memory().claimed_blocks(), 0);
        tokio::task::yield_now().await;
        assert!(lock(&recorder.frames).iter().any(|f| matches!(f, Frame::Abort { id: i, code: AbortCode::Integrity, .. } if *i == id)));
    }

    fn sums(core: &Core, link: &Arc<dyn Link>, id: u64, sums: &[u64]) {
        let frame = Frame::Sums { id, sums: sums.to_vec() };
        assert!(matches!(core.on_message(link, &frame.encode(), 0), Delivery::Discard));
    }

    #[tokio::test]
    async fn chunks_announced_unsummed_settle_when_their_checksums_come() {
        let (core, link, recorder, recv) = started(vec![3, 1]).await;
        let id = recv.descriptor().id;
        let t0 = announce(&core, &link, id, 0, 2, None);
        let t1 = announce(&core, &link, id, 1, 2, None);
        core.on_payload(&link, t0, landed(50));
        assert_eq!(recv.progress().layers, 0, "a landed chunk waits for its sender's checksum");
        sums(&core, &link, id, &[50]);
        assert_eq!(recv.progress().layers, 1);
        // A checksum may also come before its chunk landed, and the last layer arrives summed.
        sums(&core, &link, id, &[51]);
        let t2 = announce(&core, &link, id, 2, 2, Some(52));
        core.on_payload(&link, t1, landed(51));
        assert_eq!(recv.progress().layers, 2);
        core.on_payload(&link, t2, landed(52));
        assert_completed(&core, &recorder, &recv).await;
    }

    #[tokio::test]
    async fn a_late_checksum_that_disagrees_fails_the_transfer_and_frees_its_blocks() {
        let (core, link, recorder, recv) = started(vec![2, 6]).await;
        let id = recv.descriptor().id;
        let t0 = announce(&core, &link, id, 0, 2, None);
        let t1 = announce(&core, &link, id, 1, 2, None);
        core.on_payload(&link, t0, landed(9));
        core.on_payload(&link, t1, landed(10));
        assert_eq!(core.memory().claimed_blocks(), 2, "landed chunks keep the claim until checked");
        sums(&core, &link, id, &[9, 11]);
        let reason = integrity_failure(&recv);
        assert!(reason.contains("checksum mismatch in layer 1"), "{reason}");
        assert_eq!(recv.progress().layers, 1);
        assert_eq!(core.memory().claimed_blocks(), 0, "nothing is landing any more: the blocks are free at once");
        tokio::task::yield_now().await;
        assert!(lock(&recorder.frames).iter().any(|f| matches!(f, Frame::Abort { id: i, code: AbortCode::Integrity, .. } if *i == id)));
    }

    #[tokio::test]
    async fn checksums_for_chunks_never_announced_are_refused() {
        let (core, link, _recorder, recv) = started(vec![4]).await;
        let id = recv.descriptor().id;
        let t0 = announce(&core, &link, id, 0, 1, None);
        sums(&core, &link, id, &[1, 2]);
        // The chunk still landing keeps its block until reported; then the transfer has failed.
        assert!(matches!(recv.progress().state, TransferState::Pending));
        core.on_payload(&link, t0, landed(1));
        let reason = integrity_failure(&recv);
        assert!(reason.contains("never announced"), "{reason}");
        assert_eq!(core.memory().claimed_blocks(), 0);
    }

    #[tokio::test]
    async fn a_sender_that_gives_up_before_its_first_chunk_ends_the_transfer() {
        // Senders send `Start` with their first chunks: an abort may come first.
        let (core, link, _recorder, recv) = expecting(&[1, 2]);
        let id = recv.descriptor().id;
        assert_eq!(core.memory().claimed_blocks(), 2);
        let abort = Frame::Abort { id, code: AbortCode::Cancelled, reason: "cancelled".into() };
        assert!(matches!(core.on_message(&link, &abort.encode(), 0), Delivery::Discard));
        assert!(matches!(recv.progress().state, TransferState::Failed(Error::Cancelled { by: "sender", .. })));
        assert_eq!(core.memory().claimed_blocks(), 0);
    }

    #[tokio::test]
    async fn out_of_order_announcements_are_refused_while_chunks_land() {
        let (core, link, _recorder, recv) = started(vec![5]).await;
        let id = recv.descriptor().id;
        let first = chunk(&core, &link, id, 0, 1, 1);
        // Layer 2 before layer 1: refused although layer 0 is still landing; the transfer fails when
        // layer 0's payload is reported.
        let bb = geometry().block_bytes() as u64;
        let h = ChunkHeader { id, layer: 2, block_start: 0, block_count: 1, byte_len: bb, checksum: 1 };
        assert!(matches!(core.on_message(&link, &Frame::Chunk(h).encode(), bb), Delivery::Discard));
        assert_eq!(core.memory().claimed_blocks(), 1);
        core.on_payload(&link, first, landed(1));
        assert!(matches!(recv.progress().state, TransferState::Failed(Error::Integrity { .. })));
        assert_eq!(core.memory().claimed_blocks(), 0);
    }

    // ------------------------------------------------------------ direct-writing links (protocol 4)

    /// A link whose sender writes the receiver's blocks itself: records frames, counts drains, and
    /// quiesces only when the test says so.
    struct Direct {
        id: u64,
        frames: Mutex<Vec<Frame>>,
        closed: AtomicBool,
        drains: AtomicUsize,
        quiet: tokio::sync::Semaphore,
    }

    impl Direct {
        fn new(id: u64) -> Arc<Direct> {
            Arc::new(Direct { id, frames: Mutex::new(Vec::new()), closed: AtomicBool::new(false), drains: AtomicUsize::new(0), quiet: tokio::sync::Semaphore::new(0) })
        }
        /// Waits (bounded) until `pred` holds for the frames sent so far (replies go out from tasks).
        async fn sent(&self, pred: impl Fn(&[Frame]) -> bool) {
            for _ in 0..2000 {
                if pred(&lock(&self.frames)) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            panic!("never sent; frames: {:?}", lock(&self.frames));
        }
    }

    impl Link for Direct {
        fn id(&self) -> u64 {
            self.id
        }
        fn peer(&self) -> &str {
            "direct"
        }
        fn send(&self, header: Vec<u8>, _payload: Payload) -> BoxFuture<'_, Result<()>> {
            lock(&self.frames).push(Frame::decode(&header).expect("valid frames"));
            Box::pin(async { Ok(()) })
        }
        fn close(&self) {
            self.closed.store(true, Ordering::Release);
        }
        fn writes_directly(&self) -> bool {
            true
        }
        fn drain(&self) -> BoxFuture<'_, Result<()>> {
            self.drains.fetch_add(1, Ordering::AcqRel);
            Box::pin(async { Ok(()) })
        }
        fn quiesce(&self) -> BoxFuture<'_, ()> {
            Box::pin(async {
                let _ = self.quiet.acquire().await;
            })
        }
    }

    /// Waits (bounded, ~1 s) until `done` holds; the caller asserts what it needs afterwards.
    async fn eventually(done: impl Fn() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn receiver(config: ConnectorConfig) -> Arc<Core> {
        Core::new(KvMemory::host(geometry(), 16).expect("pool"), config, Handle::current()).expect("core")
    }

    fn handshake(core: &Core, link: &Arc<dyn Link>) {
        let hello = Frame::Hello { version: PROTOCOL_VERSION, geometry: geometry() };
        assert!(matches!(core.on_message(link, &hello.encode(), 0), Delivery::Discard));
    }

    fn granted(frames: &[Frame], id: u64) -> bool {
        frames.iter().any(|f| matches!(f, Frame::Grant { id: g, .. } if *g == id))
    }

    #[tokio::test]
    async fn direct_writing_links_are_granted_every_expected_transfer() {
        let core = receiver(ConnectorConfig::default());
        let early = core.expect(vec![1], 5, Duration::from_secs(30)).expect("expect");
        let direct = Direct::new(3);
        let link: Arc<dyn Link> = Arc::clone(&direct) as Arc<dyn Link>;
        handshake(&core, &link);
        // A transfer expected before the link came is granted at its handshake ...
        let id = early.descriptor().id;
        direct.sent(|f| granted(f, id)).await;
        // ... one expected after it, at once.
        let late = core.expect(vec![2], 5, Duration::from_secs(30)).expect("expect");
        let id = late.descriptor().id;
        direct.sent(|f| granted(f, id)).await;
        // A link that does not write directly is granted nothing.
        let (core, _link, recorder, recv) = expecting(&[1]);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!granted(&lock(&recorder.frames), recv.descriptor().id));
        drop(core);
    }

    #[tokio::test]
    async fn an_older_sender_is_answered_in_its_version_and_granted_nothing() {
        let core = receiver(ConnectorConfig::default());
        let recv = core.expect(vec![1], 5, Duration::from_secs(30)).expect("expect");
        let id = recv.descriptor().id;
        // A protocol 3 sender on a link that could write directly: it speaks 3, so no grants.
        let old = Direct::new(3);
        let link: Arc<dyn Link> = Arc::clone(&old) as Arc<dyn Link>;
        let hello = Frame::Hello { version: 3, geometry: geometry() };
        assert!(matches!(core.on_message(&link, &hello.encode(), 0), Delivery::Discard));
        old.sent(|f| f.contains(&Frame::HelloAck { version: 3 })).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!granted(&lock(&old.frames), id), "a protocol 3 link was granted a transfer");
        // Versions outside what this build speaks are refused.
        for version in [MIN_PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1] {
            let l = Direct::new(10 + u64::from(version));
            let link: Arc<dyn Link> = Arc::clone(&l) as Arc<dyn Link>;
            let hello = Frame::Hello { version, geometry: geometry() };
            assert!(matches!(core.on_message(&link, &hello.encode(), 0), Delivery::Discard));
            l.sent(|f| f.iter().any(|f| matches!(f, Frame::HelloReject { reason } if reason.contains("protocol version")))).await;
        }
    }

    #[tokio::test]
    async fn a_sender_accepts_an_answer_in_any_version_it_speaks() {
        for (version, ok) in [(MIN_PROTOCOL_VERSION, true), (PROTOCOL_VERSION, true), (MIN_PROTOCOL_VERSION - 1, false), (PROTOCOL_VERSION + 1, false)] {
            let d = Direct::new(3);
            let link: Arc<dyn Link> = Arc::clone(&d) as Arc<dyn Link>;
            let core = sender_with(&link);
            let out = lock(&core.tx).links.get(&3).cloned().expect("linked");
            let (tx, rx) = oneshot::channel();
            *lock(&out.hello) = Some(tx);
            assert!(matches!(core.on_message(&link, &Frame::HelloAck { version }.encode(), 0), Delivery::Discard));
            assert_eq!(rx.await.expect("a verdict").is_ok(), ok, "version {version}");
        }
    }

    #[tokio::test]
    async fn a_failed_transfer_keeps_its_blocks_until_every_granted_sender_stopped() {
        let core = receiver(ConnectorConfig::default());
        let (a, b) = (Direct::new(3), Direct::new(4));
        let (la, lb): (Arc<dyn Link>, Arc<dyn Link>) = (Arc::clone(&a) as Arc<dyn Link>, Arc::clone(&b) as Arc<dyn Link>);
        handshake(&core, &la);
        handshake(&core, &lb);
        let recv = core.expect(vec![1, 2], 5, Duration::from_secs(30)).expect("expect");
        let id = recv.descriptor().id;
        // Granted to both links (a transport posting their writes itself checks against these).
        assert_eq!(core.granted_blocks(&la, id), Some(vec![1, 2]));
        assert_eq!(core.granted_blocks(&lb, id), Some(vec![1, 2]));
        assert_eq!(core.granted_blocks(&la, id ^ 1), None);
        core.rx_cancel(id);
        // Both links are fenced; the blocks stay claimed and the handle shows no verdict.
        a.sent(|f| f.contains(&Frame::Fence { id })).await;
        b.sent(|f| f.contains(&Frame::Fence { id })).await;
        assert!(!recv.progress().is_terminal());
        assert_eq!(core.memory().claimed_blocks(), 2);
        // Writes a sender made before the fence reached it still find the blocks granted.
        assert_eq!(core.granted_blocks(&la, id), Some(vec![1, 2]));
        // A `Stopped` from a link never fenced changes nothing; from one fenced, that one is done.
        let other = Direct::new(9);
        let lo: Arc<dyn Link> = Arc::clone(&other) as Arc<dyn Link>;
        handshake(&core, &lo);
        // A link made after the transfer failed was never granted it.
        assert_eq!(core.granted_blocks(&lo, id), None);
        assert!(matches!(core.on_message(&lo, &Frame::Stopped { id }.encode(), 0), Delivery::Discard));
        assert!(matches!(core.on_message(&la, &Frame::Stopped { id }.encode(), 0), Delivery::Discard));
        assert!(!recv.progress().is_terminal());
        assert_eq!(core.memory().claimed_blocks(), 2);
        assert!(matches!(core.on_message(&lb, &Frame::Stopped { id }.encode(), 0), Delivery::Discard));
        assert!(matches!(recv.progress().state, TransferState::Failed(Error::Cancelled { by: "receiver", .. })));
        assert_eq!(core.memory().claimed_blocks(), 0);
        // Released: nothing is granted any more.
        assert_eq!(core.granted_blocks(&la, id), None);
    }

    #[tokio::test]
    async fn a_fenced_link_that_goes_away_is_waited_for_through_its_quiesce() {
        let core = receiver(ConnectorConfig::default());
        let a = Direct::new(3);
        let la: Arc<dyn Link> = Arc::clone(&a) as Arc<dyn Link>;
        handshake(&core, &la);
        let recv = core.expect(vec![1], 5, Duration::from_secs(30)).expect("expect");
        let id = recv.descriptor().id;
        let start = Frame::Start { id, num_blocks: 1, blocks_hash: frame::blocks_hash(&[1]), binding: 5 };
        assert!(matches!(core.on_message(&la, &start.encode(), 0), Delivery::Discard));
        // The link dies mid-transfer: the transfer fails, but its block stays claimed while the
        // dead peer's writes may still land.
        core.on_link_closed(&la, "peer died".into());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!recv.progress().is_terminal());
        assert_eq!(core.memory().claimed_blocks(), 1);
        a.quiet.add_permits(1);
        eventually(|| recv.progress().is_terminal()).await;
        assert!(matches!(recv.progress().state, TransferState::Failed(Error::LinkFailed { .. })));
        assert_eq!(core.memory().claimed_blocks(), 0);
    }

    #[tokio::test]
    async fn an_unanswered_fence_closes_the_link_and_waits_for_its_quiesce() {
        let core = receiver(ConnectorConfig { fence_wait: Duration::from_millis(30), ..ConnectorConfig::default() });
        let a = Direct::new(3);
        let la: Arc<dyn Link> = Arc::clone(&a) as Arc<dyn Link>;
        handshake(&core, &la);
        let recv = core.expect(vec![1], 5, Duration::from_secs(30)).expect("expect");
        let id = recv.descriptor().id;
        core.rx_cancel(id);
        eventually(|| a.closed.load(Ordering::Acquire)).await;
        assert!(a.closed.load(Ordering::Acquire), "the silent link was not closed");
        assert!(!recv.progress().is_terminal());
        a.quiet.add_permits(1);
        eventually(|| recv.progress().is_terminal()).await;
        assert!(recv.progress().is_terminal());
        assert_eq!(core.memory().claimed_blocks(), 0);
    }

    #[tokio::test]
    async fn shutdown_does_not_wait_for_fences() {
        let core = receiver(ConnectorConfig::default());
        let a = Direct::new(3);
        let la: Arc<dyn Link> = Arc::clone(&a) as Arc<dyn Link>;
        handshake(&core, &la);
        let recv = core.expect(vec![1], 5, Duration::from_secs(30)).expect("expect");
        core.rx_cancel(recv.descriptor().id);
        assert!(!recv.progress().is_terminal());
        core.shutdown();
        assert!(recv.progress().is_terminal());
        assert_eq!(core.memory().claimed_blocks(), 0);
    }

    /// A sender core with one handshaken outgoing link `link`.
    fn sender_with(link: &Arc<dyn Link>) -> Arc<Core> {
        let core = receiver(ConnectorConfig::default());
        let out = Arc::new(OutLink { link: Arc::clone(link), hello: Mutex::new(None), dead: AtomicBool::new(false), last_active: Mutex::new(Instant::now()) });
        lock(&core.tx).links.insert(link.id(), out);
        core
    }

    #[tokio::test]
    async fn a_sender_answers_a_fence_after_its_task_ended_and_its_writes_drained() {
        let d = Direct::new(3);
        let link: Arc<dyn Link> = Arc::clone(&d) as Arc<dyn Link>;
        let core = sender_with(&link);
        let id = 77;
        // A task of this transfer is running on the link.
        let (done_tx, done_rx) = oneshot::channel();
        {
            let mut tx = lock(&core.tx);
            tx.pending.insert((3, id), done_tx);
            tx.active.insert((3, id));
        }
        let grant = Frame::Grant { id, blocks_hash: frame::blocks_hash(&[1]), binding: 5 };
        assert!(matches!(core.on_message(&link, &grant.encode(), 0), Delivery::Discard));
        assert!(lock(&core.tx).grants.contains_key(&(3, id)));
        assert!(matches!(core.on_message(&link, &Frame::Fence { id }.encode(), 0), Delivery::Discard));
        // The task hears the verdict; the grant is gone and a late one grants nothing.
        assert!(matches!(done_rx.await, Ok(Err(Error::Rejected { .. }))));
        assert!(!lock(&core.tx).grants.contains_key(&(3, id)));
        assert!(matches!(core.on_message(&link, &grant.encode(), 0), Delivery::Discard));
        assert!(!lock(&core.tx).grants.contains_key(&(3, id)));
        // No `Stopped` while the task runs; one, after a drain, once it ended.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!lock(&d.frames).contains(&Frame::Stopped { id }));
        lock(&core.tx).active.remove(&(3, id));
        core.job_ended.notify_waiters();
        d.sent(|f| f.contains(&Frame::Stopped { id })).await;
        assert!(d.drains.load(Ordering::Acquire) >= 1);
        assert!(lock(&core.tx).fenced.contains(&(3, id)), "a fenced transfer is remembered, so it never starts later");
    }
}
