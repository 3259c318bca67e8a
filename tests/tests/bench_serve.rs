//! `tandem bench serve` against a real cluster: etcd, a router serving gRPC and the OpenAI HTTP API,
//! one prefill and one decode node on SmolLM2 (real processes). A short open-loop sweep over gRPC and
//! the same sweep over HTTP, then a closed-loop run: each JSON report must account for every request,
//! give each the exact token counts asked for, and hold ordered percentiles and throughputs that
//! agree with its own per-request records. The reports are then drawn into one PNG, and bad flags
//! fail with a message and a non-zero exit. `tandem up --colocated` (the baseline the comparison
//! needs) serves with no prefill node, every prompt prefilled on the decode node.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_tests::cluster::{Cluster, ClusterSpec, START};
use tandem_tests::http::request;
use tandem_tests::process::Proc;
use tandem_tests::{run_tandem, smollm2_dir};

const PROMPTS: usize = 6;
const OUTPUT: u64 = 8;
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn wait_healthy(http: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while request(http, "GET", "/health", None).status != 200 {
        assert!(Instant::now() < deadline, "the router never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `tandem bench serve ARGS`; asserts success and returns the report.
fn bench(args: &[&str], out: &Path) -> Value {
    let model = smollm2_dir();
    let mut all = vec!["bench", "serve", "--tokenizer", model.to_str().unwrap(), "--output-json", out.to_str().unwrap()];
    all.extend_from_slice(args);
    let run = run_tandem(&all, RUN_LIMIT);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "tandem {all:?} failed: {stderr}");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("| load | ok/sent |"), "no table on stdout: {stdout}");
    serde_json::from_str(&std::fs::read_to_string(out).expect("the report")).expect("the report is JSON")
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// Checks one latency's statistics against the samples they came from.
fn check_dist(d: &Value, samples: &[f64], what: &str) {
    assert_eq!(d["count"].as_u64(), Some(samples.len() as u64), "{what}: count");
    let (p50, p90, p99, max) = (f(&d["p50"]), f(&d["p90"]), f(&d["p99"]), f(&d["max"]));
    assert!(0.0 <= p50 && p50 <= p90 && p90 <= p99 && p99 <= max, "{what}: percentiles out of order: {d}");
    let lo = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = samples.iter().copied().fold(0.0, f64::max);
    assert!((max - hi).abs() < 1e-9 && p50 >= lo, "{what}: {d} against samples {lo}..{hi}");
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    assert!((f(&d["mean"]) - mean).abs() < 1e-6 * mean.max(1.0), "{what}: mean");
}

/// Every request accounted for, each with what it asked for; the summary agrees with the records.
fn check_report(report: &Value, backend: &str, runs: usize, input: (u64, u64)) {
    assert_eq!(report["tool"], "tandem bench serve");
    assert_eq!(report["backend"], backend);
    let runs_v = report["runs"].as_array().expect("runs");
    assert_eq!(runs_v.len(), runs, "one entry per rate");
    for run in runs_v {
        let load = run["load"].as_str().unwrap();
        let reqs = run["requests"].as_array().expect("requests");
        let s = &run["summary"];
        assert_eq!(reqs.len(), PROMPTS, "{load}: every request is in the report");
        assert_eq!(s["requests"].as_u64(), Some(PROMPTS as u64));
        assert_eq!(s["completed"].as_u64(), Some(PROMPTS as u64), "{load}: {}", s["errors_by_status"]);
        assert_eq!(s["failed"].as_u64(), Some(0));
        let (mut ttft, mut itl, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut prompt_total, mut sent_last) = (0, 0.0);
        for (i, r) in reqs.iter().enumerate() {
            assert_eq!(r["index"].as_u64(), Some(i as u64));
            assert!(r["error"].is_null(), "{load}: request {i} failed: {r}");
            let plen = r["prompt_len"].as_u64().unwrap();
            assert!((input.0..=input.1).contains(&plen), "{load}: prompt of {plen} tokens");
            assert_eq!(r["prompt_tokens"].as_u64(), Some(plen), "{load}: the server counted the prompt sent");
            assert_eq!(r["output_len"].as_u64(), Some(OUTPUT));
            assert_eq!(r["output_tokens"].as_u64(), Some(OUTPUT), "{load}: ignore_eos gives the length asked");
            assert!(r["cached_tokens"].as_u64().unwrap() <= plen);
            let gaps: Vec<f64> = r["itl_ms"].as_array().unwrap().iter().map(f).collect();
            if backend == "grpc" {
                assert_eq!(gaps.len() as u64, OUTPUT - 1, "{load}: one gap between each two tokens");
            } else {
                assert!(!gaps.is_empty() && (gaps.len() as u64) < OUTPUT, "{load}: {} text chunks", gaps.len() + 1);
            }
            let (t, e) = (f(&r["ttft_ms"]), f(&r["e2e_ms"]));
            assert!(t > 0.0 && t + gaps.iter().sum::<f64>() <= e + 1e-6, "{load}: TTFT {t} + gaps beyond E2E {e}");
            tpot.push((e - t) / (OUTPUT - 1) as f64);
            ttft.push(t);
            e2e.push(e);
            itl.extend(gaps);
            prompt_total += plen;
            sent_last = f(&r["sent_s"]).max(sent_last);
        }
        check_dist(&s["ttft_ms"], &ttft, "TTFT");
        check_dist(&s["itl_ms"], &itl, "ITL");
        check_dist(&s["tpot_ms"], &tpot, "TPOT");
        check_dist(&s["e2e_ms"], &e2e, "E2E");
        assert_eq!(s["total_input_tokens"].as_u64(), Some(prompt_total));
        assert_eq!(s["total_output_tokens"].as_u64(), Some(PROMPTS as u64 * OUTPUT));
        let duration = f(&s["duration_s"]);
        assert!(duration >= sent_last, "{load}: the run ended before its last send");
        let rps = f(&s["request_throughput"]);
        assert!((rps - PROMPTS as f64 / duration).abs() < 1e-9);
        assert!((f(&s["output_token_throughput"]) - (PROMPTS as u64 * OUTPUT) as f64 / duration).abs() < 1e-6);
        assert!(f(&s["goodput"]) <= rps + 1e-12);
        // The goodput matches the SLO (TTFT ≤ 60 s, every gap ≤ 60 s: all good on this machine).
        assert_eq!(s["good_requests"].as_u64(), Some(PROMPTS as u64), "{load}: within a minute every request is good");
    }
}

#[test]
fn bench_serve_sweeps_a_real_cluster_over_grpc_and_http() {
    let cluster = Cluster::start("/tandem-bench-serve", ClusterSpec { prefills: 1, decodes: 1, http: true, ..Default::default() });
    let http = cluster.http.clone().expect("http address");
    wait_healthy(&http);
    let dir = tempfile::tempdir().expect("tempdir");
    let workload = ["--num-prompts", "6", "--input-len", "uniform:16:48", "--output-len", "8", "--seed", "7", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"];

    let grpc_json = dir.path().join("grpc.json");
    let mut args = vec!["--backend", "grpc", "--router", &cluster.addr, "--request-rate", "4,inf", "--label", "grpc"];
    args.extend_from_slice(&workload);
    let grpc = bench(&args, &grpc_json);
    check_report(&grpc, "grpc", 2, (16, 48));
    assert_eq!(grpc["runs"][0]["x"].as_f64(), Some(4.0));
    assert!(grpc["runs"][1]["x"].is_null(), "an infinite rate has no x");
    // Poisson at 4 req/s: six sends spread over time; `inf`: all at once.
    let sent = |run: usize| -> Vec<f64> { grpc["runs"][run]["requests"].as_array().unwrap().iter().map(|r| f(&r["sent_s"])).collect() };
    assert!(sent(0).iter().copied().fold(0.0, f64::max) > 0.1, "Poisson sends spread: {:?}", sent(0));
    assert!(sent(1).iter().all(|&s| s < 0.5), "inf sends at once: {:?}", sent(1));

    let http_json = dir.path().join("http.json");
    let base = format!("http://{http}/v1");
    let mut args = vec!["--backend", "openai", "--base-url", &base, "--request-rate", "4,inf", "--label", "http"];
    args.extend_from_slice(&workload);
    let over_http = bench(&args, &http_json);
    check_report(&over_http, "openai", 2, (16, 48));
    // The same seed sends the same workload over either API.
    for run in 0..2 {
        let lens = |r: &Value| -> Vec<u64> { r["runs"][run]["requests"].as_array().unwrap().iter().map(|q| q["prompt_len"].as_u64().unwrap()).collect() };
        assert_eq!(lens(&grpc), lens(&over_http), "run {run}: the same prompts over both APIs");
    }

    // Closed loop, and an SLO no request can meet: goodput 0.
    let closed_json = dir.path().join("closed.json");
    let mut args = vec!["--router", &cluster.addr, "--concurrency", "2", "--num-prompts", "6", "--input-len", "24", "--output-len", "8", "--slo-ttft-ms", "0.001"];
    args.extend_from_slice(&["--label", "closed"]);
    let closed = bench(&args, &closed_json);
    let s = &closed["runs"][0]["summary"];
    assert_eq!(closed["runs"][0]["kind"], "concurrency");
    assert_eq!((s["completed"].as_u64(), s["good_requests"].as_u64(), f(&s["goodput"])), (Some(6), Some(0), 0.0));
    assert!(closed["runs"][0]["requests"].as_array().unwrap().iter().all(|r| r["prompt_tokens"].as_u64() == Some(24) && r["output_tokens"].as_u64() == Some(OUTPUT)));

    // Both sweeps in one plot.
    let png = dir.path().join("compare.png");
    let list = format!("{},{}", grpc_json.display(), http_json.display());
    let out = run_tandem(&["bench", "serve", "--plot-only", "--compare", &list, "--plot", png.to_str().unwrap()], RUN_LIMIT);
    assert!(out.status.success(), "plot: {}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&png).expect("the PNG");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 20_000, "{} bytes", bytes.len());
    // A concurrency report does not share an axis with rate reports.
    let mixed = format!("{},{}", grpc_json.display(), closed_json.display());
    let out = run_tandem(&["bench", "serve", "--plot-only", "--compare", &mixed, "--plot", png.to_str().unwrap()], RUN_LIMIT);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("mix"), "{}", String::from_utf8_lossy(&out.stderr));

    // Nothing listening: the warm-up fails with a message, no report of a dead server.
    let dead = dir.path().join("dead.json");
    let out = run_tandem(
        &["bench", "serve", "--tokenizer", smollm2_dir().to_str().unwrap(), "--router", "127.0.0.1:9", "--num-prompts", "2", "--output-json", dead.to_str().unwrap()],
        RUN_LIMIT,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("warm-up"), "{err}");
    assert!(!dead.exists());
}

#[test]
fn bench_serve_refuses_bad_flags() {
    for (args, needle) in [
        (&["--request-rate", "0"][..], "positive rate"),
        (&["--request-rate", "fast"], "positive rate"),
        (&["--input-len", "uniform:9:3"], "LO <= HI"),
        (&["--output-len", "normal:0:1"], "MEAN >= 1"),
        (&["--input-len", "zipf:1:2"], "uniform:LO:HI"),
        (&["--concurrency", "0"], "at least 1"),
        (&["--num-prompts", "0"], "at least 1"),
        (&["--slo-ttft-ms=-5"], "--slo-ttft-ms"),
        (&["--request-rate", "1", "--concurrency", "2"], "cannot be used with"),
        (&["--plot-only"], "--plot"),
        (&["--plot-only", "--plot", "/tmp/x.png"], "--compare"),
        (&["--backend", "openai", "--base-url", "https://h:1"], "no TLS"),
        (&["--dataset", "/nonexistent/sharegpt.json"], "/nonexistent/sharegpt.json"),
    ] {
        let mut all = vec!["bench", "serve", "--tokenizer", "tests/fixtures/tiny/llama", "--router", "127.0.0.1:9", "--warmup", "0"];
        all.extend_from_slice(args);
        let out = std::process::Command::new(tandem_tests::tandem_bin())
            .args(&all)
            .current_dir(tandem_tests::repo_root())
            .output()
            .expect("run tandem");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_tandem_up_prefills_on_the_decode_node() {
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let mut up = Proc::start(
        "up-colocated",
        &["up", "--colocated", "--model", model, "--kv-cache-mib", "256", "--listen", "127.0.0.1:0", "--http-listen", "off"],
    );
    let addr = tokio::task::block_in_place(|| up.wait_serving(START));
    let mut client = TandemClient::connect(format!("http://{addr}")).await.expect("connect");
    let health = client.health(api::HealthRequest {}).await.expect("health").into_inner();
    assert!(health.serving);
    assert_eq!((health.prefill_nodes, health.decode_nodes), (0, 1), "colocated: the decode node alone");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("colocated.json");
    let report = tokio::task::block_in_place(|| {
        bench(&["--router", &addr, "--concurrency", "2", "--num-prompts", "6", "--input-len", "uniform:16:48", "--output-len", "8", "--warmup", "1"], &out)
    });
    let s = &report["runs"][0]["summary"];
    assert_eq!((s["completed"].as_u64(), s["total_output_tokens"].as_u64()), (Some(6), Some(6 * OUTPUT)), "{s}");
    // Every request (warm-up included) was prefilled where it was decoded.
    assert!(up.stderr_shows("prefill=local", Duration::from_secs(5)), "{}", up.stderr());
    assert!(!up.stderr().contains("remote_prefill"), "{}", up.stderr());
}
