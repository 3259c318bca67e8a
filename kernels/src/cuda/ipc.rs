//! Device memory another process can map through CUDA IPC: [`IpcAlloc`] (one plain `cuMemAlloc`
//! allocation whose handle [`IpcAlloc::export`] gives), [`IpcArrays`] (such an allocation split
//! into equal arrays, each seen as a [`CudaSlice`] so the launchers take it like any buffer) and
//! [`IpcMapping`] (a peer's exported allocation opened in this process).
//!
//! Why not cudarc's allocations: cudarc allocates with `cuMemAllocAsync` (stream-ordered pools)
//! where the device supports it, and pool memory cannot be exported with `cuIpcGetMemHandle`. A
//! buffer another process reads or writes directly (a KV pool under GPU-resident transfer) must
//! be one `cuMemAlloc` allocation.
//!
//! CUDA refuses to open a handle in the process that exported it ([`IpcMapping::open`] fails
//! there): a user in the exporting process uses [`IpcAlloc::ptr`] directly. The exporter must
//! keep the allocation alive while a peer has it open and may still touch it (the transfer
//! protocol ends every peer's use before the owner frees it).
//!
//! Invariants:
//! - an [`IpcAlloc`] is zeroed before [`IpcAlloc::new`] returns it (and before any stream of its
//!   context can see it), and freed exactly once, in `Drop`, after every stream of its context
//!   has finished (no work of this process still uses it); if the context cannot be bound or
//!   synchronised there, the memory is leaked rather than freed under running work;
//! - the views of an [`IpcArrays`] are never freed by cudarc: `Drop` leaks them before the
//!   allocation under them is freed, and callers only ever borrow them as [`CudaView`] /
//!   [`CudaViewMut`] (never the owning `CudaSlice`), so safe code can neither drop nor replace a
//!   view; the arrays' addresses never change while the `IpcArrays` lives (CUDA graphs that
//!   captured them stay valid);
//! - an [`IpcMapping`] is closed exactly once, in `Drop`, after its context's streams finished.

use std::ffi::{c_char, c_uint};
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys::{self, CUipcMem_flags, CUipcMemHandle};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits,
};

use super::error::{GpuError, Result};

/// Alignment of every array of an [`IpcArrays`] (and at least that of a `cuMemAlloc` allocation).
pub const IPC_ARRAY_ALIGN: usize = 256;

// What the types' docs promise: each holds device addresses (plain data) and a retained context,
// so they cross threads; a field that is not `Send + Sync` (a raw host pointer) fails here.
const fn assert_send_sync<T: Send + Sync>() {}
const _: () = assert_send_sync::<IpcAlloc>();
const _: () = assert_send_sync::<IpcMapping>();
const _: () = assert_send_sync::<IpcArrays<u8>>();

/// A driver error with what was being done.
fn driver(what: &str, e: DriverError) -> GpuError {
    match GpuError::from(e) {
        GpuError::Driver(msg) => GpuError::Driver(format!("{what}: {msg}")),
        other => other,
    }
}

/// Makes `ctx` current on this thread and waits for all its streams, without cudarc's check of
/// errors recorded earlier (a `Drop` must still release what it owns after an unrelated error).
/// False when either call fails.
fn quiesce(ctx: &CudaContext) -> bool {
    // SAFETY: the context is alive (the caller holds an `Arc` to it); making it current affects
    // only the calling thread, exactly as `CudaContext::bind_to_thread` does.
    let bound = unsafe { result::ctx::set_current(ctx.cu_ctx()) }.is_ok();
    bound && result::ctx::synchronize().is_ok()
}

