//! `tandem bench engine --device cuda`: the CUDA engine on a Llama-3.1-8B-geometry model with
//! random bf16 weights, every figure next to a ceiling measured in the same run:
//!
//! - ceilings: a device-to-device copy (bytes read + written per second) and a large cuBLAS bf16
//!   GEMM (FLOP/s), each the median of timed repeats after a warm-up, timed with CUDA events;
//! - decode step time at several batch sizes with a 1k context, as a percentage of the
//!   bandwidth floor (weights + KV bytes read per step ÷ the copy bandwidth);
//! - prefill tokens/s at several prompt lengths, as a percentage of the GEMM rate
//!   (model FLOPs per token incl. attention ÷ the GEMM rate);
//! - an offline workload (all requests submitted at once, ignore_eos) next to HF transformers on
//!   the same GPU in the same run (`scripts/reference/hf_offline_bench.py`), as a ratio and as a
//!   percentage of the workload's floor (prefill FLOPs at the GEMM rate + decode bytes at the
//!   copy bandwidth).
//!
//! Engine steps synchronise (they copy sampled tokens back), so step times are host wall
//! times of whole steps: what a client sees.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use clap::Args;
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tandem_engine::config::ModelConfig;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_engine::tokenizer::Tokenizer;
use tandem_engine::{Device, Engine};
use tandem_kernels::cuda::{self, GemmOut, Gpu, bf16};

/// Llama-3.1-8B's config.json (geometry only; weights are random). `bench disagg` runs it too.
pub(crate) const LLAMA31_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 128256, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
  "rope_theta": 500000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192},
  "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": 128001
}"#;

/// Tokens a decode-measurement sequence may generate: the timed steps plus the steps its batch
/// spends prefilling the later prompts.
const DECODE_ROOM: usize = 512;

/// Arguments of `tandem bench engine`.
#[derive(Args, Debug)]
pub(crate) struct EngineBenchArgs {
    /// The device to measure (the benchmark is for CUDA).
    #[arg(long, default_value = "cuda", value_parser = |s: &str| s.parse::<Device>().map_err(|e| e.to_string()))]
    device: Device,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// Context length of the decode measurement.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Prefill prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    prefill: Vec<usize>,
    /// Offline workload: requests, prompt and output tokens.
    #[arg(long, default_value_t = 256)]
    requests: usize,
    /// Offline workload prompt length.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Offline workload output length.
    #[arg(long, default_value_t = 256)]
    output_len: usize,
    /// A directory with tokenizer.json (any tokenizer within the model's vocabulary).
    #[arg(long, default_value = "tests/fixtures/tiny/llama")]
    tokenizer_dir: PathBuf,
    /// Fraction of GPU memory for the engine.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f32,
    /// Python with torch and transformers for the HF reference.
    #[arg(long, default_value = "python3")]
    hf_python: String,
    /// The HF reference script.
    #[arg(long, default_value = "scripts/reference/hf_offline_bench.py")]
    hf_script: PathBuf,
    /// Extra arguments for the HF script (e.g. "--requests 128").
    #[arg(long, default_value = "")]
    hf_args: String,
    /// Skip the HF reference.
    #[arg(long)]
    no_hf: bool,
    /// Only the ceilings and the per-batch breakdown (GEMMs and attention timed alone, attention
    /// at every split length): no engine, no HF.
    #[arg(long)]
    breakdown_only: bool,
    /// Synchronous steps: each step's tokens are read before the next step is scheduled (turns
    /// the engine's async scheduling off, for an A/B comparison).
    #[arg(long)]
    sync_steps: bool,
}

