//! Device memory for transfers: the KV pools of CUDA engines registered as they are, so blocks move
//! device to device with no trip through host memory. [`DeviceKv`] is a connector's device side: the
//! GPU's kernel table and one stream of its own on which every transfer kernel runs (the block copy
//! with its checksum, the receiver's verification pass), each call synchronised before it returns.
//!
//! Invariants:
//! - The checksum of a chunk is the one `tandem_kernels::cpu::kv_checksum` defines, computed on the
//!   device over the blocks in payload order; the receiver computes it over the destination blocks
//!   after the payload landed and before anything is reported, exactly as on the host path.
//! - Every call waits for its kernels before returning, so the id and sum buffers it uploads never
//!   outlive their use, and a block reported written or verified is complete in device memory.
//! - One call at a time per connector (a mutex): the stream's work is never interleaved.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use tandem_kernels::cuda::{BlockArray, BlockList, Gpu, IpcAlloc, KvCopy, kv_checksum_finish, kv_copy_blocks};

use crate::core::lock;
use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::memory::{DeviceAllocation, KvMemory};

fn gpu_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what}: {e}"))
}

/// The primary context of GPU `device`, retained once per process.
pub(crate) fn context(device: i32) -> Result<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<i32, Arc<CudaContext>>>> = OnceLock::new();
    let mut map = lock(CONTEXTS.get_or_init(Mutex::default));
    if let Some(c) = map.get(&device) {
        return Ok(Arc::clone(c));
    }
    let ordinal = usize::try_from(device).map_err(|_| Error::Invalid(format!("device {device}")))?;
    // SAFETY: only tries to dlopen the candidate library names (cudarc would panic on a missing one).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Device(
            "no NVIDIA driver found (libcuda.so.1): device memory needs a GPU; put the driver's directory on LD_LIBRARY_PATH".into(),
        ));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| gpu_err(&format!("opening GPU {device}"), e))?;
    map.insert(device, Arc::clone(&ctx));
    Ok(ctx)
}

/// Copies host `data` to device address `addr` of GPU `device`, synchronously.
pub(crate) fn write(device: i32, addr: u64, data: &[u8]) -> Result<()> {
    let ctx = context(device)?;
    ctx.bind_to_thread().map_err(|e| gpu_err("binding the context", e))?;
    // SAFETY: `addr` is a block of registered device memory of this device (the caller checked the
    // block and holds its exclusive claim), `data.len()` bytes long; the copy is synchronous.
    unsafe { cudarc::driver::result::memcpy_htod_sync(addr, data) }.map_err(|e| gpu_err("writing a device block", e))
}

/// Copies `out.len()` bytes from device address `addr` of GPU `device` into `out`, synchronously.
pub(crate) fn read(device: i32, addr: u64, out: &mut [u8]) -> Result<()> {
    let ctx = context(device)?;
    ctx.bind_to_thread().map_err(|e| gpu_err("binding the context", e))?;
    // SAFETY: as in `write`, with a shared claim; the copy is synchronous.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(out, addr) }.map_err(|e| gpu_err("reading a device block", e))
}

impl KvMemory {
    /// Allocates `num_blocks` zeroed blocks per layer in device memory of GPU `device`, all layers in
    /// one allocation that CUDA IPC can export (tests, benchmarks, and backends' own pools).
    pub fn cuda(geometry: Geometry, num_blocks: u32, device: i32) -> Result<Arc<KvMemory>> {
        let ctx = context(device)?;
        let bb = geometry.block_bytes();
        let layer_bytes = (num_blocks as usize).checked_mul(bb).ok_or_else(|| Error::Invalid("pool too large".into()))?;
        let stride = layer_bytes.next_multiple_of(256).max(256);
        let total = stride.checked_mul(geometry.num_layers() as usize).ok_or_else(|| Error::Invalid("pool too large".into()))?;
        let alloc = IpcAlloc::new(&ctx, total).map_err(|e| gpu_err("allocating the device pool", e))?;
        let base = alloc.ptr();
        let layers = (0..geometry.num_layers() as u64).map(|l| base + l * stride as u64).collect();
        let allocation = DeviceAllocation { base, bytes: alloc.bytes() };
        // SAFETY: every layer base points to `layer_bytes` bytes inside `alloc`, which the memory keeps
        // alive as its owner; nothing else holds these addresses.
        unsafe { KvMemory::from_device(geometry, num_blocks, device, allocation, layers, Box::new(alloc)) }
    }
}

