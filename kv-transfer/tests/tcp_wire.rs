//! Hostile bytes on a real socket: whatever a peer writes (random garbage, huge length fields, wrong
//! protocol versions, frames out of place, a payload cut off mid-way), the TCP receiver closes that
//! connection, keeps no claim, allocates nothing unbounded, and keeps serving honest peers.

use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tandem_kv_transfer::frame::{ChunkHeader, Frame, PREFIX_LEN, PROTOCOL_VERSION, blocks_hash, payload_checksum};
use tandem_kv_transfer::transport::tcp::{TcpLimits, TcpOptions};
use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, DType, Error, Fabric, Geometry, GeometrySpec, KvMemory, Layout};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "wire".into(),
        dtype: DType::F32,
        block_size: 4,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 8,
        layout: Layout::KvHeadTokenDim,
    })
    .unwrap()
}

async fn receiver() -> (Connector, Arc<KvMemory>) {
    let memory = KvMemory::host(geometry(), 16).unwrap();
    let c = Connector::from_spec(&"tcp".parse::<ConnectorSpec>().unwrap(), Arc::clone(&memory), ConnectorConfig::default(), &Fabric::new())
        .await
        .unwrap();
    (c, memory)
}

async fn raw(endpoint: &str) -> TcpStream {
    TcpStream::connect(endpoint.strip_prefix("tcp://").unwrap()).await.unwrap()
}

/// Reads until the receiver closes the connection; returns what it sent. Fails the test after 5 s.
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    });
    read.await.expect("receiver must close a hostile connection promptly");
    out
}

fn hello() -> Vec<u8> {
    Frame::Hello { version: PROTOCOL_VERSION, geometry: geometry() }.encode()
}

