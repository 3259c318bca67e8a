//! `tandem bench serve`: a load generator against a running router, as vLLM's `bench serve` and
//! SGLang's `bench_serving` drive a server: open-loop Poisson arrivals at one rate or a sweep of
//! rates, or closed-loop fixed concurrency; requests of fixed, uniform or normal lengths (random
//! token ids) or from a ShareGPT-format file; over tandem's gRPC API or the OpenAI HTTP API. Per
//! request it records TTFT, every inter-token gap, TPOT, E2E and the token counts; per run it reports
//! p50/p90/p99 of each, request and token throughput, goodput under `--slo-*` and errors by status,
//! writes everything to one JSON file and can draw several such files into one PNG.
//!
//! Invariants:
//! - The workload is a pure function of the flags and `--seed` (see `workload`): two configurations
//!   benchmarked with the same flags get the same requests at the same offsets.
//! - Every request sent is in the JSON (succeeded or failed); a run ends only when every request has
//!   ended or hit `--timeout-s`.
//! - The JSON is rewritten after every run of a sweep, so a sweep cut short keeps its finished runs.

mod client;
mod plot;
mod stats;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tandem_engine::tokenizer::Tokenizer;

use crate::CacheArgs;
use client::Target;
use stats::{RequestRecord, Slo, Summary};
use workload::{LengthDist, Load, RequestSpec, Source};

/// Which API the requests go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// tandem's gRPC API (`tandem.v1.Tandem/Generate`) at --router.
    Grpc,
    /// The OpenAI HTTP API (`POST /v1/completions`, streamed) at --base-url.
    Openai,
}

/// Arguments of `tandem bench serve`.
#[derive(Args, Debug)]
pub(crate) struct ServeBenchArgs {
    /// The API to drive: grpc (tandem's own) or openai (HTTP /v1/completions, streamed).
    #[arg(long, value_enum, default_value = "grpc")]
    backend: Backend,
    /// The router's gRPC address (HOST:PORT), with --backend grpc.
    #[arg(long, default_value = "127.0.0.1:50051")]
    router: String,
    /// The OpenAI API's base URL (http://HOST:PORT[/v1]), with --backend openai.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// The model to ask for [default: the one the cluster serves].
    #[arg(long, default_value = "")]
    model: String,
    /// The tokenizer (a model directory or known model name): its vocabulary bounds the random
    /// prompts' token ids, and it tokenizes --dataset.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    tokenizer: String,
    #[command(flatten)]
    cache: CacheArgs,
    /// Open loop: Poisson arrivals at these rates (requests/s, comma-separated; `inf` sends all at
    /// once), one run each [default: inf].
    #[arg(long, value_delimiter = ',', value_parser = workload::parse_rate)]
    request_rate: Vec<f64>,
    /// Closed loop: keep this many requests in flight (comma-separated for a sweep), one run each.
    #[arg(long, value_delimiter = ',', conflicts_with = "request_rate")]
    concurrency: Vec<usize>,
    /// Requests per run.
    #[arg(long, default_value_t = 100)]
    num_prompts: usize,
    /// Prompt lengths in tokens: N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "256")]
    input_len: LengthDist,
    /// Output lengths in tokens (ignore_eos): N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "128")]
    output_len: LengthDist,
    /// A ShareGPT-format JSON file: prompts are first turns, output lengths the answers' (instead of
    /// --input-len and --output-len).
    #[arg(long, conflicts_with_all = ["input_len", "output_len"])]
    dataset: Option<PathBuf>,
    /// With --dataset: skip conversations whose prompt + answer exceed this many tokens.
    #[arg(long, default_value_t = 2048)]
    dataset_max_len: usize,
    /// Seed of the prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Short requests sent one at a time before the first run (not measured).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Goodput SLO: time to first token at most this many ms.
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    /// Goodput SLO: every inter-token gap at most this many ms.
    #[arg(long)]
    slo_itl_ms: Option<f64>,
    /// Goodput SLO: time per output token (mean gap after the first token) at most this many ms.
    #[arg(long)]
    slo_tpot_ms: Option<f64>,
    /// Where to write the JSON report [default: bench-serve-<unix time>.json].
    #[arg(long)]
    output_json: Option<PathBuf>,
    /// This configuration's name in the report and plots [default: the backend and address].
    #[arg(long)]
    label: Option<String>,
    /// Draw a PNG of this run's sweep, with the --compare reports overlaid.
    #[arg(long, value_name = "PNG")]
    plot: Option<PathBuf>,
    /// JSON reports of earlier runs to draw beside this one (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', requires = "plot")]
    compare: Vec<PathBuf>,
    /// Only draw --plot from the --compare reports; send nothing.
    #[arg(long, requires = "plot")]
    plot_only: bool,
    /// A TrueType font for the plot's text [default: a system font].
    #[arg(long)]
    font: Option<PathBuf>,
    /// Most seconds one request may take before it counts as failed (`timeout`).
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
}

