//! The block pool: reference-counted KV blocks, copy-on-write forks, and the prefix cache with
//! LRU eviction.
//!
//! Every block is in exactly one state:
//! - **free**: reference count 0, not registered in the prefix cache (in `free`);
//! - **referenced**: reference count ≥ 1 (held by that many [`BlockTable`]s), maybe registered;
//! - **evictable**: reference count 0 but registered in the prefix cache (in `lru`, oldest
//!   release first); reused as-is on a cache hit, or evicted when a fresh block is needed.
//!
//! Reference counts always equal the number of table entries naming the block; a block is never
//! released twice (a misuse is recorded and reported by [`BlockPool::check_invariants`]).
//! Only blocks whose KV has been computed are registered ([`BlockPool::register_computed`]), and
//! a registered or shared block is never handed out for writing: [`BlockPool::prepare_write`]
//! copies it to a fresh block first.

use std::collections::BTreeMap;

use super::prefix_cache::{Link, PrefixCache, Probe};
use super::table::{BlockTable, CacheChain};
use super::{BlockCopy, BlockId};
use crate::{Error, Result};

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Fixed-size pool of KV blocks with reference counts and a prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Free blocks; allocation pops from the end.
    free: Vec<BlockId>,
    /// Evictable blocks keyed by release stamp (oldest first).
    lru: BTreeMap<u64, BlockId>,
    /// For each block, its key in `lru` while it is evictable.
    lru_key: Vec<Option<u64>>,
    cache: PrefixCache,
    tick: u64,
    /// First misuse seen (a release of an unreferenced block).
    fault: Option<String>,
}

/// A chain of cached blocks matching a prompt's leading full blocks, found by
/// [`BlockPool::match_prefix`] and taken with [`BlockPool::acquire_prefix`].
#[derive(Debug)]
pub struct PrefixMatch {
    blocks: Vec<BlockId>,
    links: Vec<Link>,
    unreferenced: usize,
}

