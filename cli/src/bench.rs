//! `tandem bench cpu`: prefill and decode throughput of the CPU engine, printed next to HF
//! transformers on the same model directory measured in the same run (tandem first, then HF, so
//! the two never share the cores).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tandem_engine::Engine;
use tandem_engine::engine::Prompt;
use tandem_engine::sampling::SamplingParams;

use crate::generate::EngineArgs;

/// Arguments of `tandem bench cpu`.
#[derive(Args, Debug)]
pub(crate) struct CpuBenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens generated per sequence in the decode measurement.
    #[arg(long = "gen", default_value_t = 32)]
    gen_tokens: usize,
    /// Batch sizes for decode, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<usize>,
    /// Python interpreter with torch and transformers for the reference.
    #[arg(long, default_value = "python3")]
    hf_python: String,
    /// The reference script.
    #[arg(long, default_value = "scripts/reference/hf_bench.py")]
    hf_script: PathBuf,
    /// Skip the HF reference.
    #[arg(long)]
    no_hf: bool,
}

struct Measured {
    prefill_tok_s: f64,
    decode_tok_s: Vec<(usize, f64)>,
}

pub(crate) fn run_cpu(args: CpuBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.prompt_len > 0 && args.gen_tokens > 1, "--prompt-len must be positive and --gen at least 2");
    anyhow::ensure!(!args.batches.is_empty() && args.batches.iter().all(|&b| b > 0), "--batches must list positive sizes");
    let threads = args.engine.threads.unwrap_or_else(rayon::current_num_threads);
    let (dir, mut engine) = args.engine.load(false)?;
    eprintln!("tandem: measuring on {} with {threads} threads", dir.display());
    let ours = measure(&mut engine, &args)?;
    drop(engine);
    let hf = if args.no_hf {
        None
    } else {
        eprintln!("HF transformers: running {} {}", args.hf_python, args.hf_script.display());
        Some(run_hf(&args, &dir, threads))
    };
    println!("tandem bench cpu — model {}, prompt {} tokens, {} generated tokens, {threads} threads", dir.display(), args.prompt_len, args.gen_tokens);
    println!("{:<22} {:>12} {:>12} {:>8}", "metric", "tandem", "HF f32", "ratio");
    let hf_ok = hf.as_ref().and_then(|r| r.as_ref().ok());
    let row = |name: &str, ours: f64, theirs: Option<f64>| match theirs {
        Some(t) => println!("{name:<22} {ours:>12.1} {t:>12.1} {:>7.2}x", ours / t),
        None => println!("{name:<22} {ours:>12.1} {:>12} {:>8}", "-", "-"),
    };
    row("prefill tok/s", ours.prefill_tok_s, hf_ok.map(|h| h.prefill_tok_s));
    for &(b, rate) in &ours.decode_tok_s {
        let theirs = hf_ok.and_then(|h| h.decode_tok_s.iter().find(|(hb, _)| *hb == b).map(|(_, r)| *r));
        row(&format!("decode tok/s, batch {b}"), rate, theirs);
    }
    if let Some(Err(e)) = hf {
        println!("HF reference not measured: {e:#}");
    }
    Ok(())
}

fn random_prompt(rng: &mut SmallRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(100..vocab as u32 - 100)).collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() }
}

fn measure(engine: &mut Engine, args: &CpuBenchArgs) -> anyhow::Result<Measured> {
    let vocab = engine.tokenizer().vocab_size().min(engine.model_config().vocab_size);
    let mut rng = SmallRng::seed_from_u64(0x7a6d);
    // Prefill: one prompt, one token out; warm-up then the median of three.
    let mut prefill = Vec::new();
    for i in 0..4 {
        let prompt = Prompt::Tokens(random_prompt(&mut rng, args.prompt_len, vocab));
        let start = Instant::now();
        engine.generate(&prompt, greedy(1))?;
        if i > 0 {
            prefill.push(args.prompt_len as f64 / start.elapsed().as_secs_f64());
        }
    }
    prefill.sort_by(f64::total_cmp);
    let mut decode = Vec::new();
    for &batch in &args.batches {
        let mut ids = HashSet::new();
        for _ in 0..batch {
            let prompt = Prompt::Tokens(random_prompt(&mut rng, args.prompt_len, vocab));
            ids.insert(engine.add_request(&prompt, greedy(args.gen_tokens + 1))?);
        }
        // Prefill phase: until every request has its first token.
        let mut started = HashSet::new();
        while started.len() < batch {
            for out in engine.step()? {
                started.insert(out.request);
            }
        }
        let start = Instant::now();
        let mut tokens = 0usize;
        while engine.has_unfinished() {
            let outputs = engine.step()?;
            tokens += outputs.iter().filter(|o| ids.contains(&o.request)).map(|o| o.token_ids.len()).sum::<usize>();
        }
        if tokens != batch * args.gen_tokens {
            bail!("decode produced {tokens} tokens, expected {}", batch * args.gen_tokens);
        }
        decode.push((batch, tokens as f64 / start.elapsed().as_secs_f64()));
    }
    Ok(Measured { prefill_tok_s: prefill[prefill.len() / 2], decode_tok_s: decode })
}

fn run_hf(args: &CpuBenchArgs, dir: &std::path::Path, threads: usize) -> anyhow::Result<Measured> {
    let batches: Vec<String> = args.batches.iter().map(|b| b.to_string()).collect();
    let out = Command::new(&args.hf_python)
        .arg(&args.hf_script)
        .arg("--model-dir")
        .arg(dir)
        .args(["--threads", &threads.to_string(), "--prompt-len", &args.prompt_len.to_string()])
        .args(["--gen", &args.gen_tokens.to_string(), "--batches", &batches.join(",")])
        .output()
        .with_context(|| format!("cannot run {}", args.hf_python))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        bail!("{} exited with {}: {}", args.hf_script.display(), out.status, tail.into_iter().rev().collect::<Vec<_>>().join(" | "));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().context("the HF script printed nothing")?;
    let v: serde_json::Value = serde_json::from_str(last).context("the HF script's last line is not JSON")?;
    let prefill_tok_s = v["prefill_tok_s"].as_f64().context("no prefill_tok_s")?;
    let decode_tok_s = args
        .batches
        .iter()
        .filter_map(|b| v["decode_tok_s"][b.to_string()].as_f64().map(|r| (*b, r)))
        .collect();
    Ok(Measured { prefill_tok_s, decode_tok_s })
}
