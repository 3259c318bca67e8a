//! One scheduling step: which tokens of which sequences the next forward pass computes.
//!
//! Order (first come, first served): (0) remote sequences whose KV landed take free running
//! slots; (1) running sequences with exactly one token left — decodes — get one token each;
//! (2) partially prefilled running sequences continue, chunked to the remaining token budget and
//! to the free blocks; (3) waiting sequences are admitted in queue order while the budget, the
//! running slots and the free blocks allow (no admission in a step that preempted).
//!
//! When a running sequence needs a block and none is free (evictable cached blocks count as
//! free), the most recently admitted running sequence not yet scheduled this step is preempted
//! by recompute — possibly the sequence itself. Admission never preempts. A sequence's
//! `num_computed` advances when its chunk is scheduled, and its newly full blocks join the
//! prefix cache at once (the engine computes every chunk of a step before the next call), except
//! a block whose last token is still pending (see [`super::PENDING_TOKEN`]).
//! No I/O, no locks, no channels.

use crate::kv::BlockId;

use super::seq::SeqState;
use super::{Schedule, ScheduledChunk, Scheduler, SeqId};

/// Outcome of trying to give a running sequence a chunk.
enum Placed {
    /// Scheduled this many tokens.
    Tokens(usize),
    /// The sequence itself was preempted.
    Preempted,
}

