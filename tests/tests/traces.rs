//! OpenTelemetry traces across the cluster's processes: a router, a prefill and a decode node (real
//! processes, real etcd) export their spans over OTLP/gRPC to a collector in this test, and one
//! request's spans in all three join one trace — the HTTP client's, when it sends a `traceparent`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use tandem_tests::cluster::{Cluster, ClusterSpec};
use tandem_tests::http::{request, request_with_headers};
use tandem_tests::otlp::{Collector, Span};

/// The client's span: trace 4bf9…, span 00f0….
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// What one disaggregated request leaves, per service: (span name, its parent's name or "" for the
/// span whose parent is in another process).
const EXPECTED: &[(&str, &str, &str)] = &[
    ("tandem-router", "request", ""),
    ("tandem-router", "route", "request"),
    ("tandem-decode", "decode", ""),
    ("tandem-decode", "remote_prefill", "decode"),
    ("tandem-decode", "kv_transfer", "remote_prefill"),
    ("tandem-decode", "generate", "decode"),
    ("tandem-prefill", "prefill", ""),
    ("tandem-prefill", "queue", "prefill"),
    ("tandem-prefill", "compute", "prefill"),
    ("tandem-prefill", "kv_transfer", "prefill"),
];

fn wait_nodes(http: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = request(http, "GET", "/health", None);
        if r.status == 200 {
            let h = r.json();
            if h["prefill_nodes"] == 1 && h["decode_nodes"] == 1 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "the router never saw both nodes");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn find<'a>(spans: &'a [Span], service: &str, name: &str) -> Option<&'a Span> {
    spans.iter().find(|s| s.service == service && s.name == name)
}

fn complete(spans: &[Span]) -> bool {
    EXPECTED.iter().all(|(service, name, _)| find(spans, service, name).is_some())
}

/// Checks one request's spans: every expected span once, parents as listed, and the cross-process
/// links (router request → decode → remote_prefill → prefill). Returns the router's request span.
fn check_request(spans: &[Span], trace: &str) -> Span {
    let mine: Vec<Span> = spans.iter().filter(|s| s.trace_id == trace).cloned().collect();
    let by_id: HashMap<&str, &Span> = mine.iter().map(|s| (s.span_id.as_str(), s)).collect();
    for (service, name, parent) in EXPECTED {
        let n = mine.iter().filter(|s| s.service == *service && s.name == *name).count();
        assert_eq!(n, 1, "{service} {name}: {n} spans in trace {trace}: {mine:#?}");
        let span = find(&mine, service, name).expect("counted");
        if !parent.is_empty() {
            let p = by_id.get(span.parent_id.as_str()).unwrap_or_else(|| panic!("{service} {name}: parent not in the trace: {mine:#?}"));
            assert_eq!((p.service.as_str(), p.name.as_str()), (*service, *parent), "{service} {name}'s parent");
        }
    }
    let request = find(&mine, "tandem-router", "request").expect("checked");
    let decode = find(&mine, "tandem-decode", "decode").expect("checked");
    let remote = find(&mine, "tandem-decode", "remote_prefill").expect("checked");
    let prefill = find(&mine, "tandem-prefill", "prefill").expect("checked");
    assert_eq!(decode.parent_id, request.span_id, "the decode span continues the router's request span");
    assert_eq!(prefill.parent_id, remote.span_id, "the prefill span continues the decode node's remote_prefill span");
    assert!(request.events.iter().any(|e| e == "first token"), "{request:?}");
    assert!(decode.events.iter().any(|e| e == "first token"), "{decode:?}");
    assert_eq!(decode.attr("prefill"), Some("remote"));
    for (service, direction) in [("tandem-decode", "recv"), ("tandem-prefill", "send")] {
        let kv = find(&mine, service, "kv_transfer").expect("checked");
        assert_eq!(kv.attr("direction"), Some(direction), "{kv:?}");
        assert_eq!(kv.attr("backend"), Some("tcp"), "{kv:?}");
        assert!(kv.attr("bytes").and_then(|b| b.parse::<u64>().ok()).is_some_and(|b| b > 0), "{kv:?}");
    }
    request.clone()
}

#[test]
fn one_trace_joins_the_router_decode_prefill_and_transfer_spans_of_a_request() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let collector = rt.block_on(Collector::start());
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let c = Cluster::start(
        "/tandem-test-traces",
        ClusterSpec { prefills: 1, decodes: 1, http: true, env: &env, ..Default::default() },
    );
    let http = c.http.clone().expect("HTTP listener");
    wait_nodes(&http);
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).to_string();

    // With the client's trace context and request id: the router's span is the client span's child.
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = request_with_headers(
        &http,
        "POST",
        "/v1/completions",
        &[("traceparent", &traceparent), ("x-request-id", "trace-test-7")],
        Some(&body),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-request-id"), Some("trace-test-7"));
    let spans = rt.block_on(collector.wait_for(Duration::from_secs(30), |s| {
        complete(&s.iter().filter(|x| x.trace_id == CLIENT_TRACE).cloned().collect::<Vec<_>>())
    }));
    let routed = check_request(&spans, CLIENT_TRACE);
    assert_eq!(routed.parent_id, CLIENT_SPAN, "the router's span is the client span's child");
    assert_eq!(routed.attr("request_id"), Some("trace-test-7-0"));
    assert_eq!(routed.attr("api"), Some("http"));
    assert!(routed.attr("prompt_tokens").is_some_and(|t| t != "0"), "{routed:?}");
    let decode = find(&spans, "tandem-decode", "decode").filter(|s| s.trace_id == CLIENT_TRACE).expect("checked");
    assert_eq!(decode.attr("request_id"), Some("trace-test-7-0"));

    // Without one: a new trace, still one across the three processes.
    let r = request(&http, "POST", "/v1/completions", Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    let rid = r.header("x-request-id").expect("the router names the request").to_string();
    let spans = rt.block_on(collector.wait_for(Duration::from_secs(30), |s| {
        let roots: Vec<&Span> = s.iter().filter(|x| x.name == "request" && x.trace_id != CLIENT_TRACE).collect();
        roots.iter().any(|root| complete(&s.iter().filter(|x| x.trace_id == root.trace_id).cloned().collect::<Vec<_>>()))
    }));
    let root = spans
        .iter()
        .find(|s| s.name == "request" && s.trace_id != CLIENT_TRACE)
        .unwrap_or_else(|| panic!("no second request span: {spans:#?}"));
    let routed = check_request(&spans, &root.trace_id);
    assert!(routed.parent_id.is_empty(), "a request without traceparent starts its trace: {routed:?}");
    assert_eq!(routed.attr("request_id"), Some(format!("{rid}-0").as_str()));

    // A malformed X-Request-Id is refused before anything is routed.
    let r = request_with_headers(&http, "POST", "/v1/completions", &[("x-request-id", "has spaces in it")], Some(&body));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("X-Request-Id"), "{}", r.body);
    drop(c);
}
