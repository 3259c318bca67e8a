//! Seeded random workloads driving the whole Scheduler API the way an engine would (add,
//! schedule, run the chunks against a simulated KV store, report samples, finish, abort,
//! hold/release, allocate_remote/kv_ready) with a pool small enough that preemption happens.
//!
//! After every call the scheduler's invariants hold; every schedule respects the token budget
//! and `max_num_seqs` and its block tables cover their chunks; every live sequence reads back
//! exactly its own KV (so prefix hits, forks, copies and preemption never corrupt anything);
//! and once new work stops, everything drains and the pool is fully free. In overlapped mode the
//! driver behaves like the engine with async scheduling: single draws are reported as
//! [`PENDING_TOKEN`] and resolved only after the next step has been scheduled.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::seq::SeqState;
use super::{NewRequest, PENDING_TOKEN, RequestId, Role, Scheduler, SchedulerConfig, SeqId};
use crate::Error;
use crate::kv::sim::KvSim;

struct Sim {
    rng: SmallRng,
    s: Scheduler,
    kv: KvSim,
    /// The test's own record of every live sequence's tokens.
    mirror: HashMap<SeqId, Vec<u32>>,
    /// prompt length and max_tokens per live request.
    limits: HashMap<RequestId, (usize, usize)>,
    /// Remote requests whose KV is "in flight".
    in_flight: Vec<RequestId>,
    /// Sequences whose next chunk starts from scratch (new or preempted): a chunk for one of
    /// them that starts past 0 reused cached blocks.
    fresh: std::collections::HashSet<SeqId>,
    next_id: u64,
    prefixes: Vec<Vec<u32>>,
    stats: Stats,
    /// Report single draws as pending and resolve them one step later.
    overlap: bool,
    /// Draws of the last step reported as pending: the sequence and its real token (already in
    /// `mirror`).
    pending: Vec<(SeqId, u32)>,
}

#[derive(Default, Debug)]
struct Stats {
    steps: usize,
    preemptions: usize,
    copies: usize,
    finished: usize,
    cache_hit_tokens: usize,
    forks: usize,
    held: usize,
    remote: usize,
    pending: usize,
}

