//! Block identifiers and the copy-on-write instruction the engine executes.
//!
//! A [`BlockId`] names one block of the KV pool in every layer at once; the pool hands them out and
//! takes them back, the model backend indexes its per-layer buffers with them (see the module doc
//! of [`crate::kv`] for the layout). Invariant: a `BlockId` produced by a pool is always
//! `< pool.num_blocks()`.

use std::fmt;

/// Index of one KV block (the same index in every layer's buffer).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index as a `usize`, for indexing buffers.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Copy the whole block `src` into `dst`, in every layer, keys and values, before the forward pass.
///
/// Emitted when a sequence must write into a block it shares with another sequence (its partially
/// filled last block after a fork): the writer gets the fresh block `dst` with a copy of `src`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockCopy {
    /// The shared block to read from.
    pub src: BlockId,
    /// The fresh block, now owned by the writing sequence, to write to.
    pub dst: BlockId,
}
