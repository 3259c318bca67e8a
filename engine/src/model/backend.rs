//! The engine's backend boundary: where forward passes run and where the KV cache lives.
//!
//! [`Device`] names a backend; [`Backend`] is the closed set of implementations the engine
//! drives (`Cpu`: f32 [`Model`] + host [`KvCache`]; `Cuda`: bf16 [`CudaModel`] with its KV pool in
//! device memory). The engine talks to the backend through four operations: a forward pass over
//! a batch of chunks, a block copy (copy-on-write), sampling (host logits through the engine's
//! per-sequence samplers, device logits through [`Backend::sample_on_device`]) and the memory KV
//! transfers use ([`TransferMemory`]: the host cache on the CPU; on CUDA the pool's host mirror,
//! or the pool itself in device memory).
//!
//! Invariants: both backends take the same [`BatchChunk`]s and keep the same paged layout
//! (`[num_blocks][K, V][kv_heads][block_size][head_dim]` per layer; f32 on the CPU, bf16 on the
//! device); a missing GPU or CUDA library is a typed [`Error::Device`] when the engine is built,
//! never a panic or a silent fall-back to the CPU. A CUDA backend's transfers go through exactly
//! one of the host mirror and the device pool, fixed by the first registration (see
//! [`CudaModel::device_transfer_memory`]).

use std::any::Any;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::str::FromStr;

pub(crate) use super::cuda::SampleTicket;
use super::{BatchChunk, CudaModel, KvCache, Model};
use crate::config::ModelConfig;
use crate::sampling::DeviceStep;
use crate::{Error, Result};

/// Where an engine runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend (f32).
    #[default]
    Cpu,
    /// The CUDA backend on GPU `ordinal` (bf16 weights and KV).
    Cuda {
        /// The device ordinal (`cuda:N`).
        ordinal: usize,
    },
}

impl FromStr for Device {
    type Err = Error;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda { ordinal: 0 }),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Ok(Device::Cuda { ordinal }),
                _ => Err(Error::Device(format!("unknown device {s:?}: expected cpu, cuda or cuda:N"))),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// The logits of one forward pass: one row per chunk that wanted logits, in chunk order.
pub(crate) enum Logits {
    /// `rows * vocab` f32 on the host.
    Host(Vec<f32>),
    /// The rows stay in device memory; sample them with [`Backend::sample_on_device`].
    Device,
}

/// One sequence's draw from a device-resident logits row.
#[derive(Clone, Debug)]
pub(crate) struct DeviceSample {
    /// The logits row (chunk order among chunks that wanted logits).
    pub(crate) row: usize,
    /// The step's parameters, uniform included.
    pub(crate) step: DeviceStep,
    /// Distinct prompt ∪ output tokens with their output counts (empty without penalties).
    pub(crate) history: Vec<(u32, u32)>,
}

/// What a device draw produced.
#[derive(Clone, Debug)]
pub(crate) struct DeviceSampled {
    pub(crate) token: u32,
    pub(crate) logprob: f32,
    /// The row after penalties, when the step asked for top logprobs.
    pub(crate) penalised_row: Option<Vec<f32>>,
}

/// The backends the engine drives (a closed set; see the module doc). One per engine, so the
/// variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Backend {
    Cpu { model: Model, kv: KvCache },
    Cuda(Box<CudaModel>),
}

/// A forward pass's layer observer: the blocks whose K/V must be readable by a transfer when a
/// layer is reported (on the host, or in the CUDA pool itself in device-transfer mode), and the
/// callback (given the CPU cache, or `None` on CUDA).
pub(crate) struct LayerObserver<'a> {
    pub(crate) stage: &'a [u32],
    pub(crate) on_layer: &'a mut dyn FnMut(usize, Option<&KvCache>),
}

/// Element type of the KV memory transfers move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDType {
    /// The CPU engine's f32 cache.
    F32,
    /// The CUDA engine's bf16 pool (its host mirror, or the pool itself in device memory).
    Bf16,
}

