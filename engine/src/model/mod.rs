//! The Llama-family decoder: [`Model`] on the CPU (weights as f32, K/V in paged blocks), [`CudaModel`]
//! on a GPU, and the [`backend`] boundary the engine drives both through.
//!
//! One forward pass runs any mix of chunks (prefill chunks of many tokens and decode chunks of one)
//! as a single flat batch: the projections and the MLP are one GEMM over all tokens; attention runs
//! per chunk against that chunk's block table. Invariant: within a layer, every chunk's K/V is
//! written before any attention of that layer reads, so chunks sharing blocks in one step see the
//! same data whatever their order.
//!
//! Layer by layer: [`Model::forward_observed`] reports each layer right after that layer's K/V of
//! every chunk is written. Layer `l` of the cache is written only while layer `l` runs, so once
//! reported, nothing later in the pass changes it.

pub(crate) mod backend;
mod cuda;
mod kv_cache;
mod kv_store;

pub use backend::{CudaSizing, Device, KvDType, TransferMemory, TransferPlace};
pub use cuda::{CudaModel, HostKvMirror};
pub use kv_cache::{KvCache, LayerMut, LayerRef};

use std::path::Path;

use tandem_kernels::cpu::{self, AttentionChunk};

use crate::config::ModelConfig;
use crate::weights::WeightStore;
use crate::{Error, Result};

/// One sequence's part of a forward pass.
#[derive(Clone, Copy, Debug)]
pub struct BatchChunk<'a> {
    /// The tokens to compute.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (the number of tokens already in the cache for this sequence).
    pub start_pos: usize,
    /// Block ids covering positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// Whether to return logits for the chunk's last token.
    pub want_logits: bool,
}

