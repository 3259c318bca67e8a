//! The paged KV layout and the kernel that writes new K/V into it.
//!
//! One layer's cache is one buffer `[num_blocks][2 (K, V)][num_kv_heads][block_size][head_dim]`.
//! Invariant: a block of one layer is one contiguous run of [`PagedLayout::block_elems`] elements,
//! so a request's blocks of one layer can be sent as a unit and a received block written straight
//! into place by its id.

/// The geometry of one layer's paged KV buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedLayout {
    /// Tokens per block.
    pub block_size: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl PagedLayout {
    /// Elements of one block (K and V) in one layer.
    pub fn block_elems(&self) -> usize {
        2 * self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Offset of the key of `(kv_head, slot)` in `block`.
    pub fn k_offset(&self, block: u32, kv_head: usize, slot: usize) -> usize {
        block as usize * self.block_elems() + (kv_head * self.block_size + slot) * self.head_dim
    }

    /// Offset of the value of `(kv_head, slot)` in `block`.
    pub fn v_offset(&self, block: u32, kv_head: usize, slot: usize) -> usize {
        self.k_offset(block, kv_head, slot) + self.num_kv_heads * self.block_size * self.head_dim
    }
}

/// Writes `k` and `v` (both `[tokens, num_kv_heads, head_dim]`) for tokens at positions
/// `start_pos..start_pos + tokens` into `layer` through `block_table`.
pub fn write_kv(
    layer: &mut [f32],
    layout: &PagedLayout,
    block_table: &[u32],
    start_pos: usize,
    k: &[f32],
    v: &[f32],
) {
    let row = layout.num_kv_heads * layout.head_dim;
    assert_eq!(k.len(), v.len(), "k and v must have the same shape");
    assert!(k.len().is_multiple_of(row), "k must be [tokens, kv_heads, head_dim]");
    let tokens = k.len() / row;
    let needed_blocks = (start_pos + tokens).div_ceil(layout.block_size);
    assert!(block_table.len() >= needed_blocks, "block table too short");
    let hd = layout.head_dim;
    for t in 0..tokens {
        let pos = start_pos + t;
        let block = block_table[pos / layout.block_size];
        let slot = pos % layout.block_size;
        for h in 0..layout.num_kv_heads {
            let src = t * row + h * hd;
            let ko = layout.k_offset(block, h, slot);
            let vo = layout.v_offset(block, h, slot);
            layer[ko..ko + hd].copy_from_slice(&k[src..src + hd]);
            layer[vo..vo + hd].copy_from_slice(&v[src..src + hd]);
        }
    }
}
