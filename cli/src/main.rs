//! The `tandem` command: model import and pull, single-process generation and benchmarks.
//!
//! Every failure ends as one `error: ...` line on stderr and a non-zero exit (1 for runtime
//! errors, 2 for bad command lines, from clap); nothing here panics on user input.

mod bench;
mod bench_disagg;
mod bench_serve;
mod bench_engine;
mod cert;
mod cluster;
mod generate;
mod kv;
mod pull;
mod telemetry;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// tandem: an LLM serving engine that splits prefill from decode.
#[derive(Parser)]
#[command(name = "tandem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Get and convert models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Generate a completion for one prompt in this process; prints only the completion.
    Generate(generate::GenerateArgs),
    /// Benchmarks that print ratios against a reference measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// KV-transfer tools.
    #[command(subcommand)]
    Kv(KvCommand),
    /// Serve the client API and route requests to prefill and decode nodes (membership in etcd).
    Router(cluster::RouterArgs),
    /// Run a prefill node: compute prompts' KV and push it into decode nodes.
    Prefill(cluster::PrefillArgs),
    /// Run a decode node: receive prompts' KV, decode and stream tokens.
    Decode(cluster::DecodeArgs),
    /// Run router + one prefill + one decode node in this process (no etcd needed).
    Up(cluster::UpArgs),
    /// Send a prompt to a router and stream the completion to stdout.
    Client(cluster::ClientArgs),
    /// Make a throwaway CA and certificates signed by it (for --tls-* on a test or laptop cluster).
    Cert(cert::CertArgs),
}

#[derive(Subcommand)]
enum KvCommand {
    /// Run the KV-transfer conformance suite against a backend (e.g. your plugin).
    Conformance(kv::ConformanceArgs),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Convert a GGUF file into a Hugging Face-style model directory.
    ImportGguf {
        /// The GGUF file.
        file: PathBuf,
        /// The directory to create.
        out_dir: PathBuf,
        /// Store weights as bf16 instead of the exact f32 dequantized values.
        #[arg(long)]
        bf16: bool,
    },
    /// Download a known model into the cache and print its directory (last line of stdout).
    Pull {
        /// A known model name, e.g. smollm2-135m-instruct.
        name: String,
        #[command(flatten)]
        cache: CacheArgs,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode throughput on the CPU, side by side with HF transformers.
    Cpu(bench::CpuBenchArgs),
    /// KV-transfer throughput and latency next to a raw loopback socket moving the same bytes.
    Kv(kv::KvBenchArgs),
    /// The CUDA engine (Llama-3.1-8B geometry, random bf16 weights) against the device's copy
    /// bandwidth and GEMM rate measured in the same run, and HF transformers on the same GPU.
    Engine(bench_engine::EngineBenchArgs),
    /// Time to first token and throughput under load through an embedded cluster (router +
    /// prefill node + decode node), each next to the engine alone on the same random weights.
    Disagg(bench_disagg::DisaggBenchArgs),
    /// TTFT, inter-token latency and goodput of a running router under load (Poisson arrivals or
    /// fixed concurrency, over gRPC or the OpenAI API); JSON report and PNG plots.
    Serve(Box<bench_serve::ServeBenchArgs>),
}

/// Where pulled models live.
#[derive(Args, Clone, Debug)]
pub(crate) struct CacheArgs {
    /// Model cache directory [default: $TANDEM_CACHE_DIR, else the user cache dir/tandem].
    #[arg(long, env = "TANDEM_CACHE_DIR")]
    pub(crate) cache_dir: Option<PathBuf>,
}

impl CacheArgs {
    pub(crate) fn cache(&self) -> anyhow::Result<pull::ModelCache> {
        pull::ModelCache::new(self.cache_dir.clone())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let service = match &cli.command {
        Command::Router(_) => "tandem-router",
        Command::Prefill(_) => "tandem-prefill",
        Command::Decode(_) => "tandem-decode",
        _ => "tandem",
    };
    // Dropped after the command: flushes the traces not yet exported.
    let _telemetry = match telemetry::init(service) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = run(cli);
    // Nodes' engines free their memory on threads of their own once the nodes are gone: exiting
    // under them tears the CUDA driver down mid-free (a segfault at exit).
    let running = tandem_node::wait_for_engine_threads(std::time::Duration::from_secs(10));
    if running > 0 {
        eprintln!("warning: {running} engine thread(s) still running at exit");
    }
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model(ModelCommand::ImportGguf { file, out_dir, bf16 }) => pull::import_with_progress(&file, &out_dir, bf16),
        Command::Model(ModelCommand::Pull { name, cache }) => {
            let dir = pull::pull(&name, &cache.cache()?)?;
            println!("{}", dir.display());
            Ok(())
        }
        Command::Generate(args) => generate::run(args),
        Command::Bench(BenchCommand::Cpu(args)) => bench::run_cpu(args),
        Command::Bench(BenchCommand::Kv(args)) => kv::run_bench(args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine::run(args),
        Command::Bench(BenchCommand::Disagg(args)) => bench_disagg::run(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run(*args),
        Command::Kv(KvCommand::Conformance(args)) => kv::run_conformance(args),
        Command::Router(args) => cluster::run_router(args),
        Command::Prefill(args) => cluster::run_prefill(args),
        Command::Decode(args) => cluster::run_decode(args),
        Command::Up(args) => cluster::run_up(args),
        Command::Client(args) => cluster::run_client(args),
        Command::Cert(args) => cert::run(args),
    }
}
