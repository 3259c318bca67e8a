//! The KV-transfer commands through the real binary: the conformance suite and the benchmark run end to
//! end on loopback, and bad connector specs or arguments end in a clear error and a non-zero exit.

use std::time::Duration;

use tandem_tests::run_tandem;

fn stdout_of(args: &[&str]) -> String {
    let out = run_tandem(args, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "tandem {args:?} failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    stdout
}

fn fails(args: &[&str]) -> String {
    let out = run_tandem(args, Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "tandem {args:?} should fail");
    assert!(!stderr.contains("panicked"), "tandem {args:?} panicked: {stderr}");
    assert!(stderr.contains("error"), "tandem {args:?}: no error message: {stderr}");
    stderr
}

#[test]
fn conformance_command_runs_cases_against_a_backend() {
    let out = stdout_of(&["kv", "conformance", "tcp", "--case", "corrupted_chunk_detected"]);
    assert!(out.contains("ok    corrupted_chunk_detected"), "{out}");
    let out = stdout_of(&["kv", "conformance", "inproc", "--case", "round_trip_bit_exact"]);
    assert!(out.contains("all 1 conformance cases passed"), "{out}");
    let list = stdout_of(&["kv", "conformance", "tcp", "--list"]);
    assert!(list.lines().count() >= 18 && list.contains("large_transfer_256mib"), "{list}");
}

#[test]
fn bench_kv_prints_ratios_against_a_raw_socket() {
    let out = stdout_of(&["bench", "kv", "--backend", "inproc", "--sizes", "1", "--iters", "2", "--latency-iters", "10"]);
    assert!(out.contains("raw socket GB/s"), "{out}");
    let row = out.lines().find(|l| l.trim_start().starts_with("1 MiB")).expect("a 1 MiB row");
    let ratio: f64 = row.split_whitespace().nth(4).unwrap().trim_end_matches('%').parse().unwrap();
    assert!(ratio > 0.0, "{row}");
    assert!(out.contains("latency of 64 KiB transfers (10 runs)"), "{out}");
    // Pools of twice the largest transfer, unless --exact-pool.
    assert!(out.contains("pools of 2 MiB in cpu,"), "{out}");
    let exact = stdout_of(&["bench", "kv", "--backend", "inproc", "--sizes", "1", "--iters", "1", "--latency-iters", "1", "--exact-pool"]);
    assert!(exact.contains("pools of 1 MiB in cpu (--exact-pool),"), "{exact}");
}

#[test]
fn bench_kv_times_a_receiver_in_a_second_process() {
    // The receivers in a child process (this binary again), each transfer timed on the host's
    // monotonic clock from the sender's send_ready to the child seeing it verified.
    let out = stdout_of(&["bench", "kv", "--backend", "tcp", "--two-processes", "--sizes", "1,2", "--iters", "2", "--latency-iters", "5"]);
    assert!(out.contains("(receivers in process "), "{out}");
    for size in ["1 MiB", "2 MiB"] {
        let row = out.lines().find(|l| l.trim_start().starts_with(size)).unwrap_or_else(|| panic!("no {size} row: {out}"));
        let gbs: f64 = row.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!(gbs > 0.0 && gbs.is_finite(), "{row}");
    }
    assert!(out.contains("latency of 64 KiB transfers (5 runs)"), "{out}");
    assert!(out.contains("self-check: 6 transfers sent"), "{out}"); // 2 sizes x (1 warm-up + 2)
    let err = fails(&["bench", "kv", "--backend", "inproc", "--two-processes"]);
    assert!(err.contains("--two-processes"), "{err}");
}

#[test]
fn bad_specs_and_arguments_are_refused() {
    let err = fails(&["kv", "conformance", "carrier-pigeon"]);
    assert!(err.contains("unknown backend"), "{err}");
    let err = fails(&["kv", "conformance", "tcp://not-an-address"]);
    assert!(err.contains("not a HOST:PORT"), "{err}");
    let err = fails(&["kv", "conformance", "plugin:/nonexistent/libx.so", "--case", "zero_block_transfer"]);
    assert!(err.contains("libx.so"), "{err}");
    let err = fails(&["kv", "conformance", "tcp", "--case", "no_such_case"]);
    assert!(err.contains("no conformance case"), "{err}");
    let err = fails(&["bench", "kv", "--backend", "tcp", "--sizes", "0"]);
    assert!(err.contains("must all be > 0"), "{err}");
    let err = fails(&["bench", "kv", "--backend", "inproc", "--sizes", "4294967295"]);
    assert!(err.contains("too large"), "{err}");
    let err = fails(&["bench", "kv", "--backend", "plugin:"]);
    assert!(err.contains("empty plugin path"), "{err}");
    // Device backends on a machine without a GPU: one clear error, never a panic or a quiet switch.
    let err = fails(&["kv", "conformance", "cuda-ipc", "--device", "cuda:0"]);
    assert!(err.contains("libcuda") || err.contains("GPU"), "{err}");
    let err = fails(&["kv", "conformance", "cuda-ipc"]);
    assert!(err.contains("cuda-ipc"), "{err}");
    let err = fails(&["bench", "kv", "--backend", "cuda-ipc", "--device", "cuda:x"]);
    assert!(err.contains("unknown device"), "{err}");
}

/// The values of a report row: the whitespace-separated fields after `label_end`, without units.
fn row_values<'a>(out: &'a str, starts: &str, label_end: &str) -> Vec<&'a str> {
    let row = out
        .lines()
        .find(|l| l.starts_with(starts))
        .unwrap_or_else(|| panic!("no {starts:?} row: {out}"));
    let (_, values) = row.split_once(label_end).unwrap_or_else(|| panic!("{row}"));
    values
        .split_whitespace()
        .filter(|v| !matches!(*v, "ms" | "t/s"))
        .collect()
}

