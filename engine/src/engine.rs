//! [`Engine`]: one model instance serving many requests with continuous batching.
//!
//! A plain struct driven by [`Engine::step`]: the scheduler picks chunks, the model computes them
//! against the paged KV cache, each sequence's sampler picks its next token, and the detokenizer
//! and stop matcher turn tokens into text. No threads of its own (the GEMMs use rayon), no locks,
//! no channels, no async: the node crates wrap it.
//!
//! On CUDA, steps overlap (async scheduling, as in vLLM): a step's draws are enqueued and read
//! by the next call, after that call has scheduled and enqueued the following step, whose chunks
//! take their tokens from those draws on the device ([`crate::sched::PENDING_TOKEN`]). The host's
//! scheduling, detokenization and stop checks then run while the GPU computes. A step whose
//! draws need the token history (penalties), their logits row (top logprobs) or a fork, and every
//! step in the prefill role, reads its draws before returning.
//!
//! KV transfers reach a CUDA pool through one of two memories, whichever is registered first:
//! its host mirror ([`Engine::transfer_memory`]) or, for transfer backends that move KV in device
//! memory (CUDA IPC), the pool itself ([`Engine::device_transfer_memory`]). In that
//! device-transfer mode another stream or process writes received blocks straight into the pool,
//! so [`Engine::add_remote_request`] first waits until no step in flight can still write the
//! blocks it hands out (see the overlapped-steps invariant in `ARCHITECTURE.md`).
//!
//! Invariants: every request that enters leaves through exactly one finish (stop, length, abort),
//! and its blocks go back to the pool then; in the prefill role, blocks stay held until
//! [`Engine::release`]. An unobserved [`Engine::step`] builds nothing for observers; an observed
//! one ([`Engine::step_observed`]) reports layers as `observe.rs` documents.

mod observe;

pub use observe::{PrefillReady, StepObserver};

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng, rngs::SmallRng};

use crate::config::ModelConfig;
use crate::detok::{IncrementalDetokenizer, StopMatcher, StopOutcome};
use crate::model::backend::{Backend, CudaSizing, DeviceSample, DeviceSampled, LayerObserver, Logits, SampleTicket};
use crate::model::TransferMemory;
use crate::model::{BatchChunk, CudaModel, Device, KvCache};
use crate::sampling::{SampledToken, Sampler, SamplingParams, penalty_history, sequence_seed};
use crate::kv::{BlockCopy, BlockId};
use crate::sched::{NewRequest, PENDING_TOKEN, RemoteAlloc, RequestId, Role, Scheduler, SchedulerConfig, SeqId};
use crate::tokenizer::{ChatMessage, Tokenizer};
use crate::{Error, Result};

/// How an engine instance is sized and what it does.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Colocated (prefill + decode), prefill-only or decode-only.
    pub role: Role,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Memory for the KV pool; the number of blocks is derived from it.
    pub kv_cache_bytes: usize,
    /// Cap on sequences running at once.
    pub max_num_seqs: usize,
    /// Per-step token budget (prompts beyond it are chunked).
    pub max_num_batched_tokens: usize,
    /// Context limit; `None` takes the model's.
    pub max_model_len: Option<usize>,
    /// Reuse cached KV blocks of identical prompt prefixes.
    pub enable_prefix_caching: bool,
    /// Where the model runs.
    pub device: Device,
    /// CUDA: the fraction of the GPU's total memory this engine may use (weights, workspace
    /// and the KV pool, which takes what is left); `kv_cache_bytes` applies to the CPU only.
    pub gpu_memory_utilization: f32,
    /// CUDA: overlap consecutive steps (schedule and enqueue step N+1 while step N runs, and
    /// read step N's tokens afterwards) whenever the step's draws allow it (see
    /// [`Engine::step`]). Outputs are the same either way.
    pub async_scheduling: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            role: Role::Colocated,
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            enable_prefix_caching: true,
            device: Device::Cpu,
            gpu_memory_utilization: 0.9,
            async_scheduling: true,
        }
    }
}

/// What a request asks the model to continue.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Plain text, tokenized with the tokenizer's special tokens (BOS) added.
    Text(String),
    /// Chat messages rendered with the model's chat template and the generation prompt.
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The request was aborted.
    Abort,
    /// Prefill role: the prompt is computed and the first token sampled; blocks are held.
    PrefillDone,
}

/// A generated token's log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The top alternatives, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What one sequence produced in one step.
#[derive(Clone, Debug)]
pub struct SeqOutput {
    /// The request.
    pub request: RequestId,
    /// The sequence within it (`0..n`).
    pub index: u32,
    /// Tokens generated this step.
    pub token_ids: Vec<u32>,
    /// New text (valid UTF-8, stop strings removed).
    pub text: String,
    /// Log-probabilities, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
    /// Set when the sequence finished this step.
    pub finish: Option<FinishReason>,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated over all sequences.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// How busy an engine is, for routing ([`Engine::current_load`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Sequences waiting for admission (new or preempted) or, with remote KV, for a running slot.
    pub waiting: usize,
    /// Sequences admitted and running (held and awaiting-KV ones excluded).
    pub running: usize,
    /// KV blocks available for allocation: free plus evictable prefix-cache blocks.
    pub free_blocks: usize,
    /// KV blocks in the pool.
    pub total_blocks: usize,
}