/// A connector's device side: kernels and a transfer stream on the pool's GPU.
pub(crate) struct DeviceKv {
    inner: Mutex<Inner>,
}

struct Inner {
    gpu: Gpu,
    stream: Arc<CudaStream>,
    /// Block ids of one call: the source list at 0, the destination list at `ids.len() / 2`
    /// (grown on demand, reused: a call allocates nothing in the common case).
    ids: CudaSlice<u32>,
    /// The checksum counter.
    sum: CudaSlice<u64>,
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceKv")
    }
}

/// Blocks of one layer array: where it starts, how many blocks it has, which of them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Blocks<'a> {
    pub(crate) base: u64,
    pub(crate) num_blocks: u32,
    pub(crate) ids: &'a [u32],
}

impl DeviceKv {
    /// Opens GPU `device` (the kernels come from the on-disk cache the engine filled) and a stream.
    pub(crate) fn new(device: i32) -> Result<DeviceKv> {
        let ordinal = usize::try_from(device).map_err(|_| Error::Invalid(format!("device {device}")))?;
        let gpu = Gpu::new(ordinal).map_err(|e| gpu_err(&format!("opening GPU {device} for KV transfers"), e))?;
        let stream = gpu.stream().context().new_stream().map_err(|e| gpu_err("creating the transfer stream", e))?;
        let ids = stream.alloc_zeros::<u32>(2 * crate::MAX_CHUNK_BLOCKS as usize).map_err(|e| gpu_err("allocating block ids", e))?;
        let sum = stream.alloc_zeros::<u64>(1).map_err(|e| gpu_err("allocating the checksum", e))?;
        Ok(DeviceKv { inner: Mutex::new(Inner { gpu, stream, ids, sum }) })
    }

    /// The CUDA context of the transfer stream.
    pub(crate) fn context(&self) -> Arc<CudaContext> {
        Arc::clone(lock(&self.inner).stream.context())
    }

    /// The checksum of `blocks` in order (device memory of this GPU), computed on the device.
    pub(crate) fn checksum(&self, blocks: Blocks<'_>, block_bytes: usize) -> Result<u64> {
        self.run(blocks, None, block_bytes, false)
    }

    /// Copies `src` blocks to `dst` blocks (pairwise; `dst` may be another process's memory mapped
    /// through CUDA IPC) and returns the checksum of what was read. `corrupt` flips one byte of the
    /// last destination block afterwards (the integrity test hook).
    pub(crate) fn copy(&self, src: Blocks<'_>, dst: Blocks<'_>, block_bytes: usize, corrupt: bool) -> Result<u64> {
        if src.ids.len() != dst.ids.len() {
            return Err(Error::Invalid(format!("{} source blocks for {} destination blocks", src.ids.len(), dst.ids.len())));
        }
        self.run(src, Some(dst), block_bytes, corrupt)
    }

