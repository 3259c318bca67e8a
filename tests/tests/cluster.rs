//! The cluster end to end with real processes: etcd (Debian's etcd-server on random loopback ports), a
//! router, prefill and decode nodes started from the `tandem` binary, gRPC clients. Greedy output through
//! the cluster equals a single process's; cancellation, node deaths and an etcd restart leave no hang and
//! no leaked block; bad input gets typed statuses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::Engine;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_membership::{Membership, NodeInfo, NodeRole};
use tandem_proto::node::v1 as node;
use tandem_proto::node::v1::decode_client::DecodeClient;
use tandem_proto::node::v1::prefill_client::PrefillClient;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::etcd::{DataDir, EtcdServer};
use tandem_tests::process::Proc;
use tandem_tests::cluster::{Cluster, ClusterSpec, START};
use tandem_tests::{run_tandem, smollm2_dir};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const PREFIX: &str = "/tandem-test";
/// How long a node's log line may take to reach the test after the response did.
const WAIT_LOG: Duration = Duration::from_secs(5);

fn start(prefills: usize, decodes: usize, decode_extra: &[&str]) -> Cluster {
    start_with(prefills, decodes, decode_extra, &[])
}

fn start_with(prefills: usize, decodes: usize, decode_extra: &[&str], router_extra: &[&str]) -> Cluster {
    Cluster::start(PREFIX, ClusterSpec { prefills, decodes, decode_extra, router_extra, http: false, env: &[] })
}

/// What these tests ask of a cluster beyond the shared harness: gRPC clients and health.
trait ClusterExt {
    async fn client(&self) -> TandemClient<Channel>;
    /// Waits until the router sees the expected number of nodes per role.
    async fn wait_health(&self, prefill: u32, decode: u32);
}

