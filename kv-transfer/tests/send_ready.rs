//! `Connector::send_ready`: a transfer whose every layer exists runs on the caller's thread until it
//! first waits. Over the `inproc` backend (which delivers inside the sender's call) and an open
//! link, the whole transfer has landed and been verified when `send_ready` returns — on a
//! single-threaded runtime that has not run any task in between — while `send` has not started.

use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, DType, Fabric, Geometry, GeometrySpec, KvMemory, Layout, TransferState};

const BLOCKS: u32 = 6;

fn geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "send-ready".into(),
        dtype: DType::BF16,
        block_size: 4,
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 8,
        layout: Layout::KvHeadTokenDim,
    })
    .unwrap()
}

fn block(layer: u32, b: u32, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i as u32 ^ (layer * 131 + b * 17)) as u8).collect()
}

#[tokio::test(flavor = "current_thread")]
async fn send_ready_runs_the_transfer_on_the_calling_thread() {
    let g = geometry();
    let bb = g.block_bytes();
    let src = KvMemory::host(g.clone(), BLOCKS).unwrap();
    let dst = KvMemory::host(g.clone(), BLOCKS).unwrap();
    for layer in 0..g.num_layers() {
        for b in 0..BLOCKS {
            src.write_block(layer, b, &block(layer, b, bb)).unwrap();
        }
    }
    let fabric = Fabric::new();
    let spec = |name: &str| -> ConnectorSpec { format!("inproc://{name}").parse().unwrap() };
    let tx = Connector::from_spec(&spec("tx"), src, ConnectorConfig::default(), &fabric).await.unwrap();
    let rx = Connector::from_spec(&spec("rx"), std::sync::Arc::clone(&dst), ConnectorConfig::default(), &fabric).await.unwrap();

    // A first transfer opens the link (its handshake waits for the receiver's answer).
    let mut recv = rx.expect(vec![0, 1], 9, None).unwrap();
    let mut send = tx.send(recv.descriptor(), vec![0, 1], 9, None).unwrap();
    send.push_all();
    recv.wait().await.unwrap();
    send.wait().await.unwrap();

    // `send` only starts a task: nothing has moved when it returns.
    let recv = rx.expect(vec![2, 3], 9, None).unwrap();
    let lazy = tx.send(recv.descriptor(), vec![2, 3], 9, None).unwrap();
    lazy.push_all();
    assert_eq!(recv.progress().layers, 0, "send moved layers before the runtime ran its task");
    drop(lazy);
    drop(recv);

    // `send_ready` over the open link: landed and verified before it returns, no await between.
    let recv = rx.expect(vec![5, 4, 3], 9, None).unwrap();
    let mut send = tx.send_ready(recv.descriptor(), vec![3, 4, 5], 9, None).unwrap();
    let p = recv.progress();
    assert!(matches!(p.state, TransferState::Complete(_)), "not complete on return: {p:?}");
    assert_eq!(p.layers, g.num_layers());
    send.wait().await.unwrap();
    let mut got = vec![0u8; bb];
    for layer in 0..g.num_layers() {
        for (s, d) in [(3, 5), (4, 4), (5, 3)] {
            dst.read_block(layer, d, &mut got).unwrap();
            assert_eq!(got, block(layer, s, bb), "layer {layer} block {s} -> {d}");
        }
    }
}