    fn run(&self, src: Blocks<'_>, dst: Option<Blocks<'_>>, block_bytes: usize, corrupt: bool) -> Result<u64> {
        let mut guard = lock(&self.inner);
        let inner = &mut *guard;
        let s = Arc::clone(&inner.stream);
        let n = src.ids.len();
        fn err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
            move |e| gpu_err(what, e)
        }
        if 2 * n > inner.ids.len() {
            // Earlier calls finished (each synchronises before returning): the old buffer is free.
            inner.ids = s.alloc_zeros::<u32>(2 * n).map_err(err("allocating block ids"))?;
        }
        let half = inner.ids.len() / 2;
        s.memcpy_htod(src.ids, &mut inner.ids.slice_mut(0..n)).map_err(err("uploading block ids"))?;
        if let Some(d) = &dst {
            s.memcpy_htod(d.ids, &mut inner.ids.slice_mut(half..half + n)).map_err(err("uploading block ids"))?;
        }
        s.memset_zeros(&mut inner.sum).map_err(err("zeroing the checksum"))?;
        let op = KvCopy {
            src: BlockList { array: BlockArray { base: src.base, num_blocks: src.num_blocks }, ids: inner.ids.slice(0..n) },
            dst: dst.as_ref().map(|d| BlockList {
                array: BlockArray { base: d.base, num_blocks: d.num_blocks },
                ids: inner.ids.slice(half..half + n),
            }),
            block_bytes: block_bytes as u64,
            checksum: Some(inner.sum.as_view_mut()),
        };
        // SAFETY: `src` is registered device memory of this GPU (or, for `dst`, a live IPC mapping of a
        // peer's pool) of `num_blocks` blocks each; the transfer holds claims on the blocks read and
        // written, so no one else touches them; source and destination are different pools; the id
        // and sum buffers belong to `inner`, locked until the stream is synchronised below.
        unsafe { kv_copy_blocks(&inner.gpu, &s, op) }.map_err(|e| gpu_err("launching the KV copy", e))?;
        if corrupt && let (Some(d), Some(&last)) = (&dst, dst.as_ref().and_then(|d| d.ids.last())) {
            s.synchronize().map_err(err("waiting for the KV copy"))?;
            let at = d.base + u64::from(last) * block_bytes as u64 + (block_bytes as u64) / 2;
            let mut byte = [0u8; 1];
            // SAFETY: `at` lies inside the last destination block (in range: the kernel checked it
            // against `num_blocks` and the caller sized the array); synchronous one-byte copies.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_sync(&mut byte, at).map_err(err("corrupting (test hook)"))?;
                byte[0] ^= 0x10;
                cudarc::driver::result::memcpy_htod_sync(at, &byte).map_err(err("corrupting (test hook)"))?;
            }
        }
        let mut host = [0u64; 1];
        s.memcpy_dtoh(&inner.sum, &mut host).map_err(err("reading the checksum"))?;
        s.synchronize().map_err(err("waiting for the KV copy"))?;
        Ok(kv_checksum_finish(host[0], n, block_bytes as u64))
    }
}

