//! `out = x · wᵀ` for row-major `x` [m, k] and `w` [n, k] (the PyTorch `Linear` weight layout),
//! multi-threaded through the `gemm` crate.

use gemm::Parallelism;

/// Computes `out[m, n] = x[m, k] · w[n, k]ᵀ`, overwriting `out`.
pub fn matmul_t(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::SmallRng};

    fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
            }
        }
        out
    }

    #[test]
    fn matches_f64_reference_on_random_shapes() {
        let mut rng = SmallRng::seed_from_u64(7);
        for &(m, k, n) in &[(1, 576, 192), (3, 17, 5), (16, 64, 1536), (33, 130, 70), (1, 1, 1)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut out = vec![f32::NAN; m * n];
            matmul_t(&x, &w, &mut out, m, k, n);
            let want = reference(&x, &w, m, k, n);
            for (got, want) in out.iter().zip(&want) {
                let err = (*got as f64 - want).abs() / want.abs().max(1.0);
                assert!(err < 1e-5, "m={m} k={k} n={n}: got {got}, want {want}");
            }
        }
    }
}
