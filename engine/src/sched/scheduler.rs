//! The scheduler's state and its request lifecycle: admission, sampling results, finishing,
//! aborting, holding for KV transfer, and remote-KV admission. The per-step decision lives in
//! `step.rs`.
//!
//! Invariants: every live sequence is in exactly the queue its state names (`waiting`,
//! `running`, `ready`; awaiting and held sequences are in none); `running` is in admission order;
//! running slots (a not-yet-forked group counts `n`) never exceed `max_num_seqs`; every block a
//! sequence holds is returned to the pool when it finishes, is aborted, preempted or released.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::kv::{BlockId, BlockPool};
use crate::{Error, Result};

use super::seq::{Group, SeqState, Sequence};
use super::{NewRequest, RemoteAlloc, RequestId, SchedulerConfig, SeqId};

/// Continuous-batching scheduler with chunked prefill, prefix caching, copy-on-write forks
/// and preemption by recompute. Owns the [`BlockPool`]; holds no tensors.
#[derive(Debug)]
pub struct Scheduler {
    pub(super) cfg: SchedulerConfig,
    pub(super) pool: BlockPool,
    pub(super) groups: HashMap<RequestId, Group>,
    pub(super) seqs: HashMap<SeqId, Sequence>,
    /// Admission queue, front first.
    pub(super) waiting: VecDeque<SeqId>,
    /// Admitted sequences in admission order (the back is preempted first).
    pub(super) running: Vec<SeqId>,
    /// Remote sequences whose KV landed, waiting for a running slot.
    pub(super) ready: VecDeque<SeqId>,
    /// Steps scheduled so far.
    pub(super) step: u64,
    /// Admissions so far (stamps).
    pub(super) admissions: u64,
}

