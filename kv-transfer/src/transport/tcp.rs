//! The TCP backend (tokio): one connection per peer endpoint, reused by every transfer to it and
//! multiplexed chunk by chunk. Sends write block memory straight to the socket and receives read the
//! socket straight into the destination blocks, so the only copies are the kernel's (with TLS, rustls
//! encrypts from and decrypts into its own record buffers as well).
//!
//! With [`TcpOptions::tls`] every link is mutual TLS (rustls, ring): the accepting side presents its
//! certificate and requires one from the dialling side that chains to the cluster CA; the dialling side
//! verifies the acceptor's certificate against the same CA and the endpoint's host. A connection
//! becomes a link only once its handshake succeeded, so a peer without a CA-signed certificate never
//! gets a byte read as a frame, let alone a payload written into blocks.
//!
//! Invariants:
//! - One writer at a time per connection (a FIFO mutex), and a message is written whole or the
//!   connection is closed: a send abandoned mid-message (deadline) closes the link instead of leaving
//!   half a frame on the wire.
//! - The reader never buffers a payload: it reads at most a 64 KiB prefix buffer and the header (bounded by
//!   `MAX_HEADER`), then the payload into the inbox's iovecs or through a fixed scratch buffer.
//! - Every `Delivery::Into` is answered by one `on_payload`, also when the link closes mid-payload; a link
//!   that fails reports `on_link_closed` once; a link closed locally reports nothing.
//! - An accepted connection holds nothing for free ([`TcpLimits`]): its first message must arrive
//!   within the handshake timeout, every later one within the idle timeout of the previous, and each
//!   message must arrive whole within the message timeout of its first byte; at most `max_incoming`
//!   are open at once (more are closed at accept). With TLS, connections still in their handshake count
//!   toward that cap and the handshake is bounded by the handshake timeout.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::core::lock;
use crate::error::{Error, Result};
use crate::frame::{Frame, PREFIX_LEN};
use crate::memory::MemoryKind;
use crate::transport::link_state::{Closed, LinkState};
use crate::transport::{BoxFuture, Capabilities, Delivery, Inbox, Landed, Link, Payload, Transport};

/// What an accepted connection may hold, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLimits {
    /// How long an accepted connection may take to send its first message (the handshake).
    pub handshake: Duration,
    /// How long an accepted connection may stay silent between messages. Senders stop reusing a link
    /// well before (30 s, see the connector core), so a live peer never sees its link closed under it.
    pub idle: Duration,
    /// How long one message (header and payload) may take from its first byte to its last.
    pub message: Duration,
    /// Most accepted connections open at once.
    pub max_incoming: usize,
}

impl Default for TcpLimits {
    fn default() -> Self {
        TcpLimits { handshake: Duration::from_secs(5), idle: Duration::from_secs(90), message: Duration::from_secs(30), max_incoming: 512 }
    }
}

/// Where the TCP backend listens and what it advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpOptions {
    /// Listen address; port 0 picks a free port.
    pub bind: SocketAddr,
    /// Host name or IP that peers should dial (default: the bind IP, or 127.0.0.1 if that is unspecified).
    pub advertise: Option<String>,
    /// Deadlines and caps for accepted connections.
    pub limits: TcpLimits,
    /// Mutual TLS on every link (see the module doc); `None`: plain TCP.
    pub tls: Option<TcpTls>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions { bind: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), advertise: None, limits: TcpLimits::default(), tls: None }
    }
}

/// Mutual TLS for the TCP backend: this node's certificate and key, and the cluster CA that both the
/// peers it accepts and the peers it dials must present a certificate of. Built with rustls' ring
/// provider. Two values are equal when they share their configurations.
#[derive(Clone)]
pub struct TcpTls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

impl TcpTls {
    /// Configurations from DER: `chain` (this node's certificate first), its `key`, and the `ca`
    /// certificates peers' certificates must chain to. Fails on a key that does not match the
    /// certificate, an unusable CA or key type.
    pub fn new(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>, ca: &[CertificateDer<'static>]) -> Result<TcpTls> {
        let bad = |what: &str, e: rustls::Error| Error::Invalid(format!("KV TLS {what}: {e}"));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in ca {
            roots.add(cert.clone()).map_err(|e| bad("CA certificate", e))?;
        }
        let roots = Arc::new(roots);
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
            .build()
            .map_err(|e| Error::Invalid(format!("KV TLS client verifier: {e}")))?;
        let server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| bad("certificate or key", e))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| bad("certificate or key", e))?;
        Ok(TcpTls { server: Arc::new(server), client: Arc::new(client) })
    }

    /// From configurations built elsewhere (tests use this to dial with a client that presents no
    /// certificate, or one of another CA).
    pub fn from_configs(server: Arc<rustls::ServerConfig>, client: Arc<rustls::ClientConfig>) -> TcpTls {
        TcpTls { server, client }
    }
}

