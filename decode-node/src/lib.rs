//! The decode node: runs `tandem-engine` in the decode role and streams tokens back.
//!
//! Empty on purpose: the cluster issue builds it. Nothing depends on this crate yet.
