//! API keys at the router (real etcd, router and decode node processes): without a valid
//! `authorization: Bearer KEY` a gRPC call is UNAUTHENTICATED and an HTTP request 401 in OpenAI's
//! error shape, and nothing is routed; `tandem client --api-key` (or TANDEM_API_KEY) gets through;
//! SIGHUP re-reads the key file; health and metrics stay open.

use std::time::{Duration, Instant};

use serde_json::json;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::cluster::{Cluster, ClusterSpec};
use tandem_tests::http::{request, request_with_headers};
use tandem_tests::run_tandem_env;

fn generate_request() -> api::GenerateRequest {
    api::GenerateRequest {
        prompt: Some(api::generate_request::Prompt::Text("The capital of France is".into())),
        sampling: Some(api::SamplingParams { max_tokens: Some(3), temperature: Some(0.0), ..Default::default() }),
        ..Default::default()
    }
}

/// A unary call with `key` (if any) as a bearer token.
async fn call(addr: &str, key: Option<&str>) -> Result<api::GenerateUnaryResponse, tonic::Status> {
    let mut client = TandemClient::connect(format!("http://{addr}")).await.expect("router");
    let mut req = tonic::Request::new(generate_request());
    if let Some(k) = key {
        req.metadata_mut().insert("authorization", format!("Bearer {k}").parse().expect("ascii"));
    }
    client.generate_unary(req).await.map(tonic::Response::into_inner)
}

/// Routing decisions the router counted so far.
fn routed(http: &str) -> f64 {
    let body = request(http, "GET", "/metrics", None).body;
    body.lines()
        .filter(|l| l.starts_with("tandem:routing_decisions_total"))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

#[test]
fn the_router_serves_only_callers_with_a_listed_api_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# cluster keys\nsk-first\nsk-second\n").expect("key file");
    let keys_arg = keys.to_str().expect("UTF-8 path");
    let c = Cluster::start(
        "/tandem-test-auth",
        ClusterSpec { decodes: 1, http: true, router_extra: &["--api-key-file", keys_arg], ..Default::default() },
    );
    let http = c.http.clone().expect("HTTP listener");
    let addr = c.addr.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");

    // Health is open; wait until the router sees the decode node.
    let deadline = Instant::now() + Duration::from_secs(60);
    while request(&http, "GET", "/health", None).status != 200 {
        assert!(Instant::now() < deadline, "the router never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Refused over gRPC and HTTP, whatever is wrong with the key; nothing is routed.
    let before = routed(&http);
    for key in [None, Some("sk-wrong"), Some("sk-firs"), Some("sk-first-and-more")] {
        let status = rt.block_on(call(&addr, key)).expect_err("refused");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{key:?}: {status:?}");
        assert!(status.message().contains("API key"), "{status:?}");
    }
    let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}).to_string();
    for headers in [&[][..], &[("authorization", "Bearer sk-wrong")][..], &[("authorization", "sk-first")][..]] {
        let r = request_with_headers(&http, "POST", "/v1/completions", headers, Some(&body));
        assert_eq!(r.status, 401, "{headers:?}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key", "{}", r.body);
    }
    assert_eq!(request(&http, "GET", "/v1/models", None).status, 401);
    assert_eq!(routed(&http), before, "a refused request was routed");
    assert_eq!(request(&http, "GET", "/metrics", None).status, 200, "metrics stay open");

    // Either listed key works, on both APIs.
    let out = rt.block_on(call(&addr, Some("sk-second"))).expect("a listed key is served");
    assert!(!out.token_ids.is_empty());
    let r = request_with_headers(&http, "POST", "/v1/completions", &[("authorization", "Bearer sk-first")], Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(routed(&http), before + 2.0);

    // `tandem client`: the flag or the environment, and a clear failure without a key.
    let router = ["client", "--router", addr.as_str(), "--max-tokens", "3"];
    let limit = Duration::from_secs(60);
    let ok = run_tandem_env(&[&router[..], &["--api-key", "sk-first", "Hello"]].concat(), &[], limit);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let ok = run_tandem_env(&[&router[..], &["Hello"]].concat(), &[("TANDEM_API_KEY", "sk-second")], limit);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let refused = run_tandem_env(&[&router[..], &["Hello"]].concat(), &[], limit);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("API key") && err.contains("Unauthenticated"), "{err}");

    // SIGHUP re-reads the file: the new key works, a removed one no longer does; a file that no
    // longer parses keeps the keys in force.
    std::fs::write(&keys, "sk-third\n").expect("key file");
    let status = std::process::Command::new("kill").args(["-HUP", &c.router.pid().to_string()]).status().expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while rt.block_on(call(&addr, Some("sk-third"))).is_err() {
        assert!(Instant::now() < deadline, "the new key never worked");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(rt.block_on(call(&addr, Some("sk-first"))).expect_err("removed").code(), tonic::Code::Unauthenticated);
    std::fs::write(&keys, "# emptied by mistake\n").expect("key file");
    let status = std::process::Command::new("kill").args(["-HUP", &c.router.pid().to_string()]).status().expect("kill");
    assert!(status.success());
    std::thread::sleep(Duration::from_millis(500));
    rt.block_on(call(&addr, Some("sk-third"))).expect("an empty key file keeps the previous keys");
    assert!(c.router.stderr_shows("keeping the previous API keys", Duration::from_secs(10)), "{}", c.router.stderr());
}

#[test]
fn a_bad_key_file_is_a_clear_start_up_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n# none\n").expect("file");
    let missing = dir.path().join("missing");
    for (file, says) in [(&empty, "holds no key"), (&missing, "reading the API key file")] {
        let out = run_tandem_env(
            &["router", "--etcd", "http://127.0.0.1:9", "--api-key-file", file.to_str().expect("path")],
            &[],
            Duration::from_secs(30),
        );
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
    }
}
