//! HTTPS for the OpenAI-compatible API: an axum [`Listener`] that accepts TCP connections and yields
//! them once their TLS handshake (rustls) finished.
//!
//! Invariants:
//! - Handshakes run in tasks of their own, never in the accept loop, so a client that stalls its
//!   handshake delays nobody; each is bounded by [`HANDSHAKE_TIMEOUT`] and at most
//!   [`MAX_HANDSHAKES`] run at once (connections beyond wait in the kernel's backlog).
//! - A connection whose handshake fails is closed and logged at debug; it never reaches the app.
//! - Dropping the listener stops the accept loop and closes the socket.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;

/// How long a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once.
pub const MAX_HANDSHAKES: usize = 256;

/// A TLS listener for [`axum::serve`].
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Serves TLS with `config` on `listener`.
    pub fn new(listener: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let accept = tokio::spawn(async move {
            loop {
                let Ok(slot) = Arc::clone(&slots).acquire_owned().await else { return };
                let (tcp, peer) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::debug!(error = %e, "HTTPS accept failed");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    },
                    _ = tx.closed() => return,
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "HTTPS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "HTTPS handshake timed out"),
                    }
                    drop(slot);
                });
            }
        });
        Ok(TlsListener { ready, local, accept })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop ended (it only does when this listener is dropped): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