impl Sim {
    fn new(seed: u64, cfg: SchedulerConfig) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let prefixes = (0..3)
            .map(|_| {
                (0..rng.random_range(3..14))
                    .map(|_| rng.random_range(0..20))
                    .collect()
            })
            .collect();
        let kv = KvSim::new(cfg.num_blocks, cfg.block_size);
        Sim {
            rng,
            s: Scheduler::new(cfg),
            kv,
            mirror: HashMap::new(),
            limits: HashMap::new(),
            in_flight: Vec::new(),
            fresh: Default::default(),
            next_id: 1,
            prefixes,
            stats: Stats::default(),
            overlap: false,
            pending: Vec::new(),
        }
    }

    fn random_request(&mut self) -> NewRequest {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let mut prompt = if self.rng.random_bool(0.6) {
            self.prefixes[self.rng.random_range(0..self.prefixes.len())].clone()
        } else {
            Vec::new()
        };
        let extra = self.rng.random_range(0..10);
        prompt.extend((0..extra).map(|_| self.rng.random_range(0..20)));
        let n = if self.rng.random_bool(0.25) {
            self.rng.random_range(2..=3)
        } else {
            1
        };
        let max_tokens = self.rng.random_range(0..12);
        NewRequest {
            id,
            prompt,
            n,
            max_tokens,
        }
    }

    /// Expected verdict of admission for `req`, computed independently of the scheduler.
    fn expected_error(&self, req: &NewRequest) -> Option<&'static str> {
        let cfg = self.s.config();
        let total = req.prompt.len() + req.max_tokens;
        if req.prompt.is_empty() {
            Some("empty")
        } else if req.n == 0 || req.n > cfg.max_num_seqs || req.max_tokens == 0 {
            Some("sampling")
        } else if total > cfg.max_model_len {
            Some("too long")
        } else if total.div_ceil(cfg.block_size) > cfg.num_blocks {
            Some("capacity")
        } else {
            None
        }
    }

    fn verdict(e: &Error) -> &'static str {
        match e {
            Error::EmptyPrompt => "empty",
            Error::InvalidSampling(_) => "sampling",
            Error::PromptTooLong { .. } => "too long",
            Error::CapacityExceeded { .. } => "capacity",
            Error::KvPoolFull { .. } => "pool full",
            other => panic!("unexpected error {other}"),
        }
    }

    fn add(&mut self) {
        let req = self.random_request();
        let expected = self.expected_error(&req);
        let (id, prompt, max) = (req.id, req.prompt.clone(), req.max_tokens);
        match self.s.add_request(req) {
            Ok(()) => {
                assert_eq!(expected, None);
                self.mirror.insert(SeqId::new(id, 0), prompt.clone());
                self.limits.insert(id, (prompt.len(), max));
                self.fresh.insert(SeqId::new(id, 0));
            }
            Err(e) => assert_eq!(Some(Self::verdict(&e)), expected, "{e}"),
        }
    }

    fn add_remote(&mut self) {
        let mut req = self.random_request();
        let bad_n = req.n > 1;
        let expected = self.expected_error(&req);
        let (id, prompt, max) = (req.id, req.prompt.clone(), req.max_tokens);
        if self.rng.random_bool(0.5) {
            req.n = 1;
        }
        let bad_n = bad_n && req.n > 1;
        match self.s.allocate_remote(req) {
            Ok(alloc) => {
                assert_eq!(expected, None);
                assert!(!bad_n);
                let bs = self.s.config().block_size;
                assert_eq!(alloc.block_table.len(), prompt.len().div_ceil(bs));
                assert_eq!(alloc.num_cached_tokens % bs, 0);
                // The cached prefix already holds this prompt's KV; the transfer writes the rest.
                self.kv
                    .verify(&alloc.block_table, &prompt, alloc.num_cached_tokens)
                    .unwrap();
                for &b in &alloc.block_table[alloc.num_cached_tokens / bs..] {
                    assert_eq!(
                        self.s.pool().ref_count(b),
                        1,
                        "transfer target must be private"
                    );
                }
                self.kv.write(
                    &alloc.block_table,
                    &prompt,
                    alloc.num_cached_tokens,
                    prompt.len(),
                );
                self.stats.cache_hit_tokens += alloc.num_cached_tokens;
                self.mirror.insert(SeqId::new(id, 0), prompt.clone());
                self.limits.insert(id, (prompt.len(), max));
                self.in_flight.push(id);
            }
            Err(Error::InvalidSampling(_)) if bad_n || expected == Some("sampling") => {}
            Err(e) => {
                let v = Self::verdict(&e);
                assert!(
                    Some(v) == expected || (v == "pool full" && expected.is_none()),
                    "{e}"
                );
            }
        }
    }

    fn land_remote(&mut self) {
        if self.in_flight.is_empty() {
            return;
        }
        let i = self.rng.random_range(0..self.in_flight.len());
        let id = self.in_flight.swap_remove(i);
        let tok = self.rng.random_range(0..20);
        self.s.kv_ready(id, tok).unwrap();
        assert!(self.s.kv_ready(id, tok).is_err(), "kv_ready twice");
        self.mirror.get_mut(&SeqId::new(id, 0)).unwrap().push(tok);
        self.stats.remote += 1;
        self.finish_if_done(SeqId::new(id, 0));
    }

    fn forget(&mut self, id: RequestId) {
        self.mirror.retain(|s, _| s.request != id);
        self.limits.remove(&id);
        self.in_flight.retain(|&r| r != id);
    }

    fn abort_random(&mut self) {
        // Sorted: HashMap order is not seeded, the test must be reproducible.
        let mut live: Vec<RequestId> = self.limits.keys().copied().collect();
        live.sort_unstable();
        if live.is_empty() {
            return;
        }
        let id = live[self.rng.random_range(0..live.len())];
        assert!(self.s.abort(id));
        assert!(!self.s.abort(id), "second abort finds nothing");
        self.forget(id);
    }

    fn release_random(&mut self) {
        let mut held: Vec<SeqId> = self
            .s
            .seqs
            .values()
            .filter(|s| s.state == SeqState::Held)
            .map(|s| s.id)
            .collect();
        held.sort_unstable();
        if held.is_empty() {
            return;
        }
        let id = held[self.rng.random_range(0..held.len())];
        let prompt_len = self.limits[&id.request].0;
        // Release frees every held sequence of the request; their blocks still hold exactly
        // the prompt's KV (hold again just returns the table).
        for &h in held.iter().filter(|h| h.request == id.request) {
            let blocks = self.s.hold(h);
            self.kv
                .verify(&blocks, &self.mirror[&h], prompt_len)
                .unwrap();
            self.mirror.remove(&h);
        }
        assert!(self.s.release(id.request));
        assert!(!self.s.release(id.request), "nothing left to release");
        if !self.mirror.keys().any(|s| s.request == id.request) {
            self.forget(id.request);
        }
    }

    /// Engine behaviour after a sample: stop at max_tokens, sometimes stop early.
    fn finish_if_done(&mut self, seq: SeqId) {
        if !self.mirror.contains_key(&seq) {
            return; // finished or aborted while its token was pending
        }
        let (prompt_len, max) = self.limits[&seq.request];
        let generated = self.mirror[&seq].len() - prompt_len;
        let stop = generated >= max || self.rng.random_bool(0.05);
        if stop {
            self.s.finish(seq);
            self.mirror.remove(&seq);
            self.stats.finished += 1;
            if !self.mirror.keys().any(|s| s.request == seq.request) {
                self.forget(seq.request);
            }
        }
    }

    fn step(&mut self) {
        let cfg = self.s.config().clone();
        let sched = self.s.schedule();
        self.stats.steps += 1;
        self.stats.preemptions += sched.preempted.len();
        self.fresh.extend(sched.preempted.iter().copied());
        self.stats.copies += sched.copies.len();
        assert!(
            sched.num_tokens() <= cfg.max_num_batched_tokens,
            "token budget"
        );
        assert!(sched.chunks.len() <= cfg.max_num_seqs, "max_num_seqs");
        let mut seen = std::collections::HashSet::new();
        for c in &sched.chunks {
            assert!(seen.insert(c.seq), "one chunk per sequence");
            assert!(
                !sched.preempted.contains(&c.seq),
                "a preempted sequence has no chunk"
            );
            assert!(!c.tokens.is_empty());
            if self.fresh.remove(&c.seq) {
                self.stats.cache_hit_tokens += c.start_pos;
                assert!(cfg.enable_prefix_caching || c.start_pos == 0);
                assert!(
                    c.start_pos < self.mirror[&c.seq].len(),
                    "the last token is computed"
                );
            }
            let end = c.start_pos + c.tokens.len();
            assert_eq!(
                c.block_table.len(),
                end.div_ceil(cfg.block_size),
                "table covers chunk"
            );
            let mine = &self.mirror[&c.seq];
            if c.tokens.contains(&PENDING_TOKEN) {
                // Only a lone last token, sampled by the step before and not resolved yet.
                assert_eq!((c.tokens.len(), end), (1, mine.len()), "pending token alone and last");
                assert!(self.pending.contains(&(c.seq, mine[c.start_pos])), "pending token from the last step");
            } else {
                assert_eq!(&mine[c.start_pos..end], &c.tokens[..], "chunk tokens");
            }
            assert_eq!(c.sample, end == mine.len());
            if cfg.role == Role::Prefill {
                let prompt_len = self.limits[&c.seq.request].0;
                assert!(
                    end <= prompt_len || c.start_pos < prompt_len,
                    "no decode on prefill role"
                );
            }
        }
        // The engine: copies first, then every chunk's KV, then attention reads.
        self.kv.copy(&sched.copies);
        for c in &sched.chunks {
            let end = c.start_pos + c.tokens.len();
            self.kv
                .write(&c.block_table, &self.mirror[&c.seq], c.start_pos, end);
        }
        for c in &sched.chunks {
            let end = c.start_pos + c.tokens.len();
            self.kv
                .verify(&c.block_table, &self.mirror[&c.seq], end)
                .unwrap();
        }
        // The previous step's draws become known only now, after this step was scheduled.
        for (seq, tok) in std::mem::take(&mut self.pending) {
            if self.mirror.contains_key(&seq) {
                self.s.resolve_token(seq, tok);
                self.finish_if_done(seq);
            }
        }
        for c in sched.chunks.iter().filter(|c| c.sample) {
            if !self.mirror.contains_key(&c.seq) {
                continue; // finished on its resolved token: this chunk ran for nothing
            }
            let toks: Vec<u32> = (0..c.num_samples)
                .map(|_| self.rng.random_range(0..20))
                .collect();
            if self.overlap && toks.len() == 1 && cfg.role != Role::Prefill {
                self.s.on_sampled(c.seq, &[PENDING_TOKEN]);
                self.mirror.get_mut(&c.seq).unwrap().push(toks[0]);
                self.pending.push((c.seq, toks[0]));
                self.stats.pending += 1;
                continue;
            }
            self.s.on_sampled(c.seq, &toks);
            let base = self.mirror[&c.seq].clone();
            for (i, &t) in toks.iter().enumerate() {
                let id = SeqId::new(c.seq.request, c.seq.index + i as u32);
                let mut tokens = base.clone();
                tokens.push(t);
                self.mirror.insert(id, tokens);
            }
            self.stats.forks += usize::from(toks.len() > 1);
            for i in 0..toks.len() as u32 {
                let id = SeqId::new(c.seq.request, c.seq.index + i);
                if cfg.role == Role::Prefill {
                    // A prefill node hands the KV over (hold) or drops the sequence.
                    if self.rng.random_bool(0.8) {
                        let blocks = self.s.hold(id);
                        let prompt_len = self.limits[&id.request].0;
                        self.kv
                            .verify(&blocks, &self.mirror[&id], prompt_len)
                            .unwrap();
                        self.stats.held += 1;
                    } else {
                        self.s.finish(id);
                        self.mirror.remove(&id);
                        if !self.mirror.keys().any(|s| s.request == id.request) {
                            self.forget(id.request);
                        }
                    }
                } else {
                    self.finish_if_done(id);
                }
            }
        }
        self.check();
    }

    fn check(&self) {
        self.s.check_invariants().unwrap();
        for (id, s) in &self.s.seqs {
            let mine = &self.mirror[id];
            match s.tokens.split_last() {
                Some((&PENDING_TOKEN, known)) => {
                    assert!(self.pending.contains(&(*id, mine[known.len()])), "{id}: pending token not in flight");
                    assert_eq!(known, &mine[..mine.len() - 1], "{id} tokens");
                }
                _ => assert_eq!(&s.tokens, mine, "{id} tokens"),
            }
            // Nobody else's write ever clobbered this sequence's computed KV.
            self.kv
                .verify(s.table.blocks(), mine, s.num_computed)
                .unwrap();
        }
        assert_eq!(self.s.seqs.len(), self.mirror.len());
        assert_eq!(self.s.has_unfinished(), !self.limits.is_empty());
    }

    fn random_op(&mut self) {
        let role = self.s.config().role;
        match self.rng.random_range(0..100) {
            0..25 => self.add(),
            25..40 if role == Role::Decode => self.add_remote(),
            40..50 => self.land_remote(),
            50..53 => self.abort_random(),
            53..60 => self.release_random(),
            60..63 => {
                // A stop string: the engine finishes some running sequence.
                let running = self.s.running.clone();
                if !running.is_empty() {
                    let id = running[self.rng.random_range(0..running.len())];
                    self.s.finish(id);
                    self.mirror.remove(&id);
                    if !self.mirror.keys().any(|s| s.request == id.request) {
                        self.forget(id.request);
                    }
                }
            }
            _ => {}
        }
        self.check();
    }

    /// Stops new work and runs until everything is done; fails on livelock.
    fn drain(&mut self) {
        for _ in 0..20_000 {
            if !self.s.has_unfinished() {
                break;
            }
            while !self.in_flight.is_empty() {
                self.land_remote();
            }
            while self.s.num_held() > 0 {
                self.release_random();
            }
            self.step();
        }
        assert!(!self.s.has_unfinished(), "did not drain: {:?}", self.stats);
        self.s.check_invariants().unwrap();
        assert!(self.s.pool().is_fully_free(), "blocks leaked");
        assert_eq!(self.s.num_running() + self.s.num_waiting(), 0);
    }
}

