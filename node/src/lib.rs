//! What prefill and decode nodes share: the engine on its own thread, the KV cache registered for
//! transfers, proto conversions and the one error → gRPC status mapping.

pub mod convert;
mod engine_thread;
mod error;
pub mod kv;
mod peers;
mod setup;

pub use engine_thread::{EngineThread, Event, TransferPlan};
pub use error::NodeError;
pub use peers::{PEER_WAIT, Peers};
pub use setup::{NodeCore, NodeSetup, Weights, tokenizer_files_from_map, tokenizer_files_to_map};
