//! The CPU KV cache: one f32 buffer per layer in the paged layout [`KvLayout`] documents
//! (`[num_blocks][K, V][kv_heads][block_size][head_dim]`).
//!
//! Invariant: one layer's block is one contiguous slice ([`KvCache::block`]), so a KV transfer
//! can send a request's blocks of one layer as a unit and write a received block in place
//! ([`KvCache::block_mut`]). The per-layer buffers are allocated once and never resized, so
//! their addresses ([`KvCache::layer_base_ptrs`]) stay fixed for the cache's lifetime: a
//! transfer engine may register them once.

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

    /// Bytes of one layer's whole buffer (every block of the pool).
    pub fn layer_bytes(&self) -> usize {
        self.layout.layer_elems() * std::mem::size_of::<f32>()
    }

    /// Bytes of one block in one layer (K then V): block `b` of a layer starts
    /// `b * block_bytes_per_layer()` bytes after that layer's base pointer.
    pub fn block_bytes_per_layer(&self) -> usize {
        self.layout.block_elems() * std::mem::size_of::<f32>()
    }

    /// The base address of every layer's buffer (f32 elements, native endianness), in layer
    /// order, each [`Self::layer_bytes`] long: what a transfer engine registers to read blocks
    /// from or write received blocks into.
    ///
    /// The pointers stay valid for the cache's lifetime: each layer's buffer is allocated once in
    /// [`Self::new`] and never resized, and moving the cache (or the engine owning it) does not
    /// move the buffers. Producing them is safe; using them is the caller's `unsafe`, under these
    /// rules:
    /// - Touch only blocks the scheduler holds for you: the blocks of a
    ///   [`crate::sched::RemoteAlloc`] past its cached prefix (to write), or a held or
    ///   completing prefill's blocks (to read). Any other block may be in use by another
    ///   sequence, and a freed block may be reused by the next step.
    /// - Do not overlap the engine's own access to the same layer: a step's forward pass,
    ///   [`Self::copy_block`], [`Self::layer_mut`] and [`Self::block_mut`] take Rust references
    ///   over whole layers. Reading layer `l` of a completing prefill after the step reported
    ///   layer `l` done is fine (nothing writes it again in that step); write received blocks
    ///   between steps, or from a device or process outside this one.
    /// - The cache must outlive every use of the pointers.
    pub fn layer_base_ptrs(&mut self) -> Vec<*mut u8> {
        self.layers
            .iter_mut()
            .map(|layer| layer.as_mut_ptr().cast::<u8>())
            .collect()
    }

    /// Copies block `src` over block `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.layout.block_elems();
        for layer in &mut self.layers {
            layer.copy_within(src as usize * n..(src as usize + 1) * n, dst as usize * n);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn cache() -> KvCache {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/gqa-tied");
        let cfg = ModelConfig::from_model_dir(&dir).unwrap();
        KvCache::new(&cfg, 7, 4)
    }

    #[test]
    fn sizes_and_base_pointers_describe_the_layer_buffers() {
        let mut kv = cache();
        let l = kv.layout();
        assert_eq!(kv.block_bytes_per_layer(), l.block_elems() * 4);
        assert_eq!(kv.layer_bytes(), kv.block_bytes_per_layer() * kv.num_blocks());
        assert_eq!(kv.layer_bytes(), std::mem::size_of_val(kv.layer(0)));
        let want: Vec<usize> = (0..kv.num_layers()).map(|i| kv.layer(i).as_ptr() as usize).collect();
        let ptrs = kv.layer_base_ptrs();
        assert_eq!(ptrs.len(), kv.num_layers());
        assert_eq!(ptrs.iter().map(|p| *p as usize).collect::<Vec<_>>(), want);
        // Block b of layer i starts b * block_bytes_per_layer() after the base.
        let block3 = kv.block(1, 3).as_ptr() as usize;
        assert_eq!(block3, want[1] + 3 * kv.block_bytes_per_layer());
    }

    #[test]
    fn base_pointers_survive_moves_and_writes() {
        let mut kv = cache();
        let before: Vec<usize> = kv.layer_base_ptrs().into_iter().map(|p| p as usize).collect();
        kv.block_mut(0, 2).fill(1.5);
        kv.copy_block(2, 5);
        let mut moved = Box::new(kv);
        let after: Vec<usize> = moved.layer_base_ptrs().into_iter().map(|p| p as usize).collect();
        assert_eq!(before, after);
        assert!(moved.block(0, 5).iter().all(|&x| x == 1.5));
    }
}
