//! The overload flags: `--max-waiting-requests` on the router, the nodes and `tandem up`, and
//! `--max-queue-time-ms` on the router and `tandem up` (see `tandem_router::Limits` and
//! `tandem_node::admission`).

use std::time::Duration;

use clap::Args;

/// A node's bound on requests accepted and not yet started.
#[derive(Args, Debug, Clone)]
pub(crate) struct NodeLimitArgs {
    /// Most requests this node holds without a first token (decode) or with their prompt not yet
    /// computed (prefill); one more is refused at once with RESOURCE_EXHAUSTED. Published in membership,
    /// so routers send a full node nothing.
    #[arg(long, default_value_t = tandem_node::admission::DEFAULT_NODE_MAX_WAITING as u32,
          value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    max_waiting_requests: u32,
}

impl NodeLimitArgs {
    pub(crate) fn limits(&self) -> tandem_node::admission::Limits {
        tandem_node::admission::Limits { max_waiting: self.max_waiting_requests as usize }
    }
}

/// The router's overload limits.
#[derive(Args, Debug, Clone)]
pub(crate) struct RouterLimitArgs {
    /// Most requests the router holds without a first token; one more is refused at once with
    /// RESOURCE_EXHAUSTED (HTTP 429).
    #[arg(long, default_value_t = tandem_router::DEFAULT_MAX_WAITING as u32,
          value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    max_waiting_requests: u32,
    /// End a request that has no first token this long after reaching the router with
    /// DEADLINE_EXCEEDED (HTTP 504) [default: 0, no limit; a client's grpc-timeout always applies].
    #[arg(long, default_value_t = 0, value_name = "MS")]
    max_queue_time_ms: u64,
}

impl RouterLimitArgs {
    pub(crate) fn limits(&self) -> tandem_router::Limits {
        tandem_router::Limits {
            max_waiting: self.max_waiting_requests as usize,
            max_queue_time: (self.max_queue_time_ms > 0).then(|| Duration::from_millis(self.max_queue_time_ms)),
        }
    }
}
