//! Request migration end to end (real etcd, router, one prefill and two decode processes, SmolLM2): a
//! decode node killed (SIGKILL) or frozen (SIGSTOP, so it leaves membership) in the middle of a greedy
//! stream hands the stream to the other decode node, and the client's stream — over gRPC and over the
//! OpenAI HTTP API's server-sent events — completes with exactly the tokens and text of an
//! uninterrupted run (and of the model in one process); a draining node's streams are not moved; when
//! every decode node dies the stream ends with UNAVAILABLE after at most `--max-migrations` re-issues.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_engine::Engine;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_proto::node::v1 as node;
use tandem_proto::node::v1::decode_client::DecodeClient;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::cluster::{Cluster, ClusterSpec, START, node_args};
use tandem_tests::http::request;
use tandem_tests::process::Proc;
use tandem_tests::smollm2_dir;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;

const PREFIX: &str = "/tandem-migration";
const PROMPT: &str = "Write a long, detailed story about a lighthouse keeper who finds a map in a bottle.";
/// Long enough that the stream is still running when its node is stopped after `BEFORE` messages.
const MAX_TOKENS: u32 = 96;
const BEFORE: usize = 8;
/// Bounds every wait on the cluster (hang protection, not a timing assertion).
const LIMIT: Duration = Duration::from_secs(120);

fn start(router_extra: &[&str]) -> Cluster {
    Cluster::start(
        PREFIX,
        ClusterSpec { prefills: 1, decodes: 2, router_extra, http: true, env: &[("TANDEM_LOG", "info")], ..Default::default() },
    )
}

