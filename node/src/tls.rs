//! TLS for every link of a cluster, loaded once at start-up from PEM files (`--tls-cert`, `--tls-key`,
//! `--tls-ca`) and handed out as the configurations each server and client needs: tonic's
//! [`ServerTlsConfig`] and [`ClientTlsConfig`] for gRPC, rustls configurations for the KV-transfer TCP
//! backend ([`TcpTls`]) and for the router's HTTPS listener. rustls with the ring provider everywhere.
//!
//! Who checks what:
//! - node APIs (Prefill/Decode, Info, grpc.health.v1 on a node's port) are mutual TLS: a caller must
//!   present a certificate that chains to the cluster CA ([`ClusterTls::node_server`]);
//! - the router's client APIs (gRPC and the OpenAI HTTP API) serve TLS with the router's certificate and
//!   ask for no client certificate: clients authenticate with API keys ([`ClusterTls::public_server`]);
//! - every client inside the cluster (router → decode, decode → prefill, Info, KV links) presents its
//!   own certificate and verifies the server's against the CA and the host it dials
//!   ([`ClusterTls::client`], [`endpoint`]).
//!
//! Invariants:
//! - The three files come together or not at all; a missing, unreadable or malformed file, a key that
//!   does not match its certificate, or a certificate the CA did not sign (or that is not usable as a
//!   client certificate, which every component also is) is a [`TlsError`] naming the flag, before
//!   anything binds or connects.
//! - Nothing here falls back to plaintext: with TLS loaded, [`endpoint`] dials `https://` only.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tandem_kv_transfer::transport::tcp::TcpTls;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How long a server waits for a connection's TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS flags of a server (paths as given on the command line).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// `--tls-cert`: this component's certificate (chain), PEM.
    pub cert: Option<PathBuf>,
    /// `--tls-key`: its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// `--tls-ca`: the cluster CA's certificate(s), PEM.
    pub ca: Option<PathBuf>,
}

/// What can be wrong with TLS flags or files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A flag was given without the others it needs.
    #[error("{given} needs {missing} as well (--tls-cert, --tls-key and --tls-ca go together)")]
    Incomplete {
        /// The flag given.
        given: &'static str,
        /// The flag missing.
        missing: &'static str,
    },
    /// A file could not be read.
    #[error("{flag} {}: {source}", path.display())]
    Read {
        /// The flag naming the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable PEM item of the kind the flag wants.
    #[error("{flag} {}: {what}", path.display())]
    Malformed {
        /// The flag naming the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The certificate is not one the CA signed for cluster use.
    #[error("--tls-cert {} is not accepted by --tls-ca {}: {reason}", cert.display(), ca.display())]
    NotSignedByCa {
        /// The certificate file.
        cert: PathBuf,
        /// The CA file.
        ca: PathBuf,
        /// rustls' reason.
        reason: String,
    },
    /// The key does not belong to the certificate, or rustls refused the pair.
    #[error("--tls-key {} does not fit --tls-cert {}: {reason}", key.display(), cert.display())]
    KeyMismatch {
        /// The key file.
        key: PathBuf,
        /// The certificate file.
        cert: PathBuf,
        /// rustls' reason.
        reason: String,
    },
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { flag, path: path.to_path_buf(), source })
}

fn certificates(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let malformed = |what: String| TlsError::Malformed { flag, path: path.to_path_buf(), what };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| malformed(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(malformed("no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into()));
    }
    Ok(certs)
}

fn private_key(flag: &'static str, path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| TlsError::Malformed {
        flag,
        path: path.to_path_buf(),
        what: format!("no PEM private key (PKCS#8, PKCS#1 or SEC1) in it: {e}"),
    })
}

/// The PEM certificate(s) in the file `flag` names, checked to hold at least one.
pub fn read_certificates(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = read(flag, path)?;
    certificates(flag, path, &pem)?;
    Ok(pem)
}

/// The PEM private key in the file `flag` names, checked to hold one.
pub fn read_private_key(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = read(flag, path)?;
    private_key(flag, path, &pem)?;
    Ok(pem)
}

/// Makes ring the process's rustls provider (what tonic's TLS builders use); a provider installed
/// earlier stays.
fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A client's view of TLS: the CA it trusts and, optionally, a certificate to present (`tandem client`,
/// tests). `identity` is `(cert, key)`.
pub fn client_config(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<ClientTlsConfig, TlsError> {
    install_provider();
    let ca_pem = read("--tls-ca", ca)?;
    certificates("--tls-ca", ca, &ca_pem)?;
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).timeout(HANDSHAKE_TIMEOUT);
    if let Some((cert, key)) = identity {
        let (cert_pem, key_pem) = (read("--tls-cert", cert)?, read("--tls-key", key)?);
        certificates("--tls-cert", cert, &cert_pem)?;
        private_key("--tls-key", key, &key_pem)?;
        config = config.identity(Identity::from_pem(cert_pem, key_pem));
    }
    Ok(config)
}

