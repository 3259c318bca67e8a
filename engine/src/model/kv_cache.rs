//! The CPU KV cache: one f32 buffer per layer in the paged layout [`KvLayout`] documents
//! (`[num_blocks][K, V][kv_heads][block_size][head_dim]`).
//!
//! Invariant: one layer's block is one contiguous slice ([`KvCache::block`]), so a KV transfer
//! can send a request's blocks of one layer as a unit and write a received block in place
//! ([`KvCache::block_mut`]).

use tandem_kernels::cpu::PagedLayout;

use crate::config::ModelConfig;
use crate::kv::KvLayout;

/// K/V for every layer and block of the pool.
pub struct KvCache {
    layout: KvLayout,
    layers: Vec<Vec<f32>>,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `block_size` tokens for every layer of `cfg`.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        let layout = KvLayout {
            num_layers: cfg.num_layers,
            num_blocks,
            block_size,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let layers = (0..cfg.num_layers).map(|_| vec![0.0f32; layout.layer_elems()]).collect();
        KvCache { layout, layers }
    }

    /// Bytes one block takes across all layers (for sizing a pool from a memory budget).
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * cfg.num_kv_heads * block_size * cfg.head_dim * cfg.num_layers * std::mem::size_of::<f32>()
    }

    /// The whole cache's geometry.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The per-layer geometry the kernels take.
    pub fn paged(&self) -> PagedLayout {
        self.layout.paged()
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.layout.num_blocks
    }

    /// Layers in the cache.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// One layer's whole buffer.
    pub fn layer(&self, layer: usize) -> &[f32] {
        &self.layers[layer]
    }

    /// One layer's whole buffer, mutable.
    pub fn layer_mut(&mut self, layer: usize) -> &mut [f32] {
        &mut self.layers[layer]
    }

    /// One block of one layer: K then V, `block_elems` contiguous elements.
    pub fn block(&self, layer: usize, block: u32) -> &[f32] {
        let n = self.layout.block_elems();
        &self.layers[layer][block as usize * n..(block as usize + 1) * n]
    }

    /// One block of one layer, mutable: where a received block is written.
    pub fn block_mut(&mut self, layer: usize, block: u32) -> &mut [f32] {
        let n = self.layout.block_elems();
        &mut self.layers[layer][block as usize * n..(block as usize + 1) * n]
    }

    /// Copies block `src` over block `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.layout.block_elems();
        for layer in &mut self.layers {
            layer.copy_within(src as usize * n..(src as usize + 1) * n, dst as usize * n);
        }
    }
}
