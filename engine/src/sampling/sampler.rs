//! The per-sequence sampler: turns one row of logits into a token, its logprob and top logprobs.
//!
//! Pipeline (vLLM order): penalties → temperature → top-k → top-p → min-p → draw.
//!
//! Invariants:
//! - greedy (`temperature == 0`) is the argmax of the penalised logits, lowest index on ties
//!   (as `torch.argmax`), and never touches the RNG;
//! - a non-greedy step draws exactly one `f64` from the sequence's own ChaCha RNG, whatever the
//!   filters left, so a seeded sequence replays identically from the same logits;
//! - logprobs are the log-softmax of the penalised logits scaled by the temperature (scale 1
//!   for greedy), over the whole vocabulary, before any truncation filter;
//! - NaN logits are treated as `-inf` (never sampled unless nothing else is left) and `+inf` as
//!   the largest finite f32;
//! - scratch buffers are owned and reused, so a step allocates only the returned top-logprobs;
//! - `exp` runs once per vocabulary entry per step: the weights computed for the draw also give
//!   the log-sum-exp for the logprobs, and with no filter active the draw walks them directly.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::filters::{self, Candidate, FilterScratch};
use super::logprobs::{log_sum_exp, logprob, top_logprobs};
use super::math::{self, exp_into, sum_f64, weighted_index};
use super::params::SamplingParams;
use super::penalties::{Penalties, PenaltyScratch, apply_penalties};

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    /// The chosen token id.
    pub token: u32,
    /// Its log-probability (see the module doc for which distribution).
    pub logprob: f32,
    /// The requested number of most likely tokens with their logprobs, best first; empty unless
    /// `SamplingParams::logprobs` asked for some.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Mixes a request seed with a sequence index (SplitMix64 finaliser), so the `n` sequences of one
/// seeded request get distinct but reproducible RNG streams.
pub fn sequence_seed(request_seed: u64, index: usize) -> u64 {
    let mut z = request_seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One step's sampling parameters for a device sampler ([`Sampler::device_step`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceStep {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 keeps all.
    pub top_k: usize,
    /// 1 keeps all.
    pub top_p: f32,
    /// 0 keeps all.
    pub min_p: f32,
    /// Repetition penalty (1 is off).
    pub repetition: f32,
    /// Presence penalty (0 is off).
    pub presence: f32,
    /// Frequency penalty (0 is off).
    pub frequency: f32,
    /// The draw in `[0, 1)` (0 for greedy steps, which draw nothing).
    pub uniform: f64,
    /// Top logprobs asked for.
    pub logprobs: usize,
    /// Whether any penalty is active (the device then needs the token history).
    pub penalised: bool,
}

/// Picks tokens for one sequence. Owns its RNG and scratch buffers; create one per sequence.
#[derive(Debug)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    penalties: Option<Penalties>,
    logprobs: usize,
    rng: ChaCha8Rng,
    /// Penalised logits; after temperature scaling, shifted so the maximum is 0.
    work: Vec<f32>,
    /// `exp(work)` (non-greedy steps only).
    weights: Vec<f32>,
    cands: Vec<Candidate>,
    filter_scratch: FilterScratch,
    penalty_scratch: PenaltyScratch,
}

impl Sampler {
    /// A sampler for `params` (which should have passed [`SamplingParams::validate`]) whose RNG
    /// starts from `seed`. The engine passes [`sequence_seed`] of the request seed (or a random
    /// one) and the sequence index.
    pub fn new(params: &SamplingParams, seed: u64) -> Self {
        let penalties = params.has_penalties().then_some(Penalties {
            repetition: params.repetition_penalty,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
        });
        Sampler {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            penalties,
            logprobs: params.logprobs.unwrap_or(0),
            rng: ChaCha8Rng::seed_from_u64(seed),
            work: Vec::new(),
            weights: Vec::new(),
            cands: Vec::new(),
            filter_scratch: FilterScratch::default(),
            penalty_scratch: PenaltyScratch::default(),
        }
    }