impl Scheduler {
    /// A scheduler with an empty pool of `cfg.num_blocks` blocks.
    ///
    /// # Panics
    /// If `cfg` fails [`SchedulerConfig::validate`]; use [`Self::try_new`] for a typed error.
    pub fn new(cfg: SchedulerConfig) -> Self {
        match Self::try_new(cfg) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    /// A scheduler with an empty pool; errors with [`Error::InvalidKvConfig`] on bad settings.
    pub fn try_new(cfg: SchedulerConfig) -> Result<Self> {
        cfg.validate()?;
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size)?;
        Ok(Scheduler {
            cfg,
            pool,
            groups: HashMap::new(),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            ready: VecDeque::new(),
            step: 0,
            admissions: 0,
        })
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request for local prefill.
    ///
    /// Errors: [`Error::DuplicateRequest`], [`Error::EmptyPrompt`], [`Error::InvalidSampling`]
    /// (`n == 0`, `n > max_num_seqs`, `max_tokens == 0`), [`Error::PromptTooLong`]
    /// (prompt + max_tokens > max_model_len), [`Error::CapacityExceeded`] (one sequence of
    /// prompt + max_tokens tokens would not fit even in an empty pool).
    pub fn add_request(&mut self, req: NewRequest) -> Result<()> {
        self.validate(&req)?;
        let id = SeqId::new(req.id, 0);
        self.insert_group(&req);
        self.seqs
            .insert(id, Sequence::new(id, req.prompt, SeqState::Waiting));
        self.waiting.push_back(id);
        Ok(())
    }

    /// Decode role: reserves blocks for a request's whole prompt now (reusing prefix-cache hits)
    /// and parks it until [`Self::kv_ready`]. Only `n == 1` is supported this way.
    ///
    /// Errors: those of [`Self::add_request`], [`Error::InvalidSampling`] for `n > 1`, and the
    /// transient [`Error::KvPoolFull`] when too few blocks are free right now (nothing is
    /// preempted to make room).
    pub fn allocate_remote(&mut self, req: NewRequest) -> Result<RemoteAlloc> {
        self.validate(&req)?;
        if req.n != 1 {
            return Err(Error::InvalidSampling(format!(
                "n = {} is not supported with remote prefill; only n = 1",
                req.n
            )));
        }
        let len = req.prompt.len();
        let bs = self.cfg.block_size;
        let m = if self.cfg.enable_prefix_caching {
            self.pool.match_prefix(&req.prompt, len / bs)
        } else {
            self.pool.match_prefix(&req.prompt, 0)
        };
        let needed = self.pool.blocks_for(len) - m.len();
        let available = self.pool.num_free() - m.num_unreferenced();
        if needed > available {
            return Err(Error::KvPoolFull {
                needed,
                free: available,
            });
        }
        let mut table = self.pool.acquire_prefix(m);
        let cached = table.len() * bs;
        self.pool.grow(&mut table, len)?;
        let block_table = table.blocks().to_vec();
        let id = SeqId::new(req.id, 0);
        self.insert_group(&req);
        let mut seq = Sequence::new(id, req.prompt, SeqState::AwaitingKv);
        seq.table = table;
        seq.num_computed = cached;
        self.seqs.insert(id, seq);
        Ok(RemoteAlloc {
            block_table,
            num_cached_tokens: cached,
        })
    }

    /// Decode role: the prompt KV of a request from [`Self::allocate_remote`] has been written
    /// into its blocks. The prompt counts as computed (its full blocks join the prefix cache),
    /// `first_token` (sampled by the prefill node) is appended, and the sequence starts decoding
    /// as soon as a running slot is free.
    ///
    /// Errors with [`Error::UnknownRequest`] when `id` is not awaiting KV.
    pub fn kv_ready(&mut self, id: RequestId, first_token: u32) -> Result<()> {
        let sid = SeqId::new(id, 0);
        let (Some(seq), Some(group)) = (self.seqs.get_mut(&sid), self.groups.get_mut(&id)) else {
            return Err(Error::UnknownRequest(id.0));
        };
        if seq.state != SeqState::AwaitingKv {
            return Err(Error::UnknownRequest(id.0));
        }
        seq.num_computed = seq.tokens.len();
        if self.cfg.enable_prefix_caching {
            self.pool
                .register_computed(&mut seq.table, &seq.tokens, seq.num_computed);
        }
        seq.tokens.push(first_token);
        seq.state = SeqState::Ready;
        group.forked = true;
        self.ready.push_back(sid);
        Ok(())
    }

    /// Reports the tokens sampled from a chunk with `sample == true` (`tokens.len()` equal to
    /// its `num_samples`). With `n > 1` the first report forks the sequence into `n` sequences
    /// sharing its blocks, sequence `i` getting `tokens[i]`; otherwise the token is appended.
    /// A report for an unknown (finished, aborted) sequence, or one that does not match the
    /// last schedule, is ignored with a warning.
    pub fn on_sampled(&mut self, seq: SeqId, tokens: &[u32]) {
        let (Some(s), Some(group)) = (self.seqs.get(&seq), self.groups.get(&seq.request)) else {
            return;
        };
        let expected = group.slot_cost(seq.index);
        if s.state != SeqState::Running || s.remaining() != 0 || tokens.len() != expected {
            tracing::warn!(
                %seq, got = tokens.len(), expected, state = ?s.state, remaining = s.remaining(),
                "ignoring a sample report that does not match the schedule"
            );
            return;
        }
        if expected > 1 {
            self.fork(seq, &tokens[1..]);
        }
        if let Some(group) = self.groups.get_mut(&seq.request) {
            group.forked = true;
        }
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.tokens.push(tokens[0]);
        }
    }

    /// Replaces `seq`'s last token, reported as [`super::PENDING_TOKEN`], with the token the
    /// step sampled, and offers the block it completes (if its chunk is scheduled) to the prefix
    /// cache. Ignored for an unknown sequence or one whose last token is known.
    pub fn resolve_token(&mut self, seq: SeqId, token: u32) {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        match s.tokens.last_mut() {
            Some(last) if *last == super::PENDING_TOKEN => *last = token,
            _ => return,
        }
        if self.cfg.enable_prefix_caching {
            self.pool
                .register_computed(&mut s.table, &s.tokens, s.num_computed);
        }
    }

