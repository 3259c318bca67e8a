//! The truncation filters (top-k, top-p, min-p) over a candidate list of `(token, logit)`.
//!
//! Invariants:
//! - candidates are ordered by a total order, logit descending then token id ascending, so
//!   every filter is deterministic even with tied logits (ties keep the lowest ids);
//! - a filter never removes the most likely candidate, so a non-empty list stays non-empty;
//! - no filter fully sorts the vocabulary unless it must: top-k is a linear-time select, top-p
//!   sorts growing chunks of the best candidates and stops as soon as the mass is reached,
//!   min-p is a threshold on logits (`p_i >= min_p * p_max` ⟺ `l_i >= l_max + ln min_p`).
//!
//! The logits are expected finite (the sampler drops `-inf` and maps NaN to `-inf` before).

use std::cmp::Ordering;

/// One token still in the running, with its (penalised, temperature-scaled) logit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) id: u32,
    pub(crate) logit: f32,
}

/// Best first: higher logit, then lower token id.
pub(crate) fn best_first(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// The largest logit among the candidates (`-inf` for an empty list).
pub(crate) fn max_logit(cands: &[Candidate]) -> f32 {
    cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit))
}

/// Keeps the `k` best candidates (unsorted); `k == 0` or `k >= len` keeps all.
pub(crate) fn top_k(cands: &mut Vec<Candidate>, k: usize) {
    if k == 0 || k >= cands.len() {
        return;
    }
    cands.select_nth_unstable_by(k - 1, best_first);
    cands.truncate(k);
}

/// First chunk of candidates that top-p sorts; later chunks grow by [`TOP_P_GROWTH`].
const TOP_P_FIRST_CHUNK: usize = 64;
const TOP_P_GROWTH: usize = 4;

/// Keeps the smallest best-first prefix whose softmax mass reaches `p` (at least one token):
/// candidate `i` (best first) survives iff the mass of the candidates before it is `< p`.
/// On return the survivors are sorted best first. `p >= 1` keeps all (unsorted).
pub(crate) fn top_p(cands: &mut Vec<Candidate>, p: f32) {
    if p >= 1.0 || cands.len() <= 1 {
        return;
    }
    let max = max_logit(cands);
    let total: f64 = cands.iter().map(|c| f64::from((c.logit - max).exp())).sum();
    let target = f64::from(p) * total;
    let len = cands.len();
    let mut sorted = 0;
    let mut chunk = TOP_P_FIRST_CHUNK;
    let mut cum = 0.0f64;
    loop {
        let end = (sorted + chunk).min(len);
        if end < len {
            // Move the best `end - sorted` of the unsorted tail to its front.
            cands[sorted..].select_nth_unstable_by(end - sorted - 1, best_first);
        }
        cands[sorted..end].sort_unstable_by(best_first);
        for i in sorted..end {
            if cum >= target {
                cands.truncate(i);
                return;
            }
            cum += f64::from((cands[i].logit - max).exp());
        }
        if end == len {
            return;
        }
        sorted = end;
        chunk = chunk.saturating_mul(TOP_P_GROWTH);
    }
}

/// Keeps candidates whose probability is at least `min_p` times the largest; `0` keeps all.
/// Order is preserved.
pub(crate) fn min_p(cands: &mut Vec<Candidate>, min_p: f32) {
    if min_p <= 0.0 || cands.is_empty() {
        return;
    }
    let threshold = max_logit(cands) + min_p.ln();
    cands.retain(|c| c.logit >= threshold);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn cands(logits: &[f32]) -> Vec<Candidate> {
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
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
        top_p(&mut c, 0.7);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 3]);
        let mut c = cands(&l);
        top_p(&mut c, 0.85);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 3, 0]);
        let mut c = cands(&l);
        top_p(&mut c, 0.81);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 3, 0]);
        let mut c = cands(&l);
        top_p(&mut c, 0.79);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn top_p_always_keeps_the_best() {
        let l = logits_for_probs(&[0.1, 0.9]);
        let mut c = cands(&l);
        top_p(&mut c, 1e-6);
        assert_eq!(ids(&c), vec![1]);
    }

    #[test]
    fn top_p_one_keeps_all() {
        let mut c = cands(&[1.0, 2.0, 3.0]);
        top_p(&mut c, 1.0);
        assert_eq!(c.len(), 3);
    }

    /// Reference top-p by full sort, to check the chunked search on large random inputs.
    fn top_p_reference(logits: &[f32], p: f32) -> Vec<u32> {
        let mut c = cands(logits);
        let max = max_logit(&c);
        // Summed in input order, as `top_p` does, so both compare the same f64 target.
        let total: f64 = c.iter().map(|c| f64::from((c.logit - max).exp())).sum();
        c.sort_by(best_first);
        let mut cum = 0.0;
        let mut keep = Vec::new();
        for x in &c {
            if cum >= f64::from(p) * total {
                break;
            }
            cum += f64::from((x.logit - max).exp());
            keep.push(x.id);
        }
        keep
    }

    #[test]
    fn top_p_chunked_matches_full_sort() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for case in 0..40 {
            let n = [5, 63, 64, 65, 300, 5000][case % 6];
            // Mix of sharp and flat distributions; quantised so ties occur.
            let scale = if case % 2 == 0 { 10.0 } else { 0.5 };
            let logits: Vec<f32> = (0..n)
                .map(|_| (rng.random::<f32>() * scale * 8.0).round() / 8.0)
                .collect();
            for p in [0.1, 0.5, 0.9, 0.99, 0.999] {
                let mut c = cands(&logits);
                top_p(&mut c, p);
                let got: Vec<u32> = c.iter().map(|c| c.id).collect();
                assert_eq!(got, top_p_reference(&logits, p), "n={n} p={p}");
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
    fn min_p_keeps_ties_with_the_max() {
        let mut c = cands(&[2.0, 2.0, 1.0]);
        min_p(&mut c, 1.0);
        assert_eq!(ids(&c), vec![0, 1]);
    }
}
