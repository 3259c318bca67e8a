//! Causal attention whose keys and values come from paged blocks: one kernel for prefill chunks
//! (many query tokens, earlier context already cached) and decode (one query token).
//!
//! Invariant: a query at position `p` attends to exactly positions `0..=p` of its own sequence,
//! read through that sequence's block table; GQA maps query head `h` to KV head
//! `h / (num_heads / num_kv_heads)`.

use rayon::prelude::*;

use super::paged::PagedLayout;

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
/// `[tokens, num_heads, head_dim]`; K/V come from `layer` through each chunk's block table (their
/// entries for the chunk's own tokens must already be written).
pub fn paged_attention(
    q: &[f32],
    chunks: &[AttentionChunk<'_>],
    layer: &[f32],
    layout: &PagedLayout,
    num_heads: usize,
    out: &mut [f32],
) {
    let hd = layout.head_dim;
    let row = num_heads * hd;
    assert_eq!(q.len(), out.len(), "out must match q");
    assert!(num_heads.is_multiple_of(layout.num_kv_heads), "heads must be a multiple of kv heads");
    let group = num_heads / layout.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // Which chunk each token belongs to.
    let mut owner = vec![usize::MAX; q.len() / row];
    for (c, chunk) in chunks.iter().enumerate() {
        assert!(chunk.block_table.len() * layout.block_size >= chunk.start_pos + chunk.len, "block table too short");
        owner[chunk.first_token..chunk.first_token + chunk.len].fill(c);
    }
    out.par_chunks_mut(row).enumerate().for_each(|(t, out_row)| {
        let chunk = &chunks[owner[t]];
        let pos = chunk.start_pos + (t - chunk.first_token);
        let ctx = pos + 1;
        let mut scores = vec![0.0f32; ctx];
        for h in 0..num_heads {
            let kvh = h / group;
            let qh = &q[t * row + h * hd..t * row + (h + 1) * hd];
            for (j, s) in scores.iter_mut().enumerate() {
                let block = chunk.block_table[j / layout.block_size];
                let ko = layout.k_offset(block, kvh, j % layout.block_size);
                *s = dot(qh, &layer[ko..ko + hd]) * scale;
            }
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            let oh = &mut out_row[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for (j, s) in scores.iter().enumerate() {
                let block = chunk.block_table[j / layout.block_size];
                let vo = layout.v_offset(block, kvh, j % layout.block_size);
                let p = s * inv;
                for (o, v) in oh.iter_mut().zip(&layer[vo..vo + hd]) {
                    *o += p * v;
                }
            }
        }
    });
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() - a.len() % 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + ar.iter().zip(br).map(|(x, y)| x * y).sum::<f32>()
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

    #[test]
    fn paged_chunked_attention_matches_dense_reference() {
        let mut rng = SmallRng::seed_from_u64(3);
        let (heads, kv_heads, hd, bs) = (6, 2, 16, 4);
        let layout = PagedLayout { block_size: bs, num_kv_heads: kv_heads, head_dim: hd };
        let num_blocks = 24;
        let mut layer: Vec<f32> = (0..num_blocks * layout.block_elems()).map(|_| rng.random_range(-9.0..9.0)).collect();
        // Two sequences with scattered blocks: seq A has 10 cached tokens and a 5-token chunk,
        // seq B is a single decode token at position 13.
        let tables: [Vec<u32>; 2] = [vec![7, 2, 19, 11], vec![5, 0, 13, 22]];
        let lens = [(10usize, 5usize), (13, 1)];
        let mut all_q = Vec::new();
        let mut dense = Vec::new();
        for (s, &(start, len)) in lens.iter().enumerate() {
            let total = start + len;
            let k: Vec<f32> = (0..total * kv_heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..total * kv_heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            write_kv(&mut layer, &layout, &tables[s], 0, &k, &v);
            let q: Vec<f32> = (0..len * heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            dense.extend(reference(&q, &k, &v, heads, kv_heads, hd, start));
            all_q.extend(q);
        }
        let chunks = [
            AttentionChunk { first_token: 0, len: 5, start_pos: 10, block_table: &tables[0] },
            AttentionChunk { first_token: 5, len: 1, start_pos: 13, block_table: &tables[1] },
        ];
        let mut out = vec![f32::NAN; all_q.len()];
        paged_attention(&all_q, &chunks, &layer, &layout, heads, &mut out);
        for (got, want) in out.iter().zip(&dense) {
            assert!((*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "got {got} want {want}");
        }
    }
}
