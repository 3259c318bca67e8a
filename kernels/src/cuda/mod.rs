//! CUDA kernels and the small runtime that runs them.
//!
//! The kernels are CUDA C in `kernels/cuda/`, compiled at run time by NVRTC for the device's exact
//! architecture and cached on disk ([`cache_dir`]); nothing CUDA is needed to build this crate, and
//! the CUDA libraries are loaded when [`Gpu::new`] runs (a missing one is
//! [`GpuError::NoLibrary`]). [`Gpu`] owns the context, one non-default stream, a cuBLAS handle
//! and the kernel table. The launchers ([`embedding`], [`rms_norm`], [`rope`], [`write_kv`],
//! [`prefill_attention`], [`decode_attention`], [`silu_mul`], [`gemm`], [`sample`]) take device
//! views and shapes, check that the shapes fit together ([`GpuError::BadShape`] otherwise, never
//! a panic), and enqueue on [`Gpu::stream`] without synchronising, so a whole forward pass can be
//! captured as a CUDA graph.
//!
//! Data conventions: row-major; activations of the residual stream are f32, GEMM inputs and
//! weights bf16 (weights in the HF `[out, in]` layout); the paged KV cache is one bf16 buffer per
//! layer in the layout of [`crate::cpu::PagedLayout`].
//!
//! Invariants: every kernel has a device test against a CPU reference
//! (`kernels/tests/cuda_kernels.rs`); indices that live on the device (token ids, block tables,
//! slots) are validated by the kernels, so no launch reads or writes outside the buffers its
//! launcher checked.

mod attention;
mod checks;
mod compile;
mod elementwise;
mod error;
mod gemm;
mod gemm_lt;
mod gpu;
mod graph;
mod ipc;
mod kernel;
mod kv_copy;
mod sampling;
mod staging;

pub use attention::{
    DECODE_MIN_SPLIT, decode_attention_split, decode_split_keys,
    AttnMeta, AttnShape, decode_attention, decode_workspace_len, prefill_attention,
};
pub use compile::{cache_dir, compile, compile_source, nvrtc_version};
pub use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits,
};
pub use elementwise::{embedding, resolve_tokens, rms_norm, rope, silu_mul, write_kv};
pub use error::{GpuError, Result};
pub use gemm::{GemmOut, gemm};
pub use gemm_lt::{GemmPlans, GemmShape, LtAlgo, LtGemm, ShapeTimes, TuneOut};
pub use gpu::Gpu;
pub use graph::{Graph, capture};
pub use ipc::{IPC_ARRAY_ALIGN, IpcAlloc, IpcArrays, IpcMapping};
pub use kv_copy::{
    BlockArray, BlockList, KV_BAD_BLOCK_POISON, KvCopy, KvSegment, KvSegments, kv_checksum_finish, kv_copy_blocks, kv_copy_segments,
    kv_segment_table,
};
pub use half::bf16;
pub use sampling::{SampleParams, sample};
pub use staging::{StagedCopy, Staging};
