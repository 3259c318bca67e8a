//! Launcher of GPU token sampling (`kernels/cuda/sampling.cu`), one CTA per row.
//!
//! Semantics are the engine's CPU sampler (engine/src/sampling): NaN logits become `-inf` and
//! `+inf` the largest finite f32; penalties first (repetition on every listed token, presence and
//! frequency on tokens with an output count > 0), written back to `logits`; greedy
//! (`temperature == 0`) is the argmax, lowest id on ties, with the log-softmax of the penalised row
//! as logprob; otherwise `work = (l - max) / T`, the logprob is the log-softmax of `work` over the
//! whole vocabulary, then top-k, top-p, min-p (ranked by `work` descending, then id ascending),
//! then the draw: survivors walked best first, the first whose cumulative weight exceeds
//! `uniform` × their total (the last with positive weight if rounding leaves none).
//!
//! One deliberate difference from the CPU sampler: with no filter active the CPU walks the
//! vocabulary in id order for the draw, and after filters in the order the filters leave; here the
//! walk is always best first. Both draw from the same distribution, but the same `uniform` can pick
//! a different token on the two devices.

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::error::{Result, check, need_len, to_i32};
use super::gpu::Gpu;
use super::kernel::{Kernel, MAX_DYNAMIC_SMEM};

/// Dynamic shared memory of the kernel: 32 warps' private histograms of 256 (u64 mass, u32 count).
const SAMPLE_SMEM: usize = 32 * 256 * (8 + 4);
const _: () = assert!(SAMPLE_SMEM <= MAX_DYNAMIC_SMEM);

/// Per-row sampling parameters, as the kernel reads them (mirrors `SampleParams` in sampling.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: i32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repetition: f32,
    /// Subtracted once from every token with an output count > 0.
    pub presence: f32,
    /// Subtracted `count` times from every token with an output count > 0.
    pub frequency: f32,
    /// The draw, in `[0, 1)` (ignored when greedy).
    pub uniform: f32,
}

// SAFETY: repr(C) with only f32/i32 fields (no padding, no pointers); matches the CUDA struct.
unsafe impl DeviceRepr for SampleParams {}

/// Samples one token per row. Shapes: `logits` `[R, vocab]` f32 (penalised and sanitised in place),
/// `params` `[R]` (its length gives `R`), `pen_offsets` `[R+1]`, and row `r`'s penalised tokens are
/// `pen_tokens[pen_offsets[r]..pen_offsets[r+1]]` (each DISTINCT token of prompt ∪ output once) with
/// `pen_counts` their occurrences in the output (0 = prompt only); `out_tokens`, `out_logprobs`
/// `[R]`. Offsets are clamped to `pen_tokens` on the device; ids outside the vocabulary are ignored.
#[expect(
    clippy::too_many_arguments,
    reason = "the engine-facing signature is fixed"
)]
pub fn sample(
    gpu: &Gpu,
    logits: &mut CudaViewMut<'_, f32>,
    vocab: usize,
    params: &CudaView<'_, SampleParams>,
    pen_offsets: &CudaView<'_, i32>,
    pen_tokens: &CudaView<'_, i32>,
    pen_counts: &CudaView<'_, i32>,
    out_tokens: &mut CudaViewMut<'_, u32>,
    out_logprobs: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let rows = params.len();
    check(vocab > 0, || "vocab must be positive".into())?;
    let vocab_i = to_i32("vocab", vocab)?;
    need_len("logits", logits.len(), rows * vocab)?;
    need_len("pen_offsets", pen_offsets.len(), rows + 1)?;
    need_len("pen_counts", pen_counts.len(), pen_tokens.len())?;
    need_len("out_tokens", out_tokens.len(), rows)?;
    need_len("out_logprobs", out_logprobs.len(), rows)?;
    let pen_len = to_i32("pen_tokens", pen_tokens.len())?;
    if rows == 0 {
        return Ok(());
    }
    check(rows <= i32::MAX as usize, || {
        format!("{rows} rows exceed the grid")
    })?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: SAMPLE_SMEM as u32,
    };
    let mut launch = gpu.stream().launch_builder(gpu.func(Kernel::Sample));
    launch
        .arg(logits)
        .arg(&vocab_i)
        .arg(params)
        .arg(pen_offsets)
        .arg(pen_tokens)
        .arg(pen_counts)
        .arg(&pen_len)
        .arg(out_tokens)
        .arg(out_logprobs);
    // SAFETY: argument types match `sample` in sampling.cu (with SAMPLE_SMEM bytes of dynamic
    // shared memory, within what the function opted in to); logits hold rows*vocab, params,
    // out_tokens and out_logprobs rows, pen_offsets rows+1 elements; the kernel clamps the offsets
    // to pen_len (the length of pen_tokens and at most that of pen_counts) and skips ids outside
    // the vocabulary.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