#[test]
fn bench_disagg_compares_the_cluster_with_the_engine_alone() {
    let tokenizer = tandem_tests::fixture("tiny/llama");
    let mut args: Vec<&str> =
        "bench disagg --device cpu --model-config tiny --prompt-len 64 --requests 2 \
        --clients 8 --load-prompt-len 16 --load-output-len 8 --timeout-s 60 --tokenizer-dir"
            .split_whitespace()
            .collect();
    args.push(tokenizer.to_str().unwrap());
    let out = stdout_of(&args);
    assert!(
        out.contains("tiny geometry") && out.contains("KV backend tcp"),
        "{out}"
    );
    let number = |v: &str| -> f64 {
        v.trim_end_matches(['x', '%'])
            .parse()
            .unwrap_or_else(|_| panic!("{v:?} in {out}"))
    };
    // TTFT: engine alone, cluster, cluster / engine alone.
    let ttft = row_values(&out, "TTFT, 64-token prompt (median of 2)", ")");
    let (engine, cluster, ratio) = (number(ttft[0]), number(ttft[1]), number(ttft[2]));
    assert!(
        engine > 0.0 && cluster > 0.0 && ttft[2].ends_with('x'),
        "{out}"
    );
    assert!(
        (ratio - cluster / engine).abs() <= 0.01 * ratio + 0.01,
        "{out}"
    );
    // Throughput under load: engine alone offline, cluster, cluster as a percentage of it.
    let load = row_values(&out, "load 8 x 16/8 output tok/s", "tok/s");
    let (engine, cluster, percent) = (number(load[0]), number(load[1]), number(load[2]));
    assert!(
        engine > 0.0 && cluster > 0.0 && load[2].ends_with('%'),
        "{out}"
    );
    assert!(
        (percent - cluster / engine * 100.0).abs() <= 0.01 * percent + 0.2,
        "{out}"
    );
    // Per-request TTFTs: the warm-up and the 2 timed requests, on each side.
    for side in ["engine alone", "cluster"] {
        let (_, times) = out
            .lines()
            .find_map(|l| l.split_once(&format!("): {side} ")))
            .unwrap_or_else(|| panic!("{side}: {out}"));
        assert_eq!(
            times
                .split_whitespace()
                .map(number)
                .filter(|t| *t > 0.0)
                .count(),
            3,
            "{out}"
        );
    }
}
