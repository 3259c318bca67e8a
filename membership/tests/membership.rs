//! Membership through the public API: the same test bodies on the memory backend and on a real
//! etcd (tandem-tests' `EtcdServer`), plus etcd-only tests for lease expiry, etcd restarts and
//! task clean-up. Every wait is bounded.

use std::time::{Duration, Instant};

use tandem_membership::{EtcdOptions, Load, Membership, NodeInfo, NodeRole, Registration};
use tandem_tests::etcd::{DataDir, EtcdServer};
use tokio::sync::watch;

/// Lease TTL of the etcd tests (etcd's minimum with default server settings).
const TTL: Duration = Duration::from_secs(2);
/// Slack on top of the TTL for an expired lease to disappear: etcd checks for expired leases
/// every 500 ms, then the delete goes through raft and the watch.
const EXPIRY_SLACK: Duration = Duration::from_millis(1500);
/// Bound on changes that need no lease expiry (a put or delete reaching a watcher).
const PROMPT: Duration = Duration::from_secs(2);
/// Bound on recovery after an etcd restart (reconnect backoff plus a few requests).
const RECOVERY: Duration = Duration::from_secs(15);

struct Cluster {
    membership: Membership,
    /// `None` for the memory backend.
    etcd: Option<EtcdServer>,
}

impl Cluster {
    fn memory() -> Self {
        Self { membership: Membership::memory(), etcd: None }
    }

    async fn etcd() -> Self {
        let server = blocking(EtcdServer::start);
        Self { membership: etcd_membership(&server, "/tandem-test").await, etcd: Some(server) }
    }

    /// When a registration dropped without deregistering must be gone: (not before, by).
    fn crash_window(&self) -> (Duration, Duration) {
        match self.etcd {
            None => (Duration::ZERO, PROMPT),
            // The last keep-alive went out at most ttl/3 before the drop.
            Some(_) => (TTL / 2, TTL + EXPIRY_SLACK),
        }
    }

    fn server(&mut self) -> &mut EtcdServer {
        self.etcd.as_mut().expect("an etcd cluster")
    }
}

async fn etcd_membership(server: &EtcdServer, prefix: &str) -> Membership {
    let opts = EtcdOptions {
        ttl: TTL,
        request_timeout: Duration::from_secs(1),
        max_backoff: Duration::from_millis(500),
        tls: None,
    };
    Membership::etcd(&[server.endpoint()], prefix, opts).await.expect("connect to etcd")
}

/// Runs blocking `EtcdServer` work without stalling the runtime's other worker.
fn blocking<T>(work: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(work)
}

fn node(id: &str, role: NodeRole) -> NodeInfo {
    NodeInfo {
        id: id.to_owned(),
        role,
        model: "smollm2-135m-instruct".to_owned(),
        grpc_addr: format!("127.0.0.1:{}", 50000 + id.len()),
        kv_endpoint: format!("tcp://{id}.local:7000"),
        load: Load { waiting: 0, running: 0, free_blocks: 100, total_blocks: 128, max_waiting: 0 },
    }
}

fn ids(nodes: &[NodeInfo]) -> Vec<&str> {
    nodes.iter().map(|n| n.id.as_str()).collect()
}

/// Waits (at most `limit`) until `done` holds for the snapshot; returns it.
async fn wait_until(
    live: &mut watch::Receiver<Vec<NodeInfo>>,
    limit: Duration,
    what: &str,
    done: impl FnMut(&Vec<NodeInfo>) -> bool,
) -> Vec<NodeInfo> {
    let outcome = tokio::time::timeout(limit, live.wait_for(done)).await.map(|seen| seen.map(|nodes| nodes.clone()));
    match outcome {
        Ok(Ok(nodes)) => nodes,
        Ok(Err(_)) => panic!("watch channel closed while waiting for {what}"),
        Err(_) => panic!("no {what} within {limit:?}; last snapshot: {:?}", *live.borrow()),
    }
}

async fn register(membership: &Membership, info: NodeInfo) -> Registration {
    membership.register(info).await.expect("register")
}

// ---- bodies shared by both backends ----

async fn register_two_and_watch(cluster: Cluster) {
    let m = &cluster.membership;
    let mut live = m.watch().await.unwrap();
    assert!(live.borrow_and_update().is_empty(), "a new membership starts empty");

    let decode = node("decode-0", NodeRole::Decode);
    let prefill = node("prefill-0", NodeRole::Prefill);
    // Registered out of id order: snapshots are sorted by id.
    let _p = register(m, prefill.clone()).await;
    let d = register(m, decode.clone()).await;
    assert_eq!(d.id(), "decode-0");
    let nodes = wait_until(&mut live, PROMPT, "both nodes", |n| n.len() == 2).await;
    assert_eq!(nodes, vec![decode.clone(), prefill.clone()], "every field as registered");

    // A watcher opened later starts from the current membership.
    let later = m.watch().await.unwrap();
    assert_eq!(*later.borrow(), vec![decode, prefill]);
}

