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

/// Key rows per shared-memory tile of the prefill kernel (`PF_BK`).
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
    split_keys: i32,
    head_dim: i32,
    scale: f32,
}

// SAFETY: repr(C), only i32/f32 fields, no padding or pointers; matches the CUDA struct.
unsafe impl DeviceRepr for AttnParams {}

/// The shortest decode split (keys); every split is a multiple of it (4 warps x 16 keys).
pub const DECODE_MIN_SPLIT: usize = 64;
/// The longest decode split the launcher picks. The engine's decode graphs bound the context by
/// a power of two at least 1024, so a 1k-context batch launches for 2048 keys: with 2048-key
/// splits that is one split per sequence (no partials, no reduction), where 1024-key splits
/// launched a second, nearly empty CTA per sequence and head and a reduction over both.
const DECODE_MAX_SPLIT: usize = 2048;
/// CTAs a decode launch aims for. Longer splits pay the pipeline's start and the reduction less
/// often; on an H100 (132 SMs) at 1k context a 1024-key split (the whole context) was fastest
/// from batch 16 up (one CTA per SM already streams 2 TB/s), and at batch 1 (8 KV heads) 128
/// keys, 64 CTAs, was (`tandem bench engine --breakdown-only` times every split).
const DECODE_TARGET_CTAS: usize = 64;

/// Keys per split that [`decode_attention`] uses for `num_chunks` sequences with contexts up to
/// `max_context`: the longest split, up to `DECODE_MAX_SPLIT` keys, whose grid still has about
/// `DECODE_TARGET_CTAS` CTAs (fewer partials to combine), never shorter than [`DECODE_MIN_SPLIT`].
pub fn decode_split_keys(num_chunks: usize, num_kv_heads: usize, max_context: usize) -> usize {
    let mut split = DECODE_MAX_SPLIT;
    while split > DECODE_MIN_SPLIT
        && num_chunks * num_kv_heads * max_context.div_ceil(split) < DECODE_TARGET_CTAS
    {
        split /= 2;
    }
    split
}

/// Splits of a decode launch with `split_keys` keys per split.
fn decode_splits(max_context: usize, split_keys: usize) -> usize {
    max_context.div_ceil(split_keys).max(1)
}

/// f32 the workspace of one decode launch needs (0 with one split).
fn split_workspace_len(num_chunks: usize, shape: &AttnShape, max_context: usize, split_keys: usize) -> usize {
    let splits = decode_splits(max_context, split_keys);
    if splits == 1 {
        0
    } else {
        num_chunks * shape.num_heads * splits * (shape.head_dim + 2)
    }
}

/// How many f32 the `workspace` of [`decode_attention`] must hold for any launch of up to
/// `num_chunks` chunks with contexts up to `max_context` (0 when one split always suffices).
///
/// A bound, not the exact need of one launch: a graph captured for fewer chunks or a shorter
/// context picks a shorter split and may need more partials per chunk. When
/// [`decode_split_keys`] stops below `DECODE_MAX_SPLIT` keys, the grid has fewer than
/// `2 * DECODE_TARGET_CTAS` CTAs (halving once more fell below the target); at the longest split
/// it has `chunks * kv_heads * ceil(context / DECODE_MAX_SPLIT)`. Each CTA writes `group * (head_dim + 2)` f32.
pub fn decode_workspace_len(num_chunks: usize, shape: &AttnShape, max_context: usize) -> usize {
    if max_context <= DECODE_MIN_SPLIT || num_chunks == 0 || shape.num_kv_heads == 0 {
        return 0;
    }
    let group = shape.num_heads / shape.num_kv_heads;
    let ctas = (2 * DECODE_TARGET_CTAS)
        .max(num_chunks * shape.num_kv_heads * max_context.div_ceil(DECODE_MAX_SPLIT));
    let bound = ctas * group * (shape.head_dim + 2);
    bound.min(split_workspace_len(num_chunks, shape, max_context, DECODE_MIN_SPLIT))
}

