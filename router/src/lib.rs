//! The router: takes client requests, picks a decode and a prefill node, streams tokens back.
//!
//! Empty on purpose: the cluster issue builds it. Nothing depends on this crate yet.
