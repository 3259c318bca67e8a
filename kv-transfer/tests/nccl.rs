//! The nccl backend. Selection and start-up checks run everywhere; the transfers need two CUDA GPUs
//! and NCCL, so they are `#[ignore]`d (run them on a two-GPU machine with `--ignored`, with
//! libnccl.so.2 on LD_LIBRARY_PATH): the conformance suite with the senders' pools on GPU 0 and the
//! receivers' on GPU 1, a corrupted chunk caught on the receiver's GPU, and one GPU refused.

use std::sync::Arc;
use std::time::Duration;

use tandem_kv_transfer::conformance::{HOST_ONLY_CASES, Suite};
use tandem_kv_transfer::transport::nccl::{NcclOptions, RawNcclPair, library_version};
use tandem_kv_transfer::{
    Connector, ConnectorConfig, ConnectorSpec, DType, Error, Fabric, Geometry, GeometrySpec,
    KvMemory, Layout, make_transport,
};

fn geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "nccl".into(),
        dtype: DType::F32,
        block_size: 4,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 16,
        layout: Layout::KvHeadTokenDim,
    })
    .unwrap()
}

#[test]
fn nccl_specs_parse() {
    let spec: ConnectorSpec = "nccl".parse().unwrap();
    assert_eq!(spec, ConnectorSpec::Nccl(NcclOptions::default()));
    assert!(spec.wants_device_memory());
    assert!(spec.uses_device_memory().unwrap());
    let bound: ConnectorSpec = "nccl://127.0.0.1:0".parse().unwrap();
    assert_eq!(
        bound,
        ConnectorSpec::Nccl(NcclOptions {
            bind: "127.0.0.1:0".parse().unwrap(),
            ..NcclOptions::default()
        })
    );
    let all: ConnectorSpec = "nccl://0.0.0.0:7100".parse().unwrap();
    assert!(
        matches!(all, ConnectorSpec::Nccl(o) if o.bind.port() == 7100 && o.bind.ip().is_unspecified())
    );
    assert!(matches!(
        "nccl://[::1]:7100".parse::<ConnectorSpec>().unwrap(),
        ConnectorSpec::Nccl(_)
    ));
    for bad in [
        "nccl://",
        "nccl://127.0.0.1",
        "nccl://localhost:7100",
        "nccl:7100",
        "nccl://127.0.0.1:port",
        "nccl-ipc",
    ] {
        let err = bad.parse::<ConnectorSpec>().unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{bad}: {err}");
        assert!(err.to_string().contains("nccl://HOST:PORT"), "{bad}: {err}");
    }
    // An explicit nccl stays nccl wherever the pool lives; `auto` keeps picking cuda-ipc for a GPU pool
    // (a cross-host CUDA pair names nccl).
    assert!(matches!(
        "nccl".parse::<ConnectorSpec>().unwrap().resolve(true),
        ConnectorSpec::Nccl(_)
    ));
    assert!(matches!(
        ConnectorSpec::Auto.resolve(true),
        ConnectorSpec::CudaIpc(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nccl_refuses_a_host_pool_at_start() {
    let memory = KvMemory::host(geometry(), 4).unwrap();
    let spec: ConnectorSpec = "nccl".parse().unwrap();
    let err = Connector::from_spec(&spec, memory, ConnectorConfig::default(), &Fabric::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { backend, what } if backend == "nccl" && what.contains("host memory")),
        "{err}"
    );
    // The transport needs the connector's memory and GPU: it is made only by `Connector::from_spec`.
    let inbox_err = Connector::build(
        KvMemory::host(geometry(), 4).unwrap(),
        ConnectorConfig::default(),
        |inbox| async move { make_transport(&spec, &Fabric::new(), inbox).await },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&inbox_err, Error::Unsupported { backend, .. } if backend == "nccl"),
        "{inbox_err}"
    );
}

/// No NCCL here: a typed error that says what to install. With NCCL: a version it can use.
#[test]
fn the_library_probe_is_a_typed_result() {
    match library_version() {
        Ok(v) => assert!(v >= 21400, "{v}"),
        Err(Error::Device(m)) => {
            assert!(
                m.contains("NCCL is not available")
                    && m.contains("libnccl.so.2")
                    && m.contains("LD_LIBRARY_PATH"),
                "{m}"
            )
        }
        Err(e) => panic!("wrong error kind: {e}"),
    }
}

// ------------------------------------------------------------------------------------------ two GPUs

macro_rules! on_two_gpus {
    ([$($case:ident),* $(,)?]) => {
        mod conformance_gpu0_to_gpu1 {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                #[ignore = "needs two CUDA GPUs and libnccl.so.2"]
                async fn $case() {
                    let suite = Suite::new("nccl".parse().unwrap()).on_devices(0, 1);
                    if let Err(e) = suite.run_case(stringify!($case)).await {
                        panic!("nccl / {}: {e}", stringify!($case));
                    }
                }
            )*
        }
    };
}

// Every device case (the corrupted chunk through nccl's own test hook).
on_two_gpus!([
    round_trip_bit_exact,
    layers_land_in_order,
    concurrent_64,
    zero_block_transfer,
    sender_cancel_frees_both_sides,
    receiver_cancel_frees_both_sides,
    receiver_disappears,
    sender_disappears,
    corrupted_chunk_detected,
    handshake_mismatch_refused,
    unknown_destination_fails_fast,
    unknown_transfer_rejected,
    other_content_refused,
    receiver_timeout_frees_blocks,
    large_transfer_256mib,
]);

/// The list above is every device case.
#[test]
fn every_device_case_is_listed() {
    let src = include_str!("nccl.rs");
    for case in tandem_kv_transfer::conformance::CASES {
        let listed = src.contains(&format!("    {case},\n"));
        let device = !HOST_ONLY_CASES.contains(case);
        assert_eq!(listed, device, "case {case}");
    }
}

fn pools(blocks: u32) -> (Arc<KvMemory>, Arc<KvMemory>) {
    let (src, dst) = (
        KvMemory::cuda(geometry(), blocks, 0).unwrap(),
        KvMemory::cuda(geometry(), blocks, 1).unwrap(),
    );
    let bb = geometry().block_bytes();
    for layer in 0..4 {
        for b in 0..blocks {
            let fill: Vec<u8> = (0..bb)
                .map(|i| (i as u32 * 7 + b * 13 + layer * 31) as u8)
                .collect();
            src.write_block(layer, b, &fill).unwrap();
        }
    }
    (src, dst)
}

fn config() -> ConnectorConfig {
    ConnectorConfig {
        transfer_timeout: Duration::from_secs(30),
        ..ConnectorConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs two CUDA GPUs and libnccl.so.2"]
async fn corrupted_chunk_is_caught_on_the_receivers_gpu() {
    let (src, dst) = pools(64);
    let corrupt = ConnectorSpec::Nccl(NcclOptions {
        corrupt_every: Some(2),
        ..NcclOptions::default()
    });
    let tx = Connector::from_spec(&corrupt, Arc::clone(&src), config(), &Fabric::new())
        .await
        .unwrap();
    let rx = Connector::from_spec(
        &"nccl".parse().unwrap(),
        Arc::clone(&dst),
        config(),
        &Fabric::new(),
    )
    .await
    .unwrap();
    // 48 blocks per layer: one chunk per layer; the second chunk staged is corrupted after the gather.
    let blocks: Vec<u32> = (0..48).collect();
    let mut recv = rx.expect(blocks.clone(), 1, None).unwrap();
    let mut send = tx.send(recv.descriptor(), blocks, 1, None).unwrap();
    send.push_all();
    let r = tokio::time::timeout(Duration::from_secs(30), recv.wait())
        .await
        .unwrap();
    assert!(matches!(r, Err(Error::Integrity { .. })), "{r:?}");
    assert!(
        tokio::time::timeout(Duration::from_secs(30), send.wait())
            .await
            .unwrap()
            .is_err()
    );
    assert!(
        recv.progress().layers <= 1,
        "{} layers reported",
        recv.progress().layers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs two CUDA GPUs and libnccl.so.2"]
async fn one_gpu_is_refused_at_connect() {
    let (src, dst) = (
        KvMemory::cuda(geometry(), 8, 0).unwrap(),
        KvMemory::cuda(geometry(), 8, 0).unwrap(),
    );
    let spec: ConnectorSpec = "nccl".parse().unwrap();
    let tx = Connector::from_spec(&spec, src, config(), &Fabric::new())
        .await
        .unwrap();
    let rx = Connector::from_spec(&spec, dst, config(), &Fabric::new())
        .await
        .unwrap();
    let recv = rx.expect(vec![0, 1], 1, None).unwrap();
    let mut send = tx.send(recv.descriptor(), vec![0, 1], 1, None).unwrap();
    send.push_all();
    let err = tokio::time::timeout(Duration::from_secs(30), send.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Incompatible(m) if m.contains("same GPU")),
        "{err}"
    );
}

#[test]
#[ignore = "needs two CUDA GPUs and libnccl.so.2"]
fn a_raw_pair_moves_the_bytes() {
    let (src, dst) = pools(8);
    let pair = RawNcclPair::new(0, 1).unwrap();
    let bytes = 8 * geometry().block_bytes();
    pair.send(&src, &dst, bytes).unwrap();
    let (mut a, mut b) = (
        vec![0u8; geometry().block_bytes()],
        vec![0u8; geometry().block_bytes()],
    );
    for blk in 0..8 {
        src.read_block(0, blk, &mut a).unwrap();
        dst.read_block(0, blk, &mut b).unwrap();
        assert_eq!(a, b, "block {blk}");
    }
    assert!(
        pair.send(&dst, &src, bytes).is_err(),
        "the pools' GPUs are checked"
    );
}
