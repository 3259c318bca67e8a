//! tandem's gRPC API (`tandem.v1`, for clients) and the internal node API (`tandem.node.v1`), generated
//! from `proto/` at build time with protox (no protoc) and tonic. Generated code lives only here;
//! callers convert to domain types at the edge.

#![allow(missing_docs, unreachable_pub, clippy::all)]

/// The client API.
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

/// The internal node API.
pub mod node {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("tandem.node.v1");
    }
}
