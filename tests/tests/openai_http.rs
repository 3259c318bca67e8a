//! The OpenAI-compatible HTTP API end to end: etcd, a router with `--http-listen`, one prefill and one
//! decode node on SmolLM2 (real processes), driven by the official `openai` Python package (installed
//! by scripts/install-deps.sh) and by a raw HTTP client where the exact bytes matter. Greedy output
//! over HTTP equals `tandem generate`; every error status comes in OpenAI's error shape; a stream whose
//! client closes the connection is aborted on every node.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_tests::cluster::{Cluster, ClusterSpec, START, wait_all_blocks_free, wait_http};
use tandem_tests::http::request;
use tandem_tests::process::Proc;
use tandem_tests::{run_tandem, smollm2_dir};

const MODEL: &str = "smollm2-135m-instruct";
const PROMPT: &str = "The capital of France is";
const QUESTION: &str = "What is 2 + 2?";
/// Greedy tokens compared with `tandem generate`.
const GREEDY_TOKENS: u32 = 24;
/// How long a log line may take to reach the test after the response did.
const WAIT_LOG: Duration = Duration::from_secs(5);

/// The client side, run with `python3 -c SCRIPT CONFIG_JSON PHASE`; prints one JSON object.
const CLIENT: &str = r#"
import json, sys
import openai

cfg, phase = json.loads(sys.argv[1]), sys.argv[2]
model = cfg["model"]
client = openai.OpenAI(base_url=cfg["base"], api_key="unused", max_retries=0, timeout=120)

def error_of(call):
    try:
        call()
    except openai.APIStatusError as e:
        return {"status": e.status_code, "body": e.response.json(), "class": type(e).__name__}
    return None

if phase == "cancel":
    stream = client.completions.create(model=model, prompt="Write a very long story about a dragon who learns to code.",
                                       max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen, rid = 0, None
    for chunk in stream:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].text:
            seen += 1
        if seen == 3:
            break
    stream.close()  # closes the connection mid-stream
    print(json.dumps({"id": rid, "chunks": seen}))
    sys.exit(0)

out = {}
greedy = dict(model=model, max_tokens=cfg["greedy_tokens"], temperature=0)
user = [{"role": "user", "content": cfg["question"]}]

