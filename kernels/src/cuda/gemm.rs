//! `out = x · wᵀ` through cuBLAS (`cublasGemmEx`, bf16 inputs, f32 accumulation on tensor cores).
//!
//! Row-major trick: cuBLAS is column-major, and a row-major `[r, c]` matrix is the column-major
//! `[c, r]` one. So row-major `out[m, n] = x[m, k] · w[n, k]ᵀ` is column-major
//! `out'[n, m] = w'ᵀ · x'` with `w'` `[k, n]` and `x'` `[k, m]`: transa = T, transb = N,
//! (m', n', k) = (n, m, k), A = w (lda = k), B = x (ldb = k), C = out (ldc = n).
//!
//! Invariant: the handle runs on [`Gpu::stream`] with a fixed workspace (see `gpu.rs`), so a GEMM
//! can be captured in a CUDA graph.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::bf16;

use super::error::{Result, need_len, to_i32};
use super::gpu::Gpu;

/// Where a GEMM writes.
#[derive(Debug)]
pub enum GemmOut<'a> {
    /// `out = x · wᵀ`, rounded to bf16.
    Bf16(&'a mut CudaViewMut<'a, bf16>),
    /// `out = x · wᵀ` in f32, or `out += x · wᵀ` with `accumulate` (e.g. o_proj / down_proj
    /// straight into the f32 residual stream).
    F32 {
        /// The destination.
        out: &'a mut CudaViewMut<'a, f32>,
        /// Add to `out` instead of overwriting it.
        accumulate: bool,
    },
}

/// A GEMM's checked operands: device pointers (A = `w`, B = `x`, C = `out`), the sizes as the
/// libraries take them, the output type and beta (1 to accumulate), and the guards that keep
/// the pointers valid while the call is enqueued.
pub(super) struct Operands<'s> {
    pub(super) a: CUdeviceptr,
    pub(super) b: CUdeviceptr,
    pub(super) c: CUdeviceptr,
    pub(super) mnk: (i32, i32, i32),
    pub(super) f32_out: bool,
    pub(super) beta: f32,
    _guards: [SyncOnDrop<'s>; 3],
}

/// Checks the buffers of `out[m, n] (+)= x[m, k] · w[n, k]ᵀ` (at least `m*k`, `n*k` and `m*n`
/// elements, sizes within `i32`) and takes their pointers on `gpu`'s stream, bound to this
/// thread; `None` when there is nothing to compute (`m == 0` or `n == 0`). Shared by the cuBLAS
/// and cuBLASLt paths.
pub(super) fn operands<'s, 'o: 's>(
    gpu: &'s Gpu,
    x: &'s CudaView<'_, bf16>,
    w: &'s CudaView<'_, bf16>,
    out: GemmOut<'o>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Option<Operands<'s>>> {
    need_len("x", x.len(), m * k)?;
    need_len("w", w.len(), n * k)?;
    let mnk = (to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?);
    if m == 0 || n == 0 {
        return Ok(None);
    }
    let s = gpu.stream();
    gpu.bind()?;
    let (a, ga) = w.device_ptr(s);
    let (b, gb) = x.device_ptr(s);
    let (c, f32_out, beta, gc) = match out {
        GemmOut::Bf16(o) => {
            need_len("out", o.len(), m * n)?;
            let (p, g) = o.device_ptr_mut(s);
            (p, false, 0.0, g)
        }
        GemmOut::F32 { out: o, accumulate } => {
            need_len("out", o.len(), m * n)?;
            let (p, g) = o.device_ptr_mut(s);
            (p, true, if accumulate { 1.0 } else { 0.0 }, g)
        }
    };
    Ok(Some(Operands { a, b, c, mnk, f32_out, beta, _guards: [ga, gb, gc] }))
}

/// `out[m, n] (+)= x[m, k] · w[n, k]ᵀ`, row-major; `w` in the HF `[out, in]` layout. Buffers must
/// hold at least `m*k`, `n*k` and `m*n` elements; sizes must fit in `i32`. `m == 0` is a no-op.
pub fn gemm(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    out: GemmOut<'_>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    let Some(op) = operands(gpu, x, w, out, m, n, k)? else { return Ok(()) };
    let (mi, ni, ki) = op.mnk;
    let one = 1.0f32;
    let c_type = if op.f32_out { cudaDataType::CUDA_R_32F } else { cudaDataType::CUDA_R_16BF };
    // SAFETY: the handle is live and bound to this stream; A (w) holds n*k, B (x) m*k and C m*n
    // elements of the stated types (checked above); alpha/beta are host f32 (pointer mode host)
    // as CUBLAS_COMPUTE_32F requires; all pointers stay valid until the call returns (it only
    // enqueues work, and the buffers outlive the enqueued work by the caller's contract).
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *gpu.blas().handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            (&one as *const f32).cast(),
            op.a as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16BF,
            ki,
            op.b as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16BF,
            ki,
            (&op.beta as *const f32).cast(),
            op.c as *mut std::ffi::c_void,
            c_type,
            ni,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}
