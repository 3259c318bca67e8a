//! `tandem bench disagg`: what splitting prefill from decode costs, each figure next to the engine
//! alone measured in the same run on the same weights:
//!
//! - time to first token of fresh prompts (distinct random token ids: no prefix-cache hits), one at a
//!   time after a warm-up: from `Engine::add_request` to the first token for the engine alone, from
//!   sending the gRPC request to the first streamed token through the cluster (router → decode node →
//!   remote prefill on the prefill node → KV transfer → first token);
//! - output tokens per second under load: `--clients` requests all at once (ignore_eos), stepped to
//!   completion on the engine alone (offline) and as concurrent gRPC streams through the cluster.
//!
//! The cluster is what `tandem up` runs (router + one prefill + one decode node in this process,
//! in-memory membership), with the decode node sending every prompt to the prefill node. The engine
//! alone runs first and is dropped (its GPU memory freed) before the nodes load, so on one GPU the
//! nodes split the same `--gpu-memory-utilization` as `tandem up` splits it.
//!
//! Weights are random (`--model-config` picks the geometry; the tokenizer only detokenizes). On CUDA
//! they come from `Engine::with_random_weights`; the CPU engine has no random weights, so on the CPU
//! the same geometry is written as a random f32 checkpoint into a temporary directory first. Every
//! phase is time-bound (`--timeout-s`): a stuck phase is an error, never a hang.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail, ensure};
use clap::{Args, ValueEnum};
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tandem_engine::config::ModelConfig;
use tandem_engine::engine::{EngineConfig, Prompt};
use tandem_engine::sampling::SamplingParams;
use tandem_engine::tokenizer::Tokenizer;
use tandem_engine::{Device, Engine};
use tandem_kv_transfer::{ConnectorConfig, ConnectorSpec};
use tandem_node::{NodeSetup, Weights};
use tandem_proto::v1 as api;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_router::Policy;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::bench_engine::LLAMA31_8B;
use crate::cluster::{EmbeddedCluster, EmbeddedOptions, status_error};


/// A small geometry for CPU smoke runs (GQA, head_dim 64 so CUDA runs it too).
const TINY: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
  "vocab_size": 512, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
  "rope_theta": 10000.0, "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2
}"#;

/// The weights' seed: the engine alone and both nodes get the same weights.
pub(crate) const SEED: u64 = 0x5eed;

/// Prompt token ids are drawn from `FIRST_TOKEN..vocab` (clear of the usual special ids).
const FIRST_TOKEN: u32 = 10;

/// A model geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Geometry {
    /// Llama-3.1-8B (32 layers, hidden 4096, 32 heads / 8 KV heads, vocab 128256).
    #[value(name = "llama3.1-8b")]
    Llama31_8b,
    /// 4 layers, hidden 256, 4 heads / 2 KV heads, vocab 512 (CPU smoke runs).
    Tiny,
}

impl Geometry {
    pub(crate) fn config_json(self) -> &'static str {
        match self {
            Geometry::Llama31_8b => LLAMA31_8B,
            Geometry::Tiny => TINY,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Geometry::Llama31_8b => "llama3.1-8b-random",
            Geometry::Tiny => "tiny-random",
        }
    }
}

