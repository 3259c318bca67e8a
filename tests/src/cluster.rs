//! A tandem cluster of real processes for end-to-end tests: etcd (see [`crate::etcd`]), one router
//! (optionally serving the OpenAI-compatible HTTP API), prefill and decode nodes on SmolLM2, each
//! started from the `tandem` binary and killed on drop (see [`crate::process`]).
//!
//! Invariants:
//! - [`Cluster::start`] returns once every process printed its serving line; the router may not see
//!   the nodes yet (wait on membership or health).
//! - Nothing outlives the cluster: dropping it kills every process and etcd.

use std::time::Duration;

use tandem_membership::{Membership, NodeInfo};
use tokio::sync::watch;

use crate::etcd::EtcdServer;
use crate::process::Proc;
use crate::smollm2_dir;

/// How long a process may take to print its serving line.
pub const START: Duration = Duration::from_secs(120);

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct ClusterSpec<'a> {
    /// Prefill nodes.
    pub prefills: usize,
    /// Decode nodes.
    pub decodes: usize,
    /// Extra arguments of every decode node (`--local-prefill-below 0` unless given: always transfer).
    pub decode_extra: &'a [&'a str],
    /// Extra arguments of the router.
    pub router_extra: &'a [&'a str],
    /// Serve the OpenAI-compatible HTTP API on a free port.
    pub http: bool,
    /// Environment variables of every process.
    pub env: &'a [(&'a str, &'a str)],
}

/// A running cluster.
pub struct Cluster {
    /// The etcd every process registers in.
    pub etcd: EtcdServer,
    /// The key prefix of this cluster in etcd.
    pub prefix: String,
    /// The router process.
    pub router: Proc,
    /// The prefill node processes.
    pub prefill: Vec<Proc>,
    /// The decode node processes.
    pub decode: Vec<Proc>,
    /// The router's gRPC address.
    pub addr: String,
    /// The decode nodes' gRPC addresses, in `decode` order.
    pub decode_addrs: Vec<String>,
    /// The router's HTTP address (HOST:PORT) when `http` was asked for.
    pub http: Option<String>,
}

/// The arguments of a `tandem prefill` or `tandem decode` node on SmolLM2 (256 MiB of KV unless
/// `extra` names `--kv-cache-mib`).
pub fn node_args<'a>(
    role: &'a str,
    etcd: &'a str,
    prefix: &'a str,
    model: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        role,
        "--etcd",
        etcd,
        "--cluster-prefix",
        prefix,
        "--ttl",
        "2",
        "--model",
        model,
    ];
    if !extra.contains(&"--kv-cache-mib") {
        args.extend_from_slice(&["--kv-cache-mib", "256"]);
    }
    args.extend_from_slice(extra);
    args
}

/// Waits for a router's `... OpenAI API on http://ADDR/v1` line and returns ADDR.
pub fn wait_http(router: &mut Proc) -> String {
    let line = router.wait_line("OpenAI API on http://", START);
    let url = line
        .rsplit("OpenAI API on http://")
        .next()
        .expect("address")
        .trim();
    url.strip_suffix("/v1").unwrap_or(url).to_string()
}

impl Cluster {
    /// Starts etcd, the router and the nodes under `prefix`.
    pub fn start(prefix: &str, spec: ClusterSpec<'_>) -> Cluster {
        let etcd = EtcdServer::start();
        let endpoint = etcd.endpoint();
        let model = smollm2_dir();
        let model = model.to_str().expect("UTF-8 model path");
        let mut router_args = vec![
            "router",
            "--etcd",
            &endpoint,
            "--cluster-prefix",
            prefix,
            "--listen",
            "127.0.0.1:0",
        ];
        if spec.http {
            router_args.extend_from_slice(&["--http-listen", "127.0.0.1:0"]);
        }
        router_args.extend_from_slice(spec.router_extra);
        let mut router = Proc::start_with_env("router", &router_args, spec.env);
        let addr = router.wait_serving(START);
        let http = spec.http.then(|| wait_http(&mut router));
        let mut prefill: Vec<Proc> = (0..spec.prefills)
            .map(|i| {
                Proc::start_with_env(
                    &format!("prefill{i}"),
                    &node_args("prefill", &endpoint, prefix, model, &[]),
                    spec.env,
                )
            })
            .collect();
        let mut decode: Vec<Proc> = (0..spec.decodes)
            .map(|i| {
                let mut extra = Vec::new();
                if !spec.decode_extra.contains(&"--local-prefill-below") {
                    extra.extend_from_slice(&["--local-prefill-below", "0"]);
                }
                extra.extend_from_slice(spec.decode_extra);
                Proc::start_with_env(
                    &format!("decode{i}"),
                    &node_args("decode", &endpoint, prefix, model, &extra),
                    spec.env,
                )
            })
            .collect();
        for p in prefill.iter_mut() {
            p.wait_serving(START);
        }
        let decode_addrs = decode.iter_mut().map(|p| p.wait_serving(START)).collect();
        Cluster {
            etcd,
            prefix: prefix.to_string(),
            router,
            prefill,
            decode,
            addr,
            decode_addrs,
            http,
        }
    }

    /// A membership view of this cluster (as the router sees it).
    pub async fn membership(&self) -> watch::Receiver<Vec<NodeInfo>> {
        let m = Membership::etcd(&[self.etcd.endpoint()], &self.prefix, Default::default())
            .await
            .expect("etcd");
        m.watch().await.expect("watch")
    }
}

/// Waits up to `limit` until exactly `expect_nodes` nodes are in membership and every one reports all
/// its KV blocks free and nothing running; panics with their loads otherwise.
pub async fn wait_all_blocks_free(
    nodes: &mut watch::Receiver<Vec<NodeInfo>>,
    expect_nodes: usize,
    limit: Duration,
) {
    let r = tokio::time::timeout(
        limit,
        nodes.wait_for(|ns| {
            ns.len() == expect_nodes
                && ns
                    .iter()
                    .all(|n| n.load.free_blocks == n.load.total_blocks && n.load.running == 0)
        }),
    )
    .await
    .map(|_| ());
    let now: Vec<String> = nodes
        .borrow()
        .iter()
        .map(|n| format!("{} {:?}", n.id, n.load))
        .collect();
    assert!(r.is_ok(), "blocks still in use after {limit:?}: {now:?}");
}
