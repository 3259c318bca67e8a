//! CPU kernels: matrix multiply (a small-`m` SIMD kernel for decode, the `gemm` crate otherwise),
//! RMSNorm, RoPE, SiLU·mul, and attention that reads K/V from paged blocks.
//!
//! SIMD paths are chosen at run time (`simd::Isa::detect`); the crate itself is built for
//! baseline x86-64, and every SIMD path has a portable counterpart that tests force.
//!
//! Invariants: every kernel checks its slice lengths with `assert!` (a length mismatch is a bug in
//! the caller, not bad user input) and never allocates per element.

mod attention;
mod elementwise;
mod kv_checksum;
mod matmul;
mod paged;
mod simd;
#[cfg(target_arch = "x86_64")]
mod skinny;

pub use attention::{AttentionChunk, paged_attention, paged_attention_blocks};
pub use elementwise::{add_in_place, rms_norm, rope_inv_freq, rope_in_place, silu_mul, RopeScaling};
pub use kv_checksum::{fmix64, kv_checksum, kv_checksum_sum};
pub use matmul::{matmul_t, matmul_t_gemm, matmul_t_small_m};
pub use paged::{LayerBlocks, LayerBlocksMut, PagedLayout, SliceBlocks, SliceBlocksMut, write_kv, write_kv_blocks};