/// Arguments of `tandem bench disagg`.
#[derive(Args, Debug)]
pub(crate) struct DisaggBenchArgs {
    /// Where the engines run: cuda, cuda:N or cpu.
    #[arg(long, default_value = "cuda", value_parser = |s: &str| s.parse::<Device>().map_err(|e| e.to_string()))]
    device: Device,
    /// The nodes on two GPUs (e.g. cuda:0,cuda:1): the prefill node on the first, the decode node on
    /// the second, each with the whole --gpu-memory-utilization of its GPU; the engine alone runs on
    /// the first (--device is then ignored).
    #[arg(long, value_delimiter = ',', value_name = "GPUS", value_parser = crate::cluster::parse_gpu)]
    devices: Vec<Device>,
    /// The model geometry (random weights).
    #[arg(long, value_enum, default_value = "llama3.1-8b")]
    model_config: Geometry,
    /// A directory with tokenizer.json (any tokenizer within the model's vocabulary).
    #[arg(long, default_value = "tests/fixtures/tiny/llama")]
    tokenizer_dir: PathBuf,
    /// Prompt length of the time-to-first-token measurement.
    #[arg(long, default_value_t = 2048)]
    prompt_len: usize,
    /// Timed time-to-first-token requests (after one warm-up).
    #[arg(long, default_value_t = 5)]
    requests: usize,
    /// KV-transfer backend between the nodes: auto (cuda-ipc for --device cuda, tcp otherwise), tcp,
    /// cuda-ipc, or nccl (with --devices: two GPUs).
    #[arg(long, default_value = "auto")]
    kv_connector: String,
    /// CUDA: the fraction of GPU memory for the engine alone, and for both nodes together (the
    /// prefill node takes half, the decode node the rest, as in `tandem up`); with --devices, for
    /// each node on its own GPU.
    #[arg(long, default_value_t = 0.85)]
    gpu_memory_utilization: f32,
    /// Load: requests in flight at once.
    #[arg(long, default_value_t = 256)]
    clients: usize,
    /// Load: prompt tokens per request.
    #[arg(long, default_value_t = 512)]
    load_prompt_len: usize,
    /// Load: output tokens per request (ignore_eos).
    #[arg(long, default_value_t = 128)]
    load_output_len: usize,
    /// Skip the load measurement.
    #[arg(long)]
    no_load: bool,
    /// Most seconds any one phase may take (loading, the TTFT requests, the load); past it the
    /// benchmark fails.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
}

/// The prompts both sides run.
struct Workload {
    /// One warm-up prompt, then the timed ones.
    ttft: Vec<Vec<u32>>,
    load: Vec<Vec<u32>>,
    output_len: usize,
}

/// What the engine alone measured.
struct EngineFigures {
    num_blocks: usize,
    ttft_s: Vec<f64>,
    load_tok_s: Option<f64>,
}

/// What the cluster measured.
struct ClusterFigures {
    prefill_backend: String,
    decode_backend: String,
    prefill_blocks: usize,
    decode_blocks: usize,
    ttft_s: Vec<f64>,
    load_tok_s: Option<f64>,
}

/// Where the weights come from.
enum Source {
    /// `Engine::with_random_weights` (CUDA).
    Random { config_json: String },
    /// A random checkpoint written for the CPU engine.
    Checkpoint(TempCheckpoint),
}

impl Source {
    /// What builds the engine alone (on its own thread).
    fn loader(
        &self,
        tokenizer_dir: &Path,
        cfg: EngineConfig,
    ) -> Box<dyn FnOnce() -> anyhow::Result<Engine> + Send> {
        match self {
            Source::Random { config_json } => {
                let (json, dir) = (config_json.clone(), tokenizer_dir.to_path_buf());
                Box::new(move || {
                    let tokenizer = Tokenizer::from_model_dir(&dir)?;
                    Ok(Engine::with_random_weights(
                        &ModelConfig::from_json(&json)?,
                        tokenizer,
                        cfg,
                        SEED,
                    )?)
                })
            }
            Source::Checkpoint(c) => {
                let dir = c.dir.clone();
                Box::new(move || Ok(Engine::load(&dir, cfg)?))
            }
        }
    }

    /// The nodes' model directory and weights: the same as the engine alone's.
    fn node_weights(&self, tokenizer_dir: &Path) -> (PathBuf, Weights) {
        match self {
            Source::Random { config_json } => (
                PathBuf::new(),
                Weights::Random {
                    config_json: config_json.clone(),
                    tokenizer_dir: tokenizer_dir.to_path_buf(),
                    seed: SEED,
                },
            ),
            Source::Checkpoint(c) => (c.dir.clone(), Weights::Dir),
        }
    }
}

