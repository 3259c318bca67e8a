//! The in-process backend: connectors of one process (the embedded cluster, tests) reach each other
//! through a shared [`Fabric`]; a message is delivered by calling the peer's inbox directly and a payload
//! is one memcpy from the source blocks into the destination blocks.
//!
//! Invariants: messages on a link are delivered one at a time, in send order; closing either end (or
//! dropping its transport) makes the other end report `on_link_closed`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::core::lock;
use crate::error::{Error, Result};
use crate::memory::{Iov, MemoryKind};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

#[derive(Default)]
struct FabricInner {
    next: u64,
    nodes: HashMap<String, Weak<InprocTransport>>,
}

/// The namespace in-process connectors register in. Clone it to share it.
#[derive(Clone, Default)]
pub struct Fabric {
    inner: Arc<Mutex<FabricInner>>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric").field("nodes", &lock(&self.inner).nodes.len()).finish()
    }
}

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Fabric {
        Fabric::default()
    }

    /// Registers a transport under `name` (or a fresh one).
    pub fn register(&self, name: Option<String>, inbox: Arc<dyn Inbox>) -> Result<Arc<InprocTransport>> {
        let mut inner = lock(&self.inner);
        inner.nodes.retain(|_, w| w.strong_count() > 0);
        let name = match name {
            Some(n) => n,
            None => {
                inner.next += 1;
                format!("node-{}", inner.next)
            }
        };
        if inner.nodes.contains_key(&name) {
            return Err(Error::Invalid(format!("inproc endpoint {name:?} is already registered")));
        }
        let transport = Arc::new_cyclic(|me| InprocTransport {
            endpoint: format!("inproc://{name}"),
            fabric: self.clone(),
            inbox,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            shut: AtomicBool::new(false),
            me: me.clone(),
        });
        inner.nodes.insert(name, Arc::downgrade(&transport));
        Ok(transport)
    }

    fn lookup(&self, endpoint: &str) -> Option<Arc<InprocTransport>> {
        let name = endpoint.strip_prefix("inproc://")?;
        lock(&self.inner).nodes.get(name)?.upgrade()
    }
}

/// One in-process node.
pub struct InprocTransport {
    endpoint: String,
    fabric: Fabric,
    inbox: Arc<dyn Inbox>,
    links: Mutex<HashMap<u64, Arc<InprocLink>>>,
    next_link: AtomicU64,
    shut: AtomicBool,
    me: Weak<InprocTransport>,
}

impl InprocTransport {
    fn new_link(&self, peer: &str) -> Arc<InprocLink> {
        let link = Arc::new(InprocLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            peer: peer.to_string(),
            owner: self.me.clone(),
            other: OnceLock::new(),
            closed: AtomicBool::new(false),
            order: tokio::sync::Mutex::new(()),
        });
        lock(&self.links).insert(link.id, Arc::clone(&link));
        link
    }

    fn connect_now(&self, endpoint: &str) -> Result<Arc<dyn Link>> {
        let unreachable = |reason: &str| Error::Unreachable { endpoint: endpoint.to_string(), reason: reason.into() };
        if self.shut.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        let peer = self.fabric.lookup(endpoint).ok_or_else(|| unreachable("no such in-process endpoint"))?;
        if peer.shut.load(Ordering::Acquire) {
            return Err(unreachable("endpoint is shut down"));
        }
        let ours = self.new_link(endpoint);
        let theirs = peer.new_link(&self.endpoint);
        let _ = ours.other.set(Arc::downgrade(&theirs));
        let _ = theirs.other.set(Arc::downgrade(&ours));
        Ok(ours)
    }
}

