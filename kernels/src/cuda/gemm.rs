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
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
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
    need_len("x", x.len(), m * k)?;
    need_len("w", w.len(), n * k)?;
    let (mi, ni, ki) = (to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?);
    if m == 0 || n == 0 {
        return Ok(());
    }
    let s = gpu.stream();
    gpu.bind()?;
    let (a_ptr, _ga) = w.device_ptr(s);
    let (b_ptr, _gb) = x.device_ptr(s);
    let one = 1.0f32;
    let (c_ptr, c_type, beta, _gc) = match out {
        GemmOut::Bf16(o) => {
            need_len("out", o.len(), m * n)?;
            let (p, g) = o.device_ptr_mut(s);
            (p, cudaDataType::CUDA_R_16BF, 0.0f32, g)
        }
        GemmOut::F32 { out: o, accumulate } => {
            need_len("out", o.len(), m * n)?;
            let (p, g) = o.device_ptr_mut(s);
            (
                p,
                cudaDataType::CUDA_R_32F,
                if accumulate { 1.0f32 } else { 0.0 },
                g,
            )
        }
    };
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
            a_ptr as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16BF,
            ki,
            b_ptr as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16BF,
            ki,
            (&beta as *const f32).cast(),
            c_ptr as *mut std::ffi::c_void,
            c_type,
            ni,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}