/// The two ceilings.
struct Ceilings {
    /// Bytes read + written per second by a device-to-device copy.
    copy_bytes_s: f64,
    /// bf16 GEMM FLOP/s.
    gemm_flops: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// [`Gpu::time_median_ms`] for closures returning `anyhow::Result`.
fn time_events(gpu: &Gpu, warmup: usize, reps: usize, f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    gpu.time_median_ms(warmup, reps, f)
}

fn measure_ceilings(ordinal: usize) -> anyhow::Result<(String, Ceilings)> {
    let gpu = Gpu::new(ordinal)?;
    let name = gpu.name();
    // Copy: 2 GiB, several times the L2.
    let n = 1usize << 30;
    let src = gpu.upload(&vec![bf16::from_f32(1.0); n])?;
    let mut dst = gpu.alloc_zeros::<bf16>(n)?;
    let stream = gpu.stream().clone();
    let ms = time_events(&gpu, 3, 10, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    let copy_bytes_s = 2.0 * (n * 2) as f64 / (ms * 1e-3);
    drop((src, dst));
    // GEMM: 8192³ bf16 on random data.
    let m = 8192usize;
    let mut rng = SmallRng::seed_from_u64(1);
    let host: Vec<bf16> = (0..m * m).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
    let a = gpu.upload(&host)?;
    let b = gpu.upload(&host)?;
    let mut c = gpu.alloc_zeros::<bf16>(m * m)?;
    let ms = time_events(&gpu, 3, 10, || {
        cuda::gemm(&gpu, &a.slice(..), &b.slice(..), GemmOut::Bf16(&mut c.slice_mut(..)), m, m, m)?;
        Ok(())
    })?;
    let gemm_flops = 2.0 * (m * m * m) as f64 / (ms * 1e-3);
    Ok((name, Ceilings { copy_bytes_s, gemm_flops }))
}

/// Where a decode step's time goes: one layer's GEMMs at `m = batch` and its decode attention over
/// `batch` sequences of `context` tokens, each timed alone with CUDA events, times the layer
/// count, plus the LM head (ms per step, and the bytes each part must read).
struct Breakdown {
    gemm_ms: f64,
    gemm_bytes: f64,
    attn_ms: f64,
    attn_bytes: f64,
    /// The launcher's split length, and attention at each split length (keys, ms per step).
    split: usize,
    attn_by_split: Vec<(usize, f64)>,
}

fn decode_breakdown(gpu: &Gpu, cfg: &ModelConfig, batch: usize, context: usize) -> anyhow::Result<Breakdown> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let qkv_w = (nh + 2 * nkv) * hd;
    let mut rng = SmallRng::seed_from_u64(3);
    let mut random = |n: usize| -> anyhow::Result<cuda::CudaSlice<bf16>> {
        let host: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.random_range(-0.05f32..0.05))).collect();
        Ok(gpu.upload(&host)?)
    };
    // (rows n, cols k) of each GEMM of a layer, then the LM head.
    let shapes = [(qkv_w, h), (h, nh * hd), (2 * i, h), (h, i)];
    let mut gemm_ms = 0.0;
    let mut gemm_bytes = 0.0;
    let mut plans = cuda::GemmPlans::new(gpu)?;
    for &(n, k) in shapes.iter().chain(std::iter::once(&(v, h))) {
        let layers = if n == v { 1.0 } else { cfg.num_layers as f64 };
        let w = random(n * k)?;
        let x = random(batch * k)?;
        let mut out = gpu.alloc_zeros::<f32>(batch * n)?;
        // As the engine runs it: the plan tuned for this shape (cached on disk), or cuBLAS.
        if gemm_tuning_on() {
            plans.tune(gpu, cuda::GemmShape { m: batch, n, k, f32_out: true }, &x.slice(..), &w.slice(..), cuda::TuneOut::F32(out.slice_mut(..)))?;
        }
        let ms = time_events(gpu, 2, 10, || {
            plans.gemm(gpu, &x.slice(..), &w.slice(..), GemmOut::F32 { out: &mut out.slice_mut(..), accumulate: false }, batch, n, k)?;
            Ok(())
        })?;
        gemm_ms += ms * layers;
        gemm_bytes += (n * k * 2) as f64 * layers;
    }
    plans.save();
    let block_size = 16;
    let blocks_per_seq = context.div_ceil(block_size);
    let num_blocks = batch * blocks_per_seq;
    let cache = random(num_blocks * 2 * nkv * block_size * hd)?;
    let q = random(batch * qkv_w)?;
    let mut out = gpu.alloc_zeros::<bf16>(batch * nh * hd)?;
    let cu_q = gpu.upload(&(0..=batch as i32).collect::<Vec<_>>())?;
    let start_pos = gpu.upload(&vec![context as i32 - 1; batch])?;
    let tables = gpu.upload(&(0..num_blocks as i32).collect::<Vec<_>>())?;
    let shape = cuda::AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, block_size, num_blocks, q_row_stride: qkv_w, scale: 1.0 / (hd as f32).sqrt() };
    let splits: Vec<usize> = (0..6).map(|i| cuda::DECODE_MIN_SPLIT << i).collect();
    let ws_len = splits.iter().map(|s| batch * nh * context.div_ceil(*s) * (hd + 2)).max().unwrap_or(0);
    let mut ws = gpu.alloc_zeros::<f32>(ws_len.max(cuda::decode_workspace_len(batch, &shape, context)).max(1))?;
    let (cu_q, start_pos, tables) = (cu_q.slice(..), start_pos.slice(..), tables.slice(..));
    let meta = cuda::AttnMeta {
        cu_q: &cu_q,
        start_pos: &start_pos,
        block_tables: &tables,
        num_chunks: batch,
        max_blocks: blocks_per_seq,
        max_q_len: 1,
        max_context: context,
    };
    let attn_ms = time_events(gpu, 2, 10, || {
        cuda::decode_attention(gpu, &q.slice(..), &meta, &shape, &cache.slice(..), &mut ws.slice_mut(..), &mut out.slice_mut(..))?;
        Ok(())
    })? * cfg.num_layers as f64;
    let mut attn_by_split = Vec::new();
    for &split in &splits {
        let ms = time_events(gpu, 2, 10, || {
            cuda::decode_attention_split(gpu, &q.slice(..), &meta, &shape, &cache.slice(..), split, &mut ws.slice_mut(..), &mut out.slice_mut(..))?;
            Ok(())
        })?;
        attn_by_split.push((split, ms * cfg.num_layers as f64));
    }
    let attn_bytes = (batch * context * 2 * nkv * hd * 2 * cfg.num_layers) as f64;
    let split = cuda::decode_split_keys(batch, nkv, context);
    Ok(Breakdown { gemm_ms, gemm_bytes, attn_ms, attn_bytes, split, attn_by_split })
}

