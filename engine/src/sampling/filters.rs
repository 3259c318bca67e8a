//! The truncation filters (top-k, top-p, min-p).
//!
//! The first filter of a step runs over the whole logits row (`*_of_row`: `logits` plus their
//! `weights`) and produces a short candidate list of `(token, logit, weight)`; later filters
//! run over that list. Only the survivors of the first filter are ever materialised.
//!
//! Invariants:
//! - candidates are ranked by a total order, logit descending then token id ascending, so
//!   every filter is deterministic even with tied logits (ties keep the lowest ids);
//! - `weight` is `exp(logit - m)` for one constant `m` shared by the whole row (the sampler
//!   uses the row maximum), so weights are unnormalised probabilities; `-inf` logits are never
//!   candidates;
//! - a filter never removes the best candidate, so a non-empty list stays non-empty;
//! - nothing sorts the vocabulary: top-k scans with a size-k heap (or selects, for huge k);
//!   top-p first tries the best 64 by heap scan, and otherwise buckets by logit and sorts only
//!   the bucket where the mass target falls; min-p is a threshold on the weights.
//!
//! Filters may reorder the list; the sampler's draw only needs a deterministic order.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use super::math::finite_min_max;

/// One token still in the running.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Candidate {
    /// Token id.
    pub(crate) id: u32,
    /// Penalised, temperature-scaled logit (finite).
    pub(crate) logit: f32,
    /// `exp(logit - m)`, see the module doc.
    pub(crate) weight: f32,
}

/// Reusable buffers for the filters.
#[derive(Debug, Default)]
pub(crate) struct FilterScratch {
    /// Min-heap of `(rank key, token id)` for heap scans.
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    /// Candidates of top-p's boundary bucket.
    boundary: Vec<Candidate>,
    /// Mass per top-p bucket.
    mass: Vec<f64>,
    /// Top-p bucket of each row entry.
    index: Vec<u16>,
}

/// Best first: higher logit, then lower token id.
pub(crate) fn best_first(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// A key whose unsigned order is the best-first order: logit by `total_cmp`, then lower id.
fn rank_key(logit: f32, id: u32) -> u64 {
    let b = logit.to_bits();
    let ordered = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - id)
}

/// Every finite entry of the row.
pub(crate) fn all_of_row(logits: &[f32], weights: &[f32], out: &mut Vec<Candidate>) {
    out.clear();
    out.extend(
        logits
            .iter()
            .zip(weights)
            .enumerate()
            .filter_map(|(i, (&logit, &weight))| {
                (logit > f32::NEG_INFINITY).then_some(Candidate {
                    id: i as u32,
                    logit,
                    weight,
                })
            }),
    );
}

/// Largest `k` for which [`top_k_of_row`] is meant (a heap scan); beyond it use
/// [`all_of_row`] and [`top_k`].
pub(crate) const TOP_K_HEAP_MAX: usize = 1024;

/// Leaves the `k` best entries greater than `-inf` in `heap`, by one scan: O(n) compares plus
/// O(k log k).
fn scan_best(logits: &[f32], k: usize, heap: &mut BinaryHeap<Reverse<(u64, u32)>>) {
    heap.clear();
    if k == 0 {
        return;
    }
    for (i, &l) in logits.iter().enumerate() {
        if l == f32::NEG_INFINITY {
            continue;
        }
        let key = rank_key(l, i as u32);
        if heap.len() < k {
            heap.push(Reverse((key, i as u32)));
        } else if let Some(mut worst) = heap.peek_mut()
            && key > worst.0.0
        {
            *worst = Reverse((key, i as u32));
        }
    }
}

/// The ids of the `k` best entries greater than `-inf`, in no particular order.
pub(crate) fn best_ids<'s>(
    logits: &[f32],
    k: usize,
    scratch: &'s mut FilterScratch,
) -> impl Iterator<Item = u32> + 's {
    scan_best(logits, k, &mut scratch.heap);
    scratch.heap.drain().map(|Reverse((_, id))| id)
}

/// The `k` best entries of the row into `out` (in no particular order), by a heap scan.
pub(crate) fn top_k_of_row(
    logits: &[f32],
    weights: &[f32],
    k: usize,
    scratch: &mut FilterScratch,
    out: &mut Vec<Candidate>,
) {
    out.clear();
    out.extend(best_ids(logits, k, scratch).map(|id| Candidate {
        id,
        logit: logits[id as usize],
        weight: weights[id as usize],
    }));
}