    /// Samples the next token from one row of `vocab_size` logits. `prompt` and `output` are the
    /// sequence's tokens so far (for the penalties); ids outside the row are ignored.
    ///
    /// # Panics
    /// If `logits` is empty: the model always produces `vocab_size >= 1` logits, so an empty row
    /// is an engine bug, not bad input.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> SampledToken {
        assert!(
            !logits.is_empty(),
            "Sampler::sample called with an empty logits row"
        );
        self.work.clear();
        // NaN → -inf; +inf → f32::MAX (so `l - max` stays a number); -0.0 → +0.0 so equal
        // logits compare equal under total ordering.
        self.work.extend(logits.iter().map(|&l| {
            if l.is_nan() {
                f32::NEG_INFINITY
            } else {
                l.min(f32::MAX) + 0.0
            }
        }));
        if let Some(pen) = self.penalties {
            apply_penalties(
                &mut self.work,
                prompt,
                output,
                pen,
                &mut self.penalty_scratch,
            );
        }
        if self.temperature == 0.0 {
            let token = argmax(&self.work);
            let lse = log_sum_exp(&self.work, &mut self.weights);
            return self.finish(token, lse);
        }
        self.scale_by_temperature();
        exp_into(&self.work, 0.0, &mut self.weights);
        let total = sum_f64(&self.weights);
        // The maximum of `work` is 0 (when finite), so ln(total) is the log-sum-exp.
        let lse = if total > 0.0 {
            total.ln() as f32
        } else {
            f32::NEG_INFINITY
        };
        let u: f64 = self.rng.random();
        let filtered = (self.top_k != 0 && self.top_k < self.work.len())
            || self.top_p < 1.0
            || self.min_p > 0.0;
        let token = if filtered {
            self.filter(total);
            draw(self.cands.iter().map(|c| (c.id, c.weight)), u)
        } else {
            weighted_index(&self.weights, u * total).map(|i| i as u32)
        };
        let token = token.unwrap_or_else(|| argmax(&self.work));
        self.finish(token, lse)
    }

    /// This step's parameters for a sampler that runs on a device (the CUDA backend), which
    /// implements the same pipeline. Draws the step's uniform from the sequence's RNG exactly
    /// when [`Self::sample`] would (non-greedy steps only), so a seeded sequence stays
    /// reproducible on one device.
    pub fn device_step(&mut self) -> DeviceStep {
        let (repetition, presence, frequency) = match self.penalties {
            Some(p) => (p.repetition, p.presence, p.frequency),
            None => (1.0, 0.0, 0.0),
        };
        let uniform = if self.temperature == 0.0 { 0.0 } else { self.rng.random::<f64>() };
        DeviceStep {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition,
            presence,
            frequency,
            uniform,
            logprobs: self.logprobs,
            penalised: self.penalties.is_some(),
        }
    }

    /// Advances the RNG past `tokens` steps as [`Self::sample`] and [`Self::device_step`] would
    /// have taken them (one uniform per non-greedy step, none when greedy): a sequence resuming
    /// output another sampler produced draws next what that sampler would have.
    pub fn skip_steps(&mut self, tokens: usize) {
        if self.temperature != 0.0 {
            for _ in 0..tokens {
                let _: f64 = self.rng.random();
            }
        }
    }

    /// The top logprobs of a step a device sampled, from the row after penalties (as the device
    /// wrote it back): the same distribution [`Self::sample`] reports (temperature-scaled for
    /// non-greedy steps, before truncation).
    pub fn top_logprobs_of_penalised(&mut self, penalised: &[f32]) -> Vec<(u32, f32)> {
        if self.logprobs == 0 {
            return Vec::new();
        }
        self.work.clear();
        self.work.extend(penalised.iter().map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l.min(f32::MAX) + 0.0 }));
        if self.temperature != 0.0 {
            self.scale_by_temperature();
        }
        let lse = log_sum_exp(&self.work, &mut self.weights);
        top_logprobs(&self.work, lse, self.logprobs, &mut self.filter_scratch)
    }

    /// Runs top-k → top-p → min-p over the row (`work`, `weights`, whose sum is `total`),
    /// leaving the survivors in `cands`. The first active filter picks from the row directly.
    fn filter(&mut self, total: f64) {
        let (work, weights, scratch, cands) = (
            &self.work,
            &self.weights,
            &mut self.filter_scratch,
            &mut self.cands,
        );
        let k_active = self.top_k != 0 && self.top_k < work.len();
        if k_active && self.top_k <= filters::TOP_K_HEAP_MAX {
            filters::top_k_of_row(work, weights, self.top_k, scratch, cands);
            filters::top_p(cands, self.top_p, scratch);
        } else if k_active {
            filters::all_of_row(work, weights, cands);
            filters::top_k(cands, self.top_k);
            filters::top_p(cands, self.top_p, scratch);
        } else if self.top_p < 1.0 {
            filters::top_p_of_row(work, weights, total, self.top_p, scratch, cands);
        } else {
            filters::min_p_of_row(work, weights, self.min_p, cands);
            return;
        }
        filters::min_p(cands, self.min_p);
    }

    /// `work[i] = (work[i] - max) / T`: the largest becomes 0, nothing overflows even for tiny T.
    fn scale_by_temperature(&mut self) {
        let max = math::max_f32(&self.work);
        if !max.is_finite() {
            return;
        }
        let inv = 1.0 / self.temperature;
        if inv.is_finite() {
            for l in &mut self.work {
                *l = (*l - max) * inv;
            }
        } else {
            for l in &mut self.work {
                *l = (*l - max) / self.temperature;
            }
        }
    }

    /// Builds the result; `lse` is the log-sum-exp of `work` (the distribution logprobs use).
    fn finish(&mut self, token: u32, lse: f32) -> SampledToken {
        let top = top_logprobs(&self.work, lse, self.logprobs, &mut self.filter_scratch);
        SampledToken {
            token,
            logprob: logprob(self.work[token as usize], lse),
            top_logprobs: top,
        }
    }
}

