//! Device memory for transfers: the KV pools of CUDA engines registered as they are, so blocks move
//! device to device with no trip through host memory. [`DeviceKv`] is a connector's device side: the
//! GPU's kernel table, one stream on which the synchronous checksum calls run (each synchronised
//! before it returns), and a second stream for pulls — a batch of chunks copied and then verified
//! (each chunk's destination summed), returning an event instead of waiting: cuda-ipc receivers
//! pipeline them, nccl moves its staging buffers with them (plus, for a cuda-ipc sender's pool on
//! another GPU, a stream of that GPU whose copy engines push into ours).
//!
//! Invariants:
//! - The checksum of a chunk is the one `tandem_kernels::cpu::kv_checksum` defines, computed on the
//!   device over the blocks in payload order; the receiver computes it over the destination blocks
//!   after the payload landed and before anything is reported, exactly as on the host path (a pull
//!   runs its verification pass behind its copy on the same stream).
//! - Every synchronous call waits for its kernels before returning, so the id and sum buffers it
//!   uploads never outlive their use, and a block reported written or verified is complete in
//!   device memory. A pull's slot (staged ids, counter, event) is its caller's until the pull's
//!   event completed and its sum was read.
//! - One synchronous call at a time per connector, one pull enqueued at a time (two mutexes): a
//!   stream's work is never interleaved.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use tandem_kernels::cuda::{
    Gpu, IpcAlloc, KvSegment, KvSegments, kv_checksum_finish, kv_copy_segments,
    kv_segment_table,
};

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
    /// The kernel table (shared by both streams' launches; launching needs no exclusive access).
    gpu: Gpu,
    inner: Mutex<Inner>,
    /// The receiver's pipelined pulls (made on first use; only receivers of cuda-ipc pull).
    pull: Mutex<Option<Pull>>,
    /// A sender's writes into receivers' pools (made on first use; cuda-ipc senders that write).
    writer: Mutex<Option<Writer>>,
}

/// One copy of contiguous bytes: `(destination address, source address, bytes)`.
pub(crate) type CopyRun = (u64, u64, usize);

/// Appends the copy `(destination, source, bytes)` to `runs`, merged into the last one where both
/// sides continue it.
pub(crate) fn push_run(runs: &mut Vec<CopyRun>, dst: u64, src: u64, bytes: usize) {
    match runs.last_mut() {
        Some((d, s, n)) if *d + *n as u64 == dst && *s + *n as u64 == src => *n += bytes,
        _ => runs.push((dst, src, bytes)),
    }
}

/// One copy of `rows` equal runs at a constant stride on each side: row `i` moves `width` bytes
/// from `src + i * src_pitch` to `dst + i * dst_pitch`. A transfer names the same blocks in every
/// layer and a pool's layers lie at a constant stride, so one run of blocks across a group's layers
/// is one of these: the copy engines take it as one operation (a 2D/3D copy), where a copy per
/// layer costs them ~3 µs per boundary (32 layer runs of 8 MiB across NVLink: 773 µs as 32
/// copies, 681 µs as one strided copy, the same as one contiguous 256 MiB copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StridedCopy {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) width: usize,
    pub(crate) rows: usize,
    pub(crate) dst_pitch: u64,
    pub(crate) src_pitch: u64,
}

impl StridedCopy {
    /// A plain run: one row.
    pub(crate) fn run((dst, src, width): CopyRun) -> StridedCopy {
        StridedCopy { dst, src, width, rows: 1, dst_pitch: width as u64, src_pitch: width as u64 }
    }

    /// Its rows as plain runs.
    pub(crate) fn runs(&self) -> impl Iterator<Item = CopyRun> + '_ {
        (0..self.rows as u64).map(|i| (self.dst + i * self.dst_pitch, self.src + i * self.src_pitch, self.width))
    }
}

/// The copies that move `chunks` (each chunk's runs, in order): where every chunk has as many runs
/// as the first, of the same widths, and each run's addresses advance by the same two strides from
/// one chunk to the next (rows that do not overlap), one strided copy per run across the chunks;
/// otherwise the runs themselves, neighbours merged where both sides continue. Whichever is fewer
/// copies.
pub(crate) fn strided_copies(chunks: &[Vec<CopyRun>]) -> Vec<StridedCopy> {
    let mut flat: Vec<CopyRun> = Vec::new();
    for &(dst, src, bytes) in chunks.iter().flatten() {
        push_run(&mut flat, dst, src, bytes);
    }
    let strided = match chunks {
        [first, second, ..] if first.len() == second.len() && !first.is_empty() => {
            let pitch = |a: &CopyRun, b: &CopyRun| Some((b.0.checked_sub(a.0)?, b.1.checked_sub(a.1)?));
            let pitches: Option<Vec<(u64, u64)>> = first.iter().zip(second).map(|(a, b)| pitch(a, b)).collect();
            pitches.filter(|pitches| {
                first.iter().zip(pitches).all(|(r, &(dp, sp))| dp >= r.2 as u64 && sp >= r.2 as u64)
                    && chunks.windows(2).all(|w| {
                        w[0].len() == w[1].len()
                            && w[0].iter().zip(&w[1]).zip(pitches).all(|((a, b), &p)| a.2 == b.2 && pitch(a, b) == Some(p))
                    })
            })
            .map(|pitches| {
                first
                    .iter()
                    .zip(pitches)
                    .map(|(&(dst, src, width), (dst_pitch, src_pitch))| StridedCopy { dst, src, width, rows: chunks.len(), dst_pitch, src_pitch })
                    .collect::<Vec<_>>()
            })
        }
        _ => None,
    };
    match strided {
        Some(s) if s.len() < flat.len() => s,
        _ => flat.into_iter().map(StridedCopy::run).collect(),
    }
}

/// How many interprocess events a writing sender records in turn (one per group of writes).
pub(crate) const WRITE_EVENTS: usize = 64;

/// A sender's write lane: a stream of its GPU on which its copies into receivers' pools run, and a
/// ring of interprocess events recorded behind them, which receivers wait on before verifying.
/// (Re-recording an event only makes a later waiter wait longer: one stream, in order.)
///
/// Each interprocess event has a plain twin, for receivers in this same process: the driver (580,
/// H100) crashes in `cuStreamWaitEvent` when a stream of another GPU waits on an interprocess event
/// of the process that made it, and refuses to open the handle of an event of its own process; a
/// plain event may be waited on from any GPU. A write records only the kind its receiver waits on
/// (recording both cost ~1.5 points of the peer copy's rate at 256 MiB across two H200s).
struct Writer {
    // Events before the stream (drop order).
    events: Vec<RawEvent>,
    local: Vec<RawEvent>,
    stream: Arc<CudaStream>,
    next: usize,
}

/// A CUDA event made with raw flags (interprocess events need two of them), destroyed on drop.
pub(crate) struct RawEvent(pub(crate) cudarc::driver::sys::CUevent);