pub(crate) fn run(mut args: DisaggBenchArgs) -> anyhow::Result<()> {
    crate::cluster::check_gpus(&args.devices, false)?;
    if let Some(&first) = args.devices.first() {
        args.device = first;
    }
    ensure!(args.prompt_len > 0, "--prompt-len must be at least 1");
    ensure!(args.requests > 0, "--requests must be at least 1");
    ensure!(args.timeout_s > 0, "--timeout-s must be at least 1");
    if !args.no_load {
        ensure!(args.clients > 0, "--clients must be at least 1");
        ensure!(
            args.load_prompt_len > 0 && args.load_output_len > 0,
            "--load-prompt-len and --load-output-len must be at least 1"
        );
    }
    let on_gpu = matches!(args.device, Device::Cuda { .. });
    if on_gpu {
        ensure!(
            (0.05..=1.0).contains(&args.gpu_memory_utilization),
            "--gpu-memory-utilization must be in [0.05, 1]"
        );
    }
    let kv_spec = args.kv_connector.parse::<ConnectorSpec>()?.resolve(on_gpu);
    ensure!(
        on_gpu || !kv_spec.wants_device_memory(),
        "--kv-connector {} moves GPU memory: it needs --device cuda",
        args.kv_connector
    );
    let config_json = args.model_config.config_json();
    let model_cfg = ModelConfig::from_json(config_json)?;
    let tokenizer = Tokenizer::from_model_dir(&args.tokenizer_dir)
        .with_context(|| format!("loading a tokenizer from {}", args.tokenizer_dir.display()))?;
    ensure!(
        tokenizer.vocab_size() <= model_cfg.vocab_size,
        "the tokenizer in {} has {} tokens, more than the model's vocabulary of {}",
        args.tokenizer_dir.display(),
        tokenizer.vocab_size(),
        model_cfg.vocab_size
    );
    drop(tokenizer);
    let device_name = device_name(args.device)?;
    let workload = workload(&args, model_cfg.vocab_size);
    let engine_cfg = engine_config(&args, &model_cfg);
    let source = match args.device {
        Device::Cuda { .. } => Source::Random {
            config_json: config_json.to_string(),
        },
        Device::Cpu => {
            eprintln!(
                "writing a random {} checkpoint for the CPU engine ...",
                args.model_config.name()
            );
            Source::Checkpoint(TempCheckpoint::write(
                config_json,
                &model_cfg,
                &args.tokenizer_dir,
                SEED,
            )?)
        }
    };
    let limit = Duration::from_secs(args.timeout_s);

    eprintln!("engine alone on {device_name} ...");
    let engine = engine_alone(&args, &source, engine_cfg.clone(), &workload, limit)?;
    eprintln!("cluster (router + prefill node + decode node in this process) ...");
    let cluster = cluster(&args, &source, engine_cfg, kv_spec, &workload, limit)?;
    print_report(&args, &device_name, &engine, &cluster);
    Ok(())
}

/// The device as the report names it.
fn device_name(device: Device) -> anyhow::Result<String> {
    match device {
        Device::Cuda { ordinal } => {
            let gpu = tandem_kernels::cuda::Gpu::new(ordinal)
                .with_context(|| format!("opening {device}"))?;
            Ok(format!("{} ({device})", gpu.name()))
        }
        Device::Cpu => {
            let model = std::fs::read_to_string("/proc/cpuinfo")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("model name"))
                        .and_then(|l| l.split(':').nth(1))
                        .map(|m| m.trim().to_string())
                })
                .unwrap_or_else(|| "CPU".into());
            Ok(format!(
                "{model} ({} threads)",
                rayon::current_num_threads()
            ))
        }
    }
}

