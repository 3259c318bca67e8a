//! Launchers of the row-wise and element-wise kernels (`kernels/cuda/elementwise.cu`): embedding,
//! RMSNorm with the fused residual add, RoPE, SiLU·mul, the paged KV write, and the token ids an
//! overlapped step takes from the previous step's sampler.
//!
//! Every launcher checks that its buffers hold at least what the launch touches (buffers may be
//! larger: the engine passes preallocated maximum-size buffers) and that sizes fit the kernels'
//! `int` arguments; a mismatch is [`GpuError::BadShape`](super::GpuError::BadShape). Indices that live
//! on the device (token ids, slots) are validated by the kernels. All launches are asynchronous
//! on [`Gpu::stream`].

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::checks::{addr, aligned, blocks};
use super::error::{Result, check, need_len, to_i32};
use super::gpu::Gpu;
use super::kernel::Kernel;
use crate::cpu::PagedLayout;
use half::bf16;

/// `out[t, :] = f32(table[ids[t], :])`. Shapes: `table` `[vocab, h]` (its length gives `vocab`),
/// `ids` `[T]`, `out` `[T, h]`. An id `>= vocab` yields a row of zeros (the host validates ids
/// earlier; the kernel only refuses to read out of bounds).
pub fn embedding(
    gpu: &Gpu,
    table: &CudaView<'_, bf16>,
    ids: &CudaView<'_, u32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let t = ids.len();
    if t == 0 {
        return Ok(());
    }
    check(out.len().is_multiple_of(t) && out.len() >= t, || {
        format!("out ({}) is not [{t}, h]", out.len())
    })?;
    let h = out.len() / t;
    check(h > 0 && table.len().is_multiple_of(h), || {
        format!("table ({}) is not [vocab, {h}]", table.len())
    })?;
    let vocab = table.len() / h;
    let s = gpu.stream();
    let vec = h.is_multiple_of(8) && aligned(&[addr(table, s), addr(out, s)], 16);
    let (vocab, h_i, vec) = (
        to_i32("vocab", vocab)?,
        to_i32("hidden", h)?,
        i32::from(vec),
    );
    let threads = 128usize;
    check(t <= i32::MAX as usize, || {
        format!("{t} rows exceed the grid")
    })?;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, blocks(h, 8 * threads), 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = s.launch_builder(gpu.func(Kernel::Embedding));
    launch
        .arg(table)
        .arg(ids)
        .arg(out)
        .arg(&vocab)
        .arg(&h_i)
        .arg(&vec);
    // SAFETY: argument types match `embedding` in elementwise.cu; `out` holds T*h elements, the
    // kernel reads table rows only for ids < vocab = table.len()/h.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// RMSNorm with an optional fused residual add. Shapes: `x` `[T, h]` f32 (the residual stream),
/// `residual_delta` `[T, h]` f32, `weight` `[h]` bf16 (its length gives `h`), `out` `[T, h]` bf16,
/// with `T = x.len() / h`. If `residual_delta` is given, first `x += delta` (written back); then
/// `out = bf16(bf16(x / rms(x)) * weight)` per row, computed in f32.
pub fn rms_norm(
    gpu: &Gpu,
    x: &mut CudaViewMut<'_, f32>,
    residual_delta: Option<&CudaView<'_, f32>>,
    weight: &CudaView<'_, bf16>,
    eps: f32,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let h = weight.len();
    check(h > 0 && x.len().is_multiple_of(h), || {
        format!("x ({}) is not [T, {h}]", x.len())
    })?;
    let t = x.len() / h;
    if t == 0 {
        return Ok(());
    }
    need_len("out", out.len(), t * h)?;
    let s = gpu.stream();
    let delta = match residual_delta {
        Some(d) => {
            need_len("residual_delta", d.len(), t * h)?;
            addr(d, s)
        }
        None => 0,
    };
    let vec = h.is_multiple_of(4)
        && aligned(&[addr(x, s), delta], 16)
        && aligned(&[addr(weight, s), addr(out, s)], 8);
    let (h_i, vec) = (to_i32("hidden", h)?, i32::from(vec));
    check(t <= i32::MAX as usize, || {
        format!("{t} rows exceed the grid")
    })?;
    let threads = if h >= 4096 { 1024 } else { 256 };
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = s.launch_builder(gpu.func(Kernel::RmsNorm));
    launch
        .arg(x)
        .arg(&delta)
        .arg(weight)
        .arg(out)
        .arg(&h_i)
        .arg(&eps)
        .arg(&vec);
    // SAFETY: argument types match `rms_norm` in elementwise.cu (`delta` is a device address or
    // 0 = null); every buffer holds T*h (weight h) elements.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Rotate-half RoPE in place on the first `num_heads * head_dim` columns of each row of `qkv`
/// (`[T, row_stride]` bf16, `T = positions.len()`): head `h`'s pairs `(i, i + head_dim/2)` rotate
/// by `positions[t] * inv_freq[i]` (`inv_freq` `[head_dim/2]`, from
/// [`crate::cpu::rope_inv_freq`]). `num_heads` counts every head to rotate (query + key heads).
pub fn rope(
    gpu: &Gpu,
    qkv: &mut CudaViewMut<'_, bf16>,
    positions: &CudaView<'_, i32>,
    inv_freq: &CudaView<'_, f32>,
    num_heads: usize,
    head_dim: usize,
    row_stride: usize,
) -> Result<()> {
    let t = positions.len();
    check(head_dim > 0 && head_dim.is_multiple_of(2), || {
        format!("head_dim {head_dim} must be even")
    })?;
    check(num_heads * head_dim <= row_stride, || {
        format!("{num_heads} heads of {head_dim} exceed row_stride {row_stride}")
    })?;
    need_len("inv_freq", inv_freq.len(), head_dim / 2)?;
    if t == 0 || num_heads == 0 {
        return Ok(());
    }
    need_len(
        "qkv",
        qkv.len(),
        (t - 1) * row_stride + num_heads * head_dim,
    )?;
    let (heads_i, hd_i, stride_i) = (
        to_i32("num_heads", num_heads)?,
        to_i32("head_dim", head_dim)?,
        to_i32("row_stride", row_stride)?,
    );
    check(t <= i32::MAX as usize, || {
        format!("{t} rows exceed the grid")
    })?;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (head_dim * std::mem::size_of::<f32>()) as u32,
    };
    let s = gpu.stream();
    let mut launch = s.launch_builder(gpu.func(Kernel::Rope));
    launch
        .arg(qkv)
        .arg(positions)
        .arg(inv_freq)
        .arg(&heads_i)
        .arg(&hd_i)
        .arg(&stride_i);
    // SAFETY: argument types match `rope` in elementwise.cu; qkv holds every rotated column of
    // every row, inv_freq head_dim/2 values; shared memory holds head_dim floats (cos, sin).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// `out[t, i] = bf16(silu(gate_up[t, i]) * gate_up[t, inter + i])` in f32. Shapes: `gate_up`
/// `[T, 2*inter]`, `out` `[T, inter]`, `T = gate_up.len() / (2*inter)`.
pub fn silu_mul(
    gpu: &Gpu,
    gate_up: &CudaView<'_, bf16>,
    out: &mut CudaViewMut<'_, bf16>,
    inter: usize,
) -> Result<()> {
    check(inter > 0 && gate_up.len().is_multiple_of(2 * inter), || {
        format!("gate_up ({}) is not [T, 2*{inter}]", gate_up.len())
    })?;
    let t = gate_up.len() / (2 * inter);
    if t == 0 {
        return Ok(());
    }
    need_len("out", out.len(), t * inter)?;
    check(t <= i32::MAX as usize, || {
        format!("{t} rows exceed the grid")
    })?;
    to_i32("2 * inter", 2 * inter)?;
    let s = gpu.stream();
    let vec = inter.is_multiple_of(8) && aligned(&[addr(gate_up, s), addr(out, s)], 16);
    let (inter_i, vec) = (inter as i32, i32::from(vec));
    let threads = 128usize;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, blocks(inter, 8 * threads), 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = s.launch_builder(gpu.func(Kernel::SiluMul));
    launch.arg(gate_up).arg(out).arg(&inter_i).arg(&vec);
    // SAFETY: argument types match `silu_mul` in elementwise.cu; gate_up holds T*2*inter and out
    // T*inter elements.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Writes each token's K and V into one layer's paged cache. Shapes: `qkv` `[T, row_stride]` bf16
/// with K at columns `k_col..k_col + kv_heads*head_dim` and V right after; `slots` `[T]`
/// (`block * block_size + offset`, negative = padding, skipped); `cache` one layer,
/// `[num_blocks][2][kv_heads][block_size][head_dim]` bf16 as in [`PagedLayout`]. A slot whose block
/// is `>= num_blocks` is skipped by the kernel. `k_col`, `row_stride` and `head_dim` must be
/// multiples of 8 and the buffers 16-byte aligned (the copies are 16 bytes wide).
#[expect(
    clippy::too_many_arguments,
    reason = "the engine-facing signature is fixed"
)]
pub fn write_kv(
    gpu: &Gpu,
    qkv: &CudaView<'_, bf16>,
    slots: &CudaView<'_, i32>,
    cache: &mut CudaViewMut<'_, bf16>,
    layout: &PagedLayout,
    num_blocks: usize,
    k_col: usize,
    row_stride: usize,
) -> Result<()> {
    let t = slots.len();
    let PagedLayout {
        block_size,
        num_kv_heads,
        head_dim,
    } = *layout;
    check(head_dim > 0 && head_dim.is_multiple_of(8), || {
        format!("head_dim {head_dim} must be a multiple of 8")
    })?;
    check(block_size > 0 && num_kv_heads > 0, || {
        "block_size and num_kv_heads must be positive".into()
    })?;
    check(
        k_col.is_multiple_of(8) && row_stride.is_multiple_of(8),
        || format!("k_col {k_col} and row_stride {row_stride} must be multiples of 8"),
    )?;
    check(k_col + 2 * num_kv_heads * head_dim <= row_stride, || {
        format!("K and V columns from {k_col} exceed row_stride {row_stride}")
    })?;
    need_len("cache", cache.len(), num_blocks * layout.block_elems())?;
    to_i32("num_blocks * block_size", num_blocks * block_size)?;
    if t == 0 {
        return Ok(());
    }
    need_len("qkv", qkv.len(), t * row_stride)?;
    let s = gpu.stream();
    check(aligned(&[addr(qkv, s), addr(cache, s)], 16), || {
        "qkv and cache must be 16-byte aligned".into()
    })?;
    check(t <= i32::MAX as usize, || {
        format!("{t} rows exceed the grid")
    })?;
    let args = [
        to_i32("num_blocks", num_blocks)?,
        to_i32("block_size", block_size)?,
        to_i32("kv_heads", num_kv_heads)?,
        to_i32("head_dim", head_dim)?,
        to_i32("k_col", k_col)?,
        to_i32("row_stride", row_stride)?,
    ];
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = s.launch_builder(gpu.func(Kernel::WriteKv));
    launch.arg(qkv).arg(slots).arg(cache);
    for a in &args {
        launch.arg(a);
    }
    // SAFETY: argument types match `write_kv` in elementwise.cu; qkv holds T rows of row_stride
    // with K and V inside each row; the kernel writes only blocks < num_blocks, and cache holds
    // num_blocks blocks; every 16-byte access is aligned (checked above).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Token ids taken from an earlier step's sampler: for every `i` with `src[i] >= 0`,
/// `ids[i] = sampled[src[i]]`; other ids stay as they are. Shapes: `ids` and `src` `[n]` (`src`
/// may be longer: its first `ids.len()` entries are read), `sampled` `[S]`. An index `>= S` leaves
/// its id unchanged (the host validates indices first; the kernel only refuses to read out of
/// bounds).
pub fn resolve_tokens(
    gpu: &Gpu,
    ids: &mut CudaViewMut<'_, u32>,
    src: &CudaView<'_, i32>,
    sampled: &CudaView<'_, u32>,
) -> Result<()> {
    let n = ids.len();
    if n == 0 {
        return Ok(());
    }
    need_len("src", src.len(), n)?;
    let (n_i, s_i) = (to_i32("tokens", n)?, to_i32("sampled", sampled.len())?);
    let threads = 256usize;
    let cfg = LaunchConfig {
        grid_dim: (blocks(n, threads), 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let s = gpu.stream();
    let mut launch = s.launch_builder(gpu.func(Kernel::ResolveTokens));
    launch.arg(ids).arg(src).arg(sampled).arg(&n_i).arg(&s_i);
    // SAFETY: argument types match `resolve_tokens` in elementwise.cu; the kernel touches
    // ids[0..n] and src[0..n] (both at least n long) and reads sampled only below its length.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
