//! The one error type of this crate.
//!
//! Invariant: an error says what failed (which etcd operation, which input), never how a caller
//! should report it; bad input (a node id, options, a prefix) is a typed error, never a panic.

use std::time::Duration;

/// Everything that can go wrong in membership.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A node id that cannot be used as the last segment of a key.
    #[error("invalid node id {id:?}: {reason}")]
    InvalidNodeId {
        /// The id as given.
        id: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A cluster prefix that cannot start a key.
    #[error("invalid cluster prefix {prefix:?}: {reason}")]
    InvalidPrefix {
        /// The prefix as given.
        prefix: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// [`crate::EtcdOptions`] out of range.
    #[error("invalid etcd options: {0}")]
    InvalidOptions(String),
    /// An etcd request failed.
    #[error("etcd {op} failed: {source}")]
    Etcd {
        /// The operation (`"put"`, `"lease grant"`, ...).
        op: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// An etcd request got no answer within the request timeout.
    #[error("etcd {op} timed out after {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The limit it ran into.
        after: Duration,
    },
    /// The registration's lease no longer exists in etcd (expired, revoked, or etcd lost its data).
    #[error("etcd lease {0:#x} is gone")]
    LeaseGone(i64),
    /// No keep-alive answer for a whole TTL: the lease may have expired.
    #[error("no lease keep-alive answer for {0:?}")]
    KeepAliveStalled(Duration),
    /// An etcd stream (watch or lease keep-alive) ended.
    #[error("etcd {0} stream ended")]
    StreamEnded(&'static str),
    /// etcd cancelled the watch; `compact_revision` is set when the revision was compacted away.
    #[error("etcd cancelled the watch (compact revision {compact_revision}): {reason}")]
    WatchCancelled {
        /// The oldest revision still available, or 0.
        compact_revision: i64,
        /// etcd's reason.
        reason: String,
    },
    /// A node's info could not be encoded as JSON.
    #[error("encode node info: {0}")]
    Encode(#[source] serde_json::Error),
    /// A background task stopped abnormally (it panicked or its runtime shut down).
    #[error("membership background task failed: {0}")]
    Task(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