/// One component's TLS material, read and checked (see the module doc).
#[derive(Clone)]
pub struct ClusterTls {
    files: TlsFiles,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
    kv: TcpTls,
    https: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ClusterTls {
    /// Loads `files`: `None` when no flag was given, an error when only some were or a file is bad.
    pub fn load(files: &TlsFiles) -> Result<Option<ClusterTls>, TlsError> {
        let (cert, key, ca) = match (&files.cert, &files.key, &files.ca) {
            (None, None, None) => return Ok(None),
            (Some(c), Some(k), Some(a)) => (c, k, a),
            (Some(_), None, _) => return Err(TlsError::Incomplete { given: "--tls-cert", missing: "--tls-key" }),
            (None, Some(_), _) => return Err(TlsError::Incomplete { given: "--tls-key", missing: "--tls-cert" }),
            (Some(_), Some(_), None) => return Err(TlsError::Incomplete { given: "--tls-cert", missing: "--tls-ca" }),
            (None, None, Some(_)) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-cert" }),
        };
        install_provider();
        let (cert_pem, key_pem, ca_pem) = (read("--tls-cert", cert)?, read("--tls-key", key)?, read("--tls-ca", ca)?);
        let chain = certificates("--tls-cert", cert, &cert_pem)?;
        let private = private_key("--tls-key", key, &key_pem)?;
        let roots = certificates("--tls-ca", ca, &ca_pem)?;
        check_signed(&chain, &roots).map_err(|reason| TlsError::NotSignedByCa { cert: cert.clone(), ca: ca.clone(), reason })?;
        let mismatch = |reason: String| TlsError::KeyMismatch { key: key.clone(), cert: cert.clone(), reason };
        let https = https_server(chain.clone(), private.clone_key()).map_err(|e| mismatch(e.to_string()))?;
        let kv = TcpTls::new(chain, private, &roots).map_err(|e| mismatch(e.to_string()))?;
        Ok(Some(ClusterTls { files: files.clone(), cert_pem, key_pem, ca_pem, kv, https }))
    }

    /// The files this was loaded from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The CA certificate(s), PEM (e.g. for an etcd client reusing the cluster's files).
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// This component's certificate and key, PEM.
    pub fn identity_pem(&self) -> (&[u8], &[u8]) {
        (&self.cert_pem, &self.key_pem)
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }

    /// A node API server: this certificate, and only callers presenting a certificate of the CA.
    pub fn node_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// The router's client APIs: this certificate, no client certificate asked for.
    pub fn public_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity()).timeout(HANDSHAKE_TIMEOUT)
    }

    /// A client inside the cluster: presents this certificate, verifies servers against the CA.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(self.identity())
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// Mutual TLS for the KV-transfer TCP backend, with the same certificate and CA.
    pub fn kv(&self) -> TcpTls {
        self.kv.clone()
    }

    /// A rustls server configuration for an HTTPS listener (the OpenAI API): this certificate, HTTP/1.1,
    /// no client certificate asked for.
    pub fn https_server(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.https)
    }
}

fn https_server(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Whether `chain` (end entity first) is a client certificate the CA `roots` accept now.
fn check_signed(chain: &[CertificateDer<'static>], roots: &[CertificateDer<'static>]) -> Result<(), String> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(r.clone()).map_err(|e| format!("the CA certificate is unusable: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider)
        .build()
        .map_err(|e| e.to_string())?;
    let (end, intermediates) = chain.split_first().ok_or("no certificate")?;
    verifier.verify_client_cert(end, intermediates, UnixTime::now()).map(|_| ()).map_err(|e| e.to_string())
}

/// A gRPC endpoint for a peer at `addr` (HOST:PORT): `https://` with `tls` (the server verified
/// against the CA and HOST, this component's certificate presented), `http://` without.
pub fn endpoint(addr: &str, tls: Option<&ClusterTls>) -> Result<Endpoint, tonic::transport::Error> {
    match tls {
        None => Endpoint::from_shared(format!("http://{addr}")),
        Some(tls) => Endpoint::from_shared(format!("https://{addr}"))?.tls_config(tls.client()),
    }
}