/// Lets kernels on GPU `from` read and write memory of GPU `to` (CUDA peer access, over NVLink or
/// PCIe), as a sender in the same process as its receiver needs when their pools lie on two GPUs.
/// Nothing to do for one GPU; enabling it twice is harmless. A pair of GPUs without peer access is a
/// typed error, never a kernel that faults.
pub(crate) fn enable_peer_access(from: i32, to: i32) -> Result<()> {
    use cudarc::driver::sys::{CUresult, cuCtxEnablePeerAccess, cuDeviceCanAccessPeer};
    if from == to {
        return Ok(());
    }
    let (a, b) = (context(from)?, context(to)?);
    let mut can: std::ffi::c_int = 0;
    // SAFETY: `can` is a valid out-pointer; both devices come from live contexts.
    unsafe { cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
        .result()
        .map_err(|e| gpu_err("asking for peer access", e))?;
    if can == 0 {
        return Err(Error::Device(format!("GPU {from} cannot reach GPU {to}'s memory (no peer access between them)")));
    }
    a.bind_to_thread().map_err(|e| gpu_err("binding the context", e))?;
    // SAFETY: `a` is current on this thread and `b` is a live (retained) primary context.
    let r = unsafe { cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
    if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    r.result().map_err(|e| gpu_err(&format!("enabling peer access from GPU {from} to GPU {to}"), e))
}

/// The GPU whose memory device address `addr` lies in (asked with GPU `current`'s context bound).
pub(crate) fn device_of(current: i32, addr: u64) -> Result<i32> {
    use cudarc::driver::sys::{CUpointer_attribute, cuPointerGetAttribute};
    let ctx = context(current)?;
    ctx.bind_to_thread().map_err(|e| gpu_err("binding the context", e))?;
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: the device-ordinal attribute is one int, written into `ordinal`.
    unsafe {
        cuPointerGetAttribute(
            (&mut ordinal as *mut std::ffi::c_int).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        )
    }
    .result()
    .map_err(|e| gpu_err("asking which GPU an address is on", e))?;
    Ok(ordinal)
}

/// The two pools' allocations and GPUs, for the raw ceilings.
fn raw_pair(src: &KvMemory, dst: &KvMemory, bytes: usize) -> Result<(DeviceAllocation, DeviceAllocation, i32, i32)> {
    let (Some(a), Some(b), crate::MemoryKind::Cuda { device: da }, crate::MemoryKind::Cuda { device: db }) =
        (src.device_allocation(), dst.device_allocation(), src.kind(), dst.kind())
    else {
        return Err(Error::Invalid("a raw device copy needs two device pools".into()));
    };
    if bytes > a.bytes.min(b.bytes) {
        return Err(Error::Invalid(format!("{bytes} bytes exceed the pools")));
    }
    Ok((a, b, da, db))
}

/// Times one copy that `launch` enqueues on a fresh stream of GPU `device`, with CUDA events around
/// the copy alone.
fn time_copy(device: i32, what: &str, launch: impl FnOnce(&CudaStream) -> Result<()>) -> Result<std::time::Duration> {
    use cudarc::driver::sys::CUevent_flags;
    let ctx = context(device)?;
    let e = |e: cudarc::driver::DriverError| gpu_err(what, e);
    let stream = ctx.new_stream().map_err(e)?;
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    let stop = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
    start.record(&stream).map_err(e)?;
    launch(&stream)?;
    stop.record(&stream).map_err(e)?;
    stop.synchronize().map_err(e)?;
    let ms = start.elapsed_ms(&stop).map_err(e)?;
    Ok(std::time::Duration::from_secs_f64(f64::from(ms) / 1e3))
}

/// The ceiling a device backend is measured against on one GPU: one plain device-to-device copy of
/// the first `bytes` of `src`'s allocation into `dst`'s (`cuMemcpyDtoDAsync` on a stream of its
/// own), timed with CUDA events around the copy alone.
pub fn raw_device_copy(src: &KvMemory, dst: &KvMemory, bytes: usize) -> Result<std::time::Duration> {
    let (a, b, device, _) = raw_pair(src, dst, bytes)?;
    time_copy(device, "raw device copy", |stream| {
        // SAFETY: both ranges lie inside live device allocations (checked by `raw_pair`) that
        // nothing else writes during a benchmark; `time_copy` synchronises the stream before
        // returning.
        unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(b.base, a.base, bytes, stream.cu_stream()) }
            .result()
            .map_err(|e| gpu_err("raw device copy", e))
    })
}

/// The copy-engine ceiling between two GPUs (`cudaMemcpyPeer`): one `cuMemcpyPeerAsync` of the first
/// `bytes` of `src`'s allocation (on its GPU) into `dst`'s (on another), peer access enabled both
/// ways first, timed with CUDA events on a stream of the source GPU.
pub fn raw_peer_copy(src: &KvMemory, dst: &KvMemory, bytes: usize) -> Result<std::time::Duration> {
    let (a, b, da, db) = raw_pair(src, dst, bytes)?;
    enable_peer_access(da, db)?;
    enable_peer_access(db, da)?;
    let (ca, cb) = (context(da)?, context(db)?);
    time_copy(da, "raw peer copy", |stream| {
        // SAFETY: both ranges lie inside live device allocations of their GPUs (checked by
        // `raw_pair`), whose contexts `ca` and `cb` are; nothing else writes them during a benchmark;
        // `time_copy` synchronises the stream before returning.
        unsafe { cudarc::driver::sys::cuMemcpyPeerAsync(b.base, cb.cu_ctx(), a.base, ca.cu_ctx(), bytes, stream.cu_stream()) }
            .result()
            .map_err(|e| gpu_err("raw peer copy", e))
    })
}
