//! `out = x · wᵀ` for few rows of `x` (decode batches): every weight row is streamed from memory
//! once per call and multiplied against all rows of `x` while it sits in L1.
//!
//! The work is cut into tiles of `R` weight rows × `C` rows of `x`; a tile keeps `R·C` vector
//! accumulators in registers, loads `R + C` vectors per step along `k` (both operands are
//! `k`-contiguous, so no packing is needed) and reduces each accumulator horizontally at the end.
//! While it computes, it prefetches the weight rows [`PREFETCH_BYTES`] ahead into L2. Tasks are
//! contiguous ranges of weight rows (output columns), run in parallel with rayon.
//!
//! Invariants: every output is one dot product over the whole of `k`, accumulated in f32 in
//! lane-wise partial sums (FMA, one accumulator per output) and reduced in a fixed order, so
//! results differ from an exact sum only by f32 rounding, and an output's value depends only on
//! its own row of `x` and of `w` (not on `m`, on the tile it fell in, or on the thread split); no
//! task writes outside its own column range of `out`.

use rayon::prelude::*;

use super::simd::Isa;

/// Largest tile: rows of `w` × rows of `x` (the result buffer of one tile).
const MAX_R: usize = 4;
const MAX_C: usize = 8;

/// A tile's results: `[w row][x row]`.
type TileOut = [[f32; MAX_C]; MAX_R];

/// How far ahead (in bytes of weight rows) the kernel prefetches, into L2 (`_MM_HINT_T2`).
///
/// Measured on the 2-core Zen 4 (see `benches/matmul.rs`): without software prefetch one core
/// pulls only ~7 GB/s of weights while it computes at m = 16 (the FMAs fill the reorder window,
/// so few misses are in flight), and `_MM_HINT_T0` barely helps; T2 prefetches 32 KiB ahead,
/// issued from every x block of a tile, bring m = 16 from ~55 to ~150 GFLOP/s on both cores.
const PREFETCH_BYTES: usize = 32 * 1024;

/// Computes `out[m, n] = x[m, k] · w[n, k]ᵀ` with the small-`m` kernel for `isa`, which must be
/// [`Isa::Avx2`] or [`Isa::Avx512`]. Slice lengths must be checked by the caller.
pub(super) fn matmul_t_skinny(isa: Isa, x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let (tile_r, _) = tile_shape(isa, m);
    // Tasks: about 4 per thread, each a whole number of tiles, at least 16 rows.
    let threads = rayon::current_num_threads().max(1);
    let serial = m * n * k < 256 * 1024 || threads == 1;
    let tasks_wanted = if serial { 1 } else { 4 * threads };
    let chunk = n.div_ceil(tasks_wanted).max(16).next_multiple_of(tile_r).min(n);
    let tasks = n.div_ceil(chunk);
    let mut pieces: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::with_capacity(m)).collect();
    for row in out.chunks_mut(n) {
        for (t, piece) in row.chunks_mut(chunk).enumerate() {
            pieces[t].push(piece);
        }
    }
    let run = |(t, mut outs): (usize, Vec<&mut [f32]>)| {
        let rows = outs[0].len();
        let j0 = t * chunk;
        columns(isa, x, &w[j0 * k..(j0 + rows) * k], &mut outs, k);
    };
    if tasks == 1 {
        pieces.into_iter().enumerate().for_each(run);
    } else {
        pieces.into_par_iter().enumerate().for_each(run);
    }
}

/// `(R, C)`: weight rows and `x` rows per tile. (3, 8) with AVX-512 uses 24 of the 32 vector
/// registers for accumulators, (3, 4) with AVX2 12 of 16; at m <= 2 a tile covers all of `x`.
/// Only the shapes these produce, and their remainders, are instantiated in [`tile`].
fn tile_shape(isa: Isa, m: usize) -> (usize, usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            if m <= 2 {
                (1, 2)
            } else {
                (3, 8)
            }
        }
        _ => {
            if m <= 2 {
                (4, 2)
            } else {
                (3, 4)
            }
        }
    }
}