/// Distinct random prompts: the warm-up and timed TTFT prompts, then the load's.
fn workload(args: &DisaggBenchArgs, vocab: usize) -> Workload {
    let mut rng = SmallRng::seed_from_u64(0x7a6d);
    let mut prompt = |len: usize| -> Vec<u32> {
        (0..len)
            .map(|_| rng.random_range(FIRST_TOKEN..vocab as u32))
            .collect()
    };
    let ttft = (0..=args.requests)
        .map(|_| prompt(args.prompt_len))
        .collect();
    let load = if args.no_load {
        Vec::new()
    } else {
        (0..args.clients)
            .map(|_| prompt(args.load_prompt_len))
            .collect()
    };
    Workload {
        ttft,
        load,
        output_len: args.load_output_len,
    }
}

/// The one engine configuration of the engine alone and both nodes (the node kinds set the role).
fn engine_config(args: &DisaggBenchArgs, cfg: &ModelConfig) -> EngineConfig {
    let ttft_len = args.prompt_len + 2;
    let load_len = if args.no_load {
        0
    } else {
        args.load_prompt_len + args.load_output_len
    };
    let max_model_len = ttft_len.max(load_len);
    // CPU pool: room for the whole load twice over (f32 K and V of every layer).
    let kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4;
    let tokens = (args.clients * load_len).max((args.requests + 1) * ttft_len);
    EngineConfig {
        device: args.device,
        gpu_memory_utilization: args.gpu_memory_utilization,
        kv_cache_bytes: (2 * tokens * kv_bytes_per_token).max(64 << 20),
        max_num_seqs: args.clients.max(1),
        // A TTFT prompt is one chunk.
        max_num_batched_tokens: args.prompt_len.max(8192),
        max_model_len: Some(max_model_len),
        enable_prefix_caching: true,
        ..EngineConfig::default()
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

/// Progress of the engine-alone thread.
enum Stage {
    Loaded(usize),
    Ttft(Vec<f64>),
    /// The load's tokens/s; the engine is dropped before this is sent.
    Done(Option<f64>),
}

/// Step a: the engine alone, on a thread of its own so that every stage is time-bound.
fn engine_alone(
    args: &DisaggBenchArgs,
    source: &Source,
    cfg: EngineConfig,
    workload: &Workload,
    limit: Duration,
) -> anyhow::Result<EngineFigures> {
    let (tx, rx) = mpsc::channel();
    let load = source.loader(&args.tokenizer_dir, cfg);
    let ttft_prompts = workload.ttft.clone();
    let load_prompts = workload.load.clone();
    let output_len = workload.output_len;
    let worker = std::thread::Builder::new()
        .name("bench-engine".into())
        .spawn(move || -> anyhow::Result<()> {
            let mut engine = load()?;
            let _ = tx.send(Stage::Loaded(engine.current_load().total_blocks));
            let mut ttft = Vec::new();
            for prompt in ttft_prompts {
                ttft.push(engine_ttft(&mut engine, prompt)?);
            }
            let _ = tx.send(Stage::Ttft(ttft));
            let tok_s = if load_prompts.is_empty() {
                None
            } else {
                Some(engine_offline(&mut engine, load_prompts, output_len)?)
            };
            drop(engine);
            let _ = tx.send(Stage::Done(tok_s));
            Ok(())
        })?;
    let mut figures = EngineFigures {
        num_blocks: 0,
        ttft_s: Vec::new(),
        load_tok_s: None,
    };
    for what in ["loading the engine", "the TTFT requests", "the load"] {
        let stage = match rx.recv_timeout(limit) {
            Ok(stage) => stage,
            Err(mpsc::RecvTimeoutError::Timeout) => bail!(
                "engine alone: {what} did not finish within {} s (--timeout-s)",
                limit.as_secs()
            ),
            // The worker ended early: its error says why.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return match worker.join() {
                    Ok(Err(cause)) => Err(cause.context(format!("engine alone: {what}"))),
                    Ok(Ok(())) => bail!("engine alone: {what}: the engine thread ended early"),
                    Err(_) => bail!("engine alone: {what}: the engine thread panicked"),
                };
            }
        };
        match stage {
            Stage::Loaded(blocks) => {
                figures.num_blocks = blocks;
                eprintln!("engine alone: ready ({blocks} KV blocks)");
            }
            Stage::Ttft(t) => {
                eprintln!("engine alone: TTFT median {:.2} ms", median(&t[1..]) * 1e3);
                figures.ttft_s = t;
            }
            Stage::Done(tok_s) => figures.load_tok_s = tok_s,
        }
    }
    worker
        .join()
        .map_err(|_| anyhow!("the engine thread panicked"))??;
    Ok(figures)
}

