//! Which peers a node may call: only nodes the cluster's membership lists, in the role the call needs
//! and serving the same model. A node never connects to an address a caller merely names (a decode
//! node's `prefill_addr`, a descriptor's KV endpoint), so it cannot be made to reach arbitrary hosts.
//!
//! Invariant: a peer is allowed exactly while the latest membership snapshot lists it; a peer that
//! appeared a moment ago (the caller saw it first) is waited for briefly, never assumed.

use std::time::Duration;

use tandem_membership::{NodeInfo, NodeRole};
use tokio::sync::watch;

/// How long a call waits for membership to list a peer the caller already knows of.
pub const PEER_WAIT: Duration = Duration::from_secs(2);

/// The membership view a node checks its peers against.
#[derive(Debug, Clone)]
pub struct Peers {
    nodes: watch::Receiver<Vec<NodeInfo>>,
    model: String,
}

impl Peers {
    /// Peers from a membership watch, serving `model`.
    pub fn new(nodes: watch::Receiver<Vec<NodeInfo>>, model: impl Into<String>) -> Peers {
        Peers { nodes, model: model.into() }
    }

    /// Whether membership lists a `role` node of this model for which `matches` holds, waiting up to
    /// [`PEER_WAIT`] for it to appear.
    pub async fn listed(&self, role: NodeRole, matches: impl Fn(&NodeInfo) -> bool) -> bool {
        let ok = |nodes: &Vec<NodeInfo>| nodes.iter().any(|n| n.role == role && n.model == self.model && matches(n));
        let mut nodes = self.nodes.clone();
        if ok(&nodes.borrow_and_update()) {
            return true;
        }
        matches!(tokio::time::timeout(PEER_WAIT, nodes.wait_for(ok)).await, Ok(Ok(_)))
    }

    /// Whether `addr` is the gRPC address of a listed prefill node.
    pub async fn is_prefill_node(&self, addr: &str) -> bool {
        self.listed(NodeRole::Prefill, |n| n.grpc_addr == addr).await
    }

    /// Whether `endpoint` is the KV endpoint of a listed decode node.
    pub async fn is_decode_kv_endpoint(&self, endpoint: &str) -> bool {
        self.listed(NodeRole::Decode, |n| n.kv_endpoint == endpoint).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_membership::Load;

    fn node(id: &str, role: NodeRole, model: &str) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            role,
            model: model.into(),
            grpc_addr: format!("{id}:1"),
            kv_endpoint: format!("tcp://{id}:2"),
            load: Load { waiting: 0, running: 0, free_blocks: 1, total_blocks: 1, max_waiting: 1 },
        }
    }

    #[tokio::test(start_paused = true)]
    async fn only_listed_peers_of_the_right_role_and_model_are_allowed() {
        let (tx, rx) = watch::channel(vec![node("p", NodeRole::Prefill, "m"), node("d", NodeRole::Decode, "m"), node("q", NodeRole::Prefill, "other")]);
        let peers = Peers::new(rx, "m");
        assert!(peers.is_prefill_node("p:1").await);
        assert!(!peers.is_prefill_node("d:1").await, "a decode node is not a prefill node");
        assert!(!peers.is_prefill_node("q:1").await, "another model's node");
        assert!(!peers.is_prefill_node("evil.example:80").await);
        assert!(peers.is_decode_kv_endpoint("tcp://d:2").await);
        assert!(!peers.is_decode_kv_endpoint("tcp://p:2").await);
        // A node that joins while a call waits is found.
        let late = tokio::spawn({
            let peers = peers.clone();
            async move { peers.is_prefill_node("late:1").await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        tx.send_modify(|n| n.push(node("late", NodeRole::Prefill, "m")));
        assert!(late.await.unwrap());
    }
}
