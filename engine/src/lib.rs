//! tandem's inference engine: everything a prefill or decode node runs, and nothing about networking.
//!
//! The engine is a plain struct driven by [`Engine::step`]: the scheduler decides which tokens run, the
//! model computes them against the paged KV cache, the sampler picks tokens. It never depends on
//! tokio, gRPC or any async runtime; the node crates wrap it.

pub mod config;
pub mod detok;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod sched;
pub mod tokenizer;
pub mod weights;


pub use engine::Engine;
pub use model::Device;
pub use error::{Error, Result};
