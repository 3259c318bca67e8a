//! The prefix cache index: which blocks hold the KV of which full-block token prefix.
//!
//! Entries are found by the chained content hash of [`super::hash`], but a hit is accepted only
//! when the entry's stored tokens equal the requested ones *and* its parent is exactly the entry
//! matched for the previous block. Parents are identified by a registration id that is unique for
//! the pool's lifetime and never reused, so an accepted chain of hits is exactly the requested
//! token prefix: a 64-bit hash collision can cost a cache miss, never wrong KV.
//!
//! Invariants: `by_hash[h] == b` iff `entries[b]` is `Some` with hash `h`; at most one entry per
//! hash; registration ids are unique. Reference counts and eviction order live in the pool.

use std::collections::HashMap;

use super::BlockId;
use super::hash::{ROOT_HASH, block_hash};

/// Identity of a registered block: its chained hash and its unique registration id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Link {
    pub(super) hash: u64,
    pub(super) reg: u64,
}

impl Link {
    /// The virtual parent of every first block.
    pub(super) const ROOT: Link = Link {
        hash: ROOT_HASH,
        reg: 0,
    };
}

/// What a registered block holds.
#[derive(Debug)]
struct Entry {
    hash: u64,
    parent_reg: u64,
    reg: u64,
    tokens: Box<[u32]>,
}

/// Result of looking up the block that would follow `parent` with some tokens.
pub(super) enum Probe {
    /// No entry has this hash.
    Vacant,
    /// An entry with exactly this content (tokens and parent) exists.
    Same(BlockId, Link),
    /// An entry with this hash but different content occupies the slot.
    Conflict(BlockId),
}

/// The chained block hash function (tests substitute deliberately weak ones).
pub(super) type HashFn = fn(u64, &[u32]) -> u64;

/// Hash-indexed registry of computed full blocks.
#[derive(Debug)]
pub(super) struct PrefixCache {
    by_hash: HashMap<u64, BlockId>,
    entries: Vec<Option<Entry>>,
    next_reg: u64,
    hasher: HashFn,
}

impl PrefixCache {
    pub(super) fn new(num_blocks: usize) -> Self {
        Self::with_hasher(num_blocks, block_hash)
    }

    pub(super) fn with_hasher(num_blocks: usize, hasher: HashFn) -> Self {
        PrefixCache {
            by_hash: HashMap::new(),
            entries: (0..num_blocks).map(|_| None).collect(),
            next_reg: 1,
            hasher,
        }
    }

    /// Number of registered blocks.
    pub(super) fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub(super) fn is_cached(&self, block: BlockId) -> bool {
        self.entries[block.index()].is_some()
    }

    /// Looks up the block holding `tokens` right after the entry `parent`.
    pub(super) fn probe(&self, parent: Link, tokens: &[u32]) -> Probe {
        let hash = (self.hasher)(parent.hash, tokens);
        let Some(&block) = self.by_hash.get(&hash) else {
            return Probe::Vacant;
        };
        match &self.entries[block.index()] {
            Some(e) if e.parent_reg == parent.reg && *e.tokens == *tokens => {
                Probe::Same(block, Link { hash, reg: e.reg })
            }
            _ => Probe::Conflict(block),
        }
    }

    /// The current link of a registered block, if it is registered.
    pub(super) fn link_of(&self, block: BlockId) -> Option<Link> {
        self.entries[block.index()].as_ref().map(|e| Link {
            hash: e.hash,
            reg: e.reg,
        })
    }

    /// Registers `block` as holding `tokens` after `parent`. The caller has probed `Vacant`.
    pub(super) fn insert(&mut self, block: BlockId, parent: Link, tokens: &[u32]) -> Link {
        let hash = (self.hasher)(parent.hash, tokens);
        let reg = self.next_reg;
        self.next_reg += 1;
        self.entries[block.index()] = Some(Entry {
            hash,
            parent_reg: parent.reg,
            reg,
            tokens: tokens.into(),
        });
        self.by_hash.insert(hash, block);
        Link { hash, reg }
    }

    /// Forgets `block`'s entry (eviction). No-op when it is not registered.
    pub(super) fn remove(&mut self, block: BlockId) {
        if let Some(e) = self.entries[block.index()].take() {
            self.by_hash.remove(&e.hash);
        }
    }

    /// Checks the index against the entries.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut registered = 0;
        for (i, e) in self.entries.iter().enumerate() {
            if let Some(e) = e {
                registered += 1;
                if self.by_hash.get(&e.hash) != Some(&BlockId(i as u32)) {
                    return Err(format!("cache entry of block {i} not indexed by its hash"));
                }
                if e.reg == 0 || e.reg >= self.next_reg || e.parent_reg >= e.reg {
                    return Err(format!("cache entry of block {i} has bad registration ids"));
                }
            }
        }
        if registered != self.by_hash.len() {
            return Err(format!(
                "cache index has {} hashes but {registered} entries",
                self.by_hash.len()
            ));
        }
        Ok(())
    }
}
