//! Tests of the block pool: targeted cases, then seeded random workloads (admit, grow, fork,
//! finish, abort, preempt) that check every invariant and every sequence's KV after each step.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::sim::KvSim;
use super::{BlockId, BlockPool, BlockTable, block_hash};

fn ids(t: &BlockTable) -> Vec<u32> {
    t.blocks().iter().map(|b| b.0).collect()
}

/// Allocates and "computes" `tokens` into a fresh table, registering its full blocks.
fn computed(pool: &mut BlockPool, tokens: &[u32]) -> BlockTable {
    let mut t = BlockTable::new();
    assert!(
        pool.prepare_write(&mut t, 0, tokens.len())
            .unwrap()
            .is_empty()
    );
    pool.register_computed(&mut t, tokens, tokens.len());
    t
}

#[test]
fn rejects_empty_pools() {
    assert!(BlockPool::new(0, 16).is_err());
    assert!(BlockPool::new(4, 0).is_err());
    assert!(BlockPool::new(4, 16).is_ok());
}

#[test]
fn grow_and_free() {
    let mut pool = BlockPool::new(4, 4).unwrap();
    let mut t = BlockTable::new();
    pool.grow(&mut t, 5).unwrap();
    assert_eq!(ids(&t), [0, 1]);
    assert_eq!(pool.num_free(), 2);
    pool.grow(&mut t, 8).unwrap();
    assert_eq!(t.len(), 2);
    assert!(pool.grow(&mut t, 17).is_err(), "needs 3 more, 2 free");
    assert_eq!(t.len(), 2, "failed grow changes nothing");
    pool.check_invariants([&t]).unwrap();
    assert!(
        pool.check_invariants([]).is_err(),
        "a forgotten table is a leak"
    );
    pool.free(t);
    assert!(pool.is_fully_free());
    pool.check_invariants([]).unwrap();
}

#[test]
fn prefix_hits_reuse_computed_blocks() {
    let mut pool = BlockPool::new(8, 4).unwrap();
    let prompt: Vec<u32> = (10..19).collect(); // 2 full blocks + 1 token
    let a = computed(&mut pool, &prompt);
    assert_eq!(pool.num_cached(), 2, "the partial block is not cached");
    let m = pool.match_prefix(&prompt, 8);
    assert_eq!(m.blocks(), &a.blocks()[..2]);
    assert_eq!(m.num_unreferenced(), 0);
    let b = pool.acquire_prefix(m);
    assert_eq!(pool.ref_count(a.blocks()[0]), 2);
    pool.check_invariants([&a, &b]).unwrap();
    pool.free(a);
    pool.free(b);
    assert!(pool.is_fully_free());
    assert_eq!(pool.num_evictable(), 2);

    // A different second block matches only the first.
    let mut other = prompt.clone();
    other[5] = 0;
    assert_eq!(pool.match_prefix(&other, 8).len(), 1);
    // max_blocks caps the match; a different first block matches nothing.
    assert_eq!(pool.match_prefix(&prompt, 1).len(), 1);
    assert_eq!(pool.match_prefix(&[9, 9, 9, 9], 8).len(), 0);
    let m = pool.match_prefix(&prompt, 8);
    assert_eq!(m.num_unreferenced(), 2);
    let c = pool.acquire_prefix(m);
    assert_eq!(pool.num_free(), 6);
    pool.check_invariants([&c]).unwrap();
    pool.free(c);
}

#[test]
fn same_position_tokens_under_different_prefixes_do_not_match() {
    let mut pool = BlockPool::new(8, 2).unwrap();
    let a = computed(&mut pool, &[1, 2, 3, 4]);
    // Block 1 holds [3, 4] after [1, 2]; after [5, 6] it is different KV.
    assert_eq!(pool.match_prefix(&[5, 6, 3, 4], 2).len(), 0);
    let b = computed(&mut pool, &[5, 6, 3, 4]);
    assert_eq!(pool.match_prefix(&[5, 6, 3, 4], 2).blocks(), b.blocks());
    assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 2).blocks(), a.blocks());
    pool.free(a);
    pool.free(b);
}

