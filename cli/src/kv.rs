//! `tandem bench kv` and `tandem kv conformance`: the KV-transfer connector measured against a raw
//! loopback socket moving the same bytes in the same run, and the conformance suite run against any
//! backend (a plugin author's first check).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use tandem_kv_transfer::conformance::Suite;
use tandem_kv_transfer::transport::nccl::RawNcclPair;
use tandem_kv_transfer::{
    Connector, ConnectorConfig, ConnectorSpec, DType, Fabric, Geometry, GeometrySpec, KvMemory, Layout, MemoryKind, TransferState,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// `tandem bench kv`.
#[derive(Args, Debug)]
pub(crate) struct KvBenchArgs {
    /// Backend: tcp, inproc, cuda-ipc, nccl, or plugin:/path/lib.so[?config].
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Transfer sizes in MiB (each a multiple of 1 MiB).
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    sizes: Vec<u32>,
    /// Timed repetitions per size, after one warm-up; the median is reported.
    #[arg(long, default_value_t = 5)]
    iters: u32,
    /// Small transfers timed for the latency percentiles.
    #[arg(long, default_value_t = 500)]
    latency_iters: u32,
    /// Size of one small transfer in KiB.
    #[arg(long, default_value_t = 64)]
    small_kib: u32,
    /// Largest chunk the connector sends, in KiB (host memory; device chunks are whole layers).
    #[arg(long, default_value_t = 1024)]
    chunk_kib: usize,
    /// Where the pools live: cpu; cuda:N (device memory of GPU N, for cuda-ipc; the ceiling is then
    /// a plain device-to-device copy of the same bytes); or cuda:A,cuda:B (the source pool on GPU A,
    /// the destination on GPU B, for nccl and cuda-ipc; the ceilings are then a bare NCCL send and a
    /// cudaMemcpyPeer of the same bytes between the two GPUs, the ratio against the backend's kind).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// With the tcp backend: also time it over mutual TLS (certificates of a throwaway CA made in
    /// memory), interleaved with the plain runs, and report both.
    #[arg(long)]
    tls: bool,
    /// Sleep through each transfer's 1 ms head start (the receiver's grant travelling to the
    /// sender, outside the timed part) instead of spinning, and await its completion instead of
    /// watching for it spinning (device pools): the transfer's first host steps then run on a core
    /// waking from idle, and its end includes a runtime thread's wake-up, where each raw reference
    /// starts on a core just busy with the previous measurement (as a prefill node's thread is,
    /// fresh from the prefill) and ends in a spinning synchronize.
    #[arg(long)]
    idle_start: bool,
    /// Pools exactly the largest transfer's size, as before 2026-11-28: that transfer then covers
    /// whole layer arrays, so its runs of consecutive layers touch and a backend may move several
    /// layers in one copy — which a serving pool, holding many requests, never allows. By default
    /// each pool holds twice the largest transfer, the receiver's blocks at its end: every layer
    /// is a run of its own, as a fresh request's are.
    #[arg(long)]
    exact_pool: bool,
    /// Run the receiving connectors in a second process (this command, started as a child), as a
    /// decode node's run beside a prefill node's: each process has its own driver state and
    /// threads, and device backends take their cross-process path (CUDA IPC handles and events,
    /// NCCL across processes). A transfer is timed from the sender's `send_ready` to the moment
    /// the child sees it verified, both on the host's monotonic clock.
    #[arg(long)]
    two_processes: bool,
    /// (The child of --two-processes: serve receivers, driven over stdin and stdout.)
    #[arg(long, hide = true)]
    serve_receivers: bool,
    /// (The child of --two-processes: blocks of its big pool.)
    #[arg(long, hide = true, default_value_t = 0)]
    pool_blocks: u32,
}

/// Where the pools live: the senders' and the receivers' (the same unless two GPUs are named).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Devices {
    src: Option<i32>,
    dst: Option<i32>,
}

/// `cpu`, `cuda`, `cuda:N`, or `cuda:A,cuda:B` (senders on GPU A, receivers on GPU B).
fn parse_devices(s: &str) -> anyhow::Result<Devices> {
    match s.split_once(',') {
        None => {
            let d = parse_device(s)?;
            Ok(Devices { src: d, dst: d })
        }
        Some((a, b)) => match (parse_device(a)?, parse_device(b)?) {
            (Some(a), Some(b)) if a != b => Ok(Devices { src: Some(a), dst: Some(b) }),
            _ => bail!("device {s:?}: two devices are two different GPUs, cuda:A,cuda:B"),
        },
    }
}