// SAFETY: a CUevent handle may be used from any thread (the driver API is thread-safe).
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Sync for RawEvent {}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: the event was created (or opened) by this process and is destroyed once.
        unsafe {
            let _ = cudarc::driver::sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// What a receiver needs to wait on one of a sender's write events: its interprocess handle, and
/// the address of its plain twin in the sender's process (used as it is by a receiver in that same
/// process; see [`Writer`]).
#[derive(Clone, Copy)]
pub(crate) struct WriteEvent {
    pub(crate) handle: [u8; 64],
    pub(crate) raw: u64,
}

/// Block ids a checksum call's staging holds at least.
const MAX_CHUNK_IDS: usize = 16 * crate::MAX_CHUNK_BLOCKS as usize;

/// A checksum call's page-locked staging and how much of each it holds.
struct Staging {
    pinned: Pinned,
    ids: usize,
    table: usize,
    sums: usize,
}

struct Inner {
    // Field order is drop order: the pinned staging goes first (it waits for the context's work).
    /// Page-locked staging of checksum calls (made on first use, grown on demand).
    staging: Option<Staging>,
    stream: Arc<CudaStream>,
    /// Block ids of one call: every chunk's source list, then (for a copy) the destination list
    /// (grown on demand, reused: a call allocates nothing in the common case).
    ids: CudaSlice<u32>,
    /// The segment table of a checksum call (grown on demand).
    table: CudaSlice<u64>,
    /// One checksum counter per chunk of the call.
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

fn err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| gpu_err(what, e)
}

impl DeviceKv {
    /// Opens GPU `device` (the kernels come from the on-disk cache the engine filled) and a stream.
    pub(crate) fn new(device: i32) -> Result<DeviceKv> {
        let ordinal = usize::try_from(device).map_err(|_| Error::Invalid(format!("device {device}")))?;
        let gpu = Gpu::new(ordinal).map_err(|e| gpu_err(&format!("opening GPU {device} for KV transfers"), e))?;
        let stream = gpu.stream().context().new_stream().map_err(|e| gpu_err("creating the transfer stream", e))?;
        let ids = stream.alloc_zeros::<u32>(2 * crate::MAX_CHUNK_BLOCKS as usize).map_err(|e| gpu_err("allocating block ids", e))?;
        let sum = stream.alloc_zeros::<u64>(1).map_err(|e| gpu_err("allocating the checksum", e))?;
        let table = stream.alloc_zeros::<u64>(64).map_err(|e| gpu_err("allocating the segment table", e))?;
        Ok(DeviceKv { gpu, inner: Mutex::new(Inner { staging: None, stream, ids, table, sum }), pull: Mutex::new(None), writer: Mutex::new(None) })
    }

    fn with_writer<T>(&self, f: impl FnOnce(&mut Writer) -> Result<T>) -> Result<T> {
        let mut guard = lock(&self.writer);
        if guard.is_none() {
            let ctx = self.context();
            ctx.bind_to_thread().map_err(err("binding the context"))?;
            let stream = ctx.new_stream().map_err(err("creating the write stream"))?;
            let make = |flags: u32| -> Result<RawEvent> {
                let mut ev: cudarc::driver::sys::CUevent = std::ptr::null_mut();
                // SAFETY: `ev` is a valid out slot; the context is bound above.
                unsafe { cudarc::driver::sys::cuEventCreate(&mut ev, flags) }.result().map_err(err("creating the write events"))?;
                Ok(RawEvent(ev))
            };
            let no_timing = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            let ipc = no_timing | cudarc::driver::sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
            let events = (0..WRITE_EVENTS).map(|_| make(ipc)).collect::<Result<Vec<_>>>()?;
            let local = (0..WRITE_EVENTS).map(|_| make(no_timing)).collect::<Result<Vec<_>>>()?;
            *guard = Some(Writer { events, local, stream, next: 0 });
        }
        f(guard.as_mut().expect("made above"))
    }

    /// This sender's write events, for the hello of a link that writes (made on first use).
    pub(crate) fn write_events(&self) -> Result<Vec<WriteEvent>> {
        self.with_writer(|w| {
            w.events
                .iter()
                .zip(&w.local)
                .map(|(e, twin)| {
                    let mut h = cudarc::driver::sys::CUipcEventHandle { reserved: [0; 64] };
                    // SAFETY: `e` is an interprocess event of this process; `h` a valid out slot.
                    unsafe { cudarc::driver::sys::cuIpcGetEventHandle(&mut h, e.0) }.result().map_err(err("exporting a write event"))?;
                    Ok(WriteEvent { handle: h.reserved.map(|b| b as u8), raw: twin.0 as u64 })
                })
                .collect()
        })
    }

    /// Enqueues the copies of `groups` on the write stream (the copy engines; peer copies when the
    /// receiver's pool is on another GPU) and records the next write event behind each group —
    /// the kind its receiver waits on: the plain twin for a receiver in this process
    /// (`same_process`), the interprocess event otherwise (a slot's other kind keeps its last
    /// record, which only receivers of that kind wait on) — and returns each group's event index.
    ///
    /// # Safety
    ///
    /// Every source range (each row of each copy) must be whole blocks of this connector's pool that the caller holds (a
    /// transfer's claim) until the receiver acknowledged them, and every destination range blocks
    /// of a receiver's pool, as this GPU addresses it, that the receiver granted to the transfer.
    pub(crate) unsafe fn write(&self, groups: &[Vec<StridedCopy>], same_process: bool) -> Result<Vec<usize>> {
        self.with_writer(|w| {
            w.stream.context().bind_to_thread().map_err(err("binding the context"))?;
            crate::transport::kv_trace!("write: bound, {} groups to enqueue", groups.len());
            let mut events = Vec::with_capacity(groups.len());
            // Traced: when the device reaches the first copy and finishes each group, seen by a
            // thread that polls the events (the timeline's clock, to a microsecond or two).
            let mut marks: Option<(RawEvent, Vec<(usize, cudarc::driver::sys::CUevent)>)> = None;
            if crate::transport::tracing() {
                let mut ev: cudarc::driver::sys::CUevent = std::ptr::null_mut();
                let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                // SAFETY: `ev` is a valid out slot; the context is bound above; the stream is its.
                unsafe {
                    if cudarc::driver::sys::cuEventCreate(&mut ev, flags) == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                        let _ = cudarc::driver::sys::cuEventRecord(ev, w.stream.cu_stream());
                        marks = Some((RawEvent(ev), Vec::new()));
                    }
                }
            }
            let failed = err("writing KV blocks into the receiver's pool");
            for (g, copies) in groups.iter().enumerate() {
                if copies.iter().any(|c| c.rows > 1) {
                    // Strided copies: one call each (~2 µs of host time), a run as a plain copy.
                    for c in copies {
                        // SAFETY: the caller's contract above; stream-ordered on the write stream.
                        unsafe { copy_strided(c, w.stream.cu_stream()) }.map_err(&failed)?;
                    }
                } else {
                    let runs: Vec<CopyRun> = copies.iter().map(|c| (c.dst, c.src, c.width)).collect();
                    // The first group's first run goes alone, ahead of the batch: the copy engines
                    // start on it a few microseconds after the call (a batch call costs ~10 us of
                    // host time before any of its copies runs), and the batch follows behind it.
                    let lead = usize::from(g == 0 && runs.len() > 2 && lead_copy());
                    // Copied one by one: the lead run, or every run where the group is not batched.
                    let single = if runs.len() - lead > 1 && batch_copies() { lead } else { runs.len() };
                    for &(dst, src, bytes) in &runs[..single] {
                        // SAFETY: the caller's contract above; stream-ordered on the write stream.
                        unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, w.stream.cu_stream()) }.result().map_err(&failed)?;
                    }
                    if single < runs.len() {
                        // SAFETY: as above.
                        unsafe { copy_batch(&runs[single..], w.stream.cu_stream()) }.map_err(&failed)?;
                    }
                }
                crate::transport::kv_trace!("write group of {} copies: copies enqueued", copies.len());
                let k = w.next;
                w.next = (w.next + 1) % w.events.len();
                if !same_process {
                    // SAFETY: the events and the stream belong to this context.
                    unsafe { cudarc::driver::sys::cuEventRecord(w.events[k].0, w.stream.cu_stream()) }.result().map_err(err("recording a write event"))?;
                }
                if same_process || marks.is_some() {
                    // SAFETY: as above.
                    unsafe { cudarc::driver::sys::cuEventRecord(w.local[k].0, w.stream.cu_stream()) }.result().map_err(err("recording a write event"))?;
                }
                crate::transport::kv_trace!("write group of {} copies enqueued, event {k}", copies.len());
                if let Some((_, m)) = marks.as_mut() {
                    m.push((copies.len(), w.local[k].0));
                }
                events.push(k);
            }
            if let Some((start, m)) = marks {
                // (Events as handles: the local events live as long as the connector's device side.)
                let m: Vec<(usize, usize)> = m.into_iter().map(|(n, e)| (n, e as usize)).collect();
                trace_marks(Arc::clone(w.stream.context()), start, m);
            }
            Ok(events)
        })
    }

    /// Waits until every write enqueued so far has landed.
    pub(crate) fn drain_writes(&self) -> Result<()> {
        match lock(&self.writer).as_ref() {
            Some(w) => w.stream.synchronize().map_err(err("draining the writes")),
            None => Ok(()),
        }
    }

    /// The CUDA context of the transfer stream.
    pub(crate) fn context(&self) -> Arc<CudaContext> {
        Arc::clone(self.gpu.stream().context())
    }

    /// The checksums of several chunks (each in order; all of one pool, so of the same number of
    /// blocks per layer), computed on the device in one call: one upload of the ids and one of the
    /// segment table, one launch, one download of the sums, one wait.
    pub(crate) fn checksums(&self, chunks: &[Blocks<'_>], block_bytes: usize) -> Result<Vec<u64>> {
        let Some(first) = chunks.first() else { return Ok(Vec::new()) };
        if chunks.iter().any(|c| c.num_blocks != first.num_blocks || c.ids.is_empty()) {
            return Err(Error::Invalid("chunks of one checksum call must be non-empty and of one pool".into()));
        }
        let segments: Vec<KvSegment> = chunks.iter().map(|c| KvSegment { src: c.base, dst: 0, blocks: c.ids.len() as u32 }).collect();
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.ids.iter().copied()).collect();
        let table = kv_segment_table(&segments);
        let mut guard = lock(&self.inner);
        crate::transport::kv_trace!("checksums of {} chunks: locked", chunks.len());
        let inner = &mut *guard;
        let s = Arc::clone(&inner.stream);
        if ids.len() > inner.ids.len() {
            // Earlier calls finished (each synchronises before returning): the old buffer is free.
            inner.ids = s.alloc_zeros::<u32>(ids.len().next_power_of_two()).map_err(err("allocating block ids"))?;
        }
        if table.len() > inner.table.len() {
            inner.table = s.alloc_zeros::<u64>(table.len().next_power_of_two()).map_err(err("allocating the segment table"))?;
        }
        if chunks.len() > inner.sum.len() {
            inner.sum = s.alloc_zeros::<u64>(chunks.len().next_power_of_two()).map_err(err("allocating checksums"))?;
        }
        // Through page-locked staging (pageable copies stage through the driver and cost tens of
        // microseconds each), grown when a call needs more.
        let need = (ids.len(), table.len(), chunks.len());
        if inner.staging.as_ref().is_none_or(|st| st.ids < need.0 || st.table < need.1 || st.sums < need.2) {
            let (ids_cap, table_cap, sums_cap) =
                (need.0.max(MAX_CHUNK_IDS).next_power_of_two(), need.1.max(64).next_power_of_two(), need.2.max(64).next_power_of_two());
            let (ids_bytes, table_bytes) = (ids_cap * 4, table_cap * 8);
            let pinned = Pinned::new(s.context(), ids_bytes + table_bytes + sums_cap * 8, ids_bytes, ids_bytes + table_bytes)?;
            inner.staging = Some(Staging { pinned, ids: ids_cap, table: table_cap, sums: sums_cap });
        }
        let st = &inner.staging.as_ref().expect("made above").pinned;
        // SAFETY: the staging is this call's alone (`inner` is locked, and every call waits for its
        // copies before returning); the lengths fit its regions (grown above).
        let (staged_ids, staged_table) =
            unsafe { (std::slice::from_raw_parts_mut(st.ids(), ids.len()), std::slice::from_raw_parts_mut(st.table(), table.len())) };
        staged_ids.copy_from_slice(&ids);
        staged_table.copy_from_slice(&table);
        s.context().bind_to_thread().map_err(err("binding the context"))?;
        // SAFETY: pinned sources alive until the synchronisation below; device regions of `inner`.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(addr_of(&inner.ids.slice(0..ids.len()), &s), &staged_ids[..], s.cu_stream())
                .map_err(err("uploading block ids"))?;
            cudarc::driver::result::memcpy_htod_async(addr_of(&inner.table.slice(0..table.len()), &s), &staged_table[..], s.cu_stream())
                .map_err(err("uploading the segment table"))?;
        }
        s.memset_zeros(&mut inner.sum.slice_mut(0..chunks.len())).map_err(err("zeroing the checksums"))?;
        crate::transport::kv_trace!("checksums of {} chunks: uploaded", chunks.len());
        let op = KvSegments {
            segments: &segments,
            table: inner.table.slice(0..table.len()),
            src_ids: inner.ids.slice(0..ids.len()),
            src_num_blocks: first.num_blocks,
            dst_ids: None,
            dst_num_blocks: 0,
            block_bytes: block_bytes as u64,
            checksums: Some(inner.sum.slice_mut(0..chunks.len())),
        };
        // SAFETY: every chunk's base is one layer of this connector's registered pool (device memory
        // of this GPU, `num_blocks` blocks); the transfer holds claims on the blocks read; the table
        // is `kv_segment_table(segments)`; the buffers belong to `inner`, locked until the stream is
        // synchronised below.
        unsafe { kv_copy_segments(&self.gpu, &s, op) }.map_err(|e| gpu_err("launching the KV checksums", e))?;
        crate::transport::kv_trace!("checksums of {} chunks launched", chunks.len());
        let st = &inner.staging.as_ref().expect("made above").pinned;
        // SAFETY: the staging's sum region holds at least `chunks.len()` words, this call's alone; it
        // is read only after the stream synchronised.
        let host = unsafe { std::slice::from_raw_parts_mut(st.sums(), chunks.len()) };
        // SAFETY: `host` is pinned host memory; the source is `inner.sum`'s first words.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, addr_of(&inner.sum.slice(0..chunks.len()), &s), s.cu_stream()) }
            .map_err(err("reading the checksums"))?;
        s.synchronize().map_err(err("waiting for the KV checksums"))?;
        Ok(chunks.iter().zip(host.iter()).map(|(c, &sum)| kv_checksum_finish(sum, c.ids.len(), block_bytes as u64)).collect())
    }

    /// Enqueues a receiver's pull of a batch of chunks into pull slot `slot` and returns without
    /// waiting: for each chunk, `src` blocks (a sender's pool, mapped) are copied into `dst` blocks
    /// (this connector's own); behind the copy, verification passes sum each chunk's destination
    /// blocks as they now are; the sums reach host memory when the slot's event completes
    /// ([`PullEvent::wait`]). With `push`, the sender's GPU is another one and its copy engines
    /// move the bytes (peer copies of the contiguous runs: writes over NVLink/PCIe, faster than
    /// this GPU's reads of the peer), in groups of `PUSH_GROUP` chunks, each group verified here
    /// as soon as it landed (this stream waits on an event the source GPU's stream records; no
    /// host round trip); without it, where the source cannot push, or for blocks too scattered
    /// for copies of runs, this GPU's copy kernel moves the whole batch in one launch. `corrupt` names a chunk whose last destination block gets
    /// one byte flipped between its copy and its verification (the integrity test hook; it waits
    /// for the copy). A slot is the caller's until its `PullEvent` was waited for.
    pub(crate) fn pull(
        &self,
        slot: usize,
        chunks: &[(Blocks<'_>, Blocks<'_>)],
        block_bytes: usize,
        corrupt: Option<usize>,
        push: Option<PushFrom<'_>>,
    ) -> Result<PullEvent> {
        self.pull_with(None, slot, chunks, block_bytes, corrupt, push, None)
    }

    /// Enqueues, in pull slot `slot`, the verification of `dsts` (blocks of this connector's pool)
    /// that a sender wrote itself, behind `after` (the sender's write event, opened in this
    /// process): the sums reach host memory when the slot's event completes, as for a pull.
    pub(crate) fn verify_written(&self, slot: usize, dsts: &[Blocks<'_>], block_bytes: usize, corrupt: Option<usize>, after: u64) -> Result<PullEvent> {
        let chunks: Vec<(Blocks<'_>, Blocks<'_>)> = dsts.iter().map(|d| (*d, *d)).collect();
        self.pull_with(None, slot, &chunks, block_bytes, corrupt, None, Some(after))
    }

    /// Enqueues, in pull slot `slot`, the verification of `dsts` (blocks of this connector's pool
    /// that something else wrote, e.g. an NCCL receive) on `stream` (of this GPU) behind `after`;
    /// `corrupt` (the integrity test hook) flips a byte of that chunk first. The sums reach host
    /// memory when the slot's event completes, as for a pull.
    pub(crate) fn verify_on(
        &self,
        stream: &Arc<CudaStream>,
        after: &cudarc::driver::CudaEvent,
        slot: usize,
        dsts: &[Blocks<'_>],
        block_bytes: usize,
        corrupt: Option<usize>,
    ) -> Result<PullEvent> {
        let chunks: Vec<(Blocks<'_>, Blocks<'_>)> = dsts.iter().map(|d| (*d, *d)).collect();
        self.pull_with(Some((stream, after)), slot, &chunks, block_bytes, corrupt, None, Some(after.cu_event() as u64))
    }

    /// A pull as [`DeviceKv::pull`] makes it (no push), enqueued on `stream` (of this GPU) behind
    /// a wait for `after` (the last record of it when this is called): the nccl backend's
    /// gathers into and scatters out of a link's staging buffer, ordered against the link's NCCL
    /// operations with events instead of host waits.
    pub(crate) fn pull_on(
        &self,
        stream: &Arc<CudaStream>,
        after: &cudarc::driver::CudaEvent,
        slot: usize,
        chunks: &[(Blocks<'_>, Blocks<'_>)],
        block_bytes: usize,
        corrupt: Option<usize>,
    ) -> Result<PullEvent> {
        self.pull_with(Some((stream, after)), slot, chunks, block_bytes, corrupt, None, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn pull_with(
        &self,
        on: Option<(&Arc<CudaStream>, &cudarc::driver::CudaEvent)>,
        slot: usize,
        chunks: &[(Blocks<'_>, Blocks<'_>)],
        block_bytes: usize,
        corrupt: Option<usize>,
        push: Option<PushFrom<'_>>,
        written: Option<u64>,
    ) -> Result<PullEvent> {
        let total: usize = chunks.iter().map(|(s, _)| s.ids.len()).sum();
        let bad = chunks.is_empty()
            || chunks.len() > PULL_BATCH
            || slot >= PULL_SLOTS
            || chunks.iter().any(|(s, d)| {
                s.ids.is_empty() || s.ids.len() != d.ids.len() || s.num_blocks != chunks[0].0.num_blocks || d.num_blocks != chunks[0].1.num_blocks
            })
            || total > PULL_BATCH * crate::MAX_CHUNK_BLOCKS as usize
            || push.as_ref().is_some_and(|p| p.src_bases.len() != chunks.len());
        if bad {
            return Err(Error::Invalid(format!("a pull of {} chunks ({total} blocks) into slot {slot}", chunks.len())));
        }
        let mut guard = lock(&self.pull);
        if guard.is_none() {
            *guard = Some(Pull::new(&self.context())?);
        }
        let p = guard.as_mut().expect("made above");
        let s = match on {
            Some((stream, after)) => {
                stream.context().bind_to_thread().map_err(err("binding the context"))?;
                stream.wait(after).map_err(err("ordering the pull behind its event"))?;
                Arc::clone(stream)
            }
            None => Arc::clone(&p.stream),
        };
        let r = self.enqueue_pull(p, &s, slot, chunks, total, block_bytes, corrupt, push, written);
        if r.is_err() {
            // Some of the batch may be enqueued already, reading this slot's staging or writing the
            // destination (a push's copies, on a source GPU's lane): let it run out before the slot
            // and the blocks can be handed out again.
            let _ = s.synchronize();
            for lane in p.lanes.values() {
                let _ = lane.stream.synchronize();
            }
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn enqueue_pull(
        &self,
        p: &mut Pull,
        s: &Arc<CudaStream>,
        slot: usize,
        chunks: &[(Blocks<'_>, Blocks<'_>)],
        total: usize,
        block_bytes: usize,
        corrupt: Option<usize>,
        push: Option<PushFrom<'_>>,
        written: Option<u64>,
    ) -> Result<PullEvent> {
        // The raw driver calls below act on the thread's current context: make it the pool's GPU's
        // (a thread may have worked for a connector of another GPU just before).
        s.context().bind_to_thread().map_err(err("binding the context"))?;
        let own = self.gpu.ordinal() as i32;
        // (Whether a sender's GPU may push at all is settled when its link opens: see `PushFrom`.)
        let push = push.filter(|_| !p.push_failed);
        let segments: Vec<KvSegment> = chunks.iter().map(|(src, dst)| KvSegment { src: src.base, dst: dst.base, blocks: src.ids.len() as u32 }).collect();
        let verify: Vec<KvSegment> = chunks.iter().map(|(_, dst)| KvSegment { src: dst.base, dst: 0, blocks: dst.ids.len() as u32 }).collect();
        // Chunk groups verified by one launch each: the push's groups, or the whole batch.
        let groups: Vec<std::ops::Range<usize>> = if push.is_some() {
            let g = push_group();
            (0..chunks.len()).step_by(g).map(|a| a..(a + g).min(chunks.len())).collect()
        } else {
            std::iter::once(0..chunks.len()).collect()
        };
        // Ids are checked against both arrays' extents on the host before the copy engines see them
        // (the kernel path checks them on the device).
        let in_range =
            chunks.iter().all(|(src, dst)| src.ids.iter().all(|&a| a < src.num_blocks) && dst.ids.iter().all(|&b| b < dst.num_blocks));
        // A push's copies go first, before anything is staged for the verification, so the copy
        // engines start at once: each group's contiguous runs (neighbouring blocks merged, across
        // chunks too), one peer copy each, an event behind each group; a batch whose blocks are too
        // scattered for that is pulled by the copy kernel instead (one launch, whatever the scatter).
        let push_runs: Option<Vec<Vec<(u64, u64, usize)>>> = push.as_ref().filter(|_| in_range).and_then(|from| {
            let runs: Vec<Vec<(u64, u64, usize)>> = groups
                .iter()
                .map(|range| engine_runs(range.clone().map(|k| (from.src_bases[k], chunks[k].0, chunks[k].1)), block_bytes))
                .collect();
            runs.iter().all(|r| r.len() <= PUSH_MAX_RUNS).then_some(runs)
        });
        let mut pushed = false;
        if let (Some(from), Some(runs)) = (push.as_ref(), push_runs) {
            // The source GPU's lane: a stream of its context and an event per group of each slot.
            let lane = match p.lanes.entry(from.device) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(Lane::new(from.device)?),
            };
            lane.ctx.bind_to_thread().map_err(err("binding the source GPU's context"))?;
            pushed = true;
            for (g, runs) in runs.iter().enumerate() {
                let r = runs.iter().try_for_each(|&(dst, src, bytes)| {
                    // SAFETY: `src` and `dst` are runs of whole blocks inside the sender's pool (as
                    // this GPU's context addresses it) and this connector's pool (ids checked against
                    // both extents above), claimed by the transfer; the copy is stream-ordered on the
                    // lane, which the pull stream waits for before the slot is reported.
                    unsafe { cudarc::driver::sys::cuMemcpyPeerAsync(dst, s.context().cu_ctx(), src, lane.ctx.cu_ctx(), bytes, lane.stream.cu_stream()) }
                        .result()
                });
                let r = r.and_then(|()| lane.events[slot * MAX_PUSH_GROUPS + g].record(&lane.stream));
                if let Err(e) = r {
                    // Runs enqueued before the refusal have no event the pull stream waits on: let
                    // them land before anything else touches these blocks.
                    let _ = lane.stream.synchronize();
                    s.context().bind_to_thread().map_err(err("binding the context"))?;
                    if g == 0 {
                        // Nothing pushed is waited for yet (what moved has landed, above): this
                        // batch, and every later one, is pulled instead.
                        tracing::warn!(error = %e, from = from.device, to = own, "KV pull: the source GPU refused to push; pulling from now on");
                        p.push_failed = true;
                        pushed = false;
                        break;
                    }
                    return Err(gpu_err("pushing KV blocks from the source GPU", e));
                }
                crate::transport::kv_trace!("ipc push group {g} of {} copies enqueued", runs.len());
            }
            s.context().bind_to_thread().map_err(err("binding the context"))?;
        }
        // SAFETY: slot `slot` is the caller's (see `pull`'s doc): no copy from this slot's staging is
        // in flight (the previous user's event completed), and the regions lie inside the pinned
        // buffer (`PULL_SLOTS` slots of `IDS_STRIDE` ids, `TABLE_STRIDE` table words and
        // `PULL_BATCH` sums).
        let (staged_ids, staged_table) = unsafe {
            (
                std::slice::from_raw_parts_mut(p.host.ids().add(slot * IDS_STRIDE), 2 * total),
                std::slice::from_raw_parts_mut(p.host.table().add(slot * TABLE_STRIDE), TABLE_STRIDE),
            )
        };
        let mut at = 0;
        // Where each chunk's ids start in the source list (and, offset by `total`, the destination's).
        let mut starts = Vec::with_capacity(chunks.len() + 1);
        for (src, _) in chunks {
            starts.push(at);
            staged_ids[at..at + src.ids.len()].copy_from_slice(src.ids);
            at += src.ids.len();
        }
        starts.push(at);
        for (_, dst) in chunks {
            staged_ids[at..at + dst.ids.len()].copy_from_slice(dst.ids);
            at += dst.ids.len();
        }
        // The table: the copy's, then each group's verification table.
        let copy_table = kv_segment_table(&segments);
        let tl = copy_table.len();
        staged_table[..tl].copy_from_slice(&copy_table);
        let mut verify_tables = Vec::with_capacity(groups.len());
        let mut t_at = tl;
        for g in &groups {
            let t = kv_segment_table(&verify[g.clone()]);
            staged_table[t_at..t_at + t.len()].copy_from_slice(&t);
            verify_tables.push(t_at..t_at + t.len());
            t_at += t.len();
        }
        let ids = p.ids.slice(slot * IDS_STRIDE..slot * IDS_STRIDE + 2 * total);
        let table = p.table.slice(slot * TABLE_STRIDE..slot * TABLE_STRIDE + t_at);
        let sums = p.sums.slice(slot * PULL_BATCH..slot * PULL_BATCH + chunks.len());
        let stream = s.cu_stream();
        // SAFETY: the staged regions are pinned host memory left untouched until this slot's event
        // completed (the copies are asynchronous, stream-ordered before the kernels that read them);
        // the device regions are this slot's.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(addr_of(&ids, s), &staged_ids[..], stream).map_err(err("uploading block ids"))?;
            cudarc::driver::result::memcpy_htod_async(addr_of(&table, s), &staged_table[..t_at], stream)
                .map_err(err("uploading the segment tables"))?;
            cudarc::driver::result::memset_d8_async(addr_of(&sums, s), 0, 8 * chunks.len(), stream).map_err(err("zeroing the checksums"))?;
        }
        crate::transport::kv_trace!("pull of {} chunks: uploaded", chunks.len());
        let (src_num, dst_num) = (chunks[0].0.num_blocks, chunks[0].1.num_blocks);
        let verify_group = |g: usize, range: &std::ops::Range<usize>, sums: cudarc::driver::CudaViewMut<'_, u64>| -> Result<()> {
            let (a, b) = (starts[range.start], starts[range.end]);
            let check = KvSegments {
                segments: &verify[range.clone()],
                table: table.slice(verify_tables[g].clone()),
                src_ids: ids.slice(total + a..total + b),
                src_num_blocks: dst_num,
                dst_ids: None,
                dst_num_blocks: 0,
                block_bytes: block_bytes as u64,
                checksums: Some(sums),
            };
            // SAFETY: every destination is a layer of this connector's pool whose blocks the transfer
            // claims; the table is `kv_segment_table` of these segments; ids, table and sums live in
            // the pull state, whose slot stays the caller's until the event completed; the pass only
            // reads the blocks.
            unsafe { kv_copy_segments(&self.gpu, s, check) }.map_err(|e| gpu_err("launching the KV verification", e))
        };
        let corrupt_in = |range: &std::ops::Range<usize>| -> Result<()> {
            if let Some(k) = corrupt.filter(|k| range.contains(k))
                && let Some(&last) = chunks[k].1.ids.last()
            {
                s.synchronize().map_err(err("waiting for the KV pull"))?;
                flip_byte(chunks[k].1.base + u64::from(last) * block_bytes as u64 + (block_bytes as u64) / 2)?;
            }
            Ok(())
        };
        let slot_sums = |range: &std::ops::Range<usize>| slot * PULL_BATCH + range.start..slot * PULL_BATCH + range.end;
        if let Some(ev) = written {
            // The sender wrote the blocks itself: verify them behind its write event.
            // SAFETY: `ev` is a live event of this process (the sender's, or opened from its
            // handle; the link keeps it); the stream is this context's.
            unsafe { cudarc::driver::sys::cuStreamWaitEvent(stream, ev as cudarc::driver::sys::CUevent, 0) }
                .result()
                .map_err(err("waiting for the sender's writes"))?;
            for (g, range) in groups.iter().enumerate() {
                corrupt_in(range)?;
                verify_group(g, range, p.sums.slice_mut(slot_sums(range)))?;
            }
        } else if pushed {
            // Each group's verification behind its copies' event on the source GPU's lane.
            let lane = p.lanes.get(&push.as_ref().expect("pushed").device).expect("made above");
            for (g, range) in groups.iter().enumerate() {
                s.wait(&lane.events[slot * MAX_PUSH_GROUPS + g]).map_err(err("waiting for the push"))?;
                corrupt_in(range)?;
                verify_group(g, range, p.sums.slice_mut(slot_sums(range)))?;
            }
        }
        if !pushed && written.is_none() {
            let copy = KvSegments {
                segments: &segments,
                table: table.slice(0..tl),
                src_ids: ids.slice(0..total),
                src_num_blocks: src_num,
                dst_ids: Some(ids.slice(total..2 * total)),
                dst_num_blocks: dst_num,
                block_bytes: block_bytes as u64,
                checksums: None,
            };
            // One launch of the copy kernel moves the whole batch, however scattered its blocks
            // (the copy engines' batched call costs several microseconds of host time per run).
            // SAFETY: every source base is a layer of a live mapping (or this process's memory) of
            // the sender's pool, which the sender keeps claimed until we acknowledge the pull; every
            // destination is a layer of this connector's pool whose blocks the transfer claims; the
            // table is `kv_segment_table(segments)`; ids, table and sums live in `p`, whose slot
            // stays the caller's until the event completed.
            unsafe { kv_copy_segments(&self.gpu, s, copy) }.map_err(|e| gpu_err("launching the KV pull", e))?;
            for (g, range) in groups.iter().enumerate() {
                corrupt_in(range)?;
                verify_group(g, range, p.sums.slice_mut(slot_sums(range)))?;
            }
        }
        // SAFETY: the slot's pinned sums stay untouched by the host until the event completed.
        let out = unsafe { std::slice::from_raw_parts_mut(p.host.sums().add(slot * PULL_BATCH), chunks.len()) };
        let sums = p.sums.slice(slot * PULL_BATCH..slot * PULL_BATCH + chunks.len());
        // SAFETY: `out` is pinned host memory of the slot (see above), `sums` its device counters.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, addr_of(&sums, s), stream) }.map_err(err("reading the checksums"))?;
        p.events[slot].record(s).map_err(err("recording the pull's event"))?;
        Ok(PullEvent {
            event: p.events[slot].cu_event() as usize,
            sums: p.host.sums() as usize + slot * PULL_BATCH * 8,
            blocks: chunks.iter().map(|(s, _)| s.ids.len()).collect(),
            block_bytes,
        })
    }
}

/// Where a pull's bytes come from when the sender's GPU pushes them: that GPU (another than the
/// pool's, with peer access to it, pushes not turned off: the caller checked), and each chunk's
/// source layer base as an address of that GPU's context in this process.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PushFrom<'a> {
    pub(crate) device: i32,
    pub(crate) src_bases: &'a [u64],
}

/// Chunks per verification launch of a push (the last group's verification is what a transfer
/// waits for after its last byte landed: small groups keep that short).
pub(crate) const PUSH_GROUP: usize = 4;
const MAX_PUSH_GROUPS: usize = PULL_BATCH.div_ceil(PUSH_GROUP);
/// Staged ids per pull slot (sources, then destinations).
const IDS_STRIDE: usize = 2 * PULL_BATCH * crate::MAX_CHUNK_BLOCKS as usize;
/// Staged table words per pull slot: the copy's table (3 per chunk + 1), then the verification
/// groups' tables (3 per chunk + 1 per group).
const TABLE_STRIDE: usize = 6 * PULL_BATCH + 2 * MAX_PUSH_GROUPS + 2;

/// The contiguous runs of chunks given as `(source base, source, destination)` blocks:
/// `(destination address, source address, bytes)`, neighbouring blocks merged (across chunks too,
/// where one chunk's last block and the next one's first are neighbours on both sides).
fn engine_runs<'a>(chunks: impl Iterator<Item = (u64, Blocks<'a>, Blocks<'a>)>, block_bytes: usize) -> Vec<(u64, u64, usize)> {
    let mut runs: Vec<(u64, u64, usize)> = Vec::new();
    let bb = block_bytes as u64;
    for (src_base, src, dst) in chunks {
        for (&a, &b) in src.ids.iter().zip(dst.ids) {
            push_run(&mut runs, dst.base + u64::from(b) * bb, src_base + u64::from(a) * bb, block_bytes);
        }
    }
    runs
}

