//! Per-request sampling parameters and their validation.
//!
//! Invariant: a [`SamplingParams`] that passed [`SamplingParams::validate`] can be handed to
//! [`crate::sampling::Sampler::new`] and never makes the sampler produce NaN weights or panic; the
//! engine validates once when a request arrives and never re-checks.

use crate::Error;

/// Largest `n` (parallel samples per request) accepted.
pub const MAX_N: usize = 128;
/// Largest number of top logprobs a request may ask for per generated token.
pub const MAX_LOGPROBS: usize = 20;
/// Largest number of stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

/// How to pick tokens for one request, and when to stop.
///
/// Field semantics follow vLLM / the OpenAI API; the defaults sample from the plain softmax
/// (`temperature` 1) with no filtering and no penalties.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Number of sequences to generate for the request.
    pub n: usize,
    /// Most tokens to generate per sequence.
    pub max_tokens: usize,
    /// Softmax temperature; `0.0` means greedy (argmax, lowest index on ties).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables the filter.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's.
    pub min_p: f32,
    /// HF/vLLM repetition penalty over prompt and output tokens: positive logits are divided by
    /// it, negative ones multiplied. `1.0` disables it.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty, subtracted once from every token that occurs in the output.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty, subtracted once per occurrence of a token in the output.
    pub frequency_penalty: f32,
    /// Seed for the request's random draws; `None` lets the engine pick one.
    pub seed: Option<u64>,
    /// Token ids that end a sequence (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sequence; the stop string itself is not emitted.
    pub stop: Vec<String>,
    /// Keep generating past the model's EOS token(s).
    pub ignore_eos: bool,
    /// Return this many top logprobs per generated token (plus the chosen token's).
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the detokenized text.
    pub skip_special_tokens: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            n: 1,
            max_tokens: 256,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
        }
    }
}

impl SamplingParams {
    /// Parameters for greedy decoding (temperature 0), otherwise default.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// True when tokens are picked by argmax (temperature 0) and no random draw is needed.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// True when any of the three penalties would change the logits.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Checks every parameter's range; the error names the first bad parameter and its value.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |msg: String| Err(Error::InvalidSampling(msg));
        if self.n == 0 || self.n > MAX_N {
            return bad(format!("n must be in [1, {MAX_N}], got {}", self.n));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be >= 1, got 0".to_string());
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be >= 0 and finite, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be > 0 and finite, got {}",
                self.repetition_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad(format!(
                "presence_penalty must be in [-2, 2], got {}",
                self.presence_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad(format!(
                "frequency_penalty must be in [-2, 2], got {}",
                self.frequency_penalty
            ));
        }
        if let Some(k) = self.logprobs
            && k > MAX_LOGPROBS
        {
            return bad(format!("logprobs must be <= {MAX_LOGPROBS}, got {k}"));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return bad(format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                self.stop.len()
            ));
        }
        if let Some(i) = self.stop.iter().position(String::is_empty) {
            return bad(format!(
                "stop strings must be non-empty, stop[{i}] is empty"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_of(p: SamplingParams) -> String {
        match p.validate() {
            Err(Error::InvalidSampling(msg)) => msg,
            other => panic!("expected InvalidSampling, got {other:?}"),
        }
    }

    #[test]
    fn defaults_and_greedy_are_valid() {
        SamplingParams::default().validate().unwrap();
        let g = SamplingParams::greedy();
        g.validate().unwrap();
        assert!(g.is_greedy());
        assert!(!SamplingParams::default().is_greedy());
        assert!(!SamplingParams::default().has_penalties());
    }

    #[test]
    fn boundary_values_are_valid() {
        let p = SamplingParams {
            n: MAX_N,
            max_tokens: 1,
            temperature: 0.0,
            top_k: usize::MAX,
            top_p: 1.0,
            min_p: 1.0,
            repetition_penalty: 1e-3,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logprobs: Some(MAX_LOGPROBS),
            stop: vec!["x".to_string(); MAX_STOP_STRINGS],
            ..SamplingParams::default()
        };
        p.validate().unwrap();
        let p = SamplingParams {
            top_p: f32::MIN_POSITIVE,
            min_p: 0.0,
            ..SamplingParams::default()
        };
        p.validate().unwrap();
    }

    #[test]
    fn each_bad_parameter_is_rejected_by_name() {
        let d = SamplingParams::default;
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams { n: 0, ..d() },
                "n must be in [1, 128], got 0",
            ),
            (
                SamplingParams {
                    n: MAX_N + 1,
                    ..d()
                },
                "n must be in [1, 128], got 129",
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    ..d()
                },
                "max_tokens must be >= 1, got 0",
            ),
            (
                SamplingParams {
                    temperature: -1.0,
                    ..d()
                },
                "temperature must be >= 0 and finite, got -1",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..d()
                },
                "temperature must be >= 0 and finite, got NaN",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..d()
                },
                "temperature must be >= 0 and finite, got inf",
            ),
            (
                SamplingParams { top_p: 0.0, ..d() },
                "top_p must be in (0, 1], got 0",
            ),
            (
                SamplingParams { top_p: 1.5, ..d() },
                "top_p must be in (0, 1], got 1.5",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..d()
                },
                "top_p must be in (0, 1], got NaN",
            ),
            (
                SamplingParams { min_p: -0.1, ..d() },
                "min_p must be in [0, 1], got -0.1",
            ),
            (
                SamplingParams { min_p: 1.1, ..d() },
                "min_p must be in [0, 1], got 1.1",
            ),
            (
                SamplingParams {
                    min_p: f32::NAN,
                    ..d()
                },
                "min_p must be in [0, 1], got NaN",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..d()
                },
                "repetition_penalty must be > 0 and finite, got 0",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::INFINITY,
                    ..d()
                },
                "repetition_penalty must be > 0 and finite, got inf",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..d()
                },
                "presence_penalty must be in [-2, 2], got 2.5",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..d()
                },
                "presence_penalty must be in [-2, 2], got NaN",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..d()
                },
                "frequency_penalty must be in [-2, 2], got -3",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..d()
                },
                "logprobs must be <= 20, got 21",
            ),
            (
                SamplingParams {
                    stop: vec!["a".to_string(); 17],
                    ..d()
                },
                "at most 16 stop strings are allowed, got 17",
            ),
            (
                SamplingParams {
                    stop: vec!["a".to_string(), String::new()],
                    ..d()
                },
                "stop strings must be non-empty, stop[1] is empty",
            ),
        ];
        for (params, want) in cases {
            assert_eq!(err_of(params), want);
        }
    }
}
