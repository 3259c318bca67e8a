//! What `tandem bench serve` sends and when: request shapes (prompt and output lengths drawn from a
//! fixed, uniform or normal distribution, or taken from a ShareGPT-format file) and arrival times
//! (Poisson at a rate, or all at once).
//!
//! Invariants:
//! - Everything here is a pure function of its inputs and a seed: two runs with the same flags send
//!   the same prompts at the same offsets.
//! - Random prompts are token ids drawn from `FIRST_TOKEN..vocab`, sent as ids, so their lengths are
//!   exact; each run of a sweep draws its own prompts (from the seed and the run's index), so a later
//!   run does not hit the prefix cache the earlier ones filled.

use std::path::Path;
use std::str::FromStr;

use anyhow::{Context, bail, ensure};
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tandem_engine::tokenizer::Tokenizer;

/// Random prompt token ids start here (clear of the usual special ids at the bottom of a vocabulary).
pub(crate) const FIRST_TOKEN: u32 = 32;

/// A length distribution: `N`, `uniform:LO:HI` (inclusive) or `normal:MEAN:STD` (rounded, clamped to
/// at least 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum LengthDist {
    /// Always this many tokens.
    Fixed(usize),
    /// Uniform over `lo..=hi`.
    Uniform { lo: usize, hi: usize },
    /// Normal with this mean and standard deviation.
    Normal { mean: f64, std: f64 },
}

impl FromStr for LengthDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let int = |p: &str| p.trim().parse::<usize>().map_err(|_| format!("{p:?} in {s:?} is not a whole number"));
        let float = |p: &str| match p.trim().parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => Err(format!("{p:?} in {s:?} is not a number")),
        };
        let dist = match parts.as_slice() {
            [n] => LengthDist::Fixed(int(n)?),
            ["uniform", lo, hi] => LengthDist::Uniform { lo: int(lo)?, hi: int(hi)? },
            ["normal", mean, std] => LengthDist::Normal { mean: float(mean)?, std: float(std)? },
            _ => return Err(format!("{s:?}: want N, uniform:LO:HI or normal:MEAN:STD")),
        };
        match dist {
            LengthDist::Fixed(0) => Err("a length must be at least 1".into()),
            LengthDist::Uniform { lo, hi } if lo == 0 || lo > hi => Err(format!("{s:?}: want 1 <= LO <= HI")),
            LengthDist::Normal { mean, std } if mean < 1.0 || std < 0.0 => Err(format!("{s:?}: want MEAN >= 1 and STD >= 0")),
            d => Ok(d),
        }
    }
}

impl std::fmt::Display for LengthDist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LengthDist::Fixed(n) => write!(f, "{n}"),
            LengthDist::Uniform { lo, hi } => write!(f, "uniform:{lo}:{hi}"),
            LengthDist::Normal { mean, std } => write!(f, "normal:{mean}:{std}"),
        }
    }
}

impl LengthDist {
    /// One draw (at least 1).
    pub(crate) fn sample(&self, rng: &mut SmallRng) -> usize {
        match *self {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { lo, hi } => rng.random_range(lo..=hi),
            LengthDist::Normal { mean, std } => (mean + std * standard_normal(rng)).round().max(1.0) as usize,
        }
    }
}

/// A standard normal draw (Box–Muller).
fn standard_normal(rng: &mut SmallRng) -> f64 {
    // 1 - u in (0, 1]: the logarithm stays finite.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RequestSpec {
    /// The prompt's token ids.
    pub(crate) prompt: Vec<u32>,
    /// Output tokens to ask for (with ignore_eos).
    pub(crate) output_len: usize,
}

/// A ShareGPT conversation reduced to what the benchmark sends: the first human turn's tokens and
/// the length of the first answer to it.
#[derive(Debug, Clone)]
pub(crate) struct DatasetEntry {
    prompt: Vec<u32>,
    output_len: usize,
}

/// Where requests come from.
#[derive(Debug)]
pub(crate) enum Source {
    /// Random token ids of drawn lengths.
    Random { input: LengthDist, output: LengthDist, vocab: u32 },
    /// Entries of a ShareGPT-format file, shuffled once by the seed.
    Dataset(Vec<DatasetEntry>),
}

impl Source {
    /// The requests of run `run` of a sweep (`count` of them), drawn from `seed`. Dataset runs take
    /// consecutive slices of the shuffled entries, wrapping around when the file is exhausted.
    pub(crate) fn requests(&self, seed: u64, run: usize, count: usize) -> Vec<RequestSpec> {
        match self {
            Source::Random { input, output, vocab } => {
                let mut rng = SmallRng::seed_from_u64(mix(seed, run as u64));
                (0..count)
                    .map(|_| {
                        let (inp, out) = (input.sample(&mut rng), output.sample(&mut rng));
                        let prompt = (0..inp).map(|_| rng.random_range(FIRST_TOKEN..*vocab)).collect();
                        RequestSpec { prompt, output_len: out }
                    })
                    .collect()
            }
            Source::Dataset(entries) => (0..count)
                .map(|i| {
                    let e = &entries[(run * count + i) % entries.len()];
                    RequestSpec { prompt: e.prompt.clone(), output_len: e.output_len }
                })
                .collect(),
        }
    }
}