/// The JSON report of one invocation: the configuration, the workload and every run of the sweep.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Report {
    /// `tandem bench serve`.
    tool: String,
    /// Report format version.
    version: u32,
    /// The configuration's name.
    label: String,
    /// `grpc` or `openai`.
    backend: String,
    /// Where requests went.
    target: String,
    /// The model asked for ("" = the cluster's).
    model: String,
    /// Workload flags.
    workload: WorkloadInfo,
    /// The SLOs goodput counts against.
    slo: Slo,
    /// Unix time the first run started.
    started_unix_s: u64,
    /// One entry per rate or concurrency, in flag order.
    runs: Vec<RunReport>,
}

/// The workload as the flags gave it.
#[derive(Debug, Serialize, Deserialize)]
struct WorkloadInfo {
    num_prompts: usize,
    /// `--input-len` (absent with a dataset).
    input_len: Option<String>,
    /// `--output-len` (absent with a dataset).
    output_len: Option<String>,
    dataset: Option<String>,
    seed: u64,
}

/// One run of a sweep.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RunReport {
    /// `rate` or `concurrency`.
    kind: String,
    /// The rate (req/s) or concurrency; absent for an infinite rate.
    x: Option<f64>,
    /// The load in words.
    load: String,
    /// The run's statistics.
    summary: Summary,
    /// Every request, in workload order.
    requests: Vec<RequestRecord>,
}