/// For each GEMM of a layer (and the LM head) at `m` rows: cublasGemmEx's time and the fastest
/// of cuBLASLt's heuristic candidates, each timed alone (ms per step, all layers).
fn gemm_tuning(gpu: &Gpu, cfg: &ModelConfig, m: usize) -> anyhow::Result<Vec<String>> {
    let lt = cuda::LtGemm::new(gpu)?;
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let mut rng = SmallRng::seed_from_u64(5);
    let mut random = |n: usize| -> anyhow::Result<cuda::CudaSlice<bf16>> {
        let host: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.random_range(-0.05f32..0.05))).collect();
        Ok(gpu.upload(&host)?)
    };
    let mut lines = Vec::new();
    let (mut total_blas, mut total_best) = (0.0, 0.0);
    for (name, n, k, f32_out) in [("qkv", (nh + 2 * nkv) * hd, h, false), ("o", h, nh * hd, true), ("gate_up", 2 * i, h, false), ("down", h, i, true), ("lm_head", v, h, true)] {
        let layers = if name == "lm_head" { 1.0 } else { cfg.num_layers as f64 };
        let w = random(n * k)?;
        let x = random(m * k)?;
        let mut o32 = gpu.alloc_zeros::<f32>(if f32_out { m * n } else { 1 })?;
        let mut o16 = gpu.alloc_zeros::<bf16>(if f32_out { 1 } else { m * n })?;
        let out = if f32_out { cuda::TuneOut::F32(o32.slice_mut(..)) } else { cuda::TuneOut::Bf16(o16.slice_mut(..)) };
        let t = lt.time_candidates(gpu, cuda::GemmShape { m, n, k, f32_out }, &x.slice(..), &w.slice(..), out)?;
        let (best_idx, best) = t.candidates.iter().enumerate().map(|(idx, c)| (idx, c.1)).min_by(|a, b| a.1.total_cmp(&b.1)).unwrap_or((usize::MAX, f64::INFINITY));
        let blas = t.blas_ms;
        total_blas += blas * layers;
        total_best += best.min(blas) * layers;
        let bytes = (n * k * 2) as f64;
        lines.push(format!(
            "    m={m} {name} ({n}x{k}): cuBLAS {:.1} us ({:.2} TB/s, {:.0} TFLOP/s), best of {} cuBLASLt {:.1} us (#{best_idx})",
            blas * 1e3, bytes / (blas * 1e-3) / 1e12, 2.0 * (m * n * k) as f64 / (blas * 1e-3) / 1e12, t.candidates.len(), best * 1e3
        ));
    }
    lines.push(format!("    m={m}: all GEMMs of a step {total_blas:.2} ms with cuBLAS, {total_best:.2} ms with the best of each"));
    Ok(lines)
}

