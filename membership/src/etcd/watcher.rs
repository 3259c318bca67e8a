//! Follows `<prefix>/nodes/` in etcd and publishes the live nodes as full snapshots.
//!
//! The task lists the prefix (a range get, which also yields the store revision), publishes the
//! snapshot, then watches the prefix from the next revision and applies each event batch to its
//! map, publishing after each batch. On any watch error, a cancelled watch (e.g. its start
//! revision was compacted), or a stream that ends, it backs off, builds a fresh client, and starts
//! over with a new list: a list is the only way to be sure no change was missed.
//!
//! Invariants:
//! - Every publication is a full snapshot sorted by node id, and only changes are published
//!   (`send_if_modified`), so a receiver wakes only when the live set or a node's info changed.
//! - A node is in the snapshot exactly when its key exists (as of the last event applied); an
//!   expired lease deletes the key, so the node drops out. A value that does not parse as
//!   [`NodeInfo`], or whose `id` does not match its key, is left out (logged), never a panic.
//! - While etcd cannot be reached, the last snapshot stays published (it is stale, not empty:
//!   nodes keep serving while etcd is down, and leases cannot expire without etcd either).
//! - The task ends when every receiver of the snapshot channel has been dropped.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use tokio::sync::watch;

use super::Connector;
use crate::error::{Error, Result};
use crate::node::{NodeInfo, validate_node_id};

/// Lists the nodes now (errors if etcd does not answer), then spawns the task that keeps the
/// returned receiver current.
pub(crate) async fn start(conn: Arc<Connector>, client: Client) -> Result<watch::Receiver<Vec<NodeInfo>>> {
    let mut watcher = Watcher { conn, client, nodes: BTreeMap::new() };
    let revision = watcher.list().await?;
    let (snapshots, receiver) = watch::channel(watcher.snapshot());
    let closed = snapshots.clone();
    tokio::spawn(async move {
        tokio::select! {
            biased;
            () = closed.closed() => {}
            never = watcher.run(revision, &snapshots) => match never {},
        }
    });
    Ok(receiver)
}

struct Watcher {
    conn: Arc<Connector>,
    client: Client,
    /// Live nodes by id, as of the last list plus the events applied since.
    nodes: BTreeMap<String, NodeInfo>,
}

impl Watcher {
    async fn run(&mut self, listed_at: i64, snapshots: &watch::Sender<Vec<NodeInfo>>) -> Infallible {
        let mut backoff = self.conn.backoff();
        let mut revision = Some(listed_at);
        loop {
            if let Some(listed_at) = revision.take() {
                let error = self.follow(listed_at, snapshots, &mut backoff).await;
                tracing::warn!(%error, "membership: etcd watch lost; listing again");
            }
            tokio::time::sleep(backoff.next_pause()).await;
            match self.conn.connect().await {
                Ok(client) => self.client = client,
                Err(error) => tracing::warn!(%error, "membership: etcd reconnect failed"),
            }
            match self.list().await {
                Ok(listed_at) => {
                    Self::publish(snapshots, self.snapshot());
                    revision = Some(listed_at);
                }
                Err(error) => tracing::warn!(%error, "membership: etcd list failed; retrying"),
            }
        }
    }

    /// Replaces the map with the current contents of the prefix; returns the store revision.
    async fn list(&mut self) -> Result<i64> {
        let options = GetOptions::new().with_prefix();
        let response = self.conn.bounded("get", self.client.get(self.conn.nodes_prefix.as_str(), Some(options))).await?;
        let revision = response.header().map_or(0, |h| h.revision());
        self.nodes = response.kvs().iter().filter_map(|kv| self.parse(kv)).map(|n| (n.id.clone(), n)).collect();
        Ok(revision)
    }

