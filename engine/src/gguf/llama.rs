//! The Llama side of the GGUF import: hyper-parameters from `llama.*` metadata, llama.cpp tensor
//! names mapped to Hugging Face names with their expected shapes, the q/k row permutation undone,
//! and `config.json` / `generation_config.json`.
//!
//! Invariants:
//! - Every tensor of the GGUF is either mapped to exactly one HF tensor, or deliberately skipped
//!   (`rope_freqs.weight`, which HF derives from the config); an unknown name is an error, never
//!   silently dropped.
//! - A mapped tensor's shape is checked against the hyper-parameters before any data is read, so
//!   the permutation's preconditions (rows = heads * even head_dim) always hold.

use serde_json::{Value, json};

use super::OutDtype;
use super::reader::{GgufFile, MetaValue, TensorInfo};
use crate::Result;

/// The GGUF architecture this module converts.
pub(crate) const ARCH: &str = "llama";

/// Hyper-parameters of a Llama model as the GGUF states them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LlamaParams {
    pub(crate) n_layers: usize,
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rms_eps: f64,
    pub(crate) rope_theta: f64,
    pub(crate) context_length: usize,
    pub(crate) vocab_size: usize,
    pub(crate) rope_scaling: Option<Value>,
    pub(crate) bos_id: Option<u64>,
    pub(crate) eos_id: Option<u64>,
    pub(crate) pad_id: Option<u64>,
}

fn req_usize(g: &GgufFile, key: &str) -> Result<usize> {
    let v = g
        .get(key)
        .ok_or_else(|| g.error(format!("metadata {key} is missing")))?;
    v.as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .filter(|&v| v > 0)
        .ok_or_else(|| g.error(format!("metadata {key} is {v:?}, not a positive integer")))
}

fn opt_usize(g: &GgufFile, key: &str) -> Result<Option<usize>> {
    match g.get(key) {
        None => Ok(None),
        Some(_) => req_usize(g, key).map(Some),
    }
}

fn opt_f64(g: &GgufFile, key: &str) -> Result<Option<f64>> {
    match g.get(key) {
        None => Ok(None),
        // An f32 is widened through its shortest decimal form, so 1e-5 stored as f32 reads as 1e-5
        // rather than 9.999999747378752e-6.
        Some(MetaValue::F32(f)) if f.is_finite() => Ok(f.to_string().parse::<f64>().ok()),
        Some(v) => v
            .as_f64()
            .filter(|f| f.is_finite())
            .map(Some)
            .ok_or_else(|| g.error(format!("metadata {key} is {v:?}, not a finite number"))),
    }
}

impl LlamaParams {
    /// Reads and checks the `llama.*` hyper-parameters.
    pub(crate) fn from_gguf(g: &GgufFile) -> Result<Self> {
        let n_heads = req_usize(g, "llama.attention.head_count")?;
        let n_kv_heads = opt_usize(g, "llama.attention.head_count_kv")?.unwrap_or(n_heads);
        let hidden = req_usize(g, "llama.embedding_length")?;
        let head_dim = match opt_usize(g, "llama.attention.key_length")? {
            Some(d) => d,
            None if hidden % n_heads == 0 => hidden / n_heads,
            None => {
                return Err(g.error(format!(
                    "embedding length {hidden} is not a multiple of the head count {n_heads}"
                )));
            }
        };
        if let Some(v) = opt_usize(g, "llama.attention.value_length")?
            && v != head_dim
        {
            return Err(g.error(format!(
                "value head size {v} differs from key head size {head_dim}"
            )));
        }
        if let Some(rot) = opt_usize(g, "llama.rope.dimension_count")?
            && rot != head_dim
        {
            return Err(g.error(format!(
                "rotary dimension {rot} differs from the head size {head_dim} (partial rotary is not supported)"
            )));
        }
        if head_dim % 2 != 0 {
            return Err(g.error(format!(
                "head size {head_dim} is odd; rotary embeddings need it even"
            )));
        }
        if n_heads % n_kv_heads != 0 {
            return Err(g.error(format!(
                "head count {n_heads} is not a multiple of the key/value head count {n_kv_heads}"
            )));
        }
        let vocab_size = match opt_usize(g, "llama.vocab_size")? {
            Some(v) => v,
            None => match g.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array) {
                Some(tokens) if !tokens.is_empty() => tokens.len(),
                _ => match g.tensor("token_embd.weight").and_then(|t| t.dims.get(1)) {
                    Some(&v) => {
                        usize::try_from(v).map_err(|_| g.error("vocabulary size overflows"))?
                    }
                    None => return Err(g.error("cannot tell the vocabulary size")),
                },
            },
        };
        let n_layers = req_usize(g, "llama.block_count")?;
        // Each layer has nine tensors; a larger count is corrupt and must not size allocations.
        if n_layers.saturating_mul(9) > g.tensors().len() {
            return Err(g.error(format!(
                "llama.block_count is {n_layers} but the file has only {} tensors",
                g.tensors().len()
            )));
        }
        let id = |key: &str| g.get(key).and_then(MetaValue::as_u64);
        Ok(Self {
            n_layers,
            hidden,
            intermediate: req_usize(g, "llama.feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: opt_f64(g, "llama.attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope_theta: opt_f64(g, "llama.rope.freq_base")?.unwrap_or(10_000.0),
            context_length: req_usize(g, "llama.context_length")?,
            vocab_size,
            rope_scaling: rope_scaling(g)?,
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_id: id("tokenizer.ggml.eos_token_id"),
            pad_id: id("tokenizer.ggml.padding_token_id"),
        })
    }
}

