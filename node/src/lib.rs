//! What prefill and decode nodes share: the engine on its own thread, the KV cache registered for
//! transfers, proto conversions, the one error → gRPC status mapping, and TLS for every link.

pub mod admission;
pub mod convert;
mod engine_thread;
mod error;
pub mod kv;
pub mod metrics;
mod peers;
mod setup;
pub mod tls;
pub mod trace;

pub use engine_thread::{EngineThread, Event, TransferPlan, wait_for_engine_threads};
pub use error::NodeError;
pub use peers::{PEER_WAIT, Peers};
pub use setup::{NodeCore, NodeSetup, Weights, tokenizer_files_from_map, tokenizer_files_to_map};

/// A duration in milliseconds rounded to 0.01 ms, for log fields (`ttft_ms=35.36`, not
/// `35.355512999999995`).
pub fn ms(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

/// A rate rounded to two decimals, for log fields.
pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