pub(crate) fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    let slo = Slo { ttft_ms: args.slo_ttft_ms, itl_ms: args.slo_itl_ms, tpot_ms: args.slo_tpot_ms };
    for (flag, v) in [("--slo-ttft-ms", slo.ttft_ms), ("--slo-itl-ms", slo.itl_ms), ("--slo-tpot-ms", slo.tpot_ms)] {
        if let Some(v) = v {
            ensure!(v.is_finite() && v > 0.0, "{flag} must be a positive number of milliseconds");
        }
    }
    if args.plot_only {
        ensure!(!args.compare.is_empty(), "--plot-only draws the --compare reports: give at least one");
        let reports = args.compare.iter().map(|p| read_report(p)).collect::<anyhow::Result<Vec<_>>>()?;
        return draw(&reports, &args);
    }
    ensure!(args.num_prompts > 0, "--num-prompts must be at least 1");
    ensure!(args.timeout_s > 0, "--timeout-s must be at least 1");
    ensure!(args.concurrency.iter().all(|&c| c > 0), "--concurrency must be at least 1");
    let loads: Vec<Load> = if !args.concurrency.is_empty() {
        args.concurrency.iter().map(|&c| Load::Concurrency(c)).collect()
    } else if !args.request_rate.is_empty() {
        args.request_rate.iter().map(|&r| Load::Rate(r)).collect()
    } else {
        vec![Load::Rate(f64::INFINITY)]
    };
    // Earlier reports are read before anything is sent: a bad path fails at once.
    let earlier = args.compare.iter().map(|p| read_report(p)).collect::<anyhow::Result<Vec<_>>>()?;

    let tok_dir = crate::pull::resolve_model(&args.tokenizer, &args.cache.cache()?)?;
    let tokenizer = Tokenizer::from_model_dir(&tok_dir).with_context(|| format!("loading a tokenizer from {}", tok_dir.display()))?;
    let vocab = tokenizer.vocab_size() as u32;
    ensure!(vocab > workload::FIRST_TOKEN, "the tokenizer's vocabulary ({vocab}) is too small");
    let source = match &args.dataset {
        Some(path) => Source::Dataset(workload::load_sharegpt(path, &tokenizer, args.dataset_max_len, args.seed)?),
        None => Source::Random { input: args.input_len, output: args.output_len, vocab },
    };
    let rt = crate::cluster::runtime()?;
    // tonic's lazy channel spawns its connection task on the runtime it is created in.
    let _runtime = rt.enter();
    let (target, address) = match args.backend {
        Backend::Grpc => (Target::grpc(&args.router, &args.model)?, args.router.clone()),
        Backend::Openai => (Target::http(&args.base_url, &args.model)?, args.base_url.clone()),
    };
    let backend_name = match args.backend {
        Backend::Grpc => "grpc",
        Backend::Openai => "openai",
    };
    let started_unix_s = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let out = args.output_json.clone().unwrap_or_else(|| PathBuf::from(format!("bench-serve-{started_unix_s}.json")));
    let mut report = Report {
        tool: "tandem bench serve".into(),
        version: 1,
        label: args.label.clone().unwrap_or_else(|| format!("{backend_name} {address}")),
        backend: backend_name.into(),
        target: address,
        model: args.model.clone(),
        workload: WorkloadInfo {
            num_prompts: args.num_prompts,
            input_len: args.dataset.is_none().then(|| args.input_len.to_string()),
            output_len: args.dataset.is_none().then(|| args.output_len.to_string()),
            dataset: args.dataset.as_ref().map(|p| p.display().to_string()),
            seed: args.seed,
        },
        slo,
        started_unix_s,
        runs: Vec::new(),
    };
    let limit = Duration::from_secs(args.timeout_s);
    rt.block_on(async {
        warm_up(&target, args.warmup, vocab, limit).await.with_context(|| format!("warming up against {} {}", report.backend, report.target))?;
        eprintln!("tandem bench serve: {} → {} ({} runs of {} requests)", report.label, report.target, loads.len(), args.num_prompts);
        for (i, load) in loads.iter().enumerate() {
            let requests = source.requests(args.seed, i, args.num_prompts);
            let (records, duration_s) = run_load(&target, *load, requests, workload::arrival_seed(args.seed, i), limit).await;
            let summary = Summary::of(&records, duration_s, &slo);
            print_run(*load, &summary);
            report.runs.push(RunReport {
                kind: if matches!(load, Load::Rate(_)) { "rate".into() } else { "concurrency".into() },
                x: Some(load.x()).filter(|x| x.is_finite()),
                load: load.to_string(),
                summary,
                requests: records,
            });
            write_report(&report, &out)?;
        }
        anyhow::Ok(())
    })?;
    print_table(&report);
    eprintln!("report: {}", out.display());
    if args.plot.is_some() {
        let mut all = earlier;
        all.push(report);
        draw(&all, &args)?;
    }
    Ok(())
}

fn read_report(path: &std::path::Path) -> anyhow::Result<Report> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a `tandem bench serve` report", path.display()))
}

fn write_report(report: &Report, path: &std::path::Path) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn draw(reports: &[Report], args: &ServeBenchArgs) -> anyhow::Result<()> {
    let Some(png) = &args.plot else { return Ok(()) };
    let skipped = plot::draw(reports, png, args.font.as_deref())?;
    if skipped > 0 {
        eprintln!("plot: {skipped} run(s) at an infinite rate have no place on the rate axis and are left out");
    }
    eprintln!("plot: {}", png.display());
    Ok(())
}

/// Sends `count` short requests one at a time; the first failure is an error (nothing listens, wrong
/// model, ...), so a sweep never measures a server that cannot answer.
async fn warm_up(target: &Target, count: usize, vocab: u32, limit: Duration) -> anyhow::Result<()> {
    for i in 0..count {
        let prompt = (0..16).map(|k| workload::FIRST_TOKEN + ((i * 16 + k) as u32 % (vocab - workload::FIRST_TOKEN))).collect();
        let rec = target.send(i, 0.0, &RequestSpec { prompt, output_len: 4 }, limit).await;
        if let Some(e) = rec.error {
            bail!("the warm-up request failed: {e}: {}", rec.error_message.unwrap_or_default());
        }
    }
    Ok(())
}

