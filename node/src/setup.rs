//! Starting a node: load the engine (off the async threads), register its KV cache, open the KV
//! connector, start the engine thread, and prepare what `Info` answers.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::Engine;
use tandem_engine::engine::EngineConfig;
use tandem_engine::sched::Role;
use tandem_kv_transfer::{Connector, ConnectorConfig, ConnectorSpec, Fabric, Geometry};
use tandem_proto::node::v1 as node;

use crate::engine_thread::EngineThread;
use crate::error::NodeError;
use crate::{convert, kv};

/// How to start a node.
#[derive(Debug, Clone)]
pub struct NodeSetup {
    /// The model directory.
    pub model_dir: PathBuf,
    /// The model's name as clients address it.
    pub model_name: String,
    /// Engine settings (the role is set by the node kind).
    pub engine: EngineConfig,
    /// The KV connector backend.
    pub kv_spec: ConnectorSpec,
    /// Connector tunables.
    pub kv_config: ConnectorConfig,
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
}

impl NodeCore {
    /// Loads the model and starts the engine thread and the connector.
    pub async fn start(setup: NodeSetup, role: Role, fabric: &Fabric) -> Result<NodeCore, NodeError> {
        let mut cfg = setup.engine.clone();
        cfg.role = role;
        let dir = setup.model_dir.clone();
        let name = setup.model_name.clone();
        let (mut engine, model_id, tokenizer_files) = tokio::task::spawn_blocking(move || {
            let engine = Engine::load(&dir, cfg)?;
            let model_id = kv::model_fingerprint(&name, &dir)?;
            let files = tandem_engine::tokenizer::TokenizerFiles::read(&dir)?;
            Ok::<_, NodeError>((engine, model_id, files))
        })
        .await
        .map_err(|e| NodeError::Internal(format!("loading the model: {e}")))??;
        let memory = kv::register_kv(&mut engine, &model_id)?;
        let geometry = memory.geometry().clone();
        let connector = Arc::new(Connector::from_spec(&setup.kv_spec, Arc::clone(&memory), setup.kv_config, fabric).await?);
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
        };
        Ok(NodeCore { engine, connector, geometry, model_name: setup.model_name, vocab_size, block_size, max_model_len, num_blocks, info })
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

/// The tokenizer's files as a name → content map (what `Info` carries to the router).
pub fn tokenizer_files_to_map(files: &tandem_engine::tokenizer::TokenizerFiles) -> HashMap<String, String> {
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
pub fn tokenizer_files_from_map(map: &HashMap<String, String>) -> Result<tandem_engine::tokenizer::TokenizerFiles, NodeError> {
    let tokenizer_json =
        map.get("tokenizer.json").cloned().ok_or_else(|| NodeError::Internal("node sent no tokenizer.json".into()))?;
    Ok(tandem_engine::tokenizer::TokenizerFiles {
        tokenizer_json,
        tokenizer_config_json: map.get("tokenizer_config.json").cloned(),
        chat_template_jinja: map.get("chat_template.jinja").cloned(),
        generation_config_json: map.get("generation_config.json").cloned(),
        config_json: map.get("config.json").cloned(),
    })
}
