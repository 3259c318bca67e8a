//! The Llama-family decoder on a CUDA GPU: bf16 weights, a bf16 paged KV pool in device memory,
//! kernels from `tandem_kernels::cuda` (NVRTC-compiled at start, cached on disk) and cuBLAS GEMMs.
//!
//! One forward pass runs a flat batch of chunks exactly like the CPU model: embedding → per
//! layer (RMSNorm → QKV GEMM → RoPE → K/V into paged blocks → attention → O GEMM accumulated
//! into the f32 residual → RMSNorm → gate/up GEMM → SiLU·mul → down GEMM accumulated into the
//! residual) → final RMSNorm and LM head over the rows that want logits. The logits stay on the
//! device; [`CudaModel::sample`] samples them there and copies back only tokens and logprobs
//! (plus a penalised row when top logprobs were asked for). Steps can overlap: the sampler's
//! draws stay in device memory, and the next pass's ids can be taken from them on the device
//! ([`CudaModel::forward_from`]) before the host has read them ([`CudaModel::sample_collect`]);
//! per-step inputs go through page-locked staging, so enqueuing a step never waits for the one
//! running.
//!
//! Invariants:
//! - the residual stream is f32; GEMM inputs and the KV cache are bf16 (f32 accumulation);
//! - every buffer is allocated once, at load, for the largest step the scheduler can build
//!   (`max_num_batched_tokens` tokens, `max_num_seqs` logits rows), so a step allocates no
//!   device memory and device memory does not grow with the number of requests (the one
//!   exception: the sampler's penalty-history buffers grow, by doubling, to the longest history
//!   a step has needed);
//! - the KV pool takes `memory_utilization` of the GPU's total memory minus what is in use once
//!   weights and workspace are resident;
//! - the KV pool is one plain `cuMemAlloc` allocation, zeroed at load and exportable through CUDA
//!   IPC ([`cuda::IpcArrays`]): every layer's block array lies in it back to back (each 256-byte
//!   aligned) and is a view the kernels take like any buffer; the views are never freed on their
//!   own (only borrowed out of the `IpcArrays`, which leaks them before freeing the allocation),
//!   and their addresses never change, so captured graphs and registered transfer memory stay
//!   valid for the model's life;
//! - KV transfers go through exactly one of two memories, fixed by the first registration: the
//!   host mirror ([`CudaModel::mirror`]: observed prefill steps copy completing blocks into it,
//!   received blocks are uploaded from it) or the pool itself ([`CudaModel::device_transfer_memory`]:
//!   observed steps report a layer once the device wrote it, received blocks are already in place);
//! - within a layer every chunk's K/V is written before attention reads, as on the CPU.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::driver::result::DriverError;
use tandem_kernels::cpu::{self, PagedLayout};
use tandem_kernels::cuda::{
    self, AttnMeta, AttnShape, CudaSlice, GemmOut, GemmPlans, GemmShape, Gpu, Graph, IpcArrays, SampleParams, StagedCopy, Staging, TuneOut, bf16,
};

use super::BatchChunk;
use super::backend::{CudaSizing, DeviceSample, DeviceSampled, KvDType, TransferMemory, TransferPlace};
use super::kv_store::KvStore;
use crate::config::ModelConfig;
use crate::sched::PENDING_TOKEN;
use crate::weights::WeightStore;
use crate::{Error, Result};

impl From<cuda::GpuError> for Error {
    fn from(e: cuda::GpuError) -> Self {
        Error::Device(e.to_string())
    }
}

struct Layer {
    input_norm: CudaSlice<bf16>,
    /// Q, K and V stacked: `[(heads + 2*kv_heads) * head_dim, hidden]`.
    qkv: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    post_norm: CudaSlice<bf16>,
    /// Gate and up stacked: `[2 * intermediate, hidden]`.
    gate_up: CudaSlice<bf16>,
    down: CudaSlice<bf16>,
}

/// Per-step buffers, sized once for the largest step.
struct Workspace {
    max_tokens: usize,
    max_rows: usize,
    max_chunks: usize,
    max_blocks: usize,
    ids: CudaSlice<u32>,
    /// positions `[T]`, slots `[T]`, cu_q `[C+1]`, start_pos `[C]`, block tables `[C, max_blocks]`.
    meta: CudaSlice<i32>,
    /// Residual stream `[T, hidden]`.
    x: CudaSlice<f32>,
    normed: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    decode_ws: CudaSlice<f32>,
    /// Gathered rows that want logits `[R, hidden]` (f32) and their norm (bf16).
    x_rows: CudaSlice<f32>,
    normed_rows: CudaSlice<bf16>,
    /// `[R, vocab]`.
    logits: CudaSlice<f32>,
    /// `[S, vocab]`: logits rows arranged one per draw when draws share a row (n > 1).
    sample_logits: CudaSlice<f32>,
    tokens: CudaSlice<u32>,
    logprobs: CudaSlice<f32>,
    /// Sampler inputs: per-draw parameters `[R]`, penalty-history offsets `[R+1]`, and the
    /// histories' tokens and output counts (grown to the longest history seen).
    params: CudaSlice<SampleParams>,
    pen_offsets: CudaSlice<i32>,
    pen_tokens: CudaSlice<i32>,
    pen_counts: CudaSlice<i32>,
    /// Per token: the earlier step's draw its id comes from, or -1 (overlapped scheduling).
    src: CudaSlice<i32>,
    /// Page-locked staging, so enqueuing a step never waits for the one running.
    ids_stage: Staging<u32>,
    meta_stage: Staging<i32>,
    src_stage: Staging<i32>,
    params_stage: Staging<SampleParams>,
    offsets_stage: Staging<i32>,
    tokens_stage: Staging<u32>,
    logprobs_stage: Staging<f32>,
}

/// Draws enqueued by [`CudaModel::sample_enqueue`], for [`CudaModel::sample_collect`].
pub(crate) struct SampleTicket {
    tokens: StagedCopy,
    logprobs: StagedCopy,
    /// Rows after penalties (downloaded at enqueue), for draws that asked for top logprobs.
    penalised: Vec<Option<Vec<f32>>>,
}

/// A model resident on one GPU with its KV pool.
pub struct CudaModel {
    gpu: Gpu,
    cfg: ModelConfig,
    embed: CudaSlice<bf16>,
    layers: Vec<Layer>,
    norm: CudaSlice<bf16>,
    /// `None` when the embedding is tied.
    lm_head: Option<CudaSlice<bf16>>,
    inv_freq: CudaSlice<f32>,
    /// One array per layer, `[num_blocks][K, V][kv_heads][block_size][head_dim]` bf16, all in one
    /// IPC-exportable allocation (see the module invariants).
    kv: IpcArrays<bf16>,
    /// One block of one layer, for copy-on-write through a bounce buffer.
    bounce: CudaSlice<bf16>,
    layout: PagedLayout,
    num_blocks: usize,
    ws: Workspace,
    /// Logits rows the last forward pass left in `ws.logits`.
    rows: usize,
    max_model_len: usize,
    /// Which memory KV transfers use (chosen by the first registration, then fixed).
    transfers: Transfers,
    /// Copies between the pool and the mirror run here, overlapping the forward pass.
    copy_stream: Arc<CudaStream>,
    /// Replay decode steps from CUDA graphs (`TANDEM_CUDA_GRAPHS=0` turns it off).
    use_graphs: bool,
    graphs: HashMap<GraphKey, Graph>,
    /// Every GEMM goes through here: decode-bucket shapes run the algorithm tuned at load.
    plans: GemmPlans,
    /// Draws of the last [`Self::sample_enqueue`]: their tokens are in `ws.tokens`, where a
    /// later forward pass may take token ids from.
    last_draws: usize,
}