/// nccl moves blocks between two GPUs; cuda-ipc within one GPU or between two; the host backends
/// between pools of one.
fn check_devices(spec: &ConnectorSpec, d: Devices) -> anyhow::Result<()> {
    match (matches!(spec, ConnectorSpec::Nccl(_)), d.src != d.dst) {
        (true, false) => bail!("nccl connects two GPUs: pass --device cuda:A,cuda:B (e.g. cuda:0,cuda:1)"),
        (false, true) if !matches!(spec, ConnectorSpec::CudaIpc(_)) => {
            bail!("two GPUs need a device backend, nccl or cuda-ipc (the others move blocks between pools of one GPU)")
        }
        _ => Ok(()),
    }
}

/// `cpu` → None, `cuda` / `cuda:N` → Some(N).
fn parse_device(s: &str) -> anyhow::Result<Option<i32>> {
    match s {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => match s.strip_prefix("cuda:").map(str::parse::<i32>) {
            Some(Ok(n)) if n >= 0 => Ok(Some(n)),
            _ => bail!("unknown device {s:?}: expected cpu, cuda or cuda:N"),
        },
    }
}

fn pool(geometry: &Geometry, blocks: u32, device: Option<i32>) -> anyhow::Result<Arc<KvMemory>> {
    Ok(match device {
        None => KvMemory::host(geometry.clone(), blocks)?,
        Some(d) => KvMemory::cuda(geometry.clone(), blocks, d)?,
    })
}

/// `tandem kv conformance`.
#[derive(Args, Debug)]
pub(crate) struct ConformanceArgs {
    /// Backend: tcp, inproc, cuda-ipc, nccl, or plugin:/path/lib.so[?config].
    spec: String,
    /// Run only this case (see --list).
    #[arg(long)]
    case: Option<String>,
    /// Where the pools live: cpu, cuda:N (device memory; runs the device cases), or cuda:A,cuda:B
    /// (senders' pools on GPU A, receivers' on GPU B: the device cases for nccl and cuda-ipc).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// List the cases and exit.
    #[arg(long)]
    list: bool,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the tokio runtime")
}

pub(crate) fn run_conformance(args: ConformanceArgs) -> anyhow::Result<()> {
    if args.list {
        for case in tandem_kv_transfer::conformance::CASES {
            println!("{case}");
        }
        return Ok(());
    }
    let spec: ConnectorSpec = args.spec.parse()?;
    let devices = parse_devices(&args.device)?;
    let spec = spec.resolve(devices.src.is_some());
    check_devices(&spec, devices)?;
    let mut suite = Suite::new(spec.clone());
    match (devices.src, devices.dst) {
        (Some(a), Some(b)) if a != b => suite = suite.on_devices(a, b),
        (Some(d), _) => suite = suite.on_device(d),
        _ => {}
    }
    let cases: Vec<&str> = match &args.case {
        Some(c) if suite.cases().contains(&c.as_str()) => vec![c.as_str()],
        Some(c) => bail!("no conformance case {c:?} for {} (see --list)", args.device),
        None => suite.cases(),
    };
    let rt = runtime()?;
    // A backend that cannot even start (missing library, bad config) is one clear error, not N failures.
    rt.block_on(async {
        let probe = pool(&small_geometry(1)?, 1, devices.src)?;
        Connector::from_spec(&spec, probe, ConnectorConfig::default(), &Fabric::new()).await?;
        anyhow::Ok(())
    })?;
    let mut failed = 0;
    for case in &cases {
        let t = Instant::now();
        let r = rt.block_on(suite.run_case(case));
        match r {
            Ok(()) => println!("ok    {case} ({:.0} ms)", t.elapsed().as_secs_f64() * 1e3),
            Err(e) => {
                failed += 1;
                println!("FAIL  {case}: {e}");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} conformance cases failed", cases.len());
    }
    println!("all {} conformance cases passed for {}", cases.len(), args.spec);
    Ok(())
}

/// 32 layers of 32 KiB blocks (8 KV heads x 128 dims x 8 tokens, bf16): one block is 1 MiB over all layers.
fn big_geometry() -> Geometry {
    Geometry::new(GeometrySpec {
        model_id: "bench".into(),
        dtype: DType::BF16,
        block_size: 8,
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        layout: Layout::KvHeadTokenDim,
    })
    .expect("valid geometry")
}

/// 2 layers, one block of `kib` KiB in total.
fn small_geometry(kib: u32) -> anyhow::Result<Geometry> {
    Ok(Geometry::new(GeometrySpec {
        model_id: "bench-small".into(),
        dtype: DType::BF16,
        block_size: kib,
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 128,
        layout: Layout::KvHeadTokenDim,
    })?)
}

fn filled(geometry: &Geometry, blocks: u32, device: Option<i32>) -> anyhow::Result<Arc<KvMemory>> {
    let memory = pool(geometry, blocks, device)?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut buf = vec![0u8; geometry.block_bytes()];
    for layer in 0..geometry.num_layers() {
        for b in 0..blocks {
            for chunk in buf.chunks_mut(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
            }
            memory.write_block(layer, b, &buf)?;
        }
    }
    Ok(memory)
}

/// How `kv_once` starts and ends its timed part.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// Sleep through the head start instead of spinning (`--idle-start`).
    idle_start: bool,
    /// Watch for the receiver's completion by spinning rather than awaiting it (device pools,
    /// unless `--idle-start`): the raw references end in a spinning synchronize, and a runtime
    /// thread's wake-up is the bench's cost, not the transfer's.
    spin_end: bool,
    /// Blocks of each pool.
    pool_blocks: u32,
}

