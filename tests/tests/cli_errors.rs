//! Bad input through the real binary: every case ends with a clear `error:` line and a non-zero
//! exit, never a panic.

use std::path::Path;
use std::time::Duration;

use tandem_tests::{fixture, run_tandem};

/// Runs tandem expecting failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = run_tandem(args, Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "tandem {args:?} should fail; stdout: {}", String::from_utf8_lossy(&out.stdout));
    assert!(!stderr.contains("panicked"), "tandem {args:?} panicked: {stderr}");
    assert!(stderr.contains("error"), "tandem {args:?}: no error message: {stderr}");
    stderr
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
}

fn tiny_copy() -> (tempfile::TempDir, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    copy_dir(&fixture("tiny/llama"), &dir);
    let s = dir.to_str().unwrap().to_string();
    (tmp, s)
}

#[test]
fn missing_or_corrupt_model_directories() {
    let err = fails(&["generate", "--model", "/nonexistent/tandem-model", "hi"]);
    assert!(err.contains("neither a directory nor a known model"), "{err}");

    let (_tmp, dir) = tiny_copy();
    std::fs::write(Path::new(&dir).join("config.json"), "{ not json").unwrap();
    let err = fails(&["generate", "--model", &dir, "hi"]);
    assert!(err.contains("invalid config.json"), "{err}");

    let (_tmp, dir) = tiny_copy();
    std::fs::remove_file(Path::new(&dir).join("tokenizer.json")).unwrap();
    let err = fails(&["generate", "--model", &dir, "hi"]);
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn unknown_architecture() {
    let (_tmp, dir) = tiny_copy();
    let path = Path::new(&dir).join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("LlamaForCausalLM", "Qwen3MoeForCausalLM");
    std::fs::write(&path, text).unwrap();
    let err = fails(&["generate", "--model", &dir, "hi"]);
    assert!(err.contains("unsupported architecture \"Qwen3MoeForCausalLM\""), "{err}");
}

#[test]
fn bad_safetensors_header_and_truncated_weights() {
    let (_tmp, dir) = tiny_copy();
    let path = Path::new(&dir).join("model.safetensors");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"garbage\"");
    std::fs::write(&path, bytes).unwrap();
    let err = fails(&["generate", "--model", &dir, "hi"]);
    assert!(err.contains("bad safetensors file"), "{err}");

    let (_tmp, dir) = tiny_copy();
    let path = Path::new(&dir).join("model.safetensors");
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    let err = fails(&["generate", "--model", &dir, "hi"]);
    assert!(err.contains("model.safetensors"), "{err}");
}

/// A minimal GGUF v3 file: one metadata string and one tensor of `ggml_type`.
fn gguf(ggml_type: u32, data_len: usize) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(1u64.to_le_bytes()); // tensors
    out.extend(1u64.to_le_bytes()); // metadata entries
    string(&mut out, "general.architecture");
    out.extend(8u32.to_le_bytes()); // string
    string(&mut out, "llama");
    string(&mut out, "token_embd.weight");
    out.extend(2u32.to_le_bytes());
    out.extend(256u64.to_le_bytes());
    out.extend(4u64.to_le_bytes());
    out.extend(ggml_type.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    out.extend((0..data_len).map(|i| (i * 37 % 251) as u8));
    out
}

#[test]
fn truncated_and_unsupported_gguf_files() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let out = out_dir.to_str().unwrap();

    let missing = tmp.path().join("missing.gguf");
    fails(&["model", "import-gguf", missing.to_str().unwrap(), out]);

    let full = gguf(0, 256 * 4 * 4);
    for cut in [3, 20, 60, full.len() - 100] {
        let path = tmp.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &full[..cut]).unwrap();
        let err = fails(&["model", "import-gguf", path.to_str().unwrap(), out]);
        assert!(err.contains("GGUF"), "cut at {cut}: {err}");
        assert!(!out_dir.exists(), "a failed import must leave nothing behind");
    }

    // Type 16 is IQ2_XXS, which tandem does not convert.
    let path = tmp.path().join("iq2.gguf");
    std::fs::write(&path, gguf(16, 4096)).unwrap();
    let err = fails(&["model", "import-gguf", path.to_str().unwrap(), out]);
    assert!(err.contains("IQ2_XXS") || err.contains("type 16"), "{err}");
    assert!(err.contains("supported"), "{err}");
    assert!(!out_dir.exists());
}

#[test]
fn prompt_over_the_context_limit_and_empty_prompt() {
    let dir = fixture("tiny/llama");
    let dir = dir.to_str().unwrap();
    let long = "hello world ".repeat(400);
    let err = fails(&["generate", "--model", dir, "--max-tokens", "4", &long]);
    assert!(err.contains("context limit of 256"), "{err}");
    let err = fails(&["generate", "--model", dir, "--max-tokens", "300", "hi"]);
    assert!(err.contains("context limit"), "{err}");
    let err = fails(&["generate", "--model", dir, ""]);
    assert!(err.contains("empty"), "{err}");
}

#[test]
fn invalid_sampling_parameters() {
    let dir = fixture("tiny/llama");
    let dir = dir.to_str().unwrap();
    for (flag, value, needle) in [
        ("--temperature", "-1", "temperature"),
        ("--temperature", "NaN", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-p", "1.5", "top_p"),
        ("--min-p", "2", "min_p"),
        ("--max-tokens", "0", "max_tokens"),
        ("--repetition-penalty", "0", "repetition_penalty"),
    ] {
        let err = fails(&["generate", "--model", dir, flag, value, "hi"]);
        assert!(err.contains("invalid sampling parameter") && err.contains(needle), "{flag} {value}: {err}");
    }
    // A value that is not a number is the command line's error (exit code 2).
    let out = run_tandem(&["generate", "--model", dir, "--temperature", "warm", "hi"], Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn tiny_model_generates_through_the_cli() {
    let dir = fixture("tiny/llama");
    let out = run_tandem(&["generate", "--model", dir.to_str().unwrap(), "--max-tokens", "8", "--ignore-eos", "hello"], Duration::from_secs(60));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("generated 8 tokens"));
}

#[test]
fn bad_or_unavailable_devices() {
    let err = fails(&["generate", "--device", "gpu", "hi"]);
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
    let err = fails(&["generate", "--device", "cuda:x", "hi"]);
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");

    // A head dim the CUDA kernels are not built for is refused before any GPU is touched.
    let (_tmp, dir) = tiny_copy();
    let err = fails(&["generate", "--model", &dir, "--device", "cuda", "hi"]);
    assert!(err.contains("head_dim 16 is not supported on CUDA"), "{err}");

    // SmolLM2 (head dim 64) on CUDA: without a GPU driver the start-up fails with a typed error
    // naming the missing library; with one, it generates.
    let has_driver = Path::new("/dev/nvidiactl").exists();
    let args = ["generate", "--device", "cuda", "--max-tokens", "4", "Hello"];
    if has_driver {
        let out = run_tandem(&args, Duration::from_secs(300));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    } else {
        let err = fails(&args);
        assert!(err.contains("device:") && err.contains("libcuda"), "{err}");
    }
}