fn small_config(role: Role) -> SchedulerConfig {
    SchedulerConfig {
        role,
        block_size: 4,
        num_blocks: 10,
        max_num_seqs: 5,
        max_num_batched_tokens: 12,
        max_model_len: 36,
        enable_prefix_caching: true,
    }
}

fn run(seed: u64, cfg: SchedulerConfig, steps: usize) -> Stats {
    run_mode(seed, cfg, steps, false)
}

fn run_mode(seed: u64, cfg: SchedulerConfig, steps: usize, overlap: bool) -> Stats {
    let mut sim = Sim::new(seed, cfg);
    sim.overlap = overlap;
    for _ in 0..steps {
        for _ in 0..sim.rng.random_range(0..3) {
            sim.random_op();
        }
        sim.step();
    }
    sim.drain();
    eprintln!("seed {seed}: {:?}", sim.stats);
    sim.stats
}

#[test]
fn random_colocated() {
    for seed in 0..4 {
        let st = run(seed, small_config(Role::Colocated), 4_000);
        assert!(
            st.preemptions > 0 && st.copies > 0 && st.forks > 0,
            "{st:?}"
        );
        assert!(st.cache_hit_tokens > 0, "{st:?}");
        assert!(st.finished > 100, "{st:?}");
    }
}

#[test]
fn random_colocated_without_prefix_caching() {
    let cfg = SchedulerConfig {
        enable_prefix_caching: false,
        ..small_config(Role::Colocated)
    };
    let st = run(10, cfg, 4_000);
    assert!(st.preemptions > 0 && st.finished > 100, "{st:?}");
}

#[test]
fn random_prefill_role() {
    for seed in 20..23 {
        let st = run(seed, small_config(Role::Prefill), 3_000);
        assert!(st.held > 100, "{st:?}");
    }
}

#[test]
fn random_decode_role() {
    for seed in 30..33 {
        let st = run(seed, small_config(Role::Decode), 4_000);
        assert!(
            st.remote > 100 && st.cache_hit_tokens > 0 && st.preemptions > 0,
            "{st:?}"
        );
    }
}

#[test]
fn random_roomier_pool_block_size_one_and_big_budget() {
    let cfg = SchedulerConfig {
        block_size: 1,
        num_blocks: 40,
        max_num_batched_tokens: 64,
        ..small_config(Role::Colocated)
    };
    run(40, cfg, 3_000);
}

#[test]
fn random_overlapped_steps() {
    for (seed, role) in [(50, Role::Colocated), (51, Role::Colocated), (52, Role::Decode)] {
        let st = run_mode(seed, small_config(role), 4_000, true);
        assert!(st.pending > 1000 && st.preemptions > 0 && st.cache_hit_tokens > 0, "{st:?}");
        assert!(st.finished > 100, "{st:?}");
    }
}
