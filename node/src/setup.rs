//! Starting a node: load the engine (off the async threads), register its KV cache, open the KV
//! connector, start the engine thread, and prepare what `Info` answers.
//!
//! A node runs a checkpoint directory or random weights of a given geometry ([`Weights`]). Either way
//! the KV handshake's model fingerprint is a pure function of what both nodes were given (the name,
//! the config JSON, and for random weights the seed), so two nodes started alike exchange KV and nodes
//! of different models or weights refuse each other.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::Engine;
use tandem_engine::config::ModelConfig;
use tandem_engine::engine::EngineConfig;
use tandem_engine::sched::Role;
use tandem_engine::tokenizer::{Tokenizer, TokenizerFiles};
use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, Fabric, Geometry};
use tandem_proto::node::v1 as node;

use crate::engine_thread::EngineThread;
use crate::error::NodeError;
use crate::tls::ClusterTls;
use crate::{convert, kv};

/// Where a node's weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Weights {
    /// The checkpoint in [`NodeSetup::model_dir`] (config.json, safetensors, tokenizer).
    Dir,
    /// Random weights of a geometry, drawn from `seed` (benchmarks of large geometries without
    /// their checkpoints; CUDA only, as `Engine::with_random_weights` is). Equal seeds and configs
    /// give equal weights.
    Random {
        /// The model's config.json text (the geometry).
        config_json: String,
        /// A directory with tokenizer.json (any tokenizer within the config's vocabulary).
        tokenizer_dir: PathBuf,
        /// The weights' seed.
        seed: u64,
    },
}

/// How to start a node.
#[derive(Debug, Clone)]
pub struct NodeSetup {
    /// The model directory (with [`Weights::Dir`]; unused for random weights).
    pub model_dir: PathBuf,
    /// Where the weights come from.
    pub weights: Weights,
    /// The model's name as clients address it.
    pub model_name: String,
    /// Engine settings (the role is set by the node kind).
    pub engine: EngineConfig,
    /// The KV connector backend.
    pub kv_spec: ConnectorSpec,
    /// Connector tunables.
    pub kv_config: ConnectorConfig,
    /// Overload limits (`--max-waiting-requests`).
    pub limits: crate::admission::Limits,
    /// TLS for the node API, its calls to peers and the tcp KV backend; `None`: plaintext.
    pub tls: Option<Arc<ClusterTls>>,
}

/// A started node's shared parts.
#[derive(Debug)]
pub struct NodeCore {
    /// The engine thread.
    pub engine: EngineThread,
    /// The KV connector over the engine's cache.
    pub connector: Arc<Connector>,
    /// KV geometry (model fingerprint included).
    pub geometry: Geometry,
    /// The model's name.
    pub model_name: String,
    /// Vocabulary size (token ids from the wire are checked against it).
    pub vocab_size: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// The `Info` answer.
    pub info: node::InfoResponse,
    /// TLS for the node API and its calls to peers (see [`crate::tls`]); `None`: plaintext.
    pub tls: Option<Arc<ClusterTls>>,
    /// Requests accepted and not yet started, bounded by [`NodeSetup::limits`].
    pub admission: crate::admission::Gate,
}

impl NodeCore {
    /// Loads the model and starts the engine thread and the connector.
    pub async fn start(setup: NodeSetup, role: Role, fabric: &Fabric) -> Result<NodeCore, NodeError> {
        let mut cfg = setup.engine.clone();
        cfg.role = role;
        let (dir, weights, name) = (setup.model_dir.clone(), setup.weights.clone(), setup.model_name.clone());
        let (mut engine, model_id, tokenizer_files) = tokio::task::spawn_blocking(move || match weights {
            Weights::Dir => {
                let engine = Engine::load(&dir, cfg)?;
                let model_id = kv::model_fingerprint(&name, &dir)?;
                let files = TokenizerFiles::read(&dir)?;
                Ok::<_, NodeError>((engine, model_id, files))
            }
            Weights::Random { config_json, tokenizer_dir, seed } => {
                let model_cfg = ModelConfig::from_json(&config_json)?;
                let engine = Engine::with_random_weights(&model_cfg, Tokenizer::from_model_dir(&tokenizer_dir)?, cfg, seed)?;
                Ok((engine, random_weights_fingerprint(&name, &config_json, seed), TokenizerFiles::read(&tokenizer_dir)?))
            }
        })
        .await
        .map_err(|e| NodeError::Internal(format!("loading the model: {e}")))??;
        let on_gpu = matches!(engine.device(), tandem_engine::Device::Cuda { .. });
        let spec = with_kv_tls(setup.kv_spec.clone().resolve(on_gpu), setup.tls.as_deref());
        if spec.wants_device_memory() && !on_gpu {
            return Err(NodeError::InvalidArgument(format!("KV connector {spec:?} moves GPU memory: it needs --device cuda")));
        }
        let device_memory = on_gpu && spec.uses_device_memory()?;
        let memory = kv::register_kv(&mut engine, &model_id, device_memory)?;
        let geometry = memory.geometry().clone();
        let connector = Arc::new(Connector::from_spec(&spec, Arc::clone(&memory), setup.kv_config, fabric).await?);
        tracing::info!(backend = connector.backend(), endpoint = %connector.endpoint(), "KV connector ready");
        let vocab_size = engine.model_config().vocab_size;
        let block_size = engine.config().block_size;
        let max_model_len = engine.max_model_len();
        let num_blocks = memory.num_blocks() as usize;
        let engine_conn = (role == Role::Prefill).then(|| Arc::clone(&connector));
        let engine = EngineThread::spawn(engine, engine_conn, Some(memory))
            .map_err(|e| NodeError::Internal(format!("starting the engine thread: {e}")))?;
        let info = node::InfoResponse {
            model: setup.model_name.clone(),
            role: match role {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
                Role::Colocated => "colocated",
            }
            .into(),
            max_model_len: max_model_len as u32,
            geometry: Some(convert::geometry_to_proto(&geometry)),
            tokenizer_files: tokenizer_files_to_map(&tokenizer_files),
            load: None,
            kv_backend: String::new(),
        };
        let admission = crate::admission::Gate::new(setup.limits);
        let tls = setup.tls;
        Ok(NodeCore { engine, connector, geometry, model_name: setup.model_name, vocab_size, block_size, max_model_len, num_blocks, info, admission, tls })
    }

