//! Causal attention whose keys and values come from paged blocks: one kernel for prefill chunks
//! (many query tokens, earlier context already cached) and decode (one query token).
//!
//! Invariant: a query at position `p` attends to exactly positions `0..=p` of its own sequence,
//! read through that sequence's block table; GQA maps query head `h` to KV head
//! `h / (num_heads / num_kv_heads)`. Scores, softmax and the weighted sum of values are f32, with
//! dot products and weighted sums of value rows vectorised when the CPU allows (see `simd.rs`).

use rayon::prelude::*;

use super::paged::{LayerBlocks, PagedLayout, SliceBlocks};
use super::simd::{self, Isa};

/// One sequence's slice of the batch.
#[derive(Clone, Copy, Debug)]
pub struct AttentionChunk<'a> {
    /// Index of the chunk's first query token in the batch.
    pub first_token: usize,
    /// Number of query tokens.
    pub len: usize,
    /// Position of the first query token in its sequence.
    pub start_pos: usize,
    /// The sequence's block ids, covering positions `0..start_pos + len`.
    pub block_table: &'a [u32],
}

/// Computes `out` = softmax(q·kᵀ/√d)·v for every query token. `q` and `out` are
/// `[tokens, num_heads, head_dim]`; K/V come from `layer` (one slice holding the whole layer)
/// through each chunk's block table (their entries for the chunk's own tokens must already be
/// written).
pub fn paged_attention(
    q: &[f32],
    chunks: &[AttentionChunk<'_>],
    layer: &[f32],
    layout: &PagedLayout,
    num_heads: usize,
    out: &mut [f32],
) {
    paged_attention_blocks(q, chunks, &SliceBlocks::new(layer, layout), layout, num_heads, out);
}

/// [`paged_attention`] over a layer handed out block by block: reads only the blocks the chunks'
/// block tables name, up to each chunk's last position.
pub fn paged_attention_blocks<L: LayerBlocks>(
    q: &[f32],
    chunks: &[AttentionChunk<'_>],
    layer: &L,
    layout: &PagedLayout,
    num_heads: usize,
    out: &mut [f32],
) {
    paged_attention_with(Isa::detect(), &AttentionInputs { q, chunks, layer, layout, num_heads }, out);
}

/// The read-only inputs of [`paged_attention`].
struct AttentionInputs<'a, L> {
    q: &'a [f32],
    chunks: &'a [AttentionChunk<'a>],
    layer: &'a L,
    layout: &'a PagedLayout,
    num_heads: usize,
}

/// [`paged_attention`] with the vector instruction set chosen by the caller (tests force each).
///
/// Work items are (token, KV head) pairs, run in parallel: an item computes the `group` query
/// heads that share the KV head, so each block's keys and values are fetched once for all of
/// them. It walks its sequence's blocks in order; the keys (values) of one block and head are one
/// contiguous run.
fn paged_attention_with<L: LayerBlocks>(isa: Isa, inputs: &AttentionInputs<'_, L>, out: &mut [f32]) {
    let &AttentionInputs { q, chunks, layer, layout, num_heads } = inputs;
    let hd = layout.head_dim;
    let bs = layout.block_size;
    let row = num_heads * hd;
    assert_eq!(q.len(), out.len(), "out must match q");
    assert!(hd > 0 && q.len().is_multiple_of(row), "q must be [tokens, num_heads, head_dim]");
    assert!(num_heads.is_multiple_of(layout.num_kv_heads), "heads must be a multiple of kv heads");
    let group = num_heads / layout.num_kv_heads;
    // Offsets of one KV head's keys and values inside a block (each head's slots are contiguous).
    let k_in_block = |kvh: usize| layout.k_offset(0, kvh, 0);
    let v_in_block = |kvh: usize| layout.v_offset(0, kvh, 0);
    let scale = 1.0 / (hd as f32).sqrt();
    // Which chunk each token belongs to.
    let mut owner = vec![usize::MAX; q.len() / row];
    for (c, chunk) in chunks.iter().enumerate() {
        assert!(chunk.block_table.len() * bs >= chunk.start_pos + chunk.len, "block table too short");
        owner[chunk.first_token..chunk.first_token + chunk.len].fill(c);
    }
    assert!(owner.iter().all(|&o| o != usize::MAX), "every token must belong to a chunk");
    // One item: token t, KV head kvh; `o` is out[t, kvh*group .. (kvh+1)*group, :].
    let per_item = |scores: &mut Vec<f32>, (item, o): (usize, &mut [f32])| {
        let (t, kvh) = (item / layout.num_kv_heads, item % layout.num_kv_heads);
        let chunk = &chunks[owner[t]];
        let ctx = chunk.start_pos + (t - chunk.first_token) + 1;
        let qs = &q[item * group * hd..(item + 1) * group * hd];
        scores.clear();
        scores.resize(group * ctx, 0.0);
        // Scores, block by block: row g of `scores` is query head g's.
        let blocks = ctx.div_ceil(bs);
        for (b, j0) in (0..ctx).step_by(bs).enumerate() {
            let n = bs.min(ctx - j0);
            // Blocks are scattered: fetch the next block's keys and this block's values (used
            // after the softmax) into L2 while this block's scores are computed.
            if b + 1 < blocks {
                let next = layer.block(chunk.block_table[b + 1]);
                simd::prefetch_l2(&next[k_in_block(kvh)..][..bs.min(ctx - j0 - n) * hd]);
            }
            let block = layer.block(chunk.block_table[b]);
            simd::prefetch_l2(&block[v_in_block(kvh)..][..n * hd]);
            let keys = &block[k_in_block(kvh)..][..n * hd];
            for (qh, s_row) in qs.chunks_exact(hd).zip(scores.chunks_exact_mut(ctx)) {
                simd::dots(isa, qh, keys, scale, &mut s_row[j0..j0 + n]);
            }
        }
        // Softmax per head, normalised before the values are summed.
        for s_row in scores.chunks_exact_mut(ctx) {
            let max = s_row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for s in s_row.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            for s in s_row.iter_mut() {
                *s *= inv;
            }
        }
        o.fill(0.0);
        for (b, j0) in (0..ctx).step_by(bs).enumerate() {
            let n = bs.min(ctx - j0);
            let values = &layer.block(chunk.block_table[b])[v_in_block(kvh)..][..n * hd];
            for (oh, s_row) in o.chunks_exact_mut(hd).zip(scores.chunks_exact(ctx)) {
                simd::weighted_rows(isa, &s_row[j0..j0 + n], values, oh);
            }
        }
    };
    let work: usize = chunks.iter().map(|c| c.len * (c.start_pos + c.len)).sum::<usize>() * num_heads * hd;
    if work < 1 << 16 {
        let mut scores = Vec::new();
        out.chunks_mut(group * hd).enumerate().for_each(|it| per_item(&mut scores, it));
    } else {
        out.par_chunks_mut(group * hd).enumerate().for_each_init(Vec::new, per_item);
    }
}

