//! Soak: many requests of random shapes through a cluster of real processes (etcd, a router, one
//! prefill and two decode nodes on SmolLM2), with random client cancellations and a node killed and
//! restarted every few hundred requests. Afterwards every node's blocks are all free, the processes
//! that lived through it have not grown past a stated memory bound, and every greedy request that
//! completed equals the single-process reference.
//!
//! CI runs a short version (the defaults below). The long one is `scripts/soak.sh` (10,000 requests):
//!   TANDEM_SOAK_REQUESTS   requests in all (default 160)
//!   TANDEM_SOAK_CLIENTS    concurrent clients (default 8)
//!   TANDEM_SOAK_KILL_EVERY a node is killed and restarted after this many requests (default 50);
//!                          the prefill node and the second decode node take turns
//!   TANDEM_SOAK_SEED       seed of the shapes, cancellations and temperatures (default 1)
//!
//! What a request may end with: its full output; a cancellation the client chose; or, only when its
//! decode node was the one killed, a typed UNAVAILABLE/ABORTED status. Anything else (INTERNAL, a hang
//! past the per-request bound, a wrong greedy answer) fails the soak.

use std::sync::{Arc, Mutex};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tandem_engine::Engine;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::cluster::{Cluster, ClusterSpec, START, node_args};
use tandem_tests::process::Proc;
use tandem_tests::smollm2_dir;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;

const PREFIX: &str = "/tandem-soak";
/// How long one request may take, from send to its last message, on a loaded 2-core machine.
const REQUEST_BOUND: Duration = Duration::from_secs(120);
/// Greedy prompts whose output is checked against the single-process reference.
const GREEDY_PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain in one sentence why the sky is blue.",
];
const GREEDY_MAX_TOKENS: usize = 12;
/// How much a surviving process's resident memory may grow between the end of the warm-up (a tenth
/// of the requests) and the end of the soak: 25 % plus 64 MiB, plus, for a node, its KV pool (the
/// harness gives each 256 MiB), whose pages become resident as blocks are first written — a pool
/// warming up, not a leak. A per-request leak would have to exceed ~400 KiB a request to cross the
/// bound at the CI length, ~6 KiB at 10,000 requests.
const RSS_GROWTH_FACTOR: f64 = 1.25;
const RSS_GROWTH_SLACK_KIB: u64 = 64 * 1024;
const KV_POOL_KIB: u64 = 256 * 1024;

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a count")),
        Err(_) => default,
    }
}

/// Resident set size of a process, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// One request's shape, drawn from the seed.
#[derive(Debug, Clone)]
struct Shape {
    prompt: String,
    /// Index into GREEDY_PROMPTS when the output is checked.
    greedy: Option<usize>,
    max_tokens: u32,
    temperature: f32,
    seed: u64,
    /// Drop the stream after this many messages.
    cancel_after: Option<usize>,
}

const WORDS: [&str; 16] = [
    "river", "stone", "quiet", "lantern", "orbit", "maple", "signal", "copper", "harbor", "violet", "engine",
    "meadow", "thunder", "paper", "glacier", "whisper",
];

fn draw(rng: &mut SmallRng) -> Shape {
    if rng.random_range(0..4) == 0 {
        let i = rng.random_range(0..GREEDY_PROMPTS.len());
        return Shape {
            prompt: GREEDY_PROMPTS[i].to_string(),
            greedy: Some(i),
            max_tokens: GREEDY_MAX_TOKENS as u32,
            temperature: 0.0,
            seed: 0,
            cancel_after: None,
        };
    }
    // Mostly short prompts, sometimes a few hundred tokens (remote prefill, several blocks).
    let words = if rng.random_range(0..5) == 0 { rng.random_range(100..400) } else { rng.random_range(1..60) };
    let prompt = (0..words).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ");
    Shape {
        prompt,
        greedy: None,
        max_tokens: rng.random_range(1..24),
        temperature: rng.random_range(0.0..1.2),
        seed: rng.random(),
        cancel_after: (rng.random_range(0..5) == 0).then(|| rng.random_range(0..4)),
    }
}

