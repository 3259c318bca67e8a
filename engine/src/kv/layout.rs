//! Element offsets into the model backend's per-layer KV buffers.
//!
//! Each layer owns one contiguous buffer shaped `[num_blocks][2][num_kv_heads][block_size][head_dim]`
//! (the `2` is keys, then values). One block of one layer is therefore one contiguous run of
//! [`KvLayout::block_elems`] elements starting at `block * block_elems`, so a block received over
//! the network can be written straight into place by its [`BlockId`]. Within a block, the keys of
//! one KV head for all slots come first, then the next head, and the values follow all keys.

use tandem_kernels::cpu::PagedLayout;

use super::BlockId;

/// Shape of the paged KV storage. The scheduler never touches the storage; the backend allocates
/// `num_layers` buffers of [`KvLayout::layer_elems`] elements and uses these offsets.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct KvLayout {
    /// Transformer layers (one buffer each).
    pub num_layers: usize,
    /// Blocks in the pool (the same in every layer).
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Key/value heads per layer.
    pub num_kv_heads: usize,
    /// Elements per head vector.
    pub head_dim: usize,
}

impl KvLayout {
    /// The per-layer geometry the kernels work with (the one source of the offset arithmetic).
    pub fn paged(&self) -> PagedLayout {
        PagedLayout { block_size: self.block_size, num_kv_heads: self.num_kv_heads, head_dim: self.head_dim }
    }

    /// Elements of one block in one layer: keys and values of every KV head for every slot,
    /// `2 * num_kv_heads * block_size * head_dim`.
    pub fn block_elems(&self) -> usize {
        self.paged().block_elems()
    }

    /// Elements of one layer's whole buffer, `num_blocks * block_elems()`.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Elements of all layers together, `num_layers * layer_elems()`.
    pub fn total_elems(&self) -> usize {
        self.num_layers * self.layer_elems()
    }

    /// Offset (inside one layer's buffer) of the first element of `block`.
    pub fn block_offset(&self, block: BlockId) -> usize {
        block.index() * self.block_elems()
    }

    /// Offset (inside one layer's buffer) of the key vector of `kv_head` at `slot` of `block`;
    /// the vector is the `head_dim` elements starting there. The caller keeps
    /// `kv_head < num_kv_heads` and `slot < block_size`.
    pub fn k_offset(&self, block: BlockId, kv_head: usize, slot: usize) -> usize {
        debug_assert!(kv_head < self.num_kv_heads && slot < self.block_size);
        self.paged().k_offset(block.0, kv_head, slot)
    }

    /// Offset (inside one layer's buffer) of the value vector of `kv_head` at `slot` of `block`.
    /// Values of a block start right after all of its keys.
    pub fn v_offset(&self, block: BlockId, kv_head: usize, slot: usize) -> usize {
        debug_assert!(kv_head < self.num_kv_heads && slot < self.block_size);
        self.paged().v_offset(block.0, kv_head, slot)
    }

    /// The block and slot holding token position `pos` of a sequence with block table `table`,
    /// or `None` when the table does not reach that far.
    pub fn locate(&self, table: &[BlockId], pos: usize) -> Option<(BlockId, usize)> {
        let block = *table.get(pos / self.block_size)?;
        Some((block, pos % self.block_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 3,
            num_blocks: 5,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        }
    }

    #[test]
    fn sizes() {
        let l = layout();
        assert_eq!(l.block_elems(), 2 * 2 * 4 * 8);
        assert_eq!(l.layer_elems(), 5 * 128);
        assert_eq!(l.total_elems(), 3 * 5 * 128);
    }

    #[test]
    fn offsets_follow_the_documented_order() {
        let l = layout();
        // Reference: index into a [blocks][2][heads][slots][dim] array written out by hand.
        let idx = |b: usize, kv: usize, h: usize, s: usize| (((b * 2 + kv) * 2 + h) * 4 + s) * 8;
        for b in 0..5 {
            for h in 0..2 {
                for s in 0..4 {
                    assert_eq!(l.k_offset(BlockId(b as u32), h, s), idx(b, 0, h, s));
                    assert_eq!(l.v_offset(BlockId(b as u32), h, s), idx(b, 1, h, s));
                }
            }
        }
    }

    #[test]
    fn every_vector_of_a_block_is_distinct_and_inside_its_block() {
        let l = layout();
        let mut seen = vec![false; l.layer_elems()];
        for b in 0..l.num_blocks {
            let id = BlockId(b as u32);
            let range = l.block_offset(id)..l.block_offset(id) + l.block_elems();
            for h in 0..l.num_kv_heads {
                for s in 0..l.block_size {
                    for off in [l.k_offset(id, h, s), l.v_offset(id, h, s)] {
                        assert!(range.contains(&off) && range.contains(&(off + l.head_dim - 1)));
                        for (e, slot) in seen.iter_mut().enumerate().skip(off).take(l.head_dim) {
                            assert!(!*slot, "element {e} covered twice");
                            *slot = true;
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&x| x), "layout leaves holes");
    }

    #[test]
    fn locate_positions() {
        let l = layout();
        let table = [BlockId(3), BlockId(1)];
        assert_eq!(l.locate(&table, 0), Some((BlockId(3), 0)));
        assert_eq!(l.locate(&table, 5), Some((BlockId(1), 1)));
        assert_eq!(l.locate(&table, 8), None);
    }
}