#[cfg(test)]
mod tests {
    use super::super::paged::write_kv;
    use super::*;
    use rand::{Rng, SeedableRng, rngs::SmallRng};

    /// Dense causal attention in f64 over contiguous K/V ([tokens, kv_heads, hd]).
    fn reference(q: &[f32], k: &[f32], v: &[f32], heads: usize, kv_heads: usize, hd: usize, start: usize) -> Vec<f64> {
        let tq = q.len() / (heads * hd);
        let mut out = vec![0.0; q.len()];
        for t in 0..tq {
            let pos = start + t;
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                let qh = &q[(t * heads + h) * hd..][..hd];
                let s: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let kj = &k[(j * kv_heads + g) * hd..][..hd];
                        qh.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    for d in 0..hd {
                        out[(t * heads + h) * hd + d] += w / z * v[(j * kv_heads + g) * hd + d] as f64;
                    }
                }
            }
        }
        out
    }

    /// One test case: the geometry and, per sequence, (cached tokens, chunk length).
    struct Case {
        heads: usize,
        kv_heads: usize,
        hd: usize,
        bs: usize,
        seqs: Vec<(usize, usize)>,
    }

    /// Writes random K/V for every sequence into scattered blocks, runs the kernel on every
    /// instruction set (and through the public entry point) and compares with the dense f64
    /// reference.
    fn check(seed: u64, case: &Case) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let &Case { heads, kv_heads, hd, bs, .. } = case;
        let layout = PagedLayout { block_size: bs, num_kv_heads: kv_heads, head_dim: hd };
        let blocks_each: Vec<usize> = case.seqs.iter().map(|&(start, len)| (start + len).div_ceil(bs)).collect();
        let num_blocks: usize = blocks_each.iter().sum::<usize>() + 3;
        let mut layer: Vec<f32> = (0..num_blocks * layout.block_elems()).map(|_| rng.random_range(-9.0..9.0)).collect();
        // Scatter the blocks: a random permutation of the pool.
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let mut tables = Vec::new();
        let mut next = 0;
        for &n in &blocks_each {
            tables.push(ids[next..next + n].to_vec());
            next += n;
        }
        let mut all_q = Vec::new();
        let mut dense = Vec::new();
        let mut chunks = Vec::new();
        for (s, &(start, len)) in case.seqs.iter().enumerate() {
            let total = start + len;
            let k: Vec<f32> = (0..total * kv_heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..total * kv_heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            write_kv(&mut layer, &layout, &tables[s], 0, &k, &v);
            let q: Vec<f32> = (0..len * heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            dense.extend(reference(&q, &k, &v, heads, kv_heads, hd, start));
            chunks.push(AttentionChunk { first_token: all_q.len() / (heads * hd), len, start_pos: start, block_table: &tables[s] });
            all_q.extend(q);
        }
        let blocks = SliceBlocks::new(&layer, &layout);
        let inputs = AttentionInputs { q: &all_q, chunks: &chunks, layer: &blocks, layout: &layout, num_heads: heads };
        for isa in Isa::all_available() {
            let mut out = vec![f32::NAN; all_q.len()];
            paged_attention_with(isa, &inputs, &mut out);
            for (i, (got, want)) in out.iter().zip(&dense).enumerate() {
                assert!((*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{isa:?} at {i}: got {got} want {want}");
            }
        }
        let mut out = vec![f32::NAN; all_q.len()];
        paged_attention(&all_q, &chunks, &layer, &layout, heads, &mut out);
        for (got, want) in out.iter().zip(&dense) {
            assert!((*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "got {got} want {want}");
        }
    }

    #[test]
    fn paged_chunked_attention_matches_dense_reference() {
        // Seq A: 10 cached tokens and a 5-token chunk; seq B: one decode token at position 13.
        check(3, &Case { heads: 6, kv_heads: 2, hd: 16, bs: 4, seqs: vec![(10, 5), (13, 1)] });
    }

    #[test]
    fn attention_handles_odd_head_dims_partial_blocks_and_parallel_work() {
        // head_dim 20 (not a multiple of 8) and 64; last blocks partly filled; enough work for
        // the parallel path (a prefill chunk, several decode tokens, a fresh single token).
        check(5, &Case { heads: 4, kv_heads: 4, hd: 20, bs: 3, seqs: vec![(0, 1), (7, 1), (30, 9)] });
        check(6, &Case { heads: 9, kv_heads: 3, hd: 64, bs: 16, seqs: vec![(0, 40), (100, 1), (37, 1), (15, 2)] });
    }
}