#[test]
fn duplicate_content_keeps_the_chain_going() {
    let mut pool = BlockPool::new(8, 4).unwrap();
    let short: Vec<u32> = (0..8).collect();
    let long: Vec<u32> = (0..12).collect();
    let a = computed(&mut pool, &short);
    // Computed without a cache lookup (as when both are admitted in one step): its first two
    // blocks duplicate a's, its third chains onto a's second.
    let b = computed(&mut pool, &long);
    assert_eq!(pool.num_cached(), 3);
    let m = pool.match_prefix(&long, 3);
    assert_eq!(m.blocks(), &[a.blocks()[0], a.blocks()[1], b.blocks()[2]]);
    pool.free(a);
    pool.free(b);
    assert!(pool.is_fully_free());
    pool.check_invariants([]).unwrap();
}

#[test]
fn lru_evicts_oldest_release_and_tail_first() {
    let mut pool = BlockPool::new(4, 2).unwrap();
    let a = computed(&mut pool, &[1, 2, 3, 4]);
    let b = computed(&mut pool, &[5, 6, 7, 8]);
    let (a0, a1) = (a.blocks()[0], a.blocks()[1]);
    pool.free(a);
    pool.free(b);
    assert_eq!(pool.num_evictable(), 4);
    let mut t = BlockTable::new();
    pool.grow(&mut t, 2).unwrap();
    assert_eq!(t.blocks(), &[a1], "a's tail was released first");
    assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 2).blocks(), &[a0]);
    pool.grow(&mut t, 4).unwrap();
    assert_eq!(t.blocks(), &[a1, a0]);
    assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 2).len(), 0);
    assert_eq!(pool.match_prefix(&[5, 6, 7, 8], 2).len(), 2);
    pool.check_invariants([&t]).unwrap();
    pool.free(t);
}

#[test]
fn a_hit_protects_blocks_from_eviction() {
    let mut pool = BlockPool::new(3, 2).unwrap();
    let a = computed(&mut pool, &[1, 2, 3, 4]);
    pool.free(a);
    let m = pool.match_prefix(&[1, 2, 3, 4], 2);
    let hit = pool.acquire_prefix(m);
    let mut t = BlockTable::new();
    pool.grow(&mut t, 2).unwrap();
    assert!(
        pool.grow(&mut t, 4).is_err(),
        "hit blocks are referenced, not evictable"
    );
    pool.check_invariants([&hit, &t]).unwrap();
    pool.free(hit);
    pool.free(t);
}

#[test]
fn fork_and_copy_on_write() {
    let mut pool = BlockPool::new(8, 4).unwrap();
    let mut kv = KvSim::new(8, 4);
    let tokens: Vec<u32> = (0..6).collect();
    let mut parent = computed(&mut pool, &tokens);
    kv.write(parent.blocks(), &tokens, 0, 6);
    let mut child = pool.fork(&parent);
    assert_eq!(pool.ref_count(parent.blocks()[1]), 2);
    assert_eq!(
        pool.blocks_needed(&child, 6, 1),
        1,
        "one copy of the shared partial block"
    );

    let mut ct = tokens.clone();
    ct.push(100);
    let copies = pool.prepare_write(&mut child, 6, 1).unwrap();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].src, parent.blocks()[1]);
    assert_eq!(child.blocks()[1], copies[0].dst);
    assert_eq!(
        child.blocks()[0],
        parent.blocks()[0],
        "full blocks stay shared"
    );
    kv.copy(&copies);
    kv.write(child.blocks(), &ct, 6, 7);

    let mut pt = tokens.clone();
    pt.push(200);
    assert!(
        pool.prepare_write(&mut parent, 6, 1).unwrap().is_empty(),
        "sole owner writes in place"
    );
    kv.write(parent.blocks(), &pt, 6, 7);
    kv.verify(parent.blocks(), &pt, 7).unwrap();
    kv.verify(child.blocks(), &ct, 7).unwrap();
    pool.check_invariants([&parent, &child]).unwrap();
    pool.free(parent);
    pool.free(child);
    assert!(pool.is_fully_free());
}

#[test]
fn cow_is_all_or_nothing_when_full() {
    let mut pool = BlockPool::new(2, 4).unwrap();
    let mut parent = BlockTable::new();
    pool.grow(&mut parent, 6).unwrap();
    let mut child = pool.fork(&parent);
    let before = child.blocks().to_vec();
    assert!(pool.prepare_write(&mut child, 6, 1).is_err());
    assert_eq!(child.blocks(), &before[..]);
    pool.check_invariants([&parent, &child]).unwrap();
    pool.free(child);
    assert!(pool.prepare_write(&mut parent, 6, 1).unwrap().is_empty());
    pool.free(parent);
}

