//! Exposes an engine's paged KV cache to the KV-transfer connector: the geometry both sides must agree on
//! and the registration of the cache's memory.
//!
//! Invariant (the registration's safety argument): the engine's per-layer buffers never move or shrink
//! after construction and stay allocated while the registered memory lives (the CPU cache's store is the
//! memory's owner; for the CUDA host mirror and device pool the engine thread keeps the engine until the
//! memory's last other reference is gone); the engine writes a block being transferred only after the
//! transfer released it, and reads a block being received only then (the scheduler holds prefill blocks
//! until `release`, and decode blocks wait for `kv_ready`); and the engine holds references only to the
//! blocks it uses, never to a whole layer (the CPU cache hands out single blocks of `UnsafeCell`s), so a
//! transfer's access to other blocks of a layer never aliases one of them.

use std::path::Path;
use std::sync::Arc;

use tandem_engine::model::{KvDType, TransferPlace};
use tandem_engine::{Device, Engine};
use tandem_kv_transfer::{DType, DeviceAllocation, Geometry, GeometrySpec, KvMemory, Layout, MemoryKind};

use crate::error::NodeError;

/// Identifies a model's weights for the KV handshake: its name plus a hash of its `config.json`, so two
/// nodes with different models (or different configs under one name) never exchange KV.
pub fn model_fingerprint(name: &str, model_dir: &Path) -> Result<String, NodeError> {
    let config = std::fs::read(model_dir.join("config.json"))
        .map_err(|e| NodeError::Internal(format!("reading {}/config.json: {e}", model_dir.display())))?;
    let mut id = format!("{name}@{:016x}", twox_hash::XxHash3_64::oneshot(&config));
    id.truncate(200);
    Ok(id)
}

/// The content binding of a prompt's transferred KV (see `TransferDescriptor::binding`): a hash of every
/// prompt token and of how many leading blocks the receiver already holds. The decode node expects the
/// binding of the prompt it serves; the prefill node states the binding of the prompt it actually
/// computed. KV for one prompt can therefore never land in blocks allocated for another, whoever asks.
pub fn kv_binding(prompt: &[u32], skip_blocks: usize, block_size: usize) -> u64 {
    let mut bytes = Vec::with_capacity(32 + 4 * prompt.len());
    bytes.extend_from_slice(b"tandem-kv-binding-v1");
    bytes.extend_from_slice(&(block_size as u64).to_le_bytes());
    bytes.extend_from_slice(&(skip_blocks as u64).to_le_bytes());
    for t in prompt {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    twox_hash::XxHash3_64::oneshot(&bytes)
}

/// The geometry of an engine's KV cache as transfers see it (f32 from the CPU engine, bf16 from the
/// CUDA engine's host mirror).
pub fn kv_geometry(engine: &Engine, model_id: &str) -> Result<Geometry, NodeError> {
    let cfg = engine.model_config();
    Ok(Geometry::new(GeometrySpec {
        model_id: model_id.to_string(),
        dtype: match engine.device() {
            Device::Cpu => DType::F32,
            Device::Cuda { .. } => DType::BF16,
        },
        block_size: engine.config().block_size as u32,
        num_layers: cfg.num_layers as u32,
        num_kv_heads: cfg.num_kv_heads as u32,
        head_dim: cfg.head_dim as u32,
        layout: Layout::KvHeadTokenDim,
    })?)
}

/// Registers the engine's KV cache for transfers: in host memory (the CPU cache, or the CUDA pool's
/// host mirror), or with `device` the CUDA pool itself in device memory (for device backends such as
/// cuda-ipc). The caller must hand the returned memory to the engine thread with the engine (see
/// [`crate::EngineThread::spawn`]), which keeps the engine alive until every other reference to the
/// memory is gone.
#[allow(unsafe_code)]
pub fn register_kv(engine: &mut Engine, model_id: &str, device: bool) -> Result<Arc<KvMemory>, NodeError> {
    let geometry = kv_geometry(engine, model_id)?;
    if device {
        let mem = engine.device_transfer_memory()?;
        let TransferPlace::Device { ordinal, allocation, allocation_bytes, .. } = mem.place else {
            return Err(NodeError::Internal("the engine's device transfer memory is not in device memory".into()));
        };
        if mem.dtype != KvDType::Bf16 || geometry.dtype() != DType::BF16 {
            return Err(NodeError::Internal("the CUDA pool is expected in bf16".into()));
        }
        let bases = mem.layer_bases.iter().map(|&p| p as u64).collect();
        let ordinal = i32::try_from(ordinal).map_err(|_| NodeError::Internal(format!("device ordinal {ordinal}")))?;
        let allocation = DeviceAllocation { base: allocation, bytes: allocation_bytes };
        // SAFETY: the bases are the CUDA engine's pool layers, inside its one IPC-exportable allocation,
        // valid for the engine's lifetime, which the engine thread extends past the memory's last other
        // user; blocks under transfer are held by the scheduler (module invariant), and in device-transfer
        // mode the engine neither mirrors nor uploads them.
        return Ok(unsafe { KvMemory::from_device(geometry, mem.num_blocks as u32, ordinal, allocation, bases, Box::new(()))? });
    }
    let mem = engine.transfer_memory();
    let want = match mem.dtype {
        KvDType::F32 => DType::F32,
        KvDType::Bf16 => DType::BF16,
    };
    if want != geometry.dtype() {
        return Err(NodeError::Internal(format!("the engine's transfer memory is {:?} but its geometry says {:?}", mem.dtype, geometry.dtype())));
    }
    let owner: Box<dyn std::any::Any + Send + Sync> = match mem.keep_alive {
        Some(store) => Box::new(store),
        None => Box::new(()),
    };
    // SAFETY: each base points to num_blocks * block_bytes writable bytes of host memory in the paged
    // layout of `geometry` (the CPU engine's KV cache, or the CUDA engine's host mirror of its pool),
    // allocated once; the CPU cache's buffers live as long as `owner` (its store), the mirror for the
    // engine's lifetime, which the engine thread extends past the memory's last other user. Blocks under
    // transfer are held by the scheduler, and the engine references single blocks only (module invariant).
    let memory = unsafe { KvMemory::from_raw(geometry, mem.num_blocks as u32, MemoryKind::Host, mem.layer_bases, owner)? };
    Ok(memory)
}

#[cfg(test)]
mod tests {
    use super::kv_binding;

    #[test]
    fn binding_depends_on_every_token_and_the_skip() {
        let prompt: Vec<u32> = (0..40).map(|i| i * 7 + 1).collect();
        let base = kv_binding(&prompt, 1, 16);
        assert_eq!(base, kv_binding(&prompt.clone(), 1, 16));
        for i in 0..prompt.len() {
            let mut other = prompt.clone();
            other[i] ^= 1;
            assert_ne!(kv_binding(&other, 1, 16), base, "token {i}");
        }
        assert_ne!(kv_binding(&prompt, 0, 16), base);
        assert_ne!(kv_binding(&prompt, 1, 32), base);
        assert_ne!(kv_binding(&prompt[..39], 1, 16), base);
    }
}
