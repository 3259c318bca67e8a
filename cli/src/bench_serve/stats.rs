//! What one request measured, and the statistics of a run: percentiles (linear interpolation between
//! order statistics, as numpy's default and vLLM's benchmark compute them), throughput and goodput.
//!
//! Invariants:
//! - Latency statistics describe successful requests only; failed ones count in `failed` and
//!   `errors_by_status`, and `completed + failed` is every request sent.
//! - ITL percentiles are over every inter-token gap of every successful request (each gap counts
//!   once); TPOT is per request: (E2E − TTFT) / (output tokens − 1).
//! - A request is good when it succeeded and meets every SLO given: TTFT ≤ the TTFT SLO, each of its
//!   inter-token gaps ≤ the ITL SLO, its TPOT ≤ the TPOT SLO (a one-token answer has none).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One request's measurements.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct RequestRecord {
    /// Index in the run's workload.
    pub(crate) index: usize,
    /// When it was sent, seconds after the run's start.
    pub(crate) sent_s: f64,
    /// Prompt tokens sent.
    pub(crate) prompt_len: usize,
    /// Output tokens asked for.
    pub(crate) output_len: usize,
    /// Prompt tokens the server counted.
    pub(crate) prompt_tokens: Option<u32>,
    /// Prompt tokens served from a prefix cache.
    pub(crate) cached_tokens: Option<u32>,
    /// Output tokens the server reported.
    pub(crate) output_tokens: Option<u32>,
    /// Time to the first token, ms.
    pub(crate) ttft_ms: Option<f64>,
    /// Gaps between consecutive token-carrying messages (gRPC) or text chunks (HTTP), ms.
    pub(crate) itl_ms: Vec<f64>,
    /// Sent to last byte, ms.
    pub(crate) e2e_ms: Option<f64>,
    /// Why it failed: a gRPC status name, `http NNN`, `transport`, `timeout` or `protocol`.
    pub(crate) error: Option<String>,
    /// The error's message.
    pub(crate) error_message: Option<String>,
}

impl RequestRecord {
    /// Time per output token after the first, ms.
    pub(crate) fn tpot_ms(&self) -> Option<f64> {
        let (ttft, e2e, out) = (self.ttft_ms?, self.e2e_ms?, self.output_tokens?);
        (out > 1).then(|| (e2e - ttft) / f64::from(out - 1))
    }

    /// Whether it meets every SLO given (and succeeded).
    pub(crate) fn is_good(&self, slo: &Slo) -> bool {
        if self.error.is_some() {
            return false;
        }
        let within = |v: Option<f64>, limit: Option<f64>| match limit {
            None => true,
            Some(l) => v.is_some_and(|v| v <= l),
        };
        within(self.ttft_ms, slo.ttft_ms)
            && slo.itl_ms.is_none_or(|l| self.itl_ms.iter().all(|&g| g <= l))
            // A one-token answer has no TPOT: nothing to miss.
            && slo.tpot_ms.is_none_or(|l| self.tpot_ms().is_none_or(|t| t <= l))
    }
}

/// Service-level objectives, in ms; `None`: not asked for.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub(crate) struct Slo {
    /// Time to first token.
    pub(crate) ttft_ms: Option<f64>,
    /// Every inter-token gap.
    pub(crate) itl_ms: Option<f64>,
    /// Mean time per output token.
    pub(crate) tpot_ms: Option<f64>,
}

/// Mean and percentiles of one latency.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub(crate) struct Dist {
    /// Samples.
    pub(crate) count: usize,
    /// Mean.
    pub(crate) mean: f64,
    /// Median.
    pub(crate) p50: f64,
    /// 90th percentile.
    pub(crate) p90: f64,
    /// 99th percentile.
    pub(crate) p99: f64,
    /// Largest.
    pub(crate) max: f64,
}

impl Dist {
    /// The statistics of `samples`; `None` when empty.
    pub(crate) fn of(samples: &[f64]) -> Option<Dist> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Dist {
            count: sorted.len(),
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: percentile(&sorted, 50.0),
            p90: percentile(&sorted, 90.0),
            p99: percentile(&sorted, 99.0),
            max: sorted[sorted.len() - 1],
        })
    }
}