async fn update_load_is_published(cluster: Cluster) {
    let m = &cluster.membership;
    let mut live = m.watch().await.unwrap();
    let info = node("decode-1", NodeRole::Decode);
    let reg = register(m, info.clone()).await;
    wait_until(&mut live, PROMPT, "the node", |n| n.len() == 1).await;

    let busy = Load { waiting: 3, running: 8, free_blocks: 10, total_blocks: 128, max_waiting: 16 };
    reg.update_load(busy);
    let nodes = wait_until(&mut live, PROMPT, "the new load", |n| n.first().is_some_and(|n| n.load == busy)).await;
    assert_eq!(nodes[0], NodeInfo { load: busy, ..info.clone() }, "only the load changed");

    // A burst of updates is coalesced, and the newest value wins.
    live.borrow_and_update();
    for running in 0..50 {
        reg.update_load(Load { running, ..busy });
    }
    let newest = Load { running: 49, ..busy };
    let deadline = tokio::time::Instant::now() + PROMPT;
    let mut publications = 0;
    loop {
        tokio::time::timeout_at(deadline, live.changed()).await.expect("the newest load in time").unwrap();
        publications += 1;
        if live.borrow_and_update()[0].load == newest {
            break;
        }
    }
    assert!(publications <= 2, "a burst of 50 updates gave {publications} publications");
}

async fn deregister_removes_at_once(cluster: Cluster) {
    let m = &cluster.membership;
    let mut live = m.watch().await.unwrap();
    let stays = register(m, node("stays", NodeRole::Prefill)).await;
    let goes = register(m, node("goes", NodeRole::Decode)).await;
    wait_until(&mut live, PROMPT, "both nodes", |n| n.len() == 2).await;

    let started = Instant::now();
    goes.deregister().await.expect("deregister");
    let nodes = wait_until(&mut live, PROMPT, "the deregistered node to go", |n| n.len() == 1).await;
    assert_eq!(ids(&nodes), ["stays"]);
    // Far sooner than a lease expiry could explain.
    assert!(started.elapsed() < TTL / 2, "took {:?}", started.elapsed());
    drop(stays);
}

async fn dropped_registration_disappears(cluster: Cluster) {
    let m = &cluster.membership;
    let mut live = m.watch().await.unwrap();
    let _stays = register(m, node("survivor", NodeRole::Decode)).await;
    let crashes = register(m, node("crashes", NodeRole::Decode)).await;
    wait_until(&mut live, PROMPT, "both nodes", |n| n.len() == 2).await;

    let (not_before, by) = cluster.crash_window();
    let crashed_at = Instant::now();
    drop(crashes);
    let nodes = wait_until(&mut live, by, "the crashed node to expire", |n| n.len() == 1).await;
    let gone_after = crashed_at.elapsed();
    eprintln!("crashed node gone {gone_after:?} after the drop");
    assert_eq!(ids(&nodes), ["survivor"]);
    assert!(gone_after >= not_before, "gone after {gone_after:?}, before the lease could expire ({not_before:?})");
}

async fn same_id_replaces_and_old_handle_cannot_remove_it(cluster: Cluster) {
    let m = &cluster.membership;
    let mut live = m.watch().await.unwrap();
    let first = register(m, node("n", NodeRole::Decode)).await;
    wait_until(&mut live, PROMPT, "the first node", |n| n.len() == 1).await;

    // The node "restarts" under the same id before its old entry went away.
    let restarted = NodeInfo { grpc_addr: "127.0.0.1:60000".into(), ..node("n", NodeRole::Decode) };
    let second = register(m, restarted.clone()).await;
    wait_until(&mut live, PROMPT, "the replacement", |n| n == &vec![restarted.clone()]).await;

    // Neither the old handle's drop nor its lease's expiry removes the replacement...
    drop(first);
    let (_, by) = cluster.crash_window();
    tokio::time::sleep(by).await;
    assert_eq!(*live.borrow_and_update(), vec![restarted.clone()]);
    // ...and its load updates still flow.
    let load = Load { waiting: 9, ..restarted.load };
    second.update_load(load);
    wait_until(&mut live, PROMPT, "the replacement's load", |n| n.first().is_some_and(|n| n.load == load)).await;
    second.deregister().await.unwrap();
    wait_until(&mut live, PROMPT, "no node", Vec::is_empty).await;
}

async fn invalid_ids_are_rejected(cluster: Cluster) {
    for bad in ["", "a/b", "with space"] {
        let err = cluster.membership.register(node(bad, NodeRole::Prefill)).await.expect_err(bad);
        assert!(matches!(err, tandem_membership::Error::InvalidNodeId { .. }), "{err}");
    }
    assert!(cluster.membership.watch().await.unwrap().borrow().is_empty());
}