/// Parameters in the weight matrices, split into the per-token GEMM part and the embedding.
fn params(cfg: &ModelConfig) -> (f64, f64) {
    let (h, i, v) = (cfg.hidden_size as f64, cfg.intermediate_size as f64, cfg.vocab_size as f64);
    let qkv = h * ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) as f64;
    let o = (cfg.num_heads * cfg.head_dim) as f64 * h;
    let layer = qkv + o + 3.0 * h * i;
    let lm_head = v * h;
    (cfg.num_layers as f64 * layer + lm_head, v * h)
}

/// KV bytes per token (bf16, all layers).
fn kv_bytes_per_token(cfg: &ModelConfig) -> f64 {
    (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2) as f64
}

/// Weight bytes (bf16, all weights as the floor's definition counts them; a step really reads
/// the embedding table only for its rows).
fn weight_bytes(cfg: &ModelConfig) -> f64 {
    let (gemm_params, embed) = params(cfg);
    2.0 * (gemm_params + embed)
}

/// FLOPs of prefilling `len` tokens: GEMMs over every token (the LM head only for the last) plus
/// causal attention (QKᵀ and PV).
fn prefill_flops(cfg: &ModelConfig, len: usize) -> f64 {
    let (gemm_params, _) = params(cfg);
    let lm_head = (cfg.vocab_size * cfg.hidden_size) as f64;
    let per_token = 2.0 * (gemm_params - lm_head);
    let attn = 2.0 * 2.0 * (cfg.num_layers * cfg.num_heads * cfg.head_dim) as f64 * (len as f64 * (len as f64 + 1.0) / 2.0);
    per_token * len as f64 + 2.0 * lm_head + attn
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() }
}

fn random_prompt(rng: &mut SmallRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(10..vocab as u32)).collect()
}

struct HfResult {
    static_tok_s: f64,
    static_batch: u64,
    batch_tok_s: Option<f64>,
    batch1_ms: Option<f64>,
    note: String,
}

fn run_hf(args: &EngineBenchArgs) -> anyhow::Result<HfResult> {
    let out_file = std::env::temp_dir().join(format!("tandem-hf-bench-{}.json", std::process::id()));
    let status = Command::new(&args.hf_python)
        .arg(&args.hf_script)
        .arg("--out")
        .arg(&out_file)
        .args(["--requests", &args.requests.to_string(), "--prompt-len", &args.prompt_len.to_string()])
        .args(["--output-len", &args.output_len.to_string()])
        .args(args.hf_args.split_whitespace())
        .status()
        .with_context(|| format!("cannot run {}", args.hf_python))?;
    ensure!(status.success(), "{} exited with {status}", args.hf_script.display());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_file)?).context("the HF script's output is not JSON")?;
    let _ = std::fs::remove_file(&out_file);
    Ok(HfResult {
        static_tok_s: v["static"]["tok_s"].as_f64().context("no static.tok_s")?,
        static_batch: v["static"]["batch"].as_u64().unwrap_or(0),
        batch_tok_s: v["generate_batch"]["tok_s"].as_f64(),
        batch1_ms: v["batch1_ms_per_token"].as_f64(),
        note: format!("transformers {}, torch {}", v["transformers"].as_str().unwrap_or("?"), v["torch"].as_str().unwrap_or("?")),
    })
}