/// Where [`TransferMemory`] lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferPlace {
    /// Host memory of this process: the CPU engine's cache or the CUDA pool's host mirror.
    Host,
    /// The CUDA engine's pool itself, in device memory: every layer's block array lies inside
    /// one `cuMemAlloc` allocation that other processes can map through CUDA IPC. Transfers
    /// read and write it on their own streams (see [`crate::Engine::device_transfer_memory`]).
    Device {
        /// The GPU's ordinal (`cuda:N`).
        ordinal: usize,
        /// Device address (`CUdeviceptr`) of the allocation's first byte.
        allocation: u64,
        /// Size of the allocation in bytes: every layer base plus its layer's blocks lies inside.
        allocation_bytes: usize,
        /// The allocation's CUDA IPC handle (the opaque bytes of a `CUipcMemHandle`), for
        /// `cuIpcOpenMemHandle` in another process; a user in this process uses the addresses
        /// directly (CUDA refuses to open a handle in the process that exported it).
        ipc_handle: [u8; 64],
    },
}

/// Memory holding the KV pool's blocks for transfers: per layer one buffer of `num_blocks`
/// blocks in the paged layout, on the host or on the device ([`Self::place`]).
#[derive(Debug)]
pub struct TransferMemory {
    /// Element type.
    pub dtype: KvDType,
    /// Blocks per layer.
    pub num_blocks: usize,
    /// Base address of each layer's buffer, in layer order: host pointers for
    /// [`TransferPlace::Host`] (see [`KvCache::layer_base_ptrs`] for the rules), device addresses
    /// (`CUdeviceptr`s, not dereferenceable on the host) for [`TransferPlace::Device`]. Either
    /// way, touch only blocks the scheduler holds for the transfer.
    pub layer_bases: Vec<*mut u8>,
    /// Where the buffers live.
    pub place: TransferPlace,
    /// Keeps host buffers allocated for as long as it is held, whatever happens to the engine
    /// (give it to whoever keeps using `layer_bases`): the CPU cache's store
    /// ([`KvCache::keep_alive`]). `None` where the engine itself must outlive the users (the CUDA
    /// host mirror and device pool) or there is nothing to keep.
    pub keep_alive: Option<Arc<dyn Any + Send + Sync>>,
}

/// How the CUDA backend sizes itself.
#[derive(Clone, Copy, Debug)]
pub struct CudaSizing {
    /// The GPU.
    pub ordinal: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Fraction of the GPU's total memory to use (weights, workspace, KV pool).
    pub memory_utilization: f32,
    /// Most tokens in one forward pass.
    pub max_num_batched_tokens: usize,
    /// Most sequences (chunks, logits rows, draws) in one step.
    pub max_num_seqs: usize,
    /// Longest context.
    pub max_model_len: usize,
}

impl Backend {
    /// The CPU backend for `dir`, with a pool of `kv_cache_bytes`.
    pub(crate) fn load_cpu(dir: &Path, cfg: &ModelConfig, kv_cache_bytes: usize, block_size: usize) -> Result<Self> {
        let num_blocks = kv_cache_bytes / KvCache::bytes_per_block(cfg, block_size);
        if num_blocks == 0 {
            return Err(Error::Config(format!("kv_cache_bytes {kv_cache_bytes} is smaller than one KV block")));
        }
        let model = Model::load(dir, cfg)?;
        Ok(Backend::Cpu { kv: KvCache::new(cfg, num_blocks, block_size), model })
    }

    /// The model's configuration.
    pub(crate) fn config(&self) -> &ModelConfig {
        match self {
            Backend::Cpu { model, .. } => model.config(),
            Backend::Cuda(m) => m.config(),
        }
    }

    /// Blocks in the KV pool.
    pub(crate) fn num_blocks(&self) -> usize {
        match self {
            Backend::Cpu { kv, .. } => kv.num_blocks(),
            Backend::Cuda(m) => m.num_blocks(),
        }
    }

    /// Free and total device memory (CUDA backend).
    pub(crate) fn device_mem_info(&self) -> Option<(usize, usize)> {
        match self {
            Backend::Cpu { .. } => None,
            Backend::Cuda(m) => m.mem_info().ok(),
        }
    }

    /// The host KV cache (CPU backend only).
    pub(crate) fn host_kv(&self) -> Option<&KvCache> {
        match self {
            Backend::Cpu { kv, .. } => Some(kv),
            Backend::Cuda(_) => None,
        }
    }