/// One device allocation made with `cuMemAlloc` (not from a stream-ordered pool), so its handle
/// can be exported to other processes ([`Self::export`]). Zeroed when made, freed on drop.
///
/// `Send` and `Sync` (derived from its fields, on purpose): it holds a device address, which is
/// plain data any thread may pass to the driver, and the retained context (`Arc<CudaContext>`,
/// itself `Send + Sync`) that every call binds before using the address. Nothing here hands out
/// host references into device memory.
#[derive(Debug)]
pub struct IpcAlloc {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl IpcAlloc {
    /// Allocates `bytes` (more than 0) on `ctx`'s device and zeroes them; returns once the zeroes
    /// have landed, so any stream may use the memory at once. That wait is for every stream of
    /// the context (`cuCtxSynchronize`): make these at start-up, not while work runs.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<IpcAlloc> {
        if bytes == 0 {
            return Err(GpuError::BadShape("an IPC allocation of 0 bytes".into()));
        }
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation of `bytes` in the bound context; its contents are set right
        // below before anyone can read them, and it is freed once, in Drop (also on the error
        // paths below, since `alloc` owns it from here).
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| driver(&format!("allocating {bytes} bytes for IPC"), e))?;
        let alloc = IpcAlloc {
            ptr,
            bytes,
            ctx: ctx.clone(),
        };
        // SAFETY: `ptr` is a live allocation of exactly `bytes` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }?;
        // cuMemsetD8 may return before the memset has run, on the legacy default stream, which
        // the non-blocking streams cudarc creates do not wait for: wait for it here.
        ctx.synchronize()?;
        Ok(alloc)
    }

    /// The allocation's device address (a `CUdeviceptr`, at least 256-byte aligned).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The allocation's CUDA IPC handle (`cuIpcGetMemHandle`): the 64 opaque bytes of a
    /// `CUipcMemHandle`, which another process passes to [`IpcMapping::open`] to map this memory.
    /// Not for this process (CUDA refuses to open a handle where it was exported): here, use
    /// [`Self::ptr`].
    pub fn export(&self) -> Result<[u8; 64]> {
        self.ctx.bind_to_thread()?;
        let mut handle = MaybeUninit::<CUipcMemHandle>::uninit();
        // SAFETY: `handle` is writable storage for one handle; `ptr` is a live `cuMemAlloc`
        // allocation of the bound context.
        unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), self.ptr) }
            .result()
            .map_err(|e| driver("exporting a CUDA IPC handle", e))?;
        // SAFETY: the call succeeded, so it wrote the whole handle.
        let handle = unsafe { handle.assume_init() };
        Ok(handle.reserved.map(|c| c.to_ne_bytes()[0]))
    }
}

