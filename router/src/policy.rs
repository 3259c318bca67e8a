//! Choosing nodes: least load, prefix-cache affinity, or round robin (a closed set, chosen in
//! configuration). Pure functions over a membership snapshot, so they are tested without a cluster.
//!
//! Invariant: a policy only ever returns one of the candidates it was given.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;

use tandem_membership::NodeInfo;

/// How the router picks a decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Fewest queued + running requests, then most free KV blocks.
    LeastLoad,
    /// The decode node that served the longest prefix of this prompt (its prefix cache likely still has
    /// it), least load among equals.
    PrefixAware,
    /// Each node in turn.
    RoundRobin,
}

impl Policy {
    /// The policy's name, as `--policy` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::LeastLoad => "least-load",
            Policy::PrefixAware => "prefix-aware",
            Policy::RoundRobin => "round-robin",
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "least-load" => Ok(Policy::LeastLoad),
            "prefix-aware" => Ok(Policy::PrefixAware),
            "round-robin" => Ok(Policy::RoundRobin),
            _ => Err(format!("unknown routing policy {s:?} (least-load, prefix-aware, round-robin)")),
        }
    }
}

/// Load as one comparable key: (busy requests, negative free blocks, id).
fn load_key(n: &NodeInfo) -> (u64, i64, &str) {
    (u64::from(n.load.waiting) + u64::from(n.load.running), -i64::from(n.load.free_blocks), n.id.as_str())
}

/// The least loaded candidate.
pub fn least_load<'a>(candidates: &[&'a NodeInfo]) -> Option<&'a NodeInfo> {
    candidates.iter().copied().min_by(|a, b| load_key(a).cmp(&load_key(b)))
}

/// Remembers which decode node served which prompt-prefix blocks (chained block hashes), bounded.
#[derive(Debug)]
pub struct PrefixIndex {
    owner: HashMap<u64, String>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl PrefixIndex {
    /// An index remembering at most `capacity` block hashes.
    pub fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex { owner: HashMap::new(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// Records that `node` now holds the prefix blocks `hashes`.
    pub fn record(&mut self, hashes: &[u64], node: &str) {
        for &h in hashes {
            if self.owner.insert(h, node.to_string()).is_none() {
                self.order.push_back(h);
            }
        }
        while self.owner.len() > self.capacity {
            let Some(old) = self.order.pop_front() else { break };
            self.owner.remove(&old);
        }
    }

    /// For each candidate id, how many leading blocks of `hashes` it is believed to hold.
    pub fn matched_blocks(&self, hashes: &[u64], node: &str) -> usize {
        hashes.iter().take_while(|h| self.owner.get(h).is_some_and(|o| o == node)).count()
    }

    /// The candidate holding the longest prefix (least load among equals; plain least load if none).
    pub fn pick<'a>(&self, hashes: &[u64], candidates: &[&'a NodeInfo]) -> Option<&'a NodeInfo> {
        let best = candidates.iter().map(|n| self.matched_blocks(hashes, &n.id)).max()?;
        if best == 0 {
            return least_load(candidates);
        }
        let tied: Vec<&NodeInfo> = candidates.iter().copied().filter(|n| self.matched_blocks(hashes, &n.id) == best).collect();
        least_load(&tied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_membership::{Load, NodeRole};

    fn node(id: &str, waiting: u32, running: u32, free: u32) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            role: NodeRole::Decode,
            model: "m".into(),
            grpc_addr: format!("{id}:1"),
            kv_endpoint: String::new(),
            load: Load { waiting, running, free_blocks: free, total_blocks: 100, max_waiting: 0 },
        }
    }

    #[test]
    fn least_load_prefers_idle_then_free_blocks() {
        let (a, b, c) = (node("a", 1, 2, 50), node("b", 0, 1, 10), node("c", 0, 1, 90));
        assert_eq!(least_load(&[&a, &b, &c]).unwrap().id, "c");
        assert!(least_load(&[]).is_none());
    }

    #[test]
    fn prefix_index_follows_the_longest_prefix() {
        let (a, b) = (node("a", 5, 5, 10), node("b", 0, 0, 90));
        let mut idx = PrefixIndex::new(100);
        idx.record(&[1, 2, 3], "a");
        idx.record(&[1, 9], "b"); // block 1 moves to b
        assert_eq!(idx.pick(&[1, 2, 3], &[&a, &b]).unwrap().id, "b", "a lost block 1, so neither holds a 2-block prefix");
        idx.record(&[1, 2, 3], "a");
        assert_eq!(idx.pick(&[1, 2, 3, 4], &[&a, &b]).unwrap().id, "a");
        assert_eq!(idx.pick(&[7], &[&a, &b]).unwrap().id, "b", "no match: least load");
    }

    #[test]
    fn prefix_index_is_bounded() {
        let mut idx = PrefixIndex::new(10);
        for i in 0..1000u64 {
            idx.record(&[i], "a");
        }
        assert!(idx.owner.len() <= 10 && idx.order.len() <= 10);
        assert_eq!(idx.matched_blocks(&[999], "a"), 1);
        assert_eq!(idx.matched_blocks(&[0], "a"), 0);
    }

    #[test]
    fn policies_parse() {
        for p in [Policy::LeastLoad, Policy::PrefixAware, Policy::RoundRobin] {
            assert_eq!(p.name().parse::<Policy>(), Ok(p));
        }
        assert_eq!("prefix-aware".parse::<Policy>().unwrap(), Policy::PrefixAware);
        assert!("random".parse::<Policy>().is_err());
    }
}
