//! Cluster membership for tandem: prefill and decode nodes register themselves, the router
//! watches which nodes are live and how loaded they are.
//!
//! Two backends behind one API ([`Membership`]):
//! - **etcd** ([`Membership::etcd`]): each node is the key `<cluster_prefix>/nodes/<id>` holding
//!   its [`NodeInfo`] as JSON, attached to a lease (TTL [`EtcdOptions::ttl`], 5 s by default)
//!   that a background task keeps alive every `ttl / 3`. A node that crashes, or whose
//!   [`Registration`] is dropped without [`Registration::deregister`], stops renewing; etcd
//!   deletes its key when the lease expires (within one TTL). If etcd restarts (even with an
//!   empty data directory) registrations re-create their lease and key, and watchers list again,
//!   with backoff, until etcd answers.
//! - **memory** ([`Membership::memory`]): a shared in-process map for the one-process embedded
//!   cluster and tests; clones share it; dropping a [`Registration`] removes the node at once.
//!
//! ```no_run
//! # async fn demo() -> tandem_membership::Result<()> {
//! use tandem_membership::{Load, Membership, NodeInfo, NodeRole};
//! let membership = Membership::memory();
//! let mut live = membership.watch().await?;
//! let registration = membership
//!     .register(NodeInfo {
//!         id: "decode-0".into(),
//!         role: NodeRole::Decode,
//!         model: "smollm2-135m-instruct".into(),
//!         grpc_addr: "127.0.0.1:50051".into(),
//!         kv_endpoint: "tcp://127.0.0.1:50052".into(),
//!         load: Load::default(),
//!     })
//!     .await?;
//! live.changed().await.ok();
//! assert_eq!(live.borrow().len(), 1);
//! registration.update_load(Load { waiting: 0, running: 3, free_blocks: 90, total_blocks: 128, max_waiting: 256 });
//! registration.deregister().await?;
//! # Ok(()) }
//! ```
//!
//! Invariants (both backends):
//! - [`Membership::watch`] always publishes full snapshots of the live nodes, sorted by id, and
//!   its first value is the membership at the time of the call.
//! - [`Registration::update_load`] does no I/O; loads are published at most every
//!   [`LOAD_PUBLISH_INTERVAL`] per node, the newest value winning.
//! - Every background task ends when its owner is dropped: a registration's when the
//!   [`Registration`] is dropped, a watch's when all its receivers are dropped.
//! - Node ids are unique by contract; registering an id that is present replaces the entry
//!   (last writer wins), so a crashed node restarting under its old id takes its entry over.
//! - This crate knows nothing about scheduling, gRPC or the engine: it moves [`NodeInfo`] around.
//!
//! Background tasks are spawned with `tokio::spawn`: call [`Membership::register`] and
//! [`Membership::watch`] from within a tokio runtime.

mod error;
mod etcd;
mod memory;
mod node;
mod registration;

use tokio::sync::watch;

pub use error::{Error, Result};
pub use etcd::{EtcdOptions, EtcdTls};
pub use node::{Load, MAX_NODE_ID_LEN, NodeInfo, NodeRole, validate_node_id};
pub use registration::{LOAD_PUBLISH_INTERVAL, Registration};

/// A membership backend: etcd for a real cluster, memory for one process. Cheap to clone;
/// clones share the connection (etcd) or the map (memory).
#[derive(Clone, Debug)]
pub struct Membership {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    // Boxed: the etcd client is a few KiB.
    Etcd(Box<etcd::EtcdMembership>),
    Memory(memory::MemoryMembership),
}

impl Membership {
    /// Connects to etcd at `endpoints` (`http://host:port`; no TLS) and checks that it answers
    /// within [`EtcdOptions::request_timeout`]. Keys live under `<cluster_prefix>/nodes/` (a
    /// trailing `/` on the prefix is ignored; an empty prefix is an error).
    pub async fn etcd(endpoints: &[String], cluster_prefix: &str, opts: EtcdOptions) -> Result<Self> {
        let backend = etcd::EtcdMembership::connect(endpoints, cluster_prefix, opts).await?;
        Ok(Self { backend: Backend::Etcd(Box::new(backend)) })
    }

    /// A new, empty in-process membership.
    pub fn memory() -> Self {
        Self { backend: Backend::Memory(memory::MemoryMembership::default()) }
    }

    /// Registers a node; it stays registered until the returned [`Registration`] is deregistered
    /// (drained at once) or dropped (etcd: expires within the TTL, like a crash; memory: removed
    /// at once).
    ///
    /// With etcd the first registration happens before this returns (an error if etcd refuses or
    /// does not answer in time); later outages are handled in the background.
    pub async fn register(&self, info: NodeInfo) -> Result<Registration> {
        validate_node_id(&info.id)?;
        let id = info.id.clone();
        let (load, load_updates) = watch::channel(info.load);
        let backend = match &self.backend {
            Backend::Etcd(etcd) => registration::Backend::Etcd(etcd.register(info, load_updates).await?),
            Backend::Memory(memory) => registration::Backend::Memory(memory.register(info, load_updates)),
        };
        Ok(Registration::new(id, load, backend))
    }

    /// The live nodes, sorted by id, kept current in the background.
    ///
    /// With etcd each call lists the nodes (an error if etcd does not answer in time) and opens
    /// its own etcd watch: call it once per process and clone the receiver. While etcd is
    /// unreachable the last snapshot stays published.
    pub async fn watch(&self) -> Result<watch::Receiver<Vec<NodeInfo>>> {
        match &self.backend {
            Backend::Etcd(etcd) => etcd.watch().await,
            Backend::Memory(memory) => Ok(memory.watch()),
        }
    }
}