/// A seed for stream `k` of `seed` (splitmix64 of both).
fn mix(seed: u64, k: u64) -> u64 {
    let mut z = seed ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(0x6a09_e667_f3bc_c909);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Reads a ShareGPT-format file (`[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
/// "value": ...}, ...]}, ...]`): the first turn is the prompt, the second's token count the output
/// length, as vLLM's benchmark takes them. Conversations with fewer than two turns, or whose prompt or
/// answer is shorter than 4 tokens, or whose prompt + answer exceed `max_len`, are skipped (as vLLM
/// skips them). The kept entries are shuffled by `seed`.
pub(crate) fn load_sharegpt(path: &Path, tokenizer: &Tokenizer, max_len: usize, seed: u64) -> anyhow::Result<Vec<DatasetEntry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let Some(items) = value.as_array() else { bail!("{}: want a JSON array of conversations", path.display()) };
    let mut entries = Vec::new();
    for item in items {
        let turns = item.get("conversations").and_then(|c| c.as_array());
        let Some([first, second, ..]) = turns.map(|t| t.as_slice()) else { continue };
        let (Some(q), Some(a)) = (first.get("value").and_then(|v| v.as_str()), second.get("value").and_then(|v| v.as_str())) else {
            continue;
        };
        let prompt = tokenizer.encode(q, false)?;
        let output_len = tokenizer.encode(a, false)?.len();
        if prompt.len() < 4 || output_len < 4 || prompt.len() + output_len > max_len {
            continue;
        }
        entries.push(DatasetEntry { prompt, output_len });
    }
    ensure!(!entries.is_empty(), "{}: no usable conversation (two turns, each at least 4 tokens, within {max_len} tokens)", path.display());
    let mut rng = SmallRng::seed_from_u64(seed);
    for i in (1..entries.len()).rev() {
        entries.swap(i, rng.random_range(0..=i));
    }
    Ok(entries)
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Load {
    /// Open loop: a Poisson process of this many requests per second (infinite: all at once).
    Rate(f64),
    /// Closed loop: this many requests in flight, the next sent as soon as one ends.
    Concurrency(usize),
}

impl Load {
    /// The figure plots put on their x axis (a rate or a concurrency; infinite for "all at once").
    pub(crate) fn x(&self) -> f64 {
        match *self {
            Load::Rate(r) => r,
            Load::Concurrency(c) => c as f64,
        }
    }
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Load::Rate(r) if r.is_infinite() => write!(f, "rate inf"),
            Load::Rate(r) => write!(f, "rate {r} req/s"),
            Load::Concurrency(c) => write!(f, "concurrency {c}"),
        }
    }
}

/// Parses `--request-rate`: a positive number or `inf`.
pub(crate) fn parse_rate(s: &str) -> Result<f64, String> {
    if s.trim().eq_ignore_ascii_case("inf") {
        return Ok(f64::INFINITY);
    }
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a positive rate (requests per second) or inf")),
    }
}

/// Send offsets in seconds from the run's start for `count` requests at `rate` requests/s: the
/// gaps of a Poisson process (exponential with mean 1/rate), drawn from `seed`; all zero for an
/// infinite rate.
pub(crate) fn poisson_arrivals(rate: f64, count: usize, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; count];
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..count)
        .map(|_| {
            let at = t;
            let u: f64 = 1.0 - rng.random::<f64>();
            t += -u.ln() / rate;
            at
        })
        .collect()
}