#[derive(Debug, Default)]
struct Tally {
    completed: AtomicUsize,
    cancelled: AtomicUsize,
    /// Ended by a killed decode node (typed UNAVAILABLE / ABORTED).
    lost_to_kill: AtomicUsize,
    greedy_checked: AtomicUsize,
}

enum Outcome {
    Done(Vec<u32>),
    Cancelled,
    Failed(tonic::Status),
}

async fn run_one(client: &mut TandemClient<Channel>, shape: &Shape) -> Outcome {
    let req = api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text(shape.prompt.clone())),
        sampling: Some(api::SamplingParams {
            max_tokens: Some(shape.max_tokens),
            temperature: Some(shape.temperature),
            seed: Some(shape.seed),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => return Outcome::Failed(s),
    };
    let mut ids = Vec::new();
    let mut messages = 0;
    while let Some(msg) = stream.next().await {
        match msg {
            Ok(m) => {
                ids.extend(m.token_ids);
                messages += 1;
                if shape.cancel_after.is_some_and(|n| messages > n) {
                    return Outcome::Cancelled; // dropping the stream cancels it on every node
                }
            }
            Err(s) => return Outcome::Failed(s),
        }
    }
    Outcome::Done(ids)
}

fn reference() -> Vec<Vec<u32>> {
    let mut engine = Engine::load(&smollm2_dir(), EngineConfig::default()).expect("load");
    GREEDY_PROMPTS
        .iter()
        .map(|p| {
            let params = SamplingParams { max_tokens: GREEDY_MAX_TOKENS, temperature: 0.0, ..SamplingParams::default() };
            engine.generate(&Prompt::Text(p.to_string()), params).expect("generate").remove(0).token_ids
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_random_requests_cancellations_and_node_restarts() {
    let total = env_usize("TANDEM_SOAK_REQUESTS", 160);
    let clients = env_usize("TANDEM_SOAK_CLIENTS", 8).max(1);
    let kill_every = env_usize("TANDEM_SOAK_KILL_EVERY", 50).max(1);
    let seed = env_usize("TANDEM_SOAK_SEED", 1) as u64;
    let expected = Arc::new(tokio::task::spawn_blocking(reference).await.expect("reference"));

    let cluster = Cluster::start(
        PREFIX,
        ClusterSpec { prefills: 1, decodes: 2, decode_extra: &[], router_extra: &[], http: false, env: &[] },
    );
    let endpoint = cluster.etcd.endpoint();
    let model = smollm2_dir().to_str().expect("UTF-8 model path").to_string();
    let addr = cluster.addr.clone();
    let router_pid = cluster.router.pid();
    let survivor_pid = cluster.decode[0].pid(); // never killed
    let mut nodes = cluster.membership().await;
    let cluster = Arc::new(Mutex::new(cluster));
    tokio::time::timeout(Duration::from_secs(30), nodes.wait_for(|ns| ns.len() == 3))
        .await
        .expect("3 nodes join")
        .expect("membership watch");

    let mut rng = SmallRng::seed_from_u64(seed);
    let shapes: Arc<Vec<Shape>> = Arc::new((0..total).map(|_| draw(&mut rng)).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Tally::default());
    let warm_rss: Arc<std::sync::Mutex<Option<(u64, u64)>>> = Arc::default();
    // Which decode node was killed last (its in-flight requests may end UNAVAILABLE).
    let kills = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();

    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (shapes, next, tally, expected, cluster, kills, warm_rss) =
            (shapes.clone(), next.clone(), tally.clone(), expected.clone(), cluster.clone(), kills.clone(), warm_rss.clone());
        let (addr, endpoint, model) = (addr.clone(), endpoint.clone(), model.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = TandemClient::connect(format!("http://{addr}")).await.expect("router");
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= shapes.len() {
                    return;
                }
                if i == shapes.len() / 10 {
                    *warm_rss.lock().unwrap() = Some((rss_kib(router_pid), rss_kib(survivor_pid)));
                }
                if i > 0 && i % kill_every == 0 {
                    // Round r kills the prefill node when r is even, the second decode node when odd;
                    // the other clients keep sending meanwhile.
                    let round = kills.fetch_add(1, Ordering::SeqCst);
                    let (cluster, endpoint, model) = (cluster.clone(), endpoint.clone(), model.clone());
                    tokio::task::spawn_blocking(move || {
                        let mut c = cluster.lock().unwrap();
                        if round % 2 == 0 {
                            c.prefill[0].kill();
                            c.prefill[0] = Proc::start("prefill0", &node_args("prefill", &endpoint, PREFIX, &model, &[]));
                            c.prefill[0].wait_serving(START);
                        } else {
                            c.decode[1].kill();
                            let extra = ["--local-prefill-below", "0"];
                            c.decode[1] = Proc::start("decode1", &node_args("decode", &endpoint, PREFIX, &model, &extra));
                            c.decode[1].wait_serving(START);
                        }
                    })
                    .await
                    .expect("restart");
                }
                let shape = &shapes[i];
                let kills_before = kills.load(Ordering::SeqCst);
                let outcome = tokio::time::timeout(REQUEST_BOUND, run_one(&mut client, shape))
                    .await
                    .unwrap_or_else(|_| panic!("request {i} ({shape:?}) took longer than {REQUEST_BOUND:?}"));
                match outcome {
                    Outcome::Done(ids) => {
                        tally.completed.fetch_add(1, Ordering::Relaxed);
                        if let Some(g) = shape.greedy {
                            assert_eq!(ids, expected[g], "request {i}: greedy {:?} differs from the reference", shape.prompt);
                            tally.greedy_checked.fetch_add(1, Ordering::Relaxed);
                        } else {
                            assert!(ids.len() <= shape.max_tokens as usize, "request {i}: {} tokens for max {}", ids.len(), shape.max_tokens);
                        }
                    }
                    Outcome::Cancelled => {
                        tally.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::Failed(s) => {
                        // Only a decode node's death (a kill during or just before this request, or a
                        // node the router had not yet learned was dead) may end a request.
                        let kills_after = kills.load(Ordering::SeqCst);
                        let last_was_decode = kills_before > 0 && (kills_before - 1) % 2 == 1;
                        let decode_killed = last_was_decode || (kills_before..kills_after).any(|r| r % 2 == 1);
                        assert!(
                            matches!(s.code(), Code::Unavailable | Code::Aborted) && decode_killed,
                            "request {i} ({shape:?}) failed: {s:?}"
                        );
                        tally.lost_to_kill.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("a client panicked");
    }
    let elapsed = started.elapsed();

    // Every node, restarted ones included, ends with all its blocks free and nothing running.
    tandem_tests::cluster::wait_all_blocks_free(&mut nodes, 3, Duration::from_secs(60)).await;
    let (router_warm, survivor_warm) = warm_rss.lock().unwrap().expect("warm-up RSS taken");
    for (what, pid, warm, pool) in
        [("router", router_pid, router_warm, 0), ("decode0", survivor_pid, survivor_warm, KV_POOL_KIB)]
    {
        let now = rss_kib(pid);
        let bound = (warm as f64 * RSS_GROWTH_FACTOR) as u64 + RSS_GROWTH_SLACK_KIB + pool;
        eprintln!("soak: {what} RSS {warm} KiB after warm-up, {now} KiB at the end (bound {bound} KiB)");
        assert!(now <= bound, "{what} grew from {warm} KiB to {now} KiB (bound {bound} KiB)");
    }
    let t = &tally;
    let (done, cancelled, lost, greedy) = (
        t.completed.load(Ordering::Relaxed),
        t.cancelled.load(Ordering::Relaxed),
        t.lost_to_kill.load(Ordering::Relaxed),
        t.greedy_checked.load(Ordering::Relaxed),
    );
    eprintln!(
        "soak: {total} requests in {elapsed:.1?} with {clients} clients: {done} completed ({greedy} greedy checked), \
         {cancelled} cancelled, {lost} ended by a killed decode node; {} node restarts",
        kills.load(Ordering::SeqCst)
    );
    assert_eq!(done + cancelled + lost, total);
    assert!(greedy > 0, "no greedy request completed");
}