#[test]
fn registered_blocks_are_never_written_in_place() {
    let mut pool = BlockPool::new(4, 2).unwrap();
    let mut t = computed(&mut pool, &[1, 2]);
    let cached = t.blocks()[0];
    let copies = pool.prepare_write(&mut t, 1, 1).unwrap();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].src, cached);
    assert_eq!(
        pool.match_prefix(&[1, 2], 1).blocks(),
        &[cached],
        "entry intact"
    );
    pool.check_invariants([&t]).unwrap();
    pool.free(t);
}

/// A hash where everything collides with something.
fn terrible_hash(_parent: u64, tokens: &[u32]) -> u64 {
    u64::from(tokens[0] % 3)
}

#[test]
fn collisions_never_return_wrong_blocks() {
    let mut pool = BlockPool::with_hasher(16, 2, terrible_hash).unwrap();
    let a = computed(&mut pool, &[1, 2, 3, 4]);
    // Same hashes, different tokens or different parent: no hit.
    assert_eq!(pool.match_prefix(&[4, 2, 3, 4], 2).len(), 0);
    assert_eq!(pool.match_prefix(&[1, 2, 6, 4], 2).len(), 1);
    assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 2).blocks(), a.blocks());
    pool.free(a);
    // A differing entry that is unreferenced gives way to the newer content.
    let b = computed(&mut pool, &[4, 2]);
    assert_eq!(pool.match_prefix(&[4, 2], 1).blocks(), b.blocks());
    assert_eq!(pool.match_prefix(&[1, 2, 3, 4], 2).len(), 0);
    // A differing entry that is referenced stops registration but never corrupts.
    let c = computed(&mut pool, &[7, 7]);
    assert_eq!(pool.match_prefix(&[7, 7], 1).len(), 0);
    assert_eq!(pool.match_prefix(&[4, 2], 1).blocks(), b.blocks());
    pool.check_invariants([&b, &c]).unwrap();
    pool.free(b);
    pool.free(c);
    assert!(pool.is_fully_free());
}

#[test]
fn hash_of_pool_matches_public_hash() {
    let mut pool = BlockPool::new(4, 2).unwrap();
    let t = computed(&mut pool, &[1, 2]);
    // The public hash function is the one the cache indexes by.
    let h = block_hash(super::ROOT_HASH, &[1, 2]);
    assert_eq!(super::prefix_block_hashes(&[1, 2, 3], 2), vec![h]);
    pool.free(t);
}

/// One live sequence of the random workload.
struct Seq {
    table: BlockTable,
    tokens: Vec<u32>,
    computed: usize,
}

struct Workload {
    rng: SmallRng,
    pool: BlockPool,
    kv: KvSim,
    seqs: Vec<Seq>,
    caching: bool,
    prefixes: Vec<Vec<u32>>,
}

