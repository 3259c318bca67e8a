//! Prometheus metrics end to end: a router with `--http-listen` and one prefill and one decode node with
//! `--metrics-listen` (real processes, real etcd, SmolLM2). After exactly N requests the router's
//! counters moved by N and its prompt tokens by the prompts' lengths (from usage), the prefill node
//! counted N transfers over tcp, and every `/metrics` passes `promtool check metrics` (Debian's
//! `prometheus` package, installed by scripts/install-deps.sh) and a strict parse here.

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_tests::cluster::{Cluster, ClusterSpec, START, node_args};
use tandem_tests::http::request;
use tandem_tests::process::Proc;
use tandem_tests::{repo_root, smollm2_dir};

/// Requests sent.
const N: u64 = 3;

/// Shared by every prompt of the counting test: longer than two 16-token blocks.
const PREAMBLE: &str = "You are a careful assistant. Answer each question in one short sentence, \
     naming the place and nothing else, without any introduction, apology or explanation.";

fn n_f64() -> f64 {
    N as f64
}
const METRICS_ARGS: &[&str] = &["--metrics-listen", "127.0.0.1:0"];

/// Waits for a node's `... metrics on http://ADDR/metrics` line and returns ADDR.
fn wait_metrics(node: &mut Proc) -> String {
    let line = node.wait_line("metrics on http://", START);
    let url = line
        .rsplit("metrics on http://")
        .next()
        .expect("address")
        .trim();
    url.strip_suffix("/metrics")
        .expect("a /metrics URL")
        .to_string()
}

/// `GET /metrics` at `addr`, checked with promtool and the strict parser.
fn scrape(addr: &str) -> Samples {
    let r = request(addr, "GET", "/metrics", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/plain; version=0.0.4")),
        "{:?}",
        r.headers
    );
    promtool_check(&r.body);
    parse(&r.body)
}

/// Runs `promtool check metrics` on `text`; panics with its output unless it passes. The one lint
/// allowed is promtool's objection to `:` in names (it reserves colons for recording rules), which
/// vLLM's `vllm:` names, and so `tandem:` ones, draw by design: every other lint and any parse error
/// fails the test.
fn promtool_check(text: &str) {
    const COLON_LINT: &str = "metric names should not contain ':'";
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; see scripts/install-deps.sh)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("writing to promtool");
    let out = child.wait_with_output().expect("promtool");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let problems: Vec<&str> = report
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.ends_with(COLON_LINT))
        .collect();
    assert!(
        problems.is_empty()
            && (out.status.success() || report.lines().any(|l| l.ends_with(COLON_LINT))),
        "promtool check metrics failed:\n{report}\n--- exposition ---\n{text}"
    );
}

/// The families `GET /metrics` at `addr` declares, with their types.
fn families(addr: &str) -> HashMap<String, String> {
    let r = request(addr, "GET", "/metrics", None);
    r.body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .map(|(n, k)| (n.to_string(), k.to_string()))
        .collect()
}