    /// Creates sequences `1..=extra.len()` of `parent`'s request, sharing its blocks, placed
    /// right after it in the running order.
    fn fork(&mut self, parent: SeqId, extra: &[u32]) {
        let Some(p) = self.seqs.get(&parent) else {
            return;
        };
        let pos = self
            .running
            .iter()
            .position(|&r| r == parent)
            .unwrap_or(self.running.len());
        let mut children = Vec::with_capacity(extra.len());
        for (i, &tok) in extra.iter().enumerate() {
            let id = SeqId::new(parent.request, i as u32 + 1);
            let mut tokens = p.tokens.clone();
            tokens.push(tok);
            let child = Sequence {
                id,
                tokens,
                num_computed: p.num_computed,
                table: self.pool.fork(&p.table),
                state: SeqState::Running,
                admitted: p.admitted,
                scheduled_step: p.scheduled_step,
            };
            children.push(child);
        }
        for (i, child) in children.into_iter().enumerate() {
            self.running.insert(pos + 1 + i, child.id);
            if let Some(g) = self.groups.get_mut(&parent.request) {
                g.live.insert(child.id.index);
            }
            self.seqs.insert(child.id, child);
        }
    }

    /// The engine is done with this sequence (end of text, stop string, max_tokens): its blocks
    /// are freed; the request is gone once all its sequences are. Unknown ids are ignored.
    pub fn finish(&mut self, seq: SeqId) {
        self.remove_seq(seq);
    }

