//! Target `kv_handshake`: a KV connector's state machine driven by a hostile peer. The fuzzer plays the
//! transport (`Connector::build` over a fake [`Transport`]) and feeds the connector's inbox what a peer
//! could send on any number of links: `Hello` (right or wrong version and geometry), `Start` (right or
//! wrong block count, block hash and content binding), chunks (any place, length and checksum, payloads
//! landed or failed), aborts, replies on the wrong side, raw bytes; it closes links, cancels transfers,
//! and on the sending side answers the connector's own `Hello` and `Start` with anything.
//!
//! Invariants asserted (any failure is a bug in kv-transfer's core or frame code):
//! - the connector hands out payload memory (`Delivery::Into`) only on a link whose `Hello` it accepted,
//!   only for a transfer it expects whose `Start` came on that link and named exactly its blocks and
//!   binding, and only as many bytes as the payload has; a transfer with another binding never gets a
//!   byte of its blocks written;
//! - whatever was written lands exactly in the destination blocks the chunk header names (checked
//!   against a shadow copy of the whole pool once every claim is released);
//! - a receive completes only after every block of every layer got a payload whose checksum matched,
//!   and the pool then holds exactly those bytes; `Done` goes only to the link of a completed transfer;
//! - replies are well-formed receiver frames: `HelloAck` only for the right version and geometry;
//! - a send completes only after its link's `Hello` was acknowledged with the right version and its
//!   `Done` arrived after every chunk was sent;
//! - every claim is released once everything is dropped (the pool's claimed-block count returns to 0).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tandem_kv_transfer::frame::{AbortCode, ChunkHeader, Frame, PROTOCOL_VERSION, blocks_hash, payload_checksum};
use tandem_kv_transfer::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};
use tandem_kv_transfer::{
    Connector, ConnectorConfig, DType, Geometry, GeometrySpec, Iov, KvMemory, Layout, RecvHandle, SendHandle,
    TransferDescriptor, TransferState,
};

use crate::Input;

const NUM_BLOCKS: u32 = 8;
const NUM_LAYERS: u32 = 2;
/// Bindings the fuzzer picks from (0 and 1 are "right" for expectations made with them).
const BINDINGS: [u64; 3] = [0x0b1d_0000_0000_0001, 0x0b1d_0000_0000_0002, 0];

/// The pool's geometry: 2 layers, 16-byte blocks.
pub fn geometry() -> Geometry {
    spec_geometry("fuzz-model", DType::F16, 2)
}

fn spec_geometry(model_id: &str, dtype: DType, block_size: u32) -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: model_id.into(),
        dtype,
        block_size,
        num_layers: NUM_LAYERS,
        num_kv_heads: 1,
        head_dim: 2,
        layout: Layout::KvHeadTokenDim,
    })
    .expect("a valid geometry")
}

/// What the connector sent on one of our links.
#[derive(Default)]
struct Sent {
    frames: Vec<Frame>,
}

struct FakeLink {
    id: u64,
    sent: Mutex<Sent>,
    closed: AtomicBool,
}

impl Link for FakeLink {
    fn id(&self) -> u64 {
        self.id
    }
    fn peer(&self) -> &str {
        "fuzz-peer"
    }
    fn send(&self, header: Vec<u8>, _payload: Payload) -> BoxFuture<'_, tandem_kv_transfer::Result<()>> {
        let frame = match Frame::decode(&header) {
            Ok(f) => f,
            Err(e) => panic!("the connector sent a header that does not decode: {e}"),
        };
        let closed = self.closed.load(Ordering::Acquire);
        if !closed {
            self.sent.lock().expect("lock").frames.push(frame);
        }
        Box::pin(async move {
            if closed {
                Err(tandem_kv_transfer::Error::LinkFailed { peer: "fuzz-peer".into(), reason: "closed".into() })
            } else {
                Ok(())
            }
        })
    }
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// The fake transport: `connect` opens a new outgoing link the fuzzer then answers on.
struct FakeTransport {
    next_link: AtomicU64,
    outgoing: Mutex<Vec<Arc<FakeLink>>>,
}