/// One `#[tokio::test]` per backend for each shared body.
macro_rules! on_both_backends {
    ($($body:ident),* $(,)?) => {$(
        mod $body {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$body(super::Cluster::memory()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn etcd() {
                super::$body(super::Cluster::etcd().await).await;
            }
        }
    )*};
}

on_both_backends!(
    register_two_and_watch,
    update_load_is_published,
    deregister_removes_at_once,
    dropped_registration_disappears,
    same_id_replaces_and_old_handle_cannot_remove_it,
    invalid_ids_are_rejected,
);

// ---- etcd only ----

/// etcd goes away for longer than the TTL and comes back (with or without its data): the node
/// shows up again, stays up past several TTLs (its keep-alive runs), and its load updates flow.
async fn survives_etcd_restart(data: DataDir) {
    let mut cluster = Cluster::etcd().await;
    let m = cluster.membership.clone();
    let mut live = m.watch().await.unwrap();
    let info = node("decode-r", NodeRole::Decode);
    let reg = register(&m, info.clone()).await;
    wait_until(&mut live, PROMPT, "the node", |n| n.len() == 1).await;

    blocking(|| cluster.server().stop());
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    // Load changes while etcd is down are kept and published once it is back.
    let load = Load { waiting: 1, running: 2, free_blocks: 3, total_blocks: 128, max_waiting: 0 };
    reg.update_load(load);
    blocking(|| cluster.server().start_again(data));

    let back = Instant::now();
    let expected = vec![NodeInfo { load, ..info.clone() }];
    wait_until(&mut live, RECOVERY, "the node back with its newest load", |n| *n == expected).await;
    eprintln!("{data:?}: node back {:?} after etcd came back", back.elapsed());

    // Kept alive, not a leftover: still there after several TTLs...
    tokio::time::sleep(TTL * 3).await;
    assert_eq!(*live.borrow_and_update(), expected, "the node must stay registered");
    // ...and a fresh watcher (a fresh list) sees it too.
    assert_eq!(*m.watch().await.unwrap().borrow(), expected);
    // Deregistration works on the new lease.
    reg.deregister().await.expect("deregister after restart");
    wait_until(&mut live, PROMPT, "no node", Vec::is_empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_keeping_data() {
    survives_etcd_restart(DataDir::Keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_with_empty_data_dir() {
    survives_etcd_restart(DataDir::Wipe).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_under_different_prefixes_do_not_see_each_other() {
    let cluster = Cluster::etcd().await;
    let server = cluster.etcd.as_ref().unwrap();
    let other = etcd_membership(server, "/other-cluster/").await;
    let mut live = cluster.membership.watch().await.unwrap();
    let mut other_live = other.watch().await.unwrap();
    let _a = register(&cluster.membership, node("a", NodeRole::Decode)).await;
    let _b = register(&other, node("b", NodeRole::Decode)).await;
    assert_eq!(ids(&wait_until(&mut live, PROMPT, "a", |n| !n.is_empty()).await), ["a"]);
    assert_eq!(ids(&wait_until(&mut other_live, PROMPT, "b", |n| !n.is_empty()).await), ["b"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(live.borrow().len(), 1);
    assert_eq!(other_live.borrow().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_and_watch_fail_when_etcd_is_down() {
    let mut cluster = Cluster::etcd().await;
    blocking(|| cluster.server().stop());
    let started = Instant::now();
    let err = cluster.membership.register(node("x", NodeRole::Prefill)).await.expect_err("etcd is down");
    assert!(matches!(err, tandem_membership::Error::Etcd { .. } | tandem_membership::Error::Timeout { .. }), "{err}");
    let err = cluster.membership.watch().await.expect_err("etcd is down");
    assert!(matches!(err, tandem_membership::Error::Etcd { .. } | tandem_membership::Error::Timeout { .. }), "{err}");
    // Both bounded by the 1 s request timeout (a few requests at most).
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

/// Waits (bounded) until etcd's gauge `name` equals `want`.
async fn wait_for_metric(server: &EtcdServer, name: &str, want: f64) {
    let deadline = Instant::now() + PROMPT;
    loop {
        let value = blocking(|| server.metric(name));
        if value == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{name} is {value:?}, expected {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_tasks_end_with_their_owners() {
    let cluster = Cluster::etcd().await;
    let server = cluster.etcd.as_ref().unwrap();
    wait_for_metric(server, "etcd_debugging_mvcc_watcher_total", 0.0).await;

    // Dropping every receiver (clones included) ends the watch task and its etcd watch.
    let live = cluster.membership.watch().await.unwrap();
    let clone = live.clone();
    wait_for_metric(server, "etcd_debugging_mvcc_watcher_total", 1.0).await;
    drop(live);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(blocking(|| server.metric("etcd_debugging_mvcc_watcher_total")), Some(1.0), "a clone still watches");
    drop(clone);
    wait_for_metric(server, "etcd_debugging_mvcc_watcher_total", 0.0).await;

    // Dropping a registration stops its keep-alive: the lease is left to expire, and the task
    // does not come back to re-register the node afterwards.
    let mut live = cluster.membership.watch().await.unwrap();
    let reg = register(&cluster.membership, node("gone", NodeRole::Prefill)).await;
    wait_until(&mut live, PROMPT, "the node", |n| n.len() == 1).await;
    drop(reg);
    wait_until(&mut live, TTL + EXPIRY_SLACK, "the node to expire", Vec::is_empty).await;
    tokio::time::sleep(TTL).await;
    assert!(live.borrow().is_empty(), "a dropped registration came back");
}
