//! Test-only stand-in for the KV storage: each slot records a fingerprint of the token prefix
//! whose KV it holds, so tests can prove that every sequence reads exactly its own prefix's KV
//! through its block table (prefix hits, forks and copies included).

use super::{BlockCopy, BlockId, block_hash};

/// Fingerprint of `tokens[..=p]` for every `p`.
pub(crate) fn fingerprints(tokens: &[u32]) -> Vec<u64> {
    let mut f = 0x5eed_u64;
    tokens
        .iter()
        .map(|&t| {
            f = block_hash(f, &[t]);
            f
        })
        .collect()
}

/// Simulated KV storage: one fingerprint per (block, slot).
#[derive(Debug)]
pub(crate) struct KvSim {
    block_size: usize,
    slots: Vec<Option<u64>>,
}

impl KvSim {
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Self {
        KvSim {
            block_size,
            slots: vec![None; num_blocks * block_size],
        }
    }

    fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        table[pos / self.block_size].index() * self.block_size + pos % self.block_size
    }

    /// Performs the copies (whole blocks), as the engine does before a forward pass.
    pub(crate) fn copy(&mut self, copies: &[BlockCopy]) {
        let bs = self.block_size;
        for c in copies {
            let src = c.src.index() * bs;
            let dst = c.dst.index() * bs;
            let block: Vec<Option<u64>> = self.slots[src..src + bs].to_vec();
            self.slots[dst..dst + bs].copy_from_slice(&block);
        }
    }

    /// Writes the KV of positions `start..end` of `tokens` through `table`.
    pub(crate) fn write(&mut self, table: &[BlockId], tokens: &[u32], start: usize, end: usize) {
        let fp = fingerprints(&tokens[..end]);
        for (p, &f) in fp.iter().enumerate().skip(start) {
            let s = self.slot(table, p);
            self.slots[s] = Some(f);
        }
    }

    /// Checks that positions `0..end` of `tokens` read back their own KV through `table`.
    pub(crate) fn verify(
        &self,
        table: &[BlockId],
        tokens: &[u32],
        end: usize,
    ) -> Result<(), String> {
        if table.len() * self.block_size < end {
            return Err(format!(
                "table of {} blocks cannot cover {end} positions",
                table.len()
            ));
        }
        let fp = fingerprints(&tokens[..end]);
        for (p, &f) in fp.iter().enumerate() {
            if self.slots[self.slot(table, p)] != Some(f) {
                return Err(format!("position {p} reads wrong KV (table {table:?})"));
            }
        }
        Ok(())
    }
}