/// One request of `prompt` (2 tokens): seconds from `add_request` to its first token.
fn engine_ttft(engine: &mut Engine, prompt: Vec<u32>) -> anyhow::Result<f64> {
    let prompt = Prompt::Tokens(prompt);
    let start = Instant::now();
    let id = engine.add_request(&prompt, greedy(2))?;
    let mut first = None;
    while engine.has_unfinished() {
        for out in engine.step()? {
            if out.request == id && first.is_none() && !out.token_ids.is_empty() {
                first = Some(start.elapsed().as_secs_f64());
            }
        }
    }
    first.context("the engine finished the request without a token")
}

/// All `prompts` at once, `output_len` tokens each, stepped to completion: output tokens per second.
fn engine_offline(
    engine: &mut Engine,
    prompts: Vec<Vec<u32>>,
    output_len: usize,
) -> anyhow::Result<f64> {
    let requests = prompts.len();
    let prompts: Vec<Prompt> = prompts.into_iter().map(Prompt::Tokens).collect();
    let start = Instant::now();
    for p in &prompts {
        engine.add_request(p, greedy(output_len))?;
    }
    let mut produced = 0usize;
    while engine.has_unfinished() {
        produced += engine
            .step()?
            .iter()
            .map(|o| o.token_ids.len())
            .sum::<usize>();
    }
    let secs = start.elapsed().as_secs_f64();
    ensure!(
        produced == requests * output_len,
        "the engine produced {produced} tokens for {requests} x {output_len}"
    );
    eprintln!("engine alone: load {produced} tokens in {secs:.2} s");
    Ok(produced as f64 / secs)
}

