//! Device tests: every CUDA kernel against its CPU reference (`tandem_kernels::cpu`, or an f64
//! reference written here where the CPU kernel is f32 only). They need a CUDA GPU, so every test is
//! `#[ignore]`d; `scripts/device-check.sh` runs them with `--ignored`.
//!
//! Every test: random inputs from a seeded RNG (never zeros), outputs poisoned with NaN bit
//! patterns before the launch, relative error ‖got − ref‖ / ‖ref‖ within 1e-2 for bf16 results
//! and 1e-4 for f32 ones, and no NaN anywhere in the outputs. The `check_*` bodies take their
//! shapes as arguments so more shapes are one line each.

use std::sync::{Mutex, MutexGuard, OnceLock};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tandem_kernels::cpu;
use tandem_kernels::cpu::PagedLayout;
use tandem_kernels::cuda::{self, CudaSlice, DeviceRepr, GemmOut, Gpu, GpuError, bf16};

/// One `Gpu` for the whole test binary, used by one test at a time (a cuBLAS handle is not
/// thread-safe, and serial tests keep the numbers reproducible).
fn gpu() -> MutexGuard<'static, Gpu> {
    static GPU: OnceLock<Mutex<Gpu>> = OnceLock::new();
    GPU.get_or_init(|| Mutex::new(Gpu::new(0).unwrap_or_else(|e| panic!("no usable GPU: {e}"))))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// `n` values uniform in `[-scale, scale]`, none exactly zero.
fn rand_f32(r: &mut SmallRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = r.random_range(-scale..scale);
            if v == 0.0 { scale * 0.5 } else { v }
        })
        .collect()
}

fn rand_bf16(r: &mut SmallRng, n: usize, scale: f32) -> Vec<bf16> {
    rand_f32(r, n, scale).into_iter().map(bf16::from_f32).collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

const NAN_BF16: bf16 = bf16::from_bits(0x7fc1);

fn poisoned_f32(gpu: &Gpu, n: usize) -> CudaSlice<f32> {
    gpu.upload(&vec![f32::from_bits(0x7fc0_0001); n]).unwrap()
}

fn poisoned_bf16(gpu: &Gpu, n: usize) -> CudaSlice<bf16> {
    gpu.upload(&vec![NAN_BF16; n]).unwrap()
}

fn down<T: DeviceRepr + Default + Clone>(gpu: &Gpu, s: &CudaSlice<T>) -> Vec<T> {
    gpu.download(&s.as_view()).unwrap()
}

/// ‖got − want‖ / ‖want‖ in f64.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - w).powi(2);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    if let Some(i) = got.iter().position(|v| v.is_nan()) {
        panic!("{what}: NaN at {i} (of {})", got.len());
    }
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

fn bf16_round(v: f64) -> f64 {
    f64::from(bf16::from_f64(v).to_f32())
}

// ---------------------------------------------------------------------------------------------
// Element-wise kernels