impl Timing {
    fn of(args: &KvBenchArgs, devices: Devices, pool_blocks: u32) -> Timing {
        Timing { idle_start: args.idle_start, spin_end: !args.idle_start && devices.src.is_some(), pool_blocks }
    }
}

/// One transfer of `blocks` blocks, every layer ready (as after a whole prefill); returns the time
/// from `send_ready` to the receiver's verified completion.
async fn kv_once(tx: &Connector, rx: &Connector, blocks: u32, timing: Timing) -> anyhow::Result<Duration> {
    // The sender's first blocks into the receiver's last (each pool's size is `timing.pool_blocks`).
    let ids: Vec<u32> = (0..blocks).collect();
    let dst_first = timing.pool_blocks.checked_sub(blocks).context("a transfer larger than the pool")?;
    let mut recv = rx.expect((dst_first..dst_first + blocks).collect(), 0, None)?;
    // A decode node hands the descriptor to the prefill node through a gRPC call (hundreds of
    // microseconds) while the receiver's grant travels to a sender that writes directly: give it
    // that head start, outside the timed part.
    head_start(timing.idle_start).await;
    let t = Instant::now();
    let mut send = tx.send_ready(recv.descriptor(), ids, 0, None)?;
    if timing.spin_end {
        while matches!(recv.progress().state, TransferState::Pending) {
            std::hint::spin_loop();
        }
    }
    recv.wait().await?;
    let elapsed = t.elapsed();
    send.wait().await?;
    Ok(elapsed)
}

