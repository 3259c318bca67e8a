//! Run-time choice of the instruction set the CPU kernels use, and the small vector helpers
//! (dot product, `y += a·x`) that attention is built from.
//!
//! The crate is compiled for baseline x86-64 (no `-C target-cpu`), so every SIMD routine lives in
//! a `#[target_feature]` function that is only called after [`Isa::detect`] has confirmed the
//! features at run time. Invariant: every kernel has a portable path, reachable through
//! [`Isa::Portable`], that computes the same sums in the same lane order (8 partial sums, summed
//! pairwise at the end), so the SIMD paths differ from it only by FMA rounding.

use std::sync::OnceLock;

/// The instruction set a kernel runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F and AVX-512VL (with AVX2 and FMA).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX2 with FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Plain Rust, no target features.
    Portable,
}

impl Isa {
    /// The best instruction set this CPU supports (detected once, then cached).
    pub(crate) fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
                if avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
                    return Isa::Avx512;
                }
                if avx2 {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Every instruction set usable on this CPU, best first (for tests that compare paths).
    #[cfg(test)]
    pub(crate) fn all_available() -> Vec<Isa> {
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::detect() == Isa::Avx512 {
                all.push(Isa::Avx512);
            }
            if matches!(Isa::detect(), Isa::Avx512 | Isa::Avx2) {
                all.push(Isa::Avx2);
            }
        }
        all.push(Isa::Portable);
        all
    }
}

/// `Σ a[i]·b[i]` with 8 interleaved partial sums. `a` and `b` must have the same length.
pub(crate) fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` and `Isa::Avx512` are only produced by `Isa::detect` (and the
        // test helper built on it) after AVX2 and FMA were detected on this CPU.
        Isa::Avx512 | Isa::Avx2 => unsafe { x86::dot(a, b) },
        Isa::Portable => dot_portable(a, b),
    }
}

/// `y[i] += alpha·x[i]`. `x` and `y` must have the same length.
pub(crate) fn axpy(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: lengths differ");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`: AVX2 and FMA were detected before this variant was produced.
        Isa::Avx512 | Isa::Avx2 => unsafe { x86::axpy(alpha, x, y) },
        Isa::Portable => {
            for (o, v) in y.iter_mut().zip(x) {
                *o += alpha * v;
            }
        }
    }
}

/// Sums 8 lanes in the order the SIMD paths use: (0+4, 1+5, 2+6, 3+7), then pairs, then the last
/// two.
pub(crate) fn reduce8(l: [f32; 8]) -> f32 {
    let q = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let p = [q[0] + q[2], q[1] + q[3]];
    p[0] + p[1]
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let body = a.len() - a.len() % 8;
    for (x, y) in a[..body].chunks_exact(8).zip(b[..body].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a[body..].iter().zip(&b[body..]) {
        tail += x * y;
    }
    reduce8(acc) + tail
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! AVX2/FMA bodies of the helpers above. Callers must have detected AVX2 and FMA.

    use std::arch::x86_64::*;

    /// Horizontal sum of the 8 lanes of `v`, in the order of [`super::reduce8`].
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps::<0b01>(p, p)))
    }

    /// See [`super::dot`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let body = n - n % 8;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= body <= len of both slices, so both 8-float loads are in bounds.
            let (x, y) = unsafe { (_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i))) };
            acc = _mm256_fmadd_ps(x, y, acc);
            i += 8;
        }
        let mut tail = 0.0f32;
        for j in body..n {
            tail += a[j] * b[j];
        }
        hsum(acc) + tail
    }

    /// See [`super::axpy`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `x.len() == y.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let body = n - n % 8;
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= body <= len of both slices; `y` is a unique borrow.
            unsafe {
                let v = _mm256_fmadd_ps(a, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(y.as_ptr().add(i)));
                _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
            }
            i += 8;
        }
        for j in body..n {
            y[j] += alpha * x[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::SmallRng};

    #[test]
    fn dot_and_axpy_match_f64_on_every_path() {
        let mut rng = SmallRng::seed_from_u64(11);
        for isa in Isa::all_available() {
            for len in [0usize, 1, 7, 8, 9, 64, 67, 130] {
                let a: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
                let b: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
                let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
                let got = dot(isa, &a, &b);
                assert!((got as f64 - want).abs() < 1e-5, "{isa:?} len {len}: dot {got} vs {want}");
                let alpha = rng.random_range(-2.0f32..2.0);
                let mut y = b.clone();
                axpy(isa, alpha, &a, &mut y);
                for i in 0..len {
                    let want = b[i] as f64 + alpha as f64 * a[i] as f64;
                    assert!((y[i] as f64 - want).abs() < 1e-6, "{isa:?} len {len}: axpy[{i}] {} vs {want}", y[i]);
                }
            }
        }
    }

    #[test]
    fn reduce8_sums_all_lanes() {
        assert_eq!(reduce8([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]), 36.0);
    }
}