/// Keeps the `k` best candidates (in no particular order); `k == 0` or `k >= len` keeps all.
pub(crate) fn top_k(cands: &mut Vec<Candidate>, k: usize) {
    if k == 0 || k >= cands.len() {
        return;
    }
    cands.select_nth_unstable_by(k - 1, best_first);
    cands.truncate(k);
}

/// Lists up to this long are simply sorted by top-p.
const TOP_P_SORT_MAX: usize = 256;
/// How many best entries top-p over a row tries before falling back to buckets.
const TOP_P_FIRST_TRY: usize = 64;
/// Logit buckets top-p uses for long lists and rows.
const TOP_P_BUCKETS: usize = 1024;

/// Linear logit buckets over `[lo, hi]`; bucket 0 holds the highest logits. The index is
/// monotone (non-increasing) in the logit, so every entry of a lower-numbered bucket ranks
/// before every entry of a higher-numbered one.
#[derive(Clone, Copy, Debug)]
struct Buckets {
    hi: f32,
    scale: f32,
}

impl Buckets {
    fn new((lo, hi): (f32, f32)) -> Self {
        Buckets {
            hi,
            scale: TOP_P_BUCKETS as f32 / (hi - lo),
        }
    }

    /// The bucket of a finite logit.
    fn index(self, logit: f32) -> usize {
        if self.scale.is_finite() {
            (((self.hi - logit) * self.scale) as usize).min(TOP_P_BUCKETS - 1)
        } else {
            0
        }
    }
}

/// Bucket index stored for `-inf` entries of a row.
const NO_BUCKET: u16 = u16::MAX;

/// The first bucket where the cumulative mass reaches `target`, and the mass before it;
/// `None` if rounding leaves the target unreached (then everything stays).
fn boundary_bucket(mass: &[f64], target: f64) -> Option<(usize, f64)> {
    let mut before = 0.0f64;
    for (b, &m) in mass.iter().enumerate() {
        if before + m >= target {
            return Some((b, before));
        }
        before += m;
    }
    None
}

/// Walks `cands[from..]` (sorted best first) with `cum` mass before it and truncates at the
/// first candidate whose preceding mass reaches `target`. Returns whether it truncated.
fn cut_sorted(cands: &mut Vec<Candidate>, from: usize, mut cum: f64, target: f64) -> bool {
    for i in from..cands.len() {
        if cum >= target {
            cands.truncate(i);
            return true;
        }
        cum += f64::from(cands[i].weight);
    }
    false
}

/// Top-p over a candidate list: keeps the smallest best-first prefix whose mass reaches `p` of
/// the list's total (at least one candidate): in best-first order, candidate `i` survives iff
/// the mass before it is `< p * total`. `p >= 1` keeps all.
pub(crate) fn top_p(cands: &mut Vec<Candidate>, p: f32, scratch: &mut FilterScratch) {
    if p >= 1.0 || cands.len() <= 1 {
        return;
    }
    let total: f64 = cands.iter().map(|c| f64::from(c.weight)).sum();
    let target = f64::from(p) * total;
    if cands.len() <= TOP_P_SORT_MAX {
        cands.sort_unstable_by(best_first);
        cut_sorted(cands, 0, 0.0, target);
        return;
    }
    let bounds = cands
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c.logit), hi.max(c.logit))
        });
    let buckets = Buckets::new(bounds);
    scratch.mass.clear();
    scratch.mass.resize(TOP_P_BUCKETS, 0.0);
    for c in cands.iter() {
        scratch.mass[buckets.index(c.logit)] += f64::from(c.weight);
    }
    let Some((boundary, before)) = boundary_bucket(&scratch.mass, target) else {
        return;
    };
    scratch.boundary.clear();
    let mut kept = 0;
    for i in 0..cands.len() {
        let c = cands[i];
        match buckets.index(c.logit).cmp(&boundary) {
            Ordering::Less => {
                cands[kept] = c;
                kept += 1;
            }
            Ordering::Equal => scratch.boundary.push(c),
            Ordering::Greater => {}
        }
    }
    cands.truncate(kept);
    scratch.boundary.sort_unstable_by(best_first);
    cands.extend_from_slice(&scratch.boundary);
    cut_sorted(cands, kept, before, target);
}

