//! Paged KV cache bookkeeping: block ids, the reference-counted block pool with prefix caching
//! and copy-on-write forks, and the storage layout. No tensor memory lives here.
//!
//! # Storage layout (implemented by the model backend)
//!
//! The backend owns, **per layer**, one contiguous buffer shaped
//! `[num_blocks][2][num_kv_heads][block_size][head_dim]`: for each block, first the keys then the
//! values, each as `[num_kv_heads][block_size][head_dim]`. One layer's block of one sequence is
//! therefore one contiguous slice of [`KvLayout::block_elems`] elements at
//! [`KvLayout::block_offset`], so a block received from another node is written straight into
//! place by its [`BlockId`]. Token position `p` of a sequence with block table `t` lives in slot
//! `p % block_size` of block `t[p / block_size]` ([`KvLayout::locate`]).
//!
//! # Invariants kept by this module
//!
//! - Every block is exactly one of free, referenced, or evictable (cached but unreferenced).
//! - A block's reference count equals the number of [`BlockTable`] entries naming it.
//! - Only computed blocks are registered in the prefix cache, and a cache hit is verified
//!   against the stored tokens and the exact parent entry, so hash collisions never yield wrong KV.
//! - A shared or cached block is never written in place: writers get a copy ([`BlockCopy`]).

mod block;
mod hash;
mod layout;
mod pool;
mod prefix_cache;
mod table;

#[cfg(test)]
mod pool_tests;
#[cfg(test)]
pub(crate) mod sim;

pub use block::{BlockCopy, BlockId};
pub use hash::{ROOT_HASH, block_hash, prefix_block_hashes};
pub use layout::KvLayout;
pub use pool::{BlockPool, DEFAULT_BLOCK_SIZE, PrefixMatch};
pub use table::BlockTable;