/// Most copies one push group makes; more scattered batches are pulled by the copy kernel.
const PUSH_MAX_RUNS: usize = 32;

/// How many pull batches a connector keeps in flight at most.
pub(crate) const PULL_SLOTS: usize = 16;
/// The most chunks in one pull batch.
pub(crate) const PULL_BATCH: usize = 32;

/// A pull in flight: wait for it with [`PullEvent::wait`].
#[derive(Debug)]
pub(crate) struct PullEvent {
    /// The slot's `CUevent` (lives as long as the connector's device side).
    event: usize,
    /// Where the slot's sums land in pinned host memory.
    sums: usize,
    /// Blocks of each chunk of the batch.
    blocks: Vec<usize>,
    block_bytes: usize,
}

impl PullEvent {
    /// Whether the pull finished (without waiting): `Ok(true)` then [`PullEvent::wait`] returns at
    /// once. The caller's thread must have the device's context bound.
    pub(crate) fn done(&self) -> Result<bool> {
        use cudarc::driver::sys::{CUevent, CUresult, cuEventQuery};
        // SAFETY: the event belongs to the device's pull state, alive while the caller holds it.
        match unsafe { cuEventQuery(self.event as CUevent) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(gpu_err("the KV pull failed on the GPU", format!("{e:?}"))),
        }
    }

