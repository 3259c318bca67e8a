//! The crate's one error type. Every variant says what failed; which gRPC status or exit code that
//! becomes is decided by the caller, once.

/// Result alias for the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a KV transfer can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A descriptor, geometry, spec or argument is invalid before anything was sent.
    #[error("invalid KV transfer request: {0}")]
    Invalid(String),
    /// The two sides disagree on model, dtype, geometry, layout or protocol version.
    #[error("KV handshake refused: {0}")]
    Incompatible(String),
    /// The destination endpoint is unknown, refuses connections or does not answer.
    #[error("KV endpoint {endpoint} unreachable: {reason}")]
    Unreachable {
        /// The endpoint as given.
        endpoint: String,
        /// What the backend reported.
        reason: String,
    },
    /// The receiver does not expect this transfer (unknown id, finished, or wrong blocks).
    #[error("KV transfer {id:#x} rejected by the receiver: {reason}")]
    Rejected {
        /// The transfer id.
        id: u64,
        /// Why the receiver refused it.
        reason: String,
    },
    /// A chunk failed an integrity check (checksum, length, order, duplicate, unexpected).
    #[error("KV transfer {id:#x} integrity failure: {reason}")]
    Integrity {
        /// The transfer id.
        id: u64,
        /// What was wrong with the chunk.
        reason: String,
    },
    /// The link to the peer broke (peer gone, connection reset, malformed frame).
    #[error("KV link to {peer} failed: {reason}")]
    LinkFailed {
        /// The peer's endpoint or address.
        peer: String,
        /// The failure.
        reason: String,
    },
    /// The transfer did not complete before its deadline.
    #[error("KV transfer {id:#x} timed out after {after_ms} ms")]
    Timeout {
        /// The transfer id.
        id: u64,
        /// The deadline it missed, in milliseconds from its start.
        after_ms: u64,
    },
    /// One side cancelled the transfer (a handle was dropped or `cancel` called).
    #[error("KV transfer {id:#x} cancelled by the {by}")]
    Cancelled {
        /// The transfer id.
        id: u64,
        /// "sender" or "receiver".
        by: &'static str,
    },
    /// The blocks named are already part of another in-flight transfer.
    #[error("KV blocks busy: {0}")]
    BlocksBusy(String),
    /// The backend cannot do what was asked (e.g. device memory on a host-only backend).
    #[error("KV backend {backend} does not support {what}")]
    Unsupported {
        /// The backend's name.
        backend: String,
        /// What it lacks.
        what: String,
    },
    /// A plugin library could not be loaded or returned an error.
    #[error("KV plugin {path}: {reason}")]
    Plugin {
        /// The library path.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// A CUDA call of a device-memory transfer failed (driver, kernel, IPC mapping).
    #[error("KV transfer device error: {0}")]
    Device(String),
    /// The connector is shutting down.
    #[error("KV connector is shut down")]
    Shutdown,
}