/// The arrival seed of run `run`.
pub(crate) fn arrival_seed(seed: u64, run: usize) -> u64 {
    mix(seed ^ 0xa11e_a11e, run as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_flags_parse_and_reject() {
        assert_eq!("128".parse::<LengthDist>(), Ok(LengthDist::Fixed(128)));
        assert_eq!("uniform:10:20".parse::<LengthDist>(), Ok(LengthDist::Uniform { lo: 10, hi: 20 }));
        assert_eq!("normal:100:15.5".parse::<LengthDist>(), Ok(LengthDist::Normal { mean: 100.0, std: 15.5 }));
        for bad in ["0", "-3", "x", "uniform:5", "uniform:0:4", "uniform:9:4", "normal:0:1", "normal:10:-1", "zipf:1:2", "normal:nan:1"] {
            assert!(bad.parse::<LengthDist>().is_err(), "{bad} parsed");
        }
        for s in ["7", "uniform:3:9", "normal:50:5"] {
            assert_eq!(s.parse::<LengthDist>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn draws_follow_their_distribution() {
        let mut rng = SmallRng::seed_from_u64(1);
        assert!((0..100).all(|_| LengthDist::Fixed(9).sample(&mut rng) == 9));
        let u = LengthDist::Uniform { lo: 10, hi: 13 };
        let draws: Vec<usize> = (0..4000).map(|_| u.sample(&mut rng)).collect();
        for v in 10..=13 {
            let n = draws.iter().filter(|&&d| d == v).count();
            assert!((850..1150).contains(&n), "{v} drawn {n} times of 4000");
        }
        assert!(draws.iter().all(|d| (10..=13).contains(d)));
        let n = LengthDist::Normal { mean: 200.0, std: 20.0 };
        let draws: Vec<f64> = (0..20000).map(|_| n.sample(&mut rng) as f64).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let std = (draws.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / draws.len() as f64).sqrt();
        assert!((mean - 200.0).abs() < 1.0, "mean {mean}");
        assert!((std - 20.0).abs() < 1.0, "std {std}");
        // Clamped at 1.
        let wide = LengthDist::Normal { mean: 1.0, std: 50.0 };
        assert!((0..1000).all(|_| wide.sample(&mut rng) >= 1));
    }

    #[test]
    fn random_requests_are_exact_seeded_and_fresh_per_run() {
        let src = Source::Random { input: LengthDist::Uniform { lo: 5, hi: 50 }, output: LengthDist::Fixed(7), vocab: 100 };
        let a = src.requests(42, 0, 20);
        assert_eq!(a, src.requests(42, 0, 20), "same seed, same run: same requests");
        assert_ne!(a, src.requests(43, 0, 20));
        let b = src.requests(42, 1, 20);
        assert!(a.iter().zip(&b).all(|(x, y)| x.prompt != y.prompt), "a later run reuses a prompt");
        for r in &a {
            assert!((5..=50).contains(&r.prompt.len()));
            assert_eq!(r.output_len, 7);
            assert!(r.prompt.iter().all(|&t| (FIRST_TOKEN..100).contains(&t)));
        }
    }

    #[test]
    fn poisson_gaps_have_the_rate_and_repeat() {
        let at = poisson_arrivals(4.0, 20_000, 7);
        assert_eq!(at, poisson_arrivals(4.0, 20_000, 7));
        assert_eq!(at[0], 0.0);
        assert!(at.windows(2).all(|w| w[1] >= w[0]));
        let gaps: Vec<f64> = at.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.25).abs() < 0.01, "mean gap {mean}");
        // Exponential: the standard deviation equals the mean, and P(gap > mean) = e^-1.
        let std = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((std - 0.25).abs() < 0.015, "std {std}");
        let above = gaps.iter().filter(|&&g| g > 0.25).count() as f64 / gaps.len() as f64;
        assert!((above - (-1f64).exp()).abs() < 0.02, "P(gap > mean) = {above}");
        assert_eq!(poisson_arrivals(f64::INFINITY, 3, 1), vec![0.0; 3]);
        assert_ne!(poisson_arrivals(4.0, 10, 7), poisson_arrivals(4.0, 10, 8));
    }

    #[test]
    fn sharegpt_first_turns_become_requests() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama");
        let tokenizer = Tokenizer::from_model_dir(&dir).unwrap();
        let long_q = "the quick brown fox jumps over the lazy dog and keeps running far away";
        let answer = "a fox is a small animal that lives in the woods and eats berries";
        let path = std::env::temp_dir().join(format!("tandem-sharegpt-test-{}.json", std::process::id()));
        let convs = serde_json::json!([
            {"conversations": [{"from": "human", "value": long_q}, {"from": "gpt", "value": answer}, {"from": "human", "value": "more"}]},
            {"conversations": [{"from": "human", "value": long_q}]},
            {"conversations": [{"from": "human", "value": long_q}, {"from": "gpt", "value": "ok"}]},
            {"id": "no conversations"},
            {"conversations": [{"from": "human", "value": answer}, {"from": "gpt", "value": long_q}]},
        ]);
        std::fs::write(&path, convs.to_string()).unwrap();
        let entries = load_sharegpt(&path, &tokenizer, 10_000, 1).unwrap();
        assert_eq!(entries.len(), 2, "one-turn, short-answer and malformed conversations are skipped");
        let (q, a) = (tokenizer.encode(long_q, false).unwrap(), tokenizer.encode(answer, false).unwrap());
        let mut got: Vec<(Vec<u32>, usize)> = entries.iter().map(|e| (e.prompt.clone(), e.output_len)).collect();
        got.sort();
        let mut want = vec![(q.clone(), a.len()), (a.clone(), q.len())];
        want.sort();
        assert_eq!(got, want);
        // Too long for max_len: skipped, and nothing left is an error.
        assert!(load_sharegpt(&path, &tokenizer, q.len() + a.len() - 1, 1).is_err());
        let _ = std::fs::remove_file(&path);
        // Runs take consecutive entries, wrapping.
        let src = Source::Dataset(entries);
        let run0 = src.requests(0, 0, 3);
        assert_eq!(run0[0], run0[2]);
        assert_eq!(src.requests(0, 1, 1)[0], run0[1]);
    }

    #[test]
    fn rates_parse() {
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        assert_eq!(parse_rate("inf"), Ok(f64::INFINITY));
        for bad in ["0", "-1", "abc", "NaN", ""] {
            assert!(parse_rate(bad).is_err(), "{bad} parsed");
        }
    }
}