fn check_embedding(gpu: &Gpu, vocab: usize, h: usize, t: usize, seed: u64) {
    let mut r = rng(seed);
    let table = rand_bf16(&mut r, vocab * h, 1.0);
    let mut ids: Vec<u32> = (0..t).map(|_| r.random_range(0..vocab as u32)).collect();
    ids[t / 2] = vocab as u32 + 7; // out of range: a row of zeros
    let (dt, di) = (gpu.upload(&table).unwrap(), gpu.upload(&ids).unwrap());
    let mut out = poisoned_f32(gpu, t * h);
    cuda::embedding(gpu, &dt.as_view(), &di.as_view(), &mut out.as_view_mut()).unwrap();
    let got = down(gpu, &out);
    for (ti, &id) in ids.iter().enumerate() {
        for c in 0..h {
            let want = if (id as usize) < vocab { table[id as usize * h + c].to_f32() } else { 0.0 };
            assert_eq!(got[ti * h + c].to_bits(), want.to_bits(), "vocab={vocab} h={h} token {ti} col {c}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn embedding_gathers_rows() {
    let g = gpu();
    check_embedding(&g, 1000, 512, 9, 1); // vectorised
    check_embedding(&g, 300, 100, 5, 2); // scalar (h % 8 != 0)
}

/// HF's RMSNorm: `bf16(weight * bf16(x * rsqrt(mean(x²) + eps)))`, in f64 before the roundings.
fn check_rms_norm(gpu: &Gpu, t: usize, h: usize, with_delta: bool, seed: u64) {
    let mut r = rng(seed);
    let x = rand_f32(&mut r, t * h, 3.0);
    let delta = rand_f32(&mut r, t * h, 1.0);
    let w = rand_bf16(&mut r, h, 2.0);
    let eps = 1e-5f32;
    let mut dx = gpu.upload(&x).unwrap();
    let dd = gpu.upload(&delta).unwrap();
    let dw = gpu.upload(&w).unwrap();
    let mut out = poisoned_bf16(gpu, t * h);
    let dview = dd.as_view();
    cuda::rms_norm(gpu, &mut dx.as_view_mut(), with_delta.then_some(&dview), &dw.as_view(), eps, &mut out.as_view_mut()).unwrap();
    let summed: Vec<f32> = if with_delta { x.iter().zip(&delta).map(|(a, b)| a + b).collect() } else { x.clone() };
    assert_eq!(down(gpu, &dx), summed, "x must hold x + delta (or be unchanged)");
    let mut want = vec![0.0f64; t * h];
    for row in 0..t {
        let xs = &summed[row * h..(row + 1) * h];
        let ms = xs.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / h as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        for c in 0..h {
            want[row * h + c] = bf16_round(bf16_round(f64::from(xs[c]) * inv) * f64::from(w[c].to_f32()));
        }
    }
    // The CPU kernel (f32, no bf16 rounding) must agree too, within bf16 precision.
    let mut cpu_out = vec![f32::NAN; t * h];
    cpu::rms_norm(&summed, &to_f32(&w), eps, &mut cpu_out);
    let got = to_f32(&down(gpu, &out));
    assert_close(&format!("rms_norm t={t} h={h}"), &got, &want, 1e-2);
    let cpu_want: Vec<f64> = cpu_out.iter().map(|&v| f64::from(v)).collect();
    assert_close(&format!("rms_norm vs cpu t={t} h={h}"), &got, &cpu_want, 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn rms_norm_matches_hf_rounding() {
    let g = gpu();
    for (t, h, delta) in [(7, 4096, true), (3, 4096, false), (5, 1000, true), (4, 1001, true), (1, 8192, false)] {
        check_rms_norm(&g, t, h, delta, (t * h) as u64);
    }
}

fn check_rope(gpu: &Gpu, t: usize, q_heads: usize, kv_heads: usize, head_dim: usize, seed: u64) {
    let mut r = rng(seed);
    let row_stride = (q_heads + 2 * kv_heads) * head_dim;
    let rotated = q_heads + kv_heads;
    let qkv = rand_bf16(&mut r, t * row_stride, 2.0);
    let positions: Vec<i32> = (0..t).map(|i| if i == 0 { 0 } else { r.random_range(1..100_000) }).collect();
    let scaling = cpu::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let inv_freq = cpu::rope_inv_freq(head_dim, 500_000.0, &scaling);
    let mut dq = gpu.upload(&qkv).unwrap();
    let (dp, df) = (gpu.upload(&positions).unwrap(), gpu.upload(&inv_freq).unwrap());
    cuda::rope(gpu, &mut dq.as_view_mut(), &dp.as_view(), &df.as_view(), rotated, head_dim, row_stride).unwrap();
    let got = down(gpu, &dq);
    // CPU reference on the rotated columns, f32.
    let mut x: Vec<f32> = Vec::new();
    for row in qkv.chunks_exact(row_stride) {
        x.extend(row[..rotated * head_dim].iter().map(|v| v.to_f32()));
    }
    let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
    cpu::rope_in_place(&mut x, &pos, rotated, &inv_freq);
    let mut got_rot = Vec::new();
    for (row, orig) in got.chunks_exact(row_stride).zip(qkv.chunks_exact(row_stride)) {
        got_rot.extend(row[..rotated * head_dim].iter().map(|v| v.to_f32()));
        assert_eq!(&row[rotated * head_dim..], &orig[rotated * head_dim..], "columns past the rotated heads must not change");
    }
    let want: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    assert_close(&format!("rope hd={head_dim}"), &got_rot, &want, 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn rope_matches_cpu() {
    let g = gpu();
    check_rope(&g, 6, 8, 2, 128, 3);
    check_rope(&g, 5, 12, 4, 64, 4);
    check_rope(&g, 1, 32, 8, 128, 5);
}

fn check_silu_mul(gpu: &Gpu, t: usize, inter: usize, seed: u64) {
    let mut r = rng(seed);
    let gu = rand_bf16(&mut r, t * 2 * inter, 4.0);
    let d = gpu.upload(&gu).unwrap();
    let mut out = poisoned_bf16(gpu, t * inter);
    cuda::silu_mul(gpu, &d.as_view(), &mut out.as_view_mut(), inter).unwrap();
    let mut want = vec![f32::NAN; t * inter];
    cpu::silu_mul(&to_f32(&gu), &mut want, inter);
    let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
    assert_close(&format!("silu_mul t={t} inter={inter}"), &to_f32(&down(gpu, &out)), &want, 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn silu_mul_matches_cpu() {
    let g = gpu();
    check_silu_mul(&g, 3, 1000, 6);
    check_silu_mul(&g, 4, 13, 7);
    check_silu_mul(&g, 2, 14336, 8);
}

fn check_write_kv(gpu: &Gpu, layout: PagedLayout, num_blocks: usize, t: usize, seed: u64) {
    let mut r = rng(seed);
    let kv_cols = layout.num_kv_heads * layout.head_dim;
    let k_col = 4 * layout.head_dim; // four query heads first
    let row_stride = k_col + 2 * kv_cols + 8; // and some padding after V
    let qkv = rand_bf16(&mut r, t * row_stride, 1.0);
    // Distinct slots in random blocks; one padding entry, one slot in a block past the end.
    let mut slots: Vec<i32> = Vec::new();
    while slots.len() < t {
        let s = r.random_range(0..(num_blocks * layout.block_size) as i32);
        if !slots.contains(&s) {
            slots.push(s);
        }
    }
    slots[0] = -1;
    if t > 2 {
        slots[t - 1] = (num_blocks * layout.block_size) as i32 + 3;
    }
    let poison = bf16::from_bits(0x7f81);
    let cache_len = num_blocks * layout.block_elems();
    let mut cache = gpu.upload(&vec![poison; cache_len]).unwrap();
    let (dq, ds) = (gpu.upload(&qkv).unwrap(), gpu.upload(&slots).unwrap());
    cuda::write_kv(gpu, &dq.as_view(), &ds.as_view(), &mut cache.as_view_mut(), &layout, num_blocks, k_col, row_stride).unwrap();
    let got = down(gpu, &cache);
    // Reference: the CPU write_kv token by token (one-entry block tables), in f32.
    let mut want = vec![f32::from_bits(0x7f81_0000); cache_len];
    for (ti, &slot) in slots.iter().enumerate() {
        if slot < 0 || slot as usize >= num_blocks * layout.block_size {
            continue;
        }
        let (block, off) = (slot as usize / layout.block_size, slot as usize % layout.block_size);
        let row = &qkv[ti * row_stride..(ti + 1) * row_stride];
        let k = to_f32(&row[k_col..k_col + kv_cols]);
        let v = to_f32(&row[k_col + kv_cols..k_col + 2 * kv_cols]);
        cpu::write_kv(&mut want, &layout, &[block as u32], off, &k, &v);
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_f32().to_bits(), w.to_bits(), "cache element {i} ({layout:?})");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn write_kv_matches_cpu_layout() {
    let g = gpu();
    for (bs, kvh, hd) in [(16, 2, 64), (32, 8, 128), (8, 1, 128), (128, 4, 64)] {
        let layout = PagedLayout { block_size: bs, num_kv_heads: kvh, head_dim: hd };
        check_write_kv(&g, layout, 7, 11, (bs * kvh * hd) as u64);
    }
}

// ---------------------------------------------------------------------------------------------
// GEMM

#[derive(Clone, Copy, Debug)]
enum OutKind {
    Bf16,
    F32,
    F32Accumulate,
}

fn check_gemm(gpu: &Gpu, m: usize, n: usize, k: usize, kind: OutKind, seed: u64) {
    let mut r = rng(seed);
    let x = rand_bf16(&mut r, m * k, 1.0);
    let w = rand_bf16(&mut r, n * k, 1.0);
    let init = rand_f32(&mut r, m * n, 4.0);
    let (dx, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|c| f64::from(x[i * k + c].to_f32()) * f64::from(w[j * k + c].to_f32())).sum();
            want[i * n + j] = dot + if matches!(kind, OutKind::F32Accumulate) { f64::from(init[i * n + j]) } else { 0.0 };
        }
    }
    let what = format!("gemm {kind:?} m={m} n={n} k={k}");
    match kind {
        OutKind::Bf16 => {
            let mut out = poisoned_bf16(gpu, m * n);
            let mut view = out.as_view_mut();
            cuda::gemm(gpu, &dx.as_view(), &dw.as_view(), GemmOut::Bf16(&mut view), m, n, k).unwrap();
            assert_close(&what, &to_f32(&down(gpu, &out)), &want, 1e-2);
        }
        OutKind::F32 | OutKind::F32Accumulate => {
            let accumulate = matches!(kind, OutKind::F32Accumulate);
            let mut out = if accumulate { gpu.upload(&init).unwrap() } else { poisoned_f32(gpu, m * n) };
            let mut view = out.as_view_mut();
            cuda::gemm(gpu, &dx.as_view(), &dw.as_view(), GemmOut::F32 { out: &mut view, accumulate }, m, n, k).unwrap();
            assert_close(&what, &down(gpu, &out), &want, 1e-4);
        }
    }
    // CPU kernel agreement on one shape per call (f32 inputs from the same bf16 values).
    let mut cpu_out = vec![0.0f32; m * n];
    cpu::matmul_t(&to_f32(&x), &to_f32(&w), &mut cpu_out, m, k, n);
    let plain: Vec<f64> = want.iter().zip(&init).map(|(&v, &i)| if matches!(kind, OutKind::F32Accumulate) { v - f64::from(i) } else { v }).collect();
    assert_close(&format!("cpu matmul_t m={m}"), &cpu_out, &plain, 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn gemm_matches_f64_for_every_output_form() {
    let g = gpu();
    for kind in [OutKind::Bf16, OutKind::F32, OutKind::F32Accumulate] {
        for (m, n, k) in [(1, 24, 40), (3, 64, 128), (17, 40, 24), (64, 512, 1024), (5, 4096, 8)] {
            check_gemm(&g, m, n, k, kind, (m * 1000 + n + k) as u64);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shape checks: a bad shape is an error, never a panic or an out-of-bounds launch.

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn bad_shapes_are_errors() {
    let g = gpu();
    let x = g.alloc_zeros::<bf16>(3 * 16).unwrap();
    let w = g.alloc_zeros::<bf16>(8 * 16).unwrap();
    let mut small = g.alloc_zeros::<bf16>(10).unwrap();
    let mut view = small.as_view_mut();
    let e = cuda::gemm(&g, &x.as_view(), &w.as_view(), GemmOut::Bf16(&mut view), 3, 8, 16).unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
    let e = cuda::gemm(&g, &x.as_view(), &w.as_view(), GemmOut::Bf16(&mut small.as_view_mut()), 4, 8, 16).unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
    let gu = g.alloc_zeros::<bf16>(30).unwrap();
    let mut out = g.alloc_zeros::<bf16>(10).unwrap();
    let e = cuda::silu_mul(&g, &gu.as_view(), &mut out.as_view_mut(), 4).unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
    let mut upload_dst = g.alloc_zeros::<f32>(2).unwrap();
    let e = g.upload_into(&[1.0f32, 2.0, 3.0], &mut upload_dst.as_view_mut()).unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn gpu_reports_itself() {
    let g = gpu();
    let (major, _) = g.compute_capability();
    assert!(major >= 8, "the kernels need sm_80+, got {:?}", g.compute_capability());
    let (free, total) = g.mem_info().unwrap();
    assert!(free > 0 && free <= total);
    assert!(!g.name().is_empty());
    assert_eq!(g.ordinal(), 0);
    let mut buf = g.alloc_zeros::<f32>(4).unwrap();
    g.upload_into(&[1.0, 2.0], &mut buf.as_view_mut()).unwrap();
    assert_eq!(down(&g, &buf), vec![1.0, 2.0, 0.0, 0.0]);
}