    /// Watches from `listed_at + 1`, applying and publishing each batch; returns why it stopped.
    async fn follow(&mut self, listed_at: i64, snapshots: &watch::Sender<Vec<NodeInfo>>, backoff: &mut super::Backoff) -> Error {
        let options = WatchOptions::new().with_prefix().with_start_revision(listed_at + 1);
        let mut stream = match self.conn.bounded("watch", self.client.watch(self.conn.nodes_prefix.as_str(), Some(options))).await {
            Ok(stream) => stream,
            Err(error) => return error,
        };
        loop {
            let response = match stream.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return Error::StreamEnded("watch"),
                Err(source) => return Error::Etcd { op: "watch", source },
            };
            if response.canceled() {
                return Error::WatchCancelled {
                    compact_revision: response.compact_revision(),
                    reason: response.cancel_reason().to_owned(),
                };
            }
            if response.created() {
                // The watch is in place: the connection is healthy again.
                backoff.reset();
            }
            if response.events().is_empty() {
                continue;
            }
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => {
                        if let Some(node) = self.parse(kv) {
                            self.nodes.insert(node.id.clone(), node);
                        } else if let Some(id) = self.id_of(kv) {
                            // An unreadable value replaces whatever the key held before.
                            self.nodes.remove(id);
                        }
                    }
                    EventType::Delete => {
                        if let Some(id) = self.id_of(kv) {
                            self.nodes.remove(id);
                        }
                    }
                }
            }
            Self::publish(snapshots, self.snapshot());
        }
    }

    fn snapshot(&self) -> Vec<NodeInfo> {
        self.nodes.values().cloned().collect()
    }

    fn publish(snapshots: &watch::Sender<Vec<NodeInfo>>, snapshot: Vec<NodeInfo>) {
        snapshots.send_if_modified(|current| {
            let changed = *current != snapshot;
            if changed {
                *current = snapshot;
            }
            changed
        });
    }

    /// The node id a key names, if it is a node key under our prefix.
    fn id_of<'a>(&self, kv: &'a KeyValue) -> Option<&'a str> {
        let id = std::str::from_utf8(kv.key()).ok()?.strip_prefix(self.conn.nodes_prefix.as_str())?;
        validate_node_id(id).ok().map(|()| id)
    }

    /// The node a key-value holds, or `None` (logged) if it is not a well-formed node entry.
    fn parse(&self, kv: &KeyValue) -> Option<NodeInfo> {
        let key = String::from_utf8_lossy(kv.key());
        let Some(id) = self.id_of(kv) else {
            tracing::warn!(%key, "membership: ignoring a key that is not a valid node key");
            return None;
        };
        match serde_json::from_slice::<NodeInfo>(kv.value()) {
            Ok(node) if node.id == id => Some(node),
            Ok(node) => {
                tracing::warn!(%key, info_id = %node.id, "membership: ignoring a node whose id does not match its key");
                None
            }
            Err(error) => {
                tracing::warn!(%key, %error, "membership: ignoring a node value that is not valid NodeInfo JSON");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use etcd_client::{CompactionOptions, PutOptions};
    use tandem_tests::etcd::EtcdServer;

    use super::*;
    use crate::etcd::EtcdMembership;
    use crate::node::{Load, NodeRole};

    fn node(id: &str) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            role: NodeRole::Prefill,
            model: "m".into(),
            grpc_addr: "127.0.0.1:1".into(),
            kv_endpoint: "kv".into(),
            load: Load::default(),
        }
    }

    async fn backend(server: &EtcdServer) -> EtcdMembership {
        EtcdMembership::connect(&[server.endpoint()], "/watcher-test", crate::EtcdOptions::default()).await.unwrap()
    }

    #[tokio::test]
    async fn a_compacted_start_revision_cancels_the_watch() {
        let server = EtcdServer::start();
        let backend = backend(&server).await;
        let mut client = backend.client.clone();
        let mut watcher = Watcher { conn: Arc::clone(&backend.conn), client: client.clone(), nodes: BTreeMap::new() };
        let listed_at = watcher.list().await.unwrap();
        for i in 0..5 {
            let key = backend.conn.node_key(&format!("n{i}"));
            client.put(key, serde_json::to_vec(&node(&format!("n{i}"))).unwrap(), None::<PutOptions>).await.unwrap();
        }
        let latest = client.get("x", None).await.unwrap().header().unwrap().revision();
        client.compact(latest, Some(CompactionOptions::new().with_physical())).await.unwrap();

        let (snapshots, mut receiver) = watch::channel(Vec::new());
        let mut backoff = backend.conn.backoff();
        let error = tokio::time::timeout(Duration::from_secs(5), watcher.follow(listed_at, &snapshots, &mut backoff)).await.unwrap();
        assert!(matches!(error, Error::WatchCancelled { compact_revision, .. } if compact_revision > listed_at), "{error}");

        // The task body recovers by listing again: all five nodes show up.
        tokio::select! {
            never = watcher.run(listed_at, &snapshots) => match never {},
            seen = tokio::time::timeout(Duration::from_secs(5), receiver.wait_for(|nodes| nodes.len() == 5)) => {
                let ids: Vec<String> = seen.unwrap().unwrap().iter().map(|n| n.id.clone()).collect();
                assert_eq!(ids, ["n0", "n1", "n2", "n3", "n4"]);
            }
        }
    }

    #[tokio::test]
    async fn malformed_entries_are_left_out() {
        let server = EtcdServer::start();
        let backend = backend(&server).await;
        let mut client = backend.client.clone();
        let good = node("good");
        client.put(backend.conn.node_key("good"), serde_json::to_vec(&good).unwrap(), None).await.unwrap();
        client.put(backend.conn.node_key("garbage"), "not json", None).await.unwrap();
        client.put(backend.conn.node_key("mismatch"), serde_json::to_vec(&node("other")).unwrap(), None).await.unwrap();
        client.put(format!("{}a/b", backend.conn.nodes_prefix), serde_json::to_vec(&node("a")).unwrap(), None).await.unwrap();

        let mut receiver = backend.watch().await.unwrap();
        assert_eq!(*receiver.borrow_and_update(), vec![good.clone()]);

        // Through the watch path too: a good key turning into garbage drops the node.
        client.put(backend.conn.node_key("later"), serde_json::to_vec(&node("later")).unwrap(), None).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), receiver.wait_for(|nodes| nodes.len() == 2)).await.unwrap().unwrap();
        client.put(backend.conn.node_key("later"), "{", None).await.unwrap();
        let nodes = tokio::time::timeout(Duration::from_secs(5), receiver.wait_for(|nodes| nodes.len() == 1)).await.unwrap().unwrap();
        assert_eq!(*nodes, vec![good]);
    }
}
