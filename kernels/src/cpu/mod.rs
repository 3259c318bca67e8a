//! CPU kernels: matrix multiply (through the `gemm` crate), RMSNorm, RoPE, SiLU·mul, and attention
//! that reads K/V from paged blocks.
//!
//! Invariants: every kernel checks its slice lengths with `assert!` (a length mismatch is a bug in
//! the caller, not bad user input) and never allocates per element.

mod attention;
mod elementwise;
mod matmul;
mod paged;

pub use attention::{AttentionChunk, paged_attention};
pub use elementwise::{add_in_place, rms_norm, rope_inv_freq, rope_in_place, silu_mul, RopeScaling};
pub use matmul::matmul_t;
pub use paged::{PagedLayout, write_kv};
