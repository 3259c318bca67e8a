//! The conformance suite every backend must pass, written once: TCP, in-process and plugins run the same
//! cases (`kv-transfer/tests/conformance.rs`, and `tandem kv conformance SPEC` for a plugin author).
//!
//! Each case builds fresh connectors from a [`ConnectorSpec`], drives real transfers, and returns
//! `Err(description)` instead of panicking, so the CLI can report every case. Faults (corrupted,
//! truncated, duplicated, reordered, foreign chunks) are injected by wrapping the sender's transport,
//! which works for any backend without its cooperation. Every wait is bounded.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::connector::make_transport;
use crate::error::Error;
use crate::frame::Frame;
use crate::transport::{BoxFuture, Capabilities, Link, Payload, Transport};
use crate::{
    Connector, ConnectorConfig, ConnectorSpec, DType, Fabric, Geometry, GeometrySpec, Iov, KvMemory, Layout, MemoryKind,
    TransferState,
};

/// Result of one case: `Err` says what broke.
pub type CaseResult = Result<(), String>;

/// Every case, by name, in the order `run_all` runs them.
pub const CASES: &[&str] = &[
    "round_trip_bit_exact",
    "layers_land_in_order",
    "concurrent_64",
    "zero_block_transfer",
    "sender_cancel_frees_both_sides",
    "receiver_cancel_frees_both_sides",
    "receiver_disappears",
    "sender_disappears",
    "corrupted_chunk_detected",
    "truncated_chunk_detected",
    "duplicated_chunk_detected",
    "reordered_chunk_detected",
    "foreign_chunk_detected",
    "handshake_mismatch_refused",
    "unknown_destination_fails_fast",
    "unknown_transfer_rejected",
    "other_content_refused",
    "receiver_timeout_frees_blocks",
    "large_transfer_256mib",
];

/// The cases that do not run on device memory (`Suite::on_device`): the faults that rewrite a payload
/// in host memory (truncated, duplicated, reordered, foreign chunks). The checks that catch them live
/// in the backend-independent core, which the host runs exercise; a corrupted chunk is injected on
/// the device through the cuda-ipc backend's test hook instead.
pub const HOST_ONLY_CASES: &[&str] =
    &["truncated_chunk_detected", "duplicated_chunk_detected", "reordered_chunk_detected", "foreign_chunk_detected"];

/// How the suite builds connectors for one backend.
#[derive(Debug, Clone)]
pub struct Suite {
    spec: ConnectorSpec,
    fabric: Fabric,
    /// Pools in device memory of this GPU instead of host memory.
    device: Option<i32>,
    /// The receivers' pools on this GPU instead (`Suite::on_devices`).
    dst_device: Option<i32>,
    /// Senders announce chunks before summing them (`ConnectorConfig::sums_follow`).
    sums_follow: bool,
}

const WAIT: Duration = Duration::from_secs(20);

/// The content binding the suite's receivers expect and its honest senders state.
const BINDING: u64 = 0x7461_6e64_656d_0001;

impl Suite {
    /// A suite for `spec` (a TCP or NCCL spec's fixed port is replaced by port 0: the suite makes many
    /// connectors).
    pub fn new(spec: ConnectorSpec) -> Suite {
        let spec = match spec {
            ConnectorSpec::Tcp(mut opts) => {
                opts.bind.set_port(0);
                ConnectorSpec::Tcp(opts)
            }
            ConnectorSpec::Nccl(mut opts) => {
                opts.bind.set_port(0);
                ConnectorSpec::Nccl(opts)
            }
            other => other,
        };
        Suite { spec, fabric: Fabric::new(), device: None, dst_device: None, sums_follow: false }
    }

    /// The same suite with host senders announcing chunks before they sum them, as device senders
    /// do (protocol 3's `ChunkUnsummed` and `Sums`, which host runs then exercise too).
    pub fn with_sums_following(mut self) -> Suite {
        self.sums_follow = true;
        self
    }

    /// The same suite over pools in device memory of GPU `device` (every case but [`HOST_ONLY_CASES`]).
    pub fn on_device(mut self, device: i32) -> Suite {
        self.device = Some(device);
        self
    }

    /// The device suite with the senders' pools on GPU `src` and the receivers' on GPU `dst` (nccl
    /// connects two GPUs).
    pub fn on_devices(mut self, src: i32, dst: i32) -> Suite {
        self.device = Some(src);
        self.dst_device = Some(dst);
        self
    }