impl std::fmt::Debug for TcpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TcpTls { mutual }")
    }
}

impl PartialEq for TcpTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.server, &other.server) && Arc::ptr_eq(&self.client, &other.client)
    }
}

impl Eq for TcpTls {}

/// A link's reading and writing halves: a plain socket's, or a TLS stream's.
type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

fn split_plain(stream: TcpStream) -> (ReadHalf, WriteHalf) {
    let (rd, wr) = stream.into_split();
    (Box::new(rd), Box::new(wr))
}

fn split_tls<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(stream: S) -> (ReadHalf, WriteHalf) {
    let (rd, wr) = tokio::io::split(stream);
    (Box::new(rd), Box::new(wr))
}

/// The host of `HOST:PORT` (brackets of an IPv6 literal removed).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}


/// The TCP transport; see the module doc.
pub struct TcpTransport {
    endpoint: String,
    limits: TcpLimits,
    tls: Option<TcpTls>,
    /// Accepted connections still in their TLS handshake.
    handshaking: Arc<AtomicUsize>,
    inbox: Arc<dyn Inbox>,
    links: Mutex<HashMap<u64, Arc<TcpLink>>>,
    next_link: AtomicU64,
    accept: Mutex<Option<JoinHandle<()>>>,
    shut: AtomicBool,
    me: Weak<TcpTransport>,
}