/// Every `tandem:` metric name a dashboard's JSON mentions.
fn dashboard_metrics(json: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = json;
    while let Some(i) = rest.find("tandem:") {
        let tail = &rest[i..];
        let end = tail[7..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(tail.len(), |e| e + 7);
        if end > 7 {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// Samples by `name{labels}` exactly as written.
type Samples = HashMap<String, f64>;

/// A strict parse of the text format: every sample belongs to a family declared by `# HELP` and
/// `# TYPE` before it, names are valid, each series appears once and every value is a number.
fn parse(text: &str) -> Samples {
    let valid_name = |n: &str| {
        !n.is_empty()
            && !n.starts_with(|c: char| c.is_ascii_digit())
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = Samples::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(valid_name(name), "bad name in {line:?}");
            assert!(
                ["counter", "gauge", "histogram"].contains(&kind),
                "{line:?}"
            );
            assert!(
                types.insert(name.to_string(), kind.to_string()).is_none(),
                "declared twice: {line:?}"
            );
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(
            !line.is_empty() && !line.starts_with('#'),
            "unexpected line {line:?}"
        );
        let (series, value) = line.rsplit_once(' ').expect("series value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let name = series.split('{').next().expect("name");
        assert!(valid_name(name), "bad name in {line:?}");
        if series.contains('{') {
            assert!(series.ends_with('}'), "bad labels in {line:?}");
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(name);
        assert!(
            types.contains_key(family),
            "sample before its # TYPE: {line:?}"
        );
        assert!(
            samples.insert(series.to_string(), value).is_none(),
            "series twice: {line:?}"
        );
    }
    samples
}

fn get(s: &Samples, series: &str) -> f64 {
    s.get(series).copied().unwrap_or(0.0)
}

/// The sum of every series of `name` (any labels).
fn sum(s: &Samples, name: &str) -> f64 {
    s.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name))
        .map(|(_, v)| v)
        .sum()
}

/// Waits until the router sees one prefill and one decode node.
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

#[test]
fn metrics_count_exactly_the_requests_served() {
    // The harness starts prefill nodes without extra arguments: this one is started here.
    let mut c = Cluster::start(
        "/tandem-test-metrics",
        ClusterSpec {
            prefills: 0,
            decodes: 1,
            http: true,
            decode_extra: METRICS_ARGS,
            ..Default::default()
        },
    );
    let endpoint = c.etcd.endpoint();
    let model = smollm2_dir();
    let model = model.to_str().expect("UTF-8 model path");
    let mut prefill_proc = Proc::start(
        "prefill0",
        &node_args("prefill", &endpoint, &c.prefix, model, METRICS_ARGS),
    );
    prefill_proc.wait_serving(START);
    let prefill = wait_metrics(&mut prefill_proc);
    let http = c.http.clone().expect("HTTP listener");
    let decode = wait_metrics(&mut c.decode[0]);
    wait_nodes(&http);
    // Plain-HTTP health beside /metrics: what probes ask where the node API is mutual TLS.
    for addr in [&prefill, &decode] {
        let r = request(addr, "GET", "/health", None);
        assert_eq!((r.status, r.body.trim()), (200, "SERVING"), "{addr}");
    }

    let before = scrape(&http);
    let (mut prompt_tokens, mut completion_tokens, mut cached_tokens) = (0.0, 0.0, 0.0);
    for i in 0..N {
        // A shared preamble of several 16-token blocks: later requests hit the prefix caches.
        let body = json!({
            "prompt": format!("{PREAMBLE} Request number {i} asks: what is the capital of France?"),
            "max_tokens": 4,
            "temperature": 0,
        });
        let r = request(&http, "POST", "/v1/completions", Some(&body.to_string()));
        assert_eq!(r.status, 200, "{}", r.body);
        let usage: Value = r.json()["usage"].clone();
        prompt_tokens += usage["prompt_tokens"].as_f64().expect("prompt_tokens");
        completion_tokens += usage["completion_tokens"]
            .as_f64()
            .expect("completion_tokens");
        cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .expect("cached_tokens");
    }
    assert!(cached_tokens >= 32.0 * (n_f64() - 1.0), "the preamble was not served from the decode node's cache: {cached_tokens}");
    let after = scrape(&http);
    let moved = |name: &str| sum(&after, name) - sum(&before, name);
    let n = N as f64;
    assert_eq!(moved("tandem:request_success_total"), n, "{after:?}");
    assert_eq!(moved("tandem:prompt_tokens_total"), prompt_tokens);
    assert_eq!(moved("tandem:generation_tokens_total"), completion_tokens);
    assert_eq!(moved("tandem:time_to_first_token_seconds_count"), n);
    assert_eq!(moved("tandem:e2e_request_latency_seconds_count"), n);
    assert_eq!(
        get(
            &after,
            "tandem:routing_decisions_total{policy=\"least-load\",prefill=\"remote\"}"
        ) - get(
            &before,
            "tandem:routing_decisions_total{policy=\"least-load\",prefill=\"remote\"}"
        ),
        n
    );
    assert_eq!(get(&after, "tandem:requests_running"), 0.0);
    assert_eq!(
        get(
            &after,
            "tandem:membership_changes_total{role=\"decode\",change=\"join\"}"
        ),
        1.0
    );
    assert_eq!(
        get(
            &after,
            "tandem:membership_changes_total{role=\"prefill\",change=\"join\"}"
        ),
        1.0
    );

    let p = scrape(&prefill);
    let d = scrape(&decode);
    // One transfer per request, counted once by the sender and once by the receiver, same bytes.
    for (node, direction) in [(&p, "send"), (&d, "recv")] {
        let series = |name: &str| format!("{name}{{backend=\"tcp\",direction=\"{direction}\"}}");
        assert_eq!(get(node, &series("tandem:kv_transfers_total")), n, "{node:?}");
        assert_eq!(get(node, &series("tandem:kv_transfer_seconds_count")), n);
        assert_eq!(sum(node, "tandem:kv_transfer_failures_total"), 0.0);
        // Served by every node, whatever its backend (tcp here: no communicator was ever made).
        assert_eq!(node.get("tandem:kv_nccl_communicators_abandoned_total").copied(), Some(0.0));
    }
    let sent = get(&p, "tandem:kv_transfer_bytes_total{backend=\"tcp\",direction=\"send\"}");
    assert!(sent > 0.0);
    assert_eq!(get(&d, "tandem:kv_transfer_bytes_total{backend=\"tcp\",direction=\"recv\"}"), sent);
    assert_eq!(get(&p, "tandem:num_requests_running"), 0.0);
    // Every prompt queued once on the prefill node; the decode node queues none (all remote).
    assert_eq!(get(&p, "tandem:request_queue_time_seconds_count"), n);
    assert_eq!(get(&d, "tandem:request_queue_time_seconds_count"), 0.0);
    // Prefix-cache lookups: every prompt token once on each node; the decode node's hits are the
    // cached tokens it reported; the prefill node holds the preamble too (it computed it first).
    assert_eq!(get(&d, "tandem:prefix_cache_queries_total"), prompt_tokens);
    assert_eq!(get(&d, "tandem:prefix_cache_hits_total"), cached_tokens);
    assert_eq!(get(&p, "tandem:prefix_cache_queries_total"), prompt_tokens);
    let prefill_hits = get(&p, "tandem:prefix_cache_hits_total");
    assert!(prefill_hits >= 32.0 * (n - 1.0) && prefill_hits <= prompt_tokens, "{prefill_hits}");

    assert_eq!(sum(&d, "tandem:local_prefill_total"), 0.0, "{d:?}");

    // The Grafana dashboard under deploy/ queries only families these processes serve, with the
    // histogram suffixes only on histograms.
    let mut served: HashMap<String, String> = HashMap::new();
    for addr in [&http, &prefill, &decode] {
        served.extend(families(addr));
    }
    let dashboard = std::fs::read_to_string(repo_root().join("deploy/grafana/tandem.json")).expect("deploy/grafana/tandem.json");
    let used = dashboard_metrics(&dashboard);
    assert!(used.len() >= 10, "{used:?}");
    for name in &used {
        let (family, histogram_part) = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| served.get(*f).is_some_and(|k| k == "histogram")).map(|f| (f, true)))
            .unwrap_or((name.as_str(), false));
        let kind = served.get(family).unwrap_or_else(|| panic!("the dashboard queries {name}, which nothing serves"));
        assert!(histogram_part || kind != "histogram", "the dashboard queries histogram {name} without _bucket/_sum/_count");
    }
    let used = get(&d, "tandem:kv_cache_blocks{state=\"used\"}");
    let free = get(&d, "tandem:kv_cache_blocks{state=\"free\"}");
    assert!(free > 0.0);
    assert!((get(&d, "tandem:kv_cache_usage_perc") - used / (used + free)).abs() < 1e-9);
}
