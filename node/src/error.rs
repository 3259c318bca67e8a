//! The nodes' one error type and its one mapping to gRPC statuses: a failure says what went wrong where it
//! happens; which status a client sees is decided here only.

use tonic::{Code, Status};

/// Everything a node or the router can fail with.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The engine refused or failed (bad input, capacity, internal).
    #[error(transparent)]
    Engine(#[from] tandem_engine::Error),
    /// A KV transfer failed.
    #[error(transparent)]
    Kv(#[from] tandem_kv_transfer::Error),
    /// A request field is missing or malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// The model asked for is not served.
    #[error("{0}")]
    NotFound(String),
    /// No node can take the request right now (none of a role, or all gone).
    #[error("{0}")]
    Unavailable(String),
    /// The caller may not ask for this (a peer that membership does not list).
    #[error("{0}")]
    Forbidden(String),
    /// Too much work is waiting already (a bounded queue is full): retry later.
    #[error("{0}")]
    Overloaded(String),
    /// The request's deadline (the caller's `grpc-timeout`, or a queue-time limit) passed.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A peer node answered with an error.
    #[error("{0}")]
    Peer(#[from] Status),
    /// Anything else.
    #[error("{0}")]
    Internal(String),
}

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        use tandem_engine::Error as E;
        let code = match &e {
            NodeError::Engine(E::EmptyPrompt | E::InvalidResume(_) | E::PromptTooLong { .. } | E::InvalidSampling(_) | E::Tokenizer(_) | E::ChatTemplate(_)) => {
                Code::InvalidArgument
            }
            NodeError::Engine(E::KvPoolFull { .. } | E::CapacityExceeded { .. }) => Code::ResourceExhausted,
            NodeError::Engine(_) => Code::Internal,
            NodeError::Kv(tandem_kv_transfer::Error::Unreachable { .. }) => Code::Unavailable,
            NodeError::Kv(_) => Code::Aborted,
            NodeError::InvalidArgument(_) => Code::InvalidArgument,
            NodeError::NotFound(_) => Code::NotFound,
            NodeError::Unavailable(_) => Code::Unavailable,
            NodeError::Forbidden(_) => Code::PermissionDenied,
            NodeError::Overloaded(_) => Code::ResourceExhausted,
            NodeError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            NodeError::Peer(s) => return s.clone(),
            NodeError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
