//! The engine's one error type. Every failure says what failed; mapping to exit codes or gRPC
//! statuses happens at the edges, once.

use std::path::PathBuf;

/// Result alias for the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model directory is missing, unreadable or lacks a required file.
    #[error("model directory {}: {reason}", path.display())]
    ModelDir {
        /// The directory (or file inside it) at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// `config.json` names an architecture tandem does not implement.
    #[error("unsupported architecture {0:?}: tandem runs LlamaForCausalLM and MistralForCausalLM")]
    UnsupportedArchitecture(String),
    /// `config.json` is malformed or inconsistent.
    #[error("invalid config.json: {0}")]
    Config(String),
    /// A weights file is corrupt, truncated or lacks a tensor.
    #[error("weights {}: {reason}", path.display())]
    Weights {
        /// The safetensors file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The tokenizer could not be loaded or failed on input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template is missing or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A GGUF file is truncated, corrupt or uses something tandem cannot convert.
    #[error("GGUF {}: {reason}", path.display())]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A sampling parameter is out of range.
    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A resumed request's already-generated output is not one the engine can continue (longer
    /// than the tokens, with `n` > 1, or an output that had already finished).
    #[error("cannot resume the request: {0}")]
    InvalidResume(String),
    /// Prompt plus requested output exceed the model's context window.
    #[error("prompt has {prompt} tokens; with max_tokens {max_tokens} that exceeds the context limit of {limit} tokens")]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// The model's context limit.
        limit: usize,
    },
    /// The request can never fit into the KV pool, however empty.
    #[error("request needs {needed} KV blocks but the pool only has {total}")]
    CapacityExceeded {
        /// Blocks the request needs.
        needed: usize,
        /// Blocks in the whole pool.
        total: usize,
    },
    /// The KV pool or scheduler settings are unusable (zero blocks, zero budget, ...).
    #[error("invalid KV cache / scheduler configuration: {0}")]
    InvalidKvConfig(String),
    /// Not enough free KV blocks right now (transient: retry once running requests finish).
    #[error("KV pool is full: need {needed} free blocks, {free} available")]
    KvPoolFull {
        /// Blocks needed.
        needed: usize,
        /// Blocks free (including evictable cached ones).
        free: usize,
    },
    /// A request with this id is already in the engine.
    #[error("request {0} already exists")]
    DuplicateRequest(u64),
    /// The request id is not known to the engine.
    #[error("unknown request {0}")]
    UnknownRequest(u64),
    /// The device backend could not start or failed (no GPU, a missing CUDA library, a kernel
    /// that did not compile, device memory exhausted, an unsupported model shape).
    #[error("device: {0}")]
    Device(String),
    /// An I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}