/// A finished sequence, as [`Engine::generate`] returns it.
#[derive(Clone, Debug)]
pub struct Completion {
    /// Generated tokens.
    pub token_ids: Vec<u32>,
    /// Generated text.
    pub text: String,
    /// Why it stopped.
    pub finish: FinishReason,
    /// Log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprob>,
}

struct SeqState {
    sampler: Sampler,
    output: Vec<u32>,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    finished: bool,
}

struct RequestState {
    params: SamplingParams,
    prompt: Vec<u32>,
    seqs: Vec<SeqState>,
    seed: u64,
    usage: Usage,
    /// Whether a chunk of this request has been scheduled yet (the first one starts after the
    /// prefix-cache hit, which is how cached tokens are counted).
    scheduled: bool,
    /// Prefill role: the blocks kept for the KV transfer after the prefill finished.
    held: Option<Vec<BlockId>>,
    /// Decode role: the blocks a KV transfer writes (uploaded to the device at `kv_ready` from the
    /// host mirror; already in place in device-transfer mode).
    received: Vec<u32>,
}

/// Where the engine's steps spent their wall time, summed since the engine was built or
/// [`Engine::reset_step_times`]. The GPU runs asynchronously: `forward` is the time to prepare
/// and enqueue the pass (on the CPU backend, the pass itself), and `sample` includes waiting for
/// the GPU. Without overlap, `schedule` and `accept` are host work the GPU waits for; with it
/// (see the module doc) they run while the GPU computes the step enqueued before them.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTimes {
    /// Steps that ran a forward pass.
    pub steps: u64,
    /// Scheduling and block copies.
    pub schedule: std::time::Duration,
    /// Preparing and running (or enqueuing) the forward pass.
    pub forward: std::time::Duration,
    /// Sampling, including the wait for the device.
    pub sample: std::time::Duration,
    /// Appending tokens, detokenizing, stop checks, finishing sequences.
    pub accept: std::time::Duration,
}

/// A step whose draws are enqueued on the device and not read yet (overlapped scheduling).
struct InFlight {
    ticket: SampleTicket,
    /// The sequence of each draw, in draw order.
    draws: Vec<SeqId>,
    /// Each sequence's draw index: where the next step's chunk of it takes its token from.
    draw_of: HashMap<SeqId, usize>,
}

/// One model instance with its KV pool, scheduler and live requests.
pub struct Engine {
    cfg: EngineConfig,
    max_model_len: usize,
    backend: Backend,
    tokenizer: Tokenizer,
    sched: Scheduler,
    requests: HashMap<RequestId, RequestState>,
    next_id: u64,
    rng: SmallRng,
    times: StepTimes,
    /// The overlapped step whose tokens the next call reads.
    in_flight: Option<InFlight>,
    /// Requests whose first chunk the last step scheduled.
    first_scheduled: Vec<FirstScheduled>,
}

/// A request that left the waiting queue: its first chunk was scheduled in a step (queue time
/// ends here), after `cached_tokens` of its prompt were found in the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstScheduled {
    /// The request.
    pub request: RequestId,
    /// Its prompt's length.
    pub prompt_tokens: usize,
    /// Leading prompt tokens the prefix cache served.
    pub cached_tokens: usize,
}

impl Engine {
    /// Loads the model in `dir` and sizes the KV pool.
    pub fn load(dir: &Path, cfg: EngineConfig) -> Result<Self> {
        let model_cfg = ModelConfig::from_model_dir(dir)?;
        let tokenizer = Tokenizer::from_model_dir(dir)?;
        if tokenizer.vocab_size() > model_cfg.vocab_size {
            return Err(Error::Tokenizer(format!(
                "the tokenizer has {} tokens but the model only {} embeddings",
                tokenizer.vocab_size(),
                model_cfg.vocab_size
            )));
        }
        if cfg.block_size == 0 || cfg.max_num_seqs == 0 || cfg.max_num_batched_tokens == 0 {
            return Err(Error::Config("block_size, max_num_seqs and max_num_batched_tokens must be positive".into()));
        }
        let backend = match cfg.device {
            Device::Cpu => Backend::load_cpu(dir, &model_cfg, cfg.kv_cache_bytes, cfg.block_size)?,
            Device::Cuda { ordinal } => {
                let sizing = Self::cuda_sizing(&cfg, &model_cfg, ordinal);
                Backend::Cuda(Box::new(CudaModel::load(dir, &model_cfg, sizing)?))
            }
        };
        Self::with_backend(backend, tokenizer, cfg)
    }

    /// An engine over random weights of geometry `model_cfg` (CUDA only: benchmarks of large
    /// geometries without their checkpoints), with `tokenizer` for detokenizing.
    pub fn with_random_weights(model_cfg: &ModelConfig, tokenizer: Tokenizer, cfg: EngineConfig, seed: u64) -> Result<Self> {
        if cfg.block_size == 0 || cfg.max_num_seqs == 0 || cfg.max_num_batched_tokens == 0 {
            return Err(Error::Config("block_size, max_num_seqs and max_num_batched_tokens must be positive".into()));
        }
        if tokenizer.vocab_size() > model_cfg.vocab_size {
            return Err(Error::Tokenizer(format!(
                "the tokenizer has {} tokens but the model only {} embeddings",
                tokenizer.vocab_size(),
                model_cfg.vocab_size
            )));
        }
        let Device::Cuda { ordinal } = cfg.device else {
            return Err(Error::Device("random weights are for the CUDA backend's benchmarks".into()));
        };
        let sizing = Self::cuda_sizing(&cfg, model_cfg, ordinal);
        let backend = Backend::Cuda(Box::new(CudaModel::random(model_cfg, sizing, seed)?));
        Self::with_backend(backend, tokenizer, cfg)
    }

