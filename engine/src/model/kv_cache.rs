//! The CPU KV cache: one f32 buffer per layer in the paged layout [`KvLayout`] documents
//! (`[num_blocks][K, V][kv_heads][block_size][head_dim]`), shared with KV transfers.
//!
//! The buffers are a [`KvStore`] of cells, handed out block by block (see `kv_store.rs` for why and
//! for the invariant a transfer keeps): the forward pass's kernels take [`LayerMut`] and
//! [`LayerRef`] views (`tandem_kernels::cpu::{LayerBlocksMut, LayerBlocks}`) and ask only for the
//! blocks of the chunks' block tables, so a transfer reading or writing other blocks of a layer on
//! another thread never aliases a reference of the engine.
//!
//! Invariant: one layer's block is one contiguous slice ([`KvCache::block`]), so a KV transfer
//! can send a request's blocks of one layer as a unit and write a received block in place
//! ([`KvCache::block_mut`]). The per-layer buffers are allocated once and never resized or moved,
//! so their addresses ([`KvCache::layer_base_ptrs`]) stay fixed while the store lives (the cache,
//! or a [`KvCache::keep_alive`] handle): a transfer engine may register them once.

use std::any::Any;
use std::sync::Arc;

use tandem_kernels::cpu::{LayerBlocks, LayerBlocksMut, PagedLayout};

use super::kv_store::{self, KvStore};
use crate::config::ModelConfig;
use crate::kv::KvLayout;

/// K/V for every layer and block of the pool.
pub struct KvCache {
    layout: KvLayout,
    store: KvStore<f32>,
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
        KvCache { layout, store: KvStore::new(cfg.num_layers, num_blocks, layout.block_elems()) }
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
        self.store.num_blocks()
    }

    /// Layers in the cache.
    pub fn num_layers(&self) -> usize {
        self.store.num_layers()
    }

    /// One layer, read block by block (what attention takes). Panics when `layer` is out of range.
    pub fn layer(&self, layer: usize) -> LayerRef<'_> {
        LayerRef(self.store.layer(layer))
    }

    /// One layer, written block by block (what the K/V write takes). Panics when `layer` is out of
    /// range.
    pub fn layer_mut(&mut self, layer: usize) -> LayerMut<'_> {
        LayerMut(self.store.layer_mut(layer))
    }

    /// One block of one layer: K then V, `block_elems` contiguous elements. Panics when out of range.
    pub fn block(&self, layer: usize, block: u32) -> &[f32] {
        self.store.layer(layer).blocks(block, 1)
    }

    /// One block of one layer, mutable: where a received block is written. Panics when out of range.
    pub fn block_mut(&mut self, layer: usize, block: u32) -> &mut [f32] {
        self.store.layer_mut(layer).into_blocks_mut(block, 1)
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
    /// from or write received blocks into (writing through them is allowed: the elements are
    /// cells).
    ///
    /// The pointers stay valid while the store lives: each layer's buffer is allocated once in
    /// [`Self::new`] and never resized or moved, and the store lives as long as the cache or any
    /// [`Self::keep_alive`] handle. Producing them is safe; using them is the caller's `unsafe`,
    /// under this rule: touch only blocks the scheduler holds for you, in ways the engine's own use
    /// of them allows —
    /// - write the blocks of a [`crate::sched::RemoteAlloc`] past its cached prefix, until
    ///   `kv_ready` or its abort (the engine neither reads nor writes them before);
    /// - read a completing or held prefill's blocks of layer `l` once the step reported layer `l`
    ///   done, until `release` (nothing writes them then; the engine may read them too).
    ///
    /// The engine references single blocks only (the cache's views, [`Self::block`],
    /// [`Self::block_mut`]), so accesses to other blocks of a layer never conflict with it.
    pub fn layer_base_ptrs(&self) -> Vec<*mut u8> {
        self.store.base_ptrs()
    }

    /// A handle that keeps the buffers of [`Self::layer_base_ptrs`] allocated, whatever happens to
    /// the cache (a transfer memory holds one).
    pub fn keep_alive(&self) -> Arc<dyn Any + Send + Sync> {
        self.store.keep_alive()
    }

    /// Copies block `src` over block `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        if src == dst {
            return;
        }
        for l in 0..self.num_layers() {
            let (from, to) = self.store.layer_mut(l).src_dst(src, dst);
            to.copy_from_slice(from);
        }
    }
}

/// One layer of a [`KvCache`], read block by block ([`LayerBlocks`]); borrows the cache shared.
#[derive(Clone, Copy)]
pub struct LayerRef<'a>(kv_store::LayerRef<'a, f32>);

impl LayerBlocks for LayerRef<'_> {
    fn block(&self, id: u32) -> &[f32] {
        self.0.blocks(id, 1)
    }
}

