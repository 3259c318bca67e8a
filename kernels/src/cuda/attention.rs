//! Launchers of causal paged attention (`kernels/cuda/attention_prefill.cu`,
//! `attention_decode.cu`): prefill chunks on tensor cores, decode steps with flash-decoding.
//!
//! A batch is `C` chunks; chunk `c` has the query tokens `cu_q[c]..cu_q[c+1]` (rows of `q`), its
//! first at position `start_pos[c]`; a query at position `p` attends to positions `0..=p` read
//! through row `c` of `block_tables`. The chunk's own K/V must already be in the cache
//! ([`super::write_kv`]). All metadata lives on the device so a step can be replayed from a CUDA
//! graph; the host passes only upper bounds (`max_q_len`, `max_context`) that size the grid.
//!
//! Invariants: the kernels never dereference a block id that is negative or `>= num_blocks`
//! (that key is masked), nor a token index outside `q`/`out`; a query whose keys are all masked
//! gets zeros, never NaN; head dims 64 and 128, block sizes 8..=128 (powers of two) and GQA groups
//! 1..=16 are supported, anything else is [`GpuError::BadShape`].

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::checks::{addr, aligned};
use super::error::{GpuError, Result, check, need_len, to_i32};
use super::gpu::Gpu;
use super::kernel::{Kernel, MAX_DYNAMIC_SMEM};

/// Keys per decode split (`DEC_SPLIT` in attention_decode.cu).
const DECODE_SPLIT_KEYS: usize = 256;
/// Key rows per shared-memory tile in both kernels (`DEC_TILE`, `PF_BK`).
const KEY_TILE: usize = 64;
/// Query rows ((token, head) pairs) per prefill CTA (`PF_BQ`).
const PREFILL_ROWS: usize = 64;
const MAX_GROUP: usize = 16;

/// The batch's device-side metadata (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct AttnMeta<'a> {
    /// `[C+1]`: chunk `c`'s query rows are `cu_q[c]..cu_q[c+1]`.
    pub cu_q: &'a CudaView<'a, i32>,
    /// `[C]`: position of each chunk's first query token.
    pub start_pos: &'a CudaView<'a, i32>,
    /// `[C, max_blocks]`: each chunk's block ids, padded with -1.
    pub block_tables: &'a CudaView<'a, i32>,
    /// `C`.
    pub num_chunks: usize,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// Host upper bound of any chunk's length (sizes the prefill grid).
    pub max_q_len: usize,
    /// Host upper bound of any chunk's `start_pos + len` (sizes the decode splits).
    pub max_context: usize,
}

/// The attention geometry of one layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (`num_heads % num_kv_heads == 0`, group at most 16).
    pub num_kv_heads: usize,
    /// 64 or 128.
    pub head_dim: usize,
    /// Tokens per KV block: a power of two in 8..=128.
    pub block_size: usize,
    /// Blocks in the layer's cache.
    pub num_blocks: usize,
    /// Elements between consecutive rows of `q` (q is columns `0..num_heads*head_dim` of each).
    pub q_row_stride: usize,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
}

/// Mirrors `AttnParams` in attention_common.cuh field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttnParams {
    num_chunks: i32,
    max_blocks: i32,
    num_heads: i32,
    kv_heads: i32,
    group: i32,
    block_size: i32,
    block_shift: i32,
    num_blocks: i32,
    q_row_stride: i32,
    q_rows: i32,
    num_splits: i32,
    head_dim: i32,
    scale: f32,
}

// SAFETY: repr(C), only i32/f32 fields, no padding or pointers; matches the CUDA struct.
unsafe impl DeviceRepr for AttnParams {}

/// How many splits a decode launch uses for contexts up to `max_context`.
fn decode_splits(max_context: usize) -> usize {
    max_context.div_ceil(DECODE_SPLIT_KEYS).max(1)
}

/// How many f32 the `workspace` of [`decode_attention`] must hold for `num_chunks` chunks with
/// contexts up to `max_context` (0 when one split suffices).
pub fn decode_workspace_len(num_chunks: usize, shape: &AttnShape, max_context: usize) -> usize {
    let splits = decode_splits(max_context);
    if splits == 1 {
        0
    } else {
        num_chunks * shape.num_heads * splits * (shape.head_dim + 2)
    }
}