/// The 1 ms before each timed transfer and device reference, outside the timed part: spinning, so
/// that the timed part starts on a core as awake as a prefill node's thread fresh from the
/// prefill, unless `idle` (`--idle-start`) asks for a core waking from idle; either way the GPUs
/// have been idle for as long before each.
async fn head_start(idle: bool) {
    let head_start = Duration::from_millis(1);
    if idle {
        tokio::time::sleep(head_start).await;
    } else {
        let until = Instant::now() + head_start;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

/// A plain loopback TCP connection moving the same bytes, acknowledged with one byte like a transfer is.
struct RawPair {
    tx: TcpStream,
    rx: TcpStream,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl RawPair {
    async fn new(max_bytes: usize) -> anyhow::Result<RawPair> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (tx, (rx, _)) = (tx?, accepted?);
        tx.set_nodelay(true)?;
        rx.set_nodelay(true)?;
        let src: Vec<u8> = (0..max_bytes).map(|i| (i as u8).wrapping_mul(31)).collect();
        Ok(RawPair { tx, rx, src, dst: vec![0u8; max_bytes] })
    }

    async fn once(&mut self, bytes: usize) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let (tx, rx, src, dst) = (&mut self.tx, &mut self.rx, &self.src[..bytes], &mut self.dst[..bytes]);
        let send = async {
            tx.write_all(src).await?;
            let mut ack = [0u8; 1];
            tx.read_exact(&mut ack).await?;
            anyhow::Ok(())
        };
        let recv = async {
            rx.read_exact(dst).await?;
            rx.write_all(&[1]).await?;
            anyhow::Ok(())
        };
        let (a, b) = tokio::join!(send, recv);
        a?;
        b?;
        Ok(t.elapsed())
    }
}

/// What a backend is measured against.
enum Raw {
    /// A loopback socket between host buffers.
    Socket(RawPair),
    /// One plain device-to-device copy between the two pools of one GPU.
    Device { src: Arc<KvMemory>, dst: Arc<KvMemory> },
    /// One bare NCCL send between the two pools, on two GPUs.
    Nccl { pair: Arc<RawNcclPair>, src: Arc<KvMemory>, dst: Arc<KvMemory> },
    /// One `cudaMemcpyPeer` between the two pools, on two GPUs.
    Peer { src: Arc<KvMemory>, dst: Arc<KvMemory> },
}

impl Raw {
    /// The references for pools `src` and `dst`: a socket between host buffers of `max_bytes`, one
    /// copy between the pools of one GPU, or, between two GPUs (`pair` set), a bare NCCL send and a
    /// peer copy — the backend's own kind first (NCCL for nccl, the copy engines otherwise), the
    /// other one second.
    async fn new(
        src: &Arc<KvMemory>,
        dst: &Arc<KvMemory>,
        pair: Option<&Arc<RawNcclPair>>,
        nccl_first: bool,
        max_bytes: usize,
    ) -> anyhow::Result<(Raw, Option<Raw>)> {
        let (src, dst) = (Arc::clone(src), Arc::clone(dst));
        Ok(match (src.kind(), pair) {
            (MemoryKind::Host, _) => (Raw::Socket(RawPair::new(max_bytes).await?), None),
            (_, Some(pair)) => {
                let nccl = Raw::Nccl { pair: Arc::clone(pair), src: Arc::clone(&src), dst: Arc::clone(&dst) };
                let peer = Raw::Peer { src, dst };
                if nccl_first { (nccl, Some(peer)) } else { (peer, Some(nccl)) }
            }
            (_, None) => (Raw::Device { src, dst }, None),
        })
    }

    /// Whether this reference is a copy, also timed by CUDA events around it (the copy engines'
    /// own time; see `once`).
    fn is_copy(&self) -> bool {
        matches!(self, Raw::Device { .. } | Raw::Peer { .. })
    }

    fn name(&self) -> &'static str {
        match self {
            Raw::Socket(_) => "raw socket",
            Raw::Device { .. } => "raw D2D copy",
            Raw::Nccl { .. } => "raw NCCL send",
            Raw::Peer { .. } => "raw peer copy",
        }
    }

    /// One measurement: the time the ratio is taken against — on the host, from the call to its
    /// end, as a transfer is timed — and, for a copy, the copy engines' time alone. A device
    /// reference starts after the same head start as a transfer (`timing`), so it too finds the
    /// GPUs idle and the core awake.
    async fn once(&mut self, bytes: usize, timing: Timing) -> anyhow::Result<(Duration, Option<Duration>)> {
        if !matches!(self, Raw::Socket(_)) {
            head_start(timing.idle_start).await;
        }
        let copy = |t: tandem_kv_transfer::CopyTime| (t.host, Some(t.device));
        Ok(match self {
            Raw::Socket(p) => (p.once(bytes).await?, None),
            Raw::Device { src, dst } => copy(tandem_kv_transfer::raw_device_copy(src, dst, bytes)?),
            Raw::Nccl { pair, src, dst } => (pair.send(src, dst, bytes)?, None),
            Raw::Peer { src, dst } => copy(tandem_kv_transfer::raw_peer_copy(src, dst, bytes)?),
        })
    }
}

/// Which of the receivers' pools a transfer goes to.
#[derive(Debug, Clone, Copy)]
enum Pool {
    /// `big_geometry`, `Timing::pool_blocks` blocks.
    Big,
    /// `small_geometry`, one block.
    Small,
}

/// One transfer into `rx` here, or into the child's receivers.
async fn timed(tx: &Connector, rx: Option<&Connector>, child: Option<&mut ReceiverProcess>, pool: Pool, blocks: u32, timing: Timing) -> anyhow::Result<Duration> {
    match (child, rx) {
        (Some(child), _) => child.once(tx, pool, blocks, timing).await,
        (None, Some(rx)) => kv_once(tx, rx, blocks, timing).await,
        (None, None) => bail!("no receiver"),
    }
}

/// The host's monotonic clock in nanoseconds, which every process of the host reads alike (a
/// `std::time::Instant` cannot cross a process boundary).
fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The child process of `--two-processes`: this command again, with `--serve-receivers`, holding
/// the receiving connectors and their pools; driven by lines over its stdin and stdout.
struct ReceiverProcess {
    child: std::process::Child,
    /// Taken when the bench ends: the child's stdin closing ends it.
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    /// The pools' geometries, as the child's receivers name them in their descriptors.
    big: Geometry,
    small: Geometry,
}