/// Fills `outs[i][jl] = x[i] · w[jl]` for the weight rows `w` ([rows, k]) of one task; `outs` holds
/// one slice of `rows` outputs per row of `x`.
fn columns(isa: Isa, x: &[f32], w: &[f32], outs: &mut [&mut [f32]], k: usize) {
    let m = outs.len();
    let rows = w.len() / k;
    let (tile_r, tile_c) = tile_shape(isa, m);
    let pf_rows = (PREFETCH_BYTES / (4 * k)).max(1);
    let mut res: TileOut = [[0.0; MAX_C]; MAX_R];
    for jb in (0..rows).step_by(tile_r) {
        let r = tile_r.min(rows - jb);
        let wt = &w[jb * k..(jb + r) * k];
        for ib in (0..m).step_by(tile_c) {
            let c = tile_c.min(m - ib);
            let xt = &x[ib * k..(ib + c) * k];
            // Every x block of the tile prefetches the rows `pf_rows` further on (issuing them
            // again from each block measured faster than from the first alone). A hint only:
            // the address may lie past `w`, which a prefetch never faults on.
            let prefetch = w.as_ptr().wrapping_add((jb + pf_rows) * k);
            tile(isa, Operands { w: wt, x: xt, k, prefetch }, (r, c), &mut res);
            for (ci, o) in outs[ib..ib + c].iter_mut().enumerate() {
                for (ri, res_row) in res[..r].iter().enumerate() {
                    o[jb + ri] = res_row[ci];
                }
            }
        }
    }
}

/// The inputs of one tile.
#[derive(Clone, Copy)]
struct Operands<'a> {
    /// `[r, k]` weight rows.
    w: &'a [f32],
    /// `[c, k]` rows of `x`.
    x: &'a [f32],
    k: usize,
    /// Start of `r` rows (of `k` floats) to prefetch; never dereferenced.
    prefetch: *const f32,
}

/// Generates the match from a run-time `(r, c)` to the const-generic tile function.
macro_rules! dispatch_tile {
    ($f:ident, $ops:expr, $rc:expr, $res:expr; $( ($r:literal, $c:literal) ),* ) => {
        match $rc {
            $( ($r, $c) => $f::<$r, $c>($ops, $res), )*
            _ => unreachable!("tile shape {:?} is not instantiated", $rc),
        }
    };
}

/// One tile: `res[ri][ci] = w[ri] · x[ci]` for `rc = (r, c)` rows of each.
fn tile(isa: Isa, ops: Operands<'_>, rc: (usize, usize), res: &mut TileOut) {
    assert!(ops.w.len() == rc.0 * ops.k && ops.x.len() == rc.1 * ops.k, "tile operands must be [r, k] and [c, k]");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` comes from `Isa::detect`, which saw AVX-512F/VL, AVX2 and FMA on this
        // CPU; the operand lengths were checked above, as the tile function requires.
        Isa::Avx512 => unsafe {
            dispatch_tile!(tile_avx512, ops, rc, res;
                (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8),
                (2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (2, 8),
                (3, 1), (3, 2), (3, 3), (3, 4), (3, 5), (3, 6), (3, 7), (3, 8))
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` comes from `Isa::detect`, which saw AVX2 and FMA on this CPU; the
        // operand lengths were checked above, as the tile function requires.
        Isa::Avx2 => unsafe {
            dispatch_tile!(tile_avx2, ops, rc, res;
                (1, 1), (1, 2), (1, 3), (1, 4),
                (2, 1), (2, 2), (2, 3), (2, 4),
                (3, 1), (3, 2), (3, 3), (3, 4),
                (4, 1), (4, 2))
        },
        Isa::Portable => unreachable!("the small-m kernel has no portable path; matmul_t uses gemm there"),
    }
}

/// AVX2 tile of `R` weight rows × `C` rows of `x`, 8-wide accumulators.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `ops.w.len() >= R * ops.k` and `ops.x.len() >= C * ops.k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const C: usize>(ops: Operands<'_>, res: &mut TileOut) {
    use std::arch::x86_64::*;
    let Operands { w, x, k, prefetch } = ops;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let body = k - k % 8;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut t = 0;
    while t < body {
        let mut wv = [_mm256_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            // SAFETY: r < R and t + 8 <= k, so the 8 floats at r*k + t lie inside w's R*k.
            *v = unsafe { _mm256_loadu_ps(wp.add(r * k + t)) };
        }
        if t % 16 == 0 {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T2>(prefetch.wrapping_add(r * k + t).cast());
            }
        }
        for c in 0..C {
            // SAFETY: c < C and t + 8 <= k, so the 8 floats at c*k + t lie inside x's C*k.
            let xv = unsafe { _mm256_loadu_ps(xp.add(c * k + t)) };
            for (acc_r, w_r) in acc.iter_mut().zip(&wv) {
                acc_r[c] = _mm256_fmadd_ps(*w_r, xv, acc_r[c]);
            }
        }
        t += 8;
    }
    for r in 0..R {
        for c in 0..C {
            let mut tail = 0.0f32;
            for i in body..k {
                tail += w[r * k + i] * x[c * k + i];
            }
            res[r][c] = super::simd::x86::hsum(acc[r][c]) + tail;
        }
    }
}