/// Checks everything the two kernels share and builds their parameters.
fn params(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    meta: &AttnMeta<'_>,
    shape: &AttnShape,
    cache: &CudaView<'_, bf16>,
    out: &CudaViewMut<'_, bf16>,
) -> Result<AttnParams> {
    let &AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        q_row_stride,
        scale,
    } = shape;
    check(matches!(head_dim, 64 | 128), || {
        format!("head_dim {head_dim}: only 64 and 128 are compiled")
    })?;
    check(
        num_kv_heads > 0 && num_heads.is_multiple_of(num_kv_heads),
        || format!("{num_heads} heads are not a multiple of {num_kv_heads} KV heads"),
    )?;
    let group = num_heads / num_kv_heads;
    check((1..=MAX_GROUP).contains(&group), || {
        format!("GQA group {group} is outside 1..={MAX_GROUP}")
    })?;
    check(
        block_size.is_power_of_two() && (8..=128).contains(&block_size),
        || format!("block_size {block_size} must be a power of two in 8..=128"),
    )?;
    let row = num_heads * head_dim;
    check(
        q_row_stride >= row && q_row_stride.is_multiple_of(8),
        || format!("q_row_stride {q_row_stride} must be >= {row} and a multiple of 8"),
    )?;
    check(scale.is_finite(), || format!("scale {scale} is not finite"))?;
    need_len(
        "cache",
        cache.len(),
        num_blocks * 2 * num_kv_heads * block_size * head_dim,
    )?;
    need_len("cu_q", meta.cu_q.len(), meta.num_chunks + 1)?;
    need_len("start_pos", meta.start_pos.len(), meta.num_chunks)?;
    need_len(
        "block_tables",
        meta.block_tables.len(),
        meta.num_chunks * meta.max_blocks,
    )?;
    let s = gpu.stream();
    check(
        aligned(&[addr(q, s), addr(cache, s), addr(out, s)], 16),
        || "q, cache and out must be 16-byte aligned".into(),
    )?;
    let q_rows = if q.len() >= row {
        (q.len() - row) / q_row_stride + 1
    } else {
        0
    };
    let q_rows = q_rows.min(out.len() / row);
    Ok(AttnParams {
        num_chunks: to_i32("num_chunks", meta.num_chunks)?,
        max_blocks: to_i32("max_blocks", meta.max_blocks)?,
        num_heads: num_heads as i32,
        kv_heads: num_kv_heads as i32,
        group: group as i32,
        block_size: block_size as i32,
        block_shift: block_size.trailing_zeros() as i32,
        num_blocks: to_i32("num_blocks", num_blocks)?,
        q_row_stride: to_i32("q_row_stride", q_row_stride)?,
        q_rows: to_i32("q rows", q_rows)?,
        num_splits: 1,
        head_dim: head_dim as i32,
        scale,
    })
}