    /// The cases this suite runs: [`CASES`] on the host, all but [`HOST_ONLY_CASES`] on a device.
    pub fn cases(&self) -> Vec<&'static str> {
        CASES.iter().copied().filter(|c| self.device.is_none() || !HOST_ONLY_CASES.contains(c)).collect()
    }

    fn pool(&self, geometry: &Geometry, blocks: u32) -> Result<Arc<KvMemory>, String> {
        match self.device {
            None => KvMemory::host(geometry.clone(), blocks),
            Some(d) => KvMemory::cuda(geometry.clone(), blocks, d),
        }
        .map_err(|e| e.to_string())
    }

    /// A receiver's pool: on the receivers' GPU when `on_devices` named one.
    fn dst_pool(&self, geometry: &Geometry, blocks: u32) -> Result<Arc<KvMemory>, String> {
        match self.dst_device {
            Some(d) => KvMemory::cuda(geometry.clone(), blocks, d).map_err(|e| e.to_string()),
            None => self.pool(geometry, blocks),
        }
    }

    fn config(&self) -> ConnectorConfig {
        ConnectorConfig {
            max_chunk_bytes: 64 * 1024,
            transfer_timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(5),
            sums_follow: self.sums_follow,
            ..ConnectorConfig::default()
        }
    }

    async fn connector(&self, memory: Arc<KvMemory>) -> Result<Connector, String> {
        let spec = match &self.spec {
            ConnectorSpec::Inproc(_) => ConnectorSpec::Inproc(None),
            s => s.clone(),
        };
        Connector::from_spec(&spec, memory, self.config(), &self.fabric).await.map_err(|e| e.to_string())
    }

    async fn faulty(&self, memory: Arc<KvMemory>, fault: Fault) -> Result<Connector, String> {
        let spec = match &self.spec {
            ConnectorSpec::Inproc(_) => ConnectorSpec::Inproc(None),
            s => s.clone(),
        };
        // Device payloads are corrupted by the backend itself, on the device, after the copy.
        let every = Some(k_of(fault) as u64 + 1);
        let corrupting = match (&self.device, fault, &self.spec) {
            (Some(_), Fault::FlipBit(_), ConnectorSpec::CudaIpc(o)) => {
                Some(ConnectorSpec::CudaIpc(crate::transport::cuda_ipc::CudaIpcOptions { corrupt_every: every, ..o.clone() }))
            }
            (Some(_), Fault::FlipBit(_), ConnectorSpec::Nccl(o)) => {
                Some(ConnectorSpec::Nccl(crate::transport::nccl::NcclOptions { corrupt_every: every, ..o.clone() }))
            }
            _ => None,
        };
        if let Some(spec) = corrupting {
            return Connector::from_spec(&spec, memory, self.config(), &self.fabric).await.map_err(|e| e.to_string());
        }
        if self.device.is_some() {
            return Err(format!("{fault:?} rewrites payloads in host memory: not a device case"));
        }
        let fabric = self.fabric.clone();
        Connector::build(memory, self.config(), move |inbox| async move {
            let inner = make_transport(&spec, &fabric, inbox).await?;
            Ok(Arc::new(Faulty { inner, fault }) as Arc<dyn Transport>)
        })
        .await
        .map_err(|e| e.to_string())
    }

    /// Runs one case by name.
    pub async fn run_case(&self, name: &str) -> CaseResult {
        let case: BoxFuture<'_, CaseResult> = match name {
            "round_trip_bit_exact" => Box::pin(round_trip_bit_exact(self)),
            "layers_land_in_order" => Box::pin(layers_land_in_order(self)),
            "concurrent_64" => Box::pin(concurrent_64(self)),
            "zero_block_transfer" => Box::pin(zero_block_transfer(self)),
            "sender_cancel_frees_both_sides" => Box::pin(sender_cancel(self)),
            "receiver_cancel_frees_both_sides" => Box::pin(receiver_cancel(self)),
            "receiver_disappears" => Box::pin(receiver_disappears(self)),
            "sender_disappears" => Box::pin(sender_disappears(self)),
            "corrupted_chunk_detected" => Box::pin(fault_case(self, Fault::FlipBit(1))),
            "truncated_chunk_detected" => Box::pin(fault_case(self, Fault::Truncate(1))),
            "duplicated_chunk_detected" => Box::pin(fault_case(self, Fault::Duplicate(1))),
            "reordered_chunk_detected" => Box::pin(fault_case(self, Fault::Swap(1))),
            "foreign_chunk_detected" => Box::pin(fault_case(self, Fault::ForeignId(1))),
            "handshake_mismatch_refused" => Box::pin(handshake_mismatch(self)),
            "unknown_destination_fails_fast" => Box::pin(unknown_destination(self)),
            "unknown_transfer_rejected" => Box::pin(unknown_transfer(self)),
            "other_content_refused" => Box::pin(other_content_refused(self)),
            "receiver_timeout_frees_blocks" => Box::pin(receiver_timeout(self)),
            "large_transfer_256mib" => Box::pin(large_transfer(self)),
            other => return Err(format!("no conformance case named {other:?}")),
        };
        match tokio::time::timeout(Duration::from_secs(120), case).await {
            Ok(r) => r,
            Err(_) => Err("case did not finish within 120 s (hang)".into()),
        }
    }

    /// Runs every case; returns (name, result, duration) for each.
    pub async fn run_all(&self) -> Vec<(&'static str, CaseResult, Duration)> {
        let mut out = Vec::new();
        for name in self.cases() {
            let t = Instant::now();
            let r = self.run_case(name).await;
            out.push((name, r, t.elapsed()));
        }
        out
    }
}

