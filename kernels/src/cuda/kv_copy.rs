//! Launcher of the KV block copy with a device checksum (`kernels/cuda/kv_copy.cu`), the device
//! half of GPU-resident KV transfer: block `src.ids[i]` of one layer's block array goes to block
//! `dst.ids[i]` of another (a peer's layer opened through CUDA IPC, or a contiguous staging buffer
//! when packing or unpacking for NCCL), and the kernel adds the checksum terms of the bytes it read
//! ([`crate::cpu::kv_checksum`] defines the checksum) into a device counter. The receiver runs the
//! same kernel without a destination over the blocks it received and compares.
//!
//! Invariants: the launcher checks everything it can on the host (lengths, alignment, that the
//! arrays' extents do not wrap) and returns [`GpuError::BadShape`] otherwise, never a panic; block
//! ids are validated in the kernel (an id outside its array is skipped, no read and no write, and
//! poisons the checksum with [`KV_BAD_BLOCK_POISON`]), so no launch touches memory outside the two
//! arrays. Launches run on the caller's stream, never implicitly on [`Gpu::stream`], and do not
//! synchronise.
//!
//! Grid: CTAs of 256 threads, as many as the chunk has 2 KiB warp tasks (a slice of one block) up
//! to 8 per SM; each warp walks the tasks with a grid stride, 16-byte loads of a lane issued
//! before its stores, and the checksum costs one atomic per CTA. On an H100 a 256 MiB chunk (64 KiB
//! or 6 KiB blocks) copies with checksum at about 2.7 TB/s read + write, about 93% of
//! `cuMemcpyDtoD` of the same bytes contiguous; the checksum-only pass reads at the same rate.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::checks::{addr, aligned, blocks};
use super::error::{Result, check, to_i32};
use super::gpu::Gpu;
use super::kernel::Kernel;

/// What one block pair with an out-of-range id adds to the kernel's sum instead of its words' terms
/// (`KV_BAD_BLOCK` in kv_copy.cu), so a transfer that named a bad block fails verification.
pub const KV_BAD_BLOCK_POISON: u64 = 0x5bd1_e995_5bd1_e995;

/// The largest block the kernel takes (its vector counts are `int`).
const MAX_BLOCK_BYTES: u64 = 1 << 30;
/// Threads per CTA (8 warps); each warp walks its own tasks of 2 KiB.
const THREADS: u32 = 256;
/// 16-byte vectors per warp task (`KV_TASK_VECS` in kv_copy.cu).
const TASK_VECS: u64 = 128;
/// CTAs per SM at most: enough to fill an SM; more would only queue.
const CTAS_PER_SM: u32 = 8;

/// One layer's block array on the device: `num_blocks` blocks of the launch's `block_bytes` bytes
/// each, contiguous from the device address `base` (a `CUdeviceptr`, possibly a CUDA IPC mapping
/// of another process's memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockArray {
    /// Device address of block 0; 16-byte aligned.
    pub base: u64,
    /// Blocks in the array: ids `>= num_blocks` are refused by the kernel.
    pub num_blocks: u32,
}

impl BlockArray {
    /// The array a buffer of `gpu` holds: its address, and as many whole blocks of `block_bytes`
    /// as fit in it (at most `u32::MAX`; none when `block_bytes` is 0).
    pub fn of<T>(gpu: &Gpu, buf: &CudaView<'_, T>, block_bytes: u64) -> BlockArray {
        let bytes = (buf.len() as u64).saturating_mul(size_of::<T>() as u64);
        let num_blocks = bytes.checked_div(block_bytes).unwrap_or(0);
        BlockArray {
            base: addr(buf, gpu.stream()),
            num_blocks: u32::try_from(num_blocks).unwrap_or(u32::MAX),
        }
    }
}

/// A list of blocks of one array: entry `i` is block `ids[i]` of `array`.
#[derive(Debug)]
pub struct BlockList<'a> {
    /// The array the ids index.
    pub array: BlockArray,
    /// Block ids on the device, one per block of the chunk, in payload order.
    pub ids: CudaView<'a, u32>,
}

/// One launch: a chunk's blocks, where they go, and where the checksum sum goes.
#[derive(Debug)]
pub struct KvCopy<'a> {
    /// The blocks read, in payload order.
    pub src: BlockList<'a>,
    /// Where block `i` is written: `dst.ids[i]` of `dst.array` (as many ids as `src`). `None`
    /// reads and sums only (the receiver's verification pass over the blocks it received).
    pub dst: Option<BlockList<'a>>,
    /// Bytes per block: a positive multiple of 16, at most 1 GiB.
    pub block_bytes: u64,
    /// Element 0 receives `+=` the wrapping sum of the checksum terms of the bytes read (zero it
    /// first, e.g. with `stream.memset_zeros`); finish with [`kv_checksum_finish`]. `None` copies
    /// without a checksum.
    pub checksum: Option<CudaViewMut<'a, u64>>,
}

