//! Exposes an engine's paged KV cache to the KV-transfer connector: the geometry both sides must agree on
//! and the registration of the cache's memory.
//!
//! Invariant (the registration's safety argument): the engine's per-layer buffers never move or shrink
//! after construction, the engine outlives every user of the registered memory (the engine thread keeps
//! the engine until the memory's last other reference is gone), and the engine touches a block being
//! transferred only after the transfer released it (the scheduler holds prefill blocks until `release`,
//! and decode blocks wait for `kv_ready`).

use std::path::Path;
use std::sync::Arc;

use tandem_engine::Engine;
use tandem_kv_transfer::{DType, Geometry, GeometrySpec, KvMemory, Layout, MemoryKind};

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

/// The geometry of an engine's KV cache.
pub fn kv_geometry(engine: &Engine, model_id: &str) -> Result<Geometry, NodeError> {
    let cfg = engine.model_config();
    Ok(Geometry::new(GeometrySpec {
        model_id: model_id.to_string(),
        dtype: DType::F32,
        block_size: engine.config().block_size as u32,
        num_layers: cfg.num_layers as u32,
        num_kv_heads: cfg.num_kv_heads as u32,
        head_dim: cfg.head_dim as u32,
        layout: Layout::KvHeadTokenDim,
    })?)
}

/// Registers the engine's KV cache for transfers. The caller must hand the returned memory to the engine
/// thread with the engine (see [`crate::EngineThread::spawn`]), which keeps the engine alive until every
/// other reference to the memory is gone.
#[allow(unsafe_code)]
pub fn register_kv(engine: &mut Engine, model_id: &str) -> Result<Arc<KvMemory>, NodeError> {
    let geometry = kv_geometry(engine, model_id)?;
    let kv = engine.kv_cache_mut();
    let num_blocks = kv.num_blocks() as u32;
    let bases = kv.layer_base_ptrs();
    // SAFETY: each base points to num_blocks * block_bytes bytes of the engine's host KV cache (same layout
    // as `geometry`, checked by the engine's KvLayout), valid for the engine's lifetime, which the engine
    // thread extends past the memory's last other user; blocks under transfer are held by the scheduler
    // (module invariant).
    let memory = unsafe { KvMemory::from_raw(geometry, num_blocks, MemoryKind::Host, bases, Box::new(()))? };
    Ok(memory)
}
