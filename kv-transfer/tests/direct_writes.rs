//! Protocol 4 between two connectors whose links report `writes_directly` (the `inproc` backend
//! wrapped so that it says so; docs/rfc-kv-sender-writes.md): the receiver grants each expected
//! transfer, a granted sender hands its transport every payload with its destination (only for the
//! content and blocks the grant names), a failed
//! transfer is fenced and ends only once the sender answered, and a fenced transfer never starts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_kv_transfer::transport::{BoxFuture, Capabilities, Delivery, Dest, Inbox, Landed, Link, Payload, Transport, WritePlan};
use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, DType, Error, Fabric, Geometry, GeometrySpec, KvMemory, Layout, make_transport};

/// A plan a link took to write ahead: layers, chunks, source and destination blocks.
type Plan = (std::ops::Range<u32>, Vec<(usize, usize)>, Vec<u32>, Vec<u32>);

/// What the wrapped links saw.
#[derive(Default)]
struct Seen {
    dests: Mutex<Vec<Dest>>,
    drains: AtomicUsize,
    /// Whether the links take plans to write ahead, and the plans they took.
    ahead: AtomicBool,
    plans: Mutex<Vec<Plan>>,
}

/// A link that says its sender writes the receiver's blocks itself (the bytes still go through the
/// inner link), recording the destinations its payloads came with.
struct Direct {
    inner: Arc<dyn Link>,
    seen: Arc<Seen>,
}

impl Link for Direct {
    fn id(&self) -> u64 {
        self.inner.id()
    }
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, tandem_kv_transfer::Result<()>> {
        if let Some(d) = payload.dest() {
            self.seen.dests.lock().unwrap().push(d.clone());
        }
        self.inner.send(header, payload)
    }
    fn close(&self) {
        self.inner.close()
    }
    fn writes_directly(&self) -> bool {
        true
    }
    fn write_ahead(&self, plan: WritePlan<'_>) -> tandem_kv_transfer::Result<Option<Vec<u64>>> {
        if !self.seen.ahead.load(Ordering::Acquire) {
            return Ok(None);
        }
        let n = plan.layers.len() * plan.chunks.len();
        self.seen.plans.lock().unwrap().push((plan.layers.clone(), plan.chunks.to_vec(), plan.src.to_vec(), plan.dst.to_vec()));
        // (The bytes still go through the inner link with the messages.)
        Ok(Some((0..n as u64).map(|i| 100 + i).collect()))
    }
    fn drain(&self) -> BoxFuture<'_, tandem_kv_transfer::Result<()>> {
        self.seen.drains.fetch_add(1, Ordering::AcqRel);
        Box::pin(async { Ok(()) })
    }
}

/// The connector's inbox, seeing every incoming link as a `Direct` one (one wrapper per link).
struct WrapInbox {
    inner: Arc<dyn Inbox>,
    seen: Arc<Seen>,
    links: Mutex<HashMap<u64, Arc<dyn Link>>>,
}

impl WrapInbox {
    fn wrap(&self, link: &Arc<dyn Link>) -> Arc<dyn Link> {
        let mut links = self.links.lock().unwrap();
        Arc::clone(links.entry(link.id()).or_insert_with(|| Arc::new(Direct { inner: Arc::clone(link), seen: Arc::clone(&self.seen) })))
    }
}

impl Inbox for WrapInbox {
    fn on_message(&self, link: &Arc<dyn Link>, header: &[u8], payload_len: u64) -> Delivery {
        self.inner.on_message(&self.wrap(link), header, payload_len)
    }
    fn on_payload(&self, link: &Arc<dyn Link>, token: u64, result: Result<Landed, String>) {
        self.inner.on_payload(&self.wrap(link), token, result)
    }
    fn on_link_closed(&self, link: &Arc<dyn Link>, reason: String) {
        self.inner.on_link_closed(&self.wrap(link), reason)
    }
    fn granted_blocks(&self, link: &Arc<dyn Link>, id: u64) -> Option<Vec<u32>> {
        self.inner.granted_blocks(&self.wrap(link), id)
    }
}

struct WrapTransport {
    inner: Arc<dyn Transport>,
    inbox: Arc<WrapInbox>,
}

impl Transport for WrapTransport {
    fn name(&self) -> &str {
        "direct-inproc"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn endpoint(&self) -> String {
        self.inner.endpoint()
    }
    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, tandem_kv_transfer::Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let link = self.inner.connect(endpoint).await?;
            Ok(self.inbox.wrap(&link))
        })
    }
    fn shutdown(&self) {
        self.inner.shutdown()
    }
}

const WITHIN: Duration = Duration::from_secs(5);

fn geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "direct".into(),
        dtype: DType::BF16,
        block_size: 4,
        num_layers: 3,
        num_kv_heads: 1,
        head_dim: 8,
        layout: Layout::KvHeadTokenDim,
    })
    .unwrap()
}