    fn cuda_sizing(cfg: &EngineConfig, model_cfg: &ModelConfig, ordinal: usize) -> CudaSizing {
        CudaSizing {
            ordinal,
            block_size: cfg.block_size,
            memory_utilization: cfg.gpu_memory_utilization,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_num_seqs: cfg.max_num_seqs,
            max_model_len: Self::context_limit(cfg, model_cfg),
        }
    }

    fn context_limit(cfg: &EngineConfig, model_cfg: &ModelConfig) -> usize {
        cfg.max_model_len.unwrap_or(model_cfg.max_position_embeddings).min(model_cfg.max_position_embeddings)
    }

    fn with_backend(backend: Backend, tokenizer: Tokenizer, cfg: EngineConfig) -> Result<Self> {
        let model_cfg = backend.config().clone();
        let max_model_len = Self::context_limit(&cfg, &model_cfg);
        let num_blocks = backend.num_blocks();
        let sched = Scheduler::new(SchedulerConfig {
            role: cfg.role,
            block_size: cfg.block_size,
            num_blocks,
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_model_len,
            enable_prefix_caching: cfg.enable_prefix_caching,
        });
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        Ok(Engine {
            cfg,
            max_model_len,
            backend,
            tokenizer,
            sched,
            requests: HashMap::new(),
            next_id: 0,
            rng: SmallRng::seed_from_u64(seed),
            times: StepTimes::default(),
            in_flight: None,
            first_scheduled: Vec::new(),
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model's configuration.
    pub fn model_config(&self) -> &ModelConfig {
        self.backend.config()
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The context limit in tokens.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// The scheduler (read-only: pool occupancy, queue lengths).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Where the model runs.
    pub fn device(&self) -> Device {
        self.cfg.device
    }

    /// Free device memory in bytes (CUDA backend); `None` on the CPU or if the driver cannot say.
    pub fn device_free_memory(&self) -> Option<usize> {
        self.backend.device_mem_info().map(|(free, _)| free)
    }

    /// The host memory KV transfers read and write
    /// ([`TransferPlace::Host`](crate::model::TransferPlace::Host)): the CPU cache itself, or on
    /// CUDA a host mirror of the pool (allocated on the first call) that prefill steps observed
    /// through [`Self::step_observed`] copy completing prompts into layer by layer and that
    /// [`Self::kv_ready`] uploads received blocks from.
    ///
    /// On CUDA the first registration chooses the engine's transfer memory for good: after
    /// [`Self::device_transfer_memory`] there is no mirror, and this returns an empty
    /// `TransferMemory` (no layers, no blocks) that no registration accepts (and logs an error).
    pub fn transfer_memory(&mut self) -> TransferMemory {
        self.backend.transfer_memory()
    }

    /// The CUDA engine's KV pool itself as transfer memory, for transfer backends that move KV
    /// in device memory (CUDA IPC): [`TransferPlace::Device`](crate::model::TransferPlace::Device),
    /// every layer's block array inside one `cuMemAlloc` allocation, with the allocation's base,
    /// size and IPC handle (another process maps it with `cuIpcOpenMemHandle`; this process uses
    /// the addresses directly).
    ///
    /// This puts the engine in device-transfer mode for good:
    /// - an observed prefill step ([`Self::step_observed`]) copies nothing: it reports layer `l`
    ///   once the device has finished writing that layer's K/V into the pool, and the transfer
    ///   reads the completing prompts' blocks from the pool on its own stream;
    /// - [`Self::kv_ready`] copies nothing: the transfer wrote the received blocks in place, and
    ///   waited for its writes to complete before reporting them;
    /// - [`Self::add_remote_request`] waits for the compute stream before handing out blocks.
    ///
    /// One memory per engine: [`Error::Device`] if [`Self::transfer_memory`] already allocated
    /// the host mirror (and `transfer_memory` returns nothing usable afterwards). Calling this
    /// again returns the same memory. On the CPU backend, [`Error::Device`]. The memory stays
    /// valid while the engine lives; a transfer may touch only blocks the scheduler holds for it
    /// (a finished prefill's blocks until [`Self::release`], a remote request's until
    /// [`Self::kv_ready`] or its abort).
    pub fn device_transfer_memory(&mut self) -> Result<TransferMemory> {
        self.backend.device_transfer_memory()
    }

    /// The host KV cache (read-only), e.g. to send a held request's blocks; `None` when the
    /// cache lives in device memory.
    pub fn kv_cache(&self) -> Option<&KvCache> {
        self.backend.host_kv()
    }

    /// The host KV cache, e.g. to write received blocks into place; `None` when the cache lives
    /// in device memory.
    pub fn kv_cache_mut(&mut self) -> Option<&mut KvCache> {
        self.backend.host_kv_mut()
    }

    /// Turns a prompt into token ids.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Text(t) => self.tokenizer.encode(t, true),
            Prompt::Chat(messages) => {
                let text = self.tokenizer.apply_chat_template(messages, true)?;
                self.tokenizer.encode(&text, false)
            }
            Prompt::Tokens(ids) => {
                let vocab = self.backend.config().vocab_size;
                match ids.iter().find(|&&t| t as usize >= vocab) {
                    Some(bad) => Err(Error::Tokenizer(format!("token id {bad} is outside the vocabulary of {vocab}"))),
                    None => Ok(ids.clone()),
                }
            }
        }
    }

    /// Checks a tokenized request the way [`Self::add_request`] and [`Self::add_remote_request`]
    /// do, without allocating or queueing anything: sampling parameters
    /// ([`Error::InvalidSampling`], also for `n` above `max_num_seqs`), an empty prompt
    /// ([`Error::EmptyPrompt`]), token ids outside the vocabulary ([`Error::Tokenizer`]), the
    /// context limit ([`Error::PromptTooLong`]) and the pool's capacity
    /// ([`Error::CapacityExceeded`]: one sequence of prompt + `max_tokens` tokens would not fit
    /// even in an empty pool). Passing does not promise free blocks right now
    /// ([`Error::KvPoolFull`] stays possible for a remote request).
    pub fn validate_request(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let vocab = self.backend.config().vocab_size;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Tokenizer(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        if prompt.len().saturating_add(params.max_tokens) > self.max_model_len {
            return Err(Error::PromptTooLong { prompt: prompt.len(), max_tokens: params.max_tokens, limit: self.max_model_len });
        }
        self.sched.check_admissible(prompt.len(), params.n, params.max_tokens)
    }

    /// Leading tokens of `prompt` whose KV the prefix cache holds right now: a multiple of
    /// `block_size`, 0 with prefix caching off. Read-only (takes no block, touches no LRU
    /// order), so the answer can go stale as soon as the engine steps. A remote allocation of
    /// this prompt reuses that many tokens; a local prefill reuses as many except that it always
    /// computes the prompt's last token (one block less when the whole prompt is cached).
    pub fn cached_prefix_len(&self, prompt: &[u32]) -> usize {
        if !self.cfg.enable_prefix_caching {
            return 0;
        }
        let pool = self.sched.pool();
        pool.match_prefix(prompt, prompt.len() / self.cfg.block_size).len() * self.cfg.block_size
    }

    /// Where the steps so far spent their time (see [`StepTimes`]).
    pub fn step_times(&self) -> StepTimes {
        self.times
    }

    /// Starts [`Self::step_times`] from zero.
    pub fn reset_step_times(&mut self) {
        self.times = StepTimes::default();
    }

    /// Queue lengths and pool occupancy, for routing.
    pub fn current_load(&self) -> EngineLoad {
        let pool = self.sched.pool();
        EngineLoad {
            waiting: self.sched.num_waiting(),
            running: self.sched.num_running(),
            free_blocks: pool.num_free(),
            total_blocks: pool.num_blocks(),
        }
    }

    /// A request's state: `tokens` is its prompt followed by `generated` output tokens it resumes
    /// (see [`Self::add_resumed_request`]), and `params.max_tokens` counts the tokens still to come.
    /// Checks what validation cannot see of a resumed output (it must not have finished already).
    fn new_state(&mut self, tokens: &[u32], generated: usize, mut params: SamplingParams) -> Result<(RequestId, RequestState)> {
        if generated > 0 && params.n != 1 {
            return Err(Error::InvalidResume(format!("a resumed request has one sequence (n is {})", params.n)));
        }
        if generated >= tokens.len() {
            return Err(Error::InvalidResume(format!("{generated} generated tokens leave no prompt among {} tokens", tokens.len())));
        }
        let (prompt, output) = tokens.split_at(tokens.len() - generated);
        let seed = params.seed.unwrap_or_else(|| self.rng.random());
        params.max_tokens = params.max_tokens.saturating_add(generated);
        let mut first = SeqState::new(&params, prompt, seed, 0);
        first.resume(&self.tokenizer, &params, output)?;
        let usage = Usage { prompt_tokens: prompt.len(), completion_tokens: generated, ..Usage::default() };
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let state = RequestState { params, prompt: prompt.to_vec(), seqs: vec![first], seed, usage, scheduled: false, held: None, received: Vec::new() };
        Ok((id, state))
    }

    /// Validates and queues a request; returns its id.
    pub fn add_request(&mut self, prompt: &Prompt, params: SamplingParams) -> Result<RequestId> {
        let ids = self.tokenize(prompt)?;
        self.add_resumed_request(ids, 0, params)
    }

    /// Validates and queues a request that continues output another engine produced (a request the
    /// router migrated off a failed node): `tokens` is the prompt followed by the `generated` output
    /// tokens the client already received, and `params.max_tokens` counts only the tokens still to
    /// come. The engine computes the KV of all of `tokens` as it would a prompt's (prefix cache,
    /// chunked prefill), but the last `generated` are the sequence's output: penalties see them as
    /// output, usage and `max_tokens` count them, the detokenizer and stop matcher are replayed over
    /// them (so the first text delta continues exactly where the other engine's stream stopped, text it
    /// held back included), and the sampler skips the draws they took (a seeded request draws next what
    /// an uninterrupted run on one engine would). [`Error::InvalidResume`] for `n` > 1, no prompt left,
    /// or an output that had already finished (a stop token or stop string in it). `generated` 0 is
    /// [`Self::add_request`] with token ids.
    pub fn add_resumed_request(&mut self, tokens: Vec<u32>, generated: usize, params: SamplingParams) -> Result<RequestId> {
        self.validate_request(&tokens, &params)?;
        let max_tokens = params.max_tokens;
        let (id, state) = self.new_state(&tokens, generated, params)?;
        self.sched.add_request(NewRequest { id, prompt: tokens, n: state.params.n, max_tokens })?;
        self.requests.insert(id, state);
        Ok(id)
    }

    /// Decode role: allocates blocks for a prompt whose KV another node computes. The request
    /// waits until [`Engine::kv_ready`].
    ///
    /// In device-transfer mode ([`Self::device_transfer_memory`]) the blocks are written by
    /// another stream or process, outside the engine's stream order, while a step in flight
    /// (async scheduling) may still write K/V into blocks a just-finished or aborted sequence
    /// freed. So this first waits for the compute stream: no work enqueued before it returns can
    /// write the blocks it hands out, and nothing enqueued later does (the blocks belong to this
    /// request until `kv_ready`). The cost is waiting for at most the step in flight, once per
    /// remote request; with the host mirror or on the CPU it waits for nothing (the upload at
    /// `kv_ready` is stream-ordered after that step).
    pub fn add_remote_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<(RequestId, RemoteAlloc)> {
        self.validate_request(&prompt, &params)?;
        let (id, mut state) = self.new_state(&prompt, 0, params)?;
        // Before allocating: nothing is enqueued between this wait and the hand-out.
        self.backend.fence_remote_writes()?;
        let alloc = self.sched.allocate_remote(NewRequest {
            id,
            prompt,
            n: state.params.n,
            max_tokens: state.params.max_tokens,
        })?;
        state.usage.cached_tokens = alloc.num_cached_tokens;
        state.scheduled = true;
        state.received = alloc.block_table[alloc.num_cached_tokens / self.cfg.block_size..].iter().map(|b| b.0).collect();
        self.requests.insert(id, state);
        Ok((id, alloc))
    }

    /// Decode role: the prompt's KV has landed in the allocated blocks and the prefill node
    /// sampled `first_token`; the request starts decoding. Returns the first token's output.
    pub fn kv_ready(&mut self, id: RequestId, first_token: u32) -> Result<Vec<SeqOutput>> {
        self.kv_ready_with_logprob(id, first_token, None)
    }

    /// [`Engine::kv_ready`] with the first token's logprobs as the prefill node computed them
    /// (reported when the request asked for logprobs).
    pub fn kv_ready_with_logprob(&mut self, id: RequestId, first_token: u32, logprob: Option<TokenLogprob>) -> Result<Vec<SeqOutput>> {
        let vocab = self.backend.config().vocab_size;
        let Some(req) = self.requests.get_mut(&id) else { return Err(Error::UnknownRequest(id.0)) };
        if req.params.n != 1 {
            return Err(Error::InvalidSampling("remote prefill serves n = 1 only".into()));
        }
        // The token comes from another node: refuse it here rather than fail a later step (and with it
        // every request batched beside this one).
        if first_token as usize >= vocab {
            return Err(Error::Tokenizer(format!("first token {first_token} is outside the vocabulary of {vocab}")));
        }
        if let Some(lp) = &logprob
            && (lp.token != first_token || lp.top.iter().any(|&(t, _)| t as usize >= vocab))
        {
            return Err(Error::Tokenizer("the first token's logprobs name other or unknown tokens".into()));
        }
        let received = std::mem::take(&mut req.received);
        self.backend.receive_blocks(&received)?;
        self.sched.kv_ready(id, first_token)?;
        let mut outputs = Vec::new();
        self.accept_token(SeqId { request: id, index: 0 }, first_token, logprob, &mut outputs)?;
        Ok(outputs)
    }

    /// Prefill role: the blocks a finished prefill holds for the KV transfer, in position order.
    pub fn held_blocks(&self, id: RequestId) -> Option<Vec<BlockId>> {
        self.requests.get(&id).and_then(|r| r.held.clone())
    }

    /// Prefill role: frees the blocks a finished prefill holds (once its KV has been sent).
    pub fn release(&mut self, id: RequestId) -> bool {
        self.requests.remove(&id);
        self.sched.release(id)
    }

    /// Aborts a request wherever it is; frees everything. False if unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let known = self.requests.remove(&id).is_some();
        self.sched.abort(id) || known
    }

    /// Whether any request is still queued or running.
    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// Whether [`Self::step`] would do anything now: something to schedule, or a step in flight to
    /// collect. False while every live request waits on the outside (KV in transfer, held blocks), so
    /// a driver can sleep until its next command instead of spinning.
    pub fn has_work(&self) -> bool {
        self.in_flight.is_some() || self.sched.has_schedulable()
    }

    /// The requests whose first chunk the last step scheduled, in order (requests allocated by
    /// [`Self::add_remote_request`] never appear: they are not queued here).
    pub fn first_scheduled(&self) -> &[FirstScheduled] {
        &self.first_scheduled
    }

    /// Token counts of a live request.
    pub fn usage(&self, id: RequestId) -> Option<Usage> {
        self.requests.get(&id).map(|r| r.usage)
    }

    /// Runs one scheduling step and returns what every sequence produced. With overlapped steps
    /// (CUDA, see the module doc) the tokens of a step come back from the next call; a call with
    /// nothing to schedule returns those of the step in flight, so calling `step` while
    /// [`Self::has_unfinished`] holds delivers every token.
    pub fn step(&mut self) -> Result<Vec<SeqOutput>> {
        self.run_step(None)
    }

    /// [`Self::step`], reporting to `obs` the Prefill-role requests whose prompt completes in
    /// this step and each layer of the forward pass as its KV is written (see [`StepObserver`]).
    pub fn step_observed(&mut self, obs: &mut dyn StepObserver) -> Result<Vec<SeqOutput>> {
        self.run_step(Some(obs))
    }

    fn run_step(&mut self, obs: Option<&mut dyn StepObserver>) -> Result<Vec<SeqOutput>> {
        let started = std::time::Instant::now();
        self.first_scheduled.clear();
        let schedule = self.sched.schedule();
        for &BlockCopy { src, dst } in &schedule.copies {
            self.backend.copy_block(src.0, dst.0)?;
        }
        if schedule.chunks.is_empty() {
            let mut outputs = Vec::new();
            self.accept_in_flight(&mut outputs)?;
            return Ok(outputs);
        }
        for chunk in &schedule.chunks {
            if let Some(req) = self.requests.get_mut(&chunk.seq.request).filter(|r| !r.scheduled) {
                req.scheduled = true;
                // A resumed request's cache hit may reach into its output: count only prompt tokens.
                let cached = chunk.start_pos.min(req.prompt.len());
                req.usage.cached_tokens = cached;
                self.first_scheduled.push(FirstScheduled {
                    request: chunk.seq.request,
                    prompt_tokens: req.prompt.len(),
                    cached_tokens: cached,
                });
            }
        }
        // Chunks whose token the step in flight is still sampling take it on the device.
        let mut from_prev = Vec::new();
        for (i, c) in schedule.chunks.iter().enumerate().filter(|(_, c)| c.tokens.contains(&PENDING_TOKEN)) {
            match self.in_flight.as_ref().and_then(|f| f.draw_of.get(&c.seq)) {
                Some(&draw) if c.tokens.len() == 1 => from_prev.push((i, draw)),
                _ => return Err(Error::Device(format!("sequence {} was scheduled with a token no step in flight samples", c.seq))),
            }
        }
        let tables: Vec<Vec<u32>> = schedule.chunks.iter().map(|c| c.block_table.iter().map(|b| b.0).collect()).collect();
        let batch: Vec<BatchChunk<'_>> = schedule
            .chunks
            .iter()
            .zip(&tables)
            .map(|(c, t)| BatchChunk { tokens: &c.tokens, start_pos: c.start_pos, block_table: t, want_logits: c.sample })
            .collect();
        let scheduled = std::time::Instant::now();
        let logits = match obs {
            None => self.backend.forward(&batch, &from_prev, None)?,
            Some(obs) => {
                let ready: Vec<PrefillReady> = if self.cfg.role == Role::Prefill {
                    schedule
                        .chunks
                        .iter()
                        .filter(|c| c.sample)
                        .map(|c| PrefillReady {
                            request: c.seq.request,
                            block_table: c.block_table.clone(),
                            prompt_len: c.start_pos + c.tokens.len(),
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                obs.prefill_completing(&ready);
                let stage: Vec<u32> = ready.iter().flat_map(|r| r.block_table.iter().map(|b| b.0)).collect();
                let mut on_layer = |layer: usize, kv: Option<&KvCache>| match kv {
                    Some(kv) => obs.layer_done_with_kv(layer, kv),
                    None => obs.layer_done(layer),
                };
                self.backend.forward(&batch, &from_prev, Some(LayerObserver { stage: &stage, on_layer: &mut on_layer }))?
            }
        };

        // Who draws from which logits row: a forking group (n > 1) draws all its sequences from
        // the one row of its prompt.
        let mut draws: Vec<(usize, SeqId)> = Vec::new();
        let mut chunk_draws: Vec<(SeqId, std::ops::Range<usize>)> = Vec::new();
        for (row, chunk) in schedule.chunks.iter().filter(|c| c.sample).enumerate() {
            let Some(req) = self.requests.get_mut(&chunk.seq.request) else { continue };
            let first = draws.len();
            if chunk.num_samples > 1 {
                // The group forks here: children 1..n start from child 0's state.
                while req.seqs.len() < chunk.num_samples {
                    let index = req.seqs.len() as u32;
                    req.seqs.push(SeqState::new(&req.params, &req.prompt, req.seed, index));
                }
                draws.extend((0..chunk.num_samples as u32).map(|index| (row, SeqId { request: chunk.seq.request, index })));
            } else {
                draws.push((row, chunk.seq));
            }
            chunk_draws.push((chunk.seq, first..draws.len()));
        }
        let forwarded = std::time::Instant::now();
        let mut outputs = Vec::new();
        if self.can_overlap(&logits, &draws) {
            // Enqueue this step's draws, then read the previous step's while the device runs
            // this one; this step's tokens are read by the next call.
            let samples = self.device_samples(&draws)?;
            let ticket = self.backend.sample_enqueue(&samples)?;
            self.accept_in_flight(&mut outputs)?;
            let draws: Vec<SeqId> = draws.into_iter().map(|(_, seq)| seq).collect();
            for &seq in &draws {
                self.sched.on_sampled(seq, &[PENDING_TOKEN]);
            }
            let draw_of = draws.iter().enumerate().map(|(i, &seq)| (seq, i)).collect();
            self.in_flight = Some(InFlight { ticket, draws, draw_of });
            self.times.forward += forwarded - scheduled;
        } else {
            // Tokens of the step in flight first: this step's penalties and stop checks see them.
            self.accept_in_flight(&mut outputs)?;
            let drawing = std::time::Instant::now();
            // Sequences that finished on those tokens (their chunk ran for nothing) draw nothing.
            chunk_draws.retain(|(_, range)| draws[range.clone()].iter().all(|&(_, seq)| self.is_live(seq)));
            let kept: Vec<(usize, SeqId)> = chunk_draws.iter().flat_map(|(_, r)| draws[r.clone()].iter().copied()).collect();
            let sampled = self.draw(&logits, &kept)?;
            let drawn = std::time::Instant::now();
            let mut next = 0;
            for (seq, range) in chunk_draws {
                let range = next..next + range.len();
                next = range.end;
                let tokens: Vec<u32> = sampled[range.clone()].iter().map(|s| s.token).collect();
                self.sched.on_sampled(seq, &tokens);
                for (i, s) in range.clone().zip(&sampled[range]) {
                    let lp = TokenLogprob { token: s.token, logprob: s.logprob, top: s.top_logprobs.clone() };
                    self.accept_token(kept[i].1, s.token, Some(lp), &mut outputs)?;
                }
            }
            self.times.forward += forwarded - scheduled;
            self.times.sample += drawn - drawing;
            self.times.accept += drawn.elapsed();
        }
        let t = &mut self.times;
        t.steps += 1;
        t.schedule += scheduled - started;
        Ok(outputs)
    }

    /// Whether this step's draws may be read one step later: a CUDA step outside the prefill
    /// role, with async scheduling on, whose every draw is one sequence's (no fork) and needs
    /// neither the token history (penalties) nor its logits row (top logprobs).
    fn can_overlap(&self, logits: &Logits, draws: &[(usize, SeqId)]) -> bool {
        self.cfg.async_scheduling
            && self.cfg.role != Role::Prefill
            && matches!(logits, Logits::Device)
            && self.backend.overlaps_steps()
            && draws.iter().enumerate().all(|(i, &(row, seq))| {
                row == i
                    && self.requests.get(&seq.request).is_some_and(|r| {
                        (seq.index as usize) < r.seqs.len() && !r.params.has_penalties() && r.params.logprobs.unwrap_or(0) == 0
                    })
            })
    }

    /// Whether `seq` still runs (its request is live and it has not finished).
    fn is_live(&self, seq: SeqId) -> bool {
        self.requests.get(&seq.request).and_then(|r| r.seqs.get(seq.index as usize)).is_some_and(|s| !s.finished)
    }

    /// Reads the draws of the step in flight, if any, and accepts them into their sequences
    /// (skipping sequences aborted or finished since).
    fn accept_in_flight(&mut self, outputs: &mut Vec<SeqOutput>) -> Result<()> {
        let Some(f) = self.in_flight.take() else { return Ok(()) };
        let waiting = std::time::Instant::now();
        let sampled: Vec<DeviceSampled> = self.backend.sample_collect(f.ticket)?;
        let accepting = std::time::Instant::now();
        for (&seq, d) in f.draws.iter().zip(&sampled) {
            if !self.is_live(seq) {
                continue;
            }
            self.sched.resolve_token(seq, d.token);
            let lp = TokenLogprob { token: d.token, logprob: d.logprob, top: Vec::new() };
            self.accept_token(seq, d.token, Some(lp), outputs)?;
        }
        self.times.sample += accepting - waiting;
        self.times.accept += accepting.elapsed();
        Ok(())
    }

    /// The device draws for `(logits row, sequence)` pairs, each with its sampler's step (which
    /// takes the step's uniform from the sequence's RNG).
    fn device_samples(&mut self, draws: &[(usize, SeqId)]) -> Result<Vec<DeviceSample>> {
        let vocab = self.backend.config().vocab_size;
        let mut samples = Vec::with_capacity(draws.len());
        for &(row, seq_id) in draws {
            let req = self.requests.get_mut(&seq_id.request).ok_or(Error::UnknownRequest(seq_id.request.0))?;
            let seq = &mut req.seqs[seq_id.index as usize];
            let step = seq.sampler.device_step();
            let history = if step.penalised { penalty_history(&req.prompt, &seq.output, vocab) } else { Vec::new() };
            samples.push(DeviceSample { row, step, history });
        }
        Ok(samples)
    }

    /// Samples every `(logits row, sequence)` draw: on the host through each sequence's
    /// sampler, or on the device with each sampler's step parameters (same pipeline, same RNG
    /// draws).
    fn draw(&mut self, logits: &Logits, draws: &[(usize, SeqId)]) -> Result<Vec<SampledToken>> {
        let vocab = self.backend.config().vocab_size;
        let mut out = Vec::with_capacity(draws.len());
        match logits {
            Logits::Host(logits) => {
                for &(row, seq_id) in draws {
                    let req = self.requests.get_mut(&seq_id.request).ok_or(Error::UnknownRequest(seq_id.request.0))?;
                    let seq = &mut req.seqs[seq_id.index as usize];
                    out.push(seq.sampler.sample(&logits[row * vocab..(row + 1) * vocab], &req.prompt, &seq.output));
                }
            }
            Logits::Device => {
                let samples = self.device_samples(draws)?;
                for (d, &(_, seq_id)) in self.backend.sample_on_device(&samples)?.into_iter().zip(draws) {
                    let top_logprobs = match &d.penalised_row {
                        Some(row) => {
                            let req = self.requests.get_mut(&seq_id.request).ok_or(Error::UnknownRequest(seq_id.request.0))?;
                            req.seqs[seq_id.index as usize].sampler.top_logprobs_of_penalised(row)
                        }
                        None => Vec::new(),
                    };
                    out.push(SampledToken { token: d.token, logprob: d.logprob, top_logprobs });
                }
            }
        }
        Ok(out)
    }

    /// Appends a sampled token to a sequence, detokenizes, checks stop conditions and finishes
    /// the sequence when one holds.
    fn accept_token(&mut self, seq_id: SeqId, token: u32, lp: Option<TokenLogprob>, outputs: &mut Vec<SeqOutput>) -> Result<()> {
        let role = self.cfg.role;
        let Some(req) = self.requests.get_mut(&seq_id.request) else { return Ok(()) };
        let eos = self.tokenizer.eos_token_ids();
        let params = &req.params;
        let seq = &mut req.seqs[seq_id.index as usize];
        seq.output.push(token);
        req.usage.completion_tokens += 1;
        let mut out = SeqOutput {
            request: seq_id.request,
            index: seq_id.index,
            token_ids: vec![token],
            text: String::new(),
            logprobs: Vec::new(),
            finish: None,
        };
        if let Some(lp) = lp.filter(|_| params.logprobs.is_some()) {
            out.logprobs.push(lp);
        }
        let is_stop_token = (!params.ignore_eos && eos.contains(&token)) || params.stop_token_ids.contains(&token);
        if is_stop_token {
            out.finish = Some(FinishReason::Stop);
        } else {
            let delta = seq.detok.push(&self.tokenizer, token)?;
            match seq.stop.push(&delta) {
                StopOutcome::Continue(text) => out.text = text,
                StopOutcome::Stopped(text) => {
                    out.text = text;
                    out.finish = Some(FinishReason::Stop);
                }
            }
        }
        // A prefill node always holds the prompt's blocks after the first token, even one that would
        // stop the sequence: its KV is being shipped, and the decode node applies the stop rules to
        // that token itself when it accepts it.
        if role == Role::Prefill {
            out.finish = Some(FinishReason::PrefillDone);
        }
        let context_full = req.prompt.len() + seq.output.len() >= self.max_model_len;
        if out.finish.is_none() && (seq.output.len() >= params.max_tokens || context_full) {
            out.finish = Some(FinishReason::Length);
        }
        if let Some(reason) = out.finish {
            if reason != FinishReason::Stop {
                let tail = seq.detok.flush(&self.tokenizer)?;
                match seq.stop.push(&tail) {
                    StopOutcome::Continue(text) => {
                        out.text.push_str(&text);
                        out.text.push_str(&seq.stop.flush());
                    }
                    StopOutcome::Stopped(text) => out.text.push_str(&text),
                }
            }
            seq.finished = true;
            if reason == FinishReason::PrefillDone {
                req.held = Some(self.sched.hold(seq_id));
            } else {
                self.sched.finish(seq_id);
                // A sibling held for a transfer keeps the request known until `release`.
                if req.seqs.iter().all(|s| s.finished) && req.held.is_none() {
                    self.requests.remove(&seq_id.request);
                }
            }
        }
        outputs.push(out);
        Ok(())
    }

    /// Runs one request to completion on its own (other queued requests advance too) and returns
    /// its sequences.
    pub fn generate(&mut self, prompt: &Prompt, params: SamplingParams) -> Result<Vec<Completion>> {
        let n = params.n;
        let id = self.add_request(prompt, params)?;
        let mut done: Vec<Option<Completion>> = vec![None; n];
        let mut partial: Vec<Completion> =
            (0..n).map(|_| Completion { token_ids: Vec::new(), text: String::new(), finish: FinishReason::Abort, logprobs: Vec::new() }).collect();
        while done.iter().any(Option::is_none) {
            let outputs = self.step()?;
            if outputs.is_empty() && !self.has_unfinished() {
                break;
            }
            for out in outputs.into_iter().filter(|o| o.request == id) {
                let c = &mut partial[out.index as usize];
                c.token_ids.extend(out.token_ids);
                c.text.push_str(&out.text);
                c.logprobs.extend(out.logprobs);
                if let Some(reason) = out.finish {
                    c.finish = reason;
                    done[out.index as usize] = Some(c.clone());
                }
            }
        }
        Ok(done.into_iter().zip(partial).map(|(d, p)| d.unwrap_or(p)).collect())
    }
}

impl SeqState {
    fn new(params: &SamplingParams, prompt: &[u32], seed: u64, index: u32) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(8)..];
        SeqState {
            sampler: Sampler::new(params, sequence_seed(seed, index as usize)),
            output: Vec::new(),
            detok: IncrementalDetokenizer::new(tail, params.skip_special_tokens),
            stop: StopMatcher::new(&params.stop),
            finished: false,
        }
    }

    /// Takes `output` as tokens this sequence already produced: replays the detokenizer and the stop
    /// matcher over them exactly as [`Engine::accept_token`] would have (discarding the text, which
    /// the client already has, but keeping what they hold back) and skips the sampler's draws. An
    /// output that would have finished (a stop token, a stop string) cannot be resumed.
    fn resume(&mut self, tokenizer: &Tokenizer, params: &SamplingParams, output: &[u32]) -> Result<()> {
        let eos = tokenizer.eos_token_ids();
        for (i, &token) in output.iter().enumerate() {
            if (!params.ignore_eos && eos.contains(&token)) || params.stop_token_ids.contains(&token) {
                return Err(Error::InvalidResume(format!("output token {i} ({token}) is a stop token")));
            }
            let delta = self.detok.push(tokenizer, token)?;
            if let StopOutcome::Stopped(_) = self.stop.push(&delta) {
                return Err(Error::InvalidResume(format!("the output completes a stop string at token {i}")));
            }
            self.output.push(token);
        }
        self.sampler.skip_steps(output.len());
        Ok(())
    }
}