/// `rope_scaling` for config.json from `llama.rope.scaling.*`, if the file asks for scaling.
fn rope_scaling(g: &GgufFile) -> Result<Option<Value>> {
    let kind = match g.get("llama.rope.scaling.type") {
        None => return Ok(None),
        Some(v) => v
            .as_str()
            .ok_or_else(|| g.error("metadata llama.rope.scaling.type is not a string"))?,
    };
    if kind == "none" {
        return Ok(None);
    }
    if kind != "linear" && kind != "yarn" {
        return Err(g.error(format!(
            "rope scaling type {kind:?} is not supported (linear, yarn)"
        )));
    }
    let factor = opt_f64(g, "llama.rope.scaling.factor")?.ok_or_else(|| {
        g.error("llama.rope.scaling.type is set but llama.rope.scaling.factor is missing")
    })?;
    let mut v = json!({ "rope_type": kind, "type": kind, "factor": factor });
    if let Some(orig) = opt_usize(g, "llama.rope.scaling.original_context_length")? {
        v["original_max_position_embeddings"] = json!(orig);
    }
    Ok(Some(v))
}

/// Which row permutation a tensor needs undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Permute {
    /// Rows stay as they are.
    None,
    /// Undo llama.cpp's interleaving with this many heads.
    Heads(usize),
}

/// A GGUF tensor's fate in the HF directory.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Mapping {
    /// Written under `name` with `shape` (HF order, outermost first).
    Tensor {
        name: String,
        shape: Vec<usize>,
        permute: Permute,
    },
    /// Not written: HF recomputes it from the config.
    Skip,
}

/// Maps one GGUF tensor to its HF name, checks its shape, and says whether rows need unpermuting.
pub(crate) fn map_tensor(g: &GgufFile, p: &LlamaParams, t: &TensorInfo) -> Result<Mapping> {
    let (hd, h, kv) = (p.head_dim, p.hidden, p.n_kv_heads);
    let (name, expect, permute): (String, Vec<usize>, Permute) = match t.name.as_str() {
        "rope_freqs.weight" => return Ok(Mapping::Skip),
        "token_embd.weight" => (
            "model.embed_tokens.weight".into(),
            vec![p.vocab_size, h],
            Permute::None,
        ),
        "output_norm.weight" => ("model.norm.weight".into(), vec![h], Permute::None),
        "output.weight" => (
            "lm_head.weight".into(),
            vec![p.vocab_size, h],
            Permute::None,
        ),
        other => {
            let unknown = || {
                g.error(format!(
                    "tensor {other} has no Hugging Face Llama counterpart"
                ))
            };
            let rest = other.strip_prefix("blk.").ok_or_else(unknown)?;
            let (layer, part) = rest.split_once('.').ok_or_else(unknown)?;
            let layer: usize = layer.parse().map_err(|_| unknown())?;
            if layer >= p.n_layers {
                return Err(g.error(format!(
                    "tensor {other} is for layer {layer} but the model has {} layers",
                    p.n_layers
                )));
            }
            let (hf, shape, permute) = match part {
                "attn_q.weight" => (
                    "self_attn.q_proj.weight",
                    vec![p.n_heads.saturating_mul(hd), h],
                    Permute::Heads(p.n_heads),
                ),
                "attn_k.weight" => (
                    "self_attn.k_proj.weight",
                    vec![kv.saturating_mul(hd), h],
                    Permute::Heads(kv),
                ),
                "attn_v.weight" => (
                    "self_attn.v_proj.weight",
                    vec![kv.saturating_mul(hd), h],
                    Permute::None,
                ),
                "attn_output.weight" => (
                    "self_attn.o_proj.weight",
                    vec![h, p.n_heads.saturating_mul(hd)],
                    Permute::None,
                ),
                "ffn_gate.weight" => (
                    "mlp.gate_proj.weight",
                    vec![p.intermediate, h],
                    Permute::None,
                ),
                "ffn_up.weight" => ("mlp.up_proj.weight", vec![p.intermediate, h], Permute::None),
                "ffn_down.weight" => (
                    "mlp.down_proj.weight",
                    vec![h, p.intermediate],
                    Permute::None,
                ),
                "attn_norm.weight" => ("input_layernorm.weight", vec![h], Permute::None),
                "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![h], Permute::None),
                _ => return Err(unknown()),
            };
            (format!("model.layers.{layer}.{hf}"), shape, permute)
        }
    };
    let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
    if shape != expect {
        return Err(g.error(format!(
            "tensor {} has shape {shape:?} (HF order) but the hyper-parameters imply {expect:?}",
            t.name
        )));
    }
    Ok(Mapping::Tensor {
        name,
        shape,
        permute,
    })
}