impl Transport for InprocTransport {
    fn name(&self) -> &str {
        "inproc"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities(Capabilities::HOST_MEMORY)
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, Result<Arc<dyn Link>>> {
        Box::pin(async move { self.connect_now(endpoint) })
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        let links: Vec<Arc<InprocLink>> = lock(&self.links).drain().map(|(_, l)| l).collect();
        for link in links {
            link.close();
        }
    }
}

impl Drop for InprocTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One end of an in-process link.
struct InprocLink {
    id: u64,
    peer: String,
    owner: Weak<InprocTransport>,
    other: OnceLock<Weak<InprocLink>>,
    closed: AtomicBool,
    /// Serialises deliveries so messages arrive whole and in order.
    order: tokio::sync::Mutex<()>,
}

impl InprocLink {
    fn err(&self, reason: &str) -> Error {
        Error::LinkFailed { peer: self.peer.clone(), reason: reason.into() }
    }

    /// The other end and its node's inbox, if both are alive and open.
    fn remote(&self) -> Option<(Arc<InprocLink>, Arc<InprocTransport>)> {
        let other = self.other.get()?.upgrade()?;
        let node = other.owner.upgrade()?;
        if other.closed.load(Ordering::Acquire) || node.shut.load(Ordering::Acquire) {
            return None;
        }
        Some((other, node))
    }
}

/// Copies `src` pieces into `dst` pieces of the same total length.
fn scatter_copy(src: &[Iov], dst: &[Iov]) {
    let (mut si, mut so, mut di, mut doff) = (0, 0, 0, 0);
    while si < src.len() && di < dst.len() {
        let n = (src[si].len - so).min(dst[di].len - doff);
        // SAFETY: both iovecs are host memory handed out by registered pools: the source is claimed for
        // reading by the sender, the destination exclusively by the receiver until on_payload; they are
        // distinct claims, so the ranges never overlap. Offsets stay within each iovec's length.
        unsafe {
            std::ptr::copy_nonoverlapping((src[si].addr + so) as *const u8, (dst[di].addr + doff) as *mut u8, n);
        }
        so += n;
        doff += n;
        if so == src[si].len {
            si += 1;
            so = 0;
        }
        if doff == dst[di].len {
            di += 1;
            doff = 0;
        }
    }
}

impl Link for InprocLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let _order = self.order.lock().await;
            if self.closed.load(Ordering::Acquire) {
                return Err(self.err("link closed"));
            }
            let Some((other, node)) = self.remote() else { return Err(self.err("peer is gone")) };
            if payload.iovs().iter().any(|i| i.kind != MemoryKind::Host) {
                return Err(Error::Unsupported { backend: "inproc".into(), what: "device memory".into() });
            }
            let other_dyn: Arc<dyn Link> = other;
            match node.inbox.on_message(&other_dyn, &header, payload.len()) {
                Delivery::Discard => Ok(()),
                Delivery::CloseLink(reason) => {
                    tracing::debug!(%reason, "inproc peer closed the link");
                    self.close();
                    Err(self.err(&reason))
                }
                Delivery::Into { iovs, token } => {
                    let total: u64 = iovs.iter().map(|i| i.len as u64).sum();
                    if total != payload.len() || iovs.iter().any(|i| i.kind != MemoryKind::Host) {
                        node.inbox.on_payload(&other_dyn, token, Err("iovecs do not match the payload".into()));
                        return Err(self.err("receiver could not take the payload"));
                    }
                    scatter_copy(payload.iovs(), &iovs);
                    node.inbox.on_payload(&other_dyn, token, Ok(Landed::default()));
                    Ok(())
                }
            }
        })
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(node) = self.owner.upgrade() {
            lock(&node.links).remove(&self.id);
        }
        // The other end sees a failure it did not cause.
        if let Some(other) = self.other.get().and_then(Weak::upgrade)
            && !other.closed.swap(true, Ordering::AcqRel)
            && let Some(node) = other.owner.upgrade()
        {
            lock(&node.links).remove(&other.id);
            let other_dyn: Arc<dyn Link> = other;
            node.inbox.on_link_closed(&other_dyn, "peer closed the link".into());
        }
    }
}
