//! The TCP backend with mutual TLS: transfers between peers holding certificates of the cluster CA
//! work; a peer without one (plain TCP, TLS without a client certificate, a certificate of another
//! CA) is refused at the handshake, before anything it sends is read as a frame, so no KV lands and
//! no block is claimed on its behalf.

use std::sync::Arc;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tandem_kv_transfer::frame::{Frame, PROTOCOL_VERSION};
use tandem_kv_transfer::transport::tcp::{TcpOptions, TcpTls};
use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, DType, Fabric, Geometry, GeometrySpec, KvMemory, Layout};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA and one certificate (server and client use, for 127.0.0.1) it signed.
struct Pki {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: Vec<u8>,
}

impl Pki {
    fn new() -> Pki {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::default();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer).unwrap();
        Pki { ca: ca.der().clone(), cert: cert.der().clone(), key: key.serialize_der() }
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone()))
    }

    /// Mutual TLS as a node runs it: this certificate, this CA.
    fn tls(&self) -> TcpTls {
        TcpTls::new(vec![self.cert.clone()], self.key(), std::slice::from_ref(&self.ca)).unwrap()
    }

    fn roots(&self) -> Arc<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).unwrap();
        Arc::new(roots)
    }
}

fn geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "tls".into(),
        dtype: DType::F32,
        block_size: 4,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 8,
        layout: Layout::KvHeadTokenDim,
    })
    .unwrap()
}

fn config() -> ConnectorConfig {
    ConnectorConfig { transfer_timeout: Duration::from_secs(10), ..ConnectorConfig::default() }
}

async fn connector(tls: Option<TcpTls>, memory: &Arc<KvMemory>) -> Connector {
    let spec = ConnectorSpec::Tcp(TcpOptions { tls, ..TcpOptions::default() });
    Connector::from_spec(&spec, Arc::clone(memory), config(), &Fabric::new()).await.unwrap()
}

/// A source pool whose blocks 0..4 hold recognisable bytes.
fn source() -> Arc<KvMemory> {
    let src = KvMemory::host(geometry(), 16).unwrap();
    let bb = geometry().block_bytes();
    for b in 0..4 {
        src.write_block(0, b, &vec![b as u8 + 1; bb]).unwrap();
        src.write_block(1, b, &vec![b as u8 + 9; bb]).unwrap();
    }
    src
}

/// Whether blocks 8..12 of `memory` are still all zeros on every layer.
fn untouched(memory: &Arc<KvMemory>) -> bool {
    let mut out = vec![0u8; geometry().block_bytes()];
    (0..2).all(|layer| {
        (8..12).all(|b| {
            memory.read_block(layer, b, &mut out).unwrap();
            out.iter().all(|&x| x == 0)
        })
    })
}

/// Sends blocks 0..4 of a fresh source over `tx` into blocks 8..12 of the receiver `rx`.
async fn transfer(tx: &Connector, rx: &Connector) -> Result<(), tandem_kv_transfer::Error> {
    let mut recv = rx.expect(vec![8, 9, 10, 11], 0, None)?;
    let mut send = tx.send(recv.descriptor(), vec![0, 1, 2, 3], 0, None)?;
    send.push_all();
    match send.wait().await {
        Ok(_) => recv.wait().await.map(|_| ()),
        Err(e) => {
            recv.cancel().await;
            Err(e)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_of_the_cluster_ca_transfer_over_tls() {
    let pki = Pki::new();
    let (src, dst) = (source(), KvMemory::host(geometry(), 16).unwrap());
    let (tx, rx) = (connector(Some(pki.tls()), &src).await, connector(Some(pki.tls()), &dst).await);
    transfer(&tx, &rx).await.unwrap();
    let mut out = vec![0u8; geometry().block_bytes()];
    dst.read_block(1, 10, &mut out).unwrap();
    assert_eq!(out, vec![11u8; geometry().block_bytes()]);
    assert_eq!(rx.metrics().received_ok, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_a_certificate_of_the_cluster_ca_are_refused_before_any_kv_moves() {
    let (cluster, other) = (Pki::new(), Pki::new());
    let dst = KvMemory::host(geometry(), 16).unwrap();
    let rx = connector(Some(cluster.tls()), &dst).await;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = || rustls::ClientConfig::builder_with_provider(Arc::clone(&provider)).with_safe_default_protocol_versions().unwrap();
    // A server config for the dialling-only impostors (they never accept).
    let server = Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![other.cert.clone()], other.key())
            .unwrap(),
    );
    let impostors: Vec<(&str, Option<TcpTls>)> = vec![
        ("plain TCP", None),
        ("a certificate of another CA", Some(other.tls())),
        (
            "TLS that trusts the cluster CA but presents no certificate",
            Some(TcpTls::from_configs(Arc::clone(&server), Arc::new(client().with_root_certificates(cluster.roots()).with_no_client_auth()))),
        ),
        (
            "TLS that trusts the cluster CA and presents another CA's certificate",
            Some(TcpTls::from_configs(
                Arc::clone(&server),
                Arc::new(client().with_root_certificates(cluster.roots()).with_client_auth_cert(vec![other.cert.clone()], other.key()).unwrap()),
            )),
        ),
    ];
    for (who, tls) in impostors {
        let src = source();
        let tx = connector(tls, &src).await;
        let err = transfer(&tx, &rx).await.expect_err(who);
        assert!(untouched(&dst), "{who}: KV landed ({err})");
        assert_eq!(dst.claimed_blocks(), 0, "{who}: blocks still claimed");
        let m = rx.metrics();
        assert_eq!((m.received_ok, m.bytes_received), (0, 0), "{who}: the receiver took something");
    }

    // Raw bytes (a valid handshake frame, in the clear) are not read as frames: no HelloAck comes back.
    let mut s = TcpStream::connect(rx.endpoint().strip_prefix("tcp://").unwrap()).await.unwrap();
    let _ = s.write_all(&Frame::Hello { version: PROTOCOL_VERSION, geometry: geometry() }.encode()).await;
    let mut reply = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut reply)).await;
    assert!(read.is_ok(), "the receiver must close a connection that does not speak TLS");
    assert!(reply.is_empty() || reply[0] == 0x15, "only a TLS alert may come back, got {reply:?}");

    // A receiver whose certificate is of another CA is refused by an honest sender, too.
    let src = source();
    let tx = connector(Some(cluster.tls()), &src).await;
    let (impostor_dst, honest_dst) = (KvMemory::host(geometry(), 16).unwrap(), dst);
    let impostor_rx = connector(Some(other.tls()), &impostor_dst).await;
    let err = transfer(&tx, &impostor_rx).await.expect_err("a receiver of another CA");
    assert!(untouched(&impostor_dst), "KV went to a receiver of another CA ({err})");

    // The receiver still serves members of the cluster.
    transfer(&tx, &rx).await.unwrap();
    assert!(!untouched(&honest_dst));
}