    /// The host KV cache, mutable (CPU backend only).
    pub(crate) fn host_kv_mut(&mut self) -> Option<&mut KvCache> {
        match self {
            Backend::Cpu { kv, .. } => Some(kv),
            Backend::Cuda(_) => None,
        }
    }

    /// Copies block `src` over block `dst` in every layer.
    pub(crate) fn copy_block(&mut self, src: u32, dst: u32) -> Result<()> {
        match self {
            Backend::Cpu { kv, .. } => {
                kv.copy_block(src, dst);
                Ok(())
            }
            Backend::Cuda(m) => m.copy_block(src, dst),
        }
    }

    /// One forward pass. With `observe`, the pass reports each layer once its K/V is written
    /// and readable by a transfer: the CPU cache itself (passed to the callback), or for the
    /// CUDA backend the `stage` blocks copied into the host mirror, or, in device-transfer mode,
    /// written in the pool (the callback gets `None`; see [`CudaModel::forward_staged`]).
    /// `from_prev` (CUDA only, see [`CudaModel::forward_from`]) names chunks whose token is the
    /// draw of the last [`Self::sample_enqueue`].
    pub(crate) fn forward(&mut self, chunks: &[BatchChunk<'_>], from_prev: &[(usize, usize)], observe: Option<LayerObserver<'_>>) -> Result<Logits> {
        if !from_prev.is_empty() {
            return match (self, observe) {
                (Backend::Cuda(m), None) => m.forward_from(chunks, from_prev).map(|()| Logits::Device),
                (Backend::Cuda(m), Some(o)) if o.stage.is_empty() => {
                    m.forward_from(chunks, from_prev)?;
                    (0..m.config().num_layers).for_each(|l| (o.on_layer)(l, None));
                    Ok(Logits::Device)
                }
                _ => Err(Error::Device("only an unstaged CUDA pass takes tokens from the previous step's draws".into())),
            };
        }
        match (self, observe) {
            (Backend::Cpu { model, kv }, None) => model.forward(chunks, kv).map(Logits::Host),
            (Backend::Cpu { model, kv }, Some(o)) => model.forward_observed(chunks, kv, &mut |l, kv| (o.on_layer)(l, Some(kv))).map(Logits::Host),
            (Backend::Cuda(m), None) => m.forward(chunks).map(|()| Logits::Device),
            // Nothing completes: no staging, layers reported once the pass is enqueued.
            (Backend::Cuda(m), Some(o)) if o.stage.is_empty() => {
                m.forward(chunks)?;
                (0..m.config().num_layers).for_each(|l| (o.on_layer)(l, None));
                Ok(Logits::Device)
            }
            (Backend::Cuda(m), Some(o)) => m.forward_staged(chunks, o.stage, &mut |l| (o.on_layer)(l, None)).map(|()| Logits::Device),
        }
    }

    /// Makes received blocks (written into the transfer memory) visible to the forward pass:
    /// nothing to do on the CPU, an upload from the mirror on CUDA, nothing in CUDA's
    /// device-transfer mode (see [`CudaModel::receive_blocks`]).
    pub(crate) fn receive_blocks(&mut self, blocks: &[u32]) -> Result<()> {
        match self {
            Backend::Cpu { .. } => Ok(()),
            Backend::Cuda(m) => m.receive_blocks(blocks),
        }
    }

    /// Before blocks are handed to a writer outside the engine's stream order (CUDA's
    /// device-transfer mode: a transfer writes the pool from another stream or process): waits
    /// until no work enqueued so far can still write any block (at most the step in flight).
    /// Nothing to wait for on the CPU (steps are synchronous) or with the host mirror (the upload
    /// from it is stream-ordered after such work).
    pub(crate) fn fence_remote_writes(&self) -> Result<()> {
        match self {
            Backend::Cuda(m) if m.transfers_in_device_memory() => m.synchronize(),
            Backend::Cpu { .. } | Backend::Cuda(_) => Ok(()),
        }
    }

    /// The host memory KV transfers register: the CPU cache itself, or the CUDA pool's host
    /// mirror (allocated on first call). A CUDA backend in device-transfer mode has no mirror:
    /// it returns an empty `TransferMemory` (no layers, no blocks), which no registration
    /// accepts, and logs why.
    pub(crate) fn transfer_memory(&mut self) -> TransferMemory {
        match self {
            Backend::Cpu { kv, .. } => {
                TransferMemory {
                    dtype: KvDType::F32,
                    num_blocks: kv.num_blocks(),
                    layer_bases: kv.layer_base_ptrs(),
                    place: TransferPlace::Host,
                    keep_alive: Some(kv.keep_alive()),
                }
            }
            Backend::Cuda(m) => match m.mirror() {
                Ok(mirror) => TransferMemory {
                    dtype: KvDType::Bf16,
                    num_blocks: mirror.num_blocks(),
                    layer_bases: mirror.layer_base_ptrs(),
                    place: TransferPlace::Host,
                    keep_alive: None,
                },
                Err(e) => {
                    tracing::error!(error = %e, "no host transfer memory");
                    TransferMemory { dtype: KvDType::Bf16, num_blocks: 0, layer_bases: Vec::new(), place: TransferPlace::Host, keep_alive: None }
                }
            },
        }
    }

    /// The CUDA pool itself as transfer memory, switching the backend to device-resident
    /// transfers for good (see [`CudaModel::device_transfer_memory`]); [`Error::Device`] on the
    /// CPU.
    pub(crate) fn device_transfer_memory(&mut self) -> Result<TransferMemory> {
        match self {
            Backend::Cpu { .. } => Err(Error::Device(
                "device-resident KV transfers need the CUDA backend: the CPU engine's KV cache is host memory (use transfer_memory)".into(),
            )),
            Backend::Cuda(m) => m.device_transfer_memory(),
        }
    }

    /// Samples device-resident logits rows (after [`Logits::Device`]).
    pub(crate) fn sample_on_device(&mut self, samples: &[DeviceSample]) -> Result<Vec<DeviceSampled>> {
        match self {
            Backend::Cuda(m) => m.sample(samples),
            Backend::Cpu { .. } => Err(Error::Device("the CPU backend returns host logits".into())),
        }
    }

    /// Enqueues draws from device-resident logits rows without waiting for them (CUDA only);
    /// a later forward pass may take its tokens from them before they are collected.
    pub(crate) fn sample_enqueue(&mut self, samples: &[DeviceSample]) -> Result<SampleTicket> {
        match self {
            Backend::Cuda(m) => m.sample_enqueue(samples),
            Backend::Cpu { .. } => Err(Error::Device("the CPU backend samples on the host".into())),
        }
    }

    /// Waits for the draws of [`Self::sample_enqueue`].
    pub(crate) fn sample_collect(&mut self, ticket: SampleTicket) -> Result<Vec<DeviceSampled>> {
        match self {
            Backend::Cuda(m) => m.sample_collect(ticket),
            Backend::Cpu { .. } => Err(Error::Device("the CPU backend samples on the host".into())),
        }
    }

    /// Whether steps may overlap: the next one enqueued before this one's draws are read.
    pub(crate) fn overlaps_steps(&self) -> bool {
        matches!(self, Backend::Cuda(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda { ordinal: 0 });
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda { ordinal: 3 });
        assert_eq!(Device::Cuda { ordinal: 2 }.to_string(), "cuda:2");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            let err = bad.parse::<Device>().unwrap_err().to_string();
            assert!(err.contains("expected cpu, cuda or cuda:N"), "{bad}: {err}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "loads weights through a memory map")]
    fn the_cpu_backend_transfers_through_host_memory_only() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/gqa-tied");
        let cfg = ModelConfig::from_model_dir(&dir).unwrap();
        let mut backend = Backend::load_cpu(&dir, &cfg, 8 * KvCache::bytes_per_block(&cfg, 4), 4).unwrap();
        let err = backend.device_transfer_memory().unwrap_err();
        assert!(matches!(&err, Error::Device(m) if m.contains("CUDA backend")), "{err}");
        let mem = backend.transfer_memory();
        assert_eq!((mem.dtype, mem.num_blocks, mem.place), (KvDType::F32, 8, TransferPlace::Host));
        assert_eq!(mem.layer_bases, backend.host_kv().unwrap().layer_base_ptrs());
        assert!(mem.keep_alive.is_some(), "the CPU cache's store outlives the backend while a transfer holds it");
        backend.fence_remote_writes().unwrap();
        backend.receive_blocks(&[0, 7]).unwrap();
    }
}