/// Which memory KV transfers use: chosen by the first registration ([`CudaModel::mirror`] or
/// [`CudaModel::device_transfer_memory`]) and kept for the model's life.
enum Transfers {
    /// Nothing registered yet.
    Unregistered,
    /// The host copy of the pool that transfers read and write.
    HostMirror(HostKvMirror),
    /// The pool itself, in device memory.
    Device,
}

fn bf16_vec(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Head dims the kernels are instantiated for.
const HEAD_DIMS: [usize; 2] = [64, 128];

impl CudaModel {
    /// Loads the weights of `dir` onto GPU `sizing.ordinal` and sizes the KV pool.
    pub fn load(dir: &Path, cfg: &ModelConfig, sizing: CudaSizing) -> Result<Self> {
        Self::check_shape(cfg)?;
        let gpu = Gpu::new(sizing.ordinal)?;
        let store = WeightStore::open(dir)?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let up = |w: &[f32]| -> Result<CudaSlice<bf16>> { Ok(gpu.upload(&bf16_vec(w))?) };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let w = super::Layer::load(&store, cfg, l)?;
            layers.push(Layer {
                input_norm: up(&w.input_norm)?,
                qkv: up(&w.qkv)?,
                o: up(&w.o)?,
                post_norm: up(&w.post_norm)?,
                gate_up: up(&w.gate_up)?,
                down: up(&w.down)?,
            });
        }
        let lm_head = super::load_lm_head(&store, cfg)?.map(|w| up(&w)).transpose()?;
        let embed = up(&store.f32("model.embed_tokens.weight", &[v, h])?)?;
        let norm = up(&store.f32("model.norm.weight", &[h])?)?;
        Self::assemble(gpu, cfg, Weights { embed, layers, norm, lm_head }, sizing)
    }

    /// A model of geometry `cfg` with random bf16 weights drawn from `seed` (benchmarks: an
    /// 8B-parameter geometry without an 8B checkpoint). Matrices are uniform with the variance of
    /// N(0, 1/fan_in), norms are 1, so activations stay finite.
    pub fn random(cfg: &ModelConfig, sizing: CudaSizing, seed: u64) -> Result<Self> {
        Self::check_shape(cfg)?;
        let gpu = Gpu::new(sizing.ordinal)?;
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (q_rows, kv_rows) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let mut tensor = 0u64;
        let mut matrix = |rows: usize, cols: usize| -> Result<CudaSlice<bf16>> {
            tensor += 1;
            Ok(gpu.upload(&random_bf16(rows * cols, (3.0 / cols as f32).sqrt(), seed ^ tensor.wrapping_mul(0x9E37_79B9_7F4A_7C15)))?)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            layers.push(Layer {
                input_norm: gpu.upload(&vec![bf16::ONE; h])?,
                qkv: matrix(q_rows + 2 * kv_rows, h)?,
                o: matrix(h, q_rows)?,
                post_norm: gpu.upload(&vec![bf16::ONE; h])?,
                gate_up: matrix(2 * i, h)?,
                down: matrix(h, i)?,
            });
        }
        let embed = matrix(v, h)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(matrix(v, h)?) };
        let norm = gpu.upload(&vec![bf16::ONE; h])?;
        Self::assemble(gpu, cfg, Weights { embed, layers, norm, lm_head }, sizing)
    }

    fn check_shape(cfg: &ModelConfig) -> Result<()> {
        if !HEAD_DIMS.contains(&cfg.head_dim) {
            return Err(Error::Device(format!("head_dim {} is not supported on CUDA (supported: {HEAD_DIMS:?})", cfg.head_dim)));
        }
        if cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) || cfg.num_heads / cfg.num_kv_heads > 16 {
            return Err(Error::Device(format!(
                "{} query heads over {} KV heads is not a supported GQA grouping on CUDA (groups of 1 to 16)",
                cfg.num_heads, cfg.num_kv_heads
            )));
        }
        Ok(())
    }

    fn assemble(gpu: Gpu, cfg: &ModelConfig, w: Weights, sizing: CudaSizing) -> Result<Self> {
        if !sizing.block_size.is_power_of_two() || !(8..=128).contains(&sizing.block_size) {
            return Err(Error::Device(format!("block size {} must be a power of two in 8..=128 on CUDA", sizing.block_size)));
        }
        if !(0.05..=1.0).contains(&sizing.memory_utilization) {
            return Err(Error::Device(format!("GPU memory utilization {} must be in [0.05, 1]", sizing.memory_utilization)));
        }
        let layout = PagedLayout { block_size: sizing.block_size, num_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim };
        let mut ws = Workspace::new(&gpu, cfg, &sizing, layout)?;
        let use_graphs = std::env::var("TANDEM_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let mut plans = GemmPlans::new(&gpu)?;
        if use_graphs && std::env::var("TANDEM_GEMM_TUNING").map_or(true, |v| v != "0") {
            tune_decode_gemms(&gpu, cfg, &w, &mut ws, &mut plans)?;
        }
        let inv_freq = gpu.upload(&cpu::rope_inv_freq(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling))?;
        gpu.synchronize()?;
        let (free, total) = gpu.mem_info()?;
        let in_use = total - free;
        let budget = (sizing.memory_utilization as f64 * total as f64) as usize;
        let block_bytes = layout.block_elems() * cfg.num_layers * std::mem::size_of::<bf16>();
        // Keep a little headroom for cuBLAS and the driver beyond what is resident now.
        let headroom = 256 << 20;
        let num_blocks = budget.saturating_sub(in_use + headroom) / block_bytes;
        let min_blocks = sizing.max_model_len.div_ceil(sizing.block_size);
        if num_blocks < min_blocks {
            return Err(Error::Device(format!(
                "GPU memory: {} MiB of {} MiB in use after loading; a utilization of {} leaves room for {num_blocks} KV blocks, \
                 fewer than one sequence of {} tokens needs ({min_blocks})",
                in_use >> 20,
                total >> 20,
                sizing.memory_utilization,
                sizing.max_model_len
            )));
        }
        // One zeroed cuMemAlloc allocation for every layer (not cudarc's pooled allocations, which
        // CUDA IPC cannot export).
        let kv = IpcArrays::<bf16>::new(gpu.stream(), cfg.num_layers, num_blocks * layout.block_elems())?;
        let bounce = gpu.alloc_zeros::<bf16>(layout.block_elems())?;
        let copy_stream = gpu.stream().context().new_stream().map_err(|e| Error::Device(format!("creating the copy stream: {e}")))?;
        tracing::info!(
            device = %gpu.name(),
            num_blocks,
            kv_gib = (num_blocks * block_bytes) as f64 / (1u64 << 30) as f64,
            "CUDA backend ready"
        );
        Ok(CudaModel {
            gpu,
            cfg: cfg.clone(),
            embed: w.embed,
            layers: w.layers,
            norm: w.norm,
            lm_head: w.lm_head,
            inv_freq,
            kv,
            bounce,
            layout,
            num_blocks,
            ws,
            rows: 0,
            max_model_len: sizing.max_model_len,
            transfers: Transfers::Unregistered,
            copy_stream,
            use_graphs,
            graphs: HashMap::new(),
            plans,
            last_draws: 0,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Blocks in the KV pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The GPU's name.
    pub fn device_name(&self) -> String {
        self.gpu.name()
    }

    /// Copies block `src` over block `dst` in every layer.
    pub(crate) fn copy_block(&mut self, src: u32, dst: u32) -> Result<()> {
        let n = self.layout.block_elems();
        let (s, d) = (src as usize * n, dst as usize * n);
        if s.max(d) + n > self.num_blocks * n {
            return Err(Error::Device(format!("block copy {src} -> {dst} outside a pool of {} blocks", self.num_blocks)));
        }
        let stream = self.gpu.stream().clone();
        for l in 0..self.kv.count() {
            let mut layer = self.kv.array_mut(l);
            stream.memcpy_dtod(&layer.slice(s..s + n), &mut self.bounce).map_err(dev)?;
            stream.memcpy_dtod(&self.bounce, &mut layer.slice_mut(d..d + n)).map_err(dev)?;
        }
        Ok(())
    }

    /// Runs `chunks` through the model, writing their K/V into the pool; the logits of the chunks
    /// with `want_logits` stay on the device for [`Self::sample`]. A step of single-token chunks
    /// (pure decode) is padded to a batch-size bucket and replayed from a CUDA graph captured the
    /// first time that bucket (and context class) runs.
    pub fn forward(&mut self, chunks: &[BatchChunk<'_>]) -> Result<()> {
        self.forward_from(chunks, &[])
    }

    /// [`Self::forward`] where some chunks' token is not known on the host yet: each
    /// `(chunk, draw)` in `from_prev` names a chunk whose one token is [`PENDING_TOKEN`] and the
    /// draw of the last [`Self::sample_enqueue`] that decides it; the device copies the sampled
    /// id in before the pass, so the host never waits for the previous step.
    pub(crate) fn forward_from(&mut self, chunks: &[BatchChunk<'_>], from_prev: &[(usize, usize)]) -> Result<()> {
        if let Some(&(c, d)) = from_prev.iter().find(|&&(c, d)| c >= chunks.len() || d >= self.last_draws || chunks[c].tokens != [PENDING_TOKEN]) {
            return Err(Error::Device(format!(
                "chunk {c} cannot take its token from draw {d} of the previous step ({} draws)",
                self.last_draws
            )));
        }
        let host = self.ws.prepare(chunks, from_prev, &self.cfg, &self.layout, self.num_blocks)?;
        let key = if self.use_graphs && host.all_decode && host.logit_rows.len() == chunks.len() {
            graph_key(chunks.len(), host.max_context, self.ws.max_chunks, self.max_model_len)
        } else {
            None
        };
        let Some(key) = key else {
            self.upload(&host)?;
            self.rows = host.logit_rows.len();
            return self.enqueue(&host);
        };
        let padded = host.padded(key.batch, key.context, self.ws.max_blocks);
        self.upload(&padded)?;
        if !self.graphs.contains_key(&key) {
            let graph = self.capture(&padded)?;
            self.graphs.insert(key, graph);
        }
        self.graphs[&key].launch().map_err(|e| Error::Device(format!("replaying the decode graph: {e}")))?;
        self.rows = chunks.len();
        Ok(())
    }

    /// [`Self::forward`] for a step whose completing prefills' KV (the `stage` blocks) is being
    /// transferred; after the pass is enqueued, layer by layer in order, `on_layer(l)` is called
    /// once layer `l` of `stage` is readable by the transfer, while later layers still compute:
    /// - with the host mirror: the `stage` blocks of layer `l` are copied into the mirror on the
    ///   copy stream as soon as the compute stream has written them (an event per layer), and
    ///   `on_layer(l)` is called once that copy is done;
    /// - in device-transfer mode nothing is copied: `on_layer(l)` is called once layer `l`'s event
    ///   has fired (every K/V write of the layer is complete in the pool), and the transfer reads
    ///   the blocks from the pool on its own stream.
    ///
    /// Fails before enqueuing anything when a `stage` block is outside the pool or no transfer
    /// memory is registered.
    pub fn forward_staged(&mut self, chunks: &[BatchChunk<'_>], stage: &[u32], on_layer: &mut dyn FnMut(usize)) -> Result<()> {
        let host = self.ws.prepare(chunks, &[], &self.cfg, &self.layout, self.num_blocks)?;
        if stage.iter().any(|&b| b as usize >= self.num_blocks) {
            return Err(Error::Device(format!("staging a block outside the pool of {}", self.num_blocks)));
        }
        if matches!(self.transfers, Transfers::Unregistered) {
            return Err(no_transfer_memory());
        }
        self.upload(&host)?;
        self.rows = host.logit_rows.len();
        let stream = self.gpu.stream().clone();
        let ctx = stream.context().clone();
        let mut written = Vec::with_capacity(self.cfg.num_layers);
        self.enqueue_observed(&host, &mut |_| {
            let ev = ctx.new_event(None)?;
            ev.record(&stream)?;
            written.push(ev);
            Ok(())
        })?;
        let mirror = match &mut self.transfers {
            Transfers::HostMirror(mirror) => mirror,
            Transfers::Device => {
                for (l, ev) in written.iter().enumerate() {
                    ev.synchronize().map_err(dev)?;
                    on_layer(l);
                }
                return Ok(());
            }
            Transfers::Unregistered => return Err(no_transfer_memory()),
        };
        let n = self.layout.block_elems();
        let runs = block_runs(stage);
        for (l, ev) in written.iter().enumerate() {
            self.copy_stream.wait(ev).map_err(dev)?;
            for &(first, len) in &runs {
                let range = first as usize * n..(first + len) as usize * n;
                self.copy_stream.memcpy_dtoh(&self.kv.array(l).slice(range), mirror.run_mut(l, first, len as usize)).map_err(dev)?;
            }
            self.copy_stream.synchronize().map_err(dev)?;
            on_layer(l);
        }
        Ok(())
    }

    /// Makes received blocks (a KV transfer wrote them into the transfer memory) visible to the
    /// forward pass. With the host mirror: [`Self::upload_from_mirror`]. In device-transfer mode
    /// there is nothing to do: the transfer wrote the blocks into the pool itself, from another
    /// stream or process, and waited for its writes to complete before reporting them, so work
    /// the compute stream runs afterwards sees them; and no work enqueued earlier can still write
    /// them (the engine fences before handing the blocks out, see
    /// [`crate::Engine::add_remote_request`]). The ids are checked either way.
    pub fn receive_blocks(&mut self, blocks: &[u32]) -> Result<()> {
        match self.transfers {
            Transfers::Device => match blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
                Some(b) => Err(Error::Device(format!("received block {b} is outside the pool of {}", self.num_blocks))),
                None => Ok(()),
            },
            Transfers::HostMirror(_) | Transfers::Unregistered => self.upload_from_mirror(blocks),
        }
    }

    /// Copies `blocks` of every layer from the host mirror into the pool (received KV), and
    /// waits for the copies.
    pub fn upload_from_mirror(&mut self, blocks: &[u32]) -> Result<()> {
        if blocks.iter().any(|&b| b as usize >= self.num_blocks) {
            return Err(Error::Device(format!("uploading a block outside the pool of {}", self.num_blocks)));
        }
        let Transfers::HostMirror(mirror) = &self.transfers else {
            return Err(Error::Device("no host KV mirror: register the KV cache for transfers through its host mirror first".into()));
        };
        let n = self.layout.block_elems();
        let stream = self.gpu.stream().clone();
        let runs = block_runs(blocks);
        for l in 0..self.kv.count() {
            let mut layer = self.kv.array_mut(l);
            for &(first, len) in &runs {
                let range = first as usize * n..(first + len) as usize * n;
                stream.memcpy_htod(mirror.run(l, first, len as usize), &mut layer.slice_mut(range)).map_err(dev)?;
            }
        }
        stream.synchronize().map_err(dev)?;
        Ok(())
    }

    /// The host mirror of the pool, allocated (zeroed) on first use; this registration puts the
    /// model in host-mirror mode for good. [`Error::Device`] in device-transfer mode (after
    /// [`Self::device_transfer_memory`]), which never mirrors the pool.
    pub fn mirror(&mut self) -> Result<&mut HostKvMirror> {
        if let Transfers::Unregistered = self.transfers {
            let layers = self.cfg.num_layers;
            self.transfers = Transfers::HostMirror(HostKvMirror {
                store: KvStore::new(layers, self.num_blocks, self.layout.block_elems()),
                block_elems: self.layout.block_elems(),
            });
        }
        match &mut self.transfers {
            Transfers::HostMirror(mirror) => Ok(mirror),
            Transfers::Device | Transfers::Unregistered => {
                Err(Error::Device("the KV pool is registered for device-resident transfers: it has no host mirror".into()))
            }
        }
    }

    /// The pool itself as transfer memory ([`TransferPlace::Device`]: every layer's array inside
    /// one `cuMemAlloc` allocation, with its CUDA IPC handle), putting the model in
    /// device-transfer mode for good: [`Self::forward_staged`] copies nothing and reports layer
    /// `l` once the device wrote it, [`Self::receive_blocks`] copies nothing. Calling it again
    /// returns the same memory. [`Error::Device`] once the host mirror exists ([`Self::mirror`]):
    /// a model's transfers use one memory, never both. The addresses stay valid while the model
    /// lives.
    pub fn device_transfer_memory(&mut self) -> Result<TransferMemory> {
        if let Transfers::HostMirror(_) = self.transfers {
            return Err(Error::Device(
                "the KV pool is already registered for transfers through its host mirror; an engine's transfers use either the mirror or device memory"
                    .into(),
            ));
        }
        let alloc = self.kv.alloc();
        let ipc_handle = alloc.export()?;
        let place = TransferPlace::Device { ordinal: self.gpu.ordinal(), allocation: alloc.ptr(), allocation_bytes: alloc.bytes(), ipc_handle };
        let layer_bases = (0..self.kv.count()).map(|l| std::ptr::without_provenance_mut::<u8>(self.kv.array_ptr(l) as usize)).collect();
        self.transfers = Transfers::Device;
        Ok(TransferMemory { dtype: KvDType::Bf16, num_blocks: self.num_blocks, layer_bases, place, keep_alive: None })
    }

    /// Whether KV transfers use the pool in device memory ([`Self::device_transfer_memory`]).
    pub fn transfers_in_device_memory(&self) -> bool {
        matches!(self.transfers, Transfers::Device)
    }

    /// Blocks until all work enqueued on the compute stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.gpu.synchronize()?)
    }

    /// Records one padded decode step into a CUDA graph.
    fn capture(&mut self, padded: &HostBatch) -> Result<Graph> {
        let stream = self.gpu.stream().clone();
        cuda::capture(&stream, || self.enqueue(padded))
    }

    /// Copies the step's ids and metadata in (through page-locked staging: no wait for the
    /// step still running) and takes the ids the previous step's sampler decides.
    fn upload(&mut self, host: &HostBatch) -> Result<()> {
        let ws = &mut self.ws;
        ws.ids_stage.upload(&self.gpu, &host.ids, &mut ws.ids.slice_mut(0..host.tokens))?;
        ws.meta_stage.upload(&self.gpu, &host.meta, &mut ws.meta.slice_mut(0..host.meta.len()))?;
        if !host.src.is_empty() {
            let n = host.src.len();
            ws.src_stage.upload(&self.gpu, &host.src, &mut ws.src.slice_mut(0..n))?;
            cuda::resolve_tokens(&self.gpu, &mut ws.ids.slice_mut(0..n), &ws.src.slice(0..n), &ws.tokens.slice(0..self.last_draws))?;
        }
        Ok(())
    }

    /// Enqueues the forward pass of an uploaded batch (no host synchronisation, no allocation:
    /// capturable).
    fn enqueue(&mut self, host: &HostBatch) -> Result<()> {
        self.enqueue_observed(host, &mut |_| Ok(()))
    }

    /// [`Self::enqueue`], calling `after_kv(l)` once layer `l`'s K/V writes are enqueued.
    fn enqueue_observed(&mut self, host: &HostBatch, after_kv: &mut dyn FnMut(usize) -> std::result::Result<(), DriverError>) -> Result<()> {
        let cfg = &self.cfg;
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let qkv_w = cfg.qkv_width();
        let (t, c) = (host.tokens, host.chunks);
        let gpu = &self.gpu;
        let plans = &self.plans;
        let ws = &mut self.ws;
        let (positions, rest) = ws.meta.split_at(t);
        let (slots, rest) = rest.split_at(t);
        let (cu_q, rest) = rest.split_at(c + 1);
        let (start_pos, rest) = rest.split_at(c);
        let block_tables = rest.slice(0..c * host.max_blocks);
        let meta = AttnMeta {
            cu_q: &cu_q,
            start_pos: &start_pos,
            block_tables: &block_tables,
            num_chunks: c,
            max_blocks: host.max_blocks,
            max_q_len: host.max_q_len,
            max_context: host.max_context,
        };
        let shape = attn_shape(cfg, self.layout, self.num_blocks);
        let eps = cfg.rms_norm_eps;
        cuda::embedding(gpu, &self.embed.slice(..), &ws.ids.slice(0..t), &mut ws.x.slice_mut(0..t * h))?;
        for (l, layer) in self.layers.iter().enumerate() {
            cuda::rms_norm(gpu, &mut ws.x.slice_mut(0..t * h), None, &layer.input_norm.slice(..), eps, &mut ws.normed.slice_mut(0..t * h))?;
            plans.gemm(gpu, &ws.normed.slice(0..t * h), &layer.qkv.slice(..), GemmOut::Bf16(&mut ws.qkv.slice_mut(0..t * qkv_w)), t, qkv_w, h)?;
            cuda::rope(gpu, &mut ws.qkv.slice_mut(0..t * qkv_w), &positions.slice(..), &self.inv_freq.slice(..), nh + nkv, hd, qkv_w)?;
            cuda::write_kv(gpu, &ws.qkv.slice(0..t * qkv_w), &slots.slice(..), &mut self.kv.array_mut(l), &self.layout, self.num_blocks, nh * hd, qkv_w)?;
            after_kv(l).map_err(dev)?;
            let q = ws.qkv.slice(0..t * qkv_w);
            let out = &mut ws.attn.slice_mut(0..t * nh * hd);
            if host.all_decode {
                cuda::decode_attention(gpu, &q, &meta, &shape, &self.kv.array(l), &mut ws.decode_ws.slice_mut(..), out)?;
            } else {
                cuda::prefill_attention(gpu, &q, &meta, &shape, &self.kv.array(l), out)?;
            }
            plans.gemm(gpu, &ws.attn.slice(0..t * nh * hd), &layer.o.slice(..), GemmOut::F32 { out: &mut ws.x.slice_mut(0..t * h), accumulate: true }, t, h, nh * hd)?;
            cuda::rms_norm(gpu, &mut ws.x.slice_mut(0..t * h), None, &layer.post_norm.slice(..), eps, &mut ws.normed.slice_mut(0..t * h))?;
            plans.gemm(gpu, &ws.normed.slice(0..t * h), &layer.gate_up.slice(..), GemmOut::Bf16(&mut ws.gate_up.slice_mut(0..t * 2 * inter)), t, 2 * inter, h)?;
            cuda::silu_mul(gpu, &ws.gate_up.slice(0..t * 2 * inter), &mut ws.act.slice_mut(0..t * inter), inter)?;
            plans.gemm(gpu, &ws.act.slice(0..t * inter), &layer.down.slice(..), GemmOut::F32 { out: &mut ws.x.slice_mut(0..t * h), accumulate: true }, t, h, inter)?;
        }

        // Only the rows that want logits go through the final norm and the LM head. When they are
        // the first rows of the batch (every decode step) they are read in place.
        let rows = host.logit_rows.len();
        if rows == 0 {
            return Ok(());
        }
        let stream = gpu.stream().clone();
        if host.logit_rows.iter().enumerate().any(|(i, &r)| i != r) {
            for (i, &r) in host.logit_rows.iter().enumerate() {
                stream.memcpy_dtod(&ws.x.slice(r * h..(r + 1) * h), &mut ws.x_rows.slice_mut(i * h..(i + 1) * h)).map_err(dev)?;
            }
        } else {
            stream.memcpy_dtod(&ws.x.slice(0..rows * h), &mut ws.x_rows.slice_mut(0..rows * h)).map_err(dev)?;
        }
        cuda::rms_norm(gpu, &mut ws.x_rows.slice_mut(0..rows * h), None, &self.norm.slice(..), eps, &mut ws.normed_rows.slice_mut(0..rows * h))?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let v = cfg.vocab_size;
        plans.gemm(
            gpu,
            &ws.normed_rows.slice(0..rows * h),
            &head.slice(..),
            GemmOut::F32 { out: &mut ws.logits.slice_mut(0..rows * v), accumulate: false },
            rows,
            v,
            h,
        )?;
        Ok(())
    }

    /// [`Self::forward`], then copies the logits rows to the host (`rows * vocab`, chunk order):
    /// what the device tests compare against references.
    pub fn forward_logits(&mut self, chunks: &[BatchChunk<'_>]) -> Result<Vec<f32>> {
        self.forward(chunks)?;
        let n = self.rows * self.cfg.vocab_size;
        Ok(self.gpu.download(&self.ws.logits.slice(0..n))?)
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.gpu.mem_info()?)
    }

    /// Draws every sample from the logits the last forward pass left on the device, and waits
    /// for them.
    pub(crate) fn sample(&mut self, samples: &[DeviceSample]) -> Result<Vec<DeviceSampled>> {
        let ticket = self.sample_enqueue(samples)?;
        self.sample_collect(ticket)
    }

    /// Enqueues the draws from the logits the last forward pass left on the device and the
    /// copy of their tokens and logprobs to the host, without waiting (except for draws asking
    /// for top logprobs: their rows are downloaded now). The tokens stay in device memory for
    /// [`Self::forward_from`]. Collect with [`Self::sample_collect`] before a second enqueue
    /// after this one.
    pub(crate) fn sample_enqueue(&mut self, samples: &[DeviceSample]) -> Result<SampleTicket> {
        let s = samples.len();
        let v = self.cfg.vocab_size;
        if s > self.ws.max_rows || samples.iter().any(|x| x.row >= self.rows) {
            return Err(Error::Device(format!("{s} draws over {} logits rows exceed the sampler's buffers", self.rows)));
        }
        let gpu = &self.gpu;
        let ws = &mut self.ws;
        let stream = gpu.stream().clone();
        if s == 0 {
            self.last_draws = 0;
            let tokens = ws.tokens_stage.download(gpu, &ws.tokens.slice(0..0))?;
            let logprobs = ws.logprobs_stage.download(gpu, &ws.logprobs.slice(0..0))?;
            return Ok(SampleTicket { tokens, logprobs, penalised: Vec::new() });
        }
        // Draws read and write their own row: when rows repeat or are out of order, lay them out one per draw.
        let in_place = samples.iter().enumerate().all(|(i, x)| x.row == i);
        if !in_place {
            for (i, x) in samples.iter().enumerate() {
                stream
                    .memcpy_dtod(&ws.logits.slice(x.row * v..(x.row + 1) * v), &mut ws.sample_logits.slice_mut(i * v..(i + 1) * v))
                    .map_err(dev)?;
            }
        }
        let mut params = Vec::with_capacity(s);
        let mut offsets = Vec::with_capacity(s + 1);
        let (mut pen_tokens, mut pen_counts) = (Vec::new(), Vec::new());
        offsets.push(0i32);
        for x in samples {
            let st = &x.step;
            params.push(SampleParams {
                temperature: st.temperature,
                top_k: i32::try_from(st.top_k).unwrap_or(i32::MAX),
                top_p: st.top_p,
                min_p: st.min_p,
                repetition: st.repetition,
                presence: st.presence,
                frequency: st.frequency,
                // The largest f32 below 1, so rounding never makes the draw reach the total.
                uniform: (st.uniform as f32).min(1.0 - f32::EPSILON / 2.0),
            });
            for &(tok, count) in &x.history {
                pen_tokens.push(tok as i32);
                pen_counts.push(count as i32);
            }
            offsets.push(pen_tokens.len() as i32);
        }
        // With no history the offsets say every row's is empty: the (never read) history buffers
        // keep what they hold and nothing is copied from pageable memory.
        let p = pen_tokens.len().max(1);
        if !pen_tokens.is_empty() {
            if p > ws.pen_tokens.len() {
                // The one growing buffer pair: the longest penalty history seen so far.
                let cap = p.next_power_of_two();
                ws.pen_tokens = gpu.alloc_zeros(cap)?;
                ws.pen_counts = gpu.alloc_zeros(cap)?;
            }
            gpu.upload_into(&pen_tokens, &mut ws.pen_tokens.slice_mut(0..p))?;
            gpu.upload_into(&pen_counts, &mut ws.pen_counts.slice_mut(0..p))?;
        }
        ws.params_stage.upload(gpu, &params, &mut ws.params.slice_mut(0..s))?;
        ws.offsets_stage.upload(gpu, &offsets, &mut ws.pen_offsets.slice_mut(0..s + 1))?;
        let logits = if in_place { &mut ws.logits } else { &mut ws.sample_logits };
        cuda::sample(
            gpu,
            &mut logits.slice_mut(0..s * v),
            v,
            &ws.params.slice(0..s),
            &ws.pen_offsets.slice(0..s + 1),
            &ws.pen_tokens.slice(0..p),
            &ws.pen_counts.slice(0..p),
            &mut ws.tokens.slice_mut(0..s),
            &mut ws.logprobs.slice_mut(0..s),
        )?;
        self.last_draws = s;
        let tokens = ws.tokens_stage.download(gpu, &ws.tokens.slice(0..s))?;
        let logprobs = ws.logprobs_stage.download(gpu, &ws.logprobs.slice(0..s))?;
        let mut penalised = Vec::with_capacity(s);
        for (i, x) in samples.iter().enumerate() {
            penalised.push(if x.step.logprobs > 0 { Some(gpu.download(&logits.slice(i * v..(i + 1) * v))?) } else { None });
        }
        Ok(SampleTicket { tokens, logprobs, penalised })
    }

    /// Waits for the draws of `ticket` and returns them in draw order.
    pub(crate) fn sample_collect(&mut self, ticket: SampleTicket) -> Result<Vec<DeviceSampled>> {
        let v = self.cfg.vocab_size;
        let tokens = self.ws.tokens_stage.wait(ticket.tokens)?;
        let logprobs = self.ws.logprobs_stage.wait(ticket.logprobs)?;
        let mut out = Vec::with_capacity(tokens.len());
        for ((&token, &logprob), penalised_row) in tokens.iter().zip(logprobs).zip(ticket.penalised) {
            if token as usize >= v {
                return Err(Error::Device(format!("the device sampler returned token {token} outside the vocabulary of {v}")));
            }
            out.push(DeviceSampled { token, logprob, penalised_row });
        }
        Ok(out)
    }
}

fn dev(e: DriverError) -> Error {
    Error::Device(e.to_string())
}

fn no_transfer_memory() -> Error {
    Error::Device("no transfer memory: register the KV cache for transfers first (host mirror or device memory)".into())
}

/// Sorted, merged runs `(first block, count)` of consecutive block ids.
fn block_runs(blocks: &[u32]) -> Vec<(u32, u32)> {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for b in sorted {
        match runs.last_mut() {
            Some((first, len)) if *first + *len == b => *len += 1,
            _ => runs.push((b, 1)),
        }
    }
    runs
}

/// The host copy of a CUDA engine's KV pool that KV transfers use: one bf16 buffer per layer in
/// the pool's layout (`[num_blocks][K, V][kv_heads][block_size][head_dim]`). A prefill node's
/// engine copies a completing prompt's blocks into it layer by layer
/// ([`CudaModel::forward_staged`]); a decode node's transfer writes received blocks into it and
/// the engine uploads them before the request runs ([`CudaModel::upload_from_mirror`]). The
/// buffers never move once allocated. A model in device-transfer mode has none
/// ([`CudaModel::device_transfer_memory`]). Like the CPU cache it is a [`KvStore`] of cells that
/// the engine reaches only a run of blocks at a time, so a transfer touching other blocks of a
/// layer never aliases the engine's references (see `kv_store.rs`).
pub struct HostKvMirror {
    /// bf16 bit patterns: zeroed by the allocator, so untouched blocks cost no memory (the
    /// mirror of a large pool is mostly never written).
    store: KvStore<u16>,
    block_elems: usize,
}

impl HostKvMirror {
    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.store.num_blocks()
    }

    /// Bytes of one block of one layer.
    pub fn block_bytes_per_layer(&self) -> usize {
        self.block_elems * std::mem::size_of::<bf16>()
    }

    /// The base address of every layer's buffer, in layer order (the same rules as
    /// [`super::KvCache::layer_base_ptrs`]: touch only blocks the scheduler holds for you). Valid
    /// while the model lives.
    pub fn layer_base_ptrs(&mut self) -> Vec<*mut u8> {
        self.store.base_ptrs()
    }

    /// One block of one layer (bf16).
    pub fn block(&self, layer: usize, block: u32) -> &[bf16] {
        self.run(layer, block, 1)
    }

    /// One block of one layer, mutable.
    pub fn block_mut(&mut self, layer: usize, block: u32) -> &mut [bf16] {
        self.run_mut(layer, block, 1)
    }

    /// `count` adjacent blocks of one layer from `first`.
    fn run(&self, layer: usize, first: u32, count: usize) -> &[bf16] {
        bytemuck::cast_slice(self.store.layer(layer).blocks(first, count))
    }

    /// `count` adjacent blocks of one layer from `first`, mutable.
    fn run_mut(&mut self, layer: usize, first: u32, count: usize) -> &mut [bf16] {
        bytemuck::cast_slice_mut(self.store.layer_mut(layer).into_blocks_mut(first, count))
    }
}

/// `n` values uniform in `[-a, a]` from `seed` (SplitMix64 per element, so threads agree).
fn random_bf16(n: usize, a: f32, seed: u64) -> Vec<bf16> {
    use rayon::prelude::*;
    let mut out = vec![bf16::ZERO; n];
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
        for (j, x) in chunk.iter_mut().enumerate() {
            let mut z = seed.wrapping_add(((c << 16) + j) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            *x = bf16::from_f32((2.0 * u - 1.0) * a);
        }
    });
    out
}

struct Weights {
    embed: CudaSlice<bf16>,
    layers: Vec<Layer>,
    norm: CudaSlice<bf16>,
    lm_head: Option<CudaSlice<bf16>>,
}

/// The attention kernels' view of the model over a pool of `num_blocks` blocks (q is the first
/// `num_heads * head_dim` columns of each QKV row).
fn attn_shape(cfg: &ModelConfig, layout: PagedLayout, num_blocks: usize) -> AttnShape {
    AttnShape {
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        block_size: layout.block_size,
        num_blocks,
        q_row_stride: cfg.qkv_width(),
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
    }
}

/// A step's metadata, built on the host.
#[derive(Clone, Debug)]
struct HostBatch {
    tokens: usize,
    chunks: usize,
    ids: Vec<u32>,
    /// Per token, the previous step's draw deciding its id, or -1; empty when none does.
    src: Vec<i32>,
    meta: Vec<i32>,
    max_blocks: usize,
    max_q_len: usize,
    max_context: usize,
    all_decode: bool,
    /// Flat token index of each row that wants logits.
    logit_rows: Vec<usize>,
}

impl HostBatch {
    /// This decode batch (one token per chunk, each wanting logits) padded to `batch` chunks with a
    /// block-table width of `max_blocks` and a context bound of `context`, the fixed shape of
    /// one captured graph. Padding rows read token 0 at position 0, write no K/V (slot -1) and
    /// see no blocks (table entries -1); their logits are computed and never sampled.
    fn padded(&self, batch: usize, context: usize, max_blocks: usize) -> HostBatch {
        let (t, c) = (self.tokens, self.chunks);
        debug_assert!(t == c && batch >= c && context >= self.max_context && max_blocks >= self.max_blocks);
        let m = &self.meta;
        let (positions, slots) = (&m[0..t], &m[t..2 * t]);
        let start_pos = &m[3 * t + 1..3 * t + 1 + c];
        let tables = &m[3 * t + 1 + c..];
        let mut meta = Vec::with_capacity(4 * batch + 1 + batch * max_blocks);
        meta.extend_from_slice(positions);
        meta.extend(std::iter::repeat_n(0, batch - c));
        meta.extend_from_slice(slots);
        meta.extend(std::iter::repeat_n(-1, batch - c));
        meta.extend((0..=batch as i32).collect::<Vec<_>>());
        meta.extend_from_slice(start_pos);
        meta.extend(std::iter::repeat_n(0, batch - c));
        for row in tables.chunks(self.max_blocks) {
            meta.extend_from_slice(row);
            meta.extend(std::iter::repeat_n(-1, max_blocks - self.max_blocks));
        }
        meta.extend(std::iter::repeat_n(-1, (batch - c) * max_blocks));
        let mut ids = self.ids.clone();
        ids.resize(batch, 0);
        HostBatch {
            tokens: batch,
            chunks: batch,
            ids,
            src: self.src.clone(),
            meta,
            max_blocks,
            max_q_len: 1,
            max_context: context,
            all_decode: true,
            logit_rows: (0..batch).collect(),
        }
    }
}

/// Which captured decode graph serves a step: its padded batch size and context bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    batch: usize,
    context: usize,
}

/// Tunes the GEMMs of every decode-graph bucket (the batch sizes [`graph_key`] pads to): the
/// four of a layer, timed on layer 0's weights, and the LM head, with the workspace as scratch
/// (its contents do not matter at load).
fn tune_decode_gemms(gpu: &Gpu, cfg: &ModelConfig, w: &Weights, ws: &mut Workspace, plans: &mut GemmPlans) -> Result<()> {
    let Some(layer) = w.layers.first() else { return Ok(()) };
    let started = std::time::Instant::now();
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (qkv_w, attn_w) = (cfg.qkv_width(), cfg.num_heads * cfg.head_dim);
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    // Random inputs, not the zeros the workspace starts with: tensor cores fed zeros draw less
    // power and run faster, which would favour compute-heavy algorithms.
    let max_m = ws.max_chunks;
    let stream = gpu.stream().clone();
    for (buf, n, seed) in [(&mut ws.normed, max_m * h, 1), (&mut ws.attn, max_m * attn_w, 2), (&mut ws.act, max_m * i, 3), (&mut ws.normed_rows, max_m.min(ws.max_rows) * h, 4)] {
        stream.memcpy_htod(&random_bf16(n, 1.0, seed), &mut buf.slice_mut(0..n)).map_err(dev)?;
    }
    let buckets: std::collections::BTreeSet<usize> =
        (1..=ws.max_chunks).filter_map(|b| graph_key(b, 1, ws.max_chunks, usize::MAX).map(|k| k.batch)).collect();
    for m in buckets {
        let shape = |n, k, f32_out| GemmShape { m, n, k, f32_out };
        plans.tune(gpu, shape(qkv_w, h, false), &ws.normed.slice(0..m * h), &layer.qkv.slice(..), TuneOut::Bf16(ws.qkv.slice_mut(0..m * qkv_w)))?;
        plans.tune(gpu, shape(h, attn_w, true), &ws.attn.slice(0..m * attn_w), &layer.o.slice(..), TuneOut::F32(ws.x.slice_mut(0..m * h)))?;
        plans.tune(gpu, shape(2 * i, h, false), &ws.normed.slice(0..m * h), &layer.gate_up.slice(..), TuneOut::Bf16(ws.gate_up.slice_mut(0..m * 2 * i)))?;
        plans.tune(gpu, shape(h, i, true), &ws.act.slice(0..m * i), &layer.down.slice(..), TuneOut::F32(ws.x.slice_mut(0..m * h)))?;
        if m <= ws.max_rows {
            plans.tune(gpu, shape(v, h, true), &ws.normed_rows.slice(0..m * h), &head.slice(..), TuneOut::F32(ws.logits.slice_mut(0..m * v)))?;
        }
    }
    plans.save();
    let (shapes, lt) = plans.counts();
    tracing::info!(shapes, cublaslt = lt, secs = started.elapsed().as_secs_f64(), "decode GEMMs tuned");
    Ok(())
}

/// The graph bucket for a decode step of `batch` sequences whose longest context is `context`:
/// batch sizes 1, 2, 4, 8, then multiples of 8 up to 64, then of 32 (capped at `max_batch`);
/// contexts by powers of two from 1024 (capped at `max_context`). `None` for batches beyond
/// `max_batch`.
fn graph_key(batch: usize, context: usize, max_batch: usize, max_context: usize) -> Option<GraphKey> {
    if batch == 0 || batch > max_batch {
        return None;
    }
    let b = match batch {
        1 | 2 => batch,
        3..=4 => 4,
        5..=8 => 8,
        9..=64 => batch.div_ceil(8) * 8,
        _ => batch.div_ceil(32) * 32,
    }
    .min(max_batch);
    let ctx = context.next_power_of_two().max(1024).min(max_context).max(context);
    Some(GraphKey { batch: b, context: ctx })
}

impl Workspace {
    fn new(gpu: &Gpu, cfg: &ModelConfig, sizing: &CudaSizing, layout: PagedLayout) -> Result<Self> {
        let t = sizing.max_num_batched_tokens.max(sizing.max_num_seqs);
        let r = sizing.max_num_seqs;
        let c = sizing.max_num_seqs;
        let max_blocks = sizing.max_model_len.div_ceil(layout.block_size);
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let decode_len = cuda::decode_workspace_len(c, &attn_shape(cfg, layout, 0), sizing.max_model_len);
        Ok(Workspace {
            max_tokens: t,
            max_rows: r,
            max_chunks: c,
            max_blocks,
            ids: gpu.alloc_zeros(t)?,
            meta: gpu.alloc_zeros(2 * t + 2 * c + 1 + c * max_blocks)?,
            x: gpu.alloc_zeros(t * h)?,
            normed: gpu.alloc_zeros(t * h)?,
            qkv: gpu.alloc_zeros(t * cfg.qkv_width())?,
            attn: gpu.alloc_zeros(t * cfg.num_heads * cfg.head_dim)?,
            gate_up: gpu.alloc_zeros(t * 2 * cfg.intermediate_size)?,
            act: gpu.alloc_zeros(t * cfg.intermediate_size)?,
            decode_ws: gpu.alloc_zeros(decode_len.max(1))?,
            x_rows: gpu.alloc_zeros(r * h)?,
            normed_rows: gpu.alloc_zeros(r * h)?,
            logits: gpu.alloc_zeros(r * v)?,
            sample_logits: gpu.alloc_zeros(r * v)?,
            tokens: gpu.alloc_zeros(r)?,
            logprobs: gpu.alloc_zeros(r)?,
            params: gpu.upload(&vec![SampleParams::default(); r])?,
            pen_offsets: gpu.alloc_zeros(r + 1)?,
            pen_tokens: gpu.alloc_zeros(1024)?,
            pen_counts: gpu.alloc_zeros(1024)?,
            src: gpu.alloc_zeros(t)?,
            ids_stage: Staging::new(gpu, t)?,
            meta_stage: Staging::new(gpu, 2 * t + 2 * c + 1 + c * max_blocks)?,
            src_stage: Staging::new(gpu, t)?,
            params_stage: Staging::new(gpu, r)?,
            offsets_stage: Staging::new(gpu, r + 1)?,
            tokens_stage: Staging::new(gpu, r)?,
            logprobs_stage: Staging::new(gpu, r)?,
        })
    }

    /// Checks the chunks and lays out their metadata as the kernels read it.
    /// `from_prev` (checked by the caller) names chunks whose token a previous draw decides.
    fn prepare(&self, chunks: &[BatchChunk<'_>], from_prev: &[(usize, usize)], cfg: &ModelConfig, layout: &PagedLayout, num_blocks: usize) -> Result<HostBatch> {
        let tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        let rows = chunks.iter().filter(|c| c.want_logits && !c.tokens.is_empty()).count();
        if tokens > self.max_tokens || chunks.len() > self.max_chunks || rows > self.max_rows {
            return Err(Error::Device(format!(
                "a step of {tokens} tokens in {} chunks exceeds the CUDA workspace ({} tokens, {} sequences)",
                chunks.len(),
                self.max_tokens,
                self.max_chunks
            )));
        }
        let mut ids = Vec::with_capacity(tokens);
        let mut src = if from_prev.is_empty() { Vec::new() } else { vec![-1i32; tokens] };
        let mut prev = from_prev.iter().copied().collect::<HashMap<usize, usize>>();
        let (mut positions, mut slots) = (Vec::with_capacity(tokens), Vec::with_capacity(tokens));
        let mut cu_q = Vec::with_capacity(chunks.len() + 1);
        let mut start_pos = Vec::with_capacity(chunks.len());
        let mut logit_rows = Vec::with_capacity(rows);
        let (mut max_q_len, mut max_context, mut max_blocks) = (0, 0, 1);
        cu_q.push(0i32);
        for (ci, c) in chunks.iter().enumerate() {
            let end = c.start_pos + c.tokens.len();
            if end > cfg.max_position_embeddings {
                return Err(Error::PromptTooLong { prompt: end, max_tokens: 0, limit: cfg.max_position_embeddings });
            }
            let needed = end.div_ceil(layout.block_size);
            if c.block_table.len() < needed || c.block_table.iter().any(|&b| b as usize >= num_blocks) || needed > self.max_blocks {
                return Err(Error::Config("block table does not cover the chunk or names a block outside the pool".into()));
            }
            let from = prev.remove(&ci);
            for (t, &tok) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + t;
                if let Some(draw) = from {
                    // The device writes the id (see `CudaModel::upload`).
                    src[ids.len()] = draw as i32;
                    ids.push(0);
                } else if tok as usize >= cfg.vocab_size {
                    return Err(Error::Tokenizer(format!("token id {tok} is outside the vocabulary of {}", cfg.vocab_size)));
                } else {
                    ids.push(tok);
                }
                positions.push(pos as i32);
                slots.push((c.block_table[pos / layout.block_size] as usize * layout.block_size + pos % layout.block_size) as i32);
            }
            if c.want_logits && !c.tokens.is_empty() {
                logit_rows.push(ids.len() - 1);
            }
            cu_q.push(ids.len() as i32);
            start_pos.push(c.start_pos as i32);
            max_q_len = max_q_len.max(c.tokens.len());
            max_context = max_context.max(end);
            max_blocks = max_blocks.max(needed);
        }
        let mut meta = positions;
        meta.extend(slots);
        meta.extend(cu_q);
        meta.extend(start_pos);
        for c in chunks {
            let needed = (c.start_pos + c.tokens.len()).div_ceil(layout.block_size);
            meta.extend(c.block_table[..needed].iter().map(|&b| b as i32));
            meta.extend(std::iter::repeat_n(-1, max_blocks - needed));
        }
        Ok(HostBatch {
            tokens,
            chunks: chunks.len(),
            ids,
            src,
            meta,
            max_blocks,
            max_q_len,
            max_context,
            all_decode: chunks.iter().all(|c| c.tokens.len() == 1),
            logit_rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_buckets_cover_every_batch_and_context() {
        for batch in 1..=256 {
            let k = graph_key(batch, 700, 256, 4096).unwrap();
            assert!(k.batch >= batch && k.batch <= 256, "{batch} -> {k:?}");
            assert_eq!(k.context, 1024);
        }
        let buckets: std::collections::BTreeSet<usize> = (1..=256).map(|b| graph_key(b, 1, 256, 4096).unwrap().batch).collect();
        assert_eq!(buckets.len(), 4 + 7 + 6, "1, 2, 4, 8; 16..64 by 8; 96..256 by 32: {buckets:?}");
        assert_eq!(graph_key(0, 1, 256, 4096), None);
        assert_eq!(graph_key(257, 1, 256, 4096), None);
        assert_eq!(graph_key(100, 100, 100, 4096).unwrap().batch, 100, "capped at the workspace");
        assert_eq!(graph_key(3, 3000, 8, 4096).unwrap().context, 4096);
        assert_eq!(graph_key(3, 3000, 8, 3500).unwrap().context, 3500, "capped at the context limit");
    }

    #[test]
    fn block_runs_merge_consecutive_ids() {
        assert_eq!(block_runs(&[7, 3, 4, 5, 9, 8, 4]), vec![(3, 3), (7, 3)]);
        assert_eq!(block_runs(&[]), vec![]);
        assert_eq!(block_runs(&[0]), vec![(0, 1)]);
    }

    #[test]
    fn padded_decode_batches_keep_real_rows_and_mask_the_rest() {
        let host = HostBatch {
            tokens: 2,
            chunks: 2,
            ids: vec![11, 12],
            src: Vec::new(),
            // positions, slots, cu_q, start_pos, tables (width 2)
            meta: vec![5, 17, 37, 81, 0, 1, 2, 5, 17, 2, 4, 5, -1],
            max_blocks: 2,
            max_q_len: 1,
            max_context: 18,
            all_decode: true,
            logit_rows: vec![0, 1],
        };
        let p = host.padded(4, 1024, 3);
        assert_eq!(p.ids, vec![11, 12, 0, 0]);
        assert_eq!(p.meta[0..4], [5, 17, 0, 0], "positions");
        assert_eq!(p.meta[4..8], [37, 81, -1, -1], "slots: padding writes nothing");
        assert_eq!(p.meta[8..13], [0, 1, 2, 3, 4], "cu_q");
        assert_eq!(p.meta[13..17], [5, 17, 0, 0], "start_pos");
        assert_eq!(p.meta[17..], [2, 4, -1, 5, -1, -1, -1, -1, -1, -1, -1, -1], "tables widened to 3, padding rows empty");
        assert_eq!((p.tokens, p.chunks, p.max_blocks, p.max_context), (4, 4, 3, 1024));
        assert_eq!(p.logit_rows, vec![0, 1, 2, 3]);
    }
}