    /// Waits for the pull and returns the checksum of each chunk's destination blocks after it.
    /// The `DeviceKv` that made it must be alive (the caller holds it).
    pub(crate) fn wait(&self, device: &DeviceKv) -> Result<Vec<u64>> {
        device.context().bind_to_thread().map_err(err("binding the context"))?;
        // SAFETY: the event belongs to the device's pull state, alive while `device` is.
        unsafe { cudarc::driver::sys::cuEventSynchronize(self.event as cudarc::driver::sys::CUevent) }
            .result()
            .map_err(err("waiting for the KV pull"))?;
        // SAFETY: the event completed, so the asynchronous download of the slot's sum has landed in
        // pinned memory, and nothing writes it until the slot is handed out again.
        let sums = self.blocks.iter().enumerate().map(|(i, &n)| {
            // SAFETY: as above; sum `i` of the slot lies inside its `PULL_BATCH` pinned words.
            let sum = unsafe { std::ptr::read_volatile((self.sums as *const u64).add(i)) };
            kv_checksum_finish(sum, n, self.block_bytes as u64)
        });
        Ok(sums.collect())
    }
}

fn addr_of<T>(view: &cudarc::driver::CudaView<'_, T>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    let (ptr, _sync) = view.device_ptr(stream);
    ptr
}