r = client.completions.create(prompt=cfg["prompt"], **greedy)
out["completion"] = {"id": r.id, "object": r.object, "model": r.model, "text": r.choices[0].text,
                     "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
chunks = list(client.completions.create(prompt=cfg["prompt"], stream=True, stream_options={"include_usage": True}, **greedy))
out["completion_stream"] = {
    "text": "".join(c.choices[0].text for c in chunks if c.choices),
    "finishes": [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
    "usage": chunks[-1].usage.model_dump() if chunks[-1].usage else None,
    "last_choices": len(chunks[-1].choices),
    "ids": sorted({c.id for c in chunks}),
}
r = client.completions.create(prompt=cfg["prompt_ids"], **greedy)
out["token_prompt"] = r.choices[0].text

r = client.chat.completions.create(messages=user, **greedy)
out["chat"] = {"object": r.object, "role": r.choices[0].message.role, "text": r.choices[0].message.content,
               "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
chunks = list(client.chat.completions.create(messages=user, stream=True, stream_options={"include_usage": True}, **greedy))
out["chat_stream"] = {
    "objects": sorted({c.object for c in chunks}),
    "first_role": chunks[0].choices[0].delta.role,
    "text": "".join((c.choices[0].delta.content or "") for c in chunks if c.choices),
    "finishes": [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
    "usage": chunks[-1].usage.model_dump() if chunks[-1].usage else None,
}

# A stop string from the middle of the greedy completion cuts it there.
text = out["completion"]["text"]
words = text.split()
stop = words[len(words) // 2]
r = client.completions.create(prompt=cfg["prompt"], stop=[stop, "never appears"], **greedy)
out["stop"] = {"stop": stop, "expected": text[:text.index(stop)], "text": r.choices[0].text, "finish": r.choices[0].finish_reason}

sampled = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0.8)
a = client.completions.create(seed=1234, **sampled)
b = client.completions.create(seed=1234, **sampled)
two = client.completions.create(seed=1234, n=2, **sampled)
out["seed"] = {"a": a.choices[0].text, "b": b.choices[0].text,
               "n2": [c.text for c in sorted(two.choices, key=lambda c: c.index)], "n2_usage": two.usage.model_dump()}
r = client.chat.completions.create(messages=user, model=model, max_tokens=12, temperature=0.8, seed=7)
s = client.chat.completions.create(messages=user, model=model, max_tokens=12, temperature=0.8, seed=7)
out["chat_seed"] = [r.choices[0].message.content, s.choices[0].message.content]

r = client.completions.create(model=model, prompt=cfg["prompt"], max_tokens=6, temperature=0, logprobs=3)
lp = r.choices[0].logprobs
out["logprobs"] = {"text": r.choices[0].text, "tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                   "top": [list(t.items()) for t in lp.top_logprobs], "offsets": lp.text_offset}
r = client.chat.completions.create(messages=user, model=model, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
out["chat_logprobs"] = {"text": r.choices[0].message.content, "usage": r.usage.model_dump(), "content": [
    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes, "top": [[x.token, x.logprob] for x in t.top_logprobs]}
    for t in r.choices[0].logprobs.content]}

r = client.completions.create(model=model, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0)
out["batch"] = {"indices": [c.index for c in r.choices], "texts": [c.text for c in r.choices], "usage": r.usage.model_dump()}

out["models"] = [m.model_dump() for m in client.models.list().data]

empty = openai.OpenAI(base_url=cfg["empty_base"], api_key="unused", max_retries=0, timeout=60)
out["errors"] = {
    "bad_temperature": error_of(lambda: client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=-1)),
    "bad_role": error_of(lambda: client.chat.completions.create(model=model, messages=[{"role": "tool", "content": "x"}], max_tokens=2)),
    "unknown_model": error_of(lambda: client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)),
    "too_large": error_of(lambda: client.completions.create(model=model, prompt="a" * (5 << 20), max_tokens=2)),
    "over_capacity": error_of(lambda: client.completions.create(model=model, prompt=[1000] * cfg["over_capacity_tokens"], max_tokens=16)),
    "no_decode_node": error_of(lambda: empty.chat.completions.create(model=model, messages=user, max_tokens=2)),
}
print(json.dumps(out))
"#;

/// Runs the client script; panics with its stderr if it fails.
fn client(config: &Value, phase: &str) -> Value {
    let out = Command::new("python3")
        .args(["-c", CLIENT, &config.to_string(), phase])
        .output()
        .unwrap_or_else(|e| panic!("python3 is missing ({e}): run scripts/test.sh, which installs it and the openai package"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the openai package is missing: run scripts/install-deps.sh (or scripts/test.sh)"
    );
    assert!(
        out.status.success(),
        "the openai client failed ({phase}):\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("client output is not JSON ({e}):\n{stdout}\n{stderr}"))
}

fn generate_stdout(args: &[&str]) -> String {
    let out = run_tandem(args, Duration::from_secs(300));
    assert!(
        out.status.success(),
        "tandem {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Waits until `GET /health` answers 200 (the router sees a decode node).
fn wait_healthy(http: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if request(http, "GET", "/health", None).status == 200 {
            return;
        }
        assert!(Instant::now() < deadline, "the router never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asserts an OpenAI error answer: the status and a complete `error` object.
fn assert_error(what: &str, got: &Value, status: u64) {
    assert_eq!(got["status"], status, "{what}: {got}");
    let e = &got["body"]["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: no message: {got}"
    );
    assert!(e["type"].is_string(), "{what}: no type: {got}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{what}: param and code must be present: {got}"
    );
}

fn usage(u: &Value) -> (u64, u64, u64) {
    (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap(),
    )
}

/// Whether some line of `log` contains every one of `needles` (log lines carry colour codes between
/// fields, so they are matched piece by piece).
fn logged(log: &str, needles: &[&str]) -> bool {
    log.lines().any(|l| needles.iter().all(|n| l.contains(n)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_client_is_served_by_a_real_cluster() {
    let model_dir = smollm2_dir();
    let model_path = model_dir.to_str().unwrap().to_string();
    // The single-process references, computed while the cluster starts.
    let references = std::thread::spawn(move || {
        let n = GREEDY_TOKENS.to_string();
        let text = generate_stdout(&[
            "generate",
            "--model",
            &model_path,
            "--max-tokens",
            &n,
            PROMPT,
        ]);
        let chat = generate_stdout(&[
            "generate",
            "--model",
            &model_path,
            "--max-tokens",
            &n,
            "--chat",
            QUESTION,
        ]);
        (text, chat)
    });
    let cluster = tokio::task::block_in_place(|| {
        Cluster::start(
            "/tandem-openai",
            ClusterSpec {
                prefills: 1,
                decodes: 1,
                http: true,
                ..Default::default()
            },
        )
    });
    let http = cluster.http.clone().expect("http address");
    // A second router on a prefix where no node lives: nothing can serve.
    let mut empty = Proc::start(
        "router-empty",
        &[
            "router",
            "--etcd",
            &cluster.etcd.endpoint(),
            "--cluster-prefix",
            "/nobody",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    empty.wait_serving(START);
    let empty_http = wait_http(&mut empty);
    tokio::task::block_in_place(|| wait_healthy(&http));
    let mut nodes = cluster.membership().await;
    let _ = tokio::time::timeout(Duration::from_secs(20), nodes.wait_for(|ns| ns.len() == 2))
        .await
        .expect("both nodes in membership");
    let decode_blocks = nodes
        .borrow()
        .iter()
        .find(|n| n.role == tandem_membership::NodeRole::Decode)
        .map(|n| n.load.total_blocks)
        .unwrap();

    let tokenizer = Tokenizer::from_model_dir(&model_dir).expect("tokenizer");
    let prompt_ids = tokenizer.encode(PROMPT, true).unwrap();
    let chat_text = tokenizer
        .apply_chat_template(&[ChatMessage::new("user", QUESTION)], true)
        .unwrap();
    let chat_prompt_tokens = tokenizer.encode(&chat_text, false).unwrap().len() as u64;
    // A prompt that fits the context (8192) but never the decode node's KV pool.
    let over_capacity_tokens = decode_blocks as usize * 16 + 32;
    assert!(
        over_capacity_tokens + 16 <= 8192,
        "the decode node's pool is too large for the capacity case"
    );

    // The exact wire format, as a raw client sees it.
    let raw = tokio::task::block_in_place(|| {
        let health = request(&http, "GET", "/health", None);
        let models = request(&http, "GET", "/v1/models", None);
        let sse = request(
            &http,
            "POST",
            "/v1/chat/completions",
            Some(&json!({"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0, "stream": true}).to_string()),
        );
        let malformed = request(&http, "POST", "/v1/completions", Some("{\"prompt\": "));
        let empty_health = request(&empty_http, "GET", "/health", None);
        (health, models, sse, malformed, empty_health)
    });
    let (health, models, sse, malformed, empty_health) = raw;
    assert_eq!(health.status, 200);
    assert_eq!(
        (
            health.json()["serving"].clone(),
            health.json()["decode_nodes"].clone()
        ),
        (json!(true), json!(1))
    );
    assert_eq!(empty_health.status, 503, "{}", empty_health.body);
    assert_eq!(
        models.json()["data"][0]["max_model_len"],
        8192,
        "{}",
        models.body
    );
    assert_eq!(sse.status, 200);
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    let events: Vec<&str> = sse.body.split_terminator("\n\n").collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{}", sse.body);
    assert!(sse.body.ends_with("data: [DONE]\n\n"));
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}")),
        )
        .expect("JSON chunk");
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert!(
            chunk.get("usage").is_none(),
            "usage only with stream_options.include_usage: {chunk}"
        );
    }
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.json()["error"]["type"], "invalid_request_error");

    let config = json!({
        "base": format!("http://{http}/v1"),
        "empty_base": format!("http://{empty_http}/v1"),
        "model": MODEL,
        "prompt": PROMPT,
        "question": QUESTION,
        "greedy_tokens": GREEDY_TOKENS,
        "prompt_ids": prompt_ids,
        "over_capacity_tokens": over_capacity_tokens,
    });
    let out = tokio::task::block_in_place(|| client(&config, "main"));
    let (expected_text, expected_chat) = references.join().unwrap();

    // Completions: greedy equals `tandem generate`, streamed or not, from text or token ids.
    let c = &out["completion"];
    assert_eq!(
        c["text"].as_str().unwrap().trim_end(),
        expected_text.trim_end(),
        "{out}"
    );
    assert_eq!(
        (
            c["object"].as_str(),
            c["model"].as_str(),
            c["finish"].as_str()
        ),
        (Some("text_completion"), Some(MODEL), Some("length"))
    );
    let n = GREEDY_TOKENS as u64;
    let p = prompt_ids.len() as u64;
    assert_eq!(usage(&c["usage"]), (p, n, p + n));
    let s = &out["completion_stream"];
    assert_eq!(s["text"], c["text"]);
    assert_eq!(s["finishes"], json!(["length"]));
    assert_eq!(
        s["last_choices"], 0,
        "include_usage ends with a chunk without choices"
    );
    assert_eq!(usage(&s["usage"]), (p, n, p + n));
    assert_eq!(
        s["ids"].as_array().unwrap().len(),
        1,
        "one id for every chunk"
    );
    assert_eq!(out["token_prompt"], c["text"], "token ids as the prompt");

    // Chat.
    let c = &out["chat"];
    assert_eq!(
        c["text"].as_str().unwrap().trim_end(),
        expected_chat.trim_end(),
        "{out}"
    );
    assert_eq!(
        (c["object"].as_str(), c["role"].as_str()),
        (Some("chat.completion"), Some("assistant"))
    );
    let (cp, cn, ct) = usage(&c["usage"]);
    assert_eq!(cp, chat_prompt_tokens);
    assert!(cn >= 1 && cn <= n && ct == cp + cn, "{c}");
    assert_eq!(c["finish"], if cn == n { "length" } else { "stop" });
    let s = &out["chat_stream"];
    assert_eq!(s["objects"], json!(["chat.completion.chunk"]));
    assert_eq!(s["first_role"], "assistant");
    assert_eq!(s["text"], c["text"]);
    assert_eq!(s["finishes"], json!([c["finish"]]));
    assert_eq!(usage(&s["usage"]), (cp, cn, ct));

    // Stop strings.
    let s = &out["stop"];
    assert_eq!(s["text"], s["expected"], "{s}");
    assert_eq!(s["finish"], "stop");

    // Seeds: the same seed samples the same text; choice 0 of n = 2 is the n = 1 answer.
    let s = &out["seed"];
    assert_eq!(s["a"], s["b"], "{s}");
    assert_eq!(s["n2"][0], s["a"], "{s}");
    assert_eq!(s["n2"].as_array().unwrap().len(), 2);
    assert_eq!(usage(&s["n2_usage"]).1, 32, "two choices of 16 tokens: {s}");
    assert_eq!(out["chat_seed"][0], out["chat_seed"][1]);

    // Logprobs: one entry per token, the greedy token is the most likely one.
    let l = &out["logprobs"];
    let tokens = l["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 6, "{l}");
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, l["text"].as_str().unwrap());
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        let top = l["top"][i].as_array().unwrap();
        assert_eq!(top.len(), 3, "{l}");
        assert_eq!(&top[0][0], t, "greedy picks the most likely token: {l}");
        let lp = l["token_logprobs"][i].as_f64().unwrap();
        assert!(
            lp <= 0.0 && (lp - top[0][1].as_f64().unwrap()).abs() < 1e-5,
            "{l}"
        );
        assert_eq!(l["offsets"][i], offset);
        offset += t.as_str().unwrap().chars().count();
    }
    let l = &out["chat_logprobs"];
    let content = l["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        l["usage"]["completion_tokens"].as_u64().unwrap(),
        "{l}"
    );
    let joined: String = content
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, l["text"].as_str().unwrap());
    for t in content {
        assert_eq!(t["top"].as_array().unwrap().len(), 2, "{t}");
        assert_eq!(t["top"][0][0], t["token"]);
        let bytes: Vec<u8> = t["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, t["token"].as_str().unwrap().as_bytes());
    }

    // A list of prompts: one choice each; usage counts both prompts.
    let b = &out["batch"];
    assert_eq!(b["indices"], json!([0, 1]));
    let hello = (tokenizer.encode("Hello", true).unwrap().len()
        + tokenizer.encode("Goodbye", true).unwrap().len()) as u64;
    assert_eq!(usage(&b["usage"]).0, hello, "{b}");

    // Models as OpenAI lists them, with vLLM's max_model_len.
    let m = &out["models"];
    assert_eq!(m.as_array().unwrap().len(), 1, "{m}");
    assert_eq!(
        (
            m[0]["id"].as_str(),
            m[0]["object"].as_str(),
            m[0]["max_model_len"].as_u64()
        ),
        (Some(MODEL), Some("model"), Some(8192))
    );

    // One error per status, each in OpenAI's shape.
    let e = &out["errors"];
    assert_error("bad temperature", &e["bad_temperature"], 400);
    assert_error("bad role", &e["bad_role"], 400);
    assert_eq!(e["bad_role"]["body"]["error"]["param"], "messages");
    assert_error("unknown model", &e["unknown_model"], 404);
    assert_eq!(
        e["unknown_model"]["body"]["error"]["code"],
        "model_not_found"
    );
    assert_error("body over 4 MiB", &e["too_large"], 413);
    assert_error("over the decode node's capacity", &e["over_capacity"], 429);
    assert_error("no decode node", &e["no_decode_node"], 503);

    // A streamed request whose client closes the connection is aborted on every node.
    let cancel = tokio::task::block_in_place(|| client(&config, "cancel"));
    assert_eq!(cancel["chunks"], 3);
    let request_id = format!("{}-0", cancel["id"].as_str().unwrap());
    // 1000 tokens take far longer than this on these machines: the blocks come back because the
    // request was aborted, not because it ended.
    wait_all_blocks_free(&mut nodes, 2, Duration::from_secs(10)).await;
    assert!(cluster.router.stderr_shows(&request_id, WAIT_LOG));
    let router_log = cluster.router.stderr();
    assert!(
        logged(&router_log, &["client cancelled", &request_id]),
        "the router did not drop the relay:\n{router_log}"
    );
    let decode_log = cluster.decode[0].stderr();
    assert!(
        !logged(&decode_log, &["decode done", &request_id]),
        "the request ran to its end:\n{decode_log}"
    );
    // And the cluster still serves.
    let after = tokio::task::block_in_place(|| {
        request(
            &http,
            "POST",
            "/v1/completions",
            Some(
                &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
                    .to_string(),
            ),
        )
    });
    assert_eq!(after.status, 200, "{}", after.body);
    wait_all_blocks_free(&mut nodes, 2, Duration::from_secs(20)).await;
}

#[test]
fn tandem_up_serves_the_openai_api_beside_grpc() {
    let model = smollm2_dir();
    let mut up = Proc::start(
        "up",
        &[
            "up",
            "--model",
            model.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    let first = up.wait_line("tandem up: ", START);
    assert!(
        first.starts_with("tandem up: serving on 127.0.0.1:"),
        "{first}"
    );
    let http = wait_http(&mut up);
    let health = request(&http, "GET", "/health", None);
    assert_eq!(health.status, 200, "{}", health.body);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0});
    let answer = request(
        &http,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    );
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = answer.json();
    assert_eq!(answer["object"], "chat.completion");
    assert!(
        answer["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| (1..=3).contains(&n)),
        "{answer}"
    );
    assert!(
        up.terminate(Duration::from_secs(30)),
        "tandem up did not exit cleanly on SIGTERM:\n{}",
        up.stderr()
    );
}