impl FakeTransport {
    fn link(&self) -> Arc<FakeLink> {
        Arc::new(FakeLink { id: self.next_link.fetch_add(1, Ordering::Relaxed), sent: Mutex::default(), closed: AtomicBool::new(false) })
    }
}

impl Transport for FakeTransport {
    fn name(&self) -> &str {
        "fuzz"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities(Capabilities::HOST_MEMORY)
    }
    fn endpoint(&self) -> String {
        "fuzz://receiver".into()
    }
    fn connect<'a>(&'a self, _endpoint: &'a str) -> BoxFuture<'a, tandem_kv_transfer::Result<Arc<dyn Link>>> {
        let link = self.link();
        self.outgoing.lock().expect("lock").push(Arc::clone(&link));
        Box::pin(async move { Ok(link as Arc<dyn Link>) })
    }
    fn shutdown(&self) {}
}

/// One incoming link the fuzzer sends on.
struct Incoming {
    link: Arc<FakeLink>,
    /// Whether the connector acknowledged our Hello (seen in its replies).
    greeted: bool,
    /// A payload the connector gave iovecs for and that has not been reported yet.
    pending: Option<PendingPayload>,
    dead: bool,
}

struct PendingPayload {
    token: u64,
    transfer: usize,
    header: ChunkHeader,
    checksum_ok: bool,
}

/// One expected (receive) transfer and what the fuzzer knows about it.
struct Expected {
    handle: Option<RecvHandle>,
    desc: TransferDescriptor,
    /// The link whose accepted Start began it, and whether that Start was right in every field.
    started_on: Option<usize>,
    start_ok: bool,
    /// (layer, block index) → the bytes a verified payload wrote there.
    landed: HashMap<(u32, u32), Vec<u8>>,
}

/// One send the connector makes to the fake receiver.
struct Sending {
    handle: SendHandle,
    /// We sent Done for it after the connector sent all its chunks.
    done_after_all: bool,
}

struct World {
    connector: Option<Connector>,
    transport: Arc<FakeTransport>,
    inbox: Arc<dyn Inbox>,
    memory: Arc<KvMemory>,
    links: Vec<Incoming>,
    expected: Vec<Expected>,
    sends: Vec<Sending>,
    /// Outgoing links whose Hello got its first answer, and those whose first answer was a right HelloAck.
    answered: HashSet<u64>,
    acked: HashSet<u64>,
    /// The pool as it must be: zeroes, plus every payload written.
    shadow: Vec<Vec<u8>>,
    block_bytes: usize,
}

/// The target.
pub fn run(data: &[u8]) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime");
    let memory = rt.block_on(async {
        let memory = KvMemory::host(geometry(), NUM_BLOCKS).expect("host memory");
        let mut world = World::new(Arc::clone(&memory)).await;
        let mut input = Input::new(data);
        let mut steps = 0;
        while !input.is_empty() && steps < 256 {
            steps += 1;
            world.step(&mut input).await;
            settle().await;
        }
        world.finish().await;
        memory
    });
    drop(rt);
    assert_eq!(memory.claimed_blocks(), 0, "claims left after everything was dropped");
}

/// Lets spawned reply and sender tasks run.
async fn settle() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

