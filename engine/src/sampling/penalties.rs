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
//! calls so a decode step allocates nothing once they have grown; the prompt's distinct tokens
//! are computed once and reused while the prompt (by length and fingerprint) is unchanged, so a
//! step costs O(distinct prompt tokens + output) without hashing the prompt again.

use std::collections::{HashMap, HashSet};

/// Reusable scratch space for [`apply_penalties`].
#[derive(Debug, Default)]
pub(crate) struct PenaltyScratch {
    /// `(length, fingerprint)` of the prompt the two fields below describe.
    prompt_key: Option<(usize, u64)>,
    prompt_set: HashSet<u32>,
    prompt_distinct: Vec<u32>,
    seen: HashSet<u32>,
    counts: HashMap<u32, u32>,
}

/// FNV-1a over the token ids: cheap, and enough to notice a different prompt.
fn fingerprint(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xCBF2_9CE4_8422_2325, |h, &t| {
        (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01B3)
    })
}

fn repetition(l: f32, r: f32) -> f32 {
    if l > 0.0 { l / r } else { l * r }
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
        let key = (prompt.len(), fingerprint(prompt));
        if scratch.prompt_key != Some(key) {
            scratch.prompt_set.clear();
            scratch.prompt_distinct.clear();
            for &t in prompt {
                if scratch.prompt_set.insert(t) {
                    scratch.prompt_distinct.push(t);
                }
            }
            scratch.prompt_key = Some(key);
        }
        for &t in &scratch.prompt_distinct {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = repetition(*l, pen.repetition);
            }
        }
        scratch.seen.clear();
        for &t in output {
            if (t as usize) < vocab && !scratch.prompt_set.contains(&t) && scratch.seen.insert(t) {
                logits[t as usize] = repetition(logits[t as usize], pen.repetition);
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

/// The token history a device sampler needs for penalties: every distinct token of
/// `prompt ∪ output` below `vocab` with its number of occurrences in `output` (0 for tokens only
/// in the prompt), in first-seen order (prompt first). Repetition applies to every listed token,
/// presence and frequency to those with a count above 0, exactly as [`apply_penalties`] does.
pub fn penalty_history(prompt: &[u32], output: &[u32], vocab: usize) -> Vec<(u32, u32)> {
    let mut index: HashMap<u32, usize> = HashMap::new();
    let mut list: Vec<(u32, u32)> = Vec::new();
    for &t in prompt.iter().filter(|&&t| (t as usize) < vocab) {
        index.entry(t).or_insert_with(|| {
            list.push((t, 0));
            list.len() - 1
        });
    }
    for &t in output.iter().filter(|&&t| (t as usize) < vocab) {
        let i = *index.entry(t).or_insert_with(|| {
            list.push((t, 0));
            list.len() - 1
        });
        list[i].1 += 1;
    }
    list
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

    /// Applying the listed history the way a device does equals [`apply_penalties`].
    #[test]
    fn history_reproduces_apply_penalties() {
        let pen = Penalties { repetition: 1.3, presence: 0.4, frequency: 0.2 };
        let logits = [2.0f32, -1.0, 0.5, 3.0, -0.25, 1.0];
        let (prompt, output) = ([0u32, 0, 3, 9], [1u32, 3, 1, 5, 2]);
        let want = run(&logits, &prompt, &output, pen);
        let mut got = logits.to_vec();
        for (t, count) in penalty_history(&prompt, &output, logits.len()) {
            let l = &mut got[t as usize];
            *l = repetition(*l, pen.repetition);
            if count > 0 {
                *l -= pen.presence + pen.frequency * count as f32;
            }
        }
        assert_eq!(got, want);
    }

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
    fn prompt_cache_follows_prompt_changes() {
        let pen = Penalties {
            repetition: 2.0,
            ..NONE
        };
        let mut scratch = PenaltyScratch::default();
        let mut run_with = |prompt: &[u32], output: &[u32]| {
            let mut l = vec![4.0f32; 4];
            apply_penalties(&mut l, prompt, output, pen, &mut scratch);
            l
        };
        assert_eq!(run_with(&[0, 1], &[]), vec![2.0, 2.0, 4.0, 4.0]);
        // Same prompt again (cached), output grows and overlaps the prompt.
        assert_eq!(run_with(&[0, 1], &[1, 2, 2]), vec![2.0, 2.0, 2.0, 4.0]);
        // A different prompt of the same length is noticed.
        assert_eq!(run_with(&[3, 1], &[]), vec![4.0, 2.0, 4.0, 2.0]);
        assert_eq!(run_with(&[], &[0]), vec![2.0, 4.0, 4.0, 4.0]);
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
