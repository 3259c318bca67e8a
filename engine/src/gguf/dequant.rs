//! Dequantization of GGML block formats to f32, bit-exact with ggml's reference decoders.
//!
//! Each decoder takes one block's bytes and writes its elements in order. The arithmetic follows
//! ggml's order of operations (scale products first, then the multiply-add in f32) so results match
//! ggml bit for bit; rounding of intermediate values is never changed.
//!
//! Invariant: [`dequantize`] accepts exactly the types with a [`GgmlType::layout`], and checks the
//! byte count against the element count before touching either buffer.

use half::{bf16, f16};
use rayon::prelude::*;

use super::ggml_type::{GgmlType, QK_K};

/// Blocks handed to one rayon task.
const BLOCKS_PER_TASK: usize = 1024;

/// Decodes `bytes` (whole blocks of type `ty`) into `out`, whose length is the element count.
/// Errors (as a reason string) if the type is not convertible or the sizes disagree.
pub(crate) fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let layout = ty.layout().ok_or_else(|| {
        format!(
            "type {ty} cannot be converted (supported: {})",
            GgmlType::convertible_list()
        )
    })?;
    let (be, bb) = (layout.block_elems, layout.block_bytes);
    if !out.len().is_multiple_of(be) || bytes.len() != out.len() / be * bb {
        return Err(format!(
            "{} bytes of {ty} do not hold {} elements ({be} elements per {bb}-byte block)",
            bytes.len(),
            out.len()
        ));
    }
    let decode: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, o| o[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::BF16 => |b, o| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::F64 => {
            |b, o| o[0] = f64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8])) as f32
        }
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2_K => q2_k,
        GgmlType::Q3_K => q3_k,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        _ => return Err(format!("type {ty} has a layout but no decoder")),
    };
    out.par_chunks_mut(be * BLOCKS_PER_TASK)
        .zip(bytes.par_chunks(bb * BLOCKS_PER_TASK))
        .for_each(|(o, b)| {
            for (ob, bb_) in o.chunks_exact_mut(be).zip(b.chunks_exact(bb)) {
                decode(bb_, ob);
            }
        });
    Ok(())
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_0: f16 d, 16 bytes of nibbles; element j is the low nibble of byte j, element j+16 the high
/// nibble; value = (q - 8) * d.
fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = half_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        o[j] = f32::from((qs[j] & 0x0F) as i8 - 8) * d;
        o[j + 16] = f32::from((qs[j] >> 4) as i8 - 8) * d;
    }
}

/// Q4_1: f16 d, f16 m, nibbles as Q4_0; value = q * d + m.
fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        o[j] = f32::from(qs[j] & 0x0F) * d + m;
        o[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

/// The 5th bits of Q5_x: bit j of the little-endian u32 `qh` belongs to element j.
fn fifth_bits(qh: &[u8]) -> u32 {
    u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]])
}

/// Q5_0: f16 d, u32 of high bits, nibbles; value = (q - 16) * d.
fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = fifth_bits(&b[2..6]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = u32::from(qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        let hi = u32::from(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        o[j] = (lo as i32 - 16) as f32 * d;
        o[j + 16] = (hi as i32 - 16) as f32 * d;
    }
}

/// Q5_1: f16 d, f16 m, u32 of high bits, nibbles; value = q * d + m.
fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = fifth_bits(&b[4..8]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = u32::from(qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        let hi = u32::from(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        o[j] = lo as f32 * d + m;
        o[j + 16] = hi as f32 * d + m;
    }
}

/// Q8_0: f16 d, 32 signed bytes; value = q * d.
fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = half_at(b, 0);
    for (out, &q) in o.iter_mut().zip(&b[2..34]) {
        *out = f32::from(q as i8) * d;
    }
}

/// Q2_K: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit values, f16 d,
/// f16 dmin. Each group of 16 elements has its own scale; value = d*sc * q - dmin*m.
fn q2_k(b: &[u8], o: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    let mut group = 0;
    let mut out = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u8, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[group];
                let dl = d * f32::from(sc & 0x0F);
                let ml = dmin * f32::from(sc >> 4);
                for &qb in &q[part * 16..part * 16 + 16] {
                    o[out] = dl * f32::from((qb >> shift) & 3) - ml;
                    out += 1;
                }
                group += 1;
            }
        }
    }
}