/// Step b: the embedded cluster.
fn cluster(
    args: &DisaggBenchArgs,
    source: &Source,
    engine: EngineConfig,
    kv_spec: ConnectorSpec,
    workload: &Workload,
    limit: Duration,
) -> anyhow::Result<ClusterFigures> {
    let (model_dir, weights) = source.node_weights(&args.tokenizer_dir);
    let setup = NodeSetup {
        model_dir,
        weights,
        model_name: args.model_config.name().into(),
        engine,
        kv_spec,
        kv_config: ConnectorConfig::default(),
        tls: None,
        // The benchmark measures every client it sends: nothing is shed.
        limits: tandem_node::admission::Limits { max_waiting: usize::MAX },
    };
    let opts = EmbeddedOptions {
        setup,
        listen: "127.0.0.1:0".parse()?,
        policy: Policy::LeastLoad,
        local_prefill_below: 0,
        colocated: false,
        devices: args.devices.clone(),
        router_limits: tandem_router::Limits { max_waiting: usize::MAX, max_queue_time: None },
    };
    let rt = crate::cluster::runtime()?;
    let secs = limit.as_secs();
    let outcome = rt.block_on(async {
        let cluster = tokio::time::timeout(limit, EmbeddedCluster::start(opts))
            .await
            .map_err(|_| anyhow!("cluster: the nodes did not start within {secs} s (--timeout-s)"))??;
        let prefill = cluster.prefill.as_ref().context("the embedded cluster has no prefill node")?;
        eprintln!(
            "cluster: serving on {} (prefill node {} KV blocks, decode node {} KV blocks, KV over {})",
            cluster.addr, prefill.num_blocks, cluster.decode.num_blocks, cluster.decode.kv_backend
        );
        let measured = measure_cluster(&cluster.addr.to_string(), workload, limit).await;
        let mut figures = ClusterFigures {
            prefill_backend: prefill.kv_backend.clone(),
            decode_backend: cluster.decode.kv_backend.clone(),
            prefill_blocks: prefill.num_blocks,
            decode_blocks: cluster.decode.num_blocks,
            ttft_s: Vec::new(),
            load_tok_s: None,
        };
        // After a failure requests may still be in flight: leave without draining.
        (figures.ttft_s, figures.load_tok_s) = measured?;
        tokio::time::timeout(Duration::from_secs(60), cluster.shutdown())
            .await
            .map_err(|_| anyhow!("cluster: the nodes did not shut down within 60 s"))?;
        Ok(figures)
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    outcome
}

async fn measure_cluster(
    addr: &str,
    workload: &Workload,
    limit: Duration,
) -> anyhow::Result<(Vec<f64>, Option<f64>)> {
    let secs = limit.as_secs();
    let mut client = connect(addr).await?;
    let mut ttft = Vec::new();
    for (i, prompt) in workload.ttft.iter().enumerate() {
        let t = tokio::time::timeout(limit, cluster_ttft(&mut client, prompt.clone()))
            .await
            .map_err(|_| {
                anyhow!(
                    "cluster: TTFT request {i} got no complete answer within {secs} s (--timeout-s)"
                )
            })?
            .with_context(|| format!("cluster: TTFT request {i}"))?;
        ttft.push(t);
    }
    eprintln!("cluster: TTFT median {:.2} ms", median(&ttft[1..]) * 1e3);
    if workload.load.is_empty() {
        return Ok((ttft, None));
    }
    // One connection per client, opened before the clock starts.
    let mut clients = Vec::with_capacity(workload.load.len());
    for _ in &workload.load {
        clients.push(connect(addr).await?);
    }
    let output_len = workload.output_len;
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for (client, prompt) in clients.into_iter().zip(workload.load.iter().cloned()) {
        set.spawn(stream_tokens(client, prompt, output_len));
    }
    let produced = tokio::time::timeout(limit, async {
        let mut produced = 0usize;
        while let Some(done) = set.join_next().await {
            produced += done.context("a load client task failed")??;
        }
        Ok::<_, anyhow::Error>(produced)
    })
    .await
    .map_err(|_| {
        anyhow!(
            "cluster: the load ({} streams) did not finish within {secs} s (--timeout-s)",
            workload.load.len()
        )
    })??;
    let secs = start.elapsed().as_secs_f64();
    eprintln!("cluster: load {produced} tokens in {secs:.2} s");
    Ok((ttft, Some(produced as f64 / secs)))
}

async fn connect(addr: &str) -> anyhow::Result<TandemClient<Channel>> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5));
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to the router at {addr}"))?;
    Ok(TandemClient::new(channel))
}

fn token_request(prompt: Vec<u32>, max_tokens: usize) -> anyhow::Result<api::GenerateRequest> {
    let max_tokens = u32::try_from(max_tokens).context("too many output tokens")?;
    Ok(api::GenerateRequest {
        model: String::new(),
        prompt: Some(api::generate_request::Prompt::TokenIds(api::TokenIds {
            ids: prompt,
        })),
        sampling: Some(api::SamplingParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ignore_eos: true,
            ..Default::default()
        }),
        request_id: String::new(),
    })
}

/// One request of `prompt` (2 tokens) through the router: seconds from sending it to the first
/// streamed token; the stream is read to its end.
async fn cluster_ttft(client: &mut TandemClient<Channel>, prompt: Vec<u32>) -> anyhow::Result<f64> {
    let req = token_request(prompt, 2)?;
    let start = Instant::now();
    let mut stream = client
        .generate(req)
        .await
        .map_err(status_error)?
        .into_inner();
    let mut first = None;
    while let Some(msg) = stream.next().await {
        let msg = msg.map_err(status_error)?;
        if first.is_none() && !msg.token_ids.is_empty() {
            first = Some(start.elapsed().as_secs_f64());
        }
    }
    first.context("the stream ended without a token")
}

