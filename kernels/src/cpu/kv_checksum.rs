//! The checksum of a KV transfer chunk: the host implementation, and the reference the device
//! kernel `kv_copy_blocks` (`kernels/cuda/kv_copy.cu`) is tested against bit for bit.
//!
//! A chunk's payload is its blocks concatenated in list order: `N` bytes (a multiple of 8) viewed
//! as little-endian `u64` words `w[0..N/8)`. With `fmix64` MurmurHash3's 64-bit finaliser,
//!
//! ```text
//! h_j      = fmix64(w[j] ^ (j * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D))   (wrapping)
//! checksum = (Σ_j h_j, wrapping) ^ N
//! ```
//!
//! `fmix64` is a bijection, so changing any one word always changes the checksum; the position `j`
//! in the mix catches swapped words and reordered blocks; the xor of `N` separates payloads of
//! different lengths. The sum does not depend on the order the terms are added in, which lets the
//! device add them up with warp reductions and atomics and stay deterministic.
//!
//! Invariant: [`kv_checksum_sum`] over consecutive pieces of a payload (each at its own first word
//! index) adds up to the sum over the whole payload, however the payload is cut at multiples of 8
//! bytes.

/// The multiplier of the word index in the key each word is mixed with (2^64 / golden ratio).
const WORD_MUL: u64 = 0x9E37_79B9_7F4A_7C15;
/// The constant added to the key, so word 0 is mixed with a non-zero key.
const WORD_ADD: u64 = 0x2545_F491_4F6C_DD1D;

/// MurmurHash3's 64-bit finaliser: a bijection on `u64` in which every input bit affects every
/// output bit (also the engine's block-hash finaliser).
pub fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x
}

/// The checksum of the payload made of `parts` concatenated in order (a chunk's blocks in list
/// order). Every part's length must be a multiple of 8 bytes (KV blocks are multiples of 16); a
/// part that is not is a caller bug and panics. The empty payload's checksum is 0.
pub fn kv_checksum<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let (mut sum, mut bytes) = (0u64, 0u64);
    for part in parts {
        sum = sum.wrapping_add(kv_checksum_sum(bytes / 8, part));
        bytes += part.len() as u64;
    }
    sum ^ bytes
}

