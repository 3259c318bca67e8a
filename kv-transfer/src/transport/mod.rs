//! The plug point under the connector: a [`Transport`] moves *messages* (a frame header plus an optional
//! payload gathered from / scattered into block memory) over [`Link`]s, and hands incoming ones to an
//! [`Inbox`]. Handshake, checksums, ordering, timeouts and cancellation live above it, in the connector,
//! written once for every backend. The C ABI in `include/tandem_kv.h` is this same contract for shared
//! libraries ([`plugin`]).
//!
//! Invariants every transport keeps:
//! - A link delivers messages whole, in the order their `send` futures completed, never interleaved.
//! - The payload of a delivered message is written only into the iovecs the inbox returned, and
//!   `Inbox::on_payload` is called exactly once for every `Delivery::Into` (success or failure).
//! - After a link fails, `Inbox::on_link_closed` is called once for it (not for links closed locally),
//!   and no callback for that link follows.
//! - A send future dropped before completion leaves the link unusable rather than half-written.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::Result;
use crate::memory::Iov;

pub mod cuda_ipc;
pub mod inproc;
mod link_state;
pub mod nccl;
pub mod plugin;
mod spin_read;
pub mod tcp;

/// The device backends' integrity test hook, `TANDEM_KV_TEST_CORRUPT_CHUNK=N`: every Nth chunk a
/// transport of this process sends gets one byte flipped in its destination after the move and
/// before the receiver's verification pass (nccl: by the sender after its copy; cuda-ipc: the
/// sender marks the chunk and the receiver flips it between its copy and its verification), which
/// must catch it (for tests that drive whole processes).
pub(crate) fn corrupt_every_from_env() -> Option<u64> {
    std::env::var("TANDEM_KV_TEST_CORRUPT_CHUNK").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0)
}

/// The senders' pacing test hook, `TANDEM_KV_TEST_CHUNK_DELAY_MS=N`: a sender of this process waits
/// N ms before each chunk it sends, so a test that drives whole processes can act on a transfer
/// while it is in flight (kill a node mid-transfer). Read once per process.
pub(crate) fn chunk_delay_from_env() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("TANDEM_KV_TEST_CHUNK_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&ms| ms > 0)
            .map(std::time::Duration::from_millis)
    })
}

/// The transfer timeline diagnostic, `TANDEM_KV_TRACE=1`: each step of a transfer (groups
/// checksummed, chunks sent, announced, pulled, landed) recorded in memory with microseconds since
/// the first step, printed by [`crate::trace_dump`] (`tandem bench kv` does at its end), for finding
/// where a transfer's time goes without the cost of printing while it runs. Read once per process.
pub(crate) fn trace(what: std::fmt::Arguments<'_>) {
    if let Some(t0) = trace_start() {
        let at = t0.elapsed().as_secs_f64() * 1e6;
        let line = format!("kv-trace {at:>10.1} us  {what}");
        crate::core::lock(trace_lines()).push(line);
    }
}

/// Whether `TANDEM_KV_TRACE` records a timeline.
pub(crate) fn tracing() -> bool {
    trace_start().is_some()
}

fn trace_start() -> Option<&'static std::time::Instant> {
    static START: std::sync::OnceLock<Option<std::time::Instant>> = std::sync::OnceLock::new();
    START.get_or_init(|| std::env::var_os("TANDEM_KV_TRACE").map(|_| std::time::Instant::now())).as_ref()
}

fn trace_lines() -> &'static std::sync::Mutex<Vec<String>> {
    static LINES: std::sync::OnceLock<std::sync::Mutex<Vec<String>>> = std::sync::OnceLock::new();
    LINES.get_or_init(std::sync::Mutex::default)
}

/// The timeline recorded under `TANDEM_KV_TRACE` so far (emptied); nothing without it.
pub fn trace_dump() -> Vec<String> {
    std::mem::take(&mut *crate::core::lock(trace_lines()))
}

/// `trace!(...)`: [`trace`] with `format!` arguments.
macro_rules! kv_trace {
    ($($arg:tt)*) => {
        $crate::transport::trace(format_args!($($arg)*))
    };
}
pub(crate) use kv_trace;