/// Flips one byte of device memory at `at` (the integrity test hook), synchronously.
fn flip_byte(at: u64) -> Result<()> {
    let mut byte = [0u8; 1];
    // SAFETY: `at` lies inside a destination block the caller names (in range: the kernel checked
    // it against `num_blocks` and the caller sized the array); synchronous one-byte copies.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_sync(&mut byte, at).map_err(err("corrupting (test hook)"))?;
        byte[0] ^= 0x10;
        cudarc::driver::result::memcpy_htod_sync(at, &byte).map_err(err("corrupting (test hook)"))?;
    }
    Ok(())
}

/// The receiver's pull state: a stream of its own (so a pull never waits behind the sender-side
/// checksums of the same connector, nor they behind it), and `PULL_SLOTS` slots of staged ids, a
/// checksum counter and an event each; plus a lane per GPU that pushes to this one.
struct Pull {
    // Field order is drop order: the pinned staging goes first (it waits for the context's work).
    host: Pinned,
    stream: Arc<CudaStream>,
    ids: CudaSlice<u32>,
    table: CudaSlice<u64>,
    sums: CudaSlice<u64>,
    events: Vec<cudarc::driver::CudaEvent>,
    /// Source GPUs' lanes, by ordinal (made on a push from that GPU).
    lanes: HashMap<i32, Lane>,
    /// Whether a source GPU's copy engines refused a push once (pulls only from then on).
    push_failed: bool,
}

