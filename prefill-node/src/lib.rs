//! The prefill node: runs `tandem-engine` in the prefill role and pushes KV layer by layer.
//!
//! Empty on purpose: the cluster issue builds it. Nothing depends on this crate yet.
