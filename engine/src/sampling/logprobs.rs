//! Log-softmax helpers: a stable log-sum-exp and the top-N logprobs of a logits row.
//!
//! Invariants: the log-sum-exp subtracts the maximum and accumulates in f64, so it neither
//! overflows nor loses the small terms; `-inf` entries contribute nothing; a row that is all
//! `-inf` has log-sum-exp `-inf` (callers turn that into `-inf` logprobs, never NaN).

use super::filters::{Candidate, best_first};

/// `ln Σ exp(l_i)`, computed stably; `-inf` when every entry is `-inf` (or the row is empty).
pub(crate) fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    if max == f32::INFINITY {
        return f32::INFINITY;
    }
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    (f64::from(max) + sum.ln()) as f32
}

/// The log-probability of `logit` under a row whose log-sum-exp is `lse`.
pub(crate) fn logprob(logit: f32, lse: f32) -> f32 {
    if lse.is_finite() {
        logit - lse
    } else {
        f32::NEG_INFINITY
    }
}

/// The `n` most likely tokens of the row and their logprobs, best first (ties: lowest id).
/// `scratch` is reused between calls.
pub(crate) fn top_logprobs(
    logits: &[f32],
    lse: f32,
    n: usize,
    scratch: &mut Vec<Candidate>,
) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
        id: i as u32,
        logit: l,
    }));
    let n = n.min(scratch.len());
    if n < scratch.len() {
        scratch.select_nth_unstable_by(n - 1, best_first);
        scratch.truncate(n);
    }
    scratch.sort_unstable_by(best_first);
    scratch
        .iter()
        .map(|c| (c.id, logprob(c.logit, lse)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lse_matches_direct_formula_and_is_stable() {
        let l = [1.0f32, 2.0, 3.0];
        let direct = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln() as f32;
        assert!((log_sum_exp(&l) - direct).abs() < 1e-6);
        // Shift invariance far beyond exp's range.
        let big = [1001.0f32, 1002.0, 1003.0];
        assert!((log_sum_exp(&big) - (direct + 1000.0)).abs() < 1e-3);
        let neg = [-1e4f32, -1e4];
        assert!((log_sum_exp(&neg) - (-1e4 + 2f32.ln())).abs() < 1e-2);
    }

    #[test]
    fn lse_of_all_neg_inf_is_neg_inf() {
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
        assert_eq!(log_sum_exp(&[]), f32::NEG_INFINITY);
        assert_eq!(logprob(0.0, f32::NEG_INFINITY), f32::NEG_INFINITY);
        // -inf entries contribute nothing.
        assert!((log_sum_exp(&[0.0, f32::NEG_INFINITY]) - 0.0).abs() < 1e-7);
    }

    #[test]
    fn top_logprobs_sorted_with_ties_by_id() {
        let l = [0.0f32, 2.0, 1.0, 2.0, -1.0];
        let lse = log_sum_exp(&l);
        let mut s = Vec::new();
        let top = top_logprobs(&l, lse, 3, &mut s);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!((top[0].1 - (2.0 - lse)).abs() < 1e-6);
        let total: f32 = l.iter().map(|&x| (x - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(top_logprobs(&l, lse, 0, &mut s), vec![]);
        assert_eq!(top_logprobs(&l, lse, 99, &mut s).len(), 5);
    }
}