impl ReceiverProcess {
    fn start(args: &KvBenchArgs, device: Option<i32>, pool_blocks: u32) -> anyhow::Result<ReceiverProcess> {
        use std::process::{Command, Stdio};
        let exe = std::env::current_exe().context("finding this executable")?;
        let device = device.map_or("cpu".to_string(), |d| format!("cuda:{d}"));
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "kv", "--serve-receivers", "--backend", &args.backend, "--device", &device])
            .args(["--pool-blocks", &pool_blocks.to_string(), "--small-kib", &args.small_kib.to_string()])
            .args(["--chunk-kib", &args.chunk_kib.to_string()]);
        if args.idle_start {
            cmd.arg("--idle-start");
        }
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().context("starting the receivers' process")?;
        let (stdin, stdout) = (child.stdin.take().expect("piped"), child.stdout.take().expect("piped"));
        let mut p = ReceiverProcess { child, stdin: Some(stdin), stdout: std::io::BufReader::new(stdout), big: big_geometry(), small: small_geometry(args.small_kib)? };
        match p.line()?.as_str() {
            "ready" => Ok(p),
            other => bail!("the receivers' process: {other}"),
        }
    }

    /// The child's next line (an error when it ended or reported one).
    fn line(&mut self) -> anyhow::Result<String> {
        use std::io::BufRead;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("the receivers' process ended ({status})");
        }
        let line = line.trim_end().to_string();
        match line.strip_prefix("error ") {
            Some(e) => bail!("the receivers' process: {e}"),
            None => Ok(line),
        }
    }

    /// One transfer of `blocks` blocks into the child's `pool` (its last blocks), every layer ready:
    /// from `send_ready` here to the child seeing it verified, on the monotonic clock.
    /// (Its reads of the child's lines block the thread: the bench's, never a runtime worker.)
    async fn once(&mut self, tx: &Connector, pool: Pool, blocks: u32, timing: Timing) -> anyhow::Result<Duration> {
        use std::io::Write;
        let (name, geometry, pool_blocks) = match pool {
            Pool::Big => ("big", self.big.clone(), timing.pool_blocks),
            Pool::Small => ("small", self.small.clone(), 1),
        };
        let first = pool_blocks.checked_sub(blocks).context("a transfer larger than the pool")?;
        let stdin = self.stdin.as_mut().context("the receivers' process was let go")?;
        writeln!(stdin, "expect {name} {first} {blocks}")?;
        stdin.flush()?;
        let line = self.line()?;
        let mut f = line.splitn(4, ' ');
        let (Some("desc"), Some(id), Some(binding), Some(endpoint)) = (f.next(), f.next(), f.next(), f.next()) else {
            bail!("the receivers' process answered {line:?}");
        };
        let desc = tandem_kv_transfer::TransferDescriptor {
            id: id.parse()?,
            endpoint: endpoint.to_string(),
            dst_blocks: (first..first + blocks).collect(),
            geometry,
            binding: binding.parse()?,
        };
        // The same head start as `kv_once`, outside the timed part.
        let until = Instant::now() + Duration::from_millis(1);
        if timing.idle_start {
            std::thread::sleep(Duration::from_millis(1));
        } else {
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        let t0 = monotonic_ns();
        let mut send = tx.send_ready(&desc, (0..blocks).collect(), 0, None)?;
        let line = self.line()?;
        let t1: u64 = line.strip_prefix("done ").with_context(|| format!("the receivers' process answered {line:?}"))?.parse()?;
        send.wait().await?;
        Ok(Duration::from_nanos(t1.saturating_sub(t0)))
    }
}

impl Drop for ReceiverProcess {
    fn drop(&mut self) {
        // Its stdin closing ends it (it prints its trace, if any, and shuts its connectors down);
        // one still running after 5 s (stuck in a transfer) is killed.
        drop(self.stdin.take());
        for _ in 0..100 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child of `--two-processes`: the receiving connectors of both pools, driven over stdin
/// (`expect big|small FIRST N`) and stdout (`ready`, then per transfer `desc ID BINDING ENDPOINT`
/// and `done T` — T on the monotonic clock when it saw the transfer verified — or `error WHY`).
fn serve_receivers(args: KvBenchArgs) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};
    let device = parse_device(&args.device)?;
    let spec = args.backend.parse::<ConnectorSpec>()?.resolve(device.is_some());
    let rt = runtime()?;
    let mut out = std::io::stdout().lock();
    let made = rt.block_on(async {
        let fabric = Fabric::new();
        let config = ConnectorConfig { transfer_timeout: Duration::from_secs(120), max_chunk_bytes: args.chunk_kib << 10, ..ConnectorConfig::default() };
        let big = Connector::from_spec(&spec, pool(&big_geometry(), args.pool_blocks, device)?, config.clone(), &fabric).await?;
        let small = Connector::from_spec(&spec, pool(&small_geometry(args.small_kib)?, 1, device)?, config, &fabric).await?;
        anyhow::Ok((big, small))
    });
    let (big, small) = match made {
        Ok(c) => c,
        Err(e) => {
            writeln!(out, "error {e:#}")?;
            return Err(e);
        }
    };
    writeln!(out, "ready")?;
    out.flush()?;
    let spin = !args.idle_start && device.is_some();
    // (The connectors' calls below need the runtime's context; their tasks run on its workers.)
    let _in_runtime = rt.enter();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let r = (|| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let ["expect", which, first, n] = f[..] else { bail!("unknown command {line:?}") };
            let rx = if which == "small" { &small } else { &big };
            let (first, n): (u32, u32) = (first.parse()?, n.parse()?);
            let end = first.checked_add(n).context("a block range past u32")?;
            let mut recv = rx.expect((first..end).collect(), 0, None)?;
            let d = recv.descriptor();
            writeln!(out, "desc {} {} {}", d.id, d.binding, d.endpoint)?;
            out.flush()?;
            if spin {
                while matches!(recv.progress().state, TransferState::Pending) {
                    std::hint::spin_loop();
                }
            }
            rt.block_on(recv.wait())?;
            anyhow::Ok(monotonic_ns())
        })();
        match r {
            Ok(t) => writeln!(out, "done {t}")?,
            Err(e) => writeln!(out, "error {e:#}")?,
        }
        out.flush()?;
    }
    for line in tandem_kv_transfer::trace_dump() {
        eprintln!("{line}");
    }
    Ok(())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn percentile(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

fn gbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn memcpy_time(bytes: usize) -> Duration {
    let src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // fault the pages in
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        runs.push(t.elapsed());
    }
    std::hint::black_box(&dst);
    median(runs)
}