impl World {
    async fn new(memory: Arc<KvMemory>) -> World {
        let transport = Arc::new(FakeTransport { next_link: AtomicU64::new(1000), outgoing: Mutex::default() });
        let inbox_slot: Arc<Mutex<Option<Arc<dyn Inbox>>>> = Arc::default();
        let (t, slot) = (Arc::clone(&transport), Arc::clone(&inbox_slot));
        let connector = Connector::build(Arc::clone(&memory), ConnectorConfig::default(), move |inbox| async move {
            *slot.lock().expect("lock") = Some(inbox);
            Ok(t as Arc<dyn Transport>)
        })
        .await
        .expect("a connector");
        let inbox = inbox_slot.lock().expect("lock").take().expect("the inbox");
        let block_bytes = memory.geometry().block_bytes();
        let layer = vec![0u8; NUM_BLOCKS as usize * block_bytes];
        World {
            connector: Some(connector),
            transport,
            inbox,
            memory,
            links: Vec::new(),
            expected: Vec::new(),
            sends: Vec::new(),
            answered: HashSet::new(),
            acked: HashSet::new(),
            shadow: vec![layer; NUM_LAYERS as usize],
            block_bytes,
        }
    }

    fn connector(&self) -> &Connector {
        self.connector.as_ref().expect("live until finish")
    }

    /// A live incoming link picked by the input (a new one past the end).
    fn pick_link(&mut self, input: &mut Input<'_>) -> usize {
        // A link the connector closed (after a HelloReject) is gone, as a transport would see it: a
        // pending payload fails, and no `on_link_closed` follows a local close.
        for l in 0..self.links.len() {
            if !self.links[l].dead && self.links[l].link.closed.load(Ordering::Acquire) {
                self.land(l, false);
                self.links[l].dead = true;
            }
        }
        let k = usize::from(input.u8() % 4);
        let live: Vec<usize> = (0..self.links.len()).filter(|&i| !self.links[i].dead).collect();
        if k < live.len() {
            return live[k];
        }
        let link = self.transport.link();
        self.links.push(Incoming { link, greeted: false, pending: None, dead: false });
        self.links.len() - 1
    }

    async fn step(&mut self, input: &mut Input<'_>) {
        match input.u8() % 14 {
            0 => self.expect(input),
            1 => {
                let l = self.pick_link(input);
                let hello = self.hello(input);
                self.deliver(l, hello, 0).await;
            }
            2 => self.start(input).await,
            3 | 4 => self.chunk(input).await,
            5 => {
                let l = self.pick_link(input);
                self.land(l, !input.u8().is_multiple_of(4));
            }
            6 => {
                let l = self.pick_link(input);
                let id = self.transfer_id(input);
                let code = [AbortCode::Cancelled, AbortCode::Rejected, AbortCode::Integrity][usize::from(input.u8() % 3)];
                self.deliver(l, Frame::Abort { id, code, reason: "fuzz".into() }, 0).await;
            }
            7 => {
                let l = self.pick_link(input);
                let id = self.transfer_id(input);
                let f = match input.u8() % 3 {
                    0 => Frame::HelloAck { version: PROTOCOL_VERSION },
                    1 => Frame::HelloReject { reason: "no".into() },
                    _ => Frame::Done { id },
                };
                self.deliver(l, f, 0).await;
            }
            8 => {
                let l = self.pick_link(input);
                let raw = input.chunk().to_vec();
                let payload_len = u64::from(input.u8());
                self.deliver_raw(l, &raw, payload_len).await;
            }
            9 => {
                let l = self.pick_link(input);
                self.close(l, "fuzz closed the link");
            }
            10 => {
                let t = usize::from(input.u8());
                if !self.expected.is_empty() {
                    let n = self.expected.len();
                    drop(self.expected[t % n].handle.take());
                }
            }
            11 => self.send(input),
            12 => {
                if !self.sends.is_empty() {
                    let n = self.sends.len();
                    let s = &self.sends[usize::from(input.u8()) % n];
                    let _ = s.handle.push_layer(u32::from(input.u8() % 3));
                }
            }
            _ => self.answer_send(input).await,
        }
    }

