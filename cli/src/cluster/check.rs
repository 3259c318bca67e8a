//! `--check` of `tandem router|prefill|decode|up`: the command line validated as far as it can be
//! without touching the world (no model pulled or loaded, no etcd reached, no port bound), then exit.
//! Deployments (the helm chart's test) run every command they render through it, so a flag the CLI
//! does not know or a value it would refuse fails there, not on a cluster.
//!
//! What a real start would find out only on its own machine (the model directory or plugin library
//! existing, etcd answering, the GPU) is not checked.

use anyhow::{bail, ensure};
use tandem_engine::Device;
use tandem_kv_transfer::ConnectorSpec;

use super::EtcdArgs;
use crate::generate::EngineArgs;

/// Membership flags.
pub(super) fn etcd(args: &EtcdArgs) -> anyhow::Result<()> {
    ensure!(args.ttl >= 1, "--ttl must be at least 1 second");
    ensure!(args.etcd.iter().all(|e| !e.trim().is_empty()), "--etcd has an empty endpoint");
    ensure!(!args.cluster_prefix.trim_end_matches('/').is_empty(), "--cluster-prefix {:?} is empty", args.cluster_prefix);
    Ok(())
}

/// The engine flags and the KV connector they are used with.
pub(super) fn engine(args: &EngineArgs, kv_connector: &str) -> anyhow::Result<()> {
    let known = crate::pull::known_model(&args.model).is_some();
    let path = std::path::Path::new(&args.model);
    if !known && !path.exists() && !args.model.contains(std::path::MAIN_SEPARATOR) {
        bail!(
            "--model {:?} is neither a known model ({}) nor a path",
            args.model,
            crate::pull::KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        );
    }
    ensure!(args.threads != Some(0), "--threads must be at least 1");
    ensure!(args.block_size > 0, "--block-size must be at least 1");
    ensure!(args.kv_cache_mib > 0, "--kv-cache-mib must be at least 1");
    ensure!(args.max_num_batched_tokens > 0, "--max-num-batched-tokens must be at least 1");
    ensure!(
        (0.05..=1.0).contains(&args.gpu_memory_utilization),
        "--gpu-memory-utilization {} must be in [0.05, 1]",
        args.gpu_memory_utilization
    );
    let spec: ConnectorSpec = kv_connector.parse()?;
    let on_gpu = matches!(args.device, Device::Cuda { .. });
    if spec.wants_device_memory() && !on_gpu {
        bail!("--kv-connector {kv_connector} moves KV in device memory and needs --device cuda[:N]");
    }
    Ok(())
}

/// Prints that the command line of `what` is good.
pub(super) fn ok(what: &str) -> anyhow::Result<()> {
    println!("{what}: command line ok");
    Ok(())
}
