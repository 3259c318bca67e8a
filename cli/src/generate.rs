//! `tandem generate`: one prompt through an in-process engine; the completion streams to stdout,
//! timings and stats go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use tandem_engine::Device;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_engine::tokenizer::ChatMessage;
use tandem_engine::Engine;

use crate::CacheArgs;

/// Which model and how the engine is sized.
#[derive(Args, Clone, Debug)]
pub(crate) struct EngineArgs {
    /// A model directory, or a known model name pulled on first use.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub(crate) model: String,
    #[command(flatten)]
    pub(crate) cache: CacheArgs,
    /// KV cache size in MiB.
    #[arg(long, default_value_t = 1024)]
    pub(crate) kv_cache_mib: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_size: usize,
    /// Per-step token budget; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 2048)]
    pub(crate) max_num_batched_tokens: usize,
    /// Compute threads [default: all cores].
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N (bf16 weights and KV in device memory).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub(crate) device: Device,
    /// CUDA: the fraction of the GPU's total memory to use; the KV pool gets what weights and
    /// workspace leave of it (`--kv-cache-mib` sizes the CPU pool only).
    #[arg(long, default_value_t = 0.9)]
    pub(crate) gpu_memory_utilization: f32,
}

fn parse_device(s: &str) -> Result<Device, String> {
    s.parse::<Device>().map_err(|e| e.to_string())
}

impl EngineArgs {
    /// Resolves the model (pulling it if needed), sets up the thread pool and loads the engine.
    pub(crate) fn load(&self, prefix_caching: bool) -> anyhow::Result<(PathBuf, Engine)> {
        let (dir, cfg) = self.prepare(prefix_caching)?;
        let engine = Engine::load(&dir, cfg).with_context(|| format!("loading {}", dir.display()))?;
        Ok((dir, engine))
    }

    /// Resolves the model (pulling it if needed), sets up the thread pool and returns the model
    /// directory and the engine configuration, without loading.
    pub(crate) fn prepare(&self, prefix_caching: bool) -> anyhow::Result<(PathBuf, EngineConfig)> {
        let cfg = self.config(prefix_caching)?;
        let dir = crate::pull::resolve_model(&self.model, &self.cache.cache()?)?;
        Ok((dir, cfg))
    }

    /// Sets up the thread pool and returns the engine configuration (the model is not resolved:
    /// random weights need none).
    pub(crate) fn config(&self, prefix_caching: bool) -> anyhow::Result<EngineConfig> {
        if let Some(n) = self.threads {
            anyhow::ensure!(n > 0, "--threads must be at least 1");
            rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting up the thread pool")?;
        }
        Ok(EngineConfig {
            block_size: self.block_size,
            kv_cache_bytes: self.kv_cache_mib << 20,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_prefix_caching: prefix_caching,
            device: self.device,
            gpu_memory_utilization: self.gpu_memory_utilization,
            ..EngineConfig::default()
        })
    }

    /// The name clients use for the model: the known name given, or the directory's name.
    pub(crate) fn model_name(&self, dir: &std::path::Path) -> String {
        if std::path::Path::new(&self.model).is_dir() {
            dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
        } else {
            self.model.clone()
        }
    }
}

/// Arguments of `tandem generate`.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below this fraction of the top probability.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty on tokens already in the prompt or output (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings (repeatable); not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Wrap PROMPT as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// The prompt.
    prompt: String,
}

pub(crate) fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let load_start = Instant::now();
    let (dir, mut engine) = args.engine.load(true)?;
    eprintln!("loaded {} in {:.2}s", dir.display(), load_start.elapsed().as_secs_f64());
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = args.system {
            messages.push(ChatMessage { role: "system".into(), content: system });
        }
        messages.push(ChatMessage { role: "user".into(), content: args.prompt });
        Prompt::Chat(messages)
    } else {
        Prompt::Text(args.prompt)
    };
    let params = SamplingParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        stop: args.stop,
        ignore_eos: args.ignore_eos,
        ..SamplingParams::default()
    };
    let start = Instant::now();
    let id = engine.add_request(&prompt, params)?;
    let usage_prompt = engine.usage(id).map(|u| u.prompt_tokens).unwrap_or(0);
    let mut first_token = None;
    let mut generated = 0usize;
    let mut stdout = std::io::stdout().lock();
    let mut finish = None;
    while finish.is_none() {
        let outputs = engine.step()?;
        if outputs.is_empty() && !engine.has_unfinished() {
            anyhow::bail!("the engine stopped without finishing the request");
        }
        for out in outputs.into_iter().filter(|o| o.request == id) {
            first_token.get_or_insert_with(Instant::now);
            generated += out.token_ids.len();
            stdout.write_all(out.text.as_bytes())?;
            stdout.flush()?;
            finish = finish.or(out.finish);
        }
    }
    writeln!(stdout)?;
    let total = start.elapsed().as_secs_f64();
    let ttft = first_token.map(|t| (t - start).as_secs_f64()).unwrap_or(total);
    let decode_rate = if generated > 1 { (generated - 1) as f64 / (total - ttft).max(1e-9) } else { 0.0 };
    eprintln!(
        "prompt {usage_prompt} tokens, generated {generated} tokens ({:?}); time to first token {:.3}s, decode {:.1} tok/s, total {:.2}s",
        finish.unwrap_or(tandem_engine::engine::FinishReason::Abort),
        ttft,
        decode_rate,
        total
    );
    Ok(())
}