async fn connector(name: &str, fabric: &Fabric, seen: &Arc<Seen>) -> (Connector, Arc<KvMemory>) {
    let memory = KvMemory::host(geometry(), 8).unwrap();
    let spec: ConnectorSpec = format!("inproc://{name}").parse().unwrap();
    let (fabric, seen) = (fabric.clone(), Arc::clone(seen));
    let c = Connector::build(Arc::clone(&memory), ConnectorConfig::default(), move |inbox| async move {
        let inbox = Arc::new(WrapInbox { inner: inbox, seen, links: Mutex::new(HashMap::new()) });
        let inner = make_transport(&spec, &fabric, Arc::clone(&inbox) as Arc<dyn Inbox>).await?;
        Ok(Arc::new(WrapTransport { inner, inbox }) as Arc<dyn Transport>)
    })
    .await
    .unwrap();
    (c, memory)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_destinations_and_fences_between_direct_writing_connectors() {
    let fabric = Fabric::new();
    let (sender_seen, receiver_seen) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
    let (tx, _src) = connector("tx", &fabric, &sender_seen).await;
    let (rx, dst) = connector("rx", &fabric, &receiver_seen).await;

    // A first transfer opens the link.
    let mut recv = rx.expect(vec![0], 1, None).unwrap();
    let mut send = tx.send_ready(recv.descriptor(), vec![0], 1, None).unwrap();
    tokio::time::timeout(WITHIN, recv.wait()).await.unwrap().unwrap();
    tokio::time::timeout(WITHIN, send.wait()).await.unwrap().unwrap();

    // Expected once the link is there: granted at once; the sender hands every payload to its
    // transport with the destination the receiver named.
    let mut recv = rx.expect(vec![6, 2], 1, None).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await; // the grant travels through a reply task
    sender_seen.dests.lock().unwrap().clear();
    let mut send = tx.send_ready(recv.descriptor(), vec![1, 3], 1, None).unwrap();
    tokio::time::timeout(WITHIN, recv.wait()).await.unwrap().unwrap();
    tokio::time::timeout(WITHIN, send.wait()).await.unwrap().unwrap();
    let dests = sender_seen.dests.lock().unwrap().clone();
    let want: Vec<Dest> = (0..3).map(|layer| Dest { layer, blocks: vec![6, 2], written: None }).collect();
    assert_eq!(dests, want);

    // A link that writes ahead gets every ready layer in one plan before the messages are built,
    // and each payload then names the ticket of its chunk.
    sender_seen.ahead.store(true, Ordering::Release);
    let mut recv = rx.expect(vec![5, 4], 1, None).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    sender_seen.dests.lock().unwrap().clear();
    let mut send = tx.send_ready(recv.descriptor(), vec![2, 0], 1, None).unwrap();
    tokio::time::timeout(WITHIN, recv.wait()).await.unwrap().unwrap();
    tokio::time::timeout(WITHIN, send.wait()).await.unwrap().unwrap();
    let plans = std::mem::take(&mut *sender_seen.plans.lock().unwrap());
    assert_eq!(plans, vec![(0..3, vec![(0, 2)], vec![2, 0], vec![5, 4])]);
    let dests = sender_seen.dests.lock().unwrap().clone();
    let want: Vec<Dest> = (0..3).map(|layer| Dest { layer, blocks: vec![5, 4], written: Some(100 + u64::from(layer)) }).collect();
    assert_eq!(dests, want);
    sender_seen.ahead.store(false, Ordering::Release);

    // A sender bound to other content than the grant names writes nothing directly: its payloads
    // go as plain payloads, and the receiver refuses them at `Start`.
    let mut recv = rx.expect(vec![7], 1, None).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    sender_seen.dests.lock().unwrap().clear();
    let mut send = tx.send_ready(recv.descriptor(), vec![1], 2, None).unwrap();
    let err = tokio::time::timeout(WITHIN, send.wait()).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Rejected { .. }), "{err}");
    let err = tokio::time::timeout(WITHIN, recv.wait()).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Rejected { .. }), "{err}");
    assert!(sender_seen.dests.lock().unwrap().is_empty(), "content the receiver refuses was handed over to be written");

    // A receiver that cancels a running transfer tells its sender why before it fences it: the
    // sender hears the cancel, not the fence (run a few times: the two frames once raced).
    for _ in 0..20 {
        let mut recv = rx.expect(vec![4, 5], 1, None).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut send = tx.send(recv.descriptor(), vec![1, 2], 1, None).unwrap();
        send.push_layer(0).unwrap();
        tokio::time::timeout(WITHIN, recv.layer_ready(0)).await.unwrap().unwrap();
        tokio::time::timeout(WITHIN, recv.cancel()).await.expect("the fence was answered");
        let err = tokio::time::timeout(WITHIN, send.wait()).await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Cancelled { by: "receiver", .. }), "{err}");
        assert_eq!(dst.claimed_blocks(), 0);
    }

    // The receiver gives a transfer up: it is fenced, the sender confirms after draining, and the
    // cancel returns with the blocks free.
    let recv = rx.expect(vec![4, 5], 1, None).unwrap();
    let desc = recv.descriptor().clone();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let drains = sender_seen.drains.load(Ordering::Acquire);
    tokio::time::timeout(WITHIN, recv.cancel()).await.expect("the fence was answered");
    assert!(sender_seen.drains.load(Ordering::Acquire) > drains, "the sender drained its writes before it answered");
    assert_eq!(dst.claimed_blocks(), 0);
    // A descriptor that reaches the sender after its fence never starts: nothing is written.
    sender_seen.dests.lock().unwrap().clear();
    let mut late = tx.send_ready(&desc, vec![1, 2], 1, None).unwrap();
    let err = tokio::time::timeout(WITHIN, late.wait()).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Rejected { .. }), "{err}");
    assert!(sender_seen.dests.lock().unwrap().is_empty());
}