impl Scheduler {
    /// Decides the next step. Every returned chunk must be computed (copies first) before the
    /// scheduler is called again — also for a request aborted in between, since its full blocks
    /// are already offered to the prefix cache.
    pub fn schedule(&mut self) -> Schedule {
        self.step += 1;
        let mut out = Schedule::default();
        let mut budget = self.cfg.max_num_batched_tokens;

        self.admit_ready();

        // (1) decodes, (2) prefill continuations: both walk `running` front to back.
        for decode_pass in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let id = self.running[i];
                let Some(s) = self.seqs.get(&id) else {
                    i += 1;
                    continue;
                };
                let rem = s.remaining();
                if !self.can_run(s) || s.scheduled_step == self.step || (rem == 1) != decode_pass {
                    i += 1;
                    continue;
                }
                match self.place_running(id, rem.min(budget), !decode_pass, &mut out) {
                    Placed::Tokens(k) => {
                        budget -= k;
                        i += 1;
                    }
                    Placed::Preempted => {}
                }
            }
        }

        // (3) admissions.
        if out.preempted.is_empty() {
            self.admit_waiting(&mut budget, &mut out);
        }
        out
    }

    /// Running slots in use.
    pub(super) fn slots_used(&self) -> usize {
        self.running
            .iter()
            .filter_map(|id| self.groups.get(&id.request).map(|g| g.slot_cost(id.index)))
            .sum()
    }

    /// Moves remote sequences whose KV landed into `running`, FCFS, while slots allow.
    fn admit_ready(&mut self) {
        let mut slots = self.slots_used();
        while let Some(&id) = self.ready.front() {
            let Some(cost) = self.groups.get(&id.request).map(|g| g.slot_cost(id.index)) else {
                self.ready.pop_front();
                continue;
            };
            if slots + cost > self.cfg.max_num_seqs {
                break;
            }
            self.ready.pop_front();
            self.admissions += 1;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.state = SeqState::Running;
                s.admitted = self.admissions;
            }
            self.running.push(id);
            slots += cost;
        }
    }

    /// Gives running sequence `id` a chunk of up to `want` tokens, preempting the newest
    /// unscheduled running sequences while blocks are short. With `shrink`, a chunk that does
    /// not fit is first cut to what the free blocks hold.
    fn place_running(
        &mut self,
        id: SeqId,
        want: usize,
        shrink: bool,
        out: &mut Schedule,
    ) -> Placed {
        loop {
            let Some(s) = self.seqs.get(&id) else {
                return Placed::Tokens(0);
            };
            let start = s.num_computed;
            let free = self.pool.num_free();
            let fits = |k: usize| self.pool.blocks_needed(&s.table, start, k) <= free;
            let k = if fits(want) {
                want
            } else if shrink {
                // Largest k < want that fits; blocks_needed grows with k.
                let (mut lo, mut hi) = (0, want);
                while lo + 1 < hi {
                    let mid = (lo + hi) / 2;
                    if fits(mid) { lo = mid } else { hi = mid }
                }
                lo
            } else {
                0
            };
            if k > 0 {
                self.emit(id, k, out);
                return Placed::Tokens(k);
            }
            let victim = self.victim().unwrap_or(id);
            self.preempt(victim);
            out.preempted.push(victim);
            if victim == id {
                return Placed::Preempted;
            }
        }
    }

    /// The most recently admitted running sequence that is not scheduled this step and can
    /// still grow. The caller is always such a sequence, so one is always found.
    fn victim(&self) -> Option<SeqId> {
        self.running.iter().rev().copied().find(|id| {
            self.seqs
                .get(id)
                .is_some_and(|s| s.scheduled_step != self.step && self.can_run(s))
        })
    }

    /// Admits waiting sequences in order while budget, slots and free blocks allow.
    fn admit_waiting(&mut self, budget: &mut usize, out: &mut Schedule) {
        let bs = self.cfg.block_size;
        let mut slots = self.slots_used();
        while *budget > 0 {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let (Some(s), Some(group)) = (self.seqs.get(&id), self.groups.get(&id.request)) else {
                self.waiting.pop_front();
                continue;
            };
            let cost = group.slot_cost(id.index);
            if slots + cost > self.cfg.max_num_seqs {
                break;
            }
            let len = s.tokens.len();
            // Reuse cached full blocks, but leave at least the last token to compute.
            let max_hit = if self.cfg.enable_prefix_caching {
                (len - 1) / bs
            } else {
                0
            };
            let m = self.pool.match_prefix(&s.tokens, max_hit);
            let cached = m.len() * bs;
            let k = (len - cached).min(*budget);
            let needed = self.pool.blocks_for(cached + k) - m.len();
            if needed > self.pool.num_free() - m.num_unreferenced() {
                break;
            }
            self.waiting.pop_front();
            let table = self.pool.acquire_prefix(m);
            let Some(s) = self.seqs.get_mut(&id) else {
                self.pool.free(table);
                continue;
            };
            self.admissions += 1;
            s.num_computed = table.len() * bs;
            s.table = table;
            s.state = SeqState::Running;
            s.admitted = self.admissions;
            let k = (len - s.num_computed).min(*budget);
            self.running.push(id);
            slots += cost;
            self.emit(id, k, out);
            *budget -= k;
        }
    }

    /// Schedules tokens `num_computed .. num_computed + k` of `id`; the blocks are known to fit.
    fn emit(&mut self, id: SeqId, k: usize, out: &mut Schedule) {
        let Some(group) = self.groups.get(&id.request) else {
            return;
        };
        let num_samples_if_sampled = group.slot_cost(id.index);
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let start = s.num_computed;
        match self.pool.prepare_write(&mut s.table, start, k) {
            Ok(copies) => out.copies.extend(copies),
            Err(e) => {
                // Callers check the free blocks first; reaching this is a scheduler bug. Debug
                // builds stop here; release builds skip the chunk (the sequence retries later).
                if cfg!(debug_assertions) {
                    panic!("scheduler bug: chunk for {id} scheduled without its blocks: {e}");
                }
                tracing::error!(%id, error = %e, "scheduled a chunk without the blocks for it");
                return;
            }
        }
        s.num_computed += k;
        s.scheduled_step = self.step;
        if self.cfg.enable_prefix_caching {
            // A pending last token is not known yet: its block registers once it is resolved.
            let known = s.tokens.len() - usize::from(s.tokens.last() == Some(&super::PENDING_TOKEN));
            self.pool
                .register_computed(&mut s.table, &s.tokens, s.num_computed.min(known));
        }
        let sample = s.num_computed == s.tokens.len();
        let block_table: Vec<BlockId> = s.table.blocks().to_vec();
        out.chunks.push(ScheduledChunk {
            seq: id,
            tokens: s.tokens[start..start + k].to_vec(),
            start_pos: start,
            block_table,
            sample,
            num_samples: if sample { num_samples_if_sampled } else { 1 },
        });
    }
}