pub(crate) fn run(args: EngineBenchArgs) -> anyhow::Result<()> {
    let Device::Cuda { ordinal } = args.device else { bail!("tandem bench engine measures the CUDA engine: pass --device cuda[:N]") };
    ensure!(!args.batches.is_empty() && args.batches.iter().all(|&b| b > 0), "--batches must list positive sizes");
    ensure!(args.context > 0 && args.prompt_len > 0 && args.output_len > 1 && args.requests > 0, "lengths and --requests must be positive");
    let cfg = ModelConfig::from_json(LLAMA31_8B)?;
    let tokenizer = Tokenizer::from_model_dir(&args.tokenizer_dir).with_context(|| format!("loading a tokenizer from {}", args.tokenizer_dir.display()))?;

    eprintln!("measuring the ceilings ...");
    let (device_name, ceil) = measure_ceilings(ordinal)?;
    eprintln!("copy {:.2} TB/s, bf16 GEMM {:.0} TFLOP/s", ceil.copy_bytes_s / 1e12, ceil.gemm_flops / 1e12);
    let mut breakdowns = Vec::new();
    {
        let gpu = Gpu::new(ordinal)?;
        for &batch in &args.batches {
            let b = decode_breakdown(&gpu, &cfg, batch, args.context)?;
            eprintln!("decode batch {batch} parts: GEMMs {:.2} ms, attention {:.2} ms", b.gemm_ms, b.attn_ms);
            breakdowns.push((batch, b));
        }
    }

    if args.breakdown_only {
        let gpu = Gpu::new(ordinal)?;
        let mut tuning = Vec::new();
        for &m in args.batches.iter().chain(&args.prefill) {
            tuning.extend(gemm_tuning(&gpu, &cfg, m)?);
        }
        print_header(&device_name, &ceil, !args.sync_steps);
        print_breakdown(&ceil, &breakdowns, &[]);
        println!("GEMMs: cublasGemmEx against the fastest cuBLASLt candidate");
        for l in tuning {
            println!("{l}");
        }
        return Ok(());
    }

    let max_batch = *args.batches.iter().max().unwrap_or(&1);
    let max_prefill = args.prefill.iter().copied().max().unwrap_or(0);
    let engine_cfg = EngineConfig {
        device: args.device,
        gpu_memory_utilization: args.gpu_memory_utilization,
        max_num_seqs: max_batch.max(args.requests),
        max_num_batched_tokens: max_prefill.max(8192),
        max_model_len: Some((args.context + DECODE_ROOM).max(max_prefill + 1).max(args.prompt_len + args.output_len)),
        enable_prefix_caching: false,
        async_scheduling: !args.sync_steps,
        ..EngineConfig::default()
    };
    eprintln!("creating Llama-3.1-8B-geometry random bf16 weights on {device_name} ...");
    let t = Instant::now();
    let mut engine = Engine::with_random_weights(&cfg, tokenizer, engine_cfg, 0x5eed)?;
    eprintln!("engine ready in {:.1} s ({} KV blocks)", t.elapsed().as_secs_f64(), engine.current_load().total_blocks);
    let vocab = cfg.vocab_size;
    let mut rng = SmallRng::seed_from_u64(0x7a6d);

    // Decode: `batch` sequences at `context` tokens, then the median step time over 24 steps. The
    // prompts prefill in chunks, so the first sequences decode while the last prefill: they get
    // room for `DECODE_ROOM` tokens and are aborted once the steps are timed.
    let steps = 24;
    let mut decode = Vec::new();
    let mut step_parts = Vec::new();
    for &batch in &args.batches {
        let mut ids = Vec::with_capacity(batch);
        for _ in 0..batch {
            ids.push(engine.add_request(&Prompt::Tokens(random_prompt(&mut rng, args.context, vocab)), greedy(DECODE_ROOM))?);
        }
        // Until every sequence has its first token (prefills run in chunks beside early decodes).
        let mut started = std::collections::HashSet::new();
        while started.len() < batch {
            started.extend(engine.step()?.into_iter().map(|o| o.request));
        }
        let mut times = Vec::new();
        engine.reset_step_times();
        for _ in 0..steps {
            let t = Instant::now();
            let n = engine.step()?.len();
            times.push(t.elapsed().as_secs_f64());
            ensure!(n == batch, "a decode step produced {n} tokens for {batch} sequences");
        }
        for id in ids {
            engine.abort(id);
        }
        ensure!(!engine.has_unfinished(), "requests left after the decode measurement");
        let host = engine.step_times();
        let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / host.steps.max(1) as f64;
        let host = format!(
            "schedule {:.2} ms, forward (enqueue) {:.2} ms, sample (incl. GPU wait) {:.2} ms, accept {:.2} ms",
            per_step(host.schedule),
            per_step(host.forward),
            per_step(host.sample),
            per_step(host.accept)
        );
        eprintln!("decode batch {batch} per step: {host}");
        let step = median(times[4..].to_vec());
        let bytes = weight_bytes(&cfg) + batch as f64 * (args.context + steps / 2) as f64 * kv_bytes_per_token(&cfg);
        let floor = bytes / ceil.copy_bytes_s;
        decode.push((batch, step, floor));
        step_parts.push((batch, host));
        eprintln!("decode batch {batch}: {:.2} ms/step (floor {:.2} ms)", step * 1e3, floor * 1e3);
    }

    // Prefill: one prompt per measurement, one chunk, the median of 3 after a warm-up.
    let mut prefill = Vec::new();
    for &len in &args.prefill {
        let mut times = Vec::new();
        for i in 0..4 {
            let prompt = Prompt::Tokens(random_prompt(&mut rng, len, vocab));
            let t = Instant::now();
            engine.generate(&prompt, greedy(1))?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let secs = median(times);
        let util = prefill_flops(&cfg, len) / secs / ceil.gemm_flops;
        prefill.push((len, len as f64 / secs, util));
        eprintln!("prefill {len}: {:.0} tok/s ({:.0}% of the GEMM rate)", len as f64 / secs, util * 100.0);
    }

    // Offline workload.
    eprintln!("offline workload: {} requests x {} prompt / {} output tokens ...", args.requests, args.prompt_len, args.output_len);
    for _ in 0..args.requests {
        engine.add_request(&Prompt::Tokens(random_prompt(&mut rng, args.prompt_len, vocab)), greedy(args.output_len))?;
    }
    let t = Instant::now();
    let mut produced = 0usize;
    // Phases: until every request has its first token (prefill, with early decodes beside it),
    // then pure decode steps.
    let mut started = std::collections::HashSet::new();
    let (mut prefill_phase, mut prefill_steps, mut decode_steps) = (None, 0usize, 0usize);
    while engine.has_unfinished() {
        let outs = engine.step()?;
        produced += outs.iter().map(|o| o.token_ids.len()).sum::<usize>();
        if prefill_phase.is_none() {
            prefill_steps += 1;
            started.extend(outs.iter().map(|o| o.request));
            if started.len() == args.requests {
                prefill_phase = Some(t.elapsed().as_secs_f64());
            }
        } else {
            decode_steps += 1;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let prefill_phase = prefill_phase.unwrap_or(secs);
    ensure!(produced == args.requests * args.output_len, "the workload produced {produced} tokens");
    // The decode phase's floor: each step reads the weights and every sequence's KV.
    let decode_floor = {
        let first = args.output_len - 1 - decode_steps;
        let kv: f64 = (first..args.output_len - 1).map(|i| (args.prompt_len + i) as f64).sum::<f64>() * args.requests as f64 * kv_bytes_per_token(&cfg);
        (decode_steps as f64 * weight_bytes(&cfg) + kv) / ceil.copy_bytes_s
    };
    let phases = format!(
        "prefill phase {prefill_steps} steps {:.2} s; decode phase {decode_steps} steps {:.2} s ({:.2} ms/step, {:.0}% of its floor {:.2} s)",
        prefill_phase,
        secs - prefill_phase,
        (secs - prefill_phase) / decode_steps.max(1) as f64 * 1e3,
        decode_floor / (secs - prefill_phase) * 100.0,
        decode_floor
    );
    eprintln!("offline: {phases}");
    let ours = produced as f64 / secs;
    let workload_floor = {
        let prefill = args.requests as f64 * prefill_flops(&cfg, args.prompt_len) / ceil.gemm_flops;
        let steps = args.output_len - 1;
        let kv: f64 = (0..steps).map(|i| (args.prompt_len + i) as f64).sum::<f64>() * args.requests as f64 * kv_bytes_per_token(&cfg);
        let decode = (steps as f64 * weight_bytes(&cfg) + kv) / ceil.copy_bytes_s;
        produced as f64 / (prefill + decode)
    };
    drop(engine);
    let hf = if args.no_hf { None } else { Some(run_hf(&args)) };

    print_header(&device_name, &ceil, !args.sync_steps);
    for (batch, step, floor) in &decode {
        println!(
            "{:<44} {:>11.2} ms {:>11.2} ms {:>8.0}%",
            format!("decode step, batch {batch}, {} ctx", args.context),
            step * 1e3,
            floor * 1e3,
            floor / step * 100.0
        );
    }
    print_breakdown(&ceil, &breakdowns, &decode);
    for (batch, host) in &step_parts {
        println!("  batch {batch}, engine step wall time per step: {host}");
    }
    for (len, tok_s, util) in &prefill {
        println!("{:<44} {:>10.0} t/s {:>10.0} t/s {:>8.0}%", format!("prefill {len} tokens"), tok_s, tok_s / util, util * 100.0);
    }
    println!(
        "{:<44} {:>10.0} t/s {:>10.0} t/s {:>8.0}%",
        format!("offline {} x {}/{} (floor)", args.requests, args.prompt_len, args.output_len),
        ours,
        workload_floor,
        ours / workload_floor * 100.0
    );
    println!("  {phases}");
    match hf {
        Some(Ok(h)) => {
            println!("{:<44} {:>10.0} t/s {:>14} {:>8.2}x", format!("HF static generate, batch {}", h.static_batch), h.static_tok_s, "", ours / h.static_tok_s);
            if let Some(b) = h.batch_tok_s {
                println!("{:<44} {:>10.0} t/s {:>14} {:>8.2}x", "HF generate_batch", b, "", ours / b);
            }
            if let Some(ms) = h.batch1_ms {
                let ours_b1 = decode.iter().find(|d| d.0 == 1).map(|d| d.1 * 1e3);
                match ours_b1 {
                    Some(o) => println!("{:<44} {:>11.2} ms {:>14} {:>8.2}x", "HF batch-1 decode (vs tandem batch 1)", ms, "", ms / o),
                    None => println!("{:<44} {:>11.2} ms", "HF batch-1 decode", ms),
                }
            }
            println!("HF: {}", h.note);
        }
        Some(Err(e)) => println!("HF reference not measured: {e:#}"),
        None => {}
    }
    Ok(())
}

/// Whether the engine tunes its decode GEMMs (`TANDEM_GEMM_TUNING=0` turns it off).
fn gemm_tuning_on() -> bool {
    std::env::var("TANDEM_GEMM_TUNING").map_or(true, |v| v != "0")
}

fn print_header(device_name: &str, ceil: &Ceilings, async_scheduling: bool) {
    let on_off = |on: bool| if on { "on" } else { "off" };
    let graphs = std::env::var("TANDEM_CUDA_GRAPHS").map_or(true, |v| v != "0");
    println!(
        "tandem bench engine — {device_name}, Llama-3.1-8B geometry, random bf16 weights, block 16, CUDA graphs {}, GEMM tuning {}, async scheduling {}",
        on_off(graphs),
        on_off(graphs && gemm_tuning_on()),
        on_off(async_scheduling)
    );
    println!("ceilings measured in this run: device copy {:.2} TB/s (read + write), cuBLAS bf16 GEMM 8192^3 {:.0} TFLOP/s", ceil.copy_bytes_s / 1e12, ceil.gemm_flops / 1e12);
    println!("{:<44} {:>14} {:>14} {:>9}", "metric", "tandem", "ceiling", "% / ratio");
}

/// Each part of a decode step timed alone, next to its bytes at the copy bandwidth; with the
/// whole step's time (`decode`: batch, seconds, floor) also what the parts leave over.
fn print_breakdown(ceil: &Ceilings, breakdowns: &[(usize, Breakdown)], decode: &[(usize, f64, f64)]) {
    let part = |name: String, ms: f64, bytes: f64| {
        let floor_ms = bytes / ceil.copy_bytes_s * 1e3;
        let tb_s = bytes / (ms * 1e-3) / 1e12;
        println!("{:<44} {:>11.2} ms {:>11.2} ms {:>8.0}%", format!("{name} ({tb_s:.2} TB/s)"), ms, floor_ms, floor_ms / ms * 100.0);
    };
    for (batch, b) in breakdowns {
        part(format!("  batch {batch}: GEMMs alone"), b.gemm_ms, b.gemm_bytes);
        part(format!("  batch {batch}: attention alone, split {}", b.split), b.attn_ms, b.attn_bytes);
        for &(split, ms) in &b.attn_by_split {
            part(format!("    attention, split {split}"), ms, b.attn_bytes);
        }
        if let Some(d) = decode.iter().find(|d| d.0 == *batch) {
            println!("{:<44} {:>11.2} ms", format!("  batch {batch}: the rest of the step"), d.1 * 1e3 - b.gemm_ms - b.attn_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama31_8b_figures_match_the_anchors() {
        let cfg = ModelConfig::from_json(LLAMA31_8B).unwrap();
        let (gemm_params, embed) = params(&cfg);
        // 8.03 B parameters in all: the GEMM weights plus the embedding table.
        assert!(((gemm_params + embed) / 1e9 - 8.03).abs() < 0.01, "{}", gemm_params + embed);
        // 128 KiB of KV per token.
        assert_eq!(kv_bytes_per_token(&cfg), 131072.0);
        // Prefill of 2k tokens at ~795 TFLOP/s takes at least ~37 ms.
        let secs = prefill_flops(&cfg, 2048) / 795e12;
        assert!((0.036..0.045).contains(&secs), "{secs}");
    }
}
