//! Run-time choice of the instruction set the CPU kernels use, and the vector helpers attention
//! is built from: scores of one query against a run of keys, and a weighted sum of a run of value
//! rows.
//!
//! The crate is compiled for baseline x86-64 (no `-C target-cpu`), so every SIMD routine lives in
//! a `#[target_feature]` function that is only called after [`Isa::detect`] has confirmed the
//! features at run time. Invariant: every helper has a portable path, reachable through
//! [`Isa::Portable`], that computes the same f32 sums (dot products in 8 partial sums, weighted
//! sums accumulated row by row), so the paths differ only by f32 rounding (FMA, summation order).

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

/// `out[j] = scale · (q · rows[j])` for the `out.len()` rows of `rows` (each `q.len()` long).
pub(crate) fn dots(isa: Isa, q: &[f32], rows: &[f32], scale: f32, out: &mut [f32]) {
    assert_eq!(rows.len(), out.len() * q.len(), "dots: rows must be [out.len(), q.len()]");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` and `Isa::Avx512` are only produced by `Isa::detect` (and the
        // test helper built on it) after AVX2 and FMA were detected on this CPU; the lengths were
        // checked above.
        Isa::Avx512 | Isa::Avx2 => unsafe { x86::dots(q, rows, scale, out) },
        Isa::Portable => {
            for (o, row) in out.iter_mut().zip(rows.chunks_exact(q.len().max(1))) {
                *o = dot_portable(q, row) * scale;
            }
        }
    }
}

/// `out += Σ_j p[j] · rows[j]` for the `p.len()` rows of `rows` (each `out.len()` long),
/// accumulated row by row.
pub(crate) fn weighted_rows(isa: Isa, p: &[f32], rows: &[f32], out: &mut [f32]) {
    assert_eq!(rows.len(), p.len() * out.len(), "weighted_rows: rows must be [p.len(), out.len()]");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dots`: AVX2 and FMA were detected before this variant was produced;
        // the lengths were checked above.
        Isa::Avx512 | Isa::Avx2 => unsafe { x86::weighted_rows(p, rows, out) },
        Isa::Portable => {
            for (&pj, row) in p.iter().zip(rows.chunks_exact(out.len().max(1))) {
                for (o, v) in out.iter_mut().zip(row) {
                    *o += pj * v;
                }
            }
        }
    }
}

