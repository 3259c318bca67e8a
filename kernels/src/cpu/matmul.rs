//! `out = x · wᵀ` for row-major `x` [m, k] and `w` [n, k] (the PyTorch `Linear` weight layout).
//!
//! Few rows of `x` (decode batches, short prefill chunks) go to the small-`m` kernel in
//! `skinny.rs` when the CPU has AVX2/FMA; larger `m`, and every CPU without AVX2/FMA, go to the
//! `gemm` crate (which packs both operands and reaches peak FLOP rate once `m` is large enough to
//! amortise the packing).
//! Invariants: both paths compute every output as an f32 sum over the whole of `k`, so they agree
//! up to f32 rounding; on the small-`m` path a row's result does not depend on the other rows of
//! the call (bitwise), so a sequence gets the same logits alone and in any decode batch.

use gemm::Parallelism;

use super::simd::Isa;

/// Computes `out[m, n] = x[m, k] · w[n, k]ᵀ`, overwriting `out`, with the fastest path for the
/// shape and this CPU.
pub fn matmul_t(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let isa = Isa::detect();
    let isa = if m <= small_m_max(isa) { isa } else { Isa::Portable };
    matmul_t_with(isa, x, w, out, (m, k, n));
}

/// Largest `m` routed to the small-`m` kernel: the measured crossover with `gemm` on the 2-core
/// Zen 4 with weights streamed from DRAM (`kernels/benches/matmul.rs`). With AVX-512 the kernel
/// is ahead up to m ≈ 128-192; restricted to AVX2 it stays ahead up to m ≈ 64-96.
fn small_m_max(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => 128,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => 64,
        Isa::Portable => 0,
    }
}

/// [`matmul_t`] forced through the small-`m` kernel whatever `m` is (falls back to `gemm` on a
/// CPU without AVX2/FMA). For benchmarks and tests.
pub fn matmul_t_small_m(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    matmul_t_with(Isa::detect(), x, w, out, (m, k, n));
}

/// [`matmul_t`] forced through `gemm` whatever `m` is. For benchmarks and tests.
pub fn matmul_t_gemm(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    matmul_t_with(Isa::Portable, x, w, out, (m, k, n));
}

/// `isa` = [`Isa::Portable`] selects `gemm`; the SIMD variants the small-`m` kernel.
pub(crate) fn matmul_t_with(isa: Isa, x: &[f32], w: &[f32], out: &mut [f32], (m, k, n): (usize, usize, usize)) {
    assert_eq!(x.len(), m * k, "x must be [m, k]");
    assert_eq!(w.len(), n * k, "w must be [n, k]");
    assert_eq!(out.len(), m * n, "out must be [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        super::skinny::matmul_t_skinny(isa, x, w, out, m, k, n);
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let parallelism = if m * n * k < 64 * 1024 {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    };
    // SAFETY: the three slices were checked above to hold exactly m*k, n*k and m*n elements, and the
    // strides below address only inside them: out is row-major [m, n] (row stride n, column stride
    // 1), x is row-major [m, k], and wᵀ's element (i, j) is w[j*k + i] (row stride 1, column stride
    // k). `out` is a unique borrow, so nothing aliases the destination. With read_dst = false the
    // destination is only written (gemm's alpha is ignored); beta = 1 scales the product.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `x · wᵀ` in f64: the reference both matmul paths are tested against.
#[cfg(test)]
pub(super) fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
            }
        }
        out
    }

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::SmallRng};

    #[test]
    fn matches_f64_reference_on_random_shapes() {
        let mut rng = SmallRng::seed_from_u64(7);
        let shapes = [(1, 576, 192), (3, 17, 5), (16, 64, 1536), (33, 130, 70), (1, 1, 1), (60, 40, 33), (130, 77, 9)];
        type Path = fn(&[f32], &[f32], &mut [f32], usize, usize, usize);
        let paths: [(&str, Path); 3] =
            [("auto", matmul_t), ("gemm", matmul_t_gemm), ("small-m", matmul_t_small_m)];
        for &(m, k, n) in &shapes {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want = reference(&x, &w, m, k, n);
            for (name, f) in paths {
                let mut out = vec![f32::NAN; m * n];
                f(&x, &w, &mut out, m, k, n);
                for (got, want) in out.iter().zip(&want) {
                    let err = (*got as f64 - want).abs() / want.abs().max(1.0);
                    assert!(err < 1e-5, "{name} m={m} k={k} n={n}: got {got}, want {want}");
                }
            }
        }
    }

    #[test]
    fn empty_dimensions_are_handled_on_every_path() {
        for isa in Isa::all_available() {
            let mut out = vec![f32::NAN; 6];
            matmul_t_with(isa, &[], &[], &mut out, (2, 0, 3));
            assert!(out.iter().all(|v| *v == 0.0), "{isa:?}: k = 0 must give zeros");
            let mut none: Vec<f32> = Vec::new();
            matmul_t_with(isa, &[], &[1.0, 2.0], &mut none, (0, 2, 1));
            matmul_t_with(isa, &[1.0, 2.0], &[], &mut none, (1, 2, 0));
        }
    }
}
