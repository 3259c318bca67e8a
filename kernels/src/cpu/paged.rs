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

/// One layer's blocks as the paged kernels read them: block `id` is [`PagedLayout::block_elems`]
/// contiguous elements (K then V). The kernels ask only for the blocks their block tables name, so
/// an implementation can hand out each block on its own (the engine's KV cache does: a transfer may
/// be writing other blocks of the same layer meanwhile).
pub trait LayerBlocks: Sync {
    /// Block `id` of the layer. Panics when `id` is outside the pool.
    fn block(&self, id: u32) -> &[f32];
}

/// [`LayerBlocks`] for writing: hands out one block at a time, mutably.
pub trait LayerBlocksMut {
    /// Block `id` of the layer, mutable. Panics when `id` is outside the pool.
    fn block_mut(&mut self, id: u32) -> &mut [f32];
}

/// One whole layer in one slice (`[num_blocks][block_elems]`), as tests and references hold it.
#[derive(Clone, Copy, Debug)]
pub struct SliceBlocks<'a> {
    data: &'a [f32],
    block_elems: usize,
}

impl<'a> SliceBlocks<'a> {
    /// `data` is a whole number of blocks of `layout`.
    pub fn new(data: &'a [f32], layout: &PagedLayout) -> Self {
        assert!(data.len().is_multiple_of(layout.block_elems().max(1)), "a layer is a whole number of blocks");
        SliceBlocks { data, block_elems: layout.block_elems() }
    }
}

impl LayerBlocks for SliceBlocks<'_> {
    fn block(&self, id: u32) -> &[f32] {
        let n = self.block_elems;
        &self.data[id as usize * n..(id as usize + 1) * n]
    }
}

/// [`SliceBlocks`], mutable.
#[derive(Debug)]
pub struct SliceBlocksMut<'a> {
    data: &'a mut [f32],
    block_elems: usize,
}

impl<'a> SliceBlocksMut<'a> {
    /// `data` is a whole number of blocks of `layout`.
    pub fn new(data: &'a mut [f32], layout: &PagedLayout) -> Self {
        assert!(data.len().is_multiple_of(layout.block_elems().max(1)), "a layer is a whole number of blocks");
        SliceBlocksMut { data, block_elems: layout.block_elems() }
    }
}

impl LayerBlocksMut for SliceBlocksMut<'_> {
    fn block_mut(&mut self, id: u32) -> &mut [f32] {
        let n = self.block_elems;
        &mut self.data[id as usize * n..(id as usize + 1) * n]
    }
}

/// Writes `k` and `v` (both `[tokens, num_kv_heads, head_dim]`) for tokens at positions
/// `start_pos..start_pos + tokens` into `layer` (one slice holding the whole layer) through
/// `block_table`.
pub fn write_kv(
    layer: &mut [f32],
    layout: &PagedLayout,
    block_table: &[u32],
    start_pos: usize,
    k: &[f32],
    v: &[f32],
) {
    write_kv_blocks(&mut SliceBlocksMut::new(layer, layout), layout, block_table, start_pos, k, v);
}

/// [`write_kv`] into a layer handed out block by block: touches only the blocks of `block_table`
/// that positions `start_pos..start_pos + tokens` fall in.
pub fn write_kv_blocks(
    layer: &mut impl LayerBlocksMut,
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
    let mut t = 0;
    while t < tokens {
        // The tokens of one block: fetch the block once for all of them.
        let pos = start_pos + t;
        let first_slot = pos % layout.block_size;
        let n = (layout.block_size - first_slot).min(tokens - t);
        let block = layer.block_mut(block_table[pos / layout.block_size]);
        for slot in first_slot..first_slot + n {
            for h in 0..layout.num_kv_heads {
                let src = t * row + h * hd;
                let ko = layout.k_offset(0, h, slot);
                let vo = layout.v_offset(0, h, slot);
                block[ko..ko + hd].copy_from_slice(&k[src..src + hd]);
                block[vo..vo + hd].copy_from_slice(&v[src..src + hd]);
            }
            t += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block-wise writes land exactly where the whole-slice offsets say, chunk by chunk.
    #[test]
    fn block_writes_follow_the_layer_offsets() {
        let layout = PagedLayout { block_size: 3, num_kv_heads: 2, head_dim: 4 };
        let row = layout.num_kv_heads * layout.head_dim;
        let table = [4u32, 1, 3];
        let mut layer = vec![0.0f32; 5 * layout.block_elems()];
        // Positions 0..8 in three chunks (2, 5, 1 tokens), values naming their position and element.
        for (start, len) in [(0, 2), (2, 5), (7, 1)] {
            let k: Vec<f32> = (0..len * row).map(|i| ((start + i / row) * 100 + i % row) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x - 1.0).collect();
            write_kv(&mut layer, &layout, &table, start, &k, &v);
        }
        for pos in 0..8 {
            let block = table[pos / 3];
            for h in 0..2 {
                for d in 0..4 {
                    let want = (pos * 100 + h * 4 + d) as f32;
                    assert_eq!(layer[layout.k_offset(block, h, pos % 3) + d], want, "k of {pos}");
                    assert_eq!(layer[layout.v_offset(block, h, pos % 3) + d], -want - 1.0, "v of {pos}");
                }
            }
        }
        // Blocks outside the table (0, 2) and the unused slot of block 3 stay untouched.
        for b in [0u32, 2] {
            assert!(SliceBlocks::new(&layer, &layout).block(b).iter().all(|&x| x == 0.0));
        }
        assert!(layer[layout.k_offset(3, 0, 2)..][..4].iter().all(|&x| x == 0.0));
    }
}