// ------------------------------------------------------------------------------------------ helpers

fn geometry(model: &str, block_size: u32) -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: model.into(),
        dtype: DType::F32,
        block_size,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 16,
        layout: Layout::KvHeadTokenDim,
    })
    .expect("valid geometry")
}

/// Fills every block of every layer with seeded random bytes.
fn fill(memory: &Arc<KvMemory>, seed: u64) -> Result<(), String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buf = vec![0u8; memory.geometry().block_bytes()];
    for layer in 0..memory.geometry().num_layers() {
        for b in 0..memory.num_blocks() {
            rng.fill(&mut buf[..]);
            memory.write_block(layer, b, &buf).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

fn block(memory: &Arc<KvMemory>, layer: u32, b: u32) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; memory.geometry().block_bytes()];
    memory.read_block(layer, b, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// Checks `dst[dst_blocks[i]] == src[src_blocks[i]]` for the first `layers` layers.
fn same(src: &Arc<KvMemory>, sb: &[u32], dst: &Arc<KvMemory>, db: &[u32], layers: u32) -> CaseResult {
    for layer in 0..layers {
        for (&s, &d) in sb.iter().zip(db) {
            if block(src, layer, s)? != block(dst, layer, d)? {
                return Err(format!("layer {layer}: destination block {d} differs from source block {s}"));
            }
        }
    }
    Ok(())
}

/// Distinct random block ids.
fn pick(rng: &mut ChaCha8Rng, pool_blocks: u32, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..pool_blocks).collect();
    all.shuffle(rng);
    all.truncate(n);
    all
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(WAIT, fut).await.map_err(|_| format!("{what}: no result within {WAIT:?}"))
}

/// Waits until nothing claims blocks in any of `pools` (claims drop right after a terminal state).
async fn released(pools: &[&Arc<KvMemory>]) -> CaseResult {
    let t = Instant::now();
    while pools.iter().any(|p| p.claimed_blocks() > 0) {
        if t.elapsed() > WAIT {
            let left: Vec<usize> = pools.iter().map(|p| p.claimed_blocks()).collect();
            return Err(format!("blocks still claimed after {WAIT:?}: {left:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn expect_err<T: std::fmt::Debug>(what: &str, r: Result<T, Error>, ok: impl Fn(&Error) -> bool) -> CaseResult {
    match r {
        Err(e) if ok(&e) => Ok(()),
        Err(e) => Err(format!("{what}: wrong error: {e}")),
        Ok(v) => Err(format!("{what}: succeeded ({v:?}) but must fail")),
    }
}

struct Pair {
    tx: Connector,
    rx: Connector,
    src: Arc<KvMemory>,
    dst: Arc<KvMemory>,
}

async fn pair(suite: &Suite, blocks: u32, seed: u64) -> Result<Pair, String> {
    let g = geometry("conformance", 4);
    let (src, dst) = (suite.pool(&g, blocks)?, suite.dst_pool(&g, blocks)?);
    fill(&src, seed)?;
    fill(&dst, seed ^ 0x5555)?;
    let tx = suite.connector(Arc::clone(&src)).await?;
    let rx = suite.connector(Arc::clone(&dst)).await?;
    Ok(Pair { tx, rx, src, dst })
}

// ------------------------------------------------------------------------------------------ cases

async fn round_trip_bit_exact(suite: &Suite) -> CaseResult {
    let p = pair(suite, 64, 1).await?;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (sb, db) = (pick(&mut rng, 64, 40), pick(&mut rng, 64, 40));
    let mut recv = p.rx.expect(db.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let mut send = p.tx.send(recv.descriptor(), sb.clone(), BINDING, None).map_err(|e| e.to_string())?;
    send.push_all();
    let stats = within("receive", recv.wait()).await?.map_err(|e| e.to_string())?;
    let sent = within("send", send.wait()).await?.map_err(|e| e.to_string())?;
    same(&p.src, &sb, &p.dst, &db, 4)?;
    let bytes = 40 * 4 * p.src.geometry().block_bytes() as u64;
    if stats.bytes != bytes || sent.bytes != bytes {
        return Err(format!("stats report {} / {} bytes, expected {bytes}", stats.bytes, sent.bytes));
    }
    if stats.bytes_per_sec().is_nan() || stats.bytes_per_sec() <= 0.0 {
        return Err("no bandwidth reported".into());
    }
    let (m_tx, m_rx) = (p.tx.metrics(), p.rx.metrics());
    if m_tx.sent_ok != 1 || m_rx.received_ok != 1 || m_rx.bytes_received != bytes || m_tx.last_send_bytes_per_sec == 0 {
        return Err(format!("metrics wrong: {m_tx:?} / {m_rx:?}"));
    }
    released(&[&p.src, &p.dst]).await?;
    // Again over the same link with every layer ready from the start (`send_ready`: the first
    // steps run on this thread), into other blocks.
    let (sb, db) = (pick(&mut rng, 64, 24), pick(&mut rng, 64, 24));
    let mut recv = p.rx.expect(db.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let mut send = p.tx.send_ready(recv.descriptor(), sb.clone(), BINDING, None).map_err(|e| e.to_string())?;
    within("receive (send_ready)", recv.wait()).await?.map_err(|e| e.to_string())?;
    within("send (send_ready)", send.wait()).await?.map_err(|e| e.to_string())?;
    same(&p.src, &sb, &p.dst, &db, 4)?;
    released(&[&p.src, &p.dst]).await
}

async fn layers_land_in_order(suite: &Suite) -> CaseResult {
    let p = pair(suite, 32, 2).await?;
    let blocks: Vec<u32> = (0..20).collect();
    let mut recv = p.rx.expect(blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let send = p.tx.send(recv.descriptor(), blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    // Record every progress value the receiver publishes.
    let mut watch = recv.progress.clone();
    let seen = tokio::spawn(async move {
        let mut seen = vec![watch.borrow().layers];
        while watch.changed().await.is_ok() {
            let p = watch.borrow().clone();
            seen.push(p.layers);
            if !matches!(p.state, TransferState::Pending) {
                break;
            }
        }
        seen
    });
    for layer in 0..4 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let before = recv.progress().layers;
        if before != layer {
            return Err(format!("layer {layer} not pushed yet but receiver reports {before} layers landed"));
        }
        send.push_layer(layer).map_err(|e| e.to_string())?;
        within("layer", recv.layer_ready(layer)).await?.map_err(|e| e.to_string())?;
    }
    if send.push_layer(2).is_ok() {
        return Err("pushing a layer twice was accepted".into());
    }
    within("receive", recv.wait()).await?.map_err(|e| e.to_string())?;
    let seen = within("watcher", seen).await?.map_err(|e| e.to_string())?;
    if seen.windows(2).any(|w| w[1] < w[0]) || seen.last() != Some(&4) {
        return Err(format!("layer reports out of order: {seen:?}"));
    }
    same(&p.src, &blocks, &p.dst, &blocks, 4)
}

async fn concurrent_64(suite: &Suite) -> CaseResult {
    let p = pair(suite, 64 * 3, 3).await?;
    let mut recvs = Vec::new();
    let mut sends = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    let mut src_order: Vec<u32> = (0..64 * 3).collect();
    src_order.shuffle(&mut rng);
    for i in 0..64u32 {
        let db: Vec<u32> = (i * 3..i * 3 + 3).collect();
        let sb = src_order[i as usize * 3..i as usize * 3 + 3].to_vec();
        let r = p.rx.expect(db.clone(), BINDING, None).map_err(|e| e.to_string())?;
        let s = p.tx.send(r.descriptor(), sb.clone(), BINDING, None).map_err(|e| e.to_string())?;
        recvs.push((r, sb, db));
        sends.push(s);
    }
    for s in &sends {
        s.push_all();
    }
    for (r, sb, db) in &mut recvs {
        within("receive", r.wait()).await?.map_err(|e| e.to_string())?;
        same(&p.src, sb, &p.dst, db, 4)?;
    }
    for s in &mut sends {
        within("send", s.wait()).await?.map_err(|e| e.to_string())?;
    }
    if p.rx.metrics().received_ok != 64 {
        return Err(format!("{} transfers completed, expected 64", p.rx.metrics().received_ok));
    }
    released(&[&p.src, &p.dst]).await
}

async fn zero_block_transfer(suite: &Suite) -> CaseResult {
    let p = pair(suite, 4, 4).await?;
    let mut recv = p.rx.expect(vec![], BINDING, None).map_err(|e| e.to_string())?;
    let mut send = p.tx.send(recv.descriptor(), vec![], BINDING, None).map_err(|e| e.to_string())?;
    let r = within("receive", recv.wait()).await?.map_err(|e| e.to_string())?;
    let s = within("send", send.wait()).await?.map_err(|e| e.to_string())?;
    if r.bytes != 0 || s.bytes != 0 || recv.progress().layers != 4 {
        return Err(format!("zero-block transfer moved {} bytes, {} layers", r.bytes, recv.progress().layers));
    }
    Ok(())
}

async fn sender_cancel(suite: &Suite) -> CaseResult {
    let p = pair(suite, 64, 5).await?;
    let blocks: Vec<u32> = (0..48).collect();
    let mut recv = p.rx.expect(blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let send = p.tx.send(recv.descriptor(), blocks, BINDING, None).map_err(|e| e.to_string())?;
    send.push_layer(0).map_err(|e| e.to_string())?;
    within("layer 0", recv.layer_ready(0)).await?.map_err(|e| e.to_string())?;
    within("cancel", send.cancel()).await?;
    let r = within("receiver verdict", recv.wait()).await?;
    expect_err("receiver after sender cancel", r, |e| matches!(e, Error::Cancelled { by: "sender", .. }))?;
    if recv.progress().layers != 1 {
        return Err(format!("receiver reports {} layers after a cancel at layer 1", recv.progress().layers));
    }
    released(&[&p.src, &p.dst]).await?;
    let (a, b) = (p.tx.metrics(), p.rx.metrics());
    if a.sending != 0 || b.receiving != 0 {
        return Err(format!("transfers left in flight: {a:?} {b:?}"));
    }
    Ok(())
}

async fn receiver_cancel(suite: &Suite) -> CaseResult {
    let p = pair(suite, 64, 6).await?;
    let blocks: Vec<u32> = (0..48).collect();
    let mut recv = p.rx.expect(blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let mut send = p.tx.send(recv.descriptor(), blocks, BINDING, None).map_err(|e| e.to_string())?;
    send.push_layer(0).map_err(|e| e.to_string())?;
    within("layer 0", recv.layer_ready(0)).await?.map_err(|e| e.to_string())?;
    within("cancel", recv.cancel()).await?;
    // The sender learns it on the next push or while waiting.
    let _ = send.push_layer(1);
    let r = within("sender verdict", send.wait()).await?;
    expect_err("sender after receiver cancel", r, |e| matches!(e, Error::Cancelled { by: "receiver", .. }))?;
    released(&[&p.src, &p.dst]).await?;
    let (a, b) = (p.tx.metrics(), p.rx.metrics());
    if a.sending != 0 || b.receiving != 0 {
        return Err(format!("transfers left in flight: {a:?} {b:?}"));
    }
    Ok(())
}

async fn receiver_disappears(suite: &Suite) -> CaseResult {
    let p = pair(suite, 64, 7).await?;
    let blocks: Vec<u32> = (0..32).collect();
    let mut recv = p.rx.expect(blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let mut send = p.tx.send(recv.descriptor(), blocks, BINDING, None).map_err(|e| e.to_string())?;
    send.push_layer(0).map_err(|e| e.to_string())?;
    within("layer 0", recv.layer_ready(0)).await?.map_err(|e| e.to_string())?;
    let t = Instant::now();
    drop(p.rx);
    let r = within("sender verdict", send.wait()).await?;
    expect_err("sender after the receiver vanished", r, |e| {
        matches!(e, Error::LinkFailed { .. } | Error::Rejected { .. } | Error::Shutdown)
    })?;
    if t.elapsed() > Duration::from_secs(5) {
        return Err(format!("sender noticed the vanished receiver only after {:?}", t.elapsed()));
    }
    let r = recv.wait().await;
    expect_err("receiver handle of a dropped connector", r, |e| matches!(e, Error::Shutdown))?;
    released(&[&p.src, &p.dst]).await
}

async fn sender_disappears(suite: &Suite) -> CaseResult {
    let p = pair(suite, 64, 8).await?;
    let blocks: Vec<u32> = (0..32).collect();
    let mut recv = p.rx.expect(blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let send = p.tx.send(recv.descriptor(), blocks, BINDING, None).map_err(|e| e.to_string())?;
    send.push_layer(0).map_err(|e| e.to_string())?;
    within("layer 0", recv.layer_ready(0)).await?.map_err(|e| e.to_string())?;
    let t = Instant::now();
    std::mem::forget(send); // no polite cancel: the whole sender goes away
    drop(p.tx);
    let r = within("receiver verdict", recv.wait()).await?;
    expect_err("receiver after the sender vanished", r, |e| matches!(e, Error::LinkFailed { .. } | Error::Cancelled { .. }))?;
    if t.elapsed() > Duration::from_secs(5) {
        return Err(format!("receiver noticed the vanished sender only after {:?}", t.elapsed()));
    }
    if recv.progress().layers >= 4 {
        return Err("a transfer whose sender vanished was reported complete".into());
    }
    released(&[&p.dst]).await
}

async fn fault_case(suite: &Suite, fault: Fault) -> CaseResult {
    let g = geometry("conformance", 4);
    let (src, dst) = (suite.pool(&g, 64)?, suite.dst_pool(&g, 64)?);
    fill(&src, 9)?;
    fill(&dst, 10)?;
    let tx = suite.faulty(Arc::clone(&src), fault).await?;
    let rx = suite.connector(Arc::clone(&dst)).await?;
    // 48 blocks of 1 KiB per layer in 64 KiB chunks: one chunk per layer, 4 chunks; the fault hits the second.
    let blocks: Vec<u32> = (0..48).collect();
    let mut recv = rx.expect(blocks.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let mut send = tx.send(recv.descriptor(), blocks, BINDING, None).map_err(|e| e.to_string())?;
    send.push_all();
    let r = within("receiver verdict", recv.wait()).await?;
    expect_err(&format!("receiver under {fault:?}"), r, |e| matches!(e, Error::Integrity { .. } | Error::LinkFailed { .. }))?;
    let s = within("sender verdict", send.wait()).await?;
    expect_err(&format!("sender under {fault:?}"), s, |_| true)?;
    // Layer 1's chunk is the faulty one; only a duplicate comes after a correct copy of it.
    let landed = recv.progress().layers;
    let allowed = if matches!(fault, Fault::Duplicate(_)) { 2 } else { 1 };
    if landed > allowed {
        return Err(format!("{landed} layers reported landed although layer 1's chunk was faulty"));
    }
    released(&[&src, &dst]).await?;
    // Whatever was reported landed is exactly the source.
    let blocks: Vec<u32> = (0..48).collect();
    same(&src, &blocks, &dst, &blocks, landed)?;
    // The receiver stays usable for clean transfers afterwards.
    let clean = suite.connector(Arc::clone(&src)).await?;
    let b2: Vec<u32> = (48..56).collect();
    let mut r2 = rx.expect(b2.clone(), BINDING, None).map_err(|e| e.to_string())?;
    let s2 = clean.send(r2.descriptor(), b2.clone(), BINDING, None).map_err(|e| e.to_string())?;
    s2.push_all();
    within("clean transfer", r2.wait()).await?.map_err(|e| format!("clean transfer after a fault: {e}"))?;
    same(&src, &b2, &dst, &b2, 4)
}

async fn handshake_mismatch(suite: &Suite) -> CaseResult {
    let (g16, g8) = (geometry("conformance", 4), geometry("conformance", 8));
    let (src, dst) = (suite.pool(&g16, 8)?, suite.dst_pool(&g8, 8)?);
    let tx = suite.connector(Arc::clone(&src)).await?;
    let rx = suite.connector(Arc::clone(&dst)).await?;
    let recv = rx.expect(vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    // Local check: the descriptor's geometry differs from the sender's pool.
    let local = tx.send(recv.descriptor(), vec![0, 1], BINDING, None);
    expect_err("send with a mismatched descriptor", local, |e| {
        matches!(e, Error::Incompatible(m) if m.contains("block_size"))
    })?;
    // Wire check: a descriptor claiming our geometry still meets the receiver's handshake.
    let mut forged = recv.descriptor().clone();
    forged.geometry = g16.clone();
    let mut send = tx.send(&forged, vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    send.push_all();
    let r = within("handshake", send.wait()).await?;
    expect_err("handshake with a mismatched peer", r, |e| {
        matches!(e, Error::Incompatible(m) if m.contains("block_size 8 != 4"))
    })?;
    // A different model is refused too.
    let other = suite.pool(&Geometry::new(GeometrySpec { model_id: "other-model".into(), ..spec_of(&g8) }).expect("valid"), 8)?;
    let tx2 = suite.connector(other).await?;
    let mut s2 = tx2.send(recv.descriptor(), vec![0, 1], BINDING, None);
    if let Ok(s) = &mut s2 {
        s.push_all();
    }
    let r2 = match s2 {
        Ok(mut s) => within("handshake", s.wait()).await?,
        Err(e) => Err(e),
    };
    expect_err("another model", r2, |e| matches!(e, Error::Incompatible(m) if m.contains("model")))?;
    released(&[&src]).await
}

fn spec_of(g: &Geometry) -> GeometrySpec {
    GeometrySpec {
        model_id: g.model_id().into(),
        dtype: g.dtype(),
        block_size: g.block_size(),
        num_layers: g.num_layers(),
        num_kv_heads: g.num_kv_heads(),
        head_dim: g.head_dim(),
        layout: g.layout(),
    }
}

async fn unknown_destination(suite: &Suite) -> CaseResult {
    let p = pair(suite, 8, 12).await?;
    let recv = p.rx.expect(vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    let mut desc = recv.descriptor().clone();
    drop(recv);
    drop(p.rx); // its endpoint now leads nowhere
    desc.id ^= 1;
    let t = Instant::now();
    let mut send = p.tx.send(&desc, vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    send.push_all();
    let r = within("send to a dead endpoint", send.wait()).await?;
    expect_err("send to a dead endpoint", r, |e| matches!(e, Error::Unreachable { .. }))?;
    if t.elapsed() > Duration::from_secs(2) {
        return Err(format!("failing took {:?}", t.elapsed()));
    }
    released(&[&p.src]).await
}

async fn unknown_transfer(suite: &Suite) -> CaseResult {
    let p = pair(suite, 8, 13).await?;
    let recv = p.rx.expect(vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    let mut desc = recv.descriptor().clone();
    desc.id = desc.id.wrapping_add(1_000_000);
    let t = Instant::now();
    let mut send = p.tx.send(&desc, vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    send.push_all();
    let r = within("send of an unexpected transfer", send.wait()).await?;
    expect_err("unexpected transfer", r, |e| matches!(e, Error::Rejected { .. }))?;
    if t.elapsed() > Duration::from_secs(2) {
        return Err(format!("rejection took {:?}", t.elapsed()));
    }
    // Blocks that differ from what the receiver allocated are refused as well.
    let mut wrong = recv.descriptor().clone();
    wrong.dst_blocks = vec![1, 0];
    let mut send = p.tx.send(&wrong, vec![0, 1], BINDING, None).map_err(|e| e.to_string())?;
    send.push_all();
    let r = within("send to the wrong blocks", send.wait()).await?;
    expect_err("wrong destination blocks", r, |e| matches!(e, Error::Rejected { .. }))?;
    drop(recv);
    released(&[&p.src, &p.dst]).await
}

/// A sender whose content is bound to something else than the receiver expects (another prompt) is
/// refused before any block lands: the receiver's blocks keep their old bytes and nothing is reported.
async fn other_content_refused(suite: &Suite) -> CaseResult {
    let p = pair(suite, 8, 17).await?;
    let bb = p.dst.geometry().block_bytes();
    let read = |m: &Arc<KvMemory>| -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; bb];
        m.read_block(0, 2, &mut out).map_err(|e| e.to_string())?;
        Ok(out)
    };
    let before = read(&p.dst)?;
    let mut recv = p.rx.expect(vec![2, 3], BINDING, None).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let mut send = p.tx.send(recv.descriptor(), vec![0, 1], BINDING ^ 1, None).map_err(|e| e.to_string())?;
    send.push_all();
    let r = within("send of other content", send.wait()).await?;
    expect_err("sender bound to other content", r, |e| matches!(e, Error::Rejected { .. }))?;
    let r = within("receiver of other content", recv.wait()).await?;
    expect_err("receiver of other content", r, |e| matches!(e, Error::Rejected { .. }))?;
    if t.elapsed() > Duration::from_secs(2) {
        return Err(format!("refusing took {:?}", t.elapsed()));
    }
    if recv.progress().layers != 0 {
        return Err(format!("{} layers reported for refused content", recv.progress().layers));
    }
    if read(&p.dst)? != before {
        return Err("refused content was written into the receiver's block".into());
    }
    released(&[&p.src, &p.dst]).await
}

async fn receiver_timeout(suite: &Suite) -> CaseResult {
    let p = pair(suite, 16, 14).await?;
    let blocks: Vec<u32> = (0..8).collect();
    let mut recv = p.rx.expect(blocks.clone(), BINDING, Some(Duration::from_millis(300))).map_err(|e| e.to_string())?;
    let mut send = p.tx.send(recv.descriptor(), blocks, BINDING, None).map_err(|e| e.to_string())?;
    send.push_layer(0).map_err(|e| e.to_string())?; // and never the rest
    let r = within("receiver timeout", recv.wait()).await?;
    expect_err("receiver whose sender stalls", r, |e| matches!(e, Error::Timeout { .. }))?;
    let s = within("sender verdict", send.wait()).await?;
    expect_err("sender of a timed-out transfer", s, |e| matches!(e, Error::Rejected { .. }))?;
    released(&[&p.src, &p.dst]).await
}

async fn large_transfer(suite: &Suite) -> CaseResult {
    // 4 layers x 512 blocks x 128 KiB = 256 MiB.
    let g = Geometry::new(GeometrySpec {
        model_id: "conformance-large".into(),
        dtype: DType::F32,
        block_size: 16,
        num_layers: 4,
        num_kv_heads: 8,
        head_dim: 128,
        layout: Layout::KvHeadTokenDim,
    })
    .expect("valid geometry");
    let (src, dst) = (suite.pool(&g, 512)?, suite.dst_pool(&g, 512)?);
    fill(&src, 15)?;
    let tx = suite.connector(Arc::clone(&src)).await?;
    let rx = suite.connector(Arc::clone(&dst)).await?;
    let sb: Vec<u32> = (0..512).collect();
    let mut db = sb.clone();
    db.reverse();
    let mut recv = rx.expect(db.clone(), BINDING, Some(Duration::from_secs(100))).map_err(|e| e.to_string())?;
    let mut send = tx.send(recv.descriptor(), sb.clone(), BINDING, Some(Duration::from_secs(100))).map_err(|e| e.to_string())?;
    send.push_all();
    let stats = tokio::time::timeout(Duration::from_secs(100), recv.wait())
        .await
        .map_err(|_| "256 MiB transfer did not finish in 100 s".to_string())?
        .map_err(|e| e.to_string())?;
    send.wait().await.map_err(|e| e.to_string())?;
    if stats.bytes != 256 << 20 {
        return Err(format!("moved {} bytes", stats.bytes));
    }
    same(&src, &sb, &dst, &db, 4)
}

// ------------------------------------------------------------------------------------------ faults

/// The chunk a fault hits.
fn k_of(fault: Fault) -> usize {
    match fault {
        Fault::FlipBit(k) | Fault::Truncate(k) | Fault::Duplicate(k) | Fault::Swap(k) | Fault::ForeignId(k) => k,
    }
}

/// A fault injected into the sender's `n`th chunk (0-based).
#[derive(Debug, Clone, Copy)]
enum Fault {
    FlipBit(usize),
    Truncate(usize),
    Duplicate(usize),
    Swap(usize),
    ForeignId(usize),
}

struct Faulty {
    inner: Arc<dyn Transport>,
    fault: Fault,
}

impl Transport for Faulty {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn endpoint(&self) -> String {
        self.inner.endpoint()
    }
    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, crate::Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let inner = self.inner.connect(endpoint).await?;
            Ok(Arc::new(FaultyLink { inner, fault: self.fault, chunks: AtomicUsize::new(0), held: Mutex::new(None) })
                as Arc<dyn Link>)
        })
    }
    fn shutdown(&self) {
        self.inner.shutdown();
    }
}

struct FaultyLink {
    inner: Arc<dyn Link>,
    fault: Fault,
    chunks: AtomicUsize,
    held: Mutex<Option<(Vec<u8>, Payload)>>,
}

/// Copies a payload into an owned buffer (so it can be altered without touching the source pool).
fn owned_copy(payload: &Payload) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() as usize);
    for iov in payload.iovs() {
        // SAFETY: host iovecs of the sender's claimed blocks, valid while `payload` (which holds the claim) lives.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(iov.addr as *const u8, iov.len) });
    }
    out
}

fn payload_of(bytes: Arc<Vec<u8>>, len: usize) -> Payload {
    let iov = Iov { addr: bytes.as_ptr() as usize, len, kind: MemoryKind::Host };
    Payload::new(vec![iov], bytes)
}

impl Link for FaultyLink {
    fn id(&self) -> u64 {
        self.inner.id()
    }
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn close(&self) {
        self.inner.close()
    }
    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, crate::Result<()>> {
        Box::pin(async move {
            let (h, summed) = match Frame::decode(&header) {
                Ok(Frame::Chunk(h)) => (h, true),
                Ok(Frame::ChunkUnsummed(h)) => (h, false),
                _ => return self.inner.send(header, payload).await,
            };
            let n = self.chunks.fetch_add(1, Ordering::SeqCst);
            match self.fault {
                Fault::FlipBit(k) if k == n => {
                    let mut bytes = owned_copy(&payload);
                    let len = bytes.len();
                    bytes[len / 2] ^= 0x10;
                    self.inner.send(header, payload_of(Arc::new(bytes), len)).await
                }
                Fault::Truncate(k) if k == n => {
                    let bytes = owned_copy(&payload);
                    let len = bytes.len() - 100;
                    self.inner.send(header, payload_of(Arc::new(bytes), len)).await
                }
                Fault::Duplicate(k) if k == n => {
                    let bytes = Arc::new(owned_copy(&payload));
                    let len = bytes.len();
                    self.inner.send(header.clone(), payload).await?;
                    self.inner.send(header, payload_of(bytes, len)).await
                }
                Fault::Swap(k) if k == n => {
                    *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some((header, payload));
                    Ok(())
                }
                Fault::Swap(k) if k + 1 == n => {
                    self.inner.send(header, payload).await?;
                    let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).take();
                    match held {
                        Some((h, p)) => self.inner.send(h, p).await,
                        None => Ok(()),
                    }
                }
                Fault::ForeignId(k) if k == n => {
                    let forged = crate::frame::ChunkHeader { id: h.id ^ 0xabcdef, ..h };
                    let forged = if summed { Frame::Chunk(forged) } else { Frame::ChunkUnsummed(forged) }.encode();
                    self.inner.send(forged, payload).await
                }
                _ => self.inner.send(header, payload).await,
            }
        })
    }
}
