//! tandem's compute kernels.
//!
//! [`cpu`] holds the CPU implementations the CPU backend runs. They are also the references every
//! device kernel is tested against, so they favour clarity and f32 accuracy over cleverness, and
//! each one states its shapes. All matrices are row-major.
//!
//! [`cuda`] holds the CUDA kernels (CUDA C compiled at run time by NVRTC) and the runtime that
//! launches them; building it needs no CUDA installation.

pub mod cpu;
pub mod cuda;
