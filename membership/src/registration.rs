//! [`Registration`]: the handle that keeps one node registered, and the load coalescing shared
//! by both backends.
//!
//! Invariants:
//! - [`Registration::update_load`] never blocks and never does I/O: it stores the newest load in
//!   a `tokio::sync::watch` cell; the backend's task publishes it, at most once per
//!   [`LOAD_PUBLISH_INTERVAL`] (the first change after a quiet period goes out at once, later
//!   ones are coalesced into the newest value).
//! - Dropping a `Registration` without [`Registration::deregister`] is a crash as far as the
//!   cluster can tell: with etcd the keep-alive stops and the key disappears when the lease
//!   expires (within one TTL); in memory the node disappears at once.
//! - Every background task of a registration ends when the `Registration` is dropped.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::Result;
use crate::node::Load;
use crate::{etcd, memory};

/// The shortest interval between two load publications of one node.
pub const LOAD_PUBLISH_INTERVAL: Duration = Duration::from_millis(200);

/// A live registration: the node stays in the membership while this is held.
///
/// Drop it without [`deregister`](Self::deregister) to simulate a crash (etcd: the key expires
/// within the lease TTL; memory: the node is removed at once).
#[derive(Debug)]
pub struct Registration {
    id: String,
    load: watch::Sender<Load>,
    backend: Backend,
}

#[derive(Debug)]
pub(crate) enum Backend {
    Etcd(etcd::RegistrationTask),
    Memory(memory::MemoryRegistration),
}

impl Registration {
    pub(crate) fn new(id: String, load: watch::Sender<Load>, backend: Backend) -> Self {
        Self { id, load, backend }
    }

    /// The registered node's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Records the node's current load; it is published within about
    /// [`LOAD_PUBLISH_INTERVAL`]. Cheap: no I/O, never blocks; repeated calls coalesce.
    pub fn update_load(&self, load: Load) {
        self.load.send_if_modified(|current| {
            let changed = *current != load;
            *current = load;
            changed
        });
    }

    /// Drains the node out of the membership: with etcd, revokes the lease, which deletes the key
    /// at once (only if the key is still this registration's); in memory, removes the node.
    ///
    /// Errors when etcd cannot be reached within the request timeout; the key then expires
    /// within one TTL anyway, because the keep-alive has stopped.
    pub async fn deregister(self) -> Result<()> {
        match self.backend {
            Backend::Etcd(task) => task.deregister().await,
            Backend::Memory(registration) => {
                drop(registration);
                Ok(())
            }
        }
    }
}

/// Spaces publications at least `interval` apart.
#[derive(Debug)]
pub(crate) struct Throttle {
    interval: Duration,
    last: Option<Instant>,
}

impl Throttle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self { interval, last: None }
    }

    /// The earliest time the next publication may happen.
    pub(crate) fn next_at(&self) -> Instant {
        match self.last {
            Some(last) => last + self.interval,
            None => Instant::now(),
        }
    }

    /// Records a publication now.
    pub(crate) fn published(&mut self) {
        self.last = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn throttle_spaces_publications() {
        let mut throttle = Throttle::new(Duration::from_millis(200));
        let t0 = Instant::now();
        assert_eq!(throttle.next_at(), t0, "first publication is immediate");
        throttle.published();
        assert_eq!(throttle.next_at(), t0 + Duration::from_millis(200));
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(throttle.next_at() <= Instant::now(), "after a quiet period the next one is immediate");
    }
}