/// An honest transfer still works on this receiver.
async fn honest_transfer(rx: &Connector) {
    let src = KvMemory::host(geometry(), 16).unwrap();
    let bb = geometry().block_bytes();
    for b in 0..4 {
        src.write_block(0, b, &vec![b as u8 + 1; bb]).unwrap();
        src.write_block(1, b, &vec![b as u8 + 9; bb]).unwrap();
    }
    let tx = Connector::from_spec(&"tcp".parse::<ConnectorSpec>().unwrap(), Arc::clone(&src), ConnectorConfig::default(), &Fabric::new())
        .await
        .unwrap();
    let mut recv = rx.expect(vec![8, 9, 10, 11], 0, None).unwrap();
    let mut send = tx.send(recv.descriptor(), vec![0, 1, 2, 3], 0, None).unwrap();
    send.push_all();
    recv.wait().await.unwrap();
    send.wait().await.unwrap();
    let mut out = vec![0u8; bb];
    rx.memory().read_block(1, 10, &mut out).unwrap();
    assert_eq!(out, vec![11u8; bb]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_garbage_closes_the_connection() {
    let (rx, memory) = receiver().await;
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    for round in 0..40 {
        let mut s = raw(&rx.endpoint()).await;
        let len = rng.random_range(1..5000);
        let mut junk = vec![0u8; len];
        rng.fill(&mut junk[..]);
        if round % 2 == 0 {
            // Half the rounds start with a valid handshake, then garbage.
            junk.splice(0..0, hello());
        }
        let _ = s.write_all(&junk).await;
        until_closed(&mut s).await;
    }
    assert_eq!(memory.claimed_blocks(), 0);
    honest_transfer(&rx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_length_fields_are_refused_without_allocating() {
    let (rx, _memory) = receiver().await;
    // A prefix announcing a 4 GiB header.
    let mut s = raw(&rx.endpoint()).await;
    let mut prefix = Frame::Done { id: 1 }.encode()[..PREFIX_LEN].to_vec();
    prefix[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    s.write_all(&prefix).await.unwrap();
    until_closed(&mut s).await;
    // A well-formed chunk header announcing an absurd payload, after a valid handshake.
    let mut s = raw(&rx.endpoint()).await;
    s.write_all(&hello()).await.unwrap();
    let mut prefix = [0u8; PREFIX_LEN];
    s.read_exact(&mut prefix).await.unwrap();
    let mut ack = prefix.to_vec();
    ack.resize(PREFIX_LEN + Frame::remaining_len(&prefix).unwrap(), 0);
    s.read_exact(&mut ack[PREFIX_LEN..]).await.unwrap();
    assert_eq!(Frame::decode(&ack).unwrap(), Frame::HelloAck { version: PROTOCOL_VERSION });
    let chunk = ChunkHeader { id: 7, layer: 0, block_start: 0, block_count: 1, byte_len: u64::MAX / 2, checksum: 0 };
    s.write_all(&Frame::Chunk(chunk).encode()).await.unwrap();
    let replies = until_closed(&mut s).await;
    assert!(replies.is_empty(), "the receiver hangs up without reading or answering: {replies:?}");
    honest_transfer(&rx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_version_gets_a_reasoned_reject() {
    let (rx, _memory) = receiver().await;
    let mut s = raw(&rx.endpoint()).await;
    s.write_all(&Frame::Hello { version: PROTOCOL_VERSION + 1, geometry: geometry() }.encode()).await.unwrap();
    let reply = until_closed(&mut s).await;
    let prefix: [u8; PREFIX_LEN] = reply[..PREFIX_LEN].try_into().unwrap();
    let n = PREFIX_LEN + Frame::remaining_len(&prefix).unwrap();
    match Frame::decode(&reply[..n]).unwrap() {
        Frame::HelloReject { reason } => assert!(reason.contains("protocol version"), "{reason}"),
        other => panic!("expected a reject, got {other:?}"),
    }
    // Frames before the handshake are refused too.
    let mut s = raw(&rx.endpoint()).await;
    s.write_all(&Frame::Start { id: 1, num_blocks: 0, blocks_hash: 0, binding: 0 }.encode()).await.unwrap();
    until_closed(&mut s).await;
    honest_transfer(&rx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_vanishing_mid_payload_fails_the_transfer_and_frees_blocks() {
    let (rx, memory) = receiver().await;
    let bb = geometry().block_bytes();
    let mut recv = rx.expect(vec![3, 4], 0, None).unwrap();
    let id = recv.descriptor().id;
    let mut s = raw(&rx.endpoint()).await;
    s.write_all(&hello()).await.unwrap();
    s.write_all(&Frame::Start { id, num_blocks: 2, blocks_hash: blocks_hash(&[3, 4]), binding: 0 }.encode()).await.unwrap();
    let payload = vec![5u8; 2 * bb];
    let chunk = ChunkHeader { id, layer: 0, block_start: 0, block_count: 2, byte_len: 2 * bb as u64, checksum: payload_checksum([&payload[..]]) };
    s.write_all(&Frame::Chunk(chunk).encode()).await.unwrap();
    s.write_all(&payload[..bb + 17]).await.unwrap(); // then the sender dies
    drop(s);
    let err = tokio::time::timeout(Duration::from_secs(5), recv.wait()).await.expect("bounded").unwrap_err();
    assert!(matches!(err, Error::LinkFailed { .. }), "{err}");
    assert_eq!(recv.progress().layers, 0, "a cut-off layer must never be reported");
    assert_eq!(memory.claimed_blocks(), 0);
    honest_transfer(&rx).await;
}

async fn receiver_with(limits: TcpLimits) -> (Connector, Arc<KvMemory>) {
    let memory = KvMemory::host(geometry(), 16).unwrap();
    let spec = ConnectorSpec::Tcp(TcpOptions { limits, ..TcpOptions::default() });
    let c = Connector::from_spec(&spec, Arc::clone(&memory), ConnectorConfig::default(), &Fabric::new()).await.unwrap();
    (c, memory)
}

/// Connections that hold the receiver without doing anything are closed: silent before the
/// handshake, idle after it, or dribbling a header that never completes. Past the cap, new ones are
/// refused at once. Honest transfers keep working throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_sent_connections_are_closed() {
    let limits = TcpLimits {
        handshake: Duration::from_millis(1000),
        idle: Duration::from_millis(1500),
        message: Duration::from_millis(400),
        max_incoming: 8,
    };
    let (rx, memory) = receiver_with(limits).await;
    let t = std::time::Instant::now();
    // Never says hello.
    let mut silent = raw(&rx.endpoint()).await;
    until_closed(&mut silent).await;
    assert!(t.elapsed() < Duration::from_secs(3), "silent connection held {:?}", t.elapsed());
    // Says hello, then nothing.
    let mut idle = raw(&rx.endpoint()).await;
    idle.write_all(&hello()).await.unwrap();
    let t = std::time::Instant::now();
    let reply = until_closed(&mut idle).await;
    assert!(!reply.is_empty(), "the hello was answered first");
    assert!(t.elapsed() >= Duration::from_millis(1400), "closed before the idle limit: {:?}", t.elapsed());
    // Half a header, never finished.
    let mut half = raw(&rx.endpoint()).await;
    let h = hello();
    half.write_all(&h[..h.len() / 2]).await.unwrap();
    let t = std::time::Instant::now();
    until_closed(&mut half).await;
    assert!(t.elapsed() < Duration::from_secs(2), "half-sent header held {:?}", t.elapsed());
    // The cap: 8 silent connections fill it; a 9th is closed at once, then an honest peer gets in
    // again once the silent ones timed out.
    let mut hogs = Vec::new();
    for _ in 0..8 {
        hogs.push(raw(&rx.endpoint()).await);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut extra = raw(&rx.endpoint()).await;
    let t = std::time::Instant::now();
    until_closed(&mut extra).await;
    assert!(t.elapsed() < Duration::from_millis(250), "a connection over the cap must be refused at once");
    for mut h in hogs {
        until_closed(&mut h).await;
    }
    honest_transfer(&rx).await;
    assert_eq!(memory.claimed_blocks(), 0);
}

/// Transfer ids are random: two receivers (or one receiver twice) never hand out related ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_ids_are_not_sequential() {
    let (rx, _memory) = receiver().await;
    let ids: Vec<u64> = (0..64).map(|i| rx.expect(vec![i % 16], 0, None).unwrap().descriptor().id).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "ids repeat");
    let close = ids.windows(2).filter(|w| w[0].abs_diff(w[1]) < (1 << 32)).count();
    assert!(close <= 1, "{close} of 63 consecutive ids are within 2^32 of each other: {ids:x?}");
}