impl ClusterExt for Cluster {
    async fn client(&self) -> TandemClient<Channel> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match TandemClient::connect(format!("http://{}", self.addr)).await {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => panic!("router unreachable: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    async fn wait_health(&self, prefill: u32, decode: u32) {
        let mut client = self.client().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(h) = client.health(api::HealthRequest {}).await {
                let h = h.into_inner();
                if h.prefill_nodes == prefill && h.decode_nodes == decode {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "router never saw {prefill} prefill + {decode} decode nodes");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Waits until every node in membership reports all its KV blocks free.
async fn wait_all_blocks_free(nodes: &mut tokio::sync::watch::Receiver<Vec<NodeInfo>>, expect_nodes: usize) {
    tandem_tests::cluster::wait_all_blocks_free(nodes, expect_nodes, Duration::from_secs(20)).await;
}

fn greedy(max_tokens: u32) -> api::SamplingParams {
    api::SamplingParams { max_tokens: Some(max_tokens), temperature: Some(0.0), ..Default::default() }
}

fn text_request(prompt: &str, max_tokens: u32) -> api::GenerateRequest {
    api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text(prompt.into())),
        sampling: Some(greedy(max_tokens)),
        ..Default::default()
    }
}

async fn collect(client: &mut TandemClient<Channel>, req: api::GenerateRequest) -> Result<(String, Vec<u32>, api::Usage), tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let (mut text, mut ids, mut usage) = (String::new(), Vec::new(), None);
    while let Some(msg) = stream.next().await {
        let msg = msg?;
        text.push_str(&msg.text);
        ids.extend(msg.token_ids);
        if msg.usage.is_some() {
            usage = msg.usage;
        }
    }
    Ok((text, ids, usage.expect("the last message carries usage")))
}

/// Greedy completions of `prompts` from one in-process engine, the single-process reference.
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

fn generate_stdout(args: &[&str]) -> String {
    let out = run_tandem(args, Duration::from_secs(300));
    assert!(out.status.success(), "tandem {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn cluster_output_equals_generate_through_the_cli() {
    let cluster = start(1, 1, &[]);
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let long = "Tell me everything about the history of the Roman Empire, its emperors, its wars and its fall. ".repeat(8);
    for (prompt, chat) in [("The capital of France is", false), ("What is 2 + 2?", true), (long.as_str(), false)] {
        let mut args = vec!["--max-tokens", "24", prompt];
        if chat {
            args.insert(0, "--chat");
        }
        let mut gen_args = vec!["generate", "--model", model];
        gen_args.extend_from_slice(&args);
        let mut client_args = vec!["client", "--router", cluster.addr.as_str()];
        client_args.extend_from_slice(&args);
        let expected = generate_stdout(&gen_args);
        let got = generate_stdout(&client_args);
        assert_eq!(got.trim_end(), expected.trim_end(), "prompt {prompt:?}");
    }
    assert!(cluster.prefill[0].stderr_shows("transfer_bytes", WAIT_LOG), "not prefilled remotely:\n{}", cluster.prefill[0].stderr());
    assert!(cluster.decode[0].stderr_shows("decode done", WAIT_LOG), "{}", cluster.decode[0].stderr());
    drop(cluster);
}

#[test]
fn embedded_cluster_answers_like_generate() {
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let expected = generate_stdout(&["generate", "--model", model, "--max-tokens", "20", "Once upon a time"]);
    let out = generate_stdout(&["up", "--model", model, "--listen", "127.0.0.1:0", "--max-tokens", "20", "--prompt", "Once upon a time"]);
    let mut lines = out.lines();
    assert!(lines.next().unwrap().starts_with("tandem up: serving on 127.0.0.1:"), "{out}");
    let answer: Vec<&str> = lines.collect();
    assert_eq!(answer.join("\n").trim_end(), expected.trim_end());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_clients_get_single_process_output() {
    let cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let prompts: Vec<String> = (0..32).map(|i| format!("Question {i}: name a color and explain why number {} is interesting.", i * 7)).collect();
    let expected = tokio::task::spawn_blocking({
        let prompts = prompts.clone();
        move || reference(&prompts, 12)
    });
    let mut tasks = Vec::new();
    for p in &prompts {
        let mut client = cluster.client().await;
        let req = text_request(p, 12);
        tasks.push(tokio::spawn(async move { collect(&mut client, req).await }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap().expect("request failed").1);
    }
    let expected = expected.await.unwrap();
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "prompt {i}");
    }
    let mut nodes = cluster.membership().await;
    wait_all_blocks_free(&mut nodes, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_a_stream_frees_every_block_on_both_nodes() {
    let cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let mut req = text_request("Write a very long story about a dragon who learns to code.", 400);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = client.generate(req).await.expect("start").into_inner();
    for _ in 0..3 {
        stream.next().await.expect("a token").expect("ok");
    }
    drop(stream);
    let mut nodes = cluster.membership().await;
    wait_all_blocks_free(&mut nodes, 2).await;
    let log = cluster.decode[0].stderr();
    assert!(!log.contains("decode done"), "the request ran to its end instead of being aborted");
    // The cluster still serves.
    let (text, _, _) = collect(&mut client, text_request("Hello", 4)).await.expect("after a cancel");
    assert!(!text.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefill_node_killed_mid_request_still_completes() {
    let mut cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let prompt = "Summarise the following text in one sentence. ".repeat(60);
    let expected = tokio::task::spawn_blocking({
        let p = prompt.clone();
        move || reference(&[p], 8)
    });
    let mut client = cluster.client().await;
    let req = text_request(&prompt, 8);
    let call = tokio::spawn(async move { collect(&mut client, req).await });
    // The long prompt keeps the prefill node busy; kill it while it works.
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.prefill[0].kill();
    let (_, ids, _) = tokio::time::timeout(Duration::from_secs(60), call).await.expect("no hang").unwrap().expect("request completes");
    assert_eq!(ids, expected.await.unwrap()[0]);
    // The decode node learns of the dead prefill node from the failed call, not by waiting for
    // the transfer's 30 s deadline (which would log "timed out"). Asserted on the cause rather than
    // on the elapsed time, which a loaded machine stretches.
    let log = cluster.decode[0].stderr();
    assert!(log.contains("remote prefill failed"), "the decode node did not fall back:\n{log}");
    assert!(!log.contains("timed out"), "the decode node waited for the transfer's deadline:\n{log}");
    let mut nodes = cluster.membership().await;
    wait_all_blocks_free(&mut nodes, 1).await; // the dead prefill node's lease expired
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_node_killed_gives_a_prompt_error_and_leaves_routing() {
    let mut cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let mut req = text_request("Count slowly from one to one thousand.", 400);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = client.generate(req).await.expect("start").into_inner();
    stream.next().await.expect("a token").expect("ok");
    cluster.decode[0].kill();
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.next().await {
                Some(Ok(_)) => continue,
                Some(Err(s)) => return s,
                None => panic!("the stream ended cleanly although its decode node died"),
            }
        }
    })
    .await
    .expect("the client learns promptly");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // The next request is not sent to the dead node: with no decode node left it is UNAVAILABLE at once.
    let t = Instant::now();
    let s = collect(&mut client, text_request("Hello", 4)).await.expect_err("no decode node");
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
    cluster.wait_health(1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_come_back_after_an_etcd_restart() {
    let mut cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    cluster.etcd.restart(DataDir::Wipe); // a fresh etcd: every key and lease is gone
    // The nodes notice and register again in the new etcd...
    let mut fresh = cluster.membership().await;
    tokio::time::timeout(Duration::from_secs(30), fresh.wait_for(|ns| ns.len() == 2))
        .await
        .expect("both nodes re-register after the restart")
        .expect("watch");
    // ...and the router, which re-lists after losing its watch, routes to them.
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let (text, _, _) = collect(&mut client, text_request("The sky is", 6)).await.expect("served after the restart");
    assert!(!text.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_typed_statuses() {
    let cluster = start(0, 1, &["--kv-cache-mib", "2"]);
    cluster.wait_health(0, 1).await;
    let mut client = cluster.client().await;
    let code = |r: Result<(String, Vec<u32>, api::Usage), tonic::Status>| r.expect_err("must fail").code();
    assert_eq!(code(collect(&mut client, text_request("", 4)).await), Code::InvalidArgument, "empty prompt");
    let mut r = text_request("hi", 4);
    r.prompt = None;
    assert_eq!(code(collect(&mut client, r).await), Code::InvalidArgument, "no prompt");
    assert_eq!(code(collect(&mut client, text_request("hi", 100_000)).await), Code::InvalidArgument, "over the context");
    let mut r = text_request("hi", 4);
    r.sampling.as_mut().unwrap().temperature = Some(-1.0);
    assert_eq!(code(collect(&mut client, r).await), Code::InvalidArgument, "bad temperature");
    let mut r = text_request("hi", 4);
    r.model = "no-such-model".into();
    assert_eq!(code(collect(&mut client, r).await), Code::NotFound, "unknown model");
    let mut r = text_request("hi", 4);
    r.prompt = Some(api::generate_request::Prompt::TokenIds(api::TokenIds { ids: vec![1, 999_999_999] }));
    assert_eq!(code(collect(&mut client, r).await), Code::InvalidArgument, "token id outside the vocabulary");
    // 2 MiB of KV holds two blocks (32 tokens): a longer prompt can never fit.
    let long = "word ".repeat(200);
    assert_eq!(code(collect(&mut client, text_request(&long, 4)).await), Code::ResourceExhausted, "over capacity");
    // Without prefill nodes the decode node prefills itself.
    let (text, _, _) = collect(&mut client, text_request("Hi", 3)).await.expect("local prefill");
    assert!(!text.is_empty());
    let mut nodes = cluster.membership().await;
    wait_all_blocks_free(&mut nodes, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_nodes_is_unavailable() {
    let etcd = EtcdServer::start();
    let mut router = Proc::start("router", &["router", "--etcd", &etcd.endpoint(), "--cluster-prefix", "/empty", "--listen", "127.0.0.1:0"]);
    let addr = router.wait_serving(START);
    let mut client = TandemClient::connect(format!("http://{addr}")).await.unwrap();
    let s = collect(&mut client, text_request("hi", 3)).await.expect_err("no nodes");
    assert_eq!(s.code(), Code::Unavailable);
    let h = client.health(api::HealthRequest {}).await.unwrap().into_inner();
    assert!(!h.serving);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn logprobs_cover_every_token_including_the_remotely_sampled_first() {
    let cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let mut req = text_request("The three primary colors are", 6);
    req.sampling.as_mut().unwrap().logprobs = Some(3);
    let mut stream = client.generate(req).await.expect("start").into_inner();
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    while let Some(msg) = stream.next().await {
        let msg = msg.expect("ok");
        ids.extend(msg.token_ids);
        lps.extend(msg.logprobs);
    }
    assert_eq!(ids.len(), 6);
    assert_eq!(lps.len(), ids.len(), "one logprob entry per token");
    for (id, lp) in ids.iter().zip(&lps) {
        assert_eq!(lp.token_id, *id);
        assert_eq!(lp.top.len(), 3);
        assert!(lp.logprob <= 0.0 && lp.top[0].logprob >= lp.top[2].logprob);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top[0].token_id, *id);
    }
    assert!(cluster.prefill[0].stderr_shows("prefill done", WAIT_LOG), "the first token was sampled remotely");
    // The unary form answers the same completion in one message.
    let (streamed, _, _) = collect(&mut client, text_request("The three primary colors are", 6)).await.expect("stream");
    let unary = client.generate_unary(text_request("The three primary colors are", 6)).await.expect("unary").into_inner();
    assert_eq!(unary.text, streamed);
    assert_eq!(unary.token_ids, ids);
    assert_eq!(unary.finish_reason, api::FinishReason::Length as i32);
    assert_eq!(unary.usage.map(|u| u.completion_tokens), Some(6));
    // ListModels names the served model with its nodes and context limit.
    let models = client.list_models(api::ListModelsRequest {}).await.expect("list").into_inner().models;
    assert_eq!(models.len(), 1, "{models:?}");
    assert_eq!(models[0].id, "smollm2-135m-instruct");
    assert_eq!((models[0].prefill_nodes, models[0].decode_nodes), (1, 1));
    assert_eq!(models[0].max_model_len, 8192);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_uncached_prompts_are_prefilled_on_the_decode_node() {
    let cluster = start(1, 1, &["--local-prefill-below", "1000"]);
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let prompt = "Name a fruit.";
    let (_, ids, _) = collect(&mut client, text_request(prompt, 6)).await.expect("served");
    let expected = tokio::task::spawn_blocking(move || reference(&[prompt.to_string()], 6)).await.unwrap();
    assert_eq!(ids, expected[0]);
    assert!(cluster.decode[0].stderr_shows("prefill=local", WAIT_LOG), "{}", cluster.decode[0].stderr());
    assert!(!cluster.prefill[0].stderr().contains("prefill done"), "a short prompt went to the prefill node");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_drains_a_decode_node() {
    let mut cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let mut req = text_request("Describe the sea in detail.", 48);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = client.generate(req).await.expect("start").into_inner();
    // Terminate once the decode node is streaming the request (a fixed sleep raced a loaded machine).
    let first = stream.next().await.expect("a token").expect("ok");
    let decode = &mut cluster.decode[0];
    let exited_cleanly = tokio::task::block_in_place(|| decode.terminate(Duration::from_secs(30)));
    let (mut ids, mut usage) = (first.token_ids, first.usage);
    while let Some(msg) = stream.next().await {
        let msg = msg.expect("the in-flight request finishes during the drain");
        ids.extend(msg.token_ids);
        usage = usage.or(msg.usage);
    }
    assert_eq!(ids.len(), 48);
    assert_eq!(usage.expect("usage").completion_tokens, 48);
    assert!(exited_cleanly, "the decode node did not exit cleanly after SIGTERM");
    cluster.wait_health(1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefix_aware_routing_prefers_the_cached_prefix_over_the_idle_node() {
    let cluster = start_with(1, 2, &[], &["--policy", "prefix-aware"]);
    cluster.wait_health(1, 2).await;
    let mut nodes = cluster.membership().await;
    let mut client = cluster.client().await;
    let document = "You are a careful assistant. Here is a long shared document about ships and harbours. ".repeat(6);
    let ask = |q: &str, n: u32| text_request(&format!("{document}{q}"), n);
    let (_, _, first) = collect(&mut client, ask("Who built the first harbour?", 4)).await.expect("served");
    assert_eq!(first.cached_tokens, 0, "nothing is cached before the first request");
    let deadline = Instant::now() + WAIT_LOG;
    let holder = loop {
        if let Some(i) = cluster.decode.iter().position(|d| d.stderr().contains("decode done")) {
            break i;
        }
        assert!(Instant::now() < deadline, "no decode node logged the first request");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Make the node holding the document the busy one, and let its load reach the router: least load
    // would now pick the other node, prefix-aware must still pick the holder.
    wait_all_blocks_free(&mut nodes, 3).await;
    let mut busy_client = cluster.client().await;
    let mut long = ask("Tell an endless story about the sea.", 300);
    long.sampling.as_mut().unwrap().ignore_eos = true;
    let mut busy = busy_client.generate(long).await.expect("start").into_inner();
    busy.next().await.expect("a token").expect("ok");
    let busy_node = tokio::time::timeout(Duration::from_secs(10), nodes.wait_for(|ns| ns.iter().any(|n| n.load.running > 0)))
        .await
        .expect("the busy node's load is published")
        .expect("watch")
        .iter()
        .find(|n| n.load.running > 0)
        .map(|n| n.grpc_addr.clone())
        .unwrap();
    assert_eq!(busy_node, cluster.decode_addrs[holder], "the busy request did not go to the document's holder");
    let (_, _, second) = collect(&mut client, ask("Name a famous ship.", 4)).await.expect("served");
    assert!(second.cached_tokens >= 64, "the follow-up missed the cached prefix: {second:?}");
    drop(busy);
}

/// How the fake prefill node below misbehaves.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Evil {
    /// Has the real prefill node compute another prompt into the caller's blocks.
    OtherPrompt,
    /// The same, with the descriptor's binding rewritten to match the other prompt.
    OtherPromptRebound,
    /// Forwards honestly, then answers a first token outside the vocabulary.
    BadFirstToken,
}

/// A prefill "node" run by an attacker who got it into membership (etcd has no credentials yet): it
/// relays each call to the real prefill node, tampered with as `mode` says.
#[derive(Clone)]
struct EvilPrefill {
    real: String,
    block_size: usize,
    mode: Arc<std::sync::Mutex<Evil>>,
    calls: Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl tandem_proto::node::v1::prefill_server::Prefill for EvilPrefill {
    async fn prefill(&self, request: tonic::Request<node::PrefillRequest>) -> Result<tonic::Response<node::PrefillResponse>, tonic::Status> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mode = *self.mode.lock().unwrap();
        let mut req = request.into_inner();
        if mode != Evil::BadFirstToken {
            req.prompt[3] ^= 1;
        }
        if mode == Evil::OtherPromptRebound {
            req.kv.as_mut().unwrap().binding = tandem_node::kv::kv_binding(&req.prompt, req.skip_blocks as usize, self.block_size);
        }
        let mut real = PrefillClient::connect(format!("http://{}", self.real)).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut answer = real.prefill(req).await?.into_inner();
        if mode == Evil::BadFirstToken {
            answer.first_token = 49152;
        }
        Ok(tonic::Response::new(answer))
    }

    async fn info(&self, _: tonic::Request<node::InfoRequest>) -> Result<tonic::Response<node::InfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("evil"))
    }
}

async fn decode_directly(addr: &str, prompt: &[u32], prefill_addr: &str, max_tokens: u32) -> Result<Vec<u32>, tonic::Status> {
    let mut client = DecodeClient::connect(format!("http://{addr}")).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let req = node::DecodeRequest { request_id: "evil".into(), prompt: prompt.to_vec(), sampling: Some(greedy(max_tokens)), prefill_addr: prefill_addr.into(), ..Default::default() };
    let mut stream = client.generate(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(msg) = stream.next().await {
        ids.extend(msg?.token_ids);
    }
    Ok(ids)
}

/// Found when tried as a hostile client would: a caller of a decode node's `Generate` could name its
/// own prefill node, have the real one fill the victim's blocks with another prompt's KV (which then
/// stayed cached under the victim's prompt), or answer a first token outside the vocabulary (which
/// failed every stream on the node). Now: an unlisted prefill address is never called; KV computed for
/// another prompt is refused by the prefill node or, rebound, by the receiver before any block lands; a
/// bad answer falls back to local prefill for that request alone; and afterwards the victim's prompt
/// gets exactly the single-process answer from a prefix cache holding only its own KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_prefill_peers_cannot_poison_the_cache_or_fail_other_requests() {
    let cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let nodes = cluster.membership().await;
    let real = nodes.borrow().iter().find(|n| n.role == tandem_membership::NodeRole::Prefill).cloned().expect("the prefill node");
    let decode_addr = cluster.decode_addrs[0].clone();
    let victim_text = "What is the capital of France? Answer with the name of the city only, nothing else.";
    let (victim, expected, others_expected) = tokio::task::spawn_blocking(move || {
        let mut engine = Engine::load(&smollm2_dir(), EngineConfig::default()).expect("load");
        let ids = engine.tokenize(&Prompt::Text(victim_text.into())).expect("tokenize");
        let params = SamplingParams { max_tokens: 8, temperature: 0.0, ..SamplingParams::default() };
        let expected = engine.generate(&Prompt::Tokens(ids.clone()), params.clone()).expect("generate").remove(0).token_ids;
        let others = (0..4).map(|i| engine.generate(&Prompt::Text(format!("Bystander {i}: list three animals.")), params.clone()).expect("generate").remove(0).token_ids).collect::<Vec<_>>();
        (ids, expected, others)
    })
    .await
    .unwrap();
    assert!(victim.len() > 16, "the prompt spans more than one block");

    // An address membership does not list is never called: the decode node prefills locally.
    let evil = EvilPrefill {
        real: real.grpc_addr.clone(),
        block_size: 16,
        mode: Arc::new(std::sync::Mutex::new(Evil::OtherPrompt)),
        calls: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let evil_addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(tandem_proto::node::v1::prefill_server::PrefillServer::new(evil.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let ids = decode_directly(&decode_addr, &victim, &evil_addr, 8).await.expect("served locally");
    assert_eq!(ids, expected);
    assert_eq!(evil.calls.load(std::sync::atomic::Ordering::SeqCst), 0, "an unlisted prefill address was called");
    assert!(cluster.decode[0].stderr_shows("remote_prefill=unlisted", WAIT_LOG), "{}", cluster.decode[0].stderr());

    // Now the attacker writes its node into membership, as anyone could with etcd unauthenticated.
    let membership = Membership::etcd(&[cluster.etcd.endpoint()], PREFIX, Default::default()).await.expect("etcd");
    let fake = NodeInfo { id: "prefill-evil".into(), grpc_addr: evil_addr.clone(), kv_endpoint: "tcp://127.0.0.1:9".into(), ..real.clone() };
    let registration = membership.register(fake).await.expect("register the fake node");
    for (round, mode) in [Evil::OtherPrompt, Evil::OtherPromptRebound, Evil::BadFirstToken].into_iter().enumerate() {
        *evil.mode.lock().unwrap() = mode;
        // Bystanders stream through the router meanwhile: none of them may fail.
        let mut bystanders = Vec::new();
        for i in 0..4 {
            let mut client = cluster.client().await;
            let req = text_request(&format!("Bystander {i}: list three animals."), 8);
            bystanders.push(tokio::spawn(async move { collect(&mut client, req).await }));
        }
        let ids = decode_directly(&decode_addr, &victim, &evil_addr, 8).await.unwrap_or_else(|s| panic!("{mode:?}: the attacked request failed: {s:?}"));
        assert_eq!(ids, expected, "{mode:?}: the attacked request must still get the right answer");
        assert!(evil.calls.load(std::sync::atomic::Ordering::SeqCst) > round, "{mode:?}: the listed fake node was not called");
        for (i, b) in bystanders.into_iter().enumerate() {
            let (_, ids, _) = b.await.unwrap().unwrap_or_else(|s| panic!("{mode:?}: bystander {i} failed: {s:?}"));
            assert_eq!(ids, others_expected[i], "{mode:?}: bystander {i}");
        }
    }
    let log = cluster.decode[0].stderr();
    assert!(log.contains("bound to another prompt"), "the prefill node did not refuse the other prompt:\n{log}");
    assert!(log.contains("bound to other content"), "the receiver did not refuse the rebound KV:\n{log}");
    assert!(log.contains("answer is invalid"), "the bad first token was not caught:\n{log}");
    registration.deregister().await.expect("deregister");

    // The victim, through the router: the cached prefix holds its own KV only.
    let mut client = cluster.client().await;
    let req = api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::TokenIds(api::TokenIds { ids: victim.clone() })),
        sampling: Some(greedy(8)),
        ..Default::default()
    };
    let (_, ids, usage) = collect(&mut client, req).await.expect("victim served");
    assert_eq!(ids, expected, "the victim got another prompt's answer: the prefix cache was poisoned");
    assert!(usage.cached_tokens >= 16, "the victim's prompt should be served from the cache: {usage:?}");
    let mut nodes = cluster.membership().await;
    wait_all_blocks_free(&mut nodes, 2).await;
}

/// Operators (and soak tests) read a node's blocks and queues from its `Info`, not only from etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_info_reports_blocks_queues_and_backend() {
    let cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let mut node = DecodeClient::connect(format!("http://{}", cluster.decode_addrs[0])).await.expect("decode node");
    let info = node.info(node::InfoRequest {}).await.expect("info").into_inner();
    let load = info.load.expect("load");
    assert_eq!(info.kv_backend, "tcp");
    assert!(load.total_blocks > 0);
    assert_eq!((load.free_blocks, load.running, load.waiting), (load.total_blocks, 0, 0), "idle: {load:?}");
    let mut client = cluster.client().await;
    let mut req = text_request("Write a very long story about a lighthouse keeper.", 300);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = client.generate(req).await.expect("start").into_inner();
    stream.next().await.expect("a token").expect("ok");
    let busy = node.info(node::InfoRequest {}).await.expect("info").into_inner().load.expect("load");
    assert_eq!(busy.running, 1, "{busy:?}");
    assert!(busy.free_blocks < busy.total_blocks, "{busy:?}");
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let l = node.info(node::InfoRequest {}).await.expect("info").into_inner().load.expect("load");
        if l.running == 0 && l.free_blocks == l.total_blocks {
            break;
        }
        assert!(Instant::now() < deadline, "blocks not freed after the client left: {l:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Logs read well where they go: no colour codes when stderr is not a terminal, durations rounded,
/// and one JSON object per line with `TANDEM_LOG_FORMAT=json`.
#[test]
fn logs_are_plain_rounded_or_json() {
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let args = ["up", "--model", model, "--listen", "127.0.0.1:0", "--max-tokens", "4", "--prompt", "Hello there"];
    let out = tandem_tests::run_tandem_env(&args, &[("TANDEM_LOG", "info")], Duration::from_secs(300));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains('\u{1b}'), "colour codes in a piped log:\n{err}");
    let line = err.lines().find(|l| l.contains("decode done")).unwrap_or_else(|| panic!("no decode line:\n{err}"));
    let ttft = line.split("ttft_ms=").nth(1).and_then(|r| r.split_whitespace().next()).expect("ttft_ms field");
    let decimals = ttft.split('.').nth(1).map_or(0, str::len);
    assert!(decimals <= 2, "ttft_ms={ttft} is not rounded: {line}");
    let out = tandem_tests::run_tandem_env(&args, &[("TANDEM_LOG", "info"), ("TANDEM_LOG_FORMAT", "json")], Duration::from_secs(300));
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let mut seen = 0;
    for l in err.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        if v["fields"]["message"] == "decode done" {
            assert!(v["fields"]["ttft_ms"].is_number(), "{l}");
            seen += 1;
        }
    }
    assert_eq!(seen, 1, "one JSON decode line expected:\n{err}");
}

/// A server's status for `service` in the standard gRPC health protocol (`grpc.health.v1`).
async fn health_status(addr: &str, service: &str) -> Result<ServingStatus, tonic::Status> {
    let channel = Channel::from_shared(format!("http://{addr}")).expect("address").connect().await;
    let mut client = HealthClient::new(channel.map_err(|e| tonic::Status::unavailable(e.to_string()))?);
    let status = client.check(HealthCheckRequest { service: service.into() }).await?.into_inner().status;
    Ok(ServingStatus::try_from(status).unwrap_or(ServingStatus::Unknown))
}

/// Waits up to `limit` until `addr` reports `want` for `service`; panics with the last answer otherwise.
async fn wait_health_status(addr: &str, service: &str, want: ServingStatus, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let now = health_status(addr, service).await;
        if now.as_ref().is_ok_and(|s| *s == want) {
            return;
        }
        assert!(Instant::now() < deadline, "{addr} {service:?}: {now:?}, not {want:?} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kubernetes' gRPC probes ask each server's own gRPC port: the router, the prefill and the decode node
/// answer grpc.health.v1 SERVING when up (per service, unknown services NOT_FOUND); a decode node
/// sent SIGTERM answers NOT_SERVING while it finishes its request in flight, and the router's
/// `tandem.v1.Tandem` turns NOT_SERVING once no decode node is left (the router itself stays SERVING).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_health_serving_when_up_and_not_serving_while_a_node_drains() {
    let mut cluster = start(1, 1, &[]);
    cluster.wait_health(1, 1).await;
    let nodes = cluster.membership().await;
    let prefill_addr = nodes.borrow().iter().find(|n| n.role == NodeRole::Prefill).expect("prefill node").grpc_addr.clone();
    let decode_addr = cluster.decode_addrs[0].clone();
    let serving = ServingStatus::Serving;
    wait_health_status(&cluster.addr, "tandem.v1.Tandem", serving, Duration::from_secs(5)).await;
    for (addr, service) in [
        (&cluster.addr, ""),
        (&prefill_addr, ""),
        (&prefill_addr, "tandem.node.v1.Prefill"),
        (&decode_addr, ""),
        (&decode_addr, "tandem.node.v1.Decode"),
    ] {
        assert_eq!(health_status(addr, service).await.expect("health"), serving, "{addr} {service:?}");
    }
    let unknown = health_status(&decode_addr, "tandem.node.v1.Prefill").await.expect_err("not a prefill node");
    assert_eq!(unknown.code(), Code::NotFound);

    let mut client = cluster.client().await;
    let mut req = text_request("Describe the sea in detail.", 200);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = client.generate(req).await.expect("start").into_inner();
    let first = stream.next().await.expect("a token").expect("ok");
    let decode_pid = cluster.decode[0].pid().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &decode_pid]).status().expect("kill").success());
    wait_health_status(&decode_addr, "tandem.node.v1.Decode", ServingStatus::NotServing, Duration::from_secs(5)).await;
    assert_eq!(health_status(&decode_addr, "").await.expect("health while draining"), ServingStatus::NotServing);
    // NOT_SERVING was answered while the request was still running there.
    let mut node = DecodeClient::connect(format!("http://{decode_addr}")).await.expect("the draining node answers");
    let load = node.info(node::InfoRequest {}).await.expect("info while draining").into_inner().load.expect("load");
    assert_eq!(load.running, 1, "the request in flight is still running during the drain: {load:?}");
    wait_health_status(&cluster.addr, "tandem.v1.Tandem", ServingStatus::NotServing, Duration::from_secs(10)).await;
    assert_eq!(health_status(&cluster.addr, "").await.expect("router health"), serving);
    let mut ids = first.token_ids;
    while let Some(msg) = stream.next().await {
        ids.extend(msg.expect("the in-flight request finishes during the drain").token_ids);
    }
    assert_eq!(ids.len(), 200);
    let decode = &mut cluster.decode[0];
    assert!(tokio::task::block_in_place(|| decode.terminate(Duration::from_secs(30))), "the decode node did not exit cleanly");
    assert!(health_status(&decode_addr, "").await.is_err(), "a stopped node still answers");
}

/// `tandem up` answers grpc.health.v1 on its router port, and `--check` validates without serving.
#[test]
fn tandem_up_answers_grpc_health() {
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let mut up = Proc::start("up", &["up", "--model", model, "--listen", "127.0.0.1:0", "--http-listen", "off", "--kv-cache-mib", "256"]);
    let addr = up.wait_serving(START);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        wait_health_status(&addr, "", ServingStatus::Serving, Duration::from_secs(5)).await;
        wait_health_status(&addr, "tandem.v1.Tandem", ServingStatus::Serving, Duration::from_secs(5)).await;
    });
    assert!(up.terminate(Duration::from_secs(30)), "tandem up did not exit cleanly");
    let out = run_tandem(&["up", "--model", model, "--listen", "127.0.0.1:0", "--check"], Duration::from_secs(30));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "tandem up: command line ok");
}

/// The drain is bounded: a decode node given `--drain-timeout 1` exits (cleanly) about a second after
/// SIGTERM even though its request would run far longer; the client's stream ends unfinished.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_ends_at_its_timeout() {
    let mut cluster = start(1, 1, &["--drain-timeout", "1"]);
    cluster.wait_health(1, 1).await;
    let mut client = cluster.client().await;
    let mut req = text_request("Write a very long story about a lighthouse keeper.", 4000);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = client.generate(req).await.expect("start").into_inner();
    let mut tokens = stream.next().await.expect("a token").expect("ok").token_ids.len();
    let decode = &mut cluster.decode[0];
    let asked = Instant::now();
    let exited_cleanly = tokio::task::block_in_place(|| decode.terminate(Duration::from_secs(20)));
    let took = asked.elapsed();
    assert!(exited_cleanly, "the decode node did not exit cleanly:\n{}", decode.stderr());
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(8), "exited {took:?} after SIGTERM");
    assert!(decode.stderr_shows("the drain timed out", WAIT_LOG), "{}", decode.stderr());
    while let Some(Ok(msg)) = stream.next().await {
        tokens += msg.token_ids.len();
    }
    assert!(tokens < 4000, "the request finished ({tokens} tokens) although the drain was cut at 1 s");
}
