//! Partitions: the cluster spread over network namespaces the test makes (see
//! [`tandem_tests::netns`]), each process on a host of its own with its own address, KV over the tcp
//! backend. The prefill↔decode link cut while a long prompt's KV is in flight: the request is still
//! served (the decode node prefills it itself) with the uncut greedy output, and no block stays taken
//! on either node. A decode node cut from etcd leaves routing within its lease TTL and serves again
//! once healed. With 1% loss and 50 ms delay on the KV link (as `tc netem` would impose them, made
//! here with iptables and an NFQUEUE delayer: see `Net::impair`), transfers stay correct.
//!
//! Each test skips (with a message on stderr) only where network namespaces cannot be created; the
//! loss-and-delay test also where the kernel cannot drop or queue packets (iptables' statistic
//! match, NFQUEUE). Everything is bounded in time, and the
//! processes and namespaces are gone when a test ends, however it ends.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_engine::Engine;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_membership::Membership;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::cluster::{START, wait_all_blocks_free};
use tandem_tests::netns::{Host, Net};
use tandem_tests::process::Proc;
use tandem_tests::{smollm2_dir, tandem_bin};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

const PREFIX: &str = "/tandem-partitions";
/// Lease TTL of every node (seconds): how long a node cut from etcd may stay in routing.
const TTL: u64 = 2;
/// The longest any one request may take here (a cut remote prefill waits out its 30 s deadline,
/// then the decode node prefills ~1.5k tokens on a CPU).
const REQUEST_LIMIT: Duration = Duration::from_secs(180);
/// How long blocks may take to be freed (and that seen through membership) once a request ended.
const FREE_LIMIT: Duration = Duration::from_secs(60);

const NODE_PORT: u16 = 7000;
const KV_PORT: u16 = 7100;
const METRICS_PORT: u16 = 9100;
const ROUTER_PORT: u16 = 50051;

/// The network, or `None` (having said why) where this machine forbids namespaces.
fn net_or_skip(test: &str) -> Option<Net> {
    match Net::new() {
        Ok(net) => Some(net),
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

/// A cluster's processes on the hosts of a [`Net`]. Fields drop in order: processes first, then
/// etcd's data, then (in the test) the network.
struct Lab {
    _router: Proc,
    prefill: Option<Proc>,
    decode: Proc,
    _etcd: Proc,
    _etcd_dir: tempfile::TempDir,
    etcd_endpoint: String,
    router_addr: String,
}

/// What runs where.
struct Layout<'a> {
    etcd: &'a Host,
    router: &'a Host,
    prefill: Option<&'a Host>,
    /// Environment of the prefill node (test hooks, log filters).
    prefill_env: &'a [(&'a str, &'a str)],
    decode: &'a Host,
    decode_extra: &'a [&'a str],
}

impl Lab {
    fn start(layout: Layout<'_>) -> Lab {
        let model = smollm2_dir();
        let model = model.to_str().expect("UTF-8 model path");
        let dir = tempfile::Builder::new().prefix("tandem-etcd-").tempdir().expect("temp dir");
        let (etcd, etcd_endpoint) = start_etcd(layout.etcd, dir.path());
        let router_addr = format!("{}:{ROUTER_PORT}", layout.router.ip);
        let mut router = Proc::spawn(
            "router",
            tandem(layout.router, &["router", "--etcd", &etcd_endpoint, "--cluster-prefix", PREFIX, "--listen", &router_addr]),
        );
        let prefill = layout.prefill.map(|h| {
            let mut c = tandem(h, &node_args(h, "prefill", &etcd_endpoint, model, &[]));
            c.envs(layout.prefill_env.iter().copied());
            Proc::spawn("prefill", c)
        });
        let mut decode = Proc::spawn(
            "decode",
            tandem(layout.decode, &node_args(layout.decode, "decode", &etcd_endpoint, model, layout.decode_extra)),
        );
        router.wait_serving(START);
        let mut prefill = prefill;
        if let Some(p) = prefill.as_mut() {
            p.wait_serving(START);
            p.wait_line("metrics on http://", START); // printed once its metrics listener is bound
        }
        decode.wait_serving(START);
        decode.wait_line("metrics on http://", START);
        Lab { _router: router, prefill, decode, _etcd: etcd, _etcd_dir: dir, etcd_endpoint, router_addr }
    }