/// Dynamic shared memory of a decode CTA: 4 warps x 2 stages x (K, V) x 16 rows of
/// `head_dim + 8` bf16 (`DecodeSmem<HD>::BYTES` in attention_decode.cu).
fn decode_smem(head_dim: usize) -> usize {
    4 * 2 * 2 * 16 * (head_dim + 8) * 2
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
        split_keys: 0,
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
/// the paged cache, split over the context (flash-decoding) with [`decode_split_keys`] keys per
/// split. Shapes as in [`prefill_attention`]; `workspace` holds at least
/// [`decode_workspace_len`]`(num_chunks, shape, max_context)` f32. A chunk whose length is not 1
/// is skipped.
pub fn decode_attention(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    meta: &AttnMeta<'_>,
    shape: &AttnShape,
    cache: &CudaView<'_, bf16>,
    workspace: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let split = decode_split_keys(meta.num_chunks, shape.num_kv_heads, meta.max_context);
    decode_attention_split(gpu, q, meta, shape, cache, split, workspace, out)
}

/// [`decode_attention`] with `split_keys` keys per split (a positive multiple of
/// [`DECODE_MIN_SPLIT`]), for benchmarks and tests; the workspace must hold what that split needs
/// (`num_chunks * num_heads * splits * (head_dim + 2)` f32 with more than one split).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_split(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    meta: &AttnMeta<'_>,
    shape: &AttnShape,
    cache: &CudaView<'_, bf16>,
    split_keys: usize,
    workspace: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let mut p = params(gpu, q, meta, shape, cache, out)?;
    check(
        split_keys > 0 && split_keys.is_multiple_of(DECODE_MIN_SPLIT) && split_keys <= i32::MAX as usize,
        || format!("split_keys {split_keys} must be a positive multiple of {DECODE_MIN_SPLIT}"),
    )?;
    let splits = decode_splits(meta.max_context, split_keys);
    check(splits <= 65_535, || {
        format!("max_context {} needs too many splits", meta.max_context)
    })?;
    // The kernel computes split * split_keys + split_keys in int.
    check(
        (splits + 1).saturating_mul(split_keys) <= i32::MAX as usize,
        || format!("{splits} splits of {split_keys} keys overflow the kernel's key positions"),
    )?;
    need_len(
        "workspace",
        workspace.len(),
        split_workspace_len(meta.num_chunks, shape, meta.max_context, split_keys),
    )?;
    if meta.num_chunks == 0 || p.q_rows == 0 {
        return Ok(());
    }
    check(meta.num_chunks <= i32::MAX as usize, || {
        "too many chunks".into()
    })?;
    p.split_keys = split_keys as i32;
    p.num_splits = splits as i32;
    let hd = shape.head_dim;
    let smem = decode_smem(hd);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape { num_heads, num_kv_heads, head_dim, block_size: 16, num_blocks: 1, q_row_stride: num_heads * head_dim, scale: 1.0 }
    }

    #[test]
    fn split_keys_fill_the_gpu_within_bounds() {
        // Batch 1 at 1k context with 8 KV heads: 128 keys; batch 16 and up: the longest split,
        // one per sequence also for the 2048-key bound of a 1k-context decode graph.
        assert_eq!(decode_split_keys(1, 8, 1024), 128);
        assert_eq!(decode_split_keys(16, 8, 1024), DECODE_MAX_SPLIT);
        assert_eq!(decode_split_keys(16, 8, 2048), 2048);
        assert_eq!(decode_split_keys(1, 1, 1024), DECODE_MIN_SPLIT);
        for (chunks, kv, ctx) in [(1, 1, 1), (3, 8, 5000), (64, 8, 1024), (1000, 2, 131_072)] {
            let s = decode_split_keys(chunks, kv, ctx);
            assert!(s.is_multiple_of(DECODE_MIN_SPLIT) && (DECODE_MIN_SPLIT..=DECODE_MAX_SPLIT).contains(&s));
            // Below the longest split the grid has between the target and twice it, unless the
            // shortest split still falls short.
            let ctas = chunks * kv * ctx.div_ceil(s);
            if s < DECODE_MAX_SPLIT {
                assert!(ctas < 2 * DECODE_TARGET_CTAS, "{chunks} {kv} {ctx}: {ctas}");
                assert!(ctas >= DECODE_TARGET_CTAS || s == DECODE_MIN_SPLIT);
            }
        }
    }

    #[test]
    fn workspace_bound_covers_every_smaller_launch() {
        // A graph captured for fewer chunks or a shorter context must fit the workspace sized for
        // the maximum: check every chunk count and a sweep of contexts exhaustively.
        for (nh, kv, hd) in [(32, 8, 128), (9, 3, 64), (16, 16, 64)] {
            let sh = shape(nh, kv, hd);
            for (max_chunks, max_ctx) in [(1, 64), (1, 65), (4, 5000), (64, 2048), (300, 8192), (17, 131_072)] {
                let bound = decode_workspace_len(max_chunks, &sh, max_ctx);
                for b in 1..=max_chunks {
                    for ctx in (1..=max_ctx).step_by(max_ctx.div_ceil(300)).chain([max_ctx]) {
                        let need = split_workspace_len(b, &sh, ctx, decode_split_keys(b, kv, ctx));
                        assert!(need <= bound, "{nh}/{kv}x{hd}: {b} chunks at {ctx} need {need} > {bound}");
                    }
                }
            }
        }
        assert_eq!(decode_workspace_len(10, &shape(32, 8, 128), 64), 0, "one split always suffices");
    }
}