/// Q3_K: 32 bytes of high-bit masks, 64 bytes of 2-bit values, 12 bytes of packed 6-bit signed
/// scales, f16 d. value = d*(sc-32) * (q2 - (hbit ? 0 : 4)).
fn q3_k(b: &[u8], o: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let packed = &b[96..108];
    let d = half_at(b, 108);
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 {
            packed[i] & 0x0F
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        *s = (low | (high << 4)) as i8 - 32;
    }
    let mut group = 0;
    let mut out = 0;
    let mut bit = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u8, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * f32::from(scales[group]);
                for l in part * 16..part * 16 + 16 {
                    let low = ((q[l] >> shift) & 3) as i8;
                    let sub = if hmask[l] & (1 << bit) != 0 { 0 } else { 4 };
                    o[out] = dl * f32::from(low - sub);
                    out += 1;
                }
                group += 1;
            }
            bit += 1;
        }
    }
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) from a K-quant's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles. Each 64 elements take 32
/// bytes: their low nibbles (scale 2i) then their high nibbles (scale 2i+1).
fn q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..QK_K / 64 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let base = chunk * 64;
        for l in 0..32 {
            o[base + l] = d1 * f32::from(q[l] & 0x0F) - min1;
            o[base + 32 + l] = d2 * f32::from(q[l] >> 4) - min2;
        }
    }
}