/// A boxed, sendable future (the transport traits stay object-safe without extra crates).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a transport can do; the bits equal the `TANDEM_KV_CAP_*` flags of the C header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities(pub u64);

impl Capabilities {
    /// Payloads in host memory.
    pub const HOST_MEMORY: u64 = 1 << 0;
    /// Payloads in CUDA device memory.
    pub const DEVICE_MEMORY: u64 = 1 << 1;
    /// Endpoints reachable from other hosts.
    pub const CROSS_HOST: u64 = 1 << 2;
    /// Endpoints reachable from other processes.
    pub const CROSS_PROCESS: u64 = 1 << 3;

    /// Whether every bit of `flag` is set.
    pub fn has(self, flag: u64) -> bool {
        self.0 & flag == flag
    }
}

/// A payload to send: iovecs into registered memory, plus whatever keeps that memory claimed until the
/// transport is done reading it (a transport that finishes in the background keeps the `Payload`).
pub struct Payload {
    iovs: Vec<Iov>,
    _hold: Option<Arc<dyn Send + Sync>>,
    dest: Option<Dest>,
}

/// Where a payload goes in the receiver's pool, given to a link that writes directly when the
/// receiver granted the transfer (see [`Link::writes_directly`]): the same blocks the receiver's
/// inbox will name for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dest {
    /// Layer of the receiver's pool.
    pub layer: u32,
    /// Block ids there, in the payload's order.
    pub blocks: Vec<u32>,
    /// Already written by [`Link::write_ahead`]: the ticket it gave for this payload.
    pub written: Option<u64>,
}

/// A granted transfer's layers that a link writing directly may write before their messages are
/// built ([`Link::write_ahead`]): layers `layers` of `src` (the sender's blocks) into the same
/// layers of `dst` (the receiver's), each layer cut in chunks `(first, count)` of both lists.
#[derive(Debug, Clone)]
pub struct WritePlan<'a> {
    /// The transfer.
    pub id: u64,
    /// The layers, in order.
    pub layers: std::ops::Range<u32>,
    /// Each layer's chunks: `(first, count)` positions in `src` and `dst`, in order.
    pub chunks: &'a [(usize, usize)],
    /// The sender's block ids (claimed by the transfer until the receiver acknowledged it).
    pub src: &'a [u32],
    /// The receiver's block ids it granted to the transfer.
    pub dst: &'a [u32],
}

impl Payload {
    /// No payload.
    pub fn empty() -> Payload {
        Payload { iovs: Vec::new(), _hold: None, dest: None }
    }

    /// A payload over `iovs`, kept valid by `hold`.
    pub fn new(iovs: Vec<Iov>, hold: Arc<dyn Send + Sync>) -> Payload {
        Payload { iovs, _hold: Some(hold), dest: None }
    }

    /// This payload, to be written directly into `dest` of the receiver's pool.
    pub fn with_dest(mut self, dest: Dest) -> Payload {
        self.dest = Some(dest);
        self
    }

    /// Where the receiver granted this payload to be written, if it did.
    pub fn dest(&self) -> Option<&Dest> {
        self.dest.as_ref()
    }

    /// The pieces, in order.
    pub fn iovs(&self) -> &[Iov] {
        &self.iovs
    }

