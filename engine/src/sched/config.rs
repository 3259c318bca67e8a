//! Scheduler settings and the node role they serve.
//!
//! Invariant: a [`SchedulerConfig`] accepted by [`SchedulerConfig::validate`] has every size ≥ 1
//! and a block count that fits a [`crate::kv::BlockId`].

use crate::kv::DEFAULT_BLOCK_SIZE;
use crate::{Error, Result};

/// What this engine does in a (possibly disaggregated) deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    /// Prefill and decode in one process, mixed in each step.
    #[default]
    Colocated,
    /// Prefill only: a sequence is never decoded; after its first sample the engine hands its
    /// blocks over with [`super::Scheduler::hold`] (or finishes it).
    Prefill,
    /// Decode node: requests normally arrive with their KV through
    /// [`super::Scheduler::allocate_remote`] / [`super::Scheduler::kv_ready`]; local prefill
    /// through [`super::Scheduler::add_request`] still works.
    Decode,
}

/// Scheduler settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// The node's role.
    pub role: Role,
    /// Tokens per KV block (default 16).
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Cap on running sequences; a request with `n > 1` counts `n` from admission on
    /// (default 256).
    pub max_num_seqs: usize,
    /// Tokens computed per step, all sequences together; prompts are chunked to fit
    /// (default 2048).
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: usize,
    /// Reuse the KV of identical prompt prefixes (default on).
    pub enable_prefix_caching: bool,
}

impl SchedulerConfig {
    /// Default [`Self::max_num_seqs`].
    pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
    /// Default [`Self::max_num_batched_tokens`].
    pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;

    /// A colocated config with the defaults for everything but the pool size and context limit.
    pub fn new(num_blocks: usize, max_model_len: usize) -> Self {
        SchedulerConfig {
            role: Role::Colocated,
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks,
            max_num_seqs: Self::DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens: Self::DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_model_len,
            enable_prefix_caching: true,
        }
    }

    /// Checks that the settings are usable; errors with [`Error::InvalidKvConfig`].
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (name, value) in fields {
            if value == 0 {
                return Err(Error::InvalidKvConfig(format!("{name} must be at least 1")));
            }
        }
        if u32::try_from(self.num_blocks).is_err() {
            return Err(Error::InvalidKvConfig(format!(
                "{} KV blocks is too many",
                self.num_blocks
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let c = SchedulerConfig::new(100, 4096);
        assert_eq!(c.block_size, 16);
        assert_eq!(c.max_num_seqs, 256);
        assert_eq!(c.max_num_batched_tokens, 2048);
        assert_eq!(c.role, Role::Colocated);
        assert!(c.enable_prefix_caching);
        c.validate().unwrap();
        for bad in [
            SchedulerConfig {
                block_size: 0,
                ..c.clone()
            },
            SchedulerConfig {
                num_blocks: 0,
                ..c.clone()
            },
            SchedulerConfig {
                max_num_seqs: 0,
                ..c.clone()
            },
            SchedulerConfig {
                max_num_batched_tokens: 0,
                ..c.clone()
            },
            SchedulerConfig {
                max_model_len: 0,
                ..c.clone()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidKvConfig(_))),
                "{bad:?}"
            );
        }
    }
}