/// One layer of a [`KvCache`], written block by block ([`LayerBlocksMut`]); borrows the cache
/// exclusively.
pub struct LayerMut<'a>(kv_store::LayerMut<'a, f32>);

impl LayerBlocksMut for LayerMut<'_> {
    fn block_mut(&mut self, id: u32) -> &mut [f32] {
        self.0.blocks_mut(id, 1)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use tandem_kernels::cpu::{self, AttentionChunk};

    use super::*;

    fn cache() -> KvCache {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/gqa-tied");
        let cfg = ModelConfig::from_model_dir(&dir).unwrap();
        KvCache::new(&cfg, 7, 4)
    }

    #[test]
    fn sizes_and_base_pointers_describe_the_layer_buffers() {
        let kv = cache();
        let l = kv.layout();
        assert_eq!(kv.block_bytes_per_layer(), l.block_elems() * 4);
        assert_eq!(kv.layer_bytes(), kv.block_bytes_per_layer() * kv.num_blocks());
        let ptrs = kv.layer_base_ptrs();
        assert_eq!(ptrs.len(), kv.num_layers());
        for (i, p) in ptrs.iter().enumerate() {
            // Block b of layer i starts b * block_bytes_per_layer() after the base.
            for b in 0..kv.num_blocks() as u32 {
                assert_eq!(kv.block(i, b).as_ptr() as usize, *p as usize + b as usize * kv.block_bytes_per_layer());
                assert_eq!(kv.block(i, b).len(), l.block_elems());
            }
        }
    }

    #[test]
    fn base_pointers_survive_moves_and_writes() {
        let mut kv = cache();
        let before: Vec<usize> = kv.layer_base_ptrs().into_iter().map(|p| p as usize).collect();
        kv.block_mut(0, 2).fill(1.5);
        kv.copy_block(2, 5);
        let moved = Box::new(kv);
        let after: Vec<usize> = moved.layer_base_ptrs().into_iter().map(|p| p as usize).collect();
        assert_eq!(before, after);
        assert!(moved.block(0, 5).iter().all(|&x| x == 1.5));
        assert!(moved.block(1, 5).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn copy_on_write_copies_every_layer_and_nothing_else() {
        let mut kv = cache();
        for l in 0..kv.num_layers() {
            for b in 0..kv.num_blocks() as u32 {
                kv.block_mut(l, b).fill((l * 10 + b as usize) as f32);
            }
        }
        kv.copy_block(4, 1);
        kv.copy_block(3, 3);
        for l in 0..kv.num_layers() {
            for b in 0..kv.num_blocks() as u32 {
                let want = if b == 1 { l * 10 + 4 } else { l * 10 + b as usize } as f32;
                assert!(kv.block(l, b).iter().all(|&x| x == want), "layer {l} block {b}");
            }
        }
    }

    /// The engine's kernels through the cache's block views give what they give over a plain
    /// layer slice.
    #[test]
    fn kernels_over_block_views_match_a_plain_layer() {
        let mut kv = cache();
        let layout = kv.paged();
        let row = layout.num_kv_heads * layout.head_dim;
        let table = [5u32, 0, 3];
        let tokens = 10;
        let k: Vec<f32> = (0..tokens * row).map(|i| (i % 13) as f32 * 0.25 - 1.0).collect();
        let v: Vec<f32> = (0..tokens * row).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
        let mut plain = vec![0.0f32; kv.layout().layer_elems()];
        cpu::write_kv(&mut plain, &layout, &table, 0, &k[..6 * row], &v[..6 * row]);
        cpu::write_kv(&mut plain, &layout, &table, 6, &k[6 * row..], &v[6 * row..]);
        cpu::write_kv_blocks(&mut kv.layer_mut(1), &layout, &table, 0, &k[..6 * row], &v[..6 * row]);
        cpu::write_kv_blocks(&mut kv.layer_mut(1), &layout, &table, 6, &k[6 * row..], &v[6 * row..]);
        for b in 0..kv.num_blocks() as u32 {
            let n = layout.block_elems();
            assert_eq!(kv.block(1, b), &plain[b as usize * n..(b as usize + 1) * n], "block {b}");
        }
        let heads = 2 * layout.num_kv_heads;
        let q: Vec<f32> = (0..3 * heads * layout.head_dim).map(|i| (i % 5) as f32 * 0.1).collect();
        let chunks = [AttentionChunk { first_token: 0, len: 3, start_pos: 7, block_table: &table }];
        let (mut want, mut got) = (vec![0.0; q.len()], vec![0.0; q.len()]);
        cpu::paged_attention(&q, &chunks, &plain, &layout, heads, &mut want);
        cpu::paged_attention_blocks(&q, &chunks, &kv.layer(1), &layout, heads, &mut got);
        // Equal natively; Miri perturbs `exp` a little, so allow for rounding.
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "got {g} want {w}");
        }
    }
}