    /// Drops a request wherever it is (waiting, running, mid-prefill, awaiting KV, ready, held)
    /// and frees all its blocks. False if the request is unknown.
    ///
    /// Blocks of a request awaiting KV go straight back to the pool: cancel the transfer first.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(group) = self.groups.get(&id) else {
            return false;
        };
        let live: Vec<u32> = group.live.iter().copied().collect();
        for index in live {
            self.remove_seq(SeqId::new(id, index));
        }
        self.groups.remove(&id);
        true
    }

    /// Prefill role: stops scheduling `seq` but keeps its blocks (for a KV transfer) until
    /// [`Self::release`]; returns its block table. Applies to a running (or already held)
    /// sequence; for any other (or unknown) sequence nothing changes and the table is empty.
    pub fn hold(&mut self, seq: SeqId) -> Vec<BlockId> {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return Vec::new();
        };
        match s.state {
            SeqState::Held => {}
            SeqState::Running => {
                s.state = SeqState::Held;
                self.running.retain(|&r| r != seq);
            }
            SeqState::Waiting | SeqState::AwaitingKv | SeqState::Ready => return Vec::new(),
        }
        s.table.blocks().to_vec()
    }

    /// Frees the blocks of the request's held sequences (the transfer is over) and forgets them.
    /// False if the request has no held sequence.
    pub fn release(&mut self, id: RequestId) -> bool {
        let Some(group) = self.groups.get(&id) else {
            return false;
        };
        let held: Vec<SeqId> = group
            .live
            .iter()
            .map(|&i| SeqId::new(id, i))
            .filter(|s| self.seqs.get(s).is_some_and(|s| s.state == SeqState::Held))
            .collect();
        for &s in &held {
            self.remove_seq(s);
        }
        !held.is_empty()
    }

    /// True while any request is live (in any state, held and awaiting KV included).
    pub fn has_unfinished(&self) -> bool {
        !self.groups.is_empty()
    }

    /// True when [`Self::schedule`] may return work now: something waits for admission or a
    /// running sequence has tokens to compute.
    pub fn has_schedulable(&self) -> bool {
        !self.waiting.is_empty()
            || !self.ready.is_empty()
            || self
                .running
                .iter()
                .any(|id| self.seqs.get(id).is_some_and(|s| self.can_run(s)))
    }

    /// Sequences admitted and not held.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting for admission (new or preempted) or, with remote KV, for a running slot.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.ready.len()
    }

    /// Sequences whose prompt KV is still arriving.
    pub fn num_awaiting_kv(&self) -> usize {
        self.seqs
            .values()
            .filter(|s| s.state == SeqState::AwaitingKv)
            .count()
    }

    /// Sequences held for a KV transfer.
    pub fn num_held(&self) -> usize {
        self.seqs
            .values()
            .filter(|s| s.state == SeqState::Held)
            .count()
    }

    /// A running sequence that has tokens to compute and is allowed to compute them: one that
    /// reached `max_tokens`, or (prefill role) has sampled, waits for the engine to finish or
    /// hold it.
    pub(super) fn can_run(&self, s: &Sequence) -> bool {
        let Some(g) = self.groups.get(&s.id.request) else {
            return false;
        };
        let generated = g.generated(s.tokens.len());
        let parked =
            generated >= g.max_tokens || (self.cfg.role == super::Role::Prefill && generated >= 1);
        s.state == SeqState::Running && s.remaining() > 0 && !parked
    }

    fn validate(&self, req: &NewRequest) -> Result<()> {
        if self.groups.contains_key(&req.id) {
            return Err(Error::DuplicateRequest(req.id.0));
        }
        self.check_admissible(req.prompt.len(), req.n, req.max_tokens)
    }

    /// The checks [`Self::add_request`] makes on a request's shape, without admitting anything:
    /// the errors it returns except [`Error::DuplicateRequest`]. Read-only.
    pub fn check_admissible(&self, prompt_len: usize, n: usize, max_tokens: usize) -> Result<()> {
        if prompt_len == 0 {
            return Err(Error::EmptyPrompt);
        }
        if n == 0 {
            return Err(Error::InvalidSampling("n must be at least 1".into()));
        }
        if n > self.cfg.max_num_seqs {
            return Err(Error::InvalidSampling(format!(
                "n = {} exceeds the {} sequences this engine runs at once",
                n, self.cfg.max_num_seqs
            )));
        }
        if max_tokens == 0 {
            return Err(Error::InvalidSampling(
                "max_tokens must be at least 1".into(),
            ));
        }
        let total = prompt_len.saturating_add(max_tokens);
        if total > self.cfg.max_model_len {
            return Err(Error::PromptTooLong {
                prompt: prompt_len,
                max_tokens,
                limit: self.cfg.max_model_len,
            });
        }
        let needed = self.pool.blocks_for(total);
        if needed > self.pool.num_blocks() {
            return Err(Error::CapacityExceeded {
                needed,
                total: self.pool.num_blocks(),
            });
        }
        Ok(())
    }

    fn insert_group(&mut self, req: &NewRequest) {
        let group = Group {
            n: req.n,
            max_tokens: req.max_tokens,
            prompt_len: req.prompt.len(),
            forked: false,
            live: BTreeSet::from([0]),
        };
        self.groups.insert(req.id, group);
    }

    /// Removes a sequence from its queue and the group, freeing its blocks; drops the group
    /// when it was the last. No-op for an unknown sequence.
    pub(super) fn remove_seq(&mut self, id: SeqId) {
        let Some(s) = self.seqs.remove(&id) else {
            return;
        };
        match s.state {
            SeqState::Waiting => self.waiting.retain(|&w| w != id),
            SeqState::Running => self.running.retain(|&r| r != id),
            SeqState::Ready => self.ready.retain(|&r| r != id),
            SeqState::AwaitingKv | SeqState::Held => {}
        }
        self.pool.free(s.table);
        if let Some(g) = self.groups.get_mut(&id.request) {
            g.live.remove(&id.index);
            if g.live.is_empty() {
                self.groups.remove(&id.request);
            }
        }
    }

    /// Preempts a running sequence by recompute: frees its blocks, forgets its KV and puts it
    /// at the front of the waiting queue.
    pub(super) fn preempt(&mut self, id: SeqId) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let table = std::mem::take(&mut s.table);
        s.num_computed = 0;
        s.state = SeqState::Waiting;
        self.pool.free(table);
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
    }
}

