//! Request and sequence identities and the admission input.
//!
//! A request with `n` samples owns sequences `0..n`; before its first sample only sequence 0
//! exists (the shared prompt is prefilled once), then it forks into all `n`.

use std::fmt;

/// A request's id, chosen by the caller and unique among live requests.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One sequence (sample) of a request.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct SeqId {
    /// The request it belongs to.
    pub request: RequestId,
    /// Which of the request's `n` samples, `0..n`.
    pub index: u32,
}

impl SeqId {
    /// Sequence `index` of `request`.
    pub fn new(request: RequestId, index: u32) -> Self {
        SeqId { request, index }
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.request, self.index)
    }
}

/// A request to admit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRequest {
    /// Caller-chosen id, unique among live requests.
    pub id: RequestId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Independent samples to generate (≥ 1).
    pub n: usize,
    /// Most tokens each sample may generate (≥ 1); the engine finishes a sequence at this
    /// length, and the scheduler never schedules one beyond it.
    pub max_tokens: usize,
}
