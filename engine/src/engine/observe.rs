//! Watching a step layer by layer: the hook a prefill node uses to start sending a request's KV
//! while the forward pass is still running ([`super::Engine::step_observed`]).
//!
//! Invariants: for every step that runs a forward pass the engine calls
//! [`StepObserver::prefill_completing`] exactly once, before the pass, then reports layers
//! `0..num_layers` in order, each exactly once, right after that layer's K/V of every chunk was
//! written; a step without a forward pass calls nothing. Once layer `l` is reported, nothing
//! later in the step writes layer `l` of the completing requests' blocks.

use crate::kv::BlockId;
use crate::model::KvCache;
use crate::sched::RequestId;

/// A Prefill-role request whose final prompt chunk runs in the observed step: once layer `l` is
/// reported done, layer `l` of every block in `block_table` holds its prompt's K/V.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillReady {
    /// The request.
    pub request: RequestId,
    /// Every block of the prompt in position order, prefix-cache blocks (computed earlier, maybe
    /// for another request) included.
    pub block_table: Vec<BlockId>,
    /// Prompt tokens, all of which have K/V after this step.
    pub prompt_len: usize,
}

/// Watches one engine step. Called on the engine's thread, inside the step: keep the callbacks
/// short (start a transfer, do not wait for one).
///
/// What happens to a completing request after the step: it finishes with
/// [`super::FinishReason::PrefillDone`] and holds its blocks until [`super::Engine::release`],
/// even when the sampled token would end the sequence (the decode node applies the stop rules
/// to that token), so a transfer may read the blocks until it is over.
pub trait StepObserver {
    /// Before the forward pass: Prefill-role requests whose final prompt chunk runs in this step
    /// (their K/V of layer `l` is complete once layer `l` is reported), with their full block
    /// tables in position order (including prefix-cache blocks). Called once per step that runs
    /// a forward pass, with an empty slice when no prefill completes (always so in the other
    /// roles).
    fn prefill_completing(&mut self, ready: &[PrefillReady]);

    /// After layer `layer` of the forward pass wrote its K/V (through
    /// [`Self::layer_done_with_kv`]'s default).
    fn layer_done(&mut self, layer: usize);

    /// What the engine calls after layer `layer` wrote its K/V, with the cache readable (safe
    /// code can copy the completing requests' blocks of that layer from `kv` here). The default
    /// calls [`Self::layer_done`]; an override that needs both calls it itself.
    fn layer_done_with_kv(&mut self, layer: usize, kv: &KvCache) {
        let _ = kv;
        self.layer_done(layer);
    }
}