pub(crate) fn run_bench(args: KvBenchArgs) -> anyhow::Result<()> {
    if args.serve_receivers {
        return serve_receivers(args);
    }
    let devices = parse_devices(&args.device)?;
    let spec = args.backend.parse::<ConnectorSpec>()?.resolve(devices.src.is_some());
    check_devices(&spec, devices)?;
    if args.two_processes && (args.tls || matches!(spec, ConnectorSpec::Inproc(_))) {
        bail!("--two-processes times a backend between processes: not with --tls, nor with inproc (one process only)");
    }
    if args.sizes.is_empty() || args.sizes.contains(&0) || args.iters == 0 || args.latency_iters == 0 || args.small_kib == 0 || args.chunk_kib == 0 {
        bail!("sizes, iterations and the small size must all be > 0");
    }
    if args.tls && !matches!(spec, ConnectorSpec::Tcp(_)) {
        bail!("--tls times the tcp backend over TLS: use it with --backend tcp");
    }
    let rt = runtime()?;
    // The receiving connectors run on a runtime of their own, as a decode process's do: sharing one
    // would have a busy sender's worker hold up the receiver's socket reads (the runtime notices
    // readable sockets when a worker parks), which no pair of processes suffers.
    let rx_rt = runtime()?;
    let result = rt.block_on(bench(spec, args, devices, rx_rt.handle().clone()));
    drop(rt);
    result
}

/// A receiving connector, built on `rt` (its tasks run there).
async fn receiver(
    rt: &tokio::runtime::Handle,
    spec: &ConnectorSpec,
    memory: &Arc<KvMemory>,
    config: &ConnectorConfig,
    fabric: &Fabric,
) -> anyhow::Result<Connector> {
    let (spec, memory, config, fabric) = (spec.clone(), Arc::clone(memory), config.clone(), fabric.clone());
    Ok(rt.spawn(async move { Connector::from_spec(&spec, memory, config, &fabric).await }).await??)
}

/// `spec` (tcp) with mutual TLS from certificates of a throwaway CA for 127.0.0.1.
fn with_throwaway_tls(spec: &ConnectorSpec) -> anyhow::Result<ConnectorSpec> {
    use tandem_kv_transfer::transport::tcp::TcpTls;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let ConnectorSpec::Tcp(opts) = spec else { bail!("--tls needs the tcp backend") };
    let issued = crate::cert::issue(&["127.0.0.1".to_string()], &["bench"], 1)?;
    let (_, cert, key) = issued.certs.first().context("no certificate issued")?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let ca: CertificateDer<'static> = issued.ca.der().clone();
    let tls = TcpTls::new(vec![cert.der().clone()], key, &[ca])?;
    Ok(ConnectorSpec::Tcp(tandem_kv_transfer::transport::tcp::TcpOptions { tls: Some(tls), ..opts.clone() }))
}