/// One decoder layer's weights as f32, in the stacked form both backends run.
pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    /// Q, K and V projections stacked: `[(heads + 2*kv_heads) * head_dim, hidden]`.
    pub(crate) qkv: Vec<f32>,
    pub(crate) o: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2 * intermediate, hidden]`.
    pub(crate) gate_up: Vec<f32>,
    pub(crate) down: Vec<f32>,
}

impl Layer {
    /// Reads layer `l` of `store`, checking every tensor's shape against `cfg`.
    pub(crate) fn load(store: &WeightStore, cfg: &ModelConfig, l: usize) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (q_rows, kv_rows) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let p = format!("model.layers.{l}");
        let mut qkv = store.f32(&format!("{p}.self_attn.q_proj.weight"), &[q_rows, h])?;
        qkv.extend(store.f32(&format!("{p}.self_attn.k_proj.weight"), &[kv_rows, h])?);
        qkv.extend(store.f32(&format!("{p}.self_attn.v_proj.weight"), &[kv_rows, h])?);
        let mut gate_up = store.f32(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?;
        gate_up.extend(store.f32(&format!("{p}.mlp.up_proj.weight"), &[i, h])?);
        Ok(Layer {
            input_norm: store.f32(&format!("{p}.input_layernorm.weight"), &[h])?,
            qkv,
            o: store.f32(&format!("{p}.self_attn.o_proj.weight"), &[h, q_rows])?,
            post_norm: store.f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            gate_up,
            down: store.f32(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
        })
    }
}

/// The LM head, or `None` when the embedding is tied (and no separate head is stored).
pub(crate) fn load_lm_head(store: &WeightStore, cfg: &ModelConfig) -> Result<Option<Vec<f32>>> {
    if cfg.tie_word_embeddings && !store.contains("lm_head.weight") {
        Ok(None)
    } else {
        Ok(Some(store.f32("lm_head.weight", &[cfg.vocab_size, cfg.hidden_size])?))
    }
}

/// A loaded model ready to run forward passes.
pub struct Model {
    cfg: ModelConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when the embedding is tied.
    lm_head: Option<Vec<f32>>,
    inv_freq: Vec<f32>,
}

impl Model {
    /// Loads the weights of `dir` for the geometry `cfg`.
    pub fn load(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        let store = WeightStore::open(dir)?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let layers = (0..cfg.num_layers).map(|l| Layer::load(&store, cfg, l)).collect::<Result<Vec<_>>>()?;
        let lm_head = load_lm_head(&store, cfg)?;
        Ok(Model {
            embed: store.f32("model.embed_tokens.weight", &[v, h])?,
            norm: store.f32("model.norm.weight", &[h])?,
            lm_head,
            layers,
            inv_freq: cpu::rope_inv_freq(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling),
            cfg: cfg.clone(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Runs `chunks` through the model, writing their K/V into `kv`, and returns one row of
    /// `vocab_size` logits per chunk with `want_logits`, in chunk order.
    pub fn forward(&self, chunks: &[BatchChunk<'_>], kv: &mut KvCache) -> Result<Vec<f32>> {
        self.forward_observed(chunks, kv, &mut |_, _| {})
    }

    /// [`Self::forward`], calling `on_layer(l, kv)` for every layer `l` in order, right after
    /// layer `l`'s K/V of every chunk was written and before that layer's attention runs; the
    /// rest of the pass never writes layer `l` again, so the callback may read (or start
    /// sending) those blocks. The chunks are checked before the first layer: on an error the
    /// callback is not called at all.
    pub fn forward_observed(
        &self,
        chunks: &[BatchChunk<'_>],
        kv: &mut KvCache,
        on_layer: &mut dyn FnMut(usize, &KvCache),
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let layout = kv.paged();
        let total: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        let mut positions = Vec::with_capacity(total);
        let mut x = Vec::with_capacity(total * h);
        for c in chunks {
            if c.start_pos + c.tokens.len() > cfg.max_position_embeddings {
                return Err(Error::PromptTooLong { prompt: c.start_pos + c.tokens.len(), max_tokens: 0, limit: cfg.max_position_embeddings });
            }
            if c.block_table.len() * layout.block_size < c.start_pos + c.tokens.len()
                || c.block_table.iter().any(|&b| b as usize >= kv.num_blocks())
            {
                return Err(Error::Config("block table does not cover the chunk or names a block outside the pool".into()));
            }
            for (t, &tok) in c.tokens.iter().enumerate() {
                let row = self.embed.get(tok as usize * h..(tok as usize + 1) * h).ok_or_else(|| {
                    Error::Tokenizer(format!("token id {tok} is outside the vocabulary of {}", cfg.vocab_size))
                })?;
                x.extend_from_slice(row);
                positions.push(c.start_pos + t);
            }
        }
        let mut attn_chunks = Vec::with_capacity(chunks.len());
        let mut first = 0;
        for c in chunks {
            attn_chunks.push(AttentionChunk { first_token: first, len: c.tokens.len(), start_pos: c.start_pos, block_table: c.block_table });
            first += c.tokens.len();
        }

        let qkv_w = cfg.qkv_width();
        let mut normed = vec![0.0f32; total * h];
        let mut qkv = vec![0.0f32; total * qkv_w];
        let (mut q, mut k, mut v) =
            (vec![0.0f32; total * nh * hd], vec![0.0f32; total * nkv * hd], vec![0.0f32; total * nkv * hd]);
        let mut attn = vec![0.0f32; total * nh * hd];
        let mut proj = vec![0.0f32; total * h];
        let mut gate_up = vec![0.0f32; total * 2 * inter];
        let mut act = vec![0.0f32; total * inter];
        for (l, layer) in self.layers.iter().enumerate() {
            cpu::rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps, &mut normed);
            cpu::matmul_t(&normed, &layer.qkv, &mut qkv, total, h, qkv_w);
            for t in 0..total {
                let row = &qkv[t * qkv_w..(t + 1) * qkv_w];
                let (qr, rest) = row.split_at(nh * hd);
                let (kr, vr) = rest.split_at(nkv * hd);
                q[t * nh * hd..(t + 1) * nh * hd].copy_from_slice(qr);
                k[t * nkv * hd..(t + 1) * nkv * hd].copy_from_slice(kr);
                v[t * nkv * hd..(t + 1) * nkv * hd].copy_from_slice(vr);
            }
            cpu::rope_in_place(&mut q, &positions, nh, &self.inv_freq);
            cpu::rope_in_place(&mut k, &positions, nkv, &self.inv_freq);
            // The kernels reach the cache block by block, only through the chunks' block tables
            // (checked against the pool above): see `KvCache` for why that matters to transfers.
            let mut cache = kv.layer_mut(l);
            let mut offset = 0;
            for c in chunks {
                let n = c.tokens.len() * nkv * hd;
                cpu::write_kv_blocks(&mut cache, &layout, c.block_table, c.start_pos, &k[offset..offset + n], &v[offset..offset + n]);
                offset += n;
            }
            on_layer(l, kv);
            cpu::paged_attention_blocks(&q, &attn_chunks, &kv.layer(l), &layout, nh, &mut attn);
            cpu::matmul_t(&attn, &layer.o, &mut proj, total, nh * hd, h);
            cpu::add_in_place(&mut x, &proj);
            cpu::rms_norm(&x, &layer.post_norm, cfg.rms_norm_eps, &mut normed);
            cpu::matmul_t(&normed, &layer.gate_up, &mut gate_up, total, h, 2 * inter);
            cpu::silu_mul(&gate_up, &mut act, inter);
            cpu::matmul_t(&act, &layer.down, &mut proj, total, inter, h);
            cpu::add_in_place(&mut x, &proj);
        }

        // Only the rows that need logits go through the final norm and the LM head.
        let mut last = Vec::new();
        let mut end = 0;
        for c in chunks {
            end += c.tokens.len();
            if c.want_logits && !c.tokens.is_empty() {
                last.extend_from_slice(&x[(end - 1) * h..end * h]);
            }
        }
        let rows = last.len() / h;
        let mut normed_last = vec![0.0f32; last.len()];
        cpu::rms_norm(&last, &self.norm, cfg.rms_norm_eps, &mut normed_last);
        let mut logits = vec![0.0f32; rows * cfg.vocab_size];
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        cpu::matmul_t(&normed_last, head, &mut logits, rows, h, cfg.vocab_size);
        Ok(logits)
    }
}
