//! Helpers for tandem's end-to-end tests: find the `tandem` binary, run it with a time limit, and
//! get the real model through `tandem model pull` (idempotent; the first run downloads it); plus
//! long-running processes (`process`), etcd (`etcd`), a cluster of them (`cluster`) and a raw HTTP
//! client (`http`) and an OTLP trace collector (`otlp`).

pub mod process;
pub mod etcd;
pub mod cluster;
pub mod http;
pub mod otlp;
pub mod netns;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The `tandem` binary: `$TANDEM_BIN`, else the one cargo built next to this test executable.
pub fn tandem_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("test binaries live in target/<profile>/deps");
    let bin = profile_dir.join("tandem");
    assert!(bin.is_file(), "{} is missing: build it first (cargo build -p tandem-cli) or set TANDEM_BIN", bin.display());
    // `cargo test` does not rebuild another package's binary: refuse to test a stale one.
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).expect("binary mtime");
    if let Some(newer) = [
        "cli/src",
        "engine/src",
        "kernels/src",
        "kv-transfer/src",
        "node/src",
        "router/src",
        "prefill-node/src",
        "decode-node/src",
        "membership/src",
        "proto/proto",
    ].iter().find_map(|d| newer_than(&repo_root().join(d), built)) {
        panic!("{} is older than {}: rebuild it (cargo build -p tandem-cli) or run scripts/test.sh", bin.display(), newer.display());
    }
    bin
}

/// The first file under `dir` modified after `time`, if any.
fn newer_than(dir: &Path, time: std::time::SystemTime) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(p) = newer_than(&path, time) {
                return Some(p);
            }
        } else if entry.metadata().and_then(|m| m.modified()).is_ok_and(|m| m > time) {
            return Some(path);
        }
    }
    None
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the repo root").to_path_buf()
}

/// A committed fixture path under `tests/fixtures/`.
pub fn fixture(rel: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(rel)
}

/// Runs `tandem ARGS`, killing it after `limit`; returns its output.
pub fn run_tandem(args: &[&str], limit: Duration) -> Output {
    run_tandem_env(args, &[], limit)
}

/// [`run_tandem`] with extra environment variables.
pub fn run_tandem_env(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut child = Command::new(tandem_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tandem");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!("tandem {args:?} ran past {limit:?}; stderr: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The SmolLM2-135M-Instruct directory, pulled through the CLI on first use.
pub fn smollm2_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = run_tandem(&["model", "pull", "smollm2-135m-instruct"], Duration::from_secs(900));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "model pull failed: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(stdout.lines().last().expect("pull prints the directory").trim())
    })
    .clone()
}