/// AVX-512 tile of `R` weight rows × `C` rows of `x`, 16-wide accumulators; the `k % 16` tail
/// goes through masked loads.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512VL, AVX2 and FMA; `ops.w.len() >= R * ops.k` and
/// `ops.x.len() >= C * ops.k`.
#[cfg(target_arch = "x86_64")]
// AVX-512VL lets the 256/128-bit steps of the reduction use EVEX encodings, which reach
// registers 16-31; without it they are VEX-encoded (registers 0-15 only) and the accumulators spill.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn tile_avx512<const R: usize, const C: usize>(ops: Operands<'_>, res: &mut TileOut) {
    use std::arch::x86_64::*;
    let Operands { w, x, k, prefetch } = ops;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let body = k - k % 16;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut t = 0;
    while t < body {
        let mut wv = [_mm512_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            // SAFETY: r < R and t + 16 <= k, so the 16 floats at r*k + t lie inside w's R*k.
            *v = unsafe { _mm512_loadu_ps(wp.add(r * k + t)) };
        }
        for r in 0..R {
            _mm_prefetch::<_MM_HINT_T2>(prefetch.wrapping_add(r * k + t).cast());
        }
        for c in 0..C {
            // SAFETY: c < C and t + 16 <= k, so the 16 floats at c*k + t lie inside x's C*k.
            let xv = unsafe { _mm512_loadu_ps(xp.add(c * k + t)) };
            for (acc_r, w_r) in acc.iter_mut().zip(&wv) {
                acc_r[c] = _mm512_fmadd_ps(*w_r, xv, acc_r[c]);
            }
        }
        t += 16;
    }
    if body < k {
        let mask: __mmask16 = (1u16 << (k - body)) - 1;
        let mut wv = [_mm512_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            // SAFETY: the mask enables lanes 0..k-body only, i.e. floats r*k + body .. r*k + k,
            // inside w's R*k; masked-off lanes are not accessed.
            *v = unsafe { _mm512_maskz_loadu_ps(mask, wp.add(r * k + body)) };
        }
        for c in 0..C {
            // SAFETY: as above, for x's C*k floats.
            let xv = unsafe { _mm512_maskz_loadu_ps(mask, xp.add(c * k + body)) };
            for (acc_r, w_r) in acc.iter_mut().zip(&wv) {
                acc_r[c] = _mm512_fmadd_ps(*w_r, xv, acc_r[c]);
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            res[r][c] = _mm512_reduce_add_ps(acc[r][c]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::matmul::reference;
    use super::*;
    use rand::{Rng, SeedableRng, rngs::SmallRng};

    /// Every SIMD path, on shapes with remainders in every tile dimension, against f64.
    #[test]
    fn small_m_kernel_matches_f64_reference() {
        let mut rng = SmallRng::seed_from_u64(21);
        let shapes = [
            (1, 576, 960),
            (2, 17, 5),
            (3, 1, 7),
            (5, 33, 131),
            (7, 100, 301),
            (9, 15, 3),
            (16, 576, 193),
            (17, 1536, 77),
            (31, 70, 513),
            (64, 64, 64),
        ];
        for isa in Isa::all_available().into_iter().filter(|i| *i != Isa::Portable) {
            for &(m, k, n) in &shapes {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut out = vec![f32::NAN; m * n];
                matmul_t_skinny(isa, &x, &w, &mut out, m, k, n);
                let want = reference(&x, &w, m, k, n);
                for (idx, (got, want)) in out.iter().zip(&want).enumerate() {
                    // f32 accumulation of k products of magnitude <= 1.
                    let tol = 1e-6 * (k as f64).sqrt().max(1.0) * 4.0;
                    assert!(
                        (*got as f64 - want).abs() <= tol,
                        "{isa:?} m={m} k={k} n={n} at {idx}: got {got}, want {want}"
                    );
                }
            }
        }
    }

    /// A row's result must not depend on which other rows share the call (bitwise), so that a
    /// sequence decodes the same tokens alone and in any batch.
    #[test]
    fn each_row_is_independent_of_the_rest_of_the_batch() {
        let mut rng = SmallRng::seed_from_u64(33);
        let (k, n) = (77, 45);
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        for isa in Isa::all_available().into_iter().filter(|i| *i != Isa::Portable) {
            for m in [2usize, 3, 9, 16, 40] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut all = vec![f32::NAN; m * n];
                matmul_t_skinny(isa, &x, &w, &mut all, m, k, n);
                for i in 0..m {
                    let mut one = vec![f32::NAN; n];
                    matmul_t_skinny(isa, &x[i * k..(i + 1) * k], &w, &mut one, 1, k, n);
                    assert_eq!(one, all[i * n..(i + 1) * n], "{isa:?}: row {i} of {m} differs from the row alone");
                }
            }
        }
    }
}