async fn client(cluster: &Cluster) -> TandemClient<Channel> {
    let deadline = Instant::now() + LIMIT;
    loop {
        match TandemClient::connect(format!("http://{}", cluster.addr)).await {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("router unreachable: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Waits until the router sees `decode` decode nodes (and one prefill node).
async fn wait_decode_nodes(client: &mut TandemClient<Channel>, decode: u32) {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Ok(h) = client.health(api::HealthRequest {}).await
            && h.get_ref().decode_nodes == decode
            && h.get_ref().prefill_nodes == 1
        {
            return;
        }
        assert!(Instant::now() < deadline, "the router never saw {decode} decode nodes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn greedy_request() -> api::GenerateRequest {
    api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text(PROMPT.into())),
        sampling: Some(api::SamplingParams { max_tokens: Some(MAX_TOKENS), temperature: Some(0.0), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// A whole streamed answer.
#[derive(Debug, Default, PartialEq)]
struct Answer {
    text: String,
    ids: Vec<u32>,
    finish: i32,
    usage: Option<api::Usage>,
}

impl Answer {
    fn add(&mut self, msg: api::GenerateResponse) {
        self.text.push_str(&msg.text);
        self.ids.extend(msg.token_ids);
        if msg.finish_reason != 0 {
            self.finish = msg.finish_reason;
            self.usage = msg.usage;
        }
    }
}

/// Reads messages until `n` token ids arrived (or the stream ends).
async fn read_tokens(stream: &mut tonic::Streaming<api::GenerateResponse>, answer: &mut Answer, n: usize) {
    while answer.ids.len() < n {
        let msg = tokio::time::timeout(LIMIT, stream.next()).await.expect("no hang").expect("more messages").expect("ok");
        answer.add(msg);
    }
}

/// Reads the stream to its end; every message must be OK.
async fn read_rest(stream: &mut tonic::Streaming<api::GenerateResponse>, answer: &mut Answer) {
    while let Some(msg) = tokio::time::timeout(LIMIT, stream.next()).await.expect("no hang") {
        answer.add(msg.expect("the stream continues on the other decode node"));
    }
}

/// The same request, uninterrupted.
async fn uninterrupted(client: &mut TandemClient<Channel>) -> Answer {
    let mut stream = client.generate(greedy_request()).await.expect("start").into_inner();
    let mut answer = Answer::default();
    read_rest(&mut stream, &mut answer).await;
    answer
}

/// The greedy completion from the model in this one process (as `tandem generate` runs it).
fn single_process() -> (Vec<u32>, String) {
    let mut engine = Engine::load(&smollm2_dir(), EngineConfig::default()).expect("load");
    let params = SamplingParams { max_tokens: MAX_TOKENS as usize, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() };
    let c = engine.generate(&Prompt::Text(PROMPT.into()), params).expect("generate").remove(0);
    (c.token_ids, c.text)
}

/// The index (in `addrs`, the decode nodes' addresses) of the one decode node running a request now,
/// from the nodes' `Info`.
async fn serving(addrs: &[String]) -> usize {
    let deadline = Instant::now() + LIMIT;
    loop {
        let mut busy = Vec::new();
        for (i, addr) in addrs.iter().enumerate() {
            if let Ok(mut c) = DecodeClient::connect(format!("http://{addr}")).await
                && let Ok(info) = c.info(node::InfoRequest {}).await
                && info.get_ref().load.as_ref().is_some_and(|l| l.running + l.waiting > 0)
            {
                busy.push(i);
            }
        }
        if let [one] = busy.as_slice() {
            return *one;
        }
        assert!(Instant::now() < deadline, "no single decode node is serving the request: {busy:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `tandem:request_migrations_total` by cause, from the router's `/metrics`.
fn migrations(http: &str) -> HashMap<String, u64> {
    let r = request(http, "GET", "/metrics", None);
    assert_eq!(r.status, 200);
    r.body
        .lines()
        .filter_map(|l| l.strip_prefix("tandem:request_migrations_total{cause=\""))
        .map(|l| {
            let (cause, value) = l.split_once("\"} ").expect("a sample");
            (cause.to_string(), value.trim().parse().expect("a count"))
        })
        .collect()
}

fn total(m: &HashMap<String, u64>) -> u64 {
    m.values().sum()
}

fn signal(p: &Proc, sig: &str) {
    let ok = std::process::Command::new("kill").args([sig, &p.pid().to_string()]).status().expect("kill").success();
    assert!(ok, "kill {sig} {}", p.pid());
}

/// The answer of one killed and one surviving node equals the uninterrupted one, usage included.
fn assert_same(got: &Answer, want: &Answer) {
    assert_eq!(got.ids, want.ids, "token ids");
    assert_eq!(got.text, want.text, "text");
    assert_eq!(got.finish, api::FinishReason::Length as i32);
    let (g, w) = (got.usage.expect("usage"), want.usage.expect("usage"));
    assert_eq!((g.prompt_tokens, g.completion_tokens), (w.prompt_tokens, w.completion_tokens), "usage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_node_killed_mid_stream_hands_the_stream_over_without_a_gap_or_a_repeat() {
    let reference = tokio::task::spawn_blocking(single_process);
    let mut cluster = start(&[]);
    let http = cluster.http.clone().expect("http");
    let mut client = client(&cluster).await;
    wait_decode_nodes(&mut client, 2).await;
    let want = uninterrupted(&mut client).await;
    let (ref_ids, ref_text) = reference.await.unwrap();
    assert_eq!((&want.ids, &want.text), (&ref_ids, &ref_text), "the uninterrupted cluster run is the single process's");
    assert_eq!(want.ids.len(), MAX_TOKENS as usize);

    let mut stream = client.generate(greedy_request()).await.expect("start").into_inner();
    let mut got = Answer::default();
    read_tokens(&mut stream, &mut got, BEFORE).await;
    let victim = serving(&cluster.decode_addrs).await;
    cluster.decode[victim].kill();
    read_rest(&mut stream, &mut got).await;
    assert!(got.ids.len() > BEFORE);
    assert_same(&got, &want);

    let moved = migrations(&http);
    assert_eq!(moved.get("stream_error"), Some(&1), "{moved:?}");
    let survivor = &cluster.decode[1 - victim];
    assert!(survivor.stderr_shows("resumed=", Duration::from_secs(10)), "{}", survivor.stderr());
    assert!(cluster.router.stderr().contains("migrating the request"), "{}", cluster.router.stderr());

    // The dead node is quarantined at once: new requests go to the survivor (before its lease expires).
    let again = uninterrupted(&mut client).await;
    assert_same(&again, &want);

    // A node draining on SIGTERM (out of membership at once, still streaming) keeps its streams.
    let endpoint = cluster.etcd.endpoint();
    let model = smollm2_dir();
    let args = node_args("decode", &endpoint, PREFIX, model.to_str().unwrap(), &["--local-prefill-below", "0"]);
    let mut fresh = Proc::start_with_env("decode-fresh", &args, &[("TANDEM_LOG", "info")]);
    let fresh_addr = fresh.wait_serving(START);
    cluster.decode[victim] = fresh;
    cluster.decode_addrs[victim] = fresh_addr;
    wait_decode_nodes(&mut client, 2).await;
    let before = total(&migrations(&http));
    let mut stream = client.generate(greedy_request()).await.expect("start").into_inner();
    let mut drained = Answer::default();
    read_tokens(&mut stream, &mut drained, BEFORE).await;
    let draining = serving(&cluster.decode_addrs).await;
    signal(&cluster.decode[draining], "-TERM");
    read_rest(&mut stream, &mut drained).await;
    assert_same(&drained, &want);
    assert_eq!(total(&migrations(&http)), before, "a draining node's stream was moved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_decode_node_that_leaves_membership_hands_its_stream_over() {
    let cluster = start(&[]);
    let http = cluster.http.clone().expect("http");
    let mut client = client(&cluster).await;
    wait_decode_nodes(&mut client, 2).await;
    let want = uninterrupted(&mut client).await;
    let mut stream = client.generate(greedy_request()).await.expect("start").into_inner();
    let mut got = Answer::default();
    read_tokens(&mut stream, &mut got, BEFORE).await;
    let victim = serving(&cluster.decode_addrs).await;
    // Stopped, the node neither streams nor renews its lease, yet its socket still accepts connections:
    // only leaving membership and then staying silent gives it away.
    signal(&cluster.decode[victim], "-STOP");
    read_rest(&mut stream, &mut got).await;
    assert_same(&got, &want);
    let moved = migrations(&http);
    assert_eq!(moved.get("left_membership"), Some(&1), "{moved:?}");
    signal(&cluster.decode[victim], "-CONT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_every_decode_node_dies_the_stream_ends_unavailable_after_bounded_attempts() {
    let mut cluster = start(&["--max-migrations", "1"]);
    let http = cluster.http.clone().expect("http");
    let mut client = client(&cluster).await;
    wait_decode_nodes(&mut client, 2).await;
    let mut stream = client.generate(greedy_request()).await.expect("start").into_inner();
    let mut got = Answer::default();
    read_tokens(&mut stream, &mut got, BEFORE).await;
    let victim = serving(&cluster.decode_addrs).await;
    cluster.decode[1 - victim].kill();
    cluster.decode[victim].kill();
    let err = loop {
        match tokio::time::timeout(LIMIT, stream.next()).await.expect("no hang") {
            Some(Ok(msg)) => got.add(msg),
            Some(Err(s)) => break s,
            None => panic!("the stream ended cleanly although every decode node died"),
        }
    };
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("failed mid-request"), "{err:?}");
    assert!(total(&migrations(&http)) <= 1, "more re-issues than --max-migrations");
    assert!(stream.next().await.is_none(), "nothing after the error");
}

/// One streamed OpenAI completion read event by event: the text of the `choices`, and whether
/// `[DONE]` came. `on_event` sees the number of text events so far (to act mid-stream).
fn sse_completion(http: &str, body: &Value, mut on_event: impl FnMut(usize)) -> (String, Option<Value>, bool) {
    let mut s = TcpStream::connect(http).expect("connect");
    s.set_read_timeout(Some(LIMIT)).expect("timeout");
    let body = body.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("status");
    assert!(line.contains(" 200 "), "{line}");
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        if line.trim().is_empty() {
            break;
        }
    }
    // Chunked transfer: size line, bytes, CRLF; events end with a blank line.
    let (mut pending, mut text, mut usage, mut done, mut events) = (String::new(), String::new(), None, false, 0);
    loop {
        line.clear();
        r.read_line(&mut line).expect("chunk size");
        let size = usize::from_str_radix(line.trim(), 16).expect("chunk size");
        if size == 0 {
            break;
        }
        let mut chunk = vec![0; size + 2];
        r.read_exact(&mut chunk).expect("chunk");
        pending.push_str(std::str::from_utf8(&chunk[..size]).expect("UTF-8"));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let data = event.trim().strip_prefix("data: ").expect("a data event");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).expect("JSON");
            assert!(v.get("error").is_none(), "an error event: {v}");
            if let Some(t) = v["choices"][0]["text"].as_str() {
                text.push_str(t);
                events += 1;
                on_event(events);
            }
            if !v["usage"].is_null() {
                usage = Some(v["usage"].clone());
            }
        }
    }
    (text, usage, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_openai_event_stream_continues_across_a_killed_decode_node() {
    let cluster = start(&[]);
    let http = cluster.http.clone().expect("http");
    let mut client = client(&cluster).await;
    wait_decode_nodes(&mut client, 2).await;
    let body = json!({
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let whole = {
        let (http, body) = (http.clone(), body.clone());
        tokio::task::spawn_blocking(move || sse_completion(&http, &body, |_| {})).await.unwrap()
    };
    assert!(whole.2, "[DONE] ends the uninterrupted stream");
    let decode_addrs = cluster.decode_addrs.clone();
    let pids: Vec<u32> = cluster.decode.iter().map(Proc::pid).collect();
    let rt = tokio::runtime::Handle::current();
    let got = {
        let http = http.clone();
        tokio::task::spawn_blocking(move || {
            sse_completion(&http, &body, |events| {
                if events == BEFORE {
                    // Kill whichever node serves it (SIGKILL), mid-stream.
                    let victim = rt.block_on(serving(&decode_addrs));
                    let ok = std::process::Command::new("kill").args(["-KILL", &pids[victim].to_string()]).status().expect("kill").success();
                    assert!(ok);
                }
            })
        })
        .await
        .unwrap()
    };
    assert!(got.2, "[DONE] ends the migrated stream");
    assert_eq!(got.0, whole.0, "text");
    // Usage counts the same prompt and completion (the cached part depends on which node served).
    let counts = |u: &Option<Value>| u.as_ref().map(|u| (u["prompt_tokens"].clone(), u["completion_tokens"].clone()));
    assert_eq!(counts(&got.1), counts(&whole.1), "usage");
    assert_eq!(counts(&got.1).expect("usage").1, json!(MAX_TOKENS));
    assert_eq!(migrations(&http).get("stream_error"), Some(&1));
}