    /// Total bytes.
    pub fn len(&self) -> u64 {
        self.iovs.iter().map(|i| i.len as u64).sum()
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One reliable, ordered, bidirectional message stream to a peer.
pub trait Link: Send + Sync {
    /// Unique among the links of one transport instance, never reused.
    fn id(&self) -> u64;
    /// The peer, for error messages.
    fn peer(&self) -> &str;
    /// Sends one message; resolves once the payload memory is no longer read, or once the transport
    /// keeps the [`Payload`] (and so the claim on its memory) until it is.
    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, Result<()>>;
    /// Sends several messages in order, as `send` one after another would (a transport may write
    /// them at once); resolves when the last one's `send` would.
    fn send_batch(&self, messages: Vec<(Vec<u8>, Payload)>) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            for (header, payload) in messages {
                self.send(header, payload).await?;
            }
            Ok(())
        })
    }
    /// Closes the link; idempotent. Pending and later sends fail.
    fn close(&self);
    /// Whether this link's sender writes payloads into the receiver's memory itself before it
    /// announces them (one-sided writes: a CUDA IPC copy from the sender, an RDMA write). The
    /// connector then grants each expected transfer on the link before the sender may write it, and
    /// fences a transfer that ends unsuccessfully (`Fence`, answered by `Stopped`) before its blocks
    /// are released; see docs/rfc-kv-sender-writes.md. Default: no.
    fn writes_directly(&self) -> bool {
        false
    }
    /// Sender side of a link that writes directly: writes `plan` now, ahead of its messages, and
    /// returns a ticket per chunk (layer by layer, chunks in order) for the [`Dest::written`] of
    /// its payload; `None` when it cannot now (the payloads are then written as their messages
    /// are sent). Only for blocks the receiver granted to the transfer, which the caller holds
    /// claimed. Default: `None`.
    fn write_ahead(&self, plan: WritePlan<'_>) -> Result<Option<Vec<u64>>> {
        let _ = plan;
        Ok(None)
    }
    /// Sender side of a link that writes directly: resolves once every write made so far landed.
    fn drain(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }
    /// Receiver side of a link that writes directly, once it closed: resolves once nothing its peer
    /// started can still land in this process's memory.
    fn quiesce(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Where an incoming payload goes.
#[derive(Debug)]
pub enum Delivery {
    /// Write the payload into these iovecs (their lengths sum to the payload length), then call
    /// [`Inbox::on_payload`] with `token`.
    Into {
        /// Destination pieces, in order.
        iovs: Vec<Iov>,
        /// Passed back to `on_payload`.
        token: u64,
    },
    /// Read and drop the payload (if any).
    Discard,
    /// The message is malformed or hostile: close the link.
    CloseLink(String),
}

/// How a payload landed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Landed {
    /// The checksum of the destination bytes as they are after the landing, when the transport
    /// computed it itself over the destination (a device transport that runs the receiver's
    /// verification pass behind its copy); `None` leaves that pass to the connector.
    pub checksum: Option<u64>,
}

/// The receiving end a transport reports to (implemented by the connector core).
pub trait Inbox: Send + Sync {
    /// A message arrived on `link`.
    fn on_message(&self, link: &Arc<dyn Link>, header: &[u8], payload_len: u64) -> Delivery;
    /// The payload of a `Delivery::Into` was written (`Ok`) or could not be (`Err`). Payloads of one
    /// link are reported in the order their messages were delivered; a link may have several
    /// payloads landing at once.
    fn on_payload(&self, link: &Arc<dyn Link>, token: u64, result: std::result::Result<Landed, String>);
    /// The link failed; no more callbacks for it follow.
    fn on_link_closed(&self, link: &Arc<dyn Link>, reason: String);
    /// The destination blocks of transfer `id`, if this end granted it to `link` and still holds
    /// them for it (see docs/rfc-kv-sender-writes.md): a transport that posts a sender's writes
    /// itself (nccl's runs sent ahead) checks each against them before anything lands. Default:
    /// none granted.
    fn granted_blocks(&self, _link: &Arc<dyn Link>, _id: u64) -> Option<Vec<u32>> {
        None
    }
}

/// A backend: connects to endpoints and accepts links from peers.
pub trait Transport: Send + Sync {
    /// Short backend name ("tcp", "inproc", the plugin's name).
    fn name(&self) -> &str;
    /// What the backend supports.
    fn capabilities(&self) -> Capabilities;
    /// The endpoint peers pass to `connect` to reach this instance.
    fn endpoint(&self) -> String;
    /// Opens a new link to `endpoint`; fails fast when nobody is there.
    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, Result<Arc<dyn Link>>>;
    /// Closes every link and stops accepting. No inbox callback runs after it returns.
    fn shutdown(&self);
    /// A transfer into this end was just expected: its first message may come soon, after a quiet
    /// spell, and a backend whose readers sleep between messages may have them poll again (see
    /// `spin_read::Alert`). Default: nothing.
    fn expecting(&self) {}
}