impl TcpTransport {
    /// Binds the listener and starts accepting links.
    pub async fn bind(opts: &TcpOptions, inbox: Arc<dyn Inbox>) -> Result<Arc<TcpTransport>> {
        let listener = TcpListener::bind(opts.bind)
            .await
            .map_err(|e| Error::Invalid(format!("cannot listen on {}: {e}", opts.bind)))?;
        let local = listener.local_addr().map_err(|e| Error::Invalid(format!("listener address: {e}")))?;
        let host = match &opts.advertise {
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => "127.0.0.1".to_string(),
            None => local.ip().to_string(),
        };
        let endpoint = if host.contains(':') && !host.starts_with('[') {
            format!("tcp://[{host}]:{}", local.port())
        } else {
            format!("tcp://{host}:{}", local.port())
        };
        let transport = Arc::new_cyclic(|me| TcpTransport {
            endpoint,
            limits: opts.limits,
            tls: opts.tls.clone(),
            handshaking: Arc::new(AtomicUsize::new(0)),
            inbox,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            accept: Mutex::new(None),
            shut: AtomicBool::new(false),
            me: me.clone(),
        });
        let me = Arc::downgrade(&transport);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let Some(t) = me.upgrade() else { return };
                let incoming = lock(&t.links).values().filter(|l| l.incoming).count() + t.handshaking.load(Ordering::Acquire);
                if incoming >= t.limits.max_incoming {
                    tracing::warn!(%peer, max = t.limits.max_incoming, "KV connection refused: too many incoming connections are open");
                    drop(stream);
                    continue;
                }
                match &t.tls {
                    None => {
                        let _ = stream.set_nodelay(true);
                        t.adopt(split_plain(stream), peer.to_string(), true);
                    }
                    Some(tls) => t.accept_tls(stream, peer, Arc::clone(&tls.server)),
                }
            }
        });
        *lock(&transport.accept) = Some(task);
        Ok(transport)
    }

    /// Runs an accepted connection's TLS handshake in a task of its own (bounded by the handshake
    /// timeout, counted toward `max_incoming`) and adopts it as a link only if the peer presented a
    /// certificate of the cluster CA.
    fn accept_tls(&self, stream: TcpStream, peer: SocketAddr, config: Arc<rustls::ServerConfig>) {
        let _ = stream.set_nodelay(true);
        let me = self.me.clone();
        let handshaking = Arc::clone(&self.handshaking);
        handshaking.fetch_add(1, Ordering::AcqRel);
        let timeout = self.limits.handshake;
        tokio::spawn(async move {
            let accepted = tokio::time::timeout(timeout, tokio_rustls::TlsAcceptor::from(config).accept(stream)).await;
            handshaking.fetch_sub(1, Ordering::AcqRel);
            match accepted {
                Ok(Ok(tls)) => {
                    if let Some(t) = me.upgrade() {
                        t.adopt(split_tls(tls), peer.to_string(), true);
                    }
                }
                Ok(Err(e)) => tracing::warn!(%peer, error = %e, "KV connection refused: TLS handshake failed"),
                Err(_) => tracing::warn!(%peer, "KV connection refused: no TLS handshake in {timeout:?}"),
            }
        });
    }

    /// Registers a connected stream as a link and starts its reader. `incoming`: accepted here (held to
    /// the idle and handshake deadlines), not dialled.
    fn adopt(&self, (rd, wr): (ReadHalf, WriteHalf), peer: String, incoming: bool) -> Arc<TcpLink> {
        let (state, closed_rx) = LinkState::new(peer);
        let link = Arc::new(TcpLink {
            id: self.next_link.fetch_add(1, Ordering::Relaxed),
            incoming,
            writer: tokio::sync::Mutex::new(Some(wr)),
            state,
        });
        lock(&self.links).insert(link.id, Arc::clone(&link));
        if self.shut.load(Ordering::Acquire) {
            link.close();
        }
        let reader = Reader { inbox: Arc::clone(&self.inbox), link: Arc::clone(&link), transport: self.me.clone(), limits: self.limits };
        tokio::spawn(reader.run(rd, closed_rx));
        link
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities(Capabilities::HOST_MEMORY | Capabilities::CROSS_HOST | Capabilities::CROSS_PROCESS)
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn connect<'a>(&'a self, endpoint: &'a str) -> BoxFuture<'a, Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let unreachable = |reason: String| Error::Unreachable { endpoint: endpoint.to_string(), reason };
            let addr = endpoint
                .strip_prefix("tcp://")
                .ok_or_else(|| unreachable("not a tcp:// endpoint".into()))?;
            if self.shut.load(Ordering::Acquire) {
                return Err(Error::Shutdown);
            }
            let stream = TcpStream::connect(addr).await.map_err(|e| unreachable(e.to_string()))?;
            let _ = stream.set_nodelay(true);
            let halves = match &self.tls {
                None => split_plain(stream),
                Some(tls) => {
                    let name = ServerName::try_from(host_of(addr).to_string())
                        .map_err(|e| unreachable(format!("no TLS server name in {addr:?}: {e}")))?;
                    let handshake = tokio_rustls::TlsConnector::from(Arc::clone(&tls.client)).connect(name, stream);
                    let tls = tokio::time::timeout(self.limits.handshake, handshake)
                        .await
                        .map_err(|_| unreachable(format!("no TLS handshake in {:?}", self.limits.handshake)))?
                        .map_err(|e| unreachable(format!("TLS handshake: {e}")))?;
                    split_tls(tls)
                }
            };
            let link: Arc<dyn Link> = self.adopt(halves, endpoint.to_string(), false);
            Ok(link)
        })
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        if let Some(task) = lock(&self.accept).take() {
            task.abort();
        }
        let links: Vec<Arc<TcpLink>> = lock(&self.links).drain().map(|(_, l)| l).collect();
        for link in links {
            link.close();
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One TCP connection.
struct TcpLink {
    id: u64,
    incoming: bool,
    writer: tokio::sync::Mutex<Option<WriteHalf>>,
    state: LinkState,
}

impl TcpLink {
    async fn write_message(&self, header: &[u8], payload: &Payload) -> Result<()> {
        let mut guard = self.writer.lock().await;
        let Some(wr) = guard.as_mut() else { return Err(self.state.err("link closed")) };
        // Until the message is fully written, dropping this future (deadline) or failing leaves a torn
        // frame: the guard closes the link in that case.
        let mut torn = self.state.torn_guard();
        wr.write_all(header).await.map_err(|e| self.state.err(e.to_string()))?;
        for iov in payload.iovs() {
            if iov.kind != MemoryKind::Host {
                return Err(Error::Unsupported { backend: "tcp".into(), what: "device memory".into() });
            }
            // SAFETY: the iovec comes from registered host memory; the payload's hold keeps the sender's
            // claim alive until this future ends, so the owner does not write these blocks meanwhile.
            let bytes = unsafe { std::slice::from_raw_parts(iov.addr as *const u8, iov.len) };
            wr.write_all(bytes).await.map_err(|e| self.state.err(e.to_string()))?;
        }
        // TLS keeps the last record buffered until flushed (a no-op on a plain socket).
        wr.flush().await.map_err(|e| self.state.err(e.to_string()))?;
        torn.disarm();
        Ok(())
    }
}

impl Link for TcpLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn peer(&self) -> &str {
        self.state.peer()
    }

    fn send(&self, header: Vec<u8>, payload: Payload) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.state.guarded(async move { self.write_message(&header, &payload).await }))
    }

    fn close(&self) {
        self.state.close();
    }
}

/// The reading half of one link, run as a task.
struct Reader {
    inbox: Arc<dyn Inbox>,
    link: Arc<TcpLink>,
    transport: Weak<TcpTransport>,
    limits: TcpLimits,
}

const SCRATCH: usize = 64 * 1024;

