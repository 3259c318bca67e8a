//! `tandem router|prefill|decode|up --check`: what deployments (the helm chart's test,
//! scripts/check-deploy.sh) run every rendered command line through. A good command line passes
//! without pulling, loading, binding or connecting anything; a bad one fails with a message naming
//! the flag.

use std::time::Duration;

use tandem_tests::run_tandem;

const LIMIT: Duration = Duration::from_secs(30);

/// Runs `tandem ARGS --check`; returns (success, stdout, stderr).
fn check(args: &[&str]) -> (bool, String, String) {
    let mut all = args.to_vec();
    all.push("--check");
    let out = run_tandem(&all, LIMIT);
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_string(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn a_good_node_command_line_passes_without_pulling_or_binding() {
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().to_str().unwrap();
    // The port is taken: a real start would fail to bind it; --check must not try.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    let (ok, out, err) = check(&[
        "decode", "--etcd", "http://127.0.0.1:1", "--listen", &listen, "--advertise", "10.1.2.3", "--model",
        "smollm2-135m-instruct", "--cache-dir", cache_dir, "--kv-connector", "tcp://0.0.0.0:7100", "--drain-timeout", "90",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out, "tandem decode: command line ok");
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 0, "--check pulled into the cache");
    for role in ["router", "prefill"] {
        let (ok, out, err) = check(&[role, "--etcd", "http://127.0.0.1:1"]);
        assert!(ok, "{role}: {err}");
        assert_eq!(out, format!("tandem {role}: command line ok"));
    }
    // One node per GPU: the GPUs stand for --device (no GPU is opened by --check).
    for backend in ["cuda-ipc", "nccl"] {
        let (ok, out, err) = check(&["up", "--devices", "cuda:0,cuda:1", "--kv-connector", backend]);
        assert!(ok, "{backend}: {err}");
        assert_eq!(out, "tandem up: command line ok");
    }
}

#[test]
fn bad_command_lines_fail_with_the_flag_named() {
    let cases: &[(&[&str], &str)] = &[
        (&["prefill", "--etcd", "http://e:2379", "--model", "no-such-model"], "--model \"no-such-model\" is neither a known model"),
        (&["prefill", "--etcd", "http://e:2379", "--kv-connector", "rdma://x"], "KV connector \"rdma://x\""),
        (&["decode", "--etcd", "http://e:2379", "--kv-connector", "nccl://0.0.0.0:7100"], "needs --device cuda"),
        (&["decode", "--etcd", "http://e:2379", "--device", "cuda", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5"),
        (&["decode", "--etcd", "http://e:2379", "--threads", "0"], "--threads must be at least 1"),
        (&["router", "--etcd", "http://e:2379", "--ttl", "0"], "--ttl must be at least 1"),
        (&["router", "--etcd", "http://e:2379", "--cluster-prefix", "/"], "--cluster-prefix \"/\" is empty"),
        (&["up", "--kv-connector", "cuda-ipc"], "needs --device cuda"),
        (&["up", "--devices", "cuda:0"], "--devices cuda:0: name two GPUs or more"),
        (&["up", "--devices", "cuda:1,cuda:1"], "--devices names cuda:1 twice"),
        (&["up", "--devices", "cuda:0,cuda:1,cuda:2"], "one prefill and one decode node, on two GPUs"),
    ];
    for (args, want) in cases {
        let (ok, out, err) = check(args);
        assert!(!ok, "{args:?} passed: {out}");
        assert!(err.starts_with("error: ") && err.contains(want), "{args:?}: {err}");
    }
    // Flags the CLI does not know are clap's (exit 2), --check or not.
    let out = run_tandem(&["router", "--etcd", "http://e:2379", "--no-such-flag", "--check"], LIMIT);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--no-such-flag'"));
}