/// The checksum of a chunk of `n_blocks` blocks of `block_bytes` from the sum the kernel left in
/// its counter: the sum xor the payload's length in bytes (see [`crate::cpu::kv_checksum`], which
/// computes the same value on the host).
pub fn kv_checksum_finish(sum: u64, n_blocks: usize, block_bytes: u64) -> u64 {
    sum ^ (n_blocks as u64).wrapping_mul(block_bytes)
}

/// `BadShape` unless `block_bytes` is a positive multiple of 16 up to 1 GiB and `stream` belongs
/// to `gpu`'s context (whose kernel table a launch uses).
fn check_launch(gpu: &Gpu, stream: &CudaStream, block_bytes: u64) -> Result<()> {
    check(
        block_bytes > 0 && block_bytes.is_multiple_of(16) && block_bytes <= MAX_BLOCK_BYTES,
        || format!("block_bytes {block_bytes} is not a positive multiple of 16 up to 1 GiB"),
    )?;
    check(
        stream.context().cu_ctx() == gpu.stream().context().cu_ctx(),
        || "the stream belongs to another CUDA context than the Gpu".into(),
    )
}

/// The grid of a launch over `n` blocks of `block_bytes`: CTAs of `THREADS`, one warp per 2 KiB
/// task, at most `CTAS_PER_SM` per SM of the stream's device.
fn grid(stream: &CudaStream, n: usize, block_bytes: u64) -> Result<LaunchConfig> {
    let tasks = (n as u64) * (block_bytes / 16).div_ceil(TASK_VECS);
    let warps_per_cta = u64::from(THREADS / 32);
    let sms = stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let max_ctas = u32::try_from(sms).unwrap_or(1).clamp(1, 65_535) * CTAS_PER_SM;
    let warps = tasks.min(u64::from(max_ctas) * warps_per_cta);
    Ok(LaunchConfig {
        grid_dim: (blocks(warps as usize, warps_per_cta as usize), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `BadShape` unless `a` is a usable array of `block_bytes` blocks: 16-byte aligned, non-null
/// when it has blocks, and its end does not wrap around the address space.
fn check_array(what: &str, a: BlockArray, block_bytes: u64) -> Result<()> {
    check(aligned(&[a.base], 16), || {
        format!("{what} base {:#x} is not 16-byte aligned", a.base)
    })?;
    check(a.base != 0 || a.num_blocks == 0, || {
        format!(
            "{what} base is null but the array has {} blocks",
            a.num_blocks
        )
    })?;
    let end = u64::from(a.num_blocks)
        .checked_mul(block_bytes)
        .and_then(|len| len.checked_add(a.base));
    check(end.is_some(), || {
        format!(
            "{what}: {} blocks of {block_bytes} bytes from {:#x} overflow the address space",
            a.num_blocks, a.base
        )
    })
}

/// Enqueues the copy (or, with `dst: None`, the read-only checksum pass) of one chunk on `stream`
/// and returns without waiting. For `i < n` (`n = src.ids.len()`) block `src.ids[i]` of
/// `src.array` is copied to block `dst.ids[i]` of `dst.array`, and `checksum[0]` receives the sum
/// of the terms of the bytes read, payload word `j = (i * block_bytes + offset) / 8`; the chunk's
/// checksum is `kv_checksum_finish(sum, n, block_bytes)`, equal to [`crate::cpu::kv_checksum`] of
/// the `n` source blocks in list order. `n == 0` enqueues nothing.
///
/// A pair whose source id is `>= src.array.num_blocks` or whose destination id is
/// `>= dst.array.num_blocks` is skipped (nothing read, nothing written) and adds
/// [`KV_BAD_BLOCK_POISON`] to the sum in place of its words' terms, so verification fails.
///
/// `stream` must belong to `gpu`'s context (its kernel table is used); a transfer normally runs on
/// a stream of its own, e.g. `gpu.stream().context().new_stream()`. Event tracking is off in that
/// context, so ordering against other streams (the producer of the blocks, the consumer of the
/// checksum) is the caller's, with events.
///
/// # Safety
///
/// From the launch until the stream has executed it:
/// - `src.array.base` must be valid device memory readable from `gpu`'s device for
///   `src.array.num_blocks * block_bytes` bytes, and `dst.array.base` (when given) valid and
///   writable for `dst.array.num_blocks * block_bytes` bytes (memory of another process mapped
///   through CUDA IPC qualifies while the mapping stays open);
/// - no one else may write the blocks read or read or write the blocks written, and a
///   destination block must not overlap a source block of the same launch (the bytes copied and
///   the checksum are unspecified otherwise; memory outside the arrays is still never touched);
/// - the id and checksum buffers must stay alive (their views' borrows end at the return, not
///   when the stream runs).
pub unsafe fn kv_copy_blocks(gpu: &Gpu, stream: &CudaStream, op: KvCopy<'_>) -> Result<()> {
    let KvCopy {
        src,
        dst,
        block_bytes,
        checksum,
    } = op;
    check_launch(gpu, stream, block_bytes)?;
    let n = src.ids.len();
    let n_i = to_i32("blocks in the chunk", n)?;
    check_array("source", src.array, block_bytes)?;
    if let Some(d) = &dst {
        check(d.ids.len() == n, || {
            format!("{} source ids but {} destination ids", n, d.ids.len())
        })?;
        check_array("destination", d.array, block_bytes)?;
    }
    if let Some(c) = &checksum {
        check(!c.is_empty(), || "the checksum buffer is empty".into())?;
    }
    if n == 0 {
        return Ok(());
    }
    let block_vecs = (block_bytes / 16) as i32; // <= 2^26: checked above
    let cfg = grid(stream, n, block_bytes)?;
    let (dst_base, dst_num_blocks, dst_ids, do_copy) = match &dst {
        Some(d) => (d.array.base, d.array.num_blocks, addr(&d.ids, stream), 1i32),
        None => (0u64, 0u32, 0u64, 0i32),
    };
    let checksum_ptr = match &checksum {
        Some(c) => addr(c, stream),
        None => 0u64,
    };
    let mut launch = stream.launch_builder(gpu.func(Kernel::KvCopyBlocks));
    launch
        .arg(&src.array.base)
        .arg(&src.ids)
        .arg(&src.array.num_blocks)
        .arg(&dst_base)
        .arg(&dst_ids)
        .arg(&dst_num_blocks)
        .arg(&n_i)
        .arg(&block_vecs)
        .arg(&checksum_ptr)
        .arg(&do_copy);
    // SAFETY: argument types match `kv_copy_blocks` in kv_copy.cu (device addresses as u64, 0 =
    // null; num_blocks u32; n, block_vecs, do_copy int). The kernel reads src_ids[0..n) and, when
    // do_copy, dst_ids[0..n) (both views hold n ids); it reads and writes only blocks whose ids it
    // checked against num_blocks, inside arrays the caller guarantees valid for num_blocks *
    // block_bytes bytes (16-byte aligned, checked above; block_bytes is a multiple of 16); it
    // writes checksum[0] only, and only when the pointer is non-null (a non-empty view).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// One chunk of a segmented launch ([`kv_copy_segments`]): `blocks` pairs of the launch's id
/// lists, read from the array at `src` and (when copying) written to the array at `dst` (both of
/// the launch's `num_blocks`; usually one layer of each pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSegment {
    /// Device address of block 0 of the source array; 16-byte aligned, non-null.
    pub src: u64,
    /// Device address of block 0 of the destination array (ignored without a copy).
    pub dst: u64,
    /// Pairs in this segment (positive).
    pub blocks: u32,
}

/// The device table a segmented launch reads, as u64 words: every segment's source base, then
/// every destination base, then the segments' starts in the id lists (`segments.len() + 1` of
/// them, the last being the total). Upload it and pass it as [`KvSegments::table`].
pub fn kv_segment_table(segments: &[KvSegment]) -> Vec<u64> {
    let mut t = Vec::with_capacity(3 * segments.len() + 1);
    t.extend(segments.iter().map(|s| s.src));
    t.extend(segments.iter().map(|s| s.dst));
    let mut at = 0u64;
    t.push(0);
    for s in segments {
        at += u64::from(s.blocks);
        t.push(at);
    }
    t
}

/// A segmented launch: several chunks, each with its own arrays and checksum, in one kernel.
#[derive(Debug)]
pub struct KvSegments<'a> {
    /// The segments, on the host (checked by the launcher).
    pub segments: &'a [KvSegment],
    /// [`kv_segment_table`] of `segments`, on the device.
    pub table: CudaView<'a, u64>,
    /// Source block ids, every segment's in turn (as many as the segments' blocks in total).
    pub src_ids: CudaView<'a, u32>,
    /// Blocks of each source array.
    pub src_num_blocks: u32,
    /// Destination block ids (as many as `src_ids`); `None` reads and sums only.
    pub dst_ids: Option<CudaView<'a, u32>>,
    /// Blocks of each destination array.
    pub dst_num_blocks: u32,
    /// Bytes per block: a positive multiple of 16, at most 1 GiB.
    pub block_bytes: u64,
    /// Element `s` receives `+=` segment `s`'s wrapping sum (zero them first; finish each with
    /// [`kv_checksum_finish`] and the segment's block count). `None` copies without checksums.
    pub checksums: Option<CudaViewMut<'a, u64>>,
}

/// Enqueues a segmented copy (or, with `dst_ids: None`, checksum-only pass) on `stream` and
/// returns without waiting: for each segment `s`, what [`kv_copy_blocks`] does for a chunk whose
/// arrays start at `segments[s].src` / `.dst` and whose ids are the segment's slice of the lists,
/// with `checksums[s]` as its counter. No segments enqueues nothing.
///
/// # Safety
///
/// As for [`kv_copy_blocks`], for every segment's arrays (`src_num_blocks` / `dst_num_blocks`
/// blocks each); besides, `table` must hold exactly [`kv_segment_table`] of `segments` (the kernel
/// takes the arrays' addresses from it), and it, the ids and the checksums must stay alive until
/// the stream has executed the launch.
pub unsafe fn kv_copy_segments(gpu: &Gpu, stream: &CudaStream, op: KvSegments<'_>) -> Result<()> {
    let KvSegments {
        segments,
        table,
        src_ids,
        src_num_blocks,
        dst_ids,
        dst_num_blocks,
        block_bytes,
        checksums,
    } = op;
    check_launch(gpu, stream, block_bytes)?;
    if segments.is_empty() {
        return Ok(());
    }
    let nseg = to_i32("segments", segments.len())?;
    check(table.len() == 3 * segments.len() + 1, || {
        format!(
            "a table of {} words for {} segments",
            table.len(),
            segments.len()
        )
    })?;
    let mut n = 0usize;
    for (i, s) in segments.iter().enumerate() {
        check(s.blocks > 0, || format!("segment {i} is empty"))?;
        n += s.blocks as usize;
        check_array(
            "source",
            BlockArray {
                base: s.src,
                num_blocks: src_num_blocks,
            },
            block_bytes,
        )?;
        if dst_ids.is_some() {
            check_array(
                "destination",
                BlockArray {
                    base: s.dst,
                    num_blocks: dst_num_blocks,
                },
                block_bytes,
            )?;
        }
    }
    check(src_ids.len() == n, || {
        format!("{} source ids for segments of {n} blocks", src_ids.len())
    })?;
    if let Some(d) = &dst_ids {
        check(d.len() == n, || {
            format!("{} destination ids for {n} source ids", d.len())
        })?;
    }
    if let Some(c) = &checksums {
        check(c.len() >= segments.len(), || {
            format!("{} checksums for {} segments", c.len(), segments.len())
        })?;
    }
    let block_vecs = (block_bytes / 16) as i32; // <= 2^26: checked above
    let cfg = grid(stream, n, block_bytes)?;
    let (dst_ptr, do_copy) = match &dst_ids {
        Some(d) => (addr(d, stream), 1i32),
        None => (0u64, 0i32),
    };
    let checksum_ptr = match &checksums {
        Some(c) => addr(c, stream),
        None => 0u64,
    };
    let table_ptr = addr(&table, stream);
    let src_ptr = addr(&src_ids, stream);
    let mut launch = stream.launch_builder(gpu.func(Kernel::KvCopySegments));
    launch
        .arg(&table_ptr)
        .arg(&nseg)
        .arg(&src_ptr)
        .arg(&src_num_blocks)
        .arg(&dst_ptr)
        .arg(&dst_num_blocks)
        .arg(&block_vecs)
        .arg(&checksum_ptr)
        .arg(&do_copy);
    // SAFETY: argument types match `kv_copy_segments` in kv_copy.cu (device addresses as u64, 0 =
    // null; nseg, block_vecs, do_copy int; num_blocks u32). The kernel reads table[0..3 nseg + 1)
    // (checked length; the caller guarantees its content, so every base it uses is one checked
    // above), src_ids and dst_ids [0..n) (checked lengths), reads and writes only blocks whose ids
    // it checked against num_blocks inside arrays valid for num_blocks * block_bytes bytes, and
    // writes checksums[0..nseg) only when the pointer is non-null.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