    /// The `Info` answer with the node's load now (blocks and queues read from the engine thread).
    pub async fn info_now(&self) -> Result<node::InfoResponse, NodeError> {
        let load = self.engine.load().await?;
        let mut info = self.info.clone();
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        info.load = Some(node::NodeLoad {
            total_blocks: n(load.total_blocks),
            free_blocks: n(load.free_blocks),
            waiting: n(load.waiting),
            running: n(load.running),
        });
        info.kv_backend = self.connector.backend().to_string();
        Ok(info)
    }

    /// Refuses token ids outside the vocabulary (the engine trusts ids it is given).
    pub fn check_tokens(&self, prompt: &[u32]) -> Result<(), NodeError> {
        if prompt.is_empty() {
            return Err(NodeError::Engine(tandem_engine::Error::EmptyPrompt));
        }
        match prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(t) => Err(NodeError::InvalidArgument(format!("token id {t} is outside the vocabulary of {}", self.vocab_size))),
            None => Ok(()),
        }
    }
}

/// The KV connector spec with the cluster's TLS: the tcp backend runs mutual TLS with the node's
/// certificate and CA. cuda-ipc (a Unix socket only this user can open) and inproc stay as they are;
/// nccl's TCP control channel and plugins are not covered, which is logged as a warning.
fn with_kv_tls(spec: ConnectorSpec, tls: Option<&ClusterTls>) -> ConnectorSpec {
    let Some(tls) = tls else { return spec };
    match spec {
        ConnectorSpec::Tcp(mut opts) => {
            opts.tls = Some(tls.kv());
            ConnectorSpec::Tcp(opts)
        }
        spec @ (ConnectorSpec::Nccl(_) | ConnectorSpec::Plugin { .. }) => {
            tracing::warn!(connector = ?spec, "--tls-* secures the tcp KV backend only: this KV connector's links are not authenticated by TLS");
            spec
        }
        spec => spec,
    }
}

/// The KV handshake's model id of random weights: the name, a hash of the config JSON (as
/// [`kv::model_fingerprint`] hashes a directory's config.json) and the seed, so nodes given the same
/// config and seed agree, and a different config, seed or a checkpoint of the same name is refused.
fn random_weights_fingerprint(name: &str, config_json: &str, seed: u64) -> String {
    let mut end = name.len().min(150);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}@{:016x}#random-{seed:016x}", &name[..end], twox_hash::XxHash3_64::oneshot(config_json.as_bytes()))
}

/// The tokenizer's files as a name → content map (what `Info` carries to the router).
pub fn tokenizer_files_to_map(files: &TokenizerFiles) -> HashMap<String, String> {
    let mut map = HashMap::new();
    map.insert("tokenizer.json".to_string(), files.tokenizer_json.clone());
    for (name, content) in [
        ("tokenizer_config.json", &files.tokenizer_config_json),
        ("chat_template.jinja", &files.chat_template_jinja),
        ("generation_config.json", &files.generation_config_json),
        ("config.json", &files.config_json),
    ] {
        if let Some(c) = content {
            map.insert(name.to_string(), c.clone());
        }
    }
    map
}

/// The inverse of [`tokenizer_files_to_map`].
pub fn tokenizer_files_from_map(map: &HashMap<String, String>) -> Result<TokenizerFiles, NodeError> {
    let tokenizer_json =
        map.get("tokenizer.json").cloned().ok_or_else(|| NodeError::Internal("node sent no tokenizer.json".into()))?;
    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config_json: map.get("tokenizer_config.json").cloned(),
        chat_template_jinja: map.get("chat_template.jinja").cloned(),
        generation_config_json: map.get("generation_config.json").cloned(),
        config_json: map.get("config.json").cloned(),
    })
}

#[cfg(test)]
mod tests {
    use super::random_weights_fingerprint;

    #[test]
    fn random_weights_fingerprint_depends_on_name_config_and_seed() {
        let a = random_weights_fingerprint("m", "{\"hidden_size\": 64}", 7);
        assert_eq!(a, random_weights_fingerprint("m", "{\"hidden_size\": 64}", 7));
        assert_ne!(a, random_weights_fingerprint("m", "{\"hidden_size\": 128}", 7));
        assert_ne!(a, random_weights_fingerprint("m", "{\"hidden_size\": 64}", 8));
        assert_ne!(a, random_weights_fingerprint("n", "{\"hidden_size\": 64}", 7));
        // Long and multi-byte names are cut on a character boundary, keeping the hash and seed.
        let long = random_weights_fingerprint(&"é".repeat(200), "{}", 1);
        assert!(long.len() <= 200 && long.ends_with("#random-0000000000000001"), "{long}");
    }
}