    /// Expects a transfer into free blocks picked by the input.
    fn expect(&mut self, input: &mut Input<'_>) {
        let n = input.u8() % 5;
        let mut blocks = Vec::new();
        for _ in 0..n {
            let b = u32::from(input.u8()) % NUM_BLOCKS;
            if !blocks.contains(&b) {
                blocks.push(b);
            }
        }
        let binding = BINDINGS[usize::from(input.u8() % 2)];
        if let Ok(handle) = self.connector().expect(blocks, binding, None) {
            let desc = handle.descriptor().clone();
            self.expected.push(Expected { handle: Some(handle), desc, started_on: None, start_ok: false, landed: HashMap::new() });
        }
    }

    fn hello(&self, input: &mut Input<'_>) -> Frame {
        let version = match input.u8() % 4 {
            0 => input.u16(),
            _ => PROTOCOL_VERSION,
        };
        let geometry = match input.u8() % 6 {
            0 => spec_geometry("other-model", DType::F16, 2),
            1 => spec_geometry("fuzz-model", DType::BF16, 2),
            2 => spec_geometry("fuzz-model", DType::F16, 4),
            _ => geometry(),
        };
        Frame::Hello { version, geometry }
    }

    fn transfer_id(&self, input: &mut Input<'_>) -> u64 {
        let k = usize::from(input.u8());
        if self.expected.is_empty() || k % 8 == 7 {
            return u64::from(input.u8());
        }
        self.expected[k % self.expected.len()].desc.id
    }

    async fn start(&mut self, input: &mut Input<'_>) {
        let l = self.pick_link(input);
        let id = self.transfer_id(input);
        let desc = self.expected.iter().find(|e| e.desc.id == id).map(|e| e.desc.clone());
        let (right_n, right_hash, right_binding) = desc
            .as_ref()
            .map_or((0, 0, 0), |d| (d.dst_blocks.len() as u32, blocks_hash(&d.dst_blocks), d.binding));
        let flags = input.u8();
        let num_blocks = if flags & 1 == 0 { right_n } else { right_n ^ 1 };
        let hash = if flags & 2 == 0 { right_hash } else { right_hash ^ 1 };
        let binding = match flags >> 2 & 3 {
            0 | 1 => right_binding,
            2 => BINDINGS[usize::from(right_binding == BINDINGS[0])],
            _ => u64::from(input.u8()),
        };
        // The model first: the connector may answer (a zero-block transfer's Done) during delivery.
        let greeted = self.links[l].greeted && !self.links[l].dead;
        if let Some(e) = self.expected.iter_mut().find(|e| e.desc.id == id)
            && greeted
            && e.started_on.is_none()
        {
            e.started_on = Some(l);
            e.start_ok = num_blocks == right_n && hash == right_hash && binding == right_binding;
        }
        self.deliver(l, Frame::Start { id, num_blocks, blocks_hash: hash, binding }, 0).await;
    }