impl Reader {
    async fn run(self, rd: ReadHalf, mut closed: watch::Receiver<Closed>) {
        let mut rd = BufReader::with_capacity(SCRATCH, rd);
        let dyn_link: Arc<dyn Link> = Arc::clone(&self.link) as Arc<dyn Link>;
        let mut first = true;
        let natural = loop {
            // Wait for the next message's first byte: bounded on accepted links.
            let wait = if first { self.limits.handshake } else { self.limits.idle };
            let ready = tokio::select! {
                r = rd.fill_buf() => r.map(|b| !b.is_empty()).map_err(|e| e.to_string()),
                _ = closed.wait_for(|c| *c != Closed::Open) => Err("link closed".into()),
                _ = tokio::time::sleep(wait), if self.link.incoming => {
                    Err(if first { "no handshake in time".to_string() } else { format!("idle for {wait:?}") })
                }
            };
            match ready {
                Ok(true) => {}
                Ok(false) => break "peer closed the connection".to_string(),
                Err(reason) => break reason,
            }
            first = false;
            let deadline = self.link.incoming.then(|| tokio::time::Instant::now() + self.limits.message);
            if let Err(reason) = self.one_message(&mut rd, &dyn_link, &mut closed, deadline).await {
                break reason;
            }
        };
        // Mark the link closed (a failure unless someone closed it first) and drop the writer.
        self.link.state.fail(natural);
        let how = closed.borrow().clone();
        if let Some(t) = self.transport.upgrade() {
            lock(&t.links).remove(&self.link.id);
        }
        if let Some(mut wr) = self.link.writer.lock().await.take() {
            let _ = wr.shutdown().await;
        }
        if let Closed::Failed(reason) = how {
            tracing::debug!(peer = %self.link.state.peer(), %reason, "KV link closed");
            self.inbox.on_link_closed(&dyn_link, reason);
        }
    }

    /// Reads `buf` whole, unless the link closes or the message's `deadline` passes.
    async fn read_exact<R>(rd: &mut R, buf: &mut [u8], closed: &mut watch::Receiver<Closed>, deadline: Option<tokio::time::Instant>) -> Result<(), String>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let late = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = rd.read_exact(buf) => r.map(|_| ()).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof { "peer closed the connection".to_string() } else { e.to_string() }
            }),
            _ = closed.wait_for(|c| *c != Closed::Open) => Err("link closed".into()),
            _ = late => Err("a message took too long to arrive".to_string()),
        }
    }

    async fn one_message(
        &self,
        rd: &mut BufReader<ReadHalf>,
        link: &Arc<dyn Link>,
        closed: &mut watch::Receiver<Closed>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<(), String> {
        let mut prefix = [0u8; PREFIX_LEN];
        Self::read_exact(rd, &mut prefix, closed, deadline).await?;
        let rest = Frame::remaining_len(&prefix).map_err(|e| e.to_string())?;
        let mut header = vec![0u8; PREFIX_LEN + rest];
        header[..PREFIX_LEN].copy_from_slice(&prefix);
        Self::read_exact(rd, &mut header[PREFIX_LEN..], closed, deadline).await?;
        let payload_len = match Frame::decode(&header) {
            Ok(Frame::Chunk(h) | Frame::ChunkUnsummed(h)) => h.byte_len,
            Ok(_) => 0,
            Err(e) => return Err(e.to_string()),
        };
        match self.inbox.on_message(link, &header, payload_len) {
            Delivery::CloseLink(reason) => Err(reason),
            Delivery::Discard => {
                let mut scratch = vec![0u8; SCRATCH.min(payload_len as usize)];
                let mut left = payload_len;
                while left > 0 {
                    let n = left.min(scratch.len() as u64) as usize;
                    Self::read_exact(rd, &mut scratch[..n], closed, deadline).await?;
                    left -= n as u64;
                }
                Ok(())
            }
            Delivery::Into { iovs, token } => {
                let total: u64 = iovs.iter().map(|i| i.len as u64).sum();
                let result = if total != payload_len {
                    Err(format!("inbox gave {total} bytes of iovecs for a {payload_len}-byte payload"))
                } else if iovs.iter().any(|i| i.kind != MemoryKind::Host) {
                    Err("device memory is not supported by the tcp backend".to_string())
                } else {
                    let mut r = Ok(());
                    for iov in &iovs {
                        // SAFETY: the inbox handed out these host iovecs for this payload and keeps the
                        // destination blocks claimed (exclusively) until on_payload below.
                        let buf = unsafe { std::slice::from_raw_parts_mut(iov.addr as *mut u8, iov.len) };
                        if let Err(e) = Self::read_exact(rd, buf, closed, deadline).await {
                            r = Err(e);
                            break;
                        }
                    }
                    r
                };
                self.inbox.on_payload(link, token, result.clone().map(|()| Landed::default()));
                result
            }
        }
    }
}
