//! The in-process backend, for the one-process embedded cluster and for tests.
//!
//! A shared map from node id to [`NodeInfo`] behind a mutex, plus a `tokio::sync::watch` sender
//! holding the current snapshot. Clones of a [`MemoryMembership`] share the map.
//!
//! Invariants:
//! - Every change to the map publishes a full snapshot (sorted by id) while the lock is held, so
//!   watchers see changes in the order they happened.
//! - Registering an id that is already present replaces that entry (as etcd does: last writer
//!   wins). Each entry carries the token of the registration that wrote it, so an older
//!   registration's drop or load update never touches its replacement.
//! - Dropping a [`MemoryRegistration`] removes its entry at once; its load task ends within one
//!   [`LOAD_PUBLISH_INTERVAL`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::watch;

use crate::node::{Load, NodeInfo};
use crate::registration::{LOAD_PUBLISH_INTERVAL, Throttle};

/// The shared in-process membership map.
#[derive(Clone, Debug, Default)]
pub(crate) struct MemoryMembership {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    snapshot: watch::Sender<Vec<NodeInfo>>,
}

#[derive(Debug, Default)]
struct State {
    nodes: BTreeMap<String, Entry>,
    next_token: u64,
}

#[derive(Debug)]
struct Entry {
    token: u64,
    info: NodeInfo,
}

impl MemoryMembership {
    /// Adds (or replaces) `info`; the returned handle removes it on drop. `load` carries later
    /// load updates; its sender is held by the [`crate::Registration`].
    pub(crate) fn register(&self, info: NodeInfo, load: watch::Receiver<Load>) -> MemoryRegistration {
        let id = info.id.clone();
        let token = {
            let mut state = self.shared.lock();
            let token = state.next_token;
            state.next_token += 1;
            state.nodes.insert(id.clone(), Entry { token, info });
            self.shared.publish(&state);
            token
        };
        tokio::spawn(publish_loads(Arc::downgrade(&self.shared), id.clone(), token, load));
        MemoryRegistration { shared: Arc::clone(&self.shared), id, token }
    }

    /// A receiver of the live-node snapshots, starting with the current one.
    pub(crate) fn watch(&self) -> watch::Receiver<Vec<NodeInfo>> {
        self.shared.snapshot.subscribe()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated (each mutation is one
        // insert or remove), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish(&self, state: &State) {
        let snapshot: Vec<NodeInfo> = state.nodes.values().map(|e| e.info.clone()).collect();
        self.snapshot.send_replace(snapshot);
    }

    /// Sets the load of `id` if it is still registration `token`'s; false when it is not.
    fn set_load(&self, id: &str, token: u64, load: Load) -> bool {
        let mut state = self.lock();
        match state.nodes.get_mut(id) {
            Some(entry) if entry.token == token => {
                if entry.info.load != load {
                    entry.info.load = load;
                    self.publish(&state);
                }
                true
            }
            _ => false,
        }
    }

    fn remove(&self, id: &str, token: u64) {
        let mut state = self.lock();
        if state.nodes.get(id).is_some_and(|e| e.token == token) {
            state.nodes.remove(id);
            self.publish(&state);
        }
    }
}

/// Publishes load changes of one registration, coalesced; ends when the registration's load
/// sender is dropped or its entry is gone.
async fn publish_loads(shared: Weak<Shared>, id: String, token: u64, mut load: watch::Receiver<Load>) {
    let mut throttle = Throttle::new(LOAD_PUBLISH_INTERVAL);
    while load.changed().await.is_ok() {
        tokio::time::sleep_until(throttle.next_at()).await;
        let current = *load.borrow_and_update();
        let Some(shared) = shared.upgrade() else { return };
        if !shared.set_load(&id, token, current) {
            return;
        }
        throttle.published();
    }
}

/// Keeps one node in a [`MemoryMembership`]; removes it on drop.
#[derive(Debug)]
pub(crate) struct MemoryRegistration {
    shared: Arc<Shared>,
    id: String,
    token: u64,
}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        self.shared.remove(&self.id, self.token);
    }
}
