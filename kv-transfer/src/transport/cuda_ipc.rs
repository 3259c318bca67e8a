//! The CUDA IPC backend (same host): the sender writes each chunk straight into the receiver's device
//! pool, no host memory and no socket on the data path. A Unix socket carries the control messages:
//! at connect the receiver exports its pool (one `cuIpcGetMemHandle` of the allocation holding every
//! layer) and the sender opens it once per link (`cuIpcOpenMemHandle`; a receiver in the same
//! process is used through its own addresses, which CUDA requires). Per chunk: the sender announces
//! the frame, the receiver's inbox names the destination blocks, the receiver answers with their
//! ids, the sender runs the copy kernel from its blocks into the mapped ones on its transfer stream,
//! waits for it, and reports the payload written. The connector core then verifies the chunk's
//! checksum on the receiver's GPU before anything is reported.
//!
//! Endpoint: `cuda-ipc://HOSTKEY/path/to/socket`, where HOSTKEY identifies this host's boot; a
//! sender on another host refuses the endpoint at connect (never a silent fall-back).
//!
//! Invariants (besides those of every transport):
//! - Payloads only flow from the side that connected (the sender) to the side that accepted.
//! - A peer's mapping lives exactly as long as the link (closed with it); a link never writes into a
//!   peer pool whose layout it did not check against its own geometry at connect.
//! - Every `Delivery::Into` is answered by one `on_payload`, also when the link closes between the
//!   destination's announcement and the copy's report; in that case only after a grace period
//!   (a live sender's one-kernel copy has ended by then), so the blocks are not reused under a copy.
//! - An accepted connection must complete its handshake within 5 s; each control message is at most
//!   64 KiB.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::core::lock;
use crate::device::{Blocks, DeviceKv};
use crate::error::{Error, Result};
use crate::memory::KvMemory;
use crate::transport::link_state::{Closed, LinkState};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Link, Payload, Transport};

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
/// How long a receiver keeps a chunk's blocks claimed after its link closed mid-copy.
const WRITE_GRACE: Duration = Duration::from_millis(250);
const MAX_MESSAGE: usize = 64 * 1024;
const VERSION: u16 = 1;

const K_HELLO: u8 = 1;
const K_POOL: u8 = 2;
const K_REFUSE: u8 = 3;
const K_MSG: u8 = 4;
const K_WRITE_TO: u8 = 5;
const K_WRITTEN: u8 = 6;

/// This host's identity (its boot), so an endpoint names the host it lives on.
fn host_key() -> u64 {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let id = format!("{}|{}", read("/proc/sys/kernel/hostname").trim(), read("/proc/sys/kernel/random/boot_id").trim());
    twox_hash::XxHash3_64::oneshot(id.as_bytes())
}