    async fn client(&self) -> TandemClient<Channel> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match TandemClient::connect(format!("http://{}", self.router_addr)).await {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => panic!("router unreachable: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// The router's view: (prefill nodes, decode nodes).
    async fn routed(&self, client: &mut TandemClient<Channel>) -> Option<(u32, u32)> {
        let h = client.health(api::HealthRequest {}).await.ok()?.into_inner();
        Some((h.prefill_nodes, h.decode_nodes))
    }

    /// Waits up to `limit` until the router routes to `want` (prefill, decode) nodes; returns how long it took.
    async fn wait_routed(&self, want: (u32, u32), limit: Duration) -> Duration {
        let mut client = self.client().await;
        let t0 = Instant::now();
        loop {
            let now = self.routed(&mut client).await;
            if now == Some(want) {
                return t0.elapsed();
            }
            assert!(t0.elapsed() < limit, "the router routes to {now:?} (prefill, decode) nodes, not {want:?}, after {limit:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_blocks_free(&self, nodes: usize) {
        let m = Membership::etcd(std::slice::from_ref(&self.etcd_endpoint), PREFIX, Default::default()).await.expect("etcd");
        let mut view = m.watch().await.expect("watch");
        wait_all_blocks_free(&mut view, nodes, FREE_LIMIT).await;
    }
}

/// `ip netns exec NS tandem ARGS`.
fn tandem<S: AsRef<std::ffi::OsStr>>(host: &Host, args: &[S]) -> Command {
    let mut c = host.command(tandem_bin());
    c.args(args);
    c
}

fn node_args(host: &Host, role: &str, etcd: &str, model: &str, extra: &[&str]) -> Vec<String> {
    let ip = &host.ip;
    let mut args: Vec<String> = [
        role,
        "--etcd",
        etcd,
        "--cluster-prefix",
        PREFIX,
        "--ttl",
        &TTL.to_string(),
        "--model",
        model,
        "--kv-cache-mib",
        "256",
        "--listen",
        &format!("{ip}:{NODE_PORT}"),
        "--advertise",
        ip,
        "--kv-connector",
        &format!("tcp://{ip}:{KV_PORT}"),
        "--metrics-listen",
        &format!("{ip}:{METRICS_PORT}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// etcd on `host`, serving clients on its address; returns it with its endpoint once it answers.
fn start_etcd(host: &Host, dir: &Path) -> (Proc, String) {
    let endpoint = format!("http://{}:2379", host.ip);
    let peer = "http://127.0.0.1:2380";
    let mut c = host.command("/usr/bin/etcd");
    c.args(["--name", "partitions", "--data-dir"])
        .arg(dir.join("data"))
        .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
        .args(["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer])
        .args(["--initial-cluster", &format!("partitions={peer}"), "--initial-cluster-state", "new"])
        .args(["--logger", "zap", "--log-outputs", "stderr", "--log-level", "error"]);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("ETCD") {
            c.env_remove(name);
        }
    }
    let etcd = Proc::spawn("etcd", c);
    let addr = format!("{}:2379", host.ip);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_get(&addr, "/health").is_some_and(|b| b.contains(r#""health":"true""#)) {
        assert!(Instant::now() < deadline, "etcd on {addr} did not answer /health; stderr:\n{}", etcd.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    (etcd, endpoint)
}

/// The response to `GET path` from `addr` (HOST:PORT), `None` on any error.
fn http_get(addr: &str, path: &str) -> Option<String> {
    let addr: SocketAddr = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// The sum of a metric's samples on a node whose labels contain every one of `labels`
/// (e.g. `state="used"`); panics when the node's metrics cannot be read.
fn metric(host: &Host, name: &str, labels: &[&str]) -> f64 {
    let addr = format!("{}:{METRICS_PORT}", host.ip);
    let body = http_get(&addr, "/metrics").unwrap_or_else(|| panic!("no metrics from {addr}"));
    body.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with([' ', '{'])))
        .filter(|l| labels.iter().all(|lab| l.contains(lab)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn request(prompt: &str, max_tokens: u32) -> api::GenerateRequest {
    api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text(prompt.into())),
        sampling: Some(api::SamplingParams { max_tokens: Some(max_tokens), temperature: Some(0.0), ..Default::default() }),
        ..Default::default()
    }
}

/// The token ids of a streamed request, bounded by [`REQUEST_LIMIT`].
async fn generate(client: &mut TandemClient<Channel>, req: api::GenerateRequest) -> Result<Vec<u32>, tonic::Status> {
    let run = async {
        let mut stream = client.generate(req).await?.into_inner();
        let mut ids = Vec::new();
        while let Some(msg) = stream.next().await {
            ids.extend(msg?.token_ids);
        }
        Ok(ids)
    };
    tokio::time::timeout(REQUEST_LIMIT, run).await.unwrap_or_else(|_| panic!("a request ran past {REQUEST_LIMIT:?}"))
}

/// Greedy completions from one in-process engine: what an uncut cluster answers (tests/tests/cluster.rs
/// holds the cluster to exactly this).
fn reference(prompts: &[String], max_tokens: usize) -> Vec<Vec<u32>> {
    let mut engine = Engine::load(&smollm2_dir(), EngineConfig::default()).expect("load");
    prompts
        .iter()
        .map(|p| {
            let params = SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() };
            engine.generate(&Prompt::Text(p.clone()), params).expect("generate").remove(0).token_ids
        })
        .collect()
}

/// A prompt of about `sentences` × 19 tokens, different for every `seed`.
fn long_prompt(seed: u32, sentences: usize) -> String {
    (0..sentences)
        .map(|i| format!("Chapter {seed}.{i}: the river town traded salt, wool and copper with its neighbours. "))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_kv_link_mid_transfer_still_serves_the_request_and_strands_no_block() {
    let Some(mut net) = net_or_skip("cutting_the_kv_link_mid_transfer") else { return };
    let (ctl, pre, dec) = (net.add("ctl"), net.add("prefill"), net.add("decode"));
    // The prefill node paces its chunks (100 ms before each; ~90 chunks for this prompt) and says when
    // the first one went out, so the cut lands while the transfer is in flight, whatever the machine.
    let prefill_env = [("TANDEM_KV_TEST_CHUNK_DELAY_MS", "100"), ("TANDEM_LOG", "info,tandem_kv_transfer=debug")];
    let lab = Lab::start(Layout { etcd: &ctl, router: &ctl, prefill: Some(&pre), prefill_env: &prefill_env, decode: &dec, decode_extra: &[] });
    lab.wait_routed((1, 1), Duration::from_secs(30)).await;
    let prompt = long_prompt(1, 80);
    let expected = tokio::task::spawn_blocking({
        let p = prompt.clone();
        move || reference(&[p], 16)
    })
    .await
    .expect("reference")
    .remove(0);

    let mut client = lab.client().await;
    let req = request(&prompt, 16);
    let served = tokio::spawn(async move { generate(&mut client, req).await });
    let t0 = Instant::now();
    let prefill = lab.prefill.as_ref().expect("a prefill node");
    let started = tokio::task::block_in_place(|| prefill.stderr_shows("KV transfer: first chunk sent", REQUEST_LIMIT));
    assert!(started, "the prefill node never sent a chunk; stderr:\n{}", prefill.stderr());
    assert!(!served.is_finished(), "the request ended before the cut");
    net.cut(&pre, &dec);
    eprintln!("cut the prefill-decode link {:?} after the request started", t0.elapsed());

    let got = served.await.expect("task").expect("the request failed although the decode node could prefill it");
    assert_eq!(got, expected, "output after the cut differs from the uncut output");
    let fell_back = metric(&dec, "tandem:local_prefill_total", &[r#"reason="remote_failed""#]);
    assert_eq!(fell_back, 1.0, "the cut did not break the remote prefill (it came too late?)");
    // Still cut: both nodes must free everything on their own.
    lab.wait_blocks_free(2).await;

    // Healed, the link carries KV again.
    net.heal(&pre, &dec);
    let transfers = metric(&dec, "tandem:kv_transfers_total", &[]);
    let prompt2 = long_prompt(2, 10);
    let expected2 = tokio::task::spawn_blocking({
        let p = prompt2.clone();
        move || reference(&[p], 8)
    });
    let mut client = lab.client().await;
    let got2 = generate(&mut client, request(&prompt2, 8)).await.expect("request after healing");
    assert_eq!(got2, expected2.await.expect("reference").remove(0));
    assert_eq!(metric(&dec, "tandem:kv_transfers_total", &[]), transfers + 1.0, "the healed link carried no KV");
    assert_eq!(fell_back, metric(&dec, "tandem:local_prefill_total", &[r#"reason="remote_failed""#]));
    lab.wait_blocks_free(2).await;
    drop(lab);
    drop(net);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_node_cut_from_etcd_leaves_routing_and_comes_back_when_healed() {
    let Some(mut net) = net_or_skip("a_decode_node_cut_from_etcd") else { return };
    let (store, ctl, dec) = (net.add("etcd"), net.add("router"), net.add("decode"));
    let lab = Lab::start(Layout { etcd: &store, router: &ctl, prefill: None, prefill_env: &[], decode: &dec, decode_extra: &["--colocated"] });
    lab.wait_routed((0, 1), Duration::from_secs(30)).await;
    let mut client = lab.client().await;
    let prompt = "The capital of France is";
    let expected = generate(&mut client, request(prompt, 8)).await.expect("served before the cut");
    assert!(!expected.is_empty());

    net.cut(&store, &dec);
    // The router still reaches the node; only its lease stops being renewed.
    let left = lab.wait_routed((0, 0), Duration::from_secs(TTL + 20)).await;
    eprintln!("the decode node left routing {left:?} after the cut (TTL {TTL} s)");
    let refused = generate(&mut client, request(prompt, 8)).await;
    assert!(refused.is_err(), "served with no decode node in routing: {refused:?}");

    net.heal(&store, &dec);
    let back = lab.wait_routed((0, 1), Duration::from_secs(60)).await;
    eprintln!("the decode node was back in routing {back:?} after the heal");
    let served_before = lab.decode.stderr().matches("decode done").count();
    let got = generate(&mut client, request(prompt, 8)).await.expect("served after the heal");
    assert_eq!(got, expected);
    assert!(
        wait_count(&lab.decode, "decode done", served_before + 1),
        "the healed node did not serve the request:\n{}",
        lab.decode.stderr()
    );
    lab.wait_blocks_free(1).await;
    drop(lab);
    drop(net);
}

/// Whether `needle` appears at least `n` times in `p`'s stderr within 5 s.
fn wait_count(p: &Proc, needle: &str, n: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.stderr().matches(needle).count() < n {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The shortest of `tries` TCP connects from `from` to `addr` (HOST:PORT), timed inside `from`'s
/// namespace: one round trip.
fn connect_rtt(from: &Host, addr: &str, tries: usize) -> Duration {
    let (host, port) = addr.rsplit_once(':').expect("HOST:PORT");
    let script = format!(
        "import socket, time\nbest = 99.0\nfor _ in range({tries}):\n    t = time.monotonic()\n    socket.create_connection(('{host}', {port}), 10).close()\n    best = min(best, time.monotonic() - t)\nprint(best)"
    );
    let out = from.command("python3").args(["-c", &script]).output().expect("python3");
    assert!(out.status.success(), "timing a connect to {addr}: {}", String::from_utf8_lossy(&out.stderr));
    Duration::from_secs_f64(String::from_utf8_lossy(&out.stdout).trim().parse().expect("seconds"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_percent_loss_and_50ms_delay_on_the_kv_link_keep_transfers_correct() {
    let Some(mut net) = net_or_skip("loss_and_delay_on_the_kv_link") else { return };
    let (ctl, pre, dec) = (net.add("ctl"), net.add("prefill"), net.add("decode"));
    let lab = Lab::start(Layout { etcd: &ctl, router: &ctl, prefill: Some(&pre), prefill_env: &[], decode: &dec, decode_extra: &[] });
    lab.wait_routed((1, 1), Duration::from_secs(30)).await;
    // What the prefill node sends the decode node (the KV, and its answers to the node API) loses 1 %
    // of its packets and waits 50 ms, as `tc netem delay 50ms loss 1%` on the prefill host would.
    let delayer = std::path::Path::new(env!("CARGO_BIN_EXE_tandem-netdelay"));
    let impairment = match net.impair(&pre, &dec, Duration::from_millis(50), 0.01, delayer) {
        Ok(i) => i,
        Err(why) => {
            assert!(!why.contains("No such file"), "iptables is missing (scripts/install-deps.sh installs it): {why}");
            eprintln!("SKIPPED loss_and_delay_on_the_kv_link: this kernel cannot drop or queue packets (iptables statistic / NFQUEUE): {why}");
            return;
        }
    };
    let node = format!("{}:{NODE_PORT}", pre.ip);
    let (impaired, clear) = (connect_rtt(&dec, &node, 5), connect_rtt(&ctl, &node, 5));
    eprintln!("connect round trip to the prefill node: {impaired:?} from the decode node, {clear:?} from elsewhere");
    assert!(impaired >= Duration::from_millis(50), "the impaired link's round trip is {impaired:?}");
    assert!(clear < Duration::from_millis(25), "an unimpaired link's round trip is {clear:?}");

    // Four at once over the one impaired link, ~7.5 MB of KV each (prompts of ~165 tokens: twice
    // that took ~20 s alone, and with the cores starved its transfers outlasted the 30 s timeout).
    let prompts: Vec<String> = (10..14).map(|i| long_prompt(i, 8)).collect();
    let expected = tokio::task::spawn_blocking({
        let p = prompts.clone();
        move || reference(&p, 12)
    });
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for p in &prompts {
        let mut client = lab.client().await;
        let req = request(p, 12);
        tasks.push(tokio::spawn(async move { generate(&mut client, req).await }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.expect("task").expect("request over the impaired link"));
    }
    eprintln!("{} requests over the impaired link in {:?}", prompts.len(), t0.elapsed());
    assert_eq!(got, expected.await.expect("reference"), "outputs over the impaired KV link differ");
    let warnings = |p: &Proc| p.stderr().lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).collect::<Vec<_>>().join("\n");
    let why = format!("decode node:\n{}\nprefill node:\n{}", warnings(&lab.decode), lab.prefill.as_ref().map(warnings).unwrap_or_default());
    assert_eq!(metric(&dec, "tandem:local_prefill_total", &[]), 0.0, "a request fell back to local prefill; {why}");
    assert_eq!(metric(&dec, "tandem:kv_transfer_failures_total", &[]), 0.0, "a transfer failed; {why}");
    assert_eq!(metric(&pre, "tandem:kv_transfer_failures_total", &[]), 0.0, "a transfer failed; {why}");
    assert_eq!(metric(&dec, "tandem:kv_transfers_total", &[]), prompts.len() as f64, "not every prompt moved over the KV link; {why}");
    let dropped = impairment.dropped().expect("drop counter");
    eprintln!("packets dropped on the way: {dropped}");
    assert!(dropped > 0, "no packet was lost: the link was not impaired");
    lab.wait_blocks_free(2).await;
    drop(impairment);
    drop(lab);
    drop(net);
}