/// Causal attention of prefill chunks (any lengths, any `start_pos`) over the paged cache.
/// Shapes: `q` `[T, q_row_stride]` bf16 (query heads in columns `0..num_heads*head_dim`), `cache`
/// one layer `[num_blocks][2][num_kv_heads][block_size][head_dim]` bf16, `out`
/// `[T, num_heads*head_dim]` bf16. Rows of `out` that belong to no chunk are left untouched.
pub fn prefill_attention(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    meta: &AttnMeta<'_>,
    shape: &AttnShape,
    cache: &CudaView<'_, bf16>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let p = params(gpu, q, meta, shape, cache, out)?;
    if meta.num_chunks == 0 || meta.max_q_len == 0 || p.q_rows == 0 {
        return Ok(());
    }
    let group = p.group as usize;
    // Upper bound of Σ_c ceil(len_c * group / 64).
    let per_chunk = (meta.max_q_len * group).div_ceil(PREFILL_ROWS);
    let tiles = (meta.num_chunks * per_chunk)
        .min((p.q_rows as usize * group).div_ceil(PREFILL_ROWS) + meta.num_chunks);
    let tiles = u32::try_from(tiles)
        .ok()
        .filter(|&t| t < i32::MAX as u32)
        .ok_or_else(|| GpuError::BadShape(format!("{tiles} query tiles exceed the grid")))?;
    let hd = shape.head_dim;
    let smem = 3 * KEY_TILE * (hd + 8) * 2 + KEY_TILE * 8;
    debug_assert!(smem <= MAX_DYNAMIC_SMEM);
    let kernel = if hd == 64 {
        Kernel::PrefillAttentionHd64
    } else {
        Kernel::PrefillAttentionHd128
    };
    let cfg = LaunchConfig {
        grid_dim: (tiles, shape.num_kv_heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut launch = gpu.stream().launch_builder(gpu.func(kernel));
    launch
        .arg(&p)
        .arg(q)
        .arg(meta.cu_q)
        .arg(meta.start_pos)
        .arg(meta.block_tables)
        .arg(cache)
        .arg(out);
    // SAFETY: argument types match prefill_attention_hd{64,128}; every buffer length was checked
    // against the sizes in `p`; the kernel validates the device-side metadata (token indices
    // against q_rows, block ids against num_blocks and max_blocks) before any access.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Attention of decode chunks (each exactly one query token, at position `start_pos[c]`) over
/// the paged cache, split over the context (flash-decoding). Shapes as in [`prefill_attention`];
/// `workspace` holds at least [`decode_workspace_len`]`(num_chunks, shape, max_context)` f32.
/// A chunk whose length is not 1 is skipped.
pub fn decode_attention(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    meta: &AttnMeta<'_>,
    shape: &AttnShape,
    cache: &CudaView<'_, bf16>,
    workspace: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let mut p = params(gpu, q, meta, shape, cache, out)?;
    let splits = decode_splits(meta.max_context);
    check(splits <= 65_535, || {
        format!("max_context {} needs too many splits", meta.max_context)
    })?;
    need_len(
        "workspace",
        workspace.len(),
        decode_workspace_len(meta.num_chunks, shape, meta.max_context),
    )?;
    if meta.num_chunks == 0 || p.q_rows == 0 {
        return Ok(());
    }
    check(meta.num_chunks <= i32::MAX as usize, || {
        "too many chunks".into()
    })?;
    p.num_splits = splits as i32;
    let (hd, group) = (shape.head_dim, p.group as usize);
    let smem = 2 * KEY_TILE * (hd + 8) * 2
        + (group * hd + group * KEY_TILE + 3 * group + 1) * 4
        + 8
        + KEY_TILE * 8;
    debug_assert!(smem <= MAX_DYNAMIC_SMEM);
    let kernel = if hd == 64 {
        Kernel::DecodeAttentionHd64
    } else {
        Kernel::DecodeAttentionHd128
    };
    let cfg = LaunchConfig {
        grid_dim: (
            meta.num_chunks as u32,
            shape.num_kv_heads as u32,
            splits as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let s = gpu.stream();
    let mut launch = s.launch_builder(gpu.func(kernel));
    launch
        .arg(&p)
        .arg(q)
        .arg(meta.cu_q)
        .arg(meta.start_pos)
        .arg(meta.block_tables)
        .arg(cache)
        .arg(&mut *workspace)
        .arg(&mut *out);
    // SAFETY: argument types match decode_attention_hd{64,128}; buffer lengths were checked
    // against `p` (the workspace against decode_workspace_len for these splits); the kernel
    // validates the device-side metadata before any access.
    unsafe { launch.launch(cfg) }?;
    if splits > 1 {
        let cfg = LaunchConfig {
            grid_dim: (meta.num_chunks as u32, shape.num_heads as u32, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = s.launch_builder(gpu.func(Kernel::DecodeReduce));
        launch.arg(&p).arg(meta.cu_q).arg(&mut *workspace).arg(out);
        // SAFETY: argument types match decode_reduce; it reads the partials the launch above
        // wrote (same `p`, same workspace) and writes one row of `out` per decode chunk.
        unsafe { launch.launch(cfg) }?;
    }
    Ok(())
}