/// The `p`-th percentile of sorted, non-empty `sorted`: linear interpolation between the order
/// statistics around rank p/100 × (n − 1).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// A run's figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Summary {
    /// Requests sent.
    pub(crate) requests: usize,
    /// Requests that succeeded.
    pub(crate) completed: usize,
    /// Requests that failed.
    pub(crate) failed: usize,
    /// Failed requests by error kind.
    pub(crate) errors_by_status: BTreeMap<String, usize>,
    /// From the first send to the last response's end, s.
    pub(crate) duration_s: f64,
    /// Successful requests per second.
    pub(crate) request_throughput: f64,
    /// Prompt tokens of successful requests per second.
    pub(crate) input_token_throughput: f64,
    /// Output tokens per second.
    pub(crate) output_token_throughput: f64,
    /// Requests per second meeting every SLO.
    pub(crate) goodput: f64,
    /// Requests meeting every SLO.
    pub(crate) good_requests: usize,
    /// Prompt tokens of successful requests.
    pub(crate) total_input_tokens: u64,
    /// Of those, served from a prefix cache.
    pub(crate) total_cached_tokens: u64,
    /// Output tokens of successful requests.
    pub(crate) total_output_tokens: u64,
    /// Time to first token, ms.
    pub(crate) ttft_ms: Option<Dist>,
    /// Inter-token latency, ms.
    pub(crate) itl_ms: Option<Dist>,
    /// Time per output token, ms.
    pub(crate) tpot_ms: Option<Dist>,
    /// End-to-end latency, ms.
    pub(crate) e2e_ms: Option<Dist>,
}