/// Asks the CPU to bring `data` into L2 ahead of use (a hint: no effect on results, none at all
/// off x86-64).
pub(crate) fn prefetch_l2(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks(16) {
        use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
        // SAFETY: `_mm_prefetch` needs only SSE, which every x86-64 CPU has; a prefetch reads
        // nothing architecturally and never faults, and the address lies inside `data` anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T2>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Sums 8 lanes pairwise: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
fn reduce8(l: [f32; 8]) -> f32 {
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

    /// See [`super::dots`]. Four keys at a time, each in one 8-lane accumulator, reduced together.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `rows.len() == out.len() * q.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dots(q: &[f32], rows: &[f32], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let body = hd - hd % 8;
        let (qp, rp) = (q.as_ptr(), rows.as_ptr());
        let tail = |j: usize| -> f32 {
            let mut t = 0.0f32;
            for d in body..hd {
                t += q[d] * rows[j * hd + d];
            }
            t
        };
        let n = out.len();
        let mut j = 0;
        while j + 4 <= n {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut d = 0;
            while d < body {
                // SAFETY: d + 8 <= body <= hd, so the 8 floats at d lie inside q.
                let qv = unsafe { _mm256_loadu_ps(qp.add(d)) };
                for (i, a) in acc.iter_mut().enumerate() {
                    // SAFETY: j + i < n and d + 8 <= hd, so the 8 floats at (j+i)*hd + d lie
                    // inside rows' n*hd.
                    let kv = unsafe { _mm256_loadu_ps(rp.add((j + i) * hd + d)) };
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
                d += 8;
            }
            // Horizontal sums of the four accumulators at once: lane i of `s` is key j+i's sum.
            let h01 = _mm256_hadd_ps(acc[0], acc[1]);
            let h23 = _mm256_hadd_ps(acc[2], acc[3]);
            let h = _mm256_hadd_ps(h01, h23);
            let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            let mut sums = [0.0f32; 4];
            // SAFETY: `sums` holds exactly 4 floats.
            unsafe { _mm_storeu_ps(sums.as_mut_ptr(), s) };
            for (i, sum) in sums.iter().enumerate() {
                out[j + i] = (sum + tail(j + i)) * scale;
            }
            j += 4;
        }
        while j < n {
            let mut acc = _mm256_setzero_ps();
            let mut d = 0;
            while d < body {
                // SAFETY: d + 8 <= hd and j < n: both loads lie inside q and rows.
                let (qv, kv) = unsafe { (_mm256_loadu_ps(qp.add(d)), _mm256_loadu_ps(rp.add(j * hd + d))) };
                acc = _mm256_fmadd_ps(qv, kv, acc);
                d += 8;
            }
            out[j] = (hsum(acc) + tail(j)) * scale;
            j += 1;
        }
    }

    /// See [`super::weighted_rows`]. The output is kept in registers 32 floats at a time while
    /// all rows stream past; every element still accumulates row by row.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `rows.len() == p.len() * out.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn weighted_rows(p: &[f32], rows: &[f32], out: &mut [f32]) {
        let hd = out.len();
        let body = hd - hd % 8;
        let rp = rows.as_ptr();
        let op = out.as_mut_ptr();
        let mut d0 = 0;
        while d0 < body {
            let width = (body - d0).min(32) / 8;
            let mut acc = [_mm256_setzero_ps(); 4];
            for (i, a) in acc.iter_mut().enumerate().take(width) {
                // SAFETY: i < width, so d0 + 8i + 8 <= body <= hd: inside out.
                *a = unsafe { _mm256_loadu_ps(op.add(d0 + 8 * i)) };
            }
            for (j, &pj) in p.iter().enumerate() {
                let pv = _mm256_set1_ps(pj);
                for (i, a) in acc.iter_mut().enumerate().take(width) {
                    // SAFETY: j < p.len() and d0 + 8i + 8 <= hd, so the load lies inside rows'
                    // p.len()*hd floats.
                    let v = unsafe { _mm256_loadu_ps(rp.add(j * hd + d0 + 8 * i)) };
                    *a = _mm256_fmadd_ps(pv, v, *a);
                }
            }
            for (i, a) in acc.iter().enumerate().take(width) {
                // SAFETY: as for the loads above; `out` is a unique borrow.
                unsafe { _mm256_storeu_ps(op.add(d0 + 8 * i), *a) };
            }
            d0 += 8 * width;
        }
        for d in body..hd {
            for (j, &pj) in p.iter().enumerate() {
                out[d] += pj * rows[j * hd + d];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::SmallRng};

    #[test]
    fn dots_and_weighted_rows_match_f64_on_every_path() {
        let mut rng = SmallRng::seed_from_u64(11);
        for isa in Isa::all_available() {
            for hd in [1usize, 7, 8, 9, 20, 64, 67, 130] {
                for n in [0usize, 1, 3, 4, 5, 16, 17] {
                    let q: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let rows: Vec<f32> = (0..n * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let scale = rng.random_range(0.1f32..2.0);
                    let mut out = vec![f32::NAN; n];
                    dots(isa, &q, &rows, scale, &mut out);
                    for j in 0..n {
                        let want: f64 = scale as f64
                            * q.iter().zip(&rows[j * hd..(j + 1) * hd]).map(|(x, y)| *x as f64 * *y as f64).sum::<f64>();
                        assert!((out[j] as f64 - want).abs() < 1e-5, "{isa:?} hd {hd} n {n}: dots[{j}] {} vs {want}", out[j]);
                    }
                    let p: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..1.0)).collect();
                    let start: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let mut acc = start.clone();
                    weighted_rows(isa, &p, &rows, &mut acc);
                    for d in 0..hd {
                        let want = start[d] as f64 + (0..n).map(|j| p[j] as f64 * rows[j * hd + d] as f64).sum::<f64>();
                        assert!((acc[d] as f64 - want).abs() < 1e-5, "{isa:?} hd {hd} n {n}: weighted[{d}] {} vs {want}", acc[d]);
                    }
                }
            }
        }
    }

    #[test]
    fn reduce8_sums_all_lanes() {
        assert_eq!(reduce8([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]), 36.0);
    }
}
