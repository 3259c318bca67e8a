//! tandem's KV-transfer connector: moves one request's KV blocks from a prefill node's block pool into
//! blocks a decode node already allocated, layer by layer, over a pluggable backend.
//!
//! The contract, smallest first:
//! - [`KvMemory`]: a registered block pool (host or device), one contiguous block array per layer.
//! - [`Connector`]: one per node. The receiver calls [`Connector::expect`] and ships the
//!   [`TransferDescriptor`] to the sender, which calls [`Connector::send`] and pushes layers as they are
//!   computed. Handles report per-layer landing, completion with achieved bandwidth, or a typed [`Error`];
//!   dropping a handle cancels and releases everything on both sides.
//! - Backends ([`transport`]): TCP, in-process, and shared libraries implementing the versioned C ABI in
//!   `include/tandem_kv.h`. Integrity (handshake, per-chunk checksums, ordering) lives above them, once.
//!
//! Architecture invariant: this crate knows nothing about scheduling or the engine; it moves bytes
//! between block ids it is given and never marks unverified bytes ready.

mod connector;
mod core;
mod device;
mod error;
pub mod frame;
mod geometry;
mod handle;
mod memory;
pub mod transport;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use connector::{Connector, ConnectorConfig, ConnectorSpec, Metrics, TransferDescriptor, make_transport};
pub use core::MAX_CHUNK_BLOCKS;
pub use device::{CopyTime, raw_device_copy, raw_peer_copy};
pub use error::{Error, Result};
pub use geometry::{DType, Geometry, GeometrySpec, Layout};
pub use handle::{Progress, RecvHandle, SendHandle, TransferState, TransferStats};
pub use memory::{DeviceAllocation, Iov, KvMemory, MemoryKind};
pub use transport::inproc::Fabric;
pub use transport::trace_dump;
