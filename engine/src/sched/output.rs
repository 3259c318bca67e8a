//! What one scheduling step returns to the engine, and what a remote allocation returns.
//!
//! Invariants of a [`Schedule`]: at most one chunk per sequence; the chunks' token counts sum to
//! at most `max_num_batched_tokens`; there are at most `max_num_seqs` chunks; each chunk's block
//! table covers exactly `start_pos + tokens.len()` positions.

use crate::kv::{BlockCopy, BlockId};

use super::SeqId;

/// The work of one engine step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Token chunks to compute in this step's forward pass.
    pub chunks: Vec<ScheduledChunk>,
    /// Block copies to perform (all layers, K and V) BEFORE the forward pass.
    pub copies: Vec<BlockCopy>,
    /// Sequences preempted this step (informational: the scheduler already freed their blocks
    /// and will recompute them).
    pub preempted: Vec<SeqId>,
}

impl Schedule {
    /// True when there is nothing to compute or copy.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.copies.is_empty()
    }

    /// Tokens computed in this step, all chunks together.
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }
}

/// Tokens of one sequence to compute in this step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    /// The sequence.
    pub seq: SeqId,
    /// Token ids to compute (never empty).
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`, which is also how many tokens of the sequence already have KV.
    pub start_pos: usize,
    /// The sequence's blocks, covering positions `0 .. start_pos + tokens.len()`.
    pub block_table: Vec<BlockId>,
    /// The chunk ends at the sequence's last token: the engine samples from its last logits and
    /// reports with [`super::Scheduler::on_sampled`].
    pub sample: bool,
    /// Tokens to sample: the request's `n` at the first sample of a not-yet-forked group, else 1.
    pub num_samples: usize,
}

/// Blocks reserved for a request whose prompt KV will arrive from a prefill node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteAlloc {
    /// Blocks covering the whole prompt, in position order.
    pub block_table: Vec<BlockId>,
    /// Leading prompt tokens whose KV is already here (a multiple of the block size): the
    /// first `num_cached_tokens / block_size` blocks are shared prefix-cache blocks and must
    /// NOT be written; the transfer fills the rest.
    pub num_cached_tokens: usize,
}