impl Summary {
    /// Summarises `records` of a run that lasted `duration_s`.
    pub(crate) fn of(records: &[RequestRecord], duration_s: f64, slo: &Slo) -> Summary {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
        let mut errors_by_status = BTreeMap::new();
        for r in records {
            if let Some(e) = &r.error {
                *errors_by_status.entry(e.clone()).or_insert(0) += 1;
            }
        }
        let good_requests = ok.iter().filter(|r| r.is_good(slo)).count();
        let sum = |f: &dyn Fn(&RequestRecord) -> Option<u32>| ok.iter().map(|r| u64::from(f(r).unwrap_or(0))).sum::<u64>();
        let total_input_tokens = sum(&|r| r.prompt_tokens);
        let total_cached_tokens = sum(&|r| r.cached_tokens);
        let total_output_tokens = sum(&|r| r.output_tokens);
        let per_s = |n: f64| if duration_s > 0.0 { n / duration_s } else { 0.0 };
        let collect = |f: &dyn Fn(&RequestRecord) -> Option<f64>| ok.iter().filter_map(|r| f(r)).collect::<Vec<f64>>();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
        Summary {
            requests: records.len(),
            completed: ok.len(),
            failed: records.len() - ok.len(),
            errors_by_status,
            duration_s,
            request_throughput: per_s(ok.len() as f64),
            input_token_throughput: per_s(total_input_tokens as f64),
            output_token_throughput: per_s(total_output_tokens as f64),
            goodput: per_s(good_requests as f64),
            good_requests,
            total_input_tokens,
            total_cached_tokens,
            total_output_tokens,
            ttft_ms: Dist::of(&collect(&|r| r.ttft_ms)),
            itl_ms: Dist::of(&itl),
            tpot_ms: Dist::of(&collect(&|r| r.tpot_ms())),
            e2e_ms: Dist::of(&collect(&|r| r.e2e_ms)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(index: usize, ttft: f64, itl: &[f64], out: u32) -> RequestRecord {
        RequestRecord {
            index,
            sent_s: 0.0,
            prompt_len: 10,
            output_len: out as usize,
            prompt_tokens: Some(10),
            cached_tokens: Some(2),
            output_tokens: Some(out),
            ttft_ms: Some(ttft),
            itl_ms: itl.to_vec(),
            e2e_ms: Some(ttft + itl.iter().sum::<f64>()),
            error: None,
            error_message: None,
        }
    }

    fn failed(index: usize, status: &str) -> RequestRecord {
        RequestRecord {
            error: Some(status.into()),
            error_message: Some("x".into()),
            prompt_tokens: None,
            cached_tokens: None,
            output_tokens: None,
            ttft_ms: None,
            itl_ms: Vec::new(),
            e2e_ms: None,
            ..ok(index, 0.0, &[], 0)
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        // numpy.percentile([1..10], [50, 90, 99]) = 5.5, 9.1, 9.91
        assert!((percentile(&s, 50.0) - 5.5).abs() < 1e-12);
        assert!((percentile(&s, 90.0) - 9.1).abs() < 1e-12);
        assert!((percentile(&s, 99.0) - 9.91).abs() < 1e-12);
        assert_eq!(percentile(&s, 0.0), 1.0);
        assert_eq!(percentile(&s, 100.0), 10.0);
        assert_eq!(percentile(&[4.0], 99.0), 4.0);
        let d = Dist::of(&[3.0, 1.0, 2.0, 100.0]).unwrap();
        // numpy.percentile([1, 2, 3, 100], [50, 90, 99]) = 2.5, 70.9, 97.09
        assert_eq!((d.count, d.mean, d.p50, d.max), (4, 26.5, 2.5, 100.0));
        assert!((d.p90 - 70.9).abs() < 1e-9 && (d.p99 - 97.09).abs() < 1e-9, "{d:?}");
        assert!(Dist::of(&[]).is_none());
    }

    #[test]
    fn summary_counts_goodput_and_errors() {
        let records = vec![
            ok(0, 100.0, &[10.0, 10.0, 10.0], 4),  // good
            ok(1, 300.0, &[10.0, 10.0, 10.0], 4),  // TTFT over
            ok(2, 100.0, &[10.0, 60.0, 10.0], 4),  // one gap over the ITL SLO (TPOT 26.7 within)
            ok(3, 150.0, &[20.0], 2),              // good
            failed(4, "UNAVAILABLE"),
            failed(5, "http 429"),
            failed(6, "UNAVAILABLE"),
        ];
        let slo = Slo { ttft_ms: Some(200.0), itl_ms: Some(50.0), tpot_ms: Some(30.0) };
        let s = Summary::of(&records, 2.0, &slo);
        assert_eq!((s.requests, s.completed, s.failed, s.good_requests), (7, 4, 3, 2));
        assert_eq!(s.goodput, 1.0);
        assert_eq!(s.request_throughput, 2.0);
        assert_eq!(s.errors_by_status, BTreeMap::from([("UNAVAILABLE".into(), 2), ("http 429".into(), 1)]));
        assert_eq!((s.total_input_tokens, s.total_cached_tokens, s.total_output_tokens), (40, 8, 14));
        assert_eq!(s.output_token_throughput, 7.0);
        assert_eq!(s.ttft_ms.unwrap().count, 4);
        assert_eq!(s.itl_ms.unwrap().count, 10, "every gap of every successful request");
        assert_eq!(s.itl_ms.unwrap().max, 60.0);
        let tpot = s.tpot_ms.unwrap();
        assert_eq!(tpot.count, 4);
        assert!((tpot.max - 80.0 / 3.0).abs() < 1e-9);
        // Without SLOs every successful request is good; with a TPOT SLO alone request 2 (26.7) passes.
        assert_eq!(Summary::of(&records, 2.0, &Slo::default()).good_requests, 4);
        let tpot_only = Slo { tpot_ms: Some(25.0), ..Slo::default() };
        assert_eq!(Summary::of(&records, 2.0, &tpot_only).good_requests, 3);
    }

    #[test]
    fn tpot_needs_two_tokens() {
        assert_eq!(ok(0, 50.0, &[], 1).tpot_ms(), None);
        assert_eq!(ok(0, 50.0, &[4.0, 6.0], 3).tpot_ms(), Some(5.0));
        // A single-token request with an ITL or TPOT SLO: no gap exceeds, no TPOT to check.
        let slo = Slo { itl_ms: Some(1.0), ..Slo::default() };
        assert!(ok(0, 50.0, &[], 1).is_good(&slo));
        assert!(ok(0, 50.0, &[], 1).is_good(&Slo { tpot_ms: Some(1.0), ..Slo::default() }));
        assert!(!ok(0, 50.0, &[4.0], 2).is_good(&Slo { tpot_ms: Some(3.0), ..Slo::default() }));
        assert!(!failed(0, "timeout").is_good(&Slo::default()));
    }
}
