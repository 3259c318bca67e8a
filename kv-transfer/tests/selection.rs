//! Backend selection: `auto` resolves by where the pool lives, and a backend asked for explicitly that
//! cannot work is a clear error at start-up, never a quiet switch to another backend.

use tandem_kv_transfer::transport::cuda_ipc::CudaIpcOptions;
use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, DType, Error, Fabric, Geometry, GeometrySpec, KvMemory, Layout};

fn geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "selection".into(),
        dtype: DType::BF16,
        block_size: 4,
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 8,
        layout: Layout::KvHeadTokenDim,
    })
    .unwrap()
}

#[test]
fn auto_resolves_by_where_the_pool_lives() {
    let auto: ConnectorSpec = "auto".parse().unwrap();
    assert!(matches!(auto.clone().resolve(true), ConnectorSpec::CudaIpc(_)));
    assert!(matches!(auto.resolve(false), ConnectorSpec::Tcp(_)));
    let ipc: ConnectorSpec = "cuda-ipc".parse().unwrap();
    assert_eq!(ipc, ConnectorSpec::CudaIpc(CudaIpcOptions::default()));
    assert!(ipc.wants_device_memory());
    // An explicit choice stays what it is, wherever the pool lives.
    assert!(matches!("tcp".parse::<ConnectorSpec>().unwrap().resolve(true), ConnectorSpec::Tcp(_)));
    let err = "nccl-or-whatever".parse::<ConnectorSpec>().unwrap_err().to_string();
    assert!(err.contains("cuda-ipc") && err.contains("auto"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_refuses_a_host_pool_at_start() {
    let memory = KvMemory::host(geometry(), 4).unwrap();
    let spec: ConnectorSpec = "cuda-ipc".parse().unwrap();
    let err = Connector::from_spec(&spec, memory, ConnectorConfig::default(), &Fabric::new()).await.unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("cuda-ipc"), "{err}");
    // `auto` must be resolved by the caller, which knows where its pool lives.
    let memory = KvMemory::host(geometry(), 4).unwrap();
    let err = Connector::from_spec(&ConnectorSpec::Auto, memory, ConnectorConfig::default(), &Fabric::new()).await.unwrap_err();
    assert!(err.to_string().contains("auto"), "{err}");
}