/// Runs one load to its end: every request answered, failed or timed out. Returns the records in
/// workload order and the run's duration (first send to last end) in seconds.
async fn run_load(target: &Target, load: Load, requests: Vec<RequestSpec>, arrival_seed: u64, limit: Duration) -> (Vec<RequestRecord>, f64) {
    let n = requests.len();
    let bar = ProgressBar::new(n as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:40.cyan/blue}] {pos}/{len} requests, {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(load.to_string());
    let requests = Arc::new(requests);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    match load {
        Load::Rate(rate) => {
            for (i, at) in workload::poisson_arrivals(rate, n, arrival_seed).into_iter().enumerate() {
                let (target, requests, bar) = (target.clone(), Arc::clone(&requests), bar.clone());
                tasks.spawn(async move {
                    tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
                    let rec = target.send(i, start.elapsed().as_secs_f64(), &requests[i], limit).await;
                    bar.inc(1);
                    vec![(rec, Instant::now())]
                });
            }
        }
        Load::Concurrency(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..c.min(n) {
                let (target, requests, bar, next) = (target.clone(), Arc::clone(&requests), bar.clone(), Arc::clone(&next));
                tasks.spawn(async move {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= requests.len() {
                            return done;
                        }
                        let rec = target.send(i, start.elapsed().as_secs_f64(), &requests[i], limit).await;
                        bar.inc(1);
                        done.push((rec, Instant::now()));
                    }
                });
            }
        }
    }
    let mut records = Vec::with_capacity(n);
    let mut last_end = start;
    while let Some(joined) = tasks.join_next().await {
        // A request task cannot panic short of a bug; its requests would be missing from the count.
        for (rec, end) in joined.unwrap_or_default() {
            last_end = last_end.max(end);
            records.push(rec);
        }
    }
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);
    (records, (last_end - start).as_secs_f64())
}

fn fmt_dist(d: &Option<stats::Dist>) -> String {
    match d {
        Some(d) => format!("{:.1} / {:.1} / {:.1}", d.p50, d.p90, d.p99),
        None => "-".into(),
    }
}

/// One run's figures, as it ends.
fn print_run(load: Load, s: &Summary) {
    eprintln!(
        "{load}: {}/{} ok in {:.2} s, {:.2} req/s, {:.1} out tok/s, goodput {:.2} req/s ({} good)",
        s.completed, s.requests, s.duration_s, s.request_throughput, s.output_token_throughput, s.goodput, s.good_requests
    );
    eprintln!(
        "  TTFT ms p50/p90/p99 {}   ITL {}   TPOT {}   E2E {}",
        fmt_dist(&s.ttft_ms),
        fmt_dist(&s.itl_ms),
        fmt_dist(&s.tpot_ms),
        fmt_dist(&s.e2e_ms)
    );
    if !s.errors_by_status.is_empty() {
        let errs: Vec<String> = s.errors_by_status.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        eprintln!("  errors: {}", errs.join(", "));
    }
}

/// The sweep as a markdown table on stdout.
fn print_table(report: &Report) {
    println!("{} ({} → {})", report.label, report.backend, report.target);
    println!("| load | ok/sent | req/s | out tok/s | goodput req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50/p90/p99 ms | E2E p50/p90/p99 ms | errors |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for run in &report.runs {
        let s = &run.summary;
        let errs: Vec<String> = s.errors_by_status.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        println!(
            "| {} | {}/{} | {:.2} | {:.1} | {:.2} | {} | {} | {} | {} | {} |",
            run.load,
            s.completed,
            s.requests,
            s.request_throughput,
            s.output_token_throughput,
            s.goodput,
            fmt_dist(&s.ttft_ms),
            fmt_dist(&s.itl_ms),
            fmt_dist(&s.tpot_ms),
            fmt_dist(&s.e2e_ms),
            if errs.is_empty() { "-".into() } else { errs.join(", ") }
        );
    }
}