impl Pull {
    fn new(ctx: &Arc<CudaContext>) -> Result<Pull> {
        use cudarc::driver::sys::CUevent_flags;
        let stream = ctx.new_stream().map_err(err("creating the pull stream"))?;
        let ids = stream.alloc_zeros::<u32>(PULL_SLOTS * IDS_STRIDE).map_err(err("allocating block ids"))?;
        let table = stream.alloc_zeros::<u64>(PULL_SLOTS * TABLE_STRIDE).map_err(err("allocating segment tables"))?;
        let sums = stream.alloc_zeros::<u64>(PULL_SLOTS * PULL_BATCH).map_err(err("allocating checksums"))?;
        let (ids_bytes, table_bytes) = (PULL_SLOTS * IDS_STRIDE * 4, PULL_SLOTS * TABLE_STRIDE * 8);
        let host = Pinned::new(ctx, ids_bytes + table_bytes + PULL_SLOTS * PULL_BATCH * 8, ids_bytes, ids_bytes + table_bytes)?;
        let events = (0..PULL_SLOTS)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(err("creating events"))?;
        stream.synchronize().map_err(err("preparing the pull stream"))?;
        Ok(Pull { host, stream, ids, table, sums, events, lanes: HashMap::new(), push_failed: false })
    }
}

/// A source GPU's side of pushes into this connector's pool: a stream of that GPU's context (its
/// copy engines write our blocks) and an event per verification group of each pull slot, which
/// the pull stream waits on before it verifies the group.
struct Lane {
    // Events before the stream (drop order); both belong to `ctx`.
    events: Vec<cudarc::driver::CudaEvent>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Lane {
    fn new(device: i32) -> Result<Lane> {
        use cudarc::driver::sys::CUevent_flags;
        let ctx = context(device)?;
        let stream = ctx.new_stream().map_err(err("creating the source GPU's push stream"))?;
        let events = (0..PULL_SLOTS * MAX_PUSH_GROUPS)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(err("creating push events"))?;
        Ok(Lane { events, stream, ctx })
    }
}

/// Chunks per push group: `PUSH_GROUP`, or `TANDEM_KV_PUSH_GROUP` (a diagnostic, `PUSH_GROUP` to
/// `PULL_BATCH`) for measuring how the group size trades copy-engine efficiency against the wait
/// for the last group's verification.
pub(crate) fn push_group() -> usize {
    static G: OnceLock<usize> = OnceLock::new();
    *G.get_or_init(|| {
        std::env::var("TANDEM_KV_PUSH_GROUP").ok().and_then(|v| v.parse().ok()).map_or(PUSH_GROUP, |g: usize| g.clamp(PUSH_GROUP, PULL_BATCH))
    })
}

/// Whether a writing sender moves each run of blocks across a group's layers as one strided copy
/// (`TANDEM_KV_NO_STRIDED_COPY=1` makes a copy per layer run, for comparing).
pub(crate) fn strided_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NO_STRIDED_COPY").is_none())
}

/// Whether a writing sender enqueues a group's copies as one `cuMemcpyBatchAsync` (CUDA 13
/// drivers; `TANDEM_KV_NO_BATCH_COPY=1` keeps one `cuMemcpyDtoDAsync` per run, for comparing).
/// The copy engines pay ~3 µs per copy for copies enqueued one by one — 32 layer runs of 8 MiB
/// across NVLink took 780 µs where one 256 MiB copy takes 687 — and a batch of them 702–725.
fn batch_copies() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let mut version = 0;
        // SAFETY: `version` is a valid out slot; the driver is loaded (a context exists).
        let driver = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
        driver == cudarc::driver::sys::CUresult::CUDA_SUCCESS && version >= 13000 && std::env::var_os("TANDEM_KV_NO_BATCH_COPY").is_none()
    })
}

/// `TANDEM_KV_TRACE=1`: one thread (started on first use) polls each write's events in turn and
/// records when the device reached its first copy (`start`) and finished each group (`groups`:
/// copies, event handle) — the timeline's clock, to a microsecond or two. A diagnostic: an event
/// recorded again meanwhile is seen at its later record, and one whose connector is gone ends the
/// wait with an error (benches and traced runs keep their connectors).
fn trace_marks(ctx: Arc<CudaContext>, start: RawEvent, groups: Vec<(usize, usize)>) {
    type Marks = (Arc<CudaContext>, RawEvent, Vec<(usize, usize)>);
    static TRACER: OnceLock<Mutex<std::sync::mpsc::Sender<Marks>>> = OnceLock::new();
    let tx = TRACER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Marks>();
        std::thread::spawn(move || {
            use cudarc::driver::sys::{CUevent, CUresult, cuEventQuery};
            // SAFETY: the events are alive (the start event is held here, the others live as long
            // as their connector's device side); queried only.
            let wait = |e: CUevent| while unsafe { cuEventQuery(e) } == CUresult::CUDA_ERROR_NOT_READY {};
            for (ctx, start, groups) in rx {
                let _ = ctx.bind_to_thread();
                wait(start.0);
                crate::transport::kv_trace!("device: the write stream reached the first copy");
                for (n, e) in groups {
                    wait(e as CUevent);
                    crate::transport::kv_trace!("device: write group of {n} copies landed");
                }
            }
        });
        Mutex::new(tx)
    });
    let _ = lock(tx).send((ctx, start, groups));
}

/// Whether a write's first group has its first run copied alone ahead of the batch
/// (`TANDEM_KV_NO_LEAD_COPY=1` batches it with the rest, for comparing).
fn lead_copy() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NO_LEAD_COPY").is_none())
}

/// The largest pitch a 2D/3D copy takes (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`: 2^31 - 1 on every GPU
/// of this decade); beyond it the driver silently splits a copy into rows.
const MAX_PITCH: u64 = (1 << 31) - 1;

/// How a 3D copy addresses rows `pitch` bytes apart (`width` wide): row `i` at slice `i`, slices
/// `row_pitch * slice_rows` apart, so a stride beyond [`MAX_PITCH`] still makes one copy —
/// `(row_pitch, slice_rows)`, or `None` where no power-of-two split of `pitch` fits.
fn pitch_split(pitch: u64, width: usize) -> Option<(u64, u64)> {
    (0..32).map(|k| (pitch >> k, 1u64 << k)).find(|&(p, h)| p * h == pitch && p <= MAX_PITCH).filter(|&(p, _)| p >= width as u64)
}

