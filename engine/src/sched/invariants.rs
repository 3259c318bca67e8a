//! Consistency check of the whole scheduler state, for tests and debug assertions.
//!
//! Checks the pool against every live table, that each sequence sits in exactly the queue its
//! state names, that groups and sequences agree, the running-slot cap, and the per-state block
//! coverage rules documented in `seq.rs`.

use std::collections::HashSet;

use super::seq::SeqState;
use super::{Scheduler, SeqId};

impl Scheduler {
    /// Verifies every scheduler and pool invariant; the error says which one broke.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool
            .check_invariants(self.seqs.values().map(|s| &s.table))?;

        let queues: [(&str, Vec<SeqId>, SeqState); 3] = [
            (
                "waiting",
                self.waiting.iter().copied().collect(),
                SeqState::Waiting,
            ),
            ("running", self.running.clone(), SeqState::Running),
            (
                "ready",
                self.ready.iter().copied().collect(),
                SeqState::Ready,
            ),
        ];
        let mut queued = HashSet::new();
        for (name, ids, state) in &queues {
            for id in ids {
                if !queued.insert(*id) {
                    return Err(format!("{id} is queued twice (again in {name})"));
                }
                match self.seqs.get(id) {
                    Some(s) if s.state == *state => {}
                    Some(s) => return Err(format!("{id} is in {name} but {:?}", s.state)),
                    None => return Err(format!("{id} is in {name} but unknown")),
                }
            }
        }
        let bs = self.cfg.block_size;
        for (id, s) in &self.seqs {
            let in_queue = queued.contains(id);
            let wants_queue = matches!(
                s.state,
                SeqState::Waiting | SeqState::Running | SeqState::Ready
            );
            if in_queue != wants_queue {
                return Err(format!("{id} ({:?}) queued: {in_queue}", s.state));
            }
            let Some(g) = self.groups.get(&id.request) else {
                return Err(format!("{id} has no request"));
            };
            if !g.live.contains(&id.index) || s.id != *id {
                return Err(format!("{id} is not listed by its request"));
            }
            if s.num_computed > s.tokens.len() || s.tokens.len() < g.prompt_len {
                return Err(format!(
                    "{id}: {} computed of {} tokens",
                    s.num_computed,
                    s.tokens.len()
                ));
            }
            let covers = s.table.len();
            let ok = match s.state {
                SeqState::Waiting => covers == 0 && s.num_computed == 0,
                SeqState::Running | SeqState::Ready | SeqState::Held => {
                    covers == s.num_computed.div_ceil(bs)
                }
                SeqState::AwaitingKv => {
                    covers == g.prompt_len.div_ceil(bs) && s.num_computed <= g.prompt_len
                }
            };
            if !ok {
                return Err(format!(
                    "{id} ({:?}): {covers} blocks for {} computed tokens",
                    s.state, s.num_computed
                ));
            }
        }
        for (rid, g) in &self.groups {
            if g.live.is_empty() {
                return Err(format!("request {rid} has no sequences"));
            }
            for &i in &g.live {
                if !self.seqs.contains_key(&SeqId::new(*rid, i)) || i as usize >= g.n {
                    return Err(format!("request {rid} lists missing sequence {i}"));
                }
            }
        }
        let stamps: Vec<u64> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| s.admitted)
            .collect();
        if stamps.windows(2).any(|w| w[0] > w[1]) {
            return Err("running is not in admission order".into());
        }
        if self.slots_used() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running slots exceed max_num_seqs {}",
                self.slots_used(),
                self.cfg.max_num_seqs
            ));
        }
        Ok(())
    }
}
