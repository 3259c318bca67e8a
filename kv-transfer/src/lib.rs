//! The KV-transfer connector: moves one request's KV blocks from a prefill node's pool into blocks
//! a decode node allocated, layer by layer.
//!
//! Empty on purpose: the KV-transfer issue builds it on top of the block layout that
//! `tandem_engine::kv` documents. Nothing depends on this crate yet.