/// The 3D copy that moves the rows of `c` (rows as slices, so strides beyond [`MAX_PITCH`] fit),
/// or `None` for one row or a stride no split fits.
fn copy_3d(c: &StridedCopy) -> Option<cudarc::driver::sys::CUDA_MEMCPY3D> {
    use cudarc::driver::sys::{CUDA_MEMCPY3D, CUmemorytype};
    let (dst_pitch, dst_rows) = pitch_split(c.dst_pitch, c.width)?;
    let (src_pitch, src_rows) = pitch_split(c.src_pitch, c.width)?;
    (c.rows > 1).then_some(CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: c.src,
        srcArray: std::ptr::null_mut(),
        reserved0: std::ptr::null_mut(),
        srcPitch: src_pitch as usize,
        srcHeight: src_rows as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: c.dst,
        dstArray: std::ptr::null_mut(),
        reserved1: std::ptr::null_mut(),
        dstPitch: dst_pitch as usize,
        dstHeight: dst_rows as usize,
        WidthInBytes: c.width,
        Height: 1,
        Depth: c.rows,
    })
}

/// Enqueues the strided copy `c` on `stream`: one 3D copy ([`copy_3d`]), else (one row, or a
/// stride no split fits) a plain copy per row.
///
/// # Safety
/// Every row's source must be device memory the caller may read, and its destination device memory
/// it may write, until the stream's work behind this call completed; `stream` a live stream of the
/// bound context.
unsafe fn copy_strided(c: &StridedCopy, stream: cudarc::driver::sys::CUstream) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys::{cuMemcpy3DAsync_v2, cuMemcpyDtoDAsync_v2};
    match copy_3d(c) {
        // SAFETY: the copy describes exactly the rows of `c` (slice `i` at `pitch * rows * i` =
        // row `i`); the ranges are the caller's contract.
        Some(m) => unsafe { cuMemcpy3DAsync_v2(&m, stream) }.result(),
        // SAFETY: the caller's contract, row by row.
        None => c.runs().try_for_each(|(dst, src, bytes)| unsafe { cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) }.result()),
    }
}

/// Enqueues the copies `runs` `(destination, source, bytes)` on `stream` as one batch, in stream
/// order (each source read after the stream's earlier work).
///
/// # Safety
/// Each range must be device memory the caller may read (sources) or write (destinations) until
/// the stream's work behind this call completed; `stream` a live stream of the bound context.
unsafe fn copy_batch(runs: &[CopyRun], stream: cudarc::driver::sys::CUstream) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys::{CUmemcpyAttributes, CUmemcpySrcAccessOrder, cuMemcpyBatchAsync_v2};
    let mut dsts: Vec<u64> = runs.iter().map(|r| r.0).collect();
    let mut srcs: Vec<u64> = runs.iter().map(|r| r.1).collect();
    let mut sizes: Vec<usize> = runs.iter().map(|r| r.2).collect();
    // SAFETY: plain data; zero is a valid value of every field (no location hints: the pools are
    // plain device allocations, for which the driver ignores them).
    let mut attrs: CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attrs.srcAccessOrder = CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let mut first = 0usize;
    // SAFETY: the three arrays hold `runs.len()` entries each, one attribute applies from index
    // 0; the ranges are the caller's contract.
    unsafe { cuMemcpyBatchAsync_v2(dsts.as_mut_ptr(), srcs.as_mut_ptr(), sizes.as_mut_ptr(), runs.len(), &mut attrs, &mut first, 1, stream) }.result()
}

/// Whether receivers let a sender's GPU push (`TANDEM_KV_NO_PUSH=1` turns it off, so a run can
/// compare pushes with pulls).
pub(crate) fn push_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TANDEM_KV_NO_PUSH").is_none())
}