    async fn chunk(&mut self, input: &mut Input<'_>) {
        let l = self.pick_link(input);
        let id = self.transfer_id(input);
        let n_dst = self.expected.iter().find(|e| e.desc.id == id).map_or(1, |e| e.desc.dst_blocks.len() as u32);
        let layer = u32::from(input.u8() % (NUM_LAYERS as u8 + 1));
        let block_start = u32::from(input.u8()) % (n_dst + 1);
        let block_count = match input.u8() % 4 {
            0 => u32::from(input.u8()),
            _ => n_dst.saturating_sub(block_start).max(1),
        };
        let bb = self.block_bytes as u64;
        let byte_len = match input.u8() % 5 {
            0 => u64::from(input.u16()),
            _ => u64::from(block_count) * bb,
        };
        let payload_len = if input.u8().is_multiple_of(6) { u64::from(input.u16()) } else { byte_len };
        let fill = input.u8();
        let payload: Vec<u8> = (0..payload_len.min(1 << 16)).map(|i| fill.wrapping_add(i as u8)).collect();
        let right_sum = payload_checksum([payload.as_slice()]);
        let checksum_ok = !input.u8().is_multiple_of(5);
        let checksum = if checksum_ok { right_sum } else { right_sum ^ 1 };
        let header = ChunkHeader { id, layer, block_start, block_count, byte_len, checksum };
        let delivery = self.deliver(l, Frame::Chunk(header), payload_len).await;
        let Some(Delivery::Into { iovs, token }) = delivery else { return };
        // The connector gave us memory to write: check that it may.
        let t = self
            .expected
            .iter()
            .position(|e| e.desc.id == id)
            .unwrap_or_else(|| panic!("payload memory handed out for unknown transfer {id}"));
        let e = &self.expected[t];
        assert!(self.links[l].greeted, "payload memory handed out on a link without a handshake");
        assert_eq!(e.started_on, Some(l), "payload memory handed out for a transfer not started on this link");
        assert!(e.start_ok, "payload memory handed out for a transfer whose Start named other blocks or content");
        assert_eq!(iovs.iter().map(|i| i.len as u64).sum::<u64>(), payload_len, "iovecs do not match the payload");
        assert_eq!(byte_len, payload_len, "iovecs for a chunk whose header disagrees with its payload");
        assert!(
            u64::from(block_start) + u64::from(block_count) <= e.desc.dst_blocks.len() as u64 && layer < NUM_LAYERS,
            "iovecs for blocks outside the transfer"
        );
        write_iovs(&iovs, &payload);
        // The shadow: the same bytes in the blocks the header names.
        let bbu = self.block_bytes;
        for (k, b) in (block_start..block_start + block_count).enumerate() {
            let dst = e.desc.dst_blocks[b as usize] as usize;
            self.shadow[layer as usize][dst * bbu..(dst + 1) * bbu].copy_from_slice(&payload[k * bbu..(k + 1) * bbu]);
        }
        self.links[l].pending = Some(PendingPayload { token, transfer: t, header, checksum_ok });
        if !input.u8().is_multiple_of(3) {
            self.land(l, !input.u8().is_multiple_of(8));
        }
    }

    /// Reports the pending payload of link `l` as landed (`ok`) or failed.
    fn land(&mut self, l: usize, ok: bool) {
        let Some(p) = self.links[l].pending.take() else { return };
        let link: Arc<dyn Link> = Arc::clone(&self.links[l].link) as Arc<dyn Link>;
        let result = if ok { Ok(Landed::default()) } else { Err("fuzz: payload lost".to_string()) };
        self.inbox.on_payload(&link, p.token, result);
        if ok && p.checksum_ok {
            let e = &mut self.expected[p.transfer];
            let h = p.header;
            for b in h.block_start..h.block_start + h.block_count {
                let dst = e.desc.dst_blocks[b as usize] as usize;
                let bytes = self.shadow[h.layer as usize][dst * self.block_bytes..(dst + 1) * self.block_bytes].to_vec();
                e.landed.insert((h.layer, b), bytes);
            }
        }
    }

    /// Closes link `l` as a failing transport does: a pending payload fails first, then the inbox hears.
    fn close(&mut self, l: usize, reason: &str) {
        if self.links[l].dead {
            return;
        }
        self.land(l, false);
        self.links[l].dead = true;
        self.links[l].link.close();
        let link: Arc<dyn Link> = Arc::clone(&self.links[l].link) as Arc<dyn Link>;
        self.inbox.on_link_closed(&link, reason.to_string());
    }

    async fn deliver(&mut self, l: usize, frame: Frame, payload_len: u64) -> Option<Delivery> {
        let header = frame.encode();
        self.deliver_raw(l, &header, payload_len).await
    }

