//! Repetition, presence and frequency penalties applied to one row of logits.
//!
//! Semantics (vLLM/HF/OpenAI):
//! - repetition penalty `r` applies once to every distinct token of prompt ∪ output: a positive
//!   logit becomes `l / r`, a non-positive one `l * r`;
//! - presence penalty `p` and frequency penalty `f` apply to output tokens only:
//!   `l -= p + f * count` for every token that occurs `count > 0` times in the output.
//!
//! Invariants: token ids at or beyond the logits row are ignored (never a panic); each token is
//! penalised exactly once per kind however often it repeats; the scratch sets are reused between
//! calls so a decode step allocates nothing once they have grown.

use std::collections::{HashMap, HashSet};

/// Reusable scratch space for [`apply_penalties`].
#[derive(Debug, Default)]
pub(crate) struct PenaltyScratch {
    seen: HashSet<u32>,
    counts: HashMap<u32, u32>,
}

/// The three penalty strengths; `1.0`, `0.0`, `0.0` is a no-op.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Penalties {
    pub(crate) repetition: f32,
    pub(crate) presence: f32,
    pub(crate) frequency: f32,
}

/// Applies the penalties in place: repetition first, then presence/frequency.
pub(crate) fn apply_penalties(
    logits: &mut [f32],
    prompt: &[u32],
    output: &[u32],
    pen: Penalties,
    scratch: &mut PenaltyScratch,
) {
    let vocab = logits.len();
    if pen.repetition != 1.0 {
        scratch.seen.clear();
        for &t in prompt.iter().chain(output) {
            let i = t as usize;
            if i < vocab && scratch.seen.insert(t) {
                let l = logits[i];
                logits[i] = if l > 0.0 {
                    l / pen.repetition
                } else {
                    l * pen.repetition
                };
            }
        }
    }
    if pen.presence != 0.0 || pen.frequency != 0.0 {
        scratch.counts.clear();
        for &t in output {
            if (t as usize) < vocab {
                *scratch.counts.entry(t).or_insert(0) += 1;
            }
        }
        for (&t, &c) in &scratch.counts {
            logits[t as usize] -= pen.presence + pen.frequency * c as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(logits: &[f32], prompt: &[u32], output: &[u32], pen: Penalties) -> Vec<f32> {
        let mut l = logits.to_vec();
        apply_penalties(&mut l, prompt, output, pen, &mut PenaltyScratch::default());
        l
    }

    const NONE: Penalties = Penalties {
        repetition: 1.0,
        presence: 0.0,
        frequency: 0.0,
    };

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_once() {
        let pen = Penalties {
            repetition: 2.0,
            ..NONE
        };
        // token 0 (positive) in prompt twice, token 1 (negative) in output, token 3 (zero) in
        // both, token 2 untouched.
        let out = run(&[4.0, -1.0, 3.0, 0.0], &[0, 0, 3], &[1, 3, 1], pen);
        assert_eq!(out, vec![2.0, -2.0, 3.0, 0.0]);
    }

    #[test]
    fn repetition_below_one_rewards_seen_tokens() {
        let pen = Penalties {
            repetition: 0.5,
            ..NONE
        };
        let out = run(&[4.0, -1.0], &[0], &[1], pen);
        assert_eq!(out, vec![8.0, -0.5]);
    }

    #[test]
    fn presence_and_frequency_use_output_counts_only() {
        let pen = Penalties {
            repetition: 1.0,
            presence: 0.5,
            frequency: 0.25,
        };
        // token 0 only in the prompt: untouched; token 1 three times in output; token 2 once.
        let out = run(&[1.0, 1.0, 1.0, 1.0], &[0, 0], &[1, 2, 1, 1], pen);
        assert_eq!(out, vec![1.0, 1.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 1.0]);
    }

    #[test]
    fn negative_penalties_encourage() {
        let pen = Penalties {
            repetition: 1.0,
            presence: -1.0,
            frequency: -0.5,
        };
        let out = run(&[0.0, 0.0], &[], &[1, 1], pen);
        assert_eq!(out, vec![0.0, 2.0]);
    }

    #[test]
    fn all_three_compose_in_order() {
        let pen = Penalties {
            repetition: 2.0,
            presence: 1.0,
            frequency: 1.0,
        };
        // token 0: 6 / 2 = 3, then -1 -1*2 = 0.
        let out = run(&[6.0, 1.0], &[0], &[0, 0], pen);
        assert_eq!(out, vec![0.0, 1.0]);
    }

    #[test]
    fn out_of_range_ids_are_ignored() {
        let pen = Penalties {
            repetition: 2.0,
            presence: 1.0,
            frequency: 1.0,
        };
        let out = run(&[2.0, 2.0], &[7, u32::MAX], &[2, 9], pen);
        assert_eq!(out, vec![2.0, 2.0]);
    }

    #[test]
    fn no_op_penalties_change_nothing() {
        let out = run(&[1.5, -2.0, 0.0], &[0, 1, 2], &[0, 1, 2], NONE);
        assert_eq!(out, vec![1.5, -2.0, 0.0]);
    }
}