/// The HF tensor names a complete Llama import must contain (without `lm_head.weight`, which a
/// tied model lacks).
pub(crate) fn required_names(p: &LlamaParams) -> Vec<String> {
    let mut names = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    for l in 0..p.n_layers {
        for part in [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ] {
            names.push(format!("model.layers.{l}.{part}"));
        }
    }
    names
}

/// Undoes llama.cpp's q/k row permutation on a row-major `[rows, cols]` matrix.
///
/// llama.cpp's converter views each head's `head_dim` rows as `[2, head_dim/2]` (HF's rotate-half
/// layout: first halves, then second halves) and swaps the two axes, so that the rotary pairs end
/// up adjacent (interleaved). With `half = head_dim / 2`, GGUF row `h*head_dim + 2*i + j` is HF row
/// `h*head_dim + j*half + i` for `i < half`, `j < 2`. This writes each HF row from its GGUF row.
pub(crate) fn unpermute_rows(gguf: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = gguf.len() / cols;
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut hf = vec![0f32; gguf.len()];
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                let src = h * head_dim + 2 * i + j;
                let dst = h * head_dim + j * half + i;
                hf[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&gguf[src * cols..(src + 1) * cols]);
            }
        }
    }
    hf
}

/// `config.json` for the converted model.
pub(crate) fn config_json(p: &LlamaParams, tied: bool, dtype: OutDtype) -> Value {
    let mut c = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden,
        "intermediate_size": p.intermediate,
        "num_hidden_layers": p.n_layers,
        "num_attention_heads": p.n_heads,
        "num_key_value_heads": p.n_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": p.rms_eps,
        "rope_theta": p.rope_theta,
        "max_position_embeddings": p.context_length,
        "vocab_size": p.vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": dtype.torch_name(),
    });
    if let Some(b) = p.bos_id {
        c["bos_token_id"] = json!(b);
    }
    if let Some(e) = p.eos_id {
        c["eos_token_id"] = json!(e);
    }
    if let Some(pad) = p.pad_id {
        c["pad_token_id"] = json!(pad);
    }
    if let Some(rs) = &p.rope_scaling {
        c["rope_scaling"] = rs.clone();
    }
    c
}

/// `generation_config.json`: the special ids generation needs.
pub(crate) fn generation_config_json(p: &LlamaParams) -> Value {
    let mut c = json!({ "_from_model_config": true });
    if let Some(b) = p.bos_id {
        c["bos_token_id"] = json!(b);
    }
    if let Some(e) = p.eos_id {
        c["eos_token_id"] = json!(e);
    }
    if let Some(pad) = p.pad_id {
        c["pad_token_id"] = json!(pad);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::test_util::permute_forward;
    use rand::{Rng, SeedableRng};

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for (n_heads, head_dim, cols) in [(1, 2, 1), (3, 4, 5), (9, 64, 3), (2, 8, 7)] {
            let hf: Vec<f32> = (0..n_heads * head_dim * cols)
                .map(|_| rng.random::<f32>())
                .collect();
            let gguf = permute_forward(&hf, n_heads, cols);
            if head_dim > 2 {
                assert_ne!(
                    gguf, hf,
                    "the permutation must move rows ({n_heads}, {head_dim})"
                );
            } else {
                assert_eq!(gguf, hf, "with head_dim 2 the permutation is the identity");
            }
            assert_eq!(unpermute_rows(&gguf, n_heads, cols), hf);
        }
    }

    #[test]
    fn unpermute_puts_rotary_pairs_half_a_head_apart() {
        // One head of 8 rows, one column holding the GGUF row index. llama.cpp's interleaved RoPE
        // rotates rows (0,1), (2,3), ...; HF's rotate-half rotates rows (i, i+4).
        let gguf: Vec<f32> = (0..8).map(|r| r as f32).collect();
        let hf = unpermute_rows(&gguf, 1, 1);
        assert_eq!(hf, vec![0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]);
        // Two heads: each is permuted on its own.
        let gguf: Vec<f32> = (0..8).map(|r| r as f32).collect();
        assert_eq!(
            unpermute_rows(&gguf, 2, 1),
            vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
        );
    }
}