    /// Delivers one message on incoming link `l` (after its pending payload, as a transport would).
    async fn deliver_raw(&mut self, l: usize, header: &[u8], payload_len: u64) -> Option<Delivery> {
        if self.links[l].dead {
            return None;
        }
        self.land(l, true);
        let link: Arc<dyn Link> = Arc::clone(&self.links[l].link) as Arc<dyn Link>;
        let delivery = self.inbox.on_message(&link, header, payload_len);
        settle().await;
        self.read_replies(l);
        match delivery {
            Delivery::CloseLink(reason) => {
                self.close(l, &reason);
                None
            }
            Delivery::Discard => None,
            into @ Delivery::Into { .. } => Some(into),
        }
    }

    /// Checks what the connector answered on incoming link `l`.
    fn read_replies(&mut self, l: usize) {
        let frames = std::mem::take(&mut self.links[l].link.sent.lock().expect("lock").frames);
        for f in frames {
            match f {
                Frame::HelloAck { version } => {
                    assert_eq!(version, PROTOCOL_VERSION);
                    self.links[l].greeted = true;
                }
                Frame::HelloReject { .. } | Frame::Abort { .. } => {}
                Frame::Done { id } => {
                    let e = self.expected.iter().find(|e| e.desc.id == id).unwrap_or_else(|| panic!("Done for unknown {id}"));
                    assert_eq!(e.started_on, Some(l), "Done on a link that did not start the transfer");
                }
                other => panic!("the receiver sent a sender's frame: {other:?}"),
            }
        }
    }

    /// Starts a send of source blocks picked by the input to the fake receiver.
    fn send(&mut self, input: &mut Input<'_>) {
        if self.sends.len() >= 3 {
            return;
        }
        let n = input.u8() % 4;
        let src: Vec<u32> = (0..n).map(|i| (u32::from(input.u8()) + u32::from(i)) % NUM_BLOCKS).collect();
        let desc = TransferDescriptor {
            id: input.u64(),
            endpoint: "fuzz://receiver".into(),
            dst_blocks: (0..u32::from(n)).collect(),
            geometry: geometry(),
            binding: BINDINGS[0],
        };
        if let Ok(handle) = self.connector().send(&desc, src, BINDINGS[0], None) {
            self.sends.push(Sending { handle, done_after_all: false });
        }
    }

    /// Answers on the outgoing link of a send: HelloAck/HelloReject/Done/Abort/garbage.
    async fn answer_send(&mut self, input: &mut Input<'_>) {
        if self.sends.is_empty() {
            return;
        }
        let s = usize::from(input.u8()) % self.sends.len();
        // The send's link: the outgoing link whose Start names its id, or the latest one.
        let id = self.sends[s].handle.id();
        let outgoing = self.transport.outgoing.lock().expect("lock").clone();
        let link = outgoing
            .iter()
            .find(|o| o.sent.lock().expect("lock").frames.iter().any(|f| matches!(f, Frame::Start { id: i, .. } if *i == id)))
            .or(outgoing.last())
            .cloned();
        let Some(link) = link else { return };
        let (frame, payload_len) = match input.u8() % 6 {
            0 | 1 => (Frame::HelloAck { version: if input.u8().is_multiple_of(4) { input.u16() } else { PROTOCOL_VERSION } }, 0),
            2 => (Frame::HelloReject { reason: "fuzz".into() }, 0),
            3 => (Frame::Done { id }, 0),
            4 => (Frame::Abort { id, code: AbortCode::Rejected, reason: "fuzz".into() }, 0),
            _ => (Frame::Start { id, num_blocks: 0, blocks_hash: 0, binding: 0 }, u64::from(input.u8() % 2)),
        };
        // The shadow of the sender's view: a right HelloAck, and a Done after every chunk went out.
        let sent_chunks = link.sent.lock().expect("lock").frames.iter().filter(|f| matches!(f, Frame::Chunk(c) if c.id == id)).count();
        let all_chunks = self.sends[s].handle.progress().layers == NUM_LAYERS || sent_chunks == 0 && self.src_len(s) == 0;
        let hello_seen = link.sent.lock().expect("lock").frames.iter().any(|f| matches!(f, Frame::Hello { .. }));
        match &frame {
            Frame::HelloAck { version } if hello_seen && self.answered.insert(link.id)
                && *version == PROTOCOL_VERSION => {
                    self.acked.insert(link.id);
                }
            Frame::HelloReject { .. } if hello_seen => {
                self.answered.insert(link.id);
            }
            Frame::Done { .. } if all_chunks => self.sends[s].done_after_all = true,
            _ => {}
        }
        let dyn_link: Arc<dyn Link> = Arc::clone(&link) as Arc<dyn Link>;
        if let Delivery::CloseLink(reason) = self.inbox.on_message(&dyn_link, &frame.encode(), payload_len) {
            link.close();
            self.inbox.on_link_closed(&dyn_link, reason);
        }
        settle().await;
    }

