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
    rand_f32(r, n, scale)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
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
            let want = if (id as usize) < vocab {
                table[id as usize * h + c].to_f32()
            } else {
                0.0
            };
            assert_eq!(
                got[ti * h + c].to_bits(),
                want.to_bits(),
                "vocab={vocab} h={h} token {ti} col {c}"
            );
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

fn check_resolve_tokens(gpu: &Gpu, n: usize, num_sampled: usize, seed: u64) {
    let mut r = rng(seed);
    let sampled: Vec<u32> = (0..num_sampled).map(|_| r.random_range(1..50_000)).collect();
    // Half the tokens come from the sampler (in a random order), some indices are out of range.
    let src: Vec<i32> = (0..n)
        .map(|i| match i % 4 {
            0 | 1 => r.random_range(0..num_sampled as i32),
            2 => -1,
            _ => num_sampled as i32 + r.random_range(0..3),
        })
        .collect();
    let poison: Vec<u32> = (0..n).map(|_| 0xdead_0000 | r.random_range(0..0xffff)).collect();
    let mut ids = gpu.upload(&poison).unwrap();
    let (ds, dp) = (gpu.upload(&src).unwrap(), gpu.upload(&sampled).unwrap());
    cuda::resolve_tokens(gpu, &mut ids.as_view_mut(), &ds.as_view(), &dp.as_view()).unwrap();
    let got = down(gpu, &ids);
    let want: Vec<u32> = src
        .iter()
        .zip(&poison)
        .map(|(&s, &p)| if s >= 0 && (s as usize) < num_sampled { sampled[s as usize] } else { p })
        .collect();
    assert_eq!(got, want, "n={n} sampled={num_sampled}");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn resolve_tokens_takes_ids_from_the_sampler() {
    let g = gpu();
    check_resolve_tokens(&g, 1, 1, 1);
    check_resolve_tokens(&g, 300, 256, 2);
    check_resolve_tokens(&g, 2048, 17, 3);
}

/// Page-locked staging: uploads land, two downloads in flight come back intact, and waiting for
/// a download whose slot was reused is an error, never the newer data.
#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn staging_round_trips_and_refuses_overwritten_copies() {
    let g = gpu();
    let mut r = rng(9);
    let mut up = cuda::Staging::<u32>::new(&g, 1000).unwrap();
    let mut down_stage = cuda::Staging::<u32>::new(&g, 1000).unwrap();
    let data: Vec<Vec<u32>> = (0..3).map(|_| (0..1000).map(|_| r.random_range(1..u32::MAX)).collect()).collect();
    let mut bufs: Vec<CudaSlice<u32>> = (0..3).map(|_| g.upload(&vec![0xdead_beef_u32; 1000]).unwrap()).collect();
    for (d, b) in data.iter().zip(&mut bufs) {
        up.upload(&g, d, &mut b.slice_mut(..)).unwrap();
    }
    let first = down_stage.download(&g, &bufs[0].slice(0..700)).unwrap();
    let second = down_stage.download(&g, &bufs[1].slice(..)).unwrap();
    assert_eq!(down_stage.wait(first).unwrap(), &data[0][..700]);
    assert_eq!(down_stage.wait(second).unwrap(), &data[1][..]);
    let third = down_stage.download(&g, &bufs[2].slice(..)).unwrap();
    assert!(matches!(down_stage.wait(first), Err(GpuError::BadShape(_))), "slot of the first copy reused");
    assert_eq!(down_stage.wait(third).unwrap(), &data[2][..]);
    assert!(matches!(up.upload(&g, &vec![1u32; 1001], &mut bufs[0].slice_mut(..)), Err(GpuError::BadShape(_))));
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
    cuda::rms_norm(
        gpu,
        &mut dx.as_view_mut(),
        with_delta.then_some(&dview),
        &dw.as_view(),
        eps,
        &mut out.as_view_mut(),
    )
    .unwrap();
    let summed: Vec<f32> = if with_delta {
        x.iter().zip(&delta).map(|(a, b)| a + b).collect()
    } else {
        x.clone()
    };
    assert_eq!(
        down(gpu, &dx),
        summed,
        "x must hold x + delta (or be unchanged)"
    );
    let mut want = vec![0.0f64; t * h];
    for row in 0..t {
        let xs = &summed[row * h..(row + 1) * h];
        let ms = xs.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / h as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        for c in 0..h {
            want[row * h + c] =
                bf16_round(bf16_round(f64::from(xs[c]) * inv) * f64::from(w[c].to_f32()));
        }
    }
    // The CPU kernel (f32, no bf16 rounding) must agree too, within bf16 precision.
    let mut cpu_out = vec![f32::NAN; t * h];
    cpu::rms_norm(&summed, &to_f32(&w), eps, &mut cpu_out);
    let got = to_f32(&down(gpu, &out));
    assert_close(&format!("rms_norm t={t} h={h}"), &got, &want, 1e-2);
    let cpu_want: Vec<f64> = cpu_out.iter().map(|&v| f64::from(v)).collect();
    assert_close(
        &format!("rms_norm vs cpu t={t} h={h}"),
        &got,
        &cpu_want,
        1e-2,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn rms_norm_matches_hf_rounding() {
    let g = gpu();
    for (t, h, delta) in [
        (7, 4096, true),
        (3, 4096, false),
        (5, 1000, true),
        (4, 1001, true),
        (1, 8192, false),
    ] {
        check_rms_norm(&g, t, h, delta, (t * h) as u64);
    }
}

fn check_rope(gpu: &Gpu, t: usize, q_heads: usize, kv_heads: usize, head_dim: usize, seed: u64) {
    let mut r = rng(seed);
    let row_stride = (q_heads + 2 * kv_heads) * head_dim;
    let rotated = q_heads + kv_heads;
    let qkv = rand_bf16(&mut r, t * row_stride, 2.0);
    let positions: Vec<i32> = (0..t)
        .map(|i| {
            if i == 0 {
                0
            } else {
                r.random_range(1..100_000)
            }
        })
        .collect();
    let scaling = cpu::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let inv_freq = cpu::rope_inv_freq(head_dim, 500_000.0, &scaling);
    let mut dq = gpu.upload(&qkv).unwrap();
    let (dp, df) = (
        gpu.upload(&positions).unwrap(),
        gpu.upload(&inv_freq).unwrap(),
    );
    cuda::rope(
        gpu,
        &mut dq.as_view_mut(),
        &dp.as_view(),
        &df.as_view(),
        rotated,
        head_dim,
        row_stride,
    )
    .unwrap();
    let got = down(gpu, &dq);
    // CPU reference on the rotated columns, f32.
    let mut x: Vec<f32> = Vec::new();
    for row in qkv.chunks_exact(row_stride) {
        x.extend(row[..rotated * head_dim].iter().map(|v| v.to_f32()));
    }
    let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
    cpu::rope_in_place(&mut x, &pos, rotated, &inv_freq);
    let mut got_rot = Vec::new();
    for (row, orig) in got
        .chunks_exact(row_stride)
        .zip(qkv.chunks_exact(row_stride))
    {
        got_rot.extend(row[..rotated * head_dim].iter().map(|v| v.to_f32()));
        assert_eq!(
            &row[rotated * head_dim..],
            &orig[rotated * head_dim..],
            "columns past the rotated heads must not change"
        );
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
    assert_close(
        &format!("silu_mul t={t} inter={inter}"),
        &to_f32(&down(gpu, &out)),
        &want,
        1e-2,
    );
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
    let poison = NAN_BF16;
    let cache_len = num_blocks * layout.block_elems();
    let mut cache = gpu.upload(&vec![poison; cache_len]).unwrap();
    let (dq, ds) = (gpu.upload(&qkv).unwrap(), gpu.upload(&slots).unwrap());
    cuda::write_kv(
        gpu,
        &dq.as_view(),
        &ds.as_view(),
        &mut cache.as_view_mut(),
        &layout,
        num_blocks,
        k_col,
        row_stride,
    )
    .unwrap();
    let got = down(gpu, &cache);
    // Reference: the CPU write_kv token by token (one-entry block tables), in f32.
    let mut want = vec![NAN_BF16.to_f32(); cache_len];
    for (ti, &slot) in slots.iter().enumerate() {
        if slot < 0 || slot as usize >= num_blocks * layout.block_size {
            continue;
        }
        let (block, off) = (
            slot as usize / layout.block_size,
            slot as usize % layout.block_size,
        );
        let row = &qkv[ti * row_stride..(ti + 1) * row_stride];
        let k = to_f32(&row[k_col..k_col + kv_cols]);
        let v = to_f32(&row[k_col + kv_cols..k_col + 2 * kv_cols]);
        cpu::write_kv(&mut want, &layout, &[block as u32], off, &k, &v);
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_f32().to_bits(),
            w.to_bits(),
            "cache element {i} ({layout:?})"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn write_kv_matches_cpu_layout() {
    let g = gpu();
    for (bs, kvh, hd) in [(16, 2, 64), (32, 8, 128), (8, 1, 128), (128, 4, 64)] {
        let layout = PagedLayout {
            block_size: bs,
            num_kv_heads: kvh,
            head_dim: hd,
        };
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
            let dot: f64 = (0..k)
                .map(|c| f64::from(x[i * k + c].to_f32()) * f64::from(w[j * k + c].to_f32()))
                .sum();
            want[i * n + j] = dot
                + if matches!(kind, OutKind::F32Accumulate) {
                    f64::from(init[i * n + j])
                } else {
                    0.0
                };
        }
    }
    let what = format!("gemm {kind:?} m={m} n={n} k={k}");
    match kind {
        OutKind::Bf16 => {
            let mut out = poisoned_bf16(gpu, m * n);
            let mut view = out.as_view_mut();
            cuda::gemm(
                gpu,
                &dx.as_view(),
                &dw.as_view(),
                GemmOut::Bf16(&mut view),
                m,
                n,
                k,
            )
            .unwrap();
            assert_close(&what, &to_f32(&down(gpu, &out)), &want, 1e-2);
        }
        OutKind::F32 | OutKind::F32Accumulate => {
            let accumulate = matches!(kind, OutKind::F32Accumulate);
            let mut out = if accumulate {
                gpu.upload(&init).unwrap()
            } else {
                poisoned_f32(gpu, m * n)
            };
            let mut view = out.as_view_mut();
            cuda::gemm(
                gpu,
                &dx.as_view(),
                &dw.as_view(),
                GemmOut::F32 {
                    out: &mut view,
                    accumulate,
                },
                m,
                n,
                k,
            )
            .unwrap();
            assert_close(&what, &down(gpu, &out), &want, 1e-4);
        }
    }
    // CPU kernel agreement on one shape per call (f32 inputs from the same bf16 values).
    let mut cpu_out = vec![0.0f32; m * n];
    cpu::matmul_t(&to_f32(&x), &to_f32(&w), &mut cpu_out, m, k, n);
    let plain: Vec<f64> = want
        .iter()
        .zip(&init)
        .map(|(&v, &i)| {
            if matches!(kind, OutKind::F32Accumulate) {
                v - f64::from(i)
            } else {
                v
            }
        })
        .collect();
    assert_close(&format!("cpu matmul_t m={m}"), &cpu_out, &plain, 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn gemm_matches_f64_for_every_output_form() {
    let g = gpu();
    for kind in [OutKind::Bf16, OutKind::F32, OutKind::F32Accumulate] {
        for (m, n, k) in [
            (1, 24, 40),
            (3, 64, 128),
            (17, 40, 24),
            (64, 512, 1024),
            (5, 4096, 8),
        ] {
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
    let e = cuda::gemm(
        &g,
        &x.as_view(),
        &w.as_view(),
        GemmOut::Bf16(&mut view),
        3,
        8,
        16,
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
    let e = cuda::gemm(
        &g,
        &x.as_view(),
        &w.as_view(),
        GemmOut::Bf16(&mut small.as_view_mut()),
        4,
        8,
        16,
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
    let gu = g.alloc_zeros::<bf16>(30).unwrap();
    let mut out = g.alloc_zeros::<bf16>(10).unwrap();
    let e = cuda::silu_mul(&g, &gu.as_view(), &mut out.as_view_mut(), 4).unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
    let mut upload_dst = g.alloc_zeros::<f32>(2).unwrap();
    let e = g
        .upload_into(&[1.0f32, 2.0, 3.0], &mut upload_dst.as_view_mut())
        .unwrap_err();
    assert!(matches!(e, GpuError::BadShape(_)), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn gpu_reports_itself() {
    let g = gpu();
    let (major, _) = g.compute_capability();
    assert!(
        major >= 8,
        "the kernels need sm_80+, got {:?}",
        g.compute_capability()
    );
    let (free, total) = g.mem_info().unwrap();
    assert!(free > 0 && free <= total);
    assert!(!g.name().is_empty());
    assert_eq!(g.ordinal(), 0);
    let mut buf = g.alloc_zeros::<f32>(4).unwrap();
    g.upload_into(&[1.0, 2.0], &mut buf.as_view_mut()).unwrap();
    assert_eq!(down(&g, &buf), vec![1.0, 2.0, 0.0, 0.0]);
}

// ---------------------------------------------------------------------------------------------
// Attention

/// One attention batch: per chunk `(start_pos, len)`; `decode` runs decode_attention (every len
/// must be 1). `context_slack` is added to the host's max_context bound (empty splits).
struct AttnCase {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    chunks: Vec<(usize, usize)>,
    decode: bool,
    context_slack: usize,
    /// Replace one in-range block-table entry of the last chunk with -1 (its keys are masked).
    hole: bool,
    /// Decode only: keys per split (`None`: the launcher's choice).
    split_keys: Option<usize>,
}

/// f64 reference: query at position p attends to positions 0..=p whose block id is in range.
fn attention_reference(
    case: &AttnCase,
    q: &[bf16],
    stride: usize,
    cache: &[bf16],
    tables: &[Vec<i32>],
    num_blocks: usize,
) -> Vec<f64> {
    let (hd, bs, kvh) = (case.head_dim, case.block_size, case.kv_heads);
    let group = case.heads / kvh;
    let layout = PagedLayout {
        block_size: bs,
        num_kv_heads: kvh,
        head_dim: hd,
    };
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = Vec::new();
    for (c, &(sp, len)) in case.chunks.iter().enumerate() {
        let first: usize = case.chunks[..c].iter().map(|x| x.1).sum();
        for t in 0..len {
            let p = sp + t;
            for h in 0..case.heads {
                let qv: Vec<f64> = (0..hd)
                    .map(|d| f64::from(q[(first + t) * stride + h * hd + d].to_f32()))
                    .collect();
                let mut scores = Vec::new();
                let mut rows = Vec::new();
                for kp in 0..=p {
                    let id = tables[c][kp / bs];
                    if id < 0 || id as usize >= num_blocks {
                        continue;
                    }
                    let ko = layout.k_offset(id as u32, h / group, kp % bs);
                    let vo = layout.v_offset(id as u32, h / group, kp % bs);
                    let s: f64 = (0..hd)
                        .map(|d| qv[d] * f64::from(cache[ko + d].to_f32()))
                        .sum::<f64>()
                        * scale;
                    scores.push(s);
                    rows.push(vo);
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let v: f64 = w
                        .iter()
                        .zip(&rows)
                        .map(|(w, &vo)| w * f64::from(cache[vo + d].to_f32()))
                        .sum();
                    out.push(if z > 0.0 { v / z } else { 0.0 });
                }
            }
        }
    }
    out
}

fn check_attention(gpu: &Gpu, case: &AttnCase, seed: u64) {
    let mut r = rng(seed);
    let (hd, bs, kvh, nh) = (case.head_dim, case.block_size, case.kv_heads, case.heads);
    let stride = (nh + 2 * kvh) * hd; // a qkv row: q heads, then K and V
    let t_total: usize = case.chunks.iter().map(|c| c.1).sum();
    let needed: Vec<usize> = case
        .chunks
        .iter()
        .map(|&(sp, len)| (sp + len).div_ceil(bs))
        .collect();
    let num_blocks = needed.iter().sum::<usize>() + 5;
    // Scattered, non-contiguous block ids: a shuffled pool.
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, r.random_range(0..=i));
    }
    let max_blocks = needed.iter().max().copied().unwrap_or(0) + 2;
    let mut tables: Vec<Vec<i32>> = Vec::new();
    for (c, &n) in needed.iter().enumerate() {
        let mut row: Vec<i32> = pool.drain(..n).collect();
        row.resize(max_blocks, -1);
        if c == 0 {
            row[max_blocks - 1] = (num_blocks + 3) as i32; // garbage in the padding: never read
        }
        tables.push(row);
    }
    if case.hole {
        let last = tables.len() - 1;
        let n = needed[last];
        tables[last][n / 2] = -1;
    }
    let layout = PagedLayout {
        block_size: bs,
        num_kv_heads: kvh,
        head_dim: hd,
    };
    let cache = rand_bf16(&mut r, num_blocks * layout.block_elems(), 1.0);
    let q = rand_bf16(&mut r, t_total * stride, 2.0);
    let mut cu_q = vec![0i32];
    for &(_, len) in &case.chunks {
        cu_q.push(cu_q.last().unwrap() + len as i32);
    }
    let start_pos: Vec<i32> = case.chunks.iter().map(|c| c.0 as i32).collect();
    let flat_tables: Vec<i32> = tables.concat();
    let (dq, dc) = (gpu.upload(&q).unwrap(), gpu.upload(&cache).unwrap());
    let (dcu, dsp, dbt) = (
        gpu.upload(&cu_q).unwrap(),
        gpu.upload(&start_pos).unwrap(),
        gpu.upload(&flat_tables).unwrap(),
    );
    let mut out = poisoned_bf16(gpu, t_total * nh * hd);
    let (cu_v, sp_v, bt_v) = (dcu.as_view(), dsp.as_view(), dbt.as_view());
    let meta = cuda::AttnMeta {
        cu_q: &cu_v,
        start_pos: &sp_v,
        block_tables: &bt_v,
        num_chunks: case.chunks.len(),
        max_blocks,
        max_q_len: case.chunks.iter().map(|c| c.1).max().unwrap_or(0),
        max_context: case.chunks.iter().map(|c| c.0 + c.1).max().unwrap_or(0) + case.context_slack,
    };
    let shape = cuda::AttnShape {
        num_heads: nh,
        num_kv_heads: kvh,
        head_dim: hd,
        block_size: bs,
        num_blocks,
        q_row_stride: stride,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    if case.decode {
        let ws_len = cuda::decode_workspace_len(meta.num_chunks, &shape, meta.max_context);
        let split = case.split_keys.unwrap_or_else(|| cuda::decode_split_keys(meta.num_chunks, kvh, meta.max_context));
        let splits = meta.max_context.div_ceil(split);
        let ws_len = ws_len.max(meta.num_chunks * nh * splits * (hd + 2));
        let mut ws = poisoned_f32(gpu, ws_len.max(1));
        cuda::decode_attention_split(
            gpu,
            &dq.as_view(),
            &meta,
            &shape,
            &dc.as_view(),
            split,
            &mut ws.as_view_mut(),
            &mut out.as_view_mut(),
        )
        .unwrap();
    } else {
        cuda::prefill_attention(
            gpu,
            &dq.as_view(),
            &meta,
            &shape,
            &dc.as_view(),
            &mut out.as_view_mut(),
        )
        .unwrap();
    }
    let got = to_f32(&down(gpu, &out));
    let want = attention_reference(case, &q, stride, &cache, &tables, num_blocks);
    let what = format!(
        "{} hd={hd} heads={nh}/{kvh} bs={bs} chunks={:?} split={:?}",
        if case.decode { "decode" } else { "prefill" },
        case.chunks,
        case.split_keys,
    );
    assert_close(&what, &got, &want, 1e-2);
    // Without holes the CPU kernel (f32) agrees as well.
    if !case.hole {
        let qf: Vec<f32> = q
            .chunks_exact(stride)
            .flat_map(|row| row[..nh * hd].iter().map(|v| v.to_f32()))
            .collect();
        let tables_u32: Vec<Vec<u32>> = tables
            .iter()
            .zip(&needed)
            .map(|(t, &n)| t[..n].iter().map(|&b| b as u32).collect())
            .collect();
        let chunks: Vec<cpu::AttentionChunk<'_>> = case
            .chunks
            .iter()
            .enumerate()
            .map(|(c, &(sp, len))| cpu::AttentionChunk {
                first_token: cu_q[c] as usize,
                len,
                start_pos: sp,
                block_table: &tables_u32[c],
            })
            .collect();
        let mut cpu_out = vec![f32::NAN; t_total * nh * hd];
        cpu::paged_attention(&qf, &chunks, &to_f32(&cache), &layout, nh, &mut cpu_out);
        let cpu_want: Vec<f64> = cpu_out.iter().map(|&v| f64::from(v)).collect();
        assert_close(&format!("{what} vs cpu"), &got, &cpu_want, 1e-2);
    }
}

/// Every (head_dim, group, block_size) combination the tests cover.
fn attention_geometries() -> Vec<(usize, usize, usize, usize)> {
    let mut v = Vec::new();
    for hd in [64, 128] {
        for (heads, kv_heads) in [(2, 2), (6, 2), (16, 2)] {
            for bs in [16, 32] {
                v.push((hd, heads, kv_heads, bs));
            }
        }
    }
    v
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn prefill_attention_matches_reference() {
    let g = gpu();
    for (i, (hd, heads, kv_heads, bs)) in attention_geometries().into_iter().enumerate() {
        // A fresh prompt, a chunk continuing a cached prefix, a one-token chunk, a long chunk.
        let chunks = vec![(0, 70), (100, 33), (37, 1), (5, 130)];
        for hole in [false, true] {
            let case = AttnCase {
                heads,
                kv_heads,
                head_dim: hd,
                block_size: bs,
                chunks: chunks.clone(),
                decode: false,
                context_slack: 0,
                hole,
                split_keys: None,
            };
            check_attention(&g, &case, 100 + i as u64);
        }
    }
    // Group 8 with 8 KV heads, and block sizes at the ends of the range.
    for bs in [8, 128] {
        let case = AttnCase {
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            block_size: bs,
            chunks: vec![(0, 40), (200, 25)],
            decode: false,
            context_slack: 0,
            hole: false,
            split_keys: None,
        };
        check_attention(&g, &case, 7 + bs as u64);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn decode_attention_matches_reference() {
    let g = gpu();
    for (i, (hd, heads, kv_heads, bs)) in attention_geometries().into_iter().enumerate() {
        // Contexts 1, 17, 1000, 5000: one split up to 256 keys, many beyond.
        let chunks = vec![(0, 1), (16, 1), (999, 1), (4999, 1)];
        let case = AttnCase {
            heads,
            kv_heads,
            head_dim: hd,
            block_size: bs,
            chunks,
            decode: true,
            context_slack: 0,
            hole: false,
            split_keys: None,
        };
        check_attention(&g, &case, 200 + i as u64);
        // A single split (max_context <= 256), and a bound far above the real contexts (a graph
        // captured for a longer context: most splits are empty), with a hole.
        let case = AttnCase {
            heads,
            kv_heads,
            head_dim: hd,
            block_size: bs,
            chunks: vec![(0, 1), (16, 1), (200, 1)],
            decode: true,
            context_slack: 0,
            hole: false,
            split_keys: None,
        };
        check_attention(&g, &case, 300 + i as u64);
        let case = AttnCase {
            heads,
            kv_heads,
            head_dim: hd,
            block_size: bs,
            chunks: vec![(40, 1), (700, 1)],
            decode: true,
            context_slack: 3000,
            hole: true,
            split_keys: None,
        };
        check_attention(&g, &case, 400 + i as u64);
    }
    // Every split length from the shortest to one covering the whole context, and the ends of
    // the block-size range (16-key groups spanning two blocks; one block holding many groups).
    for split in [64, 128, 512, 1024, 2048] {
        for (bs, heads, kv_heads) in [(8, 64, 8), (128, 32, 8), (16, 9, 3)] {
            let case = AttnCase {
                heads,
                kv_heads,
                head_dim: if heads == 9 { 64 } else { 128 },
                block_size: bs,
                chunks: vec![(0, 1), (63, 1), (64, 1), (1000, 1), (2047, 1)],
                decode: true,
                context_slack: 100,
                hole: bs == 8,
                split_keys: Some(split),
            };
            check_attention(&g, &case, 500 + split as u64 + bs as u64);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn attention_rejects_unsupported_shapes() {
    let g = gpu();
    let q = g.alloc_zeros::<bf16>(96 * 4).unwrap();
    let cache = g.alloc_zeros::<bf16>(2 * 2 * 16 * 96).unwrap();
    let meta_buf = g.upload(&[0i32, 1]).unwrap();
    let sp = g.upload(&[0i32]).unwrap();
    let bt = g.upload(&[0i32]).unwrap();
    let (cu_v, sp_v, bt_v) = (meta_buf.as_view(), sp.as_view(), bt.as_view());
    let meta = cuda::AttnMeta {
        cu_q: &cu_v,
        start_pos: &sp_v,
        block_tables: &bt_v,
        num_chunks: 1,
        max_blocks: 1,
        max_q_len: 1,
        max_context: 1,
    };
    let mut out = g.alloc_zeros::<bf16>(96 * 4).unwrap();
    let base = cuda::AttnShape {
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 96,
        block_size: 16,
        num_blocks: 1,
        q_row_stride: 384,
        scale: 0.1,
    };
    let bad = [
        base,
        cuda::AttnShape {
            head_dim: 64,
            num_heads: 3,
            num_kv_heads: 2,
            q_row_stride: 256,
            ..base
        },
        cuda::AttnShape {
            head_dim: 64,
            num_heads: 34,
            num_kv_heads: 2,
            q_row_stride: 34 * 64,
            ..base
        },
        cuda::AttnShape {
            head_dim: 64,
            block_size: 12,
            q_row_stride: 256,
            ..base
        },
        cuda::AttnShape {
            head_dim: 64,
            num_blocks: 100,
            q_row_stride: 256,
            ..base
        },
    ];
    for shape in bad {
        let e = cuda::prefill_attention(
            &g,
            &q.as_view(),
            &meta,
            &shape,
            &cache.as_view(),
            &mut out.as_view_mut(),
        )
        .unwrap_err();
        assert!(matches!(e, GpuError::BadShape(_)), "{shape:?}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Sampling

/// One row to sample: logits, parameters and `(token, output count)` penalty entries.
struct SampleRow {
    logits: Vec<f32>,
    params: cuda::SampleParams,
    pen: Vec<(i32, i32)>,
}

/// The f64 reference of the GPU sampler's semantics (module doc of `cuda::sample`), sort-based.
/// Returns the token, its logprob and the penalised row, or `None` when a filter cut or the draw
/// lies within 1e-6 (relative) of its target, where f32 weights may legitimately go either way.
fn sample_reference(row: &SampleRow) -> Option<(u32, f64, Vec<f32>)> {
    let p = &row.params;
    let mut l: Vec<f32> = row
        .logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                v.min(f32::MAX) + 0.0
            }
        })
        .collect();
    for &(t, count) in &row.pen {
        let Some(v) = l.get_mut(t as usize) else {
            continue;
        };
        if p.repetition != 1.0 {
            *v = if *v > 0.0 {
                *v / p.repetition
            } else {
                *v * p.repetition
            };
        }
        if count > 0 && (p.presence != 0.0 || p.frequency != 0.0) {
            *v -= p.presence + p.frequency * count as f32;
        }
    }
    let max = l
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let argmax = l.iter().position(|&v| v == max).unwrap_or(0) as u32;
    if max == f32::NEG_INFINITY {
        return Some((0, f64::NEG_INFINITY, l));
    }
    if p.temperature == 0.0 {
        let lse = f64::from(max)
            + l.iter()
                .map(|&v| (f64::from(v) - f64::from(max)).exp())
                .sum::<f64>()
                .ln();
        return Some((argmax, f64::from(l[argmax as usize]) - lse, l));
    }
    let inv = 1.0 / p.temperature;
    let work: Vec<f32> = l.iter().map(|&v| (v - max) * inv).collect();
    let w: Vec<f64> = work.iter().map(|&x| f64::from(x).exp()).collect();
    let lse = w.iter().sum::<f64>().ln();
    let mut cands: Vec<u32> = (0..l.len() as u32)
        .filter(|&i| work[i as usize] > f32::NEG_INFINITY)
        .collect();
    cands.sort_by(|&a, &b| {
        work[b as usize]
            .total_cmp(&work[a as usize])
            .then(a.cmp(&b))
    });
    let near = |a: f64, b: f64, scale: f64| (a - b).abs() <= 1e-6 * scale;
    if p.top_k > 0 && (p.top_k as usize) < l.len() {
        cands.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let total: f64 = cands.iter().map(|&i| w[i as usize]).sum();
        let target = f64::from(p.top_p) * total;
        let mut cum = 0.0;
        let mut keep = 0;
        for &i in &cands {
            if near(cum, target, total) {
                return None;
            }
            if cum >= target {
                break;
            }
            cum += w[i as usize];
            keep += 1;
        }
        cands.truncate(keep);
    }
    if p.min_p > 0.0 {
        let thr = f64::from(p.min_p);
        if cands.iter().any(|&i| near(w[i as usize], thr, 1.0)) {
            return None;
        }
        cands.retain(|&i| w[i as usize] >= thr);
    }
    let total: f64 = cands.iter().map(|&i| w[i as usize]).sum();
    let target = f64::from(p.uniform) * total;
    let mut cum = 0.0;
    let mut token = argmax;
    for &i in &cands {
        cum += w[i as usize];
        if near(cum, target, total) {
            return None;
        }
        if target < cum {
            token = i;
            break;
        }
    }
    Some((token, f64::from(work[token as usize]) - lse, l))
}

/// Samples `rows` in one launch and checks each against [`sample_reference`]; a row whose
/// reference is ambiguous gets a different draw until it is not.
fn check_sampling(gpu: &Gpu, mut rows: Vec<SampleRow>, what: &str) {
    let vocab = rows[0].logits.len();
    for row in &mut rows {
        let mut tries = 0;
        while sample_reference(row).is_none() {
            row.params.uniform = (row.params.uniform + 0.377).fract();
            row.params.top_p = if row.params.top_p < 1.0 {
                row.params.top_p * 0.99
            } else {
                1.0
            };
            row.params.min_p *= 1.01;
            tries += 1;
            assert!(tries < 20, "{what}: could not find an unambiguous draw");
        }
    }
    let logits: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
    let params: Vec<cuda::SampleParams> = rows.iter().map(|r| r.params).collect();
    let mut offsets = vec![0i32];
    let (mut toks, mut counts) = (Vec::new(), Vec::new());
    for r in &rows {
        for &(t, c) in &r.pen {
            toks.push(t);
            counts.push(c);
        }
        offsets.push(toks.len() as i32);
    }
    // Never empty buffers: a zero-length allocation is not a valid device pointer.
    toks.push(0);
    counts.push(0);
    let mut dl = gpu.upload(&logits).unwrap();
    let dp = gpu.upload(&params).unwrap();
    let (doff, dtok, dcnt) = (
        gpu.upload(&offsets).unwrap(),
        gpu.upload(&toks).unwrap(),
        gpu.upload(&counts).unwrap(),
    );
    let mut out_t = gpu.upload(&vec![u32::MAX; rows.len()]).unwrap();
    let mut out_lp = poisoned_f32(gpu, rows.len());
    let dtok_view = dtok.slice(0..toks.len() - 1);
    cuda::sample(
        gpu,
        &mut dl.as_view_mut(),
        vocab,
        &dp.as_view(),
        &doff.as_view(),
        &dtok_view,
        &dcnt.as_view(),
        &mut out_t.as_view_mut(),
        &mut out_lp.as_view_mut(),
    )
    .unwrap();
    let (got_t, got_lp, got_rows) = (down(gpu, &out_t), down(gpu, &out_lp), down(gpu, &dl));
    for (i, row) in rows.iter().enumerate() {
        let (token, logprob, penalised) = sample_reference(row).unwrap();
        let ctx = format!(
            "{what}, row {i} ({:?}, {} penalties)",
            row.params,
            row.pen.len()
        );
        assert_eq!(got_t[i], token, "{ctx}: token");
        assert!(!got_lp[i].is_nan(), "{ctx}: NaN logprob");
        if logprob == f64::NEG_INFINITY {
            assert_eq!(got_lp[i], f32::NEG_INFINITY, "{ctx}: logprob");
        } else {
            assert!(
                (f64::from(got_lp[i]) - logprob).abs() <= 1e-4,
                "{ctx}: logprob {} vs {logprob}",
                got_lp[i]
            );
        }
        let got_row = &got_rows[i * vocab..(i + 1) * vocab];
        for (j, (g, w)) in got_row.iter().zip(&penalised).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ctx}: penalised logit {j}");
        }
    }
}

fn sample_rows(vocab: usize, seed: u64) -> Vec<SampleRow> {
    let mut r = rng(seed);
    let base = cuda::SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition: 1.0,
        presence: 0.0,
        frequency: 0.0,
        uniform: 0.5,
    };
    let with = |f: &dyn Fn(&mut cuda::SampleParams)| {
        let mut p = base;
        f(&mut p);
        p
    };
    let params = vec![
        with(&|p| p.temperature = 0.0),
        with(&|p| p.temperature = 0.7),
        with(&|p| {
            p.temperature = 1.3;
            p.uniform = 0.93;
        }),
        with(&|p| p.top_k = 1),
        with(&|p| {
            p.top_k = 5;
            p.uniform = 0.8;
        }),
        with(&|p| {
            p.top_k = 50;
            p.temperature = 0.8;
            p.uniform = 0.2;
        }),
        with(&|p| p.top_p = 0.9),
        with(&|p| {
            p.top_p = 0.5;
            p.temperature = 0.6;
            p.uniform = 0.99;
        }),
        with(&|p| p.min_p = 0.1),
        with(&|p| {
            p.top_k = 40;
            p.top_p = 0.9;
            p.min_p = 0.05;
            p.uniform = 0.3;
        }),
        with(&|p| {
            p.temperature = 0.0;
            p.repetition = 1.3;
            p.presence = 0.5;
            p.frequency = 0.2;
        }),
        with(&|p| {
            p.temperature = 0.9;
            p.repetition = 1.2;
            p.presence = 0.4;
            p.frequency = 0.3;
            p.top_p = 0.95;
            p.uniform = 0.61;
        }),
        with(&|p| p.uniform = 0.0),
    ];
    params
        .into_iter()
        .enumerate()
        .map(|(i, params)| {
            let mut logits = rand_f32(&mut r, vocab, 8.0);
            // Sharp rows: a few clear favourites.
            for _ in 0..4 {
                let j = r.random_range(0..vocab);
                logits[j] += 12.0;
            }
            if i == 0 {
                // A tie for the maximum: the lower id wins.
                let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                logits[vocab - 1] = m;
                logits[1] = m;
            }
            let pen = if params.repetition != 1.0 {
                // The current favourites, some only in the prompt (count 0), and one id past the vocabulary.
                let mut order: Vec<usize> = (0..vocab).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                let mut pen: Vec<(i32, i32)> = order[..6]
                    .iter()
                    .enumerate()
                    .map(|(k, &t)| (t as i32, (k % 3) as i32))
                    .collect();
                pen.push((vocab as i32 + 5, 2));
                pen.push((order[vocab - 1] as i32, 1)); // a negative logit: multiplied
                pen
            } else {
                Vec::new()
            };
            SampleRow {
                logits,
                params,
                pen,
            }
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn sampling_matches_reference() {
    let g = gpu();
    for (vocab, seed) in [(50, 1), (1000, 2), (32_000, 3), (256_000, 4)] {
        check_sampling(&g, sample_rows(vocab, seed), &format!("vocab {vocab}"));
    }
    // Many exact ties (quantised logits): selection must fall through to the id bits.
    let mut rows = sample_rows(20_000, 5);
    for row in &mut rows {
        for v in &mut row.logits {
            *v = (*v * 4.0).round() / 4.0;
        }
    }
    check_sampling(&g, rows, "quantised");
    // Flat rows with large survivor sets: top-k and top-p cuts far past 1024 candidates.
    let mut rows = sample_rows(100_000, 6);
    for (i, row) in rows.iter_mut().enumerate() {
        for v in &mut row.logits {
            *v = v.clamp(-8.0, 8.0) * 0.1;
        }
        row.params.temperature = 1.0;
        row.params.top_k = [5000, 0, 20_000, 3000][i % 4];
        row.params.top_p = [1.0, 0.999, 0.7, 0.95][i % 4];
        row.params.min_p = [0.0, 0.0, 0.0, 0.3][i % 4];
    }
    check_sampling(&g, rows, "flat");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn sampling_sanitises_nan_and_inf() {
    let g = gpu();
    let greedy = cuda::SampleParams {
        temperature: 0.0,
        top_p: 1.0,
        repetition: 1.0,
        ..Default::default()
    };
    let hot = cuda::SampleParams {
        temperature: 1.0,
        top_p: 1.0,
        repetition: 1.0,
        uniform: 0.7,
        ..Default::default()
    };
    let rows = vec![
        SampleRow {
            logits: vec![f32::NAN, 1.0, f32::INFINITY, 2.0, f32::NEG_INFINITY],
            params: greedy,
            pen: vec![],
        },
        SampleRow {
            logits: vec![f32::NAN, 1.0, -0.0, 2.0, f32::NEG_INFINITY],
            params: hot,
            pen: vec![],
        },
        SampleRow {
            logits: vec![f32::NAN; 5],
            params: greedy,
            pen: vec![],
        },
        SampleRow {
            logits: vec![f32::NEG_INFINITY; 5],
            params: hot,
            pen: vec![],
        },
    ];
    check_sampling(&g, rows, "nan/inf");
}

// ---------------------------------------------------------------------------------------------
// KV block copy with the device checksum (GPU-resident KV transfer)

/// A byte pattern no kernel writes: what destination blocks hold before a copy.
const KV_POISON: u64 = 0x7fc0_0001_dead_beef;

/// `blocks` blocks of random bytes, no 8-byte word zero.
fn rand_blocks(r: &mut SmallRng, blocks: usize, block_bytes: usize) -> Vec<u8> {
    (0..blocks * block_bytes / 8)
        .flat_map(|_| r.random_range(1..=u64::MAX).to_le_bytes())
        .collect()
}

fn poisoned_blocks(blocks: usize, block_bytes: usize) -> Vec<u8> {
    KV_POISON.to_le_bytes().repeat(blocks * block_bytes / 8)
}

/// `n` distinct block ids below `of`, in random order.
fn distinct_ids(r: &mut SmallRng, n: usize, of: usize) -> Vec<u32> {
    use rand::seq::SliceRandom;
    let mut ids: Vec<u32> = (0..of as u32).collect();
    ids.shuffle(r);
    ids.truncate(n);
    ids
}

fn kv_list<'a>(array: cuda::BlockArray, ids: &'a CudaSlice<u32>) -> cuda::BlockList<'a> {
    cuda::BlockList {
        array,
        ids: ids.as_view(),
    }
}

fn block(bytes: &[u8], id: u32, block_bytes: usize) -> &[u8] {
    &bytes[id as usize * block_bytes..(id as usize + 1) * block_bytes]
}

/// The kernel's sum for a chunk whose pair `i` reads `parts[i]` (`None`: a bad id, the poison term).
fn kv_sum_ref(parts: &[Option<&[u8]>], block_bytes: usize) -> u64 {
    parts.iter().enumerate().fold(0u64, |acc, (i, p)| {
        acc.wrapping_add(match p {
            Some(b) => cpu::kv_checksum_sum((i * block_bytes / 8) as u64, b),
            None => cuda::KV_BAD_BLOCK_POISON,
        })
    })
}

/// Runs one launch on `stream` and returns the finished checksum (the launch's own counter).
fn kv_launch(
    g: &Gpu,
    stream: &cuda::CudaStream,
    src: cuda::BlockList<'_>,
    dst: Option<cuda::BlockList<'_>>,
    block_bytes: usize,
) -> u64 {
    let n = src.ids.len();
    let mut sum = g.alloc_zeros::<u64>(1).unwrap();
    g.synchronize().unwrap(); // uploads and the zeroing ran on the Gpu's stream
    let op = cuda::KvCopy {
        src,
        dst,
        block_bytes: block_bytes as u64,
        checksum: Some(sum.as_view_mut()),
    };
    // SAFETY: both arrays are live device buffers of this Gpu of exactly num_blocks blocks
    // (BlockArray::of), source and destination are distinct buffers, and the stream is
    // synchronised before any of them is touched or dropped.
    unsafe { cuda::kv_copy_blocks(g, stream, op) }.unwrap();
    stream.synchronize().unwrap();
    cuda::kv_checksum_finish(down(g, &sum)[0], n, block_bytes as u64)
}

/// Copies `n` random blocks of a random layer into random blocks of a poisoned one: the chosen
/// blocks arrive, every other destination block keeps its poison, and the copy's checksum equals
/// a check-only pass over the destination and the CPU checksum of the gathered bytes.
fn check_kv_copy(g: &Gpu, stream: &cuda::CudaStream, n: usize, block_bytes: usize, seed: u64) {
    let mut r = rng(seed);
    let (src_blocks, dst_blocks) = (2 * n + 3, n + 5);
    let src_host = rand_blocks(&mut r, src_blocks, block_bytes);
    let (src_ids, dst_ids) = (
        distinct_ids(&mut r, n, src_blocks),
        distinct_ids(&mut r, n, dst_blocks),
    );
    let src = g.upload(&src_host).unwrap();
    let dst = g.upload(&poisoned_blocks(dst_blocks, block_bytes)).unwrap();
    let (dsi, ddi) = (g.upload(&src_ids).unwrap(), g.upload(&dst_ids).unwrap());
    let bb = block_bytes as u64;
    let (src_arr, dst_arr) = (
        cuda::BlockArray::of(g, &src.as_view(), bb),
        cuda::BlockArray::of(g, &dst.as_view(), bb),
    );
    assert_eq!(src_arr.num_blocks as usize, src_blocks);
    let what = format!("n={n} block_bytes={block_bytes}");
    let copied = kv_launch(
        g,
        stream,
        kv_list(src_arr, &dsi),
        Some(kv_list(dst_arr, &ddi)),
        block_bytes,
    );
    let got = down(g, &dst);
    let poison = poisoned_blocks(1, block_bytes);
    for d in 0..dst_blocks as u32 {
        let want = match dst_ids.iter().position(|&x| x == d) {
            Some(i) => block(&src_host, src_ids[i], block_bytes),
            None => &poison[..],
        };
        assert!(
            block(&got, d, block_bytes) == want,
            "{what}: destination block {d}"
        );
    }
    let want = cpu::kv_checksum(src_ids.iter().map(|&s| block(&src_host, s, block_bytes)));
    assert_eq!(copied, want, "{what}: copy checksum");
    let verified = kv_launch(g, stream, kv_list(dst_arr, &ddi), None, block_bytes);
    assert_eq!(verified, want, "{what}: verification checksum");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn kv_copy_moves_blocks_and_checksums_match_cpu() {
    let g = gpu();
    let s = g.stream().clone();
    let mut seed = 0;
    for n in [1, 7, 300] {
        for block_bytes in [16, 48, 2064, 6144, 65536] {
            seed += 1;
            check_kv_copy(&g, &s, n, block_bytes, 100 + seed);
        }
    }
}

/// A transfer runs on a stream of its own, not on the Gpu's.
#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn kv_copy_runs_on_a_second_stream() {
    let g = gpu();
    let s2 = g.stream().context().new_stream().unwrap();
    check_kv_copy(&g, &s2, 33, 6144, 200);
    check_kv_copy(&g, &s2, 5, 1 << 20, 201);
}

/// Out-of-range ids (source or destination) are skipped, with no read or write, and make the
/// sender's checksum differ from the receiver's.
#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn kv_copy_skips_bad_ids_and_poisons_the_checksum() {
    let g = gpu();
    let s = g.stream().clone();
    let (n, block_bytes, src_blocks, dst_blocks) = (7, 6144, 12, 10);
    let mut r = rng(300);
    let src_host = rand_blocks(&mut r, src_blocks, block_bytes);
    let mut src_ids = distinct_ids(&mut r, n, src_blocks);
    let mut dst_ids = distinct_ids(&mut r, n, dst_blocks);
    src_ids[2] = src_blocks as u32 + 3;
    dst_ids[5] = dst_blocks as u32; // exactly the bound
    src_ids[6] = u32::MAX;
    let src = g.upload(&src_host).unwrap();
    let dst = g.upload(&poisoned_blocks(dst_blocks, block_bytes)).unwrap();
    let (dsi, ddi) = (g.upload(&src_ids).unwrap(), g.upload(&dst_ids).unwrap());
    let bb = block_bytes as u64;
    let (src_arr, dst_arr) = (
        cuda::BlockArray::of(&g, &src.as_view(), bb),
        cuda::BlockArray::of(&g, &dst.as_view(), bb),
    );
    let copied = kv_launch(
        &g,
        &s,
        kv_list(src_arr, &dsi),
        Some(kv_list(dst_arr, &ddi)),
        block_bytes,
    );
    let got = down(&g, &dst);
    let poison = poisoned_blocks(1, block_bytes);
    let bad = |i: usize| i == 2 || i == 5 || i == 6;
    for d in 0..dst_blocks as u32 {
        let want = match dst_ids.iter().position(|&x| x == d) {
            Some(i) if !bad(i) => block(&src_host, src_ids[i], block_bytes),
            _ => &poison[..],
        };
        assert!(block(&got, d, block_bytes) == want, "destination block {d}");
    }
    let sender: Vec<Option<&[u8]>> = (0..n)
        .map(|i| (!bad(i)).then(|| block(&src_host, src_ids[i], block_bytes)))
        .collect();
    let want_copied = kv_sum_ref(&sender, block_bytes) ^ (n * block_bytes) as u64;
    assert_eq!(copied, want_copied, "copy checksum with bad ids");
    let verified = kv_launch(&g, &s, kv_list(dst_arr, &ddi), None, block_bytes);
    let receiver: Vec<Option<&[u8]>> = (0..n)
        .map(|i| (i != 5).then(|| block(&got, dst_ids[i], block_bytes)))
        .collect();
    let want_verified = kv_sum_ref(&receiver, block_bytes) ^ (n * block_bytes) as u64;
    assert_eq!(
        verified, want_verified,
        "verification checksum with bad ids"
    );
    assert_ne!(
        copied, verified,
        "a transfer with bad ids must fail verification"
    );
    // The clean transfer's checksum differs from both.
    let good: Vec<u32> = (0..n as u32).collect();
    let clean = cpu::kv_checksum(good.iter().map(|&s| block(&src_host, s, block_bytes)));
    assert_ne!(copied, clean);
}

/// Several chunks in one segmented launch, each between its own pair of arrays (layers) with its
/// own counter: every chosen block arrives, every other keeps its poison, and each segment's
/// checksum equals the CPU checksum of its own blocks (and `kv_copy_blocks` of that chunk alone),
/// on the copy and on a check-only pass over the destination; a bad id poisons only its segment.
fn check_kv_segments(g: &Gpu, stream: &cuda::CudaStream, sizes: &[u32], block_bytes: usize, bad: Option<(usize, usize)>, seed: u64) {
    let mut r = rng(seed);
    let most = *sizes.iter().max().expect("segments") as usize;
    let (src_blocks, dst_blocks) = (2 * most + 3, most + 5);
    let bb = block_bytes as u64;
    let what = format!("segments {sizes:?} block_bytes={block_bytes} bad={bad:?}");
    let mut src_hosts = Vec::new();
    let (mut srcs, mut dsts) = (Vec::new(), Vec::new());
    let (mut all_src, mut all_dst) = (Vec::new(), Vec::new());
    let mut segments = Vec::new();
    for (k, &n) in sizes.iter().enumerate() {
        let host = rand_blocks(&mut r, src_blocks, block_bytes);
        let src = g.upload(&host).unwrap();
        let dst = g.upload(&poisoned_blocks(dst_blocks, block_bytes)).unwrap();
        let mut src_ids = distinct_ids(&mut r, n as usize, src_blocks);
        let dst_ids = distinct_ids(&mut r, n as usize, dst_blocks);
        if let Some((seg, i)) = bad
            && seg == k
        {
            src_ids[i] = src_blocks as u32; // exactly the bound
        }
        segments.push(cuda::KvSegment {
            src: cuda::BlockArray::of(g, &src.as_view(), bb).base,
            dst: cuda::BlockArray::of(g, &dst.as_view(), bb).base,
            blocks: n,
        });
        all_src.push(src_ids);
        all_dst.push(dst_ids);
        src_hosts.push(host);
        srcs.push(src);
        dsts.push(dst);
    }
    let flat = |v: &Vec<Vec<u32>>| v.iter().flatten().copied().collect::<Vec<u32>>();
    let (dsi, ddi) = (g.upload(&flat(&all_src)).unwrap(), g.upload(&flat(&all_dst)).unwrap());
    let run = |dst_ids: Option<&CudaSlice<u32>>, src_ids: &CudaSlice<u32>, segs: &[cuda::KvSegment]| -> Vec<u64> {
        let mut sums = g.upload(&vec![0u64; segs.len()]).unwrap();
        let tbl = g.upload(&cuda::kv_segment_table(segs)).unwrap();
        g.synchronize().unwrap();
        let op = cuda::KvSegments {
            segments: segs,
            table: tbl.as_view(),
            src_ids: src_ids.as_view(),
            src_num_blocks: src_blocks as u32,
            dst_ids: dst_ids.map(|d| d.as_view()),
            dst_num_blocks: dst_blocks as u32,
            block_bytes: bb,
            checksums: Some(sums.as_view_mut()),
        };
        // SAFETY: every segment's arrays are live device buffers of this Gpu of exactly
        // src_blocks / dst_blocks blocks, sources and destinations are distinct buffers, the table
        // is kv_segment_table(segs), and the stream is synchronised before anything is dropped.
        unsafe { cuda::kv_copy_segments(g, stream, op) }.unwrap();
        stream.synchronize().unwrap();
        down(g, &sums).iter().zip(segs).map(|(&s, seg)| cuda::kv_checksum_finish(s, seg.blocks as usize, bb)).collect()
    };
    let copied = run(Some(&ddi), &dsi, &segments);
    let poison = poisoned_blocks(1, block_bytes);
    for (k, &n) in sizes.iter().enumerate() {
        let got = down(g, &dsts[k]);
        let is_bad = |i: usize| bad == Some((k, i));
        for d in 0..dst_blocks as u32 {
            let want = match all_dst[k].iter().position(|&x| x == d) {
                Some(i) if !is_bad(i) => block(&src_hosts[k], all_src[k][i], block_bytes),
                _ => &poison[..],
            };
            assert!(block(&got, d, block_bytes) == want, "{what}: segment {k} destination block {d}");
        }
        let parts: Vec<Option<&[u8]>> =
            (0..n as usize).map(|i| (!is_bad(i)).then(|| block(&src_hosts[k], all_src[k][i], block_bytes))).collect();
        let want = kv_sum_ref(&parts, block_bytes) ^ (n as u64 * bb);
        assert_eq!(copied[k], want, "{what}: segment {k} copy checksum");
        if bad.is_none() {
            let cpu_sum = cpu::kv_checksum(all_src[k].iter().map(|&s| block(&src_hosts[k], s, block_bytes)));
            assert_eq!(copied[k], cpu_sum, "{what}: segment {k} against the CPU checksum");
        }
    }
    // The receiver's pass: read-only over the destinations, segment by segment.
    let dst_as_src: Vec<cuda::KvSegment> = segments.iter().map(|s| cuda::KvSegment { src: s.dst, dst: 0, blocks: s.blocks }).collect();
    let mut dst_ids_checked = all_dst.clone();
    if let Some((k, i)) = bad {
        dst_ids_checked[k][i] = 0; // a poisoned block: its sum differs, as it must
    }
    let verify_ids = g.upload(&flat(&dst_ids_checked)).unwrap();
    let verified = {
        let mut sums = g.upload(&vec![0u64; sizes.len()]).unwrap();
        let tbl = g.upload(&cuda::kv_segment_table(&dst_as_src)).unwrap();
        g.synchronize().unwrap();
        let op = cuda::KvSegments {
            segments: &dst_as_src,
            table: tbl.as_view(),
            src_ids: verify_ids.as_view(),
            src_num_blocks: dst_blocks as u32,
            dst_ids: None,
            dst_num_blocks: 0,
            block_bytes: bb,
            checksums: Some(sums.as_view_mut()),
        };
        // SAFETY: as above; the pass only reads the destination buffers.
        unsafe { cuda::kv_copy_segments(g, stream, op) }.unwrap();
        stream.synchronize().unwrap();
        down(g, &sums).iter().zip(sizes).map(|(&s, &n)| cuda::kv_checksum_finish(s, n as usize, bb)).collect::<Vec<u64>>()
    };
    for k in 0..sizes.len() {
        if bad.is_some_and(|(b, _)| b == k) {
            assert_ne!(verified[k], copied[k], "{what}: the bad segment {k} must fail verification");
        } else {
            assert_eq!(verified[k], copied[k], "{what}: segment {k} verification");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn kv_copy_segments_match_per_chunk_checksums() {
    let g = gpu();
    let s = g.stream().context().new_stream().unwrap();
    let mut seed = 500;
    for sizes in [&[1u32][..], &[7, 7, 7], &[256, 3, 100, 1, 256], &[5; 40]] {
        for block_bytes in [16, 2064, 32768] {
            seed += 1;
            check_kv_segments(&g, &s, sizes, block_bytes, None, seed);
        }
    }
    check_kv_segments(&g, &s, &[9, 9, 9, 9], 6144, Some((2, 4)), 600);
    check_kv_segments(&g, &s, &[1, 300], 48, Some((1, 0)), 601);
}

/// Packing blocks into a contiguous staging buffer (destination ids 0..n) and unpacking them into
/// another layer (source ids 0..n) round trips, with the same checksum on both passes.
#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn kv_copy_packs_and_unpacks_through_staging() {
    let g = gpu();
    let s = g.stream().context().new_stream().unwrap();
    for (n, block_bytes, seed) in [(1, 16, 400), (7, 6144, 401), (300, 65536, 402)] {
        let mut r = rng(seed);
        let blocks = n + 9;
        let src_host = rand_blocks(&mut r, blocks, block_bytes);
        let (src_ids, dst_ids) = (
            distinct_ids(&mut r, n, blocks),
            distinct_ids(&mut r, n, blocks),
        );
        let seq: Vec<u32> = (0..n as u32).collect();
        let src = g.upload(&src_host).unwrap();
        let staging = g.upload(&poisoned_blocks(n, block_bytes)).unwrap();
        let dst = g.upload(&poisoned_blocks(blocks, block_bytes)).unwrap();
        let (dsi, ddi, dseq) = (
            g.upload(&src_ids).unwrap(),
            g.upload(&dst_ids).unwrap(),
            g.upload(&seq).unwrap(),
        );
        let bb = block_bytes as u64;
        let arr = |b: &CudaSlice<u8>| cuda::BlockArray::of(&g, &b.as_view(), bb);
        let packed = kv_launch(
            &g,
            &s,
            kv_list(arr(&src), &dsi),
            Some(kv_list(arr(&staging), &dseq)),
            block_bytes,
        );
        let gathered: Vec<u8> = src_ids
            .iter()
            .flat_map(|&i| block(&src_host, i, block_bytes).iter().copied())
            .collect();
        let what = format!("n={n} block_bytes={block_bytes}");
        assert!(
            down(&g, &staging) == gathered,
            "{what}: staging holds the gathered blocks"
        );
        let unpacked = kv_launch(
            &g,
            &s,
            kv_list(arr(&staging), &dseq),
            Some(kv_list(arr(&dst), &ddi)),
            block_bytes,
        );
        let want = cpu::kv_checksum([&gathered[..]]);
        assert_eq!(packed, want, "{what}: pack checksum");
        assert_eq!(unpacked, want, "{what}: unpack checksum");
        let got = down(&g, &dst);
        let poison = poisoned_blocks(1, block_bytes);
        for d in 0..blocks as u32 {
            let want = match dst_ids.iter().position(|&x| x == d) {
                Some(i) => block(&src_host, src_ids[i], block_bytes),
                None => &poison[..],
            };
            assert!(
                block(&got, d, block_bytes) == want,
                "{what}: unpacked block {d}"
            );
        }
    }
}

/// The copy launcher refuses what it cannot launch safely, as `BadShape`; an empty chunk is a
/// no-op; a copy without a checksum buffer still copies.
#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn kv_copy_rejects_bad_shapes() {
    let g = gpu();
    let s = g.stream().clone();
    let buf = g.upload(&poisoned_blocks(4, 64)).unwrap();
    let out = g.upload(&poisoned_blocks(4, 64)).unwrap();
    let ids = g.upload(&[0u32, 1, 2]).unwrap();
    let two = g.upload(&[0u32, 1]).unwrap();
    let mut empty_sum = g.alloc_zeros::<u64>(1).unwrap();
    let a = cuda::BlockArray::of(&g, &buf.as_view(), 64);
    let b = cuda::BlockArray::of(&g, &out.as_view(), 64);
    let launch = |op: cuda::KvCopy<'_>| {
        // SAFETY: every array is a live buffer of this Gpu; refused launches enqueue nothing and
        // the accepted ones are synchronised below before the buffers drop.
        unsafe { cuda::kv_copy_blocks(&g, &s, op) }
    };
    let bad = |r: cuda::Result<()>| assert!(matches!(r, Err(GpuError::BadShape(_))), "{r:?}");
    for block_bytes in [0, 8, 24, 1 << 31] {
        bad(launch(cuda::KvCopy {
            src: kv_list(a, &ids),
            dst: None,
            block_bytes,
            checksum: None,
        }));
    }
    let misaligned = cuda::BlockArray {
        base: a.base + 8,
        ..a
    };
    bad(launch(cuda::KvCopy {
        src: kv_list(misaligned, &ids),
        dst: None,
        block_bytes: 64,
        checksum: None,
    }));
    let null = cuda::BlockArray {
        base: 0,
        num_blocks: 4,
    };
    bad(launch(cuda::KvCopy {
        src: kv_list(a, &ids),
        dst: Some(kv_list(null, &ids)),
        block_bytes: 64,
        checksum: None,
    }));
    let wraps = cuda::BlockArray {
        base: u64::MAX - 15,
        num_blocks: 2,
    };
    bad(launch(cuda::KvCopy {
        src: kv_list(wraps, &ids),
        dst: None,
        block_bytes: 64,
        checksum: None,
    }));
    bad(launch(cuda::KvCopy {
        src: kv_list(a, &ids),
        dst: Some(kv_list(b, &two)),
        block_bytes: 64,
        checksum: None,
    }));
    bad(launch(cuda::KvCopy {
        src: kv_list(a, &ids),
        dst: None,
        block_bytes: 64,
        checksum: Some(empty_sum.slice_mut(0..0)),
    }));
    let none = g.upload(&[7u32]).unwrap();
    launch(cuda::KvCopy {
        src: cuda::BlockList {
            array: a,
            ids: none.slice(0..0),
        },
        dst: Some(cuda::BlockList {
            array: b,
            ids: none.slice(0..0),
        }),
        block_bytes: 64,
        checksum: Some(empty_sum.as_view_mut()),
    })
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(down(&g, &empty_sum), vec![0], "an empty chunk adds nothing");
    assert_eq!(cuda::kv_checksum_finish(0, 0, 64), cpu::kv_checksum([]));
    let host = rand_blocks(&mut rng(500), 4, 64);
    let src = g.upload(&host).unwrap();
    let sa = cuda::BlockArray::of(&g, &src.as_view(), 64);
    g.synchronize().unwrap();
    launch(cuda::KvCopy {
        src: kv_list(sa, &ids),
        dst: Some(kv_list(b, &ids)),
        block_bytes: 64,
        checksum: None,
    })
    .unwrap();
    s.synchronize().unwrap();
    let got = down(&g, &out);
    assert_eq!(&got[..192], &host[..192]);
    assert_eq!(&got[192..], &poisoned_blocks(1, 64)[..]);
}

/// `IpcAlloc` and `IpcArrays`: zeroed when made, written and read through `CudaSlice` views like
/// any buffer, freed exactly once (views leaked, never freed by cudarc), exportable; opening the
/// handle in the exporting process is an error, not a panic.
#[test]
#[ignore = "needs a CUDA GPU (scripts/device-check.sh runs it)"]
fn ipc_allocations_are_zeroed_writable_and_exportable() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<cuda::IpcAlloc>();
    send_sync::<cuda::IpcMapping>();
    send_sync::<cuda::IpcArrays<bf16>>();
    let g = gpu();
    let stream = g.stream().clone();
    let ctx = stream.context().clone();
    assert!(matches!(
        cuda::IpcAlloc::new(&ctx, 0),
        Err(GpuError::BadShape(_))
    ));

    // One allocation, written through a view that is leaked before the allocation frees it.
    let bytes = (3 << 20) + 4096 + 17;
    let alloc = cuda::IpcAlloc::new(&ctx, bytes).unwrap();
    assert_eq!(alloc.bytes(), bytes);
    assert_eq!(alloc.ptr() % 256, 0);
    // SAFETY: the allocation holds `bytes` zeroed bytes (valid `u8`s); the view is leaked below,
    // before the allocation is dropped, so cudarc never frees it.
    let mut view = unsafe { stream.upgrade_device_ptr::<u8>(alloc.ptr(), bytes) };
    assert!(down(&g, &view).iter().all(|&b| b == 0), "zeroed when made");
    let data: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8 + 1).collect();
    g.upload_into(&data, &mut view.as_view_mut()).unwrap();
    assert_eq!(down(&g, &view), data);
    assert_eq!(view.leak(), alloc.ptr());
    let handle = alloc.export().unwrap();
    assert_ne!(handle, [0u8; 64], "a handle was written");
    match cuda::IpcMapping::open(&ctx, &handle) {
        Ok(m) => panic!(
            "opened an IPC handle in the process that exported it (at {:#x})",
            m.ptr()
        ),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("opening our own IPC handle: {msg}");
            assert!(
                matches!(e, GpuError::Driver(_)) && msg.contains("IPC"),
                "{msg}"
            );
        }
    }
    drop(alloc);

    // Arrays in one allocation: aligned, disjoint, zeroed, each written through its own view,
    // the padding between them untouched.
    let (count, len) = (3, 1000);
    let mut arrays = cuda::IpcArrays::<bf16>::new(&stream, count, len).unwrap();
    assert_eq!(
        (arrays.count(), arrays.array_len(), arrays.stride_bytes()),
        (3, 1000, 2048)
    );
    assert!(arrays.alloc().bytes() >= count * 2048);
    for i in 0..count {
        assert_eq!(
            arrays.array_ptr(i),
            arrays.alloc().ptr() + (i * 2048) as u64
        );
        assert_eq!(arrays.array(i).len(), len);
        let zeros = g.download(&arrays.array(i)).unwrap();
        assert!(zeros.iter().all(|x| x.to_bits() == 0), "array {i} zeroed");
    }
    let mut r = rng(600);
    let host: Vec<Vec<bf16>> = (0..count).map(|_| rand_bf16(&mut r, len, 1.0)).collect();
    for (i, h) in host.iter().enumerate() {
        g.upload_into(h, &mut arrays.array_mut(i)).unwrap();
    }
    for (i, h) in host.iter().enumerate() {
        assert_eq!(&g.download(&arrays.array(i)).unwrap(), h, "array {i}");
    }
    let total = arrays.alloc().bytes();
    // SAFETY: the whole allocation as bytes (any bit pattern is a valid `u8`); leaked below,
    // before `arrays` frees the allocation.
    let whole = unsafe { stream.upgrade_device_ptr::<u8>(arrays.alloc().ptr(), total) };
    let raw = down(&g, &whole);
    whole.leak();
    for (i, h) in host.iter().enumerate() {
        let want: Vec<u8> = h.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        assert_eq!(
            &raw[i * 2048..i * 2048 + 2000],
            &want[..],
            "array {i} in place"
        );
        assert!(
            raw[i * 2048 + 2000..(i + 1) * 2048].iter().all(|&b| b == 0),
            "padding {i}"
        );
    }
    drop(arrays);

    // Dropping frees the allocation (once): the device's free memory comes back.
    const BIG: usize = 256 << 20;
    ctx.synchronize().unwrap();
    let (before, _) = g.mem_info().unwrap();
    let big = cuda::IpcArrays::<u8>::new(&stream, 2, BIG / 2).unwrap();
    let (during, _) = g.mem_info().unwrap();
    drop(big);
    ctx.synchronize().unwrap();
    let (after, _) = g.mem_info().unwrap();
    eprintln!(
        "free MiB: {} before, {} with 256 MiB of IPC arrays, {} after",
        before >> 20,
        during >> 20,
        after >> 20
    );
    assert!(
        during + (200 << 20) <= before,
        "the arrays took device memory"
    );
    assert!(
        after >= during + (200 << 20),
        "dropping the arrays freed it"
    );
    g.synchronize().unwrap();
}
