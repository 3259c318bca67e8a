//! [`Gpu`]: one device, its stream, its cuBLAS handle and the loaded kernel table.
//!
//! Invariants:
//! - the CUDA libraries are checked before cudarc first touches them (cudarc panics when a library
//!   is missing; we return [`GpuError::NoLibrary`] instead);
//! - all work goes to one non-default stream ([`Gpu::stream`]), so a sequence of launches can be
//!   captured into a CUDA graph; cudarc's per-buffer event tracking is off (one stream needs no
//!   cross-stream events, and events would end up in captured graphs);
//! - cuBLAS runs on that stream with a fixed workspace, so GEMMs are capturable too;
//! - every kernel is looked up once at start-up (see `kernel.rs`).

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::compile;
use super::error::{GpuError, Result, need_len};
use super::kernel::{Kernel, KernelTable};

/// cuBLAS workspace: fixed, so cuBLAS never allocates during graph capture (NVIDIA recommends
/// 32 MiB on Hopper).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// One CUDA device ready to run tandem's kernels. Create one per device and keep it for the
/// process lifetime (creation compiles or loads the kernels).
#[derive(Debug)]
pub struct Gpu {
    // Field order is drop order: the cuBLAS handle goes before its workspace, the kernels before
    // the module, everything before the stream and context.
    blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
    kernels: KernelTable,
    _module: Arc<CudaModule>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    compute_capability: (i32, i32),
}

fn library_present(present: bool, lib: &'static str, hint: &str) -> Result<()> {
    if present {
        Ok(())
    } else {
        Err(GpuError::NoLibrary {
            lib,
            hint: hint.to_string(),
        })
    }
}

impl Gpu {
    /// Checks that libcuda, libnvrtc and libcublas can be loaded, opens device `ordinal`, and
    /// compiles (or loads from [`super::cache_dir`]) every kernel for its compute capability.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        // SAFETY: only tries to dlopen the candidate library names.
        let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
        library_present(
            cuda,
            "libcuda.so.1",
            "no NVIDIA driver found: install it, or put the directory holding libcuda.so.1 on LD_LIBRARY_PATH",
        )?;
        compile::check_nvrtc()?;
        // SAFETY: as above.
        let blas = unsafe { cudarc::cublas::sys::is_culib_present() };
        library_present(
            blas,
            "libcublas.so.13",
            "put the directory holding libcublas.so.13 and libcublasLt.so.13 (CUDA 13) on LD_LIBRARY_PATH",
        )?;

        let count = CudaContext::device_count()?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::Driver(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: no CudaSlice exists yet, and all our work runs on the one stream created below,
        // so no cross-stream synchronisation (what the events provide) is ever needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let compute_capability = ctx.compute_capability()?;
        let arch = format!("sm_{}{}", compute_capability.0, compute_capability.1);
        let module = load_kernels(&ctx, &arch)?;
        let kernels = KernelTable::load(&module)?;

        let blas = CudaBlas::new(stream.clone())?;
        let workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _sync) = workspace.device_ptr(&stream);
            // SAFETY: the handle is live; the workspace is a device allocation of the stated size
            // that lives as long as the handle (field order in `Gpu`).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        Ok(Gpu {
            blas,
            _blas_workspace: workspace,
            kernels,
            _module: module,
            stream,
            ctx,
            compute_capability,
        })
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|_| "unknown CUDA device".to_string())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread()?;
        Ok(self.ctx.mem_get_info()?)
    }

    /// The stream every launch and copy of this `Gpu` is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A zeroed device buffer of `n` elements.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros::<T>(n)?)
    }

    /// A new device buffer holding a copy of `host`. Returns once `host` may be reused.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `host` into the first `host.len()` elements of `dst` (`BadShape` if `dst` is
    /// shorter). Returns once `host` may be reused.
    pub fn upload_into<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        need_len("upload destination", dst.len(), host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut head = dst.slice_mut(0..host.len());
        Ok(self.stream.memcpy_htod(host, &mut head)?)
    }

    /// Waits for the stream, then returns a copy of `dev`.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaView<'_, T>,
    ) -> Result<Vec<T>> {
        let mut host = vec![T::default(); dev.len()];
        if !host.is_empty() {
            self.stream.memcpy_dtoh(dev, &mut host)?;
        }
        self.stream.synchronize()?;
        Ok(host)
    }

    /// The median time (ms) of `reps` runs of `f` after `warmup` untimed ones, each timed with
    /// CUDA events around what `f` enqueues on [`Gpu::stream`].
    pub fn time_median_ms<E: From<GpuError>>(
        &self,
        warmup: usize,
        reps: usize,
        mut f: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<f64, E> {
        let ctx = self.stream.context();
        for _ in 0..warmup {
            f()?;
        }
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            // Timing events: cudarc's default flags disable timing.
            let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(GpuError::from)?;
            let stop = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(GpuError::from)?;
            start.record(&self.stream).map_err(GpuError::from)?;
            f()?;
            stop.record(&self.stream).map_err(GpuError::from)?;
            stop.synchronize().map_err(GpuError::from)?;
            ms.push(f64::from(start.elapsed_ms(&stop).map_err(GpuError::from)?));
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms.get(ms.len() / 2).copied().unwrap_or(0.0))
    }

    /// Blocks until everything enqueued on [`Gpu::stream`] has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    pub(crate) fn func(&self, k: Kernel) -> &cudarc::driver::CudaFunction {
        self.kernels.get(k)
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    pub(crate) fn bind(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }
}

/// Loads the kernels for `arch`, from the cache when possible; a cached CUBIN the driver rejects
/// is dropped from the cache and compiled afresh.
fn load_kernels(ctx: &Arc<CudaContext>, arch: &str) -> Result<Arc<CudaModule>> {
    let (cubin, cached) = compile::compile_cached(arch)?;
    match ctx.load_module(Ptx::from_binary(cubin)) {
        Ok(m) => Ok(m),
        Err(_) if cached => {
            compile::forget(arch);
            let (cubin, _) = compile::compile_cached(arch)?;
            Ok(ctx.load_module(Ptx::from_binary(cubin))?)
        }
        Err(e) => Err(e.into()),
    }
}
