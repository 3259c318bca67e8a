//! tandem's gRPC API (`tandem.v1`) and the internal node API.
//!
//! Empty on purpose: the cluster issue defines the protos and generates them here. Nothing in the
//! workspace depends on this crate yet.