    fn src_len(&self, s: usize) -> usize {
        let id = self.sends[s].handle.id();
        let outgoing = self.transport.outgoing.lock().expect("lock").clone();
        outgoing
            .iter()
            .flat_map(|o| o.sent.lock().expect("lock").frames.clone())
            .find_map(|f| match f {
                Frame::Start { id: i, num_blocks, .. } if i == id => Some(num_blocks as usize),
                _ => None,
            })
            .unwrap_or(usize::MAX)
    }

    /// Checks every verdict, drops everything, and compares the pool with the shadow.
    async fn finish(mut self) {
        for e in &self.expected {
            let Some(h) = &e.handle else { continue };
            if let TransferState::Complete(_) = h.progress().state {
                assert!(e.start_ok, "transfer {} completed without a right Start", e.desc.id);
                for layer in 0..NUM_LAYERS {
                    for b in 0..e.desc.dst_blocks.len() as u32 {
                        assert!(e.landed.contains_key(&(layer, b)), "transfer {} completed without layer {layer} block {b}", e.desc.id);
                    }
                }
            }
        }
        let outgoing = self.transport.outgoing.lock().expect("lock").clone();
        for s in &self.sends {
            if let TransferState::Complete(_) = s.handle.progress().state {
                let id = s.handle.id();
                let link = outgoing
                    .iter()
                    .find(|o| o.sent.lock().expect("lock").frames.iter().any(|f| matches!(f, Frame::Start { id: i, .. } if *i == id)))
                    .unwrap_or_else(|| panic!("send {id} completed without sending Start"));
                assert!(self.acked.contains(&link.id), "send {id} completed on a link without a right HelloAck");
                assert!(s.done_after_all, "send {} completed without Done after its last chunk", s.handle.id());
            }
        }
        for l in 0..self.links.len() {
            self.land(l, false);
        }
        self.expected.clear();
        self.sends.clear();
        drop(self.connector.take());
        settle().await;
        // Every claim is gone now: the pool must be exactly the shadow.
        let mut block = vec![0u8; self.block_bytes];
        for layer in 0..NUM_LAYERS {
            for b in 0..NUM_BLOCKS {
                self.memory.read_block(layer, b, &mut block).expect("no claim is left");
                let at = b as usize * self.block_bytes;
                assert!(
                    block == self.shadow[layer as usize][at..at + self.block_bytes],
                    "layer {layer} block {b} holds bytes no payload wrote there"
                );
            }
        }
    }
}

/// Writes `payload` into `iovs`, as a transport does.
fn write_iovs(iovs: &[Iov], payload: &[u8]) {
    let mut at = 0;
    for iov in iovs {
        // SAFETY: the connector handed out these host iovecs for this payload (`Delivery::Into`), inside
        // its registered pool, and keeps their blocks claimed exclusively until `on_payload`; their
        // lengths sum to the payload's (asserted by the caller).
        let dst = unsafe { std::slice::from_raw_parts_mut(iov.addr as *mut u8, iov.len) };
        dst.copy_from_slice(&payload[at..at + iov.len]);
        at += iov.len;
    }
}