impl Workload {
    fn new(seed: u64, pool: BlockPool, caching: bool) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let bs = pool.block_size();
        let prefixes = (0..4)
            .map(|_| {
                let len = rng.random_range(1..4 * bs);
                (0..len).map(|_| rng.random_range(0..6)).collect()
            })
            .collect();
        let kv = KvSim::new(pool.num_blocks(), bs);
        Workload {
            rng,
            pool,
            kv,
            seqs: Vec::new(),
            caching,
            prefixes,
        }
    }

    /// Computes positions `computed .. computed + k` of `seq`, if the pool allows.
    fn compute(&mut self, mut seq: Seq, k: usize) -> Option<Seq> {
        let start = seq.computed;
        let Ok(copies) = self.pool.prepare_write(&mut seq.table, start, k) else {
            return Some(seq);
        };
        self.kv.copy(&copies);
        self.kv
            .write(seq.table.blocks(), &seq.tokens, start, start + k);
        seq.computed += k;
        if self.caching {
            self.pool
                .register_computed(&mut seq.table, &seq.tokens, seq.computed);
        }
        Some(seq)
    }

    /// Admits (or re-admits after preemption) a sequence with these tokens.
    fn admit(&mut self, tokens: Vec<u32>) {
        let bs = self.pool.block_size();
        let (table, computed) = if self.caching {
            let m = self.pool.match_prefix(&tokens, (tokens.len() - 1) / bs);
            let t = self.pool.acquire_prefix(m);
            let c = t.len() * bs;
            (t, c)
        } else {
            (BlockTable::new(), 0)
        };
        let k = self.rng.random_range(1..=tokens.len() - computed);
        let seq = Seq {
            table,
            tokens,
            computed,
        };
        if let Some(seq) = self.compute(seq, k) {
            if seq.computed == computed && computed == 0 {
                // Nothing computed and nothing held: the admission failed.
                self.pool.free(seq.table);
            } else {
                self.seqs.push(seq);
            }
        }
    }

    fn step(&mut self) {
        let op = self.rng.random_range(0..100);
        let n = self.seqs.len();
        match op {
            0..30 => {
                let p = self.rng.random_range(0..self.prefixes.len());
                let mut tokens = self.prefixes[p].clone();
                let extra = self.rng.random_range(0..6);
                tokens.extend((0..extra).map(|_| self.rng.random_range(0..6)));
                self.admit(tokens);
            }
            30..60 if n > 0 => {
                // Grow: continue a prefill, or decode one new token.
                let i = self.rng.random_range(0..n);
                let seq = self.seqs.swap_remove(i);
                let mut seq = seq;
                if seq.computed == seq.tokens.len() {
                    seq.tokens.push(self.rng.random_range(0..6));
                }
                let k = self.rng.random_range(1..=seq.tokens.len() - seq.computed);
                if let Some(seq) = self.compute(seq, k) {
                    self.seqs.push(seq);
                }
            }
            60..72 if n > 0 => {
                let i = self.rng.random_range(0..n);
                let table = self.pool.fork(&self.seqs[i].table);
                let s = &self.seqs[i];
                let child = Seq {
                    table,
                    tokens: s.tokens.clone(),
                    computed: s.computed,
                };
                self.seqs.push(child);
            }
            72..88 if n > 0 => {
                // Finish or abort: both just give the blocks back.
                let i = self.rng.random_range(0..n);
                let seq = self.seqs.swap_remove(i);
                self.pool.free(seq.table);
            }
            88..100 if n > 0 => {
                // Preempt by recompute: drop the KV, re-admit with every token so far.
                let i = self.rng.random_range(0..n);
                let seq = self.seqs.swap_remove(i);
                self.pool.free(seq.table);
                let mut tokens = seq.tokens;
                if tokens.len() == seq.computed {
                    tokens.push(self.rng.random_range(0..6));
                }
                self.admit(tokens);
            }
            _ => {}
        }
    }

    fn check(&self) {
        self.pool
            .check_invariants(self.seqs.iter().map(|s| &s.table))
            .unwrap();
        for s in &self.seqs {
            self.kv
                .verify(s.table.blocks(), &s.tokens, s.computed)
                .unwrap();
        }
    }

    fn finish_all(mut self) {
        for s in std::mem::take(&mut self.seqs) {
            self.pool.free(s.table);
        }
        self.pool.check_invariants([]).unwrap();
        assert!(self.pool.is_fully_free(), "blocks leaked");
    }
}

fn run_workload(seed: u64, pool: BlockPool, caching: bool, steps: usize) {
    let mut w = Workload::new(seed, pool, caching);
    let mut peak_cached = 0;
    for _ in 0..steps {
        w.step();
        w.check();
        peak_cached = peak_cached.max(w.pool.num_cached());
        // Keep the population bounded so the pool keeps cycling.
        if w.seqs.len() > 12 {
            let s = w.seqs.swap_remove(0);
            w.pool.free(s.table);
        }
    }
    if caching {
        assert!(
            peak_cached > 0,
            "the workload never exercised the prefix cache"
        );
    }
    w.finish_all();
}

#[test]
fn random_workload_with_prefix_caching() {
    for seed in 0..5 {
        run_workload(seed, BlockPool::new(24, 4).unwrap(), true, 12_000);
    }
}

#[test]
fn random_workload_without_prefix_caching() {
    run_workload(100, BlockPool::new(24, 4).unwrap(), false, 10_000);
}

#[test]
fn random_workload_with_colliding_hashes() {
    run_workload(
        200,
        BlockPool::with_hasher(24, 2, terrible_hash).unwrap(),
        true,
        20_000,
    );
}

#[test]
fn block_ids_stay_in_range() {
    let mut pool = BlockPool::new(3, 1).unwrap();
    let mut t = BlockTable::new();
    pool.grow(&mut t, 3).unwrap();
    assert!(t.blocks().iter().all(|b| b.index() < 3));
    assert_eq!(pool.ref_count(BlockId(99)), 0);
    pool.free(t);
}