/// A peer pool opened for writing: where each layer's blocks start in this process's address space.
struct PeerPool {
    _mapping: Option<tandem_kernels::cuda::IpcMapping>,
    layer_bases: Vec<u64>,
    num_blocks: u32,
    block_bytes: u64,
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
    /// The exported pool, as sent to peers (`K_POOL` body).
    pool_message: Vec<u8>,
    host: u64,
    links: Mutex<HashMap<u64, Arc<IpcLink>>>,
    next_link: AtomicU64,
    accept: Mutex<Option<JoinHandle<()>>>,
    shut: AtomicBool,
    corrupt_every: Option<u64>,
    copied: AtomicU64,
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
        let dir = opts.dir.clone().unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("tandem-kv-{}-{:016x}.sock", std::process::id(), getrandom::u64().unwrap_or(0)));
        let listener = UnixListener::bind(&path).map_err(|e| Error::Invalid(format!("cannot listen on {}: {e}", path.display())))?;
        // Only this user may connect: the socket hands out write access to the GPU pool.
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        }
        let endpoint = format!("cuda-ipc://{host:016x}{}", path.display());
        let transport = Arc::new_cyclic(|me| CudaIpcTransport {
            endpoint,
            path,
            memory,
            device,
            ordinal,
            inbox,
            pool_message: pool,
            host,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            accept: Mutex::new(None),
            shut: AtomicBool::new(false),
            corrupt_every: opts.corrupt_every.or_else(super::corrupt_every_from_env),
            copied: AtomicU64::new(0),
            me: me.clone(),
        });
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

    fn adopt(&self, stream: UnixStream, peer: String, pool: Option<PeerPool>) -> Arc<IpcLink> {
        let (rd, wr) = stream.into_split();
        let (state, closed_rx) = LinkState::new(peer);
        let link = Arc::new(IpcLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            writer: tokio::sync::Mutex::new(Some(wr)),
            state,
            pool,
            write_to: Mutex::new(None),
            transport: self.me.clone(),
        });
        lock(&self.links).insert(link.id, Arc::clone(&link));
        if self.shut.load(Ordering::Acquire) {
            link.close();
        }
        let reader = Reader { inbox: Arc::clone(&self.inbox), link: Arc::clone(&link), transport: self.me.clone() };
        tokio::spawn(reader.run(rd, closed_rx));
        link
    }

    /// Opens the peer's pool from its `K_POOL` message, checking its layout against ours.
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
        // A pool of another geometry is refused by the connector's handshake (with the reason); copies
        // check the layout again before writing anything.
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
        let (mapping, mapped) = if pid == std::process::id() {
            // CUDA refuses to open a handle in the process that exported it: the receiver's own
            // addresses serve, and if its pool lies on another GPU, this GPU's kernels need peer
            // access to it (another process's mapping gets it from the lazy flag of the open).
            let theirs = crate::device::device_of(self.ordinal, base).map_err(|e| e.to_string())?;
            crate::device::enable_peer_access(self.ordinal, theirs).map_err(|e| e.to_string())?;
            (None, base)
        } else {
            let m = tandem_kernels::cuda::IpcMapping::open(&self.device.context(), &handle)
                .map_err(|e| format!("opening the receiver's pool (cuIpcOpenMemHandle): {e}"))?;
            let p = m.ptr();
            (Some(m), p)
        };
        Ok(PeerPool { _mapping: mapping, layer_bases: offsets.iter().map(|o| mapped + o).collect(), num_blocks, block_bytes })
    }

    /// Copies a chunk into the peer's blocks; returns nothing (the receiver verifies).
    fn copy(&self, pool: &PeerPool, payload: &Payload, to: &WriteTo) -> Result<()> {
        let bad = |why: String| Error::Invalid(format!("cuda-ipc copy: {why}"));
        let bb = self.memory.geometry().block_bytes();
        if pool.block_bytes != bb as u64 || pool.layer_bases.len() != self.memory.geometry().num_layers() as usize {
            return Err(bad("the receiver's pool has another layout than this one".into()));
        }
        let (src_layer, src_ids) =
            self.memory.blocks_of(payload.iovs()).ok_or_else(|| bad("the payload is not whole blocks of one layer of the pool".into()))?;
        if src_ids.len() != to.ids.len() {
            return Err(bad(format!("{} source blocks, the receiver names {}", src_ids.len(), to.ids.len())));
        }
        let dst_base = *pool.layer_bases.get(to.layer as usize).ok_or_else(|| bad(format!("layer {} out of range", to.layer)))?;
        let src = Blocks { base: self.memory.layer_base(src_layer) as u64, num_blocks: self.memory.num_blocks(), ids: &src_ids };
        let dst = Blocks { base: dst_base, num_blocks: pool.num_blocks, ids: &to.ids };
        let n = self.copied.fetch_add(1, Ordering::Relaxed) + 1;
        let corrupt = self.corrupt_every.is_some_and(|k| n.is_multiple_of(k));
        self.device.copy(src, dst, bb, corrupt)?;
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
            let link: Arc<dyn Link> = self.adopt(stream, endpoint.to_string(), Some(pool));
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
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where the receiver wants a chunk: blocks `ids` of `layer`, or nowhere (`discard`).
struct WriteTo {
    discard: bool,
    layer: u32,
    ids: Vec<u32>,
}

/// One control connection.
struct IpcLink {
    id: u64,
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    state: LinkState,
    /// Sender side: the receiver's pool, mapped.
    pool: Option<PeerPool>,
    /// Sender side: the send waiting for the receiver to name the destination of its payload.
    write_to: Mutex<Option<oneshot::Sender<WriteTo>>>,
    transport: Weak<CudaIpcTransport>,
}

impl IpcLink {
    async fn write(&self, wr: &mut OwnedWriteHalf, kind: u8, body: &[u8]) -> Result<()> {
        let mut torn = self.state.torn_guard();
        write_message(wr, kind, body).await.map_err(|e| self.state.err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }

    /// One message with its payload (sender side): announce, learn the destination, copy, report.
    async fn send_message(&self, header: &[u8], payload: &Payload) -> Result<()> {
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else { return Err(self.state.err("link closed")) };
        let mut msg = payload.len().to_le_bytes().to_vec();
        msg.extend_from_slice(header);
        if payload.is_empty() {
            return self.write(wr, K_MSG, &msg).await;
        }
        let (Some(pool), Some(transport)) = (&self.pool, self.transport.upgrade()) else {
            return Err(Error::Unsupported { backend: "cuda-ipc".into(), what: "payloads from the accepting side".into() });
        };
        // Abandoning the exchange midway (the transfer's deadline drops this future) must not leave the
        // peer waiting for a report: the link fails instead.
        let mut exchange = self.state.torn_guard();
        let (tx, rx) = oneshot::channel();
        *lock(&self.write_to) = Some(tx);
        self.write(wr, K_MSG, &msg).await?;
        let to = rx.await.map_err(|_| self.state.err("link closed before the receiver named the destination"))?;
        if to.discard {
            exchange.disarm();
            return Ok(());
        }
        let copied = transport.copy(pool, payload, &to);
        let mut report = vec![u8::from(copied.is_ok())];
        if let Err(e) = &copied {
            report.extend_from_slice(e.to_string().as_bytes());
            report.truncate(1024);
        }
        self.write(wr, K_WRITTEN, &report).await?;
        exchange.disarm();
        copied
    }

    /// A control message from the receiving side (destination names).
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
        Box::pin(self.state.guarded(async move { self.send_message(&header, &payload).await }))
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

impl Reader {
    async fn run(self, mut rd: OwnedReadHalf, mut closed: watch::Receiver<Closed>) {
        let dyn_link: Arc<dyn Link> = Arc::clone(&self.link) as Arc<dyn Link>;
        let mut pending: Option<u64> = None;
        let natural = loop {
            let msg = tokio::select! {
                m = read_message(&mut rd) => m,
                _ = closed.wait_for(|c| *c != Closed::Open) => break "link closed".to_string(),
            };
            let (kind, body) = match msg {
                Ok(m) => m,
                Err(e) => break e.to_string(),
            };
            if let Err(reason) = self.one(kind, &body, &dyn_link, &mut pending).await {
                break reason;
            }
        };
        if let Some(token) = pending.take() {
            // The sender writes into our blocks itself: if it is alive it may be mid-copy. Its copy of
            // one chunk (one kernel, at most MAX_CHUNK_BLOCKS blocks) ends within milliseconds, so the
            // blocks stay claimed for a grace period before they can be reused.
            tokio::time::sleep(WRITE_GRACE).await;
            self.inbox.on_payload(&dyn_link, token, Err(format!("link closed before the payload was written: {natural}")));
        }
        self.link.state.fail(natural);
        let how = closed.borrow().clone();
        lock(&self.link.write_to).take();
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

    async fn one(&self, kind: u8, body: &[u8], link: &Arc<dyn Link>, pending: &mut Option<u64>) -> std::result::Result<(), String> {
        let sender_side = self.link.pool.is_some();
        match kind {
            K_MSG => {
                let mut r = Cursor { buf: body };
                let payload_len = r.u64()?;
                if pending.is_some() {
                    return Err("a message while a payload is being written".into());
                }
                if payload_len > 0 && sender_side {
                    return Err("payload from the accepting side".into());
                }
                match self.inbox.on_message(link, r.buf, payload_len) {
                    Delivery::CloseLink(reason) => Err(reason),
                    Delivery::Discard if payload_len > 0 => {
                        self.link.reply(K_WRITE_TO, &[0]).await.map_err(|e| e.to_string())
                    }
                    Delivery::Discard => Ok(()),
                    Delivery::Into { iovs, token } => {
                        let total: u64 = iovs.iter().map(|i| i.len as u64).sum();
                        let located = self.transport.upgrade().and_then(|t| t.memory.blocks_of(&iovs));
                        let Some((layer, ids)) = located.filter(|_| total == payload_len) else {
                            self.inbox.on_payload(link, token, Err("the destination is not whole blocks of one layer".into()));
                            return Err("unusable destination".into());
                        };
                        let mut out = vec![1u8];
                        out.extend_from_slice(&layer.to_le_bytes());
                        out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
                        for id in &ids {
                            out.extend_from_slice(&id.to_le_bytes());
                        }
                        *pending = Some(token);
                        self.link.reply(K_WRITE_TO, &out).await.map_err(|e| e.to_string())
                    }
                }
            }
            K_WRITE_TO if sender_side => {
                let mut r = Cursor { buf: body };
                let to = if r.u8()? == 0 {
                    WriteTo { discard: true, layer: 0, ids: Vec::new() }
                } else {
                    let (layer, n) = (r.u32()?, r.u32()?);
                    if n as usize > crate::MAX_CHUNK_BLOCKS as usize {
                        return Err(format!("{n} destination blocks exceed a chunk"));
                    }
                    let ids = (0..n).map(|_| r.u32()).collect::<std::result::Result<Vec<_>, _>>()?;
                    WriteTo { discard: false, layer, ids }
                };
                match lock(&self.link.write_to).take() {
                    Some(tx) => {
                        let _ = tx.send(to);
                        Ok(())
                    }
                    None => Err("a destination nobody asked for".into()),
                }
            }
            K_WRITTEN if !sender_side => {
                let token = pending.take().ok_or("a payload report without a payload")?;
                let result = match body.first() {
                    Some(1) => Ok(()),
                    _ => Err(format!("the sender could not write the payload: {}", String::from_utf8_lossy(body.get(1..).unwrap_or(&[])))),
                };
                self.inbox.on_payload(link, token, result);
                Ok(())
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