/// Index of the largest value, lowest index on ties (an all-`-inf` row gives 0).
fn argmax(row: &[f32]) -> u32 {
    math::argmax(row).unwrap_or(0) as u32
}

/// Inverse-CDF draw over `(id, weight)` pairs, `u` in `[0, 1)`: returns the first id whose
/// cumulative weight exceeds `u * total`, so zero weights are never chosen. `None` when the
/// total weight is zero.
fn draw(items: impl Iterator<Item = (u32, f32)> + Clone, u: f64) -> Option<u32> {
    let total: f64 = items.clone().map(|(_, w)| f64::from(w)).sum();
    if total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last_positive = None;
    for (id, w) in items {
        cum += f64::from(w);
        if w > 0.0 {
            last_positive = Some(id);
        }
        if target < cum {
            return Some(id);
        }
    }
    // Only reachable through rounding: the last token with weight owns that sliver.
    last_positive
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p.validate().unwrap();
        p
    }

    /// A device sampler gets exactly the RNG draws the host sampler would make (none for
    /// greedy steps), and the host finishes its top logprobs from the penalised row exactly as
    /// `sample` reports them.
    #[test]
    fn device_steps_draw_like_host_steps_and_finish_top_logprobs_alike() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0).collect();
        let (prompt, output) = ([1u32, 2, 2, 7], [7u32, 9]);
        for temperature in [0.0f32, 0.7] {
            let p = params(|p| {
                p.temperature = temperature;
                p.top_p = 0.9;
                p.repetition_penalty = 1.2;
                p.frequency_penalty = 0.3;
                p.logprobs = Some(4);
            });
            let (mut host, mut dev) = (Sampler::new(&p, 42), Sampler::new(&p, 42));
            let mut reference = Sampler::new(&p, 42);
            for _ in 0..5 {
                let step = dev.device_step();
                let want_u = if temperature == 0.0 { 0.0 } else { reference.rng.random::<f64>() };
                assert_eq!(step.uniform, want_u, "the device step's draw is the host's next draw");
                assert_eq!((step.temperature, step.top_p, step.repetition, step.frequency, step.logprobs), (temperature, 0.9, 1.2, 0.3, 4));
                assert!(step.penalised);
                // The penalised row as the device writes it back.
                let mut penalised = logits.clone();
                for (t, count) in super::super::penalties::penalty_history(&prompt, &output, logits.len()) {
                    let l = &mut penalised[t as usize];
                    *l = if *l > 0.0 { *l / 1.2 } else { *l * 1.2 };
                    if count > 0 {
                        *l -= 0.3 * count as f32;
                    }
                }
                let sampled = host.sample(&logits, &prompt, &output);
                let top = dev.top_logprobs_of_penalised(&penalised);
                assert_eq!(top.len(), 4);
                for (a, b) in top.iter().zip(&sampled.top_logprobs) {
                    assert_eq!(a.0, b.0);
                    assert!((a.1 - b.1).abs() < 1e-5, "{a:?} vs {b:?}");
                }
            }
        }
    }

    fn softmax(l: &[f32], t: f32) -> Vec<f64> {
        let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f64> = l.iter().map(|&x| f64::from((x - m) / t).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    fn histogram(s: &mut Sampler, logits: &[f32], draws: usize) -> Vec<f64> {
        let mut h = vec![0usize; logits.len()];
        for _ in 0..draws {
            h[s.sample(logits, &[], &[]).token as usize] += 1;
        }
        h.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        let mut s = Sampler::new(&SamplingParams::greedy(), 0);
        assert_eq!(s.sample(&[0.5, 3.0, 1.0, 3.0], &[], &[]).token, 1);
        assert_eq!(s.sample(&[-1.0, -1.0], &[], &[]).token, 0);
        assert_eq!(s.sample(&[f32::NAN, -5.0, f32::NAN], &[], &[]).token, 1);
        assert_eq!(s.sample(&[-0.0, 0.0], &[], &[]).token, 0);
    }

    #[test]
    fn skipping_steps_draws_what_the_uninterrupted_sampler_draws_next() {
        let p = params(|p| {
            p.temperature = 0.9;
            p.seed = Some(7);
        });
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut whole = Sampler::new(&p, 7);
        let run: Vec<u32> = (0..12).map(|_| whole.sample(&logits, &[], &[]).token).collect();
        let mut resumed = Sampler::new(&p, 7);
        resumed.skip_steps(5);
        let rest: Vec<u32> = (0..7).map(|_| resumed.sample(&logits, &[], &[]).token).collect();
        assert_eq!(rest, run[5..]);
        let mut greedy = Sampler::new(&SamplingParams::greedy(), 7);
        let before = greedy.rng.clone();
        greedy.skip_steps(5);
        assert_eq!(greedy.rng, before);
    }

    #[test]
    fn greedy_does_not_touch_the_rng() {
        let p = SamplingParams::greedy();
        let mut s = Sampler::new(&p, 42);
        let before = s.rng.clone();
        for _ in 0..10 {
            s.sample(&[1.0, 2.0, 3.0], &[], &[]);
        }
        assert_eq!(s.rng, before);
    }

    #[test]
    fn greedy_logprobs_use_temperature_one_over_penalised_logits() {
        let p = params(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 2.0;
            p.logprobs = Some(2);
        });
        let mut s = Sampler::new(&p, 0);
        // token 2 (logit 4) is in the prompt: penalised to 2, so token 1 (3) wins.
        let out = s.sample(&[1.0, 3.0, 4.0], &[2], &[]);
        assert_eq!(out.token, 1);
        let want = softmax(&[1.0, 3.0, 2.0], 1.0);
        assert!((f64::from(out.logprob) - want[1].ln()).abs() < 1e-6);
        assert_eq!(out.top_logprobs.len(), 2);
        assert_eq!(out.top_logprobs[0].0, 1);
        assert_eq!(out.top_logprobs[1].0, 2);
        assert!((f64::from(out.top_logprobs[1].1) - want[2].ln()).abs() < 1e-6);
    }

    #[test]
    fn logprobs_are_temperature_scaled_and_before_filters() {
        let p = params(|p| {
            p.temperature = 0.5;
            p.top_k = 1;
            p.logprobs = Some(3);
        });
        let logits = [1.0, 2.0, 0.0];
        let mut s = Sampler::new(&p, 3);
        let out = s.sample(&logits, &[], &[]);
        assert_eq!(out.token, 1);
        let want = softmax(&logits, 0.5);
        assert!((f64::from(out.logprob) - want[1].ln()).abs() < 1e-6);
        let ids: Vec<u32> = out.top_logprobs.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 0, 2]);
        for (id, lp) in out.top_logprobs {
            assert!((f64::from(lp) - want[id as usize].ln()).abs() < 1e-6);
        }
    }

    #[test]
    fn no_logprobs_requested_gives_empty_top_list() {
        let mut s = Sampler::new(&SamplingParams::default(), 1);
        assert!(s.sample(&[1.0, 2.0], &[], &[]).top_logprobs.is_empty());
        let mut s = Sampler::new(&params(|p| p.logprobs = Some(0)), 1);
        assert!(s.sample(&[1.0, 2.0], &[], &[]).top_logprobs.is_empty());
    }

    #[test]
    fn temperature_sampling_follows_softmax() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 3.0];
        for t in [0.7f32, 1.0, 1.8] {
            let mut s = Sampler::new(&params(|p| p.temperature = t), 1234);
            let freq = histogram(&mut s, &logits, 100_000);
            let want = softmax(&logits, t);
            for (f, w) in freq.iter().zip(&want) {
                // std dev of a proportion at n = 1e5 is <= 0.0016; 0.008 is five of them.
                assert!((f - w).abs() < 0.008, "t={t}: freq {freq:?} want {want:?}");
            }
        }
    }

    #[test]
    fn top_k_sampling_is_renormalised_over_the_kept_set() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 3.0];
        let mut s = Sampler::new(&params(|p| p.top_k = 2), 99);
        let freq = histogram(&mut s, &logits, 50_000);
        let want = softmax(&[2.0, 3.0], 1.0);
        assert!(
            (freq[1] - want[0]).abs() < 0.01 && (freq[4] - want[1]).abs() < 0.01,
            "{freq:?}"
        );
        assert_eq!(freq[0] + freq[2] + freq[3], 0.0);
    }

    #[test]
    fn filters_never_return_excluded_tokens() {
        // probs ∝ exp(logits): roughly 0.64, 0.24, 0.09, 0.03, ...
        let logits = [3.0f32, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0];
        let cases: Vec<(SamplingParams, Vec<u32>)> = vec![
            (params(|p| p.top_k = 3), vec![0, 1, 2]),
            (params(|p| p.top_p = 0.8), vec![0, 1]),
            (params(|p| p.min_p = 0.3), vec![0, 1]),
            (params(|p| p.min_p = 0.1), vec![0, 1, 2]),
            (
                // Each filter binds: top-k drops 6 and 7, top-p (over the six left: cumulative
                // mass before token 5 is ~0.997) drops 5, min-p (threshold 3 + ln 0.02 ≈ -0.91)
                // drops 4.
                params(|p| {
                    p.top_k = 6;
                    p.top_p = 0.99;
                    p.min_p = 0.02;
                }),
                vec![0, 1, 2, 3],
            ),
        ];
        for (p, allowed) in cases {
            let mut s = Sampler::new(&p, 5);
            let mut seen = vec![false; logits.len()];
            for _ in 0..20_000 {
                let t = s.sample(&logits, &[], &[]).token;
                assert!(allowed.contains(&t), "{p:?} returned excluded token {t}");
                seen[t as usize] = true;
            }
            // Every allowed token is reachable (each has probability >= ~3% here).
            for a in &allowed {
                assert!(seen[*a as usize], "{p:?} never returned allowed token {a}");
            }
        }
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let p = params(|p| {
            p.temperature = 1.3;
            p.top_p = 0.95;
            p.repetition_penalty = 1.1;
        });
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 101) as f32) / 25.0).collect();
        let run = |seed: u64| {
            let mut s = Sampler::new(&p, seed);
            let mut out = Vec::new();
            for _ in 0..64 {
                let t = s.sample(&logits, &[1, 2, 3], &out).token;
                out.push(t);
            }
            out
        };
        assert_eq!(run(sequence_seed(7, 0)), run(sequence_seed(7, 0)));
        assert_ne!(run(sequence_seed(7, 0)), run(sequence_seed(7, 1)));
        assert_ne!(run(sequence_seed(7, 0)), run(sequence_seed(8, 0)));
    }

    #[test]
    fn sequence_seed_separates_indices() {
        let seeds: std::collections::HashSet<u64> =
            (0..1000).map(|i| sequence_seed(12345, i)).collect();
        assert_eq!(seeds.len(), 1000);
        assert_ne!(sequence_seed(0, 0), 0);
    }

    #[test]
    fn penalties_steer_the_sample() {
        // Token 0 would always win greedily, but a large frequency penalty on its repeats
        // in the output flips the choice.
        let p = params(|p| {
            p.temperature = 0.0;
            p.frequency_penalty = 2.0;
        });
        let mut s = Sampler::new(&p, 0);
        assert_eq!(s.sample(&[3.0, 0.0], &[], &[]).token, 0);
        assert_eq!(s.sample(&[3.0, 0.0], &[], &[0, 0]).token, 1);
        // Presence penalty ignores prompt tokens.
        let p = params(|p| {
            p.temperature = 0.0;
            p.presence_penalty = 2.0;
        });
        let mut s = Sampler::new(&p, 0);
        assert_eq!(s.sample(&[1.0, 0.0], &[0, 0, 0], &[]).token, 0);
        assert_eq!(s.sample(&[1.0, 0.0], &[], &[0]).token, 1);
    }

    #[test]
    fn tiny_temperature_approaches_greedy_without_nan() {
        let p = params(|p| {
            p.temperature = 1e-30;
            p.logprobs = Some(2);
        });
        let mut s = Sampler::new(&p, 11);
        for _ in 0..100 {
            let out = s.sample(&[1.0, 1.5, 1.4999], &[], &[]);
            assert_eq!(out.token, 1);
            assert_eq!(out.logprob, 0.0);
            assert!(out.top_logprobs.iter().all(|t| !t.1.is_nan()));
        }
    }

    #[test]
    fn degenerate_rows_do_not_panic() {
        let p = params(|p| p.logprobs = Some(3));
        let mut s = Sampler::new(&p, 0);
        let out = s.sample(&[f32::NAN; 4], &[], &[]);
        assert_eq!(out.token, 0);
        assert_eq!(out.logprob, f32::NEG_INFINITY);
        // -inf entries are never sampled while something finite remains.
        for _ in 0..200 {
            let t = s.sample(
                &[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, f32::NAN],
                &[],
                &[],
            );
            assert_eq!(t.token, 1);
            assert_eq!(t.logprob, 0.0);
        }
        assert_eq!(s.sample(&[5.0], &[], &[]).token, 0);
        // +inf wins without producing NaN, greedy or not.
        for p in [SamplingParams::greedy(), params(|p| p.top_p = 0.5)] {
            let mut s = Sampler::new(&p, 0);
            let out = s.sample(&[1.0, f32::INFINITY, 2.0], &[], &[]);
            assert_eq!(out.token, 1);
            assert!(!out.logprob.is_nan());
        }
    }

    #[test]
    fn draw_covers_the_unit_interval_and_skips_zero_weights() {
        let c = [(4u32, 1.0f32), (5, 0.0), (9, 1.0), (11, 0.0)];
        assert_eq!(draw(c.iter().copied(), 0.0), Some(4));
        assert_eq!(draw(c.iter().copied(), 0.49), Some(4));
        assert_eq!(draw(c.iter().copied(), 0.5), Some(9));
        assert_eq!(draw(c.iter().copied(), 0.999_999), Some(9));
        assert_eq!(draw(c.iter().copied(), 1.0), Some(9));
        assert_eq!(draw([(1u32, 0.0f32)].into_iter(), 0.3), None);
        assert_eq!(draw(std::iter::empty(), 0.3), None);
    }
}