/// Top-p over the whole row (`total` is the sum of `weights`), same rule as [`top_p`], into
/// `out`. When the best [`TOP_P_FIRST_TRY`] entries could hold the target mass, it tries them
/// first (the common case for sharp distributions); otherwise it buckets the row.
pub(crate) fn top_p_of_row(
    logits: &[f32],
    weights: &[f32],
    total: f64,
    p: f32,
    scratch: &mut FilterScratch,
    out: &mut Vec<Candidate>,
) {
    if p >= 1.0 {
        all_of_row(logits, weights, out);
        return;
    }
    let target = f64::from(p) * total;
    let max_weight = weights
        .iter()
        .fold(0.0f32, |m, &w| if w > m { w } else { m });
    if TOP_P_FIRST_TRY as f64 * f64::from(max_weight) >= target {
        top_k_of_row(logits, weights, TOP_P_FIRST_TRY, scratch, out);
        out.sort_unstable_by(best_first);
        let whole_row = out.len() < TOP_P_FIRST_TRY;
        if cut_sorted(out, 0, 0.0, target) || whole_row {
            // The cut fell inside the best entries, or they are all the row has.
            return;
        }
    }
    let buckets = Buckets::new(finite_min_max(logits));
    let FilterScratch {
        boundary,
        mass,
        index,
        ..
    } = scratch;
    index.clear();
    index.extend(logits.iter().map(|&l| {
        if l > f32::NEG_INFINITY {
            buckets.index(l) as u16
        } else {
            NO_BUCKET
        }
    }));
    mass.clear();
    mass.resize(TOP_P_BUCKETS, 0.0);
    for (&b, &w) in index.iter().zip(weights) {
        if b != NO_BUCKET {
            mass[usize::from(b)] += f64::from(w);
        }
    }
    out.clear();
    let Some((edge, before)) = boundary_bucket(mass, target) else {
        all_of_row(logits, weights, out);
        return;
    };
    let edge = edge as u16; // < TOP_P_BUCKETS <= u16::MAX
    boundary.clear();
    for (i, &b) in index.iter().enumerate() {
        if b <= edge {
            let c = Candidate {
                id: i as u32,
                logit: logits[i],
                weight: weights[i],
            };
            if b < edge {
                out.push(c)
            } else {
                boundary.push(c)
            }
        }
    }
    let kept = out.len();
    boundary.sort_unstable_by(best_first);
    out.extend_from_slice(boundary);
    cut_sorted(out, kept, before, target);
}

/// Keeps candidates whose probability is at least `min_p` times the largest; `0` keeps all.
/// Order is preserved.
pub(crate) fn min_p(cands: &mut Vec<Candidate>, min_p: f32) {
    if min_p <= 0.0 || cands.is_empty() {
        return;
    }
    let max = cands.iter().fold(0.0f32, |m, c| m.max(c.weight));
    let threshold = min_p * max;
    cands.retain(|c| c.weight >= threshold);
}