/// Q5_K: like Q4_K with 32 bytes of fifth bits after the scales: bit 2i of `qh[l]` belongs to the
/// low-nibble half of chunk i, bit 2i+1 to its high-nibble half.
fn q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..QK_K / 64 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let (u1, u2) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
        let base = chunk * 64;
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            o[base + l] = d1 * f32::from((q[l] & 0x0F) + hi1) - min1;
            o[base + 32 + l] = d2 * f32::from((q[l] >> 4) + hi2) - min2;
        }
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed scales, f16 d.
/// value = d * scale * (q6 - 32).
fn q6_k(b: &[u8], o: &mut [f32]) {
    let ql_all = &b[0..128];
    let qh_all = &b[128..192];
    let sc_all = &b[192..208];
    let d = half_at(b, 208);
    for half in 0..2 {
        let ql = &ql_all[half * 64..half * 64 + 64];
        let qh = &qh_all[half * 32..half * 32 + 32];
        let sc = &sc_all[half * 8..half * 8 + 8];
        let base = half * 128;
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            o[base + l] = s(0) * f32::from(q1);
            o[base + l + 32] = s(2) * f32::from(q2);
            o[base + l + 64] = s(4) * f32::from(q3);
            o[base + l + 96] = s(6) * f32::from(q4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    fn run(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; n];
        dequantize(ty, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn plain_floats() {
        let f: Vec<u8> = [1.5f32, -2.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(run(GgmlType::F32, &f, 2), vec![1.5, -2.25]);
        let f: Vec<u8> = [h(0.5), h(-3.0)].concat();
        assert_eq!(run(GgmlType::F16, &f, 2), vec![0.5, -3.0]);
        // bf16 0x3FC0 = 1.5, 0xC040 = -3.0
        assert_eq!(
            run(GgmlType::BF16, &[0xC0, 0x3F, 0x40, 0xC0], 2),
            vec![1.5, -3.0]
        );
        assert_eq!(run(GgmlType::F64, &0.125f64.to_le_bytes(), 1), vec![0.125]);
    }

    #[test]
    fn q4_0_block() {
        // Element j < 16 gets low nibble j % 16, element j+16 gets high nibble 15 - j.
        let mut b = h(0.5).to_vec();
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let out = run(GgmlType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_block() {
        let mut b = [h(0.25), h(-1.0)].concat();
        for j in 0..16u8 {
            b.push(j | (3 << 4));
        }
        let out = run(GgmlType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.25 - 1.0);
            assert_eq!(out[j + 16], 3.0 * 0.25 - 1.0);
        }
    }

    #[test]
    fn q8_0_block() {
        let mut b = h(2.0).to_vec();
        for j in 0..32i8 {
            b.push((j * 4 - 64) as u8);
        }
        let out = run(GgmlType::Q8_0, &b, 32);
        for (j, v) in out.iter().enumerate() {
            assert_eq!(*v, (j as f32 * 4.0 - 64.0) * 2.0);
        }
    }

    #[test]
    fn q5_blocks() {
        // Fifth bit set for elements 1 and 17 (bits 1 and 17 of qh).
        let qh = (1u32 << 1) | (1u32 << 17);
        let nib: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
        let b0 = [h(1.0).as_slice(), &qh.to_le_bytes(), &nib].concat();
        let out = run(GgmlType::Q5_0, &b0, 32);
        assert_eq!(out[0], -16.0);
        assert_eq!(out[1], 1.0 + 16.0 - 16.0);
        assert_eq!(out[2], 2.0 - 16.0);
        assert_eq!(out[16], -16.0);
        assert_eq!(out[17], 1.0);
        assert_eq!(out[31], 15.0 - 16.0);
        let b1 = [h(0.5).as_slice(), &h(2.0), &qh.to_le_bytes(), &nib].concat();
        let out = run(GgmlType::Q5_1, &b1, 32);
        assert_eq!(out[0], 2.0);
        assert_eq!(out[1], 17.0 * 0.5 + 2.0);
        assert_eq!(out[17], 17.0 * 0.5 + 2.0);
        assert_eq!(out[18], 2.0 * 0.5 + 2.0);
    }

    #[test]
    fn q4_k_block() {
        // Scales: sub-blocks 0..3 use the low 6 bits of bytes 0..3 (scale) and 4..7 (min);
        // sub-blocks 4..7 combine nibbles of bytes 8..11 with the top 2 bits of bytes 0..7.
        let mut scales = [0u8; 12];
        scales[0] = 3; // sc0 = 3
        scales[4] = 1; // m0 = 1
        scales[1] = 5 | (1 << 6); // sc1 = 5, contributes 16 to sc5
        scales[5] = 2 | (2 << 6); // m1 = 2, contributes 32 to m5
        scales[9] = 7 | (1 << 4); // sc5 low = 7, m5 low = 1
        let qs: Vec<u8> = (0..128)
            .map(|i| (i % 16) as u8 | (((i + 1) % 16) as u8) << 4)
            .collect();
        let b = [h(0.5).as_slice(), &h(0.25), &scales, &qs].concat();
        let out = run(GgmlType::Q4_K, &b, 256);
        // Sub-block 0: low nibbles of bytes 0..31, scale 3*0.5, min 1*0.25.
        assert_eq!(out[0], 1.5 * 0.0 - 0.25);
        assert_eq!(out[5], 1.5 * 5.0 - 0.25);
        // Sub-block 1: high nibbles of bytes 0..31, scale 5*0.5, min 2*0.25.
        assert_eq!(out[32], 2.5 * 1.0 - 0.5);
        // Sub-block 5: high nibbles of bytes 64..95, sc = 7 | 16 = 23, m = 1 | 32 = 33.
        let q = ((64 + 3 + 1) % 16) as f32;
        assert_eq!(out[2 * 64 + 32 + 3], 23.0 * 0.5 * q - 33.0 * 0.25);
        // Sub-block 6 has scale 0 and min 0.
        assert_eq!(out[3 * 64 + 1], 0.0);
    }

    #[test]
    fn q5_k_block() {
        let mut scales = [0u8; 12];
        for s in scales.iter_mut().take(8) {
            *s = 1; // every sub-block 0..3: sc = 1, m = 1
        }
        let mut qh = [0u8; 32];
        qh[2] = 0b0000_0110; // element 2 of sub-blocks 1 and 2 (bit k belongs to sub-block k)
        let qs = vec![0x21u8; 128]; // low nibble 1, high nibble 2
        let b = [h(1.0).as_slice(), &h(0.5), &scales, &qh, &qs].concat();
        let out = run(GgmlType::Q5_K, &b, 256);
        assert_eq!(out[2], 1.0 - 0.5); // sub-block 0, no fifth bit
        assert_eq!(out[32 + 2], 2.0 + 16.0 - 0.5); // sub-block 1, bit 1 set
        assert_eq!(out[64 + 2], 1.0 + 16.0 - 0.5); // sub-block 2, bit 2 set
        assert_eq!(out[64 + 3], 1.0 - 0.5);
    }

    #[test]
    fn q6_k_block() {
        let ql = vec![0x53u8; 128]; // low nibble 3, high nibble 5
        let qh = vec![0b11_10_01_00u8; 64]; // 2-bit highs 0, 1, 2, 3
        let scales: Vec<u8> = (1..=16)
            .map(|s: i8| (if s % 2 == 0 { -s } else { s }) as u8)
            .collect();
        let b = [ql.as_slice(), &qh, &scales, &h(0.5)].concat();
        let out = run(GgmlType::Q6_K, &b, 256);
        // element 0: q = 3 | 0<<4 = 3 -> -29, scale sc[0] = 1
        assert_eq!(out[0], 0.5 * 1.0 * -29.0);
        // element 32: low nibble of ql[32] = 3 | 1<<4 = 19 -> -13, scale sc[2] = 3
        assert_eq!(out[32], 0.5 * 3.0 * -13.0);
        // element 64: high nibble of ql[0] = 5 | 2<<4 = 37 -> 5, scale sc[4] = 5
        assert_eq!(out[64], 0.5 * 5.0 * 5.0);
        // element 96 + 16: 5 | 3<<4 = 53 -> 21, scale sc[7] = -8
        assert_eq!(out[112], 0.5 * -8.0 * 21.0);
        // second half uses scales 8..16: element 128 -> sc[8] = 9
        assert_eq!(out[128], 0.5 * 9.0 * -29.0);
    }

    #[test]
    fn q2_k_block() {
        let scales: Vec<u8> = (0..16u8).map(|i| (i % 16) | (1 << 4)).collect();
        let qs = vec![0b11_10_01_00u8; 64];
        let b = [scales.as_slice(), &qs, &h(1.0), &h(0.5)].concat();
        let out = run(GgmlType::Q2_K, &b, 256);
        // Group g covers elements 16g..16g+16; shift = 2 * ((g / 2) % 4).
        for g in 0..16 {
            let q = ((g / 2) % 4) as f32;
            assert_eq!(out[16 * g + 3], g as f32 * q - 0.5, "group {g}");
        }
    }

    #[test]
    fn q3_k_block() {
        // All scales = 33 - 32 = 1: low nibbles 1 (bytes 0..8 both nibbles), high bits 2 (= 32).
        let mut packed = [0x11u8; 12];
        for p in packed.iter_mut().skip(8) {
            *p = 0b10_10_10_10;
        }
        let mut hmask = [0u8; 32];
        hmask[0] = 0b0000_0001; // element 0 of the first 32-wide group has its high bit set
        let qs = vec![0b00_00_00_11u8; 64];
        let b = [hmask.as_slice(), &qs, &packed, &h(2.0)].concat();
        let out = run(GgmlType::Q3_K, &b, 256);
        assert_eq!(out[0], 2.0 * 3.0); // high bit set: no -4
        assert_eq!(out[1], 2.0 * (3.0 - 4.0));
        assert_eq!(out[32], 2.0 * (0.0 - 4.0)); // shift 2 -> 0, bit 1 unset
    }

    #[test]
    fn size_mismatch_and_unknown_type_are_errors() {
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], &mut [0.0; 32]).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut [0.0; 31]).is_err());
        assert!(
            dequantize(GgmlType(15), &[0u8; 292], &mut [0.0; 256])
                .unwrap_err()
                .contains("Q8_K")
        );
    }

    #[test]
    fn many_blocks_across_tasks() {
        let n_blocks = BLOCKS_PER_TASK * 2 + 3;
        let mut b = Vec::new();
        for i in 0..n_blocks {
            b.extend_from_slice(&h(1.0));
            b.extend(std::iter::repeat_n((i % 100) as u8, 32));
        }
        let out = run(GgmlType::Q8_0, &b, n_blocks * 32);
        for i in 0..n_blocks {
            assert_eq!(out[i * 32 + 31], (i % 100) as f32);
        }
    }
}