/// The unfinished checksum of a piece of a payload: the wrapping sum of `h_j` over the words of
/// `bytes`, which start at word `first_word` of the payload (its byte offset / 8). Sums of the
/// pieces of a payload add up (wrapping) to the sum of the whole; the checksum is that sum xor the
/// payload's length in bytes. This is the value the device kernel accumulates. Panics unless
/// `bytes.len()` is a multiple of 8.
pub fn kv_checksum_sum(first_word: u64, bytes: &[u8]) -> u64 {
    assert!(
        bytes.len().is_multiple_of(8),
        "a KV checksum piece must be a whole number of 8-byte words, got {} bytes",
        bytes.len()
    );
    let mut key = first_word.wrapping_mul(WORD_MUL).wrapping_add(WORD_ADD);
    let mut sum = 0u64;
    for word in bytes.chunks_exact(8) {
        let w = u64::from_le_bytes(word.try_into().expect("chunks_exact(8) yields 8 bytes"));
        sum = sum.wrapping_add(fmix64(w ^ key));
        key = key.wrapping_add(WORD_MUL);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic non-zero byte stream (SplitMix64), so the tests need no RNG crate.
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut s = seed;
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        }
        out.truncate(n);
        out
    }

    #[test]
    fn fmix64_matches_murmur3() {
        assert_eq!(fmix64(0), 0);
        // Step by step: x ^= x >> 33 leaves 1; * c1; ^= >> 33; * c2; ^= >> 33.
        let x = 0xff51_afd7_ed55_8ccdu64;
        let x = x ^ (x >> 33);
        let x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        assert_eq!(fmix64(1), x ^ (x >> 33));
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
    }

    #[test]
    fn known_values() {
        // Computed by hand (Python, wrapping at 2^64) from the definition in the module doc.
        assert_eq!(kv_checksum([]), 0);
        let w0 = 0x0123_4567_89ab_cdefu64.to_le_bytes();
        let w1 = 0xfedc_ba98_7654_3210u64.to_le_bytes();
        // h_0 = fmix64(w0 ^ 0x2545f4914f6cdd1d); checksum = h_0 ^ 8.
        assert_eq!(kv_checksum([&w0[..]]), 0x6e5e_2433_0bd0_ab7a);
        // h_1 = fmix64(w1 ^ 0xc37d6e4aceb75932); checksum = (h_0 + h_1) ^ 16.
        let both = [w0, w1].concat();
        assert_eq!(kv_checksum([&both[..]]), 0x6892_c997_5108_a663);
    }

    #[test]
    fn every_single_word_change_is_detected() {
        let block = 6144;
        let payload = bytes(1, 3 * block);
        let want = kv_checksum(payload.chunks(block));
        let mut p = payload.clone();
        for j in 0..payload.len() / 8 {
            for flip in [1u64, 1 << 63, 0x0000_0100_0000_0000] {
                let w = u64::from_le_bytes(p[8 * j..8 * j + 8].try_into().unwrap());
                p[8 * j..8 * j + 8].copy_from_slice(&(w ^ flip).to_le_bytes());
                assert_ne!(kv_checksum(p.chunks(block)), want, "word {j} ^ {flip:#x}");
                p[8 * j..8 * j + 8].copy_from_slice(&w.to_le_bytes());
            }
        }
        assert_eq!(kv_checksum(p.chunks(block)), want);
    }

    #[test]
    fn swapped_words_are_detected() {
        let payload = bytes(2, 3 * 1024);
        let want = kv_checksum([&payload[..]]);
        let words = payload.len() / 8;
        for (a, b) in [(0, 1), (0, words - 1), (5, 200), (127, 128), (10, 300)] {
            let mut p = payload.clone();
            let (wa, wb) = (p[8 * a..8 * a + 8].to_vec(), p[8 * b..8 * b + 8].to_vec());
            assert_ne!(wa, wb, "the test needs distinct words");
            p[8 * a..8 * a + 8].copy_from_slice(&wb);
            p[8 * b..8 * b + 8].copy_from_slice(&wa);
            assert_ne!(kv_checksum([&p[..]]), want, "words {a} and {b} swapped");
        }
    }

    #[test]
    fn order_of_parts_matters() {
        let (a, b, c) = (bytes(3, 64), bytes(4, 64), bytes(5, 64));
        let abc = kv_checksum([&a[..], &b[..], &c[..]]);
        assert_ne!(abc, kv_checksum([&b[..], &a[..], &c[..]]));
        assert_ne!(abc, kv_checksum([&a[..], &c[..], &b[..]]));
        assert_ne!(abc, kv_checksum([&c[..], &b[..], &a[..]]));
    }

    #[test]
    fn length_is_part_of_the_checksum() {
        let p = bytes(6, 256);
        assert_ne!(kv_checksum([&p[..]]), kv_checksum([&p[..248]]));
        // Words whose terms sum to zero would still be told apart from the empty payload by N.
        assert_ne!(kv_checksum([&p[..8]]), kv_checksum([]));
    }

    #[test]
    fn part_boundaries_do_not_matter() {
        let p = bytes(7, 4096 + 48);
        let want = kv_checksum([&p[..]]);
        for cuts in [
            vec![8],
            vec![16, 24],
            vec![4096],
            vec![8, 16, 1000, 1008, 4096],
            vec![p.len() - 8],
        ] {
            let mut parts = Vec::new();
            let mut start = 0;
            for &c in cuts.iter().chain(&[p.len()]) {
                parts.push(&p[start..c]);
                start = c;
            }
            assert_eq!(kv_checksum(parts.iter().copied()), want, "cuts at {cuts:?}");
        }
        // Empty parts are harmless, and sums of pieces add up to the whole.
        assert_eq!(kv_checksum([&p[..0], &p[..], &p[..0]]), want);
        let halves = kv_checksum_sum(0, &p[..2048]).wrapping_add(kv_checksum_sum(256, &p[2048..]));
        assert_eq!(halves ^ p.len() as u64, want);
    }

    #[test]
    #[should_panic(expected = "whole number of 8-byte words")]
    fn a_part_of_odd_length_panics() {
        let p = bytes(8, 24);
        kv_checksum([&p[..12], &p[12..]]);
    }
}
