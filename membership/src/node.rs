//! What a node says about itself: its role, model, addresses and current load.
//!
//! [`NodeInfo`] is stored as JSON (serde) in etcd under `<prefix>/nodes/<id>`; the JSON field
//! names are the Rust field names and `role` is `"prefill"` or `"decode"`. Unknown fields are
//! ignored on read, so a newer node can add fields without breaking an older router.
//!
//! Invariant: a [`NodeInfo`] that reached a backend has a valid id ([`validate_node_id`]): 1 to
//! [`MAX_NODE_ID_LEN`] printable ASCII characters with no `/` and no space, so it is exactly the
//! last segment of its etcd key.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The longest node id accepted, in bytes.
pub const MAX_NODE_ID_LEN: usize = 128;

/// What a node does in the disaggregated pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// Runs prompt prefill and ships the KV cache to a decode node.
    Prefill,
    /// Receives KV caches and generates tokens.
    Decode,
}

/// A node's load as the router sees it (a snapshot; published at most every ~200 ms).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Load {
    /// Requests queued and not yet scheduled.
    pub waiting: u32,
    /// Requests currently being processed.
    pub running: u32,
    /// KV-cache blocks free now.
    pub free_blocks: u32,
    /// KV-cache blocks in total.
    pub total_blocks: u32,
    /// The node's bound on `waiting` (`--max-waiting-requests`): at it, the node refuses more work and
    /// a router sends it none. 0: not published (a node from before the bound existed).
    #[serde(default)]
    pub max_waiting: u32,
}

/// One cluster member, as registered and as watched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Unique node id (see [`validate_node_id`]); the last segment of the etcd key.
    pub id: String,
    /// Prefill or decode.
    pub role: NodeRole,
    /// The model this node serves.
    pub model: String,
    /// Where the node's gRPC API listens (`host:port`).
    pub grpc_addr: String,
    /// The node's KV-transfer endpoint (backend-specific string).
    pub kv_endpoint: String,
    /// Load at the last publication.
    pub load: Load,
}

/// Checks that `id` can name a node: 1 to [`MAX_NODE_ID_LEN`] bytes of printable ASCII other than
/// `/` (the key separator) and space.
pub fn validate_node_id(id: &str) -> Result<()> {
    let reason = if id.is_empty() {
        "empty"
    } else if id.len() > MAX_NODE_ID_LEN {
        "longer than 128 bytes"
    } else if id.contains('/') {
        "contains '/'"
    } else if !id.bytes().all(|b| b.is_ascii_graphic()) {
        "not printable ASCII without spaces"
    } else {
        return Ok(());
    };
    Err(Error::InvalidNodeId { id: id.to_owned(), reason })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_validated() {
        for good in ["decode-0", "prefill.1", "10.0.0.7:50051", "a", &"x".repeat(MAX_NODE_ID_LEN)] {
            assert!(validate_node_id(good).is_ok(), "{good:?} should be accepted");
        }
        for bad in ["", "a/b", "has space", "tab\t", "é", &"x".repeat(MAX_NODE_ID_LEN + 1)] {
            let err = validate_node_id(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidNodeId { ref id, .. } if id == bad), "{err}");
        }
    }

    #[test]
    fn json_shape_is_stable() {
        let info = NodeInfo {
            id: "d0".into(),
            role: NodeRole::Decode,
            model: "m".into(),
            grpc_addr: "127.0.0.1:1".into(),
            kv_endpoint: "tcp://127.0.0.1:2".into(),
            load: Load { waiting: 1, running: 2, free_blocks: 3, total_blocks: 4, max_waiting: 5 },
        };
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "id": "d0", "role": "decode", "model": "m", "grpc_addr": "127.0.0.1:1",
                "kv_endpoint": "tcp://127.0.0.1:2",
                "load": {"waiting": 1, "running": 2, "free_blocks": 3, "total_blocks": 4, "max_waiting": 5}
            })
        );
        // Unknown fields from a newer node are ignored.
        let mut newer = json.clone();
        newer["gpu"] = serde_json::json!("h100");
        assert_eq!(serde_json::from_value::<NodeInfo>(newer).unwrap(), info);
        // A node from before `max_waiting` existed publishes none: it reads as 0 (no bound published).
        let mut older = json;
        older["load"].as_object_mut().unwrap().remove("max_waiting");
        let older: NodeInfo = serde_json::from_value(older).unwrap();
        assert_eq!(older.load.max_waiting, 0);
    }
}