impl PrefixMatch {
    /// Matched blocks, in position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of matched blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing matched.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Matched blocks that are currently evictable: acquiring them lowers
    /// [`BlockPool::num_free`] by this much.
    pub fn num_unreferenced(&self) -> usize {
        self.unreferenced
    }
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` token slots each.
    ///
    /// Errors with [`Error::InvalidKvConfig`] when either is 0 or `num_blocks` exceeds `u32::MAX`.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 {
            return Err(Error::InvalidKvConfig(format!(
                "the KV pool needs at least one block of at least one slot \
                 (got {num_blocks} blocks of {block_size})"
            )));
        }
        if u32::try_from(num_blocks).is_err() {
            return Err(Error::InvalidKvConfig(format!(
                "{num_blocks} KV blocks is too many"
            )));
        }
        Ok(BlockPool {
            block_size,
            ref_counts: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            lru: BTreeMap::new(),
            lru_key: vec![None; num_blocks],
            cache: PrefixCache::new(num_blocks),
            tick: 0,
            fault: None,
        })
    }

    /// A pool whose prefix cache uses `hasher` instead of [`super::block_hash`]; tests use
    /// deliberately colliding hashers to prove collisions never yield wrong KV.
    #[cfg(test)]
    pub(crate) fn with_hasher(
        num_blocks: usize,
        block_size: usize,
        hasher: super::prefix_cache::HashFn,
    ) -> Result<Self> {
        let mut pool = Self::new(num_blocks, block_size)?;
        pool.cache = PrefixCache::with_hasher(num_blocks, hasher);
        Ok(pool)
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks available for allocation: free plus evictable.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Evictable blocks (unreferenced but still cached).
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    /// Blocks registered in the prefix cache (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    /// True when no block is referenced (every block free or evictable).
    pub fn is_fully_free(&self) -> bool {
        self.num_free() == self.num_blocks()
    }

    /// Current reference count of `block` (0 for an id outside the pool).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts.get(block.index()).copied().unwrap_or(0)
    }

    /// Blocks needed to hold `num_tokens` tokens, `ceil(num_tokens / block_size)`.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Longest chain of cached blocks equal to the leading full blocks of `tokens`, at most
    /// `max_blocks` long. Pure lookup: nothing is referenced until [`Self::acquire_prefix`].
    pub fn match_prefix(&self, tokens: &[u32], max_blocks: usize) -> PrefixMatch {
        let mut m = PrefixMatch {
            blocks: Vec::new(),
            links: Vec::new(),
            unreferenced: 0,
        };
        let mut parent = Link::ROOT;
        for block_tokens in tokens.chunks_exact(self.block_size).take(max_blocks) {
            match self.cache.probe(parent, block_tokens) {
                Probe::Same(block, link) => {
                    m.blocks.push(block);
                    m.links.push(link);
                    parent = link;
                    if self.ref_counts[block.index()] == 0 {
                        m.unreferenced += 1;
                    }
                }
                Probe::Vacant | Probe::Conflict(_) => break,
            }
        }
        m
    }

    /// Takes a reference on every block of a match and returns a table holding them. The match
    /// is re-validated, so a match made stale by intervening pool operations only shrinks.
    pub fn acquire_prefix(&mut self, m: PrefixMatch) -> BlockTable {
        let mut table = BlockTable::new();
        let mut link = Link::ROOT;
        for (block, expected) in m.blocks.into_iter().zip(m.links) {
            if self.cache.link_of(block) != Some(expected) {
                break;
            }
            self.take_ref(block);
            table.blocks.push(block);
            link = expected;
        }
        table.chain = CacheChain {
            processed: table.blocks.len(),
            link,
            broken: false,
        };
        table
    }

    /// Fresh blocks (and copies) that [`Self::prepare_write`] would need to let `table` write
    /// token positions `start_pos .. start_pos + num_tokens`.
    pub fn blocks_needed(&self, table: &BlockTable, start_pos: usize, num_tokens: usize) -> usize {
        let end_blocks = self.blocks_for(start_pos + num_tokens);
        let grow = end_blocks.saturating_sub(table.blocks.len());
        let copies = self
            .written_existing(table, start_pos, num_tokens)
            .filter(|&i| self.must_copy(table.blocks[i]))
            .count();
        grow + copies
    }

    /// Makes `table` writable for positions `start_pos .. start_pos + num_tokens`: appends fresh
    /// blocks to cover them and replaces every written block that is shared or cached by a fresh
    /// copy, returning the copies the engine must perform before the forward pass.
    /// All or nothing: errors with [`Error::KvPoolFull`] (and changes nothing) when the pool has
    /// too few free blocks.
    pub fn prepare_write(
        &mut self,
        table: &mut BlockTable,
        start_pos: usize,
        num_tokens: usize,
    ) -> Result<Vec<BlockCopy>> {
        let needed = self.blocks_needed(table, start_pos, num_tokens);
        if needed > self.num_free() {
            return Err(Error::KvPoolFull {
                needed,
                free: self.num_free(),
            });
        }
        let mut copies = Vec::new();
        for i in self.written_existing(table, start_pos, num_tokens) {
            let src = table.blocks[i];
            if self.must_copy(src) {
                let dst = self.take_free().expect("checked: enough free blocks");
                self.release(src);
                table.blocks[i] = dst;
                copies.push(BlockCopy { src, dst });
            }
        }
        while table.blocks.len() < self.blocks_for(start_pos + num_tokens) {
            let b = self.take_free().expect("checked: enough free blocks");
            table.blocks.push(b);
        }
        Ok(copies)
    }

    /// Appends fresh blocks until `table` covers `num_tokens` positions (no copies). All or
    /// nothing; errors with [`Error::KvPoolFull`].
    pub fn grow(&mut self, table: &mut BlockTable, num_tokens: usize) -> Result<()> {
        let needed = self
            .blocks_for(num_tokens)
            .saturating_sub(table.blocks.len());
        if needed > self.num_free() {
            return Err(Error::KvPoolFull {
                needed,
                free: self.num_free(),
            });
        }
        for _ in 0..needed {
            let b = self.take_free().expect("checked: enough free blocks");
            table.blocks.push(b);
        }
        Ok(())
    }

    /// A second table sharing every block of `table` (each reference count +1). Either table
    /// later writing into a shared block gets a private copy from [`Self::prepare_write`].
    pub fn fork(&mut self, table: &BlockTable) -> BlockTable {
        for &b in &table.blocks {
            self.take_ref(b);
        }
        BlockTable {
            blocks: table.blocks.clone(),
            chain: table.chain,
        }
    }

    /// Returns a table's references. Blocks reaching reference count 0 become evictable when
    /// cached, free otherwise; the tail is released first so a prompt's head stays cached longest.
    pub fn free(&mut self, table: BlockTable) {
        for &b in table.blocks.iter().rev() {
            self.release(b);
        }
    }

    /// Offers `table`'s full blocks within the first `num_computed` positions of `tokens` to the
    /// prefix cache; call once their KV is computed (or will be by the step being scheduled).
    /// Blocks whose content is already cached elsewhere stay private; a differing unreferenced
    /// entry with the same hash is evicted; a differing referenced one stops registration for
    /// this table.
    pub fn register_computed(
        &mut self,
        table: &mut BlockTable,
        tokens: &[u32],
        num_computed: usize,
    ) {
        let full = (num_computed.min(tokens.len()) / self.block_size).min(table.blocks.len());
        while !table.chain.broken && table.chain.processed < full {
            let i = table.chain.processed;
            let block = table.blocks[i];
            let block_tokens = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let parent = table.chain.link;
            let link = match self.cache.probe(parent, block_tokens) {
                Probe::Same(_, link) => link,
                Probe::Conflict(other) if self.ref_counts[other.index()] == 0 => {
                    self.evict(other);
                    self.free.push(other);
                    self.register_block(block, parent, block_tokens)
                }
                Probe::Conflict(_) => {
                    table.chain.broken = true;
                    break;
                }
                Probe::Vacant => self.register_block(block, parent, block_tokens),
            };
            table.chain.link = link;
            table.chain.processed = i + 1;
        }
    }

    /// Checks every pool invariant against the complete set of live tables: each block is
    /// exactly one of free / referenced / evictable, reference counts equal table references,
    /// no block was released twice, the cache index is consistent.
    pub fn check_invariants<'a>(
        &self,
        tables: impl IntoIterator<Item = &'a BlockTable>,
    ) -> std::result::Result<(), String> {
        if let Some(f) = &self.fault {
            return Err(f.clone());
        }
        let n = self.num_blocks();
        let mut refs = vec![0u32; n];
        for t in tables {
            if t.chain.processed > t.blocks.len() {
                return Err("table's cache chain runs past its blocks".into());
            }
            for b in &t.blocks {
                *refs
                    .get_mut(b.index())
                    .ok_or_else(|| format!("table names block {b} outside the pool"))? += 1;
            }
        }
        let mut in_free = vec![false; n];
        for b in &self.free {
            if std::mem::replace(&mut in_free[b.index()], true) {
                return Err(format!("block {b} is on the free list twice"));
            }
        }
        let mut in_lru = vec![false; n];
        for (&key, b) in &self.lru {
            in_lru[b.index()] = true;
            if self.lru_key[b.index()] != Some(key) {
                return Err(format!("block {b} has a stale LRU key"));
            }
        }
        if self.lru_key.iter().filter(|k| k.is_some()).count() != self.lru.len() {
            return Err("LRU keys and LRU order disagree".into());
        }
        for i in 0..n {
            let b = BlockId(i as u32);
            if self.ref_counts[i] != refs[i] {
                return Err(format!(
                    "block {b}: ref count {} but {} table references",
                    self.ref_counts[i], refs[i]
                ));
            }
            let cached = self.cache.is_cached(b);
            let state = (refs[i] > 0, in_free[i], in_lru[i]);
            let ok = match state {
                (true, false, false) => true,
                (false, true, false) => !cached,
                (false, false, true) => cached,
                _ => false,
            };
            if !ok {
                return Err(format!(
                    "block {b} is not in exactly one state (refs {}, free {}, evictable {}, cached {cached})",
                    refs[i], in_free[i], in_lru[i]
                ));
            }
        }
        self.cache.check()
    }

    /// Indices of `table`'s existing blocks that positions `start_pos .. start_pos+num_tokens` touch.
    fn written_existing(
        &self,
        table: &BlockTable,
        start_pos: usize,
        num_tokens: usize,
    ) -> std::ops::Range<usize> {
        let first = start_pos / self.block_size;
        if num_tokens == 0 {
            return first..first;
        }
        let end = self
            .blocks_for(start_pos + num_tokens)
            .min(table.blocks.len());
        first..end.max(first)
    }

    /// A block someone else may read must not be written in place.
    fn must_copy(&self, block: BlockId) -> bool {
        self.ref_counts[block.index()] > 1 || self.cache.is_cached(block)
    }

    fn register_block(&mut self, block: BlockId, parent: Link, tokens: &[u32]) -> Link {
        // A block can be registered only once; a stale entry of its own would be a bug, so
        // drop it first rather than leave two hashes pointing at one block.
        self.cache.remove(block);
        self.cache.insert(block, parent, tokens)
    }

    /// Adds a reference, pulling the block off the LRU list if it was evictable.
    fn take_ref(&mut self, block: BlockId) {
        let i = block.index();
        if self.ref_counts[i] == 0 {
            if let Some(key) = self.lru_key[i].take() {
                self.lru.remove(&key);
            } else if let Some(pos) = self.free.iter().position(|&b| b == block) {
                self.free.swap_remove(pos);
            }
        }
        self.ref_counts[i] += 1;
    }

    /// A block with reference count 1: a free one, else the least recently released evictable
    /// one (its cache entry dropped).
    fn take_free(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                self.lru_key[b.index()] = None;
                self.cache.remove(b);
                b
            }
        };
        self.ref_counts[block.index()] = 1;
        Some(block)
    }

    /// Removes an evictable block from the LRU list and the cache (it becomes uncached).
    fn evict(&mut self, block: BlockId) {
        if let Some(key) = self.lru_key[block.index()].take() {
            self.lru.remove(&key);
        }
        self.cache.remove(block);
    }

    fn release(&mut self, block: BlockId) {
        let i = block.index();
        if self.ref_counts[i] == 0 {
            self.fault
                .get_or_insert_with(|| format!("block {block} released twice"));
            return;
        }
        self.ref_counts[i] -= 1;
        if self.ref_counts[i] == 0 {
            if self.cache.is_cached(block) {
                self.tick += 1;
                self.lru.insert(self.tick, block);
                self.lru_key[i] = Some(self.tick);
            } else {
                self.free.push(block);
            }
        }
    }
}