/// Page-locked host memory (so copies to and from it are truly asynchronous): staged ids, then
/// segment tables from `table_at`, then the slots' sums from `sums_at`.
struct Pinned {
    ptr: usize,
    table_at: usize,
    sums_at: usize,
    ctx: Arc<CudaContext>,
}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, bytes: usize, table_at: usize, sums_at: usize) -> Result<Pinned> {
        ctx.bind_to_thread().map_err(err("binding the context"))?;
        // Portable: pinned for every context, as a thread may have another GPU's current.
        let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain page-locked allocation of `bytes`, freed once in `Drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, flags) }.map_err(err("allocating pinned host memory"))?;
        // SAFETY: fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(Pinned { ptr: ptr as usize, table_at, sums_at, ctx: Arc::clone(ctx) })
    }
    fn ids(&self) -> *mut u32 {
        self.ptr as *mut u32
    }
    fn table(&self) -> *mut u64 {
        (self.ptr + self.table_at) as *mut u64
    }
    fn sums(&self) -> *mut u64 {
        (self.ptr + self.sums_at) as *mut u64
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // The pull stream is dropped after this (field order), but its work must be over before the
        // staging memory goes: wait for the whole context.
        if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
            // SAFETY: allocated by `malloc_host` in `new`, freed exactly once, no copy in flight.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
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

/// This process's ordinal of the GPU with UUID `uuid` (`cuDeviceGetUuid`), if it sees that GPU.
pub(crate) fn ordinal_of(uuid: &[u8; 16]) -> Result<i32> {
    // SAFETY: only tries to dlopen the candidate library names (cudarc would panic on a missing one).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Device("no NVIDIA driver found (libcuda.so.1)".into()));
    }
    cudarc::driver::result::init().map_err(|e| gpu_err("initialising the driver", e))?;
    let count = cudarc::driver::result::device::get_count().map_err(|e| gpu_err("counting GPUs", e))?;
    for ordinal in 0..count {
        let dev = cudarc::driver::result::device::get(ordinal).map_err(|e| gpu_err("opening a GPU", e))?;
        let theirs = cudarc::driver::result::device::get_uuid(dev).map_err(|e| gpu_err("reading a GPU's UUID", e))?;
        if theirs.bytes.iter().zip(uuid).all(|(&a, &b)| a as u8 == b) {
            return Ok(ordinal);
        }
    }
    Err(Error::Device(format!("no visible GPU has the sender's UUID {}", uuid.iter().map(|b| format!("{b:02x}")).collect::<String>())))
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

/// One raw copy timed two ways.
#[derive(Debug, Clone, Copy)]
pub struct CopyTime {
    /// As its caller sees it: from the call that enqueues the copy to the host seeing it done —
    /// how a transfer (`send_ready` to verified) and the bare NCCL send are timed, and what a
    /// program calling `cudaMemcpyPeer` waits.
    pub host: std::time::Duration,
    /// The copy engines' time alone: CUDA events around the copy (no call, start-up or
    /// completion latency).
    pub device: std::time::Duration,
}

/// Times one copy that `launch` enqueues on GPU `device`'s timing stream: on the host, from the
/// launch to the synchronize returning, and on the device, with CUDA events around the copy alone.
/// The stream and events are made once per GPU and kept (a stream and two events made and
/// destroyed per measurement left the driver work that slowed the first calls of the transfer
/// timed next).
fn time_copy(device: i32, what: &str, launch: impl FnOnce(&CudaStream) -> Result<()>) -> Result<CopyTime> {
    use cudarc::driver::sys::CUevent_flags;
    struct Timer {
        start: cudarc::driver::CudaEvent,
        stop: cudarc::driver::CudaEvent,
        stream: Arc<CudaStream>,
    }
    static TIMERS: OnceLock<Mutex<HashMap<i32, Timer>>> = OnceLock::new();
    let e = |e: cudarc::driver::DriverError| gpu_err(what, e);
    let mut timers = lock(TIMERS.get_or_init(Mutex::default));
    let t = match timers.entry(device) {
        std::collections::hash_map::Entry::Occupied(t) => t.into_mut(),
        std::collections::hash_map::Entry::Vacant(slot) => {
            let ctx = context(device)?;
            let stream = ctx.new_stream().map_err(e)?;
            let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
            let stop = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(e)?;
            slot.insert(Timer { start, stop, stream })
        }
    };
    t.start.record(&t.stream).map_err(e)?;
    let host = std::time::Instant::now();
    launch(&t.stream)?;
    t.stop.record(&t.stream).map_err(e)?;
    t.stop.synchronize().map_err(e)?;
    let host = host.elapsed();
    let ms = t.start.elapsed_ms(&t.stop).map_err(e)?;
    Ok(CopyTime { host, device: std::time::Duration::from_secs_f64(f64::from(ms) / 1e3) })
}

/// The ceiling a device backend is measured against on one GPU: one plain device-to-device copy of
/// the first `bytes` of `src`'s allocation into `dst`'s (`cuMemcpyDtoDAsync` on a stream of its
/// own), timed on the host and with CUDA events around the copy alone ([`CopyTime`]).
pub fn raw_device_copy(src: &KvMemory, dst: &KvMemory, bytes: usize) -> Result<CopyTime> {
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
/// ways first, on a stream of the source GPU, timed on the host and with CUDA events
/// ([`CopyTime`]).
pub fn raw_peer_copy(src: &KvMemory, dst: &KvMemory, bytes: usize) -> Result<CopyTime> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(base: u64, ids: &[u32]) -> Blocks<'_> {
        Blocks { base, num_blocks: 64, ids }
    }

    #[test]
    fn runs_merge_neighbouring_blocks_within_and_across_chunks() {
        const BB: usize = 256;
        // Layer arrays of 64 blocks, back to back in both pools (as a pool's layers are).
        let (src, dst) = (1 << 20, 1 << 30);
        let layer = 64 * BB as u64;
        let (a0, a1, b0, b1) = ([0u32, 1, 2, 63], [0u32, 1], [10u32, 11, 12, 63], [0u32, 1]);
        // Chunk 0: blocks 0..3 -> 10..13 (one run) and 63 -> 63; chunk 1 (the next layer): 0, 1 -> 0, 1,
        // which continues the run ending at block 63 of layer 0 on both sides.
        let chunks = [(src, blocks(src, &a0), blocks(dst, &b0)), (src + layer, blocks(src + layer, &a1), blocks(dst + layer, &b1))];
        let runs = engine_runs(chunks.into_iter(), BB);
        assert_eq!(runs, vec![(dst + 10 * BB as u64, src, 3 * BB), (dst + 63 * BB as u64, src + 63 * BB as u64, 3 * BB)]);
        let total: usize = runs.iter().map(|r| r.2).sum();
        assert_eq!(total, 6 * BB, "every block is in exactly one run");
        // Neighbours on one side only stay apart.
        let (a, b) = ([4u32, 5, 6], [9u32, 8, 7]);
        let runs = engine_runs(std::iter::once((src, blocks(src, &a), blocks(dst, &b))), BB);
        assert_eq!(runs.len(), 3);
        assert!(runs.iter().all(|r| r.2 == BB));
        // The source base a push uses (another mapping of the same pool) replaces the chunk's own.
        let runs = engine_runs(std::iter::once((7 << 40, blocks(src, &a1), blocks(dst, &b1))), BB);
        assert_eq!(runs, vec![(dst, 7 << 40, 2 * BB)]);
    }

    /// Every byte a list of copies moves, as merged runs sorted by destination.
    fn bytes_moved(copies: impl IntoIterator<Item = CopyRun>) -> Vec<CopyRun> {
        let mut runs: Vec<CopyRun> = copies.into_iter().collect();
        runs.sort();
        let mut merged: Vec<CopyRun> = Vec::new();
        for (d, s, n) in runs {
            push_run(&mut merged, d, s, n);
        }
        merged
    }

    #[test]
    fn a_run_across_layers_is_one_strided_copy() {
        // The bench's shape: 32 layers, each one run of 128 blocks of 64 KiB at the end of its array.
        const BB: u64 = 64 << 10;
        let (src_layer, dst_layer) = (256 * BB, 384 * BB);
        let chunks: Vec<Vec<CopyRun>> =
            (0..32).map(|l| vec![((1 << 40) + l * dst_layer + 256 * BB, (1 << 30) + l * src_layer + 128 * BB, (128 * BB) as usize)]).collect();
        let copies = strided_copies(&chunks);
        assert_eq!(copies, vec![StridedCopy { dst: (1 << 40) + 256 * BB, src: (1 << 30) + 128 * BB, width: (128 * BB) as usize, rows: 32, dst_pitch: dst_layer, src_pitch: src_layer }]);
        assert_eq!(copies[0].runs().collect::<Vec<_>>(), chunks.concat());
        // Layers back to back on both sides and whole arrays moved: one plain run beats it.
        let chunks: Vec<Vec<CopyRun>> = (0..4).map(|l| vec![(l * src_layer, l * src_layer, src_layer as usize)]).collect();
        assert_eq!(strided_copies(&chunks), vec![StridedCopy::run((0, 0, 4 * src_layer as usize))]);
        // A chunk of another shape (or stride) leaves plain runs.
        let mut odd: Vec<Vec<CopyRun>> = (0..3).map(|l| vec![(l * 1000, l * 2000, 100), (l * 1000 + 500, l * 2000 + 500, 50)]).collect();
        assert_eq!(strided_copies(&odd).len(), 2, "two runs, three rows each");
        odd[2][1].2 = 60;
        assert_eq!(strided_copies(&odd).len(), 6);
        // Rows that would overlap (a stride below the width) are never one copy.
        let overlapping: Vec<Vec<CopyRun>> = (0..3).map(|l| vec![(l * 100, l * 100, 150)]).collect();
        assert!(strided_copies(&overlapping).iter().all(|c| c.rows == 1));
        // Strides going down are not strides.
        let down: Vec<Vec<CopyRun>> = (0..3).map(|l| vec![((9 - l) * 1000, l * 1000, 100)]).collect();
        assert!(strided_copies(&down).iter().all(|c| c.rows == 1));
    }

    #[test]
    fn pitches_beyond_the_limit_split_into_slices() {
        assert_eq!(pitch_split(16 << 20, 8 << 20), Some((16 << 20, 1)));
        assert_eq!(pitch_split(3 << 30, 8 << 20), Some((3 << 29, 2)), "3 GiB: two rows of 1.5 GiB per slice");
        assert_eq!(pitch_split(12 << 30, 8 << 20), Some((3 << 29, 8)));
        assert_eq!(pitch_split(4 << 20, 8 << 20), None, "a pitch below the width");
        assert_eq!(pitch_split((3 << 30) + 1, 64), None, "odd: no power-of-two split");
    }

    #[test]
    fn a_strided_copy_is_one_3d_copy_of_its_rows() {
        let c = StridedCopy { dst: 1 << 40, src: 1 << 30, width: 8 << 20, rows: 32, dst_pitch: 3 << 30, src_pitch: 16 << 20 };
        let m = copy_3d(&c).expect("one copy");
        // Slice i starts at pitch * height * i: row i on both sides.
        assert_eq!((m.dstDevice, m.dstPitch * m.dstHeight, m.srcDevice, m.srcPitch * m.srcHeight), (1 << 40, 3 << 30, 1 << 30, 16 << 20));
        assert!(m.dstPitch as u64 <= MAX_PITCH && m.dstPitch >= m.WidthInBytes);
        assert_eq!((m.WidthInBytes, m.Height, m.Depth), (8 << 20, 1, 32));
        assert!(copy_3d(&StridedCopy::run((0, 0, 64))).is_none(), "one row is a plain copy");
        assert!(copy_3d(&StridedCopy { dst_pitch: (3 << 30) + 1, ..c }).is_none(), "no split fits: row by row");
    }

    proptest::proptest! {
        /// Pools of random layer strides and a transfer of random blocks (the same in every layer):
        /// the strided copies move exactly the bytes the per-layer runs move, in no more copies.
        #[test]
        fn strided_copies_move_exactly_the_runs_bytes(
            layers in 1usize..12,
            src_blocks in 8u64..64,
            dst_gap in 0u64..5,
            ids in proptest::collection::vec((0u32..8, 0u32..8), 1..8),
        ) {
            const BB: u64 = 512;
            let (src_layer, dst_layer) = (src_blocks * BB, (64 + dst_gap) * BB);
            // Distinct source and destination blocks (as a claim holds them), in transfer order.
            let mut src_ids: Vec<u32> = ids.iter().map(|&(a, _)| a).collect();
            src_ids.sort();
            src_ids.dedup();
            let dst_ids: Vec<u32> = src_ids.iter().map(|&a| (a * 7 + ids[0].1) % 64).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
            let n = src_ids.len().min(dst_ids.len());
            let chunks: Vec<Vec<CopyRun>> = (0..layers as u64)
                .map(|l| {
                    let mut runs: Vec<CopyRun> = Vec::new();
                    for (&a, &b) in src_ids[..n].iter().zip(&dst_ids[..n]) {
                        push_run(&mut runs, (1 << 32) + l * dst_layer + u64::from(b) * BB, l * src_layer + u64::from(a) * BB, BB as usize);
                    }
                    runs
                })
                .collect();
            let copies = strided_copies(&chunks);
            proptest::prop_assert_eq!(bytes_moved(copies.iter().flat_map(|c| c.runs())), bytes_moved(chunks.concat()));
            proptest::prop_assert!(copies.len() <= chunks.iter().map(Vec::len).sum::<usize>());
            for c in &copies {
                proptest::prop_assert!(c.rows == 1 || (c.dst_pitch >= c.width as u64 && c.src_pitch >= c.width as u64));
            }
        }
    }
}