async fn bench(spec: ConnectorSpec, args: KvBenchArgs, devices: Devices, rx_rt: tokio::runtime::Handle) -> anyhow::Result<()> {
    let fabric = Fabric::new();
    let config = ConnectorConfig {
        transfer_timeout: Duration::from_secs(120),
        max_chunk_bytes: args.chunk_kib << 10,
        ..ConnectorConfig::default()
    };
    let max_mib = *args.sizes.iter().max().expect("non-empty");
    let pool_blocks = match args.exact_pool {
        true => max_mib,
        false => max_mib.checked_mul(2).context("--sizes: the largest transfer is too large")?,
    };
    let timing = Timing::of(&args, devices, pool_blocks);
    let g = big_geometry();
    // (With --two-processes the child holds the receivers' pools; `dst` here serves the raw
    // references only.)
    let (src, dst) = (filled(&g, pool_blocks, devices.src)?, pool(&g, pool_blocks, devices.dst)?);
    let tx = Connector::from_spec(&spec, Arc::clone(&src), config.clone(), &fabric).await?;
    let mut child = match args.two_processes {
        true => Some(ReceiverProcess::start(&args, devices.dst, pool_blocks)?),
        false => None,
    };
    let rx = match child {
        Some(_) => None,
        None => Some(receiver(&rx_rt, &spec, &dst, &config, &fabric).await?),
    };
    // With --tls, a second pair over the same pools moving the same blocks over mutual TLS.
    let tls_spec = if args.tls { Some(with_throwaway_tls(&spec)?) } else { None };
    let tls_pair = match &tls_spec {
        Some(s) => Some((
            Connector::from_spec(s, Arc::clone(&src), config.clone(), &fabric).await?,
            receiver(&rx_rt, s, &dst, &config, &fabric).await?,
        )),
        None => None,
    };
    // The reference moving the same bytes: a loopback socket between host buffers, one plain
    // device-to-device copy between two pools of one GPU, or one bare NCCL send between two GPUs.
    let pair = match (devices.src, devices.dst) {
        (Some(a), Some(b)) if a != b => Some(Arc::new(tokio::task::spawn_blocking(move || RawNcclPair::new(a, b)).await??)),
        _ => None,
    };
    let nccl_first = matches!(spec, ConnectorSpec::Nccl(_));
    let (mut raw, mut raw2) = Raw::new(&src, &dst, pair.as_ref(), nccl_first, (max_mib as usize) << 20).await?;
    println!(
        "tandem bench kv: backend {} ({}), pools of {} MiB in {}{}, {} cores, chunks of {} KiB, median of {} runs after 1 warm-up",
        tx.backend(),
        match (&rx, &child) {
            (Some(rx), _) => rx.endpoint(),
            (None, Some(c)) => format!("receivers in process {}", c.child.id()),
            (None, None) => unreachable!("receivers here or in a child"),
        },
        pool_blocks,
        args.device,
        if args.exact_pool { " (--exact-pool)" } else { "" },
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        config.max_chunk_bytes >> 10,
        args.iters
    );
    let tls_header = if tls_pair.is_some() { format!("  {:>15}  {:>9}", "tandem TLS GB/s", "TLS/plain") } else { String::new() };
    let second_header = match &raw2 {
        Some(r) => format!("  {:>18}  {:>8}", format!("{} GB/s", r.name()), "ratio"),
        None => String::new(),
    };
    // A raw copy is timed as a transfer is, on the host from the call to its end; the copy
    // engines' time alone (CUDA events around the copy) is shown beside, with the ratio to it.
    let engine_header = if raw.is_copy() || raw2.as_ref().is_some_and(Raw::is_copy) {
        format!("  {:>17}  {:>8}", "copy engines GB/s", "ratio")
    } else {
        String::new()
    };
    println!(
        "{:>8}  {:>12}  {:>16}  {:>8}{second_header}  {:>12}{tls_header}{engine_header}",
        "size",
        "tandem GB/s",
        format!("{} GB/s", raw.name()),
        "ratio",
        "memcpy GB/s"
    );
    for &mib in &args.sizes {
        let bytes = (mib as usize) << 20;
        timed(&tx, rx.as_ref(), child.as_mut(), Pool::Big, mib, timing).await?;
        raw.once(bytes, timing).await?;
        if let Some(r) = &mut raw2 {
            r.once(bytes, timing).await?;
        }
        if let Some((ttx, trx)) = &tls_pair {
            kv_once(ttx, trx, mib, timing).await?;
        }
        let (mut kv, mut sock, mut tls, mut second) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // The copy engines' own time of the raw copy (device pools), where one of the references is a copy.
        let mut engines = Vec::new();
        // Interleave so all see the same machine state.
        for _ in 0..args.iters {
            kv.push(timed(&tx, rx.as_ref(), child.as_mut(), Pool::Big, mib, timing).await?);
            let (host, device) = raw.once(bytes, timing).await?;
            sock.push(host);
            engines.extend(device);
            if let Some(r) = &mut raw2 {
                let (host, device) = r.once(bytes, timing).await?;
                second.push(host);
                engines.extend(device);
            }
            if let Some((ttx, trx)) = &tls_pair {
                tls.push(kv_once(ttx, trx, mib, timing).await?);
            }
        }
        let (k, s) = (gbs(bytes, median(kv)), gbs(bytes, median(sock)));
        let tls_cols = if tls.is_empty() {
            String::new()
        } else {
            let t = gbs(bytes, median(tls));
            format!("  {:>15.2}  {:>8.0}%", t, 100.0 * t / k)
        };
        let second_cols = if second.is_empty() {
            String::new()
        } else {
            let r = gbs(bytes, median(second));
            format!("  {:>18.2}  {:>7.0}%", r, 100.0 * k / r)
        };
        let engine_cols = if engines.is_empty() {
            String::new()
        } else {
            let e = gbs(bytes, median(engines));
            format!("  {:>17.2}  {:>7.0}%", e, 100.0 * k / e)
        };
        println!(
            "{:>5} MiB  {:>12.2}  {:>16.2}  {:>7.0}%{second_cols}  {:>12.2}{tls_cols}{engine_cols}",
            mib,
            k,
            s,
            100.0 * k / s,
            gbs(bytes, memcpy_time(bytes))
        );
    }
    // Latency of small transfers.
    let sg = small_geometry(args.small_kib)?;
    let (ssrc, sdst) = (filled(&sg, 1, devices.src)?, pool(&sg, 1, devices.dst)?);
    let stx = Connector::from_spec(&spec, Arc::clone(&ssrc), config.clone(), &fabric).await?;
    let srx = match child {
        Some(_) => None,
        None => Some(Connector::from_spec(&spec, Arc::clone(&sdst), config.clone(), &fabric).await?),
    };
    let small_tls = match &tls_spec {
        Some(s) => Some((
            Connector::from_spec(s, Arc::clone(&ssrc), config.clone(), &fabric).await?,
            Connector::from_spec(s, Arc::clone(&sdst), config, &fabric).await?,
        )),
        None => None,
    };
    let small = (args.small_kib as usize) << 10;
    let mut raw_small = match raw {
        Raw::Socket(_) => raw,
        _ => Raw::new(&ssrc, &sdst, pair.as_ref(), nccl_first, small).await?.0,
    };
    let timing = Timing { pool_blocks: 1, ..timing };
    for _ in 0..20 {
        timed(&stx, srx.as_ref(), child.as_mut(), Pool::Small, 1, timing).await?;
        raw_small.once(small, timing).await?;
        if let Some((ttx, trx)) = &small_tls {
            kv_once(ttx, trx, 1, timing).await?;
        }
    }
    let (mut kv, mut sock, mut tls) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.latency_iters {
        kv.push(timed(&stx, srx.as_ref(), child.as_mut(), Pool::Small, 1, timing).await?);
        sock.push(raw_small.once(small, timing).await?.0);
        if let Some((ttx, trx)) = &small_tls {
            tls.push(kv_once(ttx, trx, 1, timing).await?);
        }
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "latency of {} KiB transfers ({} runs): tandem p50 {:.0} us, p99 {:.0} us; {} p50 {:.0} us, p99 {:.0} us; p50 ratio {:.2}x",
        args.small_kib,
        args.latency_iters,
        us(percentile(&kv, 0.5)),
        us(percentile(&kv, 0.99)),
        raw_small.name(),
        us(percentile(&sock, 0.5)),
        us(percentile(&sock, 0.99)),
        us(percentile(&kv, 0.5)) / us(percentile(&sock, 0.5)),
    );
    if !tls.is_empty() {
        println!(
            "latency over TLS: tandem p50 {:.0} us, p99 {:.0} us; p50 ratio to plain {:.2}x",
            us(percentile(&tls, 0.5)),
            us(percentile(&tls, 0.99)),
            us(percentile(&tls, 0.5)) / us(percentile(&kv, 0.5)),
        );
    }
    let m = tx.metrics();
    println!(
        "self-check: {} transfers sent, last at {:.2} GB/s as the sender measured it",
        m.sent_ok,
        m.last_send_bytes_per_sec as f64 / 1e9
    );
    for line in tandem_kv_transfer::trace_dump() {
        eprintln!("{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Devices, check_devices, parse_devices};
    use tandem_kv_transfer::ConnectorSpec;

    #[test]
    fn two_gpus_take_a_device_backend() {
        let two = parse_devices("cuda:0,cuda:1").unwrap();
        assert_eq!(two, Devices { src: Some(0), dst: Some(1) });
        assert!(parse_devices("cuda:1,cuda:1").is_err());
        let spec = |s: &str| s.parse::<ConnectorSpec>().unwrap().resolve(true);
        assert!(check_devices(&spec("nccl"), two).is_ok());
        assert!(check_devices(&spec("cuda-ipc"), two).is_ok());
        assert!(check_devices(&spec("tcp"), two).unwrap_err().to_string().contains("device backend"));
        let one = parse_devices("cuda:0").unwrap();
        assert!(check_devices(&spec("nccl"), one).unwrap_err().to_string().contains("two GPUs"));
        assert!(check_devices(&spec("cuda-ipc"), one).is_ok());
    }
}
