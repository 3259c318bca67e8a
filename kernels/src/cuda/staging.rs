//! [`Staging`]: page-locked host buffers for copies that must not make the host wait.
//!
//! A copy from pageable memory may make the host wait for the stream (the driver stages it), so
//! a host that enqueues step N+1 while step N runs would stall behind step N. Copies through a
//! `Staging` go from or to page-locked memory and return at once. Each `Staging` has two slots
//! used in turn, each with an event recorded after its copy: writing a slot waits only for the
//! copy enqueued two uses earlier, so consecutive steps never wait for each other.
//!
//! Invariants: a slot's memory is touched by the host only after its event says the previous
//! copy through it is done; slots never move or shrink while a copy may use them.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, result};

use super::error::{GpuError, Result};
use super::gpu::Gpu;

struct Slot<T> {
    ptr: *mut T,
    cap: usize,
    /// Elements the last copy moved.
    len: usize,
    /// Copies through this slot so far (a [`StagedCopy`] names the one it waits for).
    uses: u64,
    /// Recorded after the last copy through this slot.
    done: CudaEvent,
    ctx: Arc<CudaContext>,
}

// SAFETY: the slot exclusively owns its page-locked allocation (nothing else holds `ptr`), and
// every access goes through `&self`/`&mut self` after waiting for the device's use of it.
unsafe impl<T: Send> Send for Slot<T> {}

impl<T> Drop for Slot<T> {
    fn drop(&mut self) {
        // Wait for a copy still using the memory before freeing it.
        let _ = self.done.synchronize();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` and is freed once, here.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

impl<T: DeviceRepr> Slot<T> {
    fn new(gpu: &Gpu, cap: usize) -> Result<Self> {
        let cap = cap.max(1);
        let bytes = cap
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| GpuError::BadShape(format!("{cap} staged elements overflow")))?;
        gpu.bind()?;
        let ctx = gpu.stream().context().clone();
        let done = ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        // SAFETY: a plain page-locked allocation of `bytes`; freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }? as *mut T;
        Ok(Slot { ptr, cap, len: 0, uses: 0, done, ctx })
    }
}

/// Two page-locked slots of up to `capacity` elements each, for asynchronous copies on
/// [`Gpu::stream`].
pub struct Staging<T> {
    slots: [Slot<T>; 2],
    next: usize,
}

impl<T> std::fmt::Debug for Staging<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging").field("capacity", &self.slots[0].cap).finish()
    }
}

/// Which slot (and which use of it) a [`Staging::download`] went to, for [`Staging::wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedCopy {
    slot: usize,
    use_index: u64,
}

impl<T: DeviceRepr + Copy> Staging<T> {
    /// Allocates both slots.
    pub fn new(gpu: &Gpu, capacity: usize) -> Result<Self> {
        Ok(Staging { slots: [Slot::new(gpu, capacity)?, Slot::new(gpu, capacity)?], next: 0 })
    }

    /// Elements one copy may move.
    pub fn capacity(&self) -> usize {
        self.slots[0].cap
    }

    /// The next slot, once the copy enqueued through it two uses ago has finished.
    fn take(&mut self, n: usize) -> Result<(usize, &mut Slot<T>)> {
        let i = self.next;
        self.next ^= 1;
        let slot = &mut self.slots[i];
        if n > slot.cap {
            return Err(GpuError::BadShape(format!("{n} elements exceed the staging capacity of {}", slot.cap)));
        }
        slot.done.synchronize()?;
        slot.uses += 1;
        Ok((i, slot))
    }

    /// Enqueues a copy of `host` into the first `host.len()` elements of `dst` and returns
    /// without waiting for the device (`host` may be reused at once).
    pub fn upload(&mut self, gpu: &Gpu, host: &[T], dst: &mut CudaViewMut<'_, T>) -> Result<()> {
        let n = host.len();
        if n == 0 {
            return Ok(());
        }
        super::error::need_len("upload destination", dst.len(), n)?;
        let stream = gpu.stream();
        let (_, slot) = self.take(n)?;
        // SAFETY: the slot holds `cap >= n` elements and no copy uses it (waited for above).
        let staged = unsafe { std::slice::from_raw_parts_mut(slot.ptr, n) };
        staged.copy_from_slice(host);
        slot.len = n;
        gpu.bind()?;
        let (dst_ptr, _sync) = dst.device_ptr_mut(stream);
        // SAFETY: `dst` holds at least n elements; the slot stays allocated and untouched by the
        // host until `done` (recorded right after) fires.
        unsafe { result::memcpy_htod_async(dst_ptr, &*staged, stream.cu_stream()) }?;
        slot.done.record(stream)?;
        Ok(())
    }

    /// Enqueues a copy of `src` into a slot; [`Self::wait`] returns it once it has landed.
    pub fn download(&mut self, gpu: &Gpu, src: &CudaView<'_, T>) -> Result<StagedCopy> {
        let n = src.len();
        let stream = gpu.stream();
        let (i, slot) = self.take(n)?;
        slot.len = n;
        if n > 0 {
            gpu.bind()?;
            // SAFETY: the slot holds `cap >= n` elements and no copy uses it.
            let staged = unsafe { std::slice::from_raw_parts_mut(slot.ptr, n) };
            let (src_ptr, _sync) = src.device_ptr(stream);
            // SAFETY: `src` holds n elements; `staged` is exactly n elements of the slot, which
            // the host does not touch until `done` fires.
            unsafe { result::memcpy_dtoh_async(staged, src_ptr, stream.cu_stream()) }?;
        }
        slot.done.record(stream)?;
        Ok(StagedCopy { slot: i, use_index: slot.uses })
    }

    /// Waits for the download `copy` and returns what it copied. Valid until the slot's next
    /// use (the second [`Self::download`] or [`Self::upload`] after it); waiting for a copy whose
    /// slot has been used again since is [`GpuError::BadShape`], not the newer data.
    pub fn wait(&self, copy: StagedCopy) -> Result<&[T]> {
        let slot = &self.slots[copy.slot];
        if slot.uses != copy.use_index {
            return Err(GpuError::BadShape(format!(
                "staged copy {} of slot {} was overwritten by copy {}",
                copy.use_index, copy.slot, slot.uses
            )));
        }
        slot.done.synchronize()?;
        // SAFETY: the copy into the slot's first `len` elements has finished.
        Ok(unsafe { std::slice::from_raw_parts(slot.ptr, slot.len) })
    }
}
