//! Log-softmax helpers: a stable log-sum-exp and the top-N logprobs of a logits row.
//!
//! Invariants: the log-sum-exp subtracts the maximum and accumulates in f64, so it neither
//! overflows nor loses the small terms; `-inf` entries contribute nothing; a row that is all
//! `-inf` has log-sum-exp `-inf` (callers turn that into `-inf` logprobs, never NaN).

use super::filters::{FilterScratch, best_ids};
use super::math::{exp_into, max_f32, sum_f64};

/// `ln Σ exp(l_i)`, computed stably; `-inf` when every entry is `-inf` (or the row is empty).
/// `scratch` receives `exp(l_i - max)`.
pub(crate) fn log_sum_exp(logits: &[f32], scratch: &mut Vec<f32>) -> f32 {
    let max = max_f32(logits);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    if max == f32::INFINITY {
        return f32::INFINITY;
    }
    exp_into(logits, max, scratch);
    (f64::from(max) + sum_f64(scratch).ln()) as f32
}

/// The log-probability of `logit` under a row whose log-sum-exp is `lse`.
pub(crate) fn logprob(logit: f32, lse: f32) -> f32 {
    if lse.is_finite() {
        logit - lse
    } else {
        f32::NEG_INFINITY
    }
}

/// The `n` most likely tokens of the row and their logprobs, best first (ties: lowest id);
/// `-inf` entries are left out.
pub(crate) fn top_logprobs(
    logits: &[f32],
    lse: f32,
    n: usize,
    scratch: &mut FilterScratch,
) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = best_ids(logits, n, scratch)
        .map(|id| (id, logits[id as usize]))
        .collect();
    top.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for t in &mut top {
        t.1 = logprob(t.1, lse);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lse_matches_direct_formula_and_is_stable() {
        let l = [1.0f32, 2.0, 3.0];
        let direct = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln() as f32;
        assert!((log_sum_exp(&l, &mut Vec::new()) - direct).abs() < 1e-6);
        // Shift invariance far beyond exp's range.
        let big = [1001.0f32, 1002.0, 1003.0];
        assert!((log_sum_exp(&big, &mut Vec::new()) - (direct + 1000.0)).abs() < 1e-3);
        let neg = [-1e4f32, -1e4];
        assert!((log_sum_exp(&neg, &mut Vec::new()) - (-1e4 + 2f32.ln())).abs() < 1e-2);
    }

    #[test]
    fn lse_of_all_neg_inf_is_neg_inf() {
        assert_eq!(
            log_sum_exp(&[f32::NEG_INFINITY; 3], &mut Vec::new()),
            f32::NEG_INFINITY
        );
        assert_eq!(log_sum_exp(&[], &mut Vec::new()), f32::NEG_INFINITY);
        assert_eq!(logprob(0.0, f32::NEG_INFINITY), f32::NEG_INFINITY);
        // -inf entries contribute nothing.
        assert!((log_sum_exp(&[0.0, f32::NEG_INFINITY], &mut Vec::new()) - 0.0).abs() < 1e-7);
    }

    #[test]
    fn top_logprobs_sorted_with_ties_by_id() {
        let l = [0.0f32, 2.0, 1.0, 2.0, -1.0];
        let lse = log_sum_exp(&l, &mut Vec::new());
        let mut s = FilterScratch::default();
        let top = top_logprobs(&l, lse, 3, &mut s);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!((top[0].1 - (2.0 - lse)).abs() < 1e-6);
        let total: f32 = l.iter().map(|&x| (x - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(top_logprobs(&l, lse, 0, &mut s), vec![]);
        assert_eq!(top_logprobs(&l, lse, 99, &mut s).len(), 5);
        let with_inf = [f32::NEG_INFINITY, 1.0];
        assert_eq!(top_logprobs(&with_inf, 1.0, 2, &mut s), vec![(1, 0.0)]);
    }
}