/// [`min_p`] over the whole row, into `out`.
pub(crate) fn min_p_of_row(logits: &[f32], weights: &[f32], min_p: f32, out: &mut Vec<Candidate>) {
    let max = weights.iter().fold(0.0f32, |m, &w| m.max(w));
    let threshold = if min_p > 0.0 { min_p * max } else { 0.0 };
    out.clear();
    out.extend(
        logits
            .iter()
            .zip(weights)
            .enumerate()
            .filter_map(|(i, (&logit, &weight))| {
                (logit > f32::NEG_INFINITY && weight >= threshold).then_some(Candidate {
                    id: i as u32,
                    logit,
                    weight,
                })
            }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn cands(logits: &[f32]) -> Vec<Candidate> {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
                weight: (l - max).exp(),
            })
            .collect()
    }

    fn ids(c: &[Candidate]) -> Vec<u32> {
        let mut v: Vec<u32> = c.iter().map(|c| c.id).collect();
        v.sort_unstable();
        v
    }

    /// Probabilities (softmax) of the logits, to build test inputs with known masses.
    fn logits_for_probs(p: &[f64]) -> Vec<f32> {
        p.iter().map(|&x| x.ln() as f32).collect()
    }

    #[test]
    fn top_k_keeps_the_k_largest() {
        let mut c = cands(&[0.1, 5.0, -3.0, 2.0, 4.0]);
        top_k(&mut c, 3);
        assert_eq!(ids(&c), vec![1, 3, 4]);
    }

    #[test]
    fn top_k_ties_keep_lowest_ids() {
        let mut c = cands(&[1.0, 2.0, 1.0, 1.0, 0.0]);
        top_k(&mut c, 3);
        assert_eq!(ids(&c), vec![0, 1, 2]);
    }

    #[test]
    fn rank_key_orders_like_best_first() {
        let vals = [
            -f32::MAX,
            -3.5,
            -1.0,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::MAX,
            f32::INFINITY,
        ];
        let mut all = Vec::new();
        for (i, &l) in vals.iter().enumerate() {
            for id in [0u32, 7, u32::MAX] {
                all.push(Candidate {
                    id: id.wrapping_add(i as u32),
                    logit: l,
                    weight: 0.0,
                });
            }
        }
        for a in &all {
            for b in &all {
                let by_key = rank_key(b.logit, b.id).cmp(&rank_key(a.logit, a.id));
                assert_eq!(by_key, best_first(a, b), "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn top_k_of_row_matches_select() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut scratch = FilterScratch::default();
        let mut out = Vec::new();
        for case in 0..50 {
            let n = [1, 10, 1000, 5000][case % 4];
            let mut logits: Vec<f32> = (0..n)
                .map(|_| (rng.random::<f32>() * 16.0).round() / 4.0)
                .collect();
            if case % 3 == 0 {
                logits[0] = f32::NEG_INFINITY;
            }
            let weights: Vec<f32> = logits.iter().map(|l| l.exp()).collect();
            for k in [1, 2, 50, 999] {
                top_k_of_row(&logits, &weights, k, &mut scratch, &mut out);
                let mut want = cands(&logits);
                want.retain(|c| c.logit > f32::NEG_INFINITY);
                top_k(&mut want, k);
                assert_eq!(ids(&out), ids(&want), "n={n} k={k}");
                assert!(out.iter().all(|c| c.weight == weights[c.id as usize]));
            }
        }
    }

    #[test]
    fn top_k_zero_or_large_keeps_all() {
        let mut c = cands(&[1.0, 2.0, 3.0]);
        top_k(&mut c, 0);
        assert_eq!(c.len(), 3);
        top_k(&mut c, 10);
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_mass() {
        // probs 0.5, 0.3, 0.15, 0.05 (shuffled positions)
        let l = logits_for_probs(&[0.15, 0.5, 0.05, 0.3]);
        let mut c = cands(&l);
        top_p(&mut c, 0.7, &mut FilterScratch::default());
        assert_eq!(ids(&c), vec![1, 3]);
        let mut c = cands(&l);
        top_p(&mut c, 0.85, &mut FilterScratch::default());
        assert_eq!(ids(&c), vec![0, 1, 3]);
        let mut c = cands(&l);
        top_p(&mut c, 0.81, &mut FilterScratch::default());
        assert_eq!(ids(&c), vec![0, 1, 3]);
        let mut c = cands(&l);
        top_p(&mut c, 0.79, &mut FilterScratch::default());
        assert_eq!(ids(&c), vec![1, 3]);
    }

    #[test]
    fn top_p_always_keeps_the_best() {
        let l = logits_for_probs(&[0.1, 0.9]);
        let mut c = cands(&l);
        top_p(&mut c, 1e-6, &mut FilterScratch::default());
        assert_eq!(ids(&c), vec![1]);
    }

    #[test]
    fn top_p_one_keeps_all() {
        let mut c = cands(&[1.0, 2.0, 3.0]);
        top_p(&mut c, 1.0, &mut FilterScratch::default());
        assert_eq!(c.len(), 3);
    }

    /// Reference top-p by full sort, to check the chunked search on large random inputs.
    fn top_p_reference(logits: &[f32], p: f32) -> Vec<u32> {
        let mut c = cands(logits);
        // Summed in input order, as `top_p` does, so both compare the same f64 target.
        let total: f64 = c.iter().map(|c| f64::from(c.weight)).sum();
        c.sort_by(best_first);
        let mut cum = 0.0;
        let mut keep = Vec::new();
        for x in &c {
            if cum >= f64::from(p) * total {
                break;
            }
            cum += f64::from(x.weight);
            keep.push(x.id);
        }
        keep.sort_unstable();
        keep
    }

    #[test]
    fn top_p_bucketed_matches_full_sort() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for case in 0..60 {
            let n = [5, 256, 257, 300, 5000, 50_000][case % 6];
            // Mix of sharp and flat distributions; quantised so ties occur.
            let scale = if case % 2 == 0 { 10.0 } else { 0.5 };
            let logits: Vec<f32> = (0..n)
                .map(|_| (rng.random::<f32>() * scale * 8.0).round() / 8.0)
                .collect();
            for p in [0.1, 0.5, 0.9, 0.99, 0.999] {
                let mut c = cands(&logits);
                top_p(&mut c, p, &mut FilterScratch::default());
                assert_eq!(ids(&c), top_p_reference(&logits, p), "n={n} p={p}");
            }
        }
    }

    #[test]
    fn min_p_is_relative_to_the_max() {
        // probs 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps p >= 0.125.
        let l = logits_for_probs(&[0.5, 0.3, 0.15, 0.05]);
        let mut c = cands(&l);
        min_p(&mut c, 0.25);
        assert_eq!(ids(&c), vec![0, 1, 2]);
        let mut c = cands(&l);
        min_p(&mut c, 1.0);
        assert_eq!(ids(&c), vec![0]);
        let mut c = cands(&l);
        min_p(&mut c, 0.0);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn top_p_of_row_matches_full_sort() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut scratch = FilterScratch::default();
        let mut out = Vec::new();
        for case in 0..60 {
            let n = [3, 64, 65, 1000, 50_000][case % 5];
            // Sharp rows end inside the first 64, flat ones need the buckets.
            let scale = [40.0, 4.0, 0.5][case % 3];
            let mut logits: Vec<f32> = (0..n)
                .map(|_| (rng.random::<f32>() * scale * 8.0).round() / 8.0)
                .collect();
            if case % 4 == 0 {
                logits[n / 2] = f32::NEG_INFINITY;
            }
            let row: Vec<Candidate> = cands(&logits);
            let weights: Vec<f32> = row.iter().map(|c| c.weight).collect();
            let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            for p in [0.1, 0.5, 0.9, 0.99, 0.999] {
                top_p_of_row(&logits, &weights, total, p, &mut scratch, &mut out);
                let finite: Vec<f32> = logits
                    .iter()
                    .map(|&l| if l.is_finite() { l } else { -1e30 })
                    .collect();
                let mut want = top_p_reference(&finite, p);
                want.retain(|&id| logits[id as usize].is_finite());
                assert_eq!(ids(&out), want, "n={n} scale={scale} p={p}");
            }
        }
    }

    #[test]
    fn row_selectors_skip_neg_inf() {
        let logits = [f32::NEG_INFINITY, 0.0, -1.0, f32::NEG_INFINITY];
        let weights: Vec<f32> = logits.iter().map(|l| l.exp()).collect();
        let mut out = Vec::new();
        all_of_row(&logits, &weights, &mut out);
        assert_eq!(ids(&out), vec![1, 2]);
        min_p_of_row(&logits, &weights, 0.5, &mut out);
        assert_eq!(ids(&out), vec![1]);
        min_p_of_row(&logits, &weights, 0.0, &mut out);
        assert_eq!(ids(&out), vec![1, 2]);
        let mut scratch = FilterScratch::default();
        top_k_of_row(&logits, &weights, 3, &mut scratch, &mut out);
        assert_eq!(ids(&out), vec![1, 2]);
        top_p_of_row(&logits, &weights, 1.3679, 0.99, &mut scratch, &mut out);
        assert_eq!(ids(&out), vec![1, 2]);
    }

    #[test]
    fn min_p_of_row_matches_list_min_p() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 101) as f32) / -10.0).collect();
        let row = cands(&logits);
        let weights: Vec<f32> = row.iter().map(|c| c.weight).collect();
        for mp in [0.0, 0.01, 0.3, 1.0] {
            let mut out = Vec::new();
            min_p_of_row(&logits, &weights, mp, &mut out);
            let mut want = row.clone();
            min_p(&mut want, mp);
            assert_eq!(out, want, "min_p={mp}");
        }
    }

    #[test]
    fn top_p_with_all_logits_equal_keeps_lowest_ids() {
        let mut c = cands(&[0.5; 1000]);
        top_p(&mut c, 0.25, &mut FilterScratch::default());
        assert_eq!(ids(&c), (0..250).collect::<Vec<u32>>());
    }

    #[test]
    fn min_p_keeps_ties_with_the_max() {
        let mut c = cands(&[2.0, 2.0, 1.0]);
        min_p(&mut c, 1.0);
        assert_eq!(ids(&c), vec![0, 1]);
    }
}
