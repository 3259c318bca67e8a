//! Token sampling: per-request [`SamplingParams`] and the per-sequence [`Sampler`].
//!
//! The engine validates a request's parameters once ([`SamplingParams::validate`]), creates one
//! [`Sampler`] per sequence with a seed from [`sequence_seed`], and calls [`Sampler::sample`] on
//! each decode step with that sequence's logits row. Stop conditions (EOS, stop ids, stop strings,
//! `max_tokens`) are the engine's business; this module only picks tokens.
//!
//! Invariants kept here: greedy never draws from the RNG; a seeded sequence is reproducible;
//! filters never return a token they excluded; the per-step cost is linear in the vocabulary
//! (a full sort happens only when top-p genuinely needs most of it).
//!
//! Files: `params` (the request parameters), `penalties`, `filters` (top-k/top-p/min-p),
//! `logprobs` (log-softmax helpers), `math` (vectorisable exp and sums), `sampler` (the pipeline
//! and the draw).

mod filters;
mod logprobs;
mod math;
mod params;
mod penalties;
mod sampler;

pub use params::{MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SamplingParams};
pub use penalties::penalty_history;
pub use sampler::{DeviceStep, SampledToken, Sampler, sequence_seed};
