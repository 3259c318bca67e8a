//! Stable 64-bit content hashes of full KV blocks, chained through their parents.
//!
//! The hash of block `i` of a token sequence covers that block's token ids and the hash of block
//! `i - 1` (block 0 chains to [`ROOT_HASH`]), so equal hashes mean (up to collisions) equal whole
//! prefixes. The function is FNV-1a over little-endian bytes followed by a 64-bit avalanche
//! finalizer; it is written out here, not taken from `std`, so the values are identical across
//! Rust versions, processes and machines (a router may compare hashes computed elsewhere).
//! Hashes only *find* candidates: the pool always compares the stored tokens and the parent
//! before reusing a block, so a collision can never hand out wrong KV.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The parent hash of a sequence's first block.
pub const ROOT_HASH: u64 = 0x7461_6e64_656d_6b76; // "tandemkv"

/// FNV-1a, 64-bit, of `bytes` continued from `state`.
fn fnv1a64_from(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

// The avalanche finalizer (MurmurHash3's `fmix64`): every input bit affects every output bit,
// which FNV alone does poorly for the last bytes.
use tandem_kernels::cpu::fmix64;

/// Hash of one full block with token ids `tokens` whose preceding block hashed to `parent`
/// ([`ROOT_HASH`] for the first block).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut state = fnv1a64_from(FNV_OFFSET, &parent.to_le_bytes());
    state = fnv1a64_from(state, &(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        state = fnv1a64_from(state, &t.to_le_bytes());
    }
    fmix64(state)
}

/// Chained hashes of every *full* block of `tokens` split into blocks of `block_size`
/// (a trailing partial block has no hash). Empty when `block_size` is 0.
pub fn prefix_block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = ROOT_HASH;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = block_hash(parent, block);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_matches_published_vectors() {
        // Test vectors from the FNV reference (Fowler/Noll/Vo): FNV-1a 64.
        assert_eq!(fnv1a64_from(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64_from(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64_from(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn fmix_is_a_bijection_on_samples() {
        let mut outs: Vec<u64> = (0..10_000u64).map(fmix64).collect();
        outs.sort_unstable();
        outs.dedup();
        assert_eq!(outs.len(), 10_000);
    }

    #[test]
    fn chaining_distinguishes_parents_and_order() {
        let a = block_hash(ROOT_HASH, &[1, 2, 3, 4]);
        assert_ne!(a, block_hash(ROOT_HASH, &[4, 3, 2, 1]));
        assert_ne!(
            block_hash(a, &[5, 6, 7, 8]),
            block_hash(ROOT_HASH, &[5, 6, 7, 8])
        );
        assert_eq!(a, block_hash(ROOT_HASH, &[1, 2, 3, 4]));
    }

    #[test]
    fn prefix_hashes_cover_full_blocks_only() {
        let toks: Vec<u32> = (0..10).collect();
        let hs = prefix_block_hashes(&toks, 4);
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0], block_hash(ROOT_HASH, &toks[0..4]));
        assert_eq!(hs[1], block_hash(hs[0], &toks[4..8]));
        // A shared prefix gives shared leading hashes.
        let mut other = toks.clone();
        other[6] = 99;
        let hs2 = prefix_block_hashes(&other, 4);
        assert_eq!(hs2[0], hs[0]);
        assert_ne!(hs2[1], hs[1]);
        assert!(prefix_block_hashes(&toks, 0).is_empty());
    }

    #[test]
    fn no_collisions_among_many_small_blocks() {
        let mut seen = std::collections::HashSet::new();
        for a in 0..64u32 {
            for b in 0..64u32 {
                for c in 0..8u32 {
                    assert!(seen.insert(block_hash(ROOT_HASH, &[a, b, c])));
                }
            }
        }
    }
}