impl Drop for IpcAlloc {
    fn drop(&mut self) {
        // Every stream of the context, not one: work still using the memory must end first.
        if !quiesce(&self.ctx) {
            return;
        }
        // SAFETY: `ptr` came from `malloc_sync` in this context (current now), is freed once,
        // here, and no work of this process uses it any more (synchronised above).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A peer process's [`IpcAlloc`] mapped into this process (`cuIpcOpenMemHandle`, with lazy peer
/// access so an allocation on another GPU of the host can be mapped too). Unmapped on drop.
///
/// `Send` and `Sync` for the same reason as [`IpcAlloc`]: a device address and the retained
/// context it is used in.
#[derive(Debug)]
pub struct IpcMapping {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl IpcMapping {
    /// Opens `handle` (from [`IpcAlloc::export`] in another process) in `ctx`. Fails with
    /// [`GpuError::Driver`] for a bad handle, and in the process that exported it (CUDA's rule:
    /// use the allocation's own address there).
    pub fn open(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<IpcMapping> {
        ctx.bind_to_thread()?;
        let handle = CUipcMemHandle {
            reserved: handle.map(|b| c_char::from_ne_bytes([b])),
        };
        let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: `ptr` is writable storage for one address; the handle is passed by value and
        // the driver checks it (a bad one is an error, not a mapping).
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                ptr.as_mut_ptr(),
                handle,
                CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
            )
        }
        .result()
        .map_err(|e| {
            driver(
                "opening a CUDA IPC handle (it cannot be opened in the process that exported it)",
                e,
            )
        })?;
        // SAFETY: the call succeeded, so it wrote the address.
        let ptr = unsafe { ptr.assume_init() };
        Ok(IpcMapping {
            ptr,
            ctx: ctx.clone(),
        })
    }

    /// The mapped allocation's device address in this process (its first byte).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if !quiesce(&self.ctx) {
            return;
        }
        // SAFETY: `ptr` came from `cuIpcOpenMemHandle` in this context (current now), is closed
        // once, here, and no work of this process uses it any more (synchronised above).
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// `count` arrays of `len` elements of `T` back to back in one [`IpcAlloc`], each starting at a
/// multiple of [`IPC_ARRAY_ALIGN`] bytes from the allocation's base (e.g. a KV pool's layers, one
/// array each). Every array is a `CudaSlice<T>` view on the stream given at creation, borrowed
/// through [`Self::array`] and [`Self::array_mut`]; the views are never freed by cudarc (see the
/// module's invariants), and the allocation is zeroed, then freed when this is dropped.
pub struct IpcArrays<T> {
    /// Leaked (not dropped) in `Drop`, before `alloc` frees the memory under them.
    views: Vec<CudaSlice<T>>,
    len: usize,
    stride: usize,
    alloc: IpcAlloc,
}

impl<T> std::fmt::Debug for IpcArrays<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcArrays")
            .field("count", &self.views.len())
            .field("len", &self.len)
            .field("stride_bytes", &self.stride)
            .field("alloc", &self.alloc)
            .finish()
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> IpcArrays<T> {
    /// Allocates `count` zeroed arrays of `len` elements on `stream`'s context, viewed on
    /// `stream`. With cudarc's event tracking on (not so on a [`super::Gpu`]'s context), cudarc
    /// creates two events per view and panics if the driver refuses them.
    pub fn new(stream: &Arc<CudaStream>, count: usize, len: usize) -> Result<IpcArrays<T>> {
        const { assert!(std::mem::align_of::<T>() <= IPC_ARRAY_ALIGN) };
        let overflow = || GpuError::BadShape(format!("{count} arrays of {len} elements overflow"));
        let array_bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(overflow)?;
        let stride = array_bytes
            .checked_next_multiple_of(IPC_ARRAY_ALIGN)
            .ok_or_else(overflow)?;
        let total = stride.checked_mul(count).ok_or_else(overflow)?;
        let alloc = IpcAlloc::new(stream.context(), total.max(IPC_ARRAY_ALIGN))?;
        // Built in place, so that even a panic half-way leaks the views made so far (Drop).
        let mut arrays = IpcArrays {
            views: Vec::with_capacity(count),
            len,
            stride,
            alloc,
        };
        for i in 0..count {
            let ptr = arrays.alloc.ptr() + (i * stride) as u64;
            // SAFETY: array `i` is bytes `i * stride .. i * stride + array_bytes` of the live
            // allocation (`stride >= array_bytes` and `count * stride <= alloc.bytes()`); its start
            // is 256-byte aligned (the allocation's base is, and `stride` is a multiple of 256),
            // enough for `T` (checked above); the bytes are zero, a valid `T`
            // (`ValidAsZeroBits`). The view is leaked, never freed, before the allocation is
            // freed (Drop), and only borrowed views of it ever leave this type.
            let view = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
            arrays.views.push(view);
        }
        Ok(arrays)
    }
}

impl<T> IpcArrays<T> {
    /// The number of arrays.
    pub fn count(&self) -> usize {
        self.views.len()
    }

    /// Elements per array.
    pub fn array_len(&self) -> usize {
        self.len
    }

    /// Bytes from one array's start to the next's (the array's bytes rounded up to
    /// [`IPC_ARRAY_ALIGN`]).
    pub fn stride_bytes(&self) -> usize {
        self.stride
    }

    /// Array `i`, read-only.
    ///
    /// # Panics
    /// If `i >= self.count()`.
    pub fn array(&self, i: usize) -> CudaView<'_, T> {
        self.views[i].as_view()
    }

    /// Array `i`, writable.
    ///
    /// # Panics
    /// If `i >= self.count()`.
    pub fn array_mut(&mut self, i: usize) -> CudaViewMut<'_, T> {
        self.views[i].as_view_mut()
    }

    /// The device address of array `i`'s first element.
    ///
    /// # Panics
    /// If `i >= self.count()`.
    pub fn array_ptr(&self, i: usize) -> u64 {
        assert!(
            i < self.views.len(),
            "array {i} of {} arrays",
            self.views.len()
        );
        self.alloc.ptr() + (i * self.stride) as u64
    }

    /// The allocation holding every array (its base, size and IPC handle).
    pub fn alloc(&self) -> &IpcAlloc {
        &self.alloc
    }
}

impl<T> Drop for IpcArrays<T> {
    fn drop(&mut self) {
        for view in self.views.drain(..) {
            // The view gives up its claim to free the memory; `alloc`, dropped right after this,
            // frees the whole allocation once, after every stream of the context finished.
            let _ = view.leak();
        }
    }
}
