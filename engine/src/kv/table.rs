//! A sequence's block table: the ordered blocks that hold its KV, plus how far its full blocks
//! have been offered to the prefix cache.
//!
//! A `BlockTable` is a resource handle: it holds one reference on each of its blocks, it is not
//! `Clone` (share it only through [`super::BlockPool::fork`]) and it must be returned with
//! [`super::BlockPool::free`]. Invariant: `chain.processed <= blocks.len()`; the first
//! `chain.processed` blocks have been registered in (or matched against) the prefix cache and
//! `chain.link` identifies the cache entry of the last of them.

use super::BlockId;
use super::prefix_cache::Link;

/// How far a table's full blocks have been registered in the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CacheChain {
    /// Leading blocks already matched or registered.
    pub(super) processed: usize,
    /// Identity of the cache entry for block `processed - 1` (the root link when 0).
    pub(super) link: Link,
    /// Registration stopped for good (a differing entry holds a hash this chain needs).
    pub(super) broken: bool,
}

impl CacheChain {
    pub(super) const fn root() -> Self {
        CacheChain {
            processed: 0,
            link: Link::ROOT,
            broken: false,
        }
    }
}

/// The blocks of one sequence, in position order: token position `p` lives in slot
/// `p % block_size` of `blocks()[p / block_size]`.
#[derive(Debug)]
pub struct BlockTable {
    pub(super) blocks: Vec<BlockId>,
    pub(super) chain: CacheChain,
}

impl Default for BlockTable {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockTable {
    /// An empty table (holds no blocks).
    pub fn new() -> Self {
        BlockTable {
            blocks: Vec::new(),
            chain: CacheChain::root(),
        }
    }

    /// The blocks, in position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when the table holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Leading full blocks already registered in (or taken from) the prefix cache.
    pub fn num_cache_processed(&self) -> usize {
        self.chain.processed
    }
}