/// One load stream: its output tokens (checked to be `output_len`).
async fn stream_tokens(
    mut client: TandemClient<Channel>,
    prompt: Vec<u32>,
    output_len: usize,
) -> anyhow::Result<usize> {
    let mut stream = client
        .generate(token_request(prompt, output_len)?)
        .await
        .map_err(status_error)?
        .into_inner();
    let mut tokens = 0;
    while let Some(msg) = stream.next().await {
        tokens += msg.map_err(status_error)?.token_ids.len();
    }
    ensure!(
        tokens == output_len,
        "a load stream ended after {tokens} of {output_len} tokens"
    );
    Ok(tokens)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn print_report(
    args: &DisaggBenchArgs,
    device_name: &str,
    engine: &EngineFigures,
    cluster: &ClusterFigures,
) {
    let backend = if cluster.prefill_backend == cluster.decode_backend {
        cluster.decode_backend.clone()
    } else {
        format!(
            "{} (prefill) / {} (decode)",
            cluster.prefill_backend, cluster.decode_backend
        )
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "tandem bench disagg — {device_name}, {} geometry, random weights, KV backend {backend}, {}",
        args.model_config.name().trim_end_matches("-random"),
        utc_now()
    );
    let split = match args.device {
        Device::Cuda { .. } if args.devices.len() == 2 => format!(
            ", GPU memory {} of each GPU (prefill node on {}, decode node on {}; the engine alone on {})",
            args.gpu_memory_utilization, args.devices[0], args.devices[1], args.devices[0]
        ),
        Device::Cuda { .. } => format!(
            ", GPU memory {} (the nodes: prefill half, decode the rest)",
            args.gpu_memory_utilization
        ),
        Device::Cpu => String::new(),
    };
    let _ = writeln!(
        out,
        "KV blocks: engine alone {}; cluster prefill node {}, decode node {} (every prompt prefilled remotely){split}",
        engine.num_blocks, cluster.prefill_blocks, cluster.decode_blocks
    );
    let _ = writeln!(
        out,
        "{:<46} {:>14} {:>14} {:>9}",
        "metric", "engine alone", "cluster", "ratio"
    );
    let (e, c) = (median(&engine.ttft_s[1..]), median(&cluster.ttft_s[1..]));
    let _ = writeln!(
        out,
        "{:<46} {:>11.2} ms {:>11.2} ms {:>8.3}x  (target <= 1.05)",
        format!(
            "TTFT, {}-token prompt (median of {})",
            args.prompt_len, args.requests
        ),
        e * 1e3,
        c * 1e3,
        c / e
    );
    if let (Some(e), Some(c)) = (engine.load_tok_s, cluster.load_tok_s) {
        let _ = writeln!(
            out,
            "{:<46} {:>10.1} t/s {:>10.1} t/s {:>8.1}%  (target >= 70%)",
            format!(
                "load {} x {}/{} output tok/s",
                args.clients, args.load_prompt_len, args.load_output_len
            ),
            e,
            c,
            c / e * 100.0
        );
    }
    let ms = |v: &[f64]| {
        v.iter()
            .map(|t| format!("{:.2}", t * 1e3))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = writeln!(
        out,
        "TTFT per request (ms; the first is the warm-up): engine alone {}",
        ms(&engine.ttft_s)
    );
    let _ = writeln!(
        out,
        "TTFT per request (ms; the first is the warm-up): cluster      {}",
        ms(&cluster.ttft_s)
    );
}

/// The current UTC time as `YYYY-MM-DD HH:MM UTC`.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

/// A random-weight checkpoint of a geometry in a temporary directory (f32 safetensors, the config
/// JSON as given, the tokenizer's files), removed on drop. The CPU engine loads it; equal seeds give
/// equal files.
struct TempCheckpoint {
    dir: PathBuf,
}

impl TempCheckpoint {
    fn write(
        config_json: &str,
        cfg: &ModelConfig,
        tokenizer_dir: &Path,
        seed: u64,
    ) -> anyhow::Result<TempCheckpoint> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "tandem-bench-disagg-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let checkpoint = TempCheckpoint { dir };
        let dir = &checkpoint.dir;
        std::fs::write(dir.join("config.json"), config_json)?;
        for name in [
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
        ] {
            let from = tokenizer_dir.join(name);
            if from.is_file() {
                std::fs::copy(&from, dir.join(name))
                    .with_context(|| format!("copying {}", from.display()))?;
            }
        }
        std::fs::write(
            dir.join("model.safetensors"),
            random_safetensors(cfg, seed)?,
        )?;
        Ok(checkpoint)
    }
}

impl Drop for TempCheckpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A safetensors file with every tensor of a Llama geometry: matrices uniform with the variance of
/// N(0, 1/fan_in), norms 1 (as the CUDA engine's random weights).
fn random_safetensors(cfg: &ModelConfig, seed: u64) -> anyhow::Result<Vec<u8>> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    // (name, rows, cols); cols == 0 marks a norm vector of `rows` ones.
    let mut tensors: Vec<(String, usize, usize)> = vec![
        ("model.embed_tokens.weight".into(), v, h),
        ("model.norm.weight".into(), h, 0),
    ];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        tensors.extend([
            (format!("{p}.input_layernorm.weight"), h, 0),
            (format!("{p}.post_attention_layernorm.weight"), h, 0),
            (format!("{p}.self_attn.q_proj.weight"), q, h),
            (format!("{p}.self_attn.k_proj.weight"), kv, h),
            (format!("{p}.self_attn.v_proj.weight"), kv, h),
            (format!("{p}.self_attn.o_proj.weight"), h, q),
            (format!("{p}.mlp.gate_proj.weight"), i, h),
            (format!("{p}.mlp.up_proj.weight"), i, h),
            (format!("{p}.mlp.down_proj.weight"), h, i),
        ]);
    }
    if !cfg.tie_word_embeddings {
        tensors.push(("lm_head.weight".into(), v, h));
    }
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (n, (name, rows, cols)) in tensors.iter().enumerate() {
        let start = data.len();
        if *cols == 0 {
            for _ in 0..*rows {
                data.extend_from_slice(&1.0f32.to_le_bytes());
            }
        } else {
            let a = (3.0 / *cols as f32).sqrt();
            let mut rng =
                SmallRng::seed_from_u64(seed ^ (n as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for _ in 0..rows * cols {
                data.extend_from_slice(&rng.random_range(-a..a).to_le_bytes());
            }
        }
        let shape = if *cols == 0 {
            vec![*rows]
        } else {
            vec![*rows, *cols]
        };
        header.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}));
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header))?;
    // The data starts 8-byte aligned.
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = Vec::with_capacity(8 + header.len() + data.len());
    file.extend_from_slice(&(header.len() as u64).to_le_bytes());
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometries_parse() {
        let cfg = ModelConfig::from_json(LLAMA31_8B).unwrap();
        assert_eq!(
            (cfg.num_layers, cfg.hidden_size, cfg.vocab_size),
            (32, 4096, 128256)
        );
        let cfg = ModelConfig::from_json(TINY).unwrap();
        assert_eq!(
            (
                cfg.num_layers,
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim
            ),
            (4, 256, 4, 2, 64)
        );
    }

    #[test]
    fn random_checkpoint_is_deterministic_in_its_seed() {
        let cfg = ModelConfig::from_json(TINY).unwrap();
        let a = random_safetensors(&cfg, 1).unwrap();
        assert_eq!(a, random_safetensors(&cfg, 1).unwrap());
        assert_ne!(a, random_safetensors(&cfg, 2).unwrap());
    }

    #[test]
    fn medians_and_dates() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let now = utc_now();
        assert!(
            now.len() == 20 && now.ends_with(" UTC") && now.starts_with("20"),
            "{now}"
        );
    }
}
