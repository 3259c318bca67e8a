//! `config.json` → [`ModelConfig`]: the Llama-family geometry tandem runs (Llama 2/3/3.1, SmolLM2,
//! Mistral-style), validated once so the rest of the engine can trust it.
//!
//! Understands both the classic keys (`rope_theta`, `rope_scaling`) and transformers 5's
//! `rope_parameters`.

use std::path::Path;

use serde_json::Value;
use tandem_kernels::cpu::RopeScaling;

use crate::{Error, Result};

/// The model geometry and hyper-parameters the engine needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The `architectures[0]` entry (or one derived from `model_type`).
    pub architecture: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Context window the model supports.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token, if the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens named by the config.
    pub eos_token_ids: Vec<u32>,
}

const SUPPORTED: [&str; 2] = ["LlamaForCausalLM", "MistralForCausalLM"];

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !dir.is_dir() {
            return Err(Error::ModelDir { path: dir.to_path_buf(), reason: "not a directory".into() });
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::ModelDir {
            path: path.clone(),
            reason: format!("cannot read config.json: {e}"),
        })?;
        Self::from_json(&text)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::Config(format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(Error::Config("expected a JSON object".into()));
        }
        let architecture = architecture(&v)?;
        let hidden_size = req_usize(&v, "hidden_size")?;
        let num_heads = req_usize(&v, "num_attention_heads")?;
        let num_kv_heads = opt_usize(&v, "num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match opt_usize(&v, "head_dim")? {
            Some(d) => d,
            None if num_heads > 0 && hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => return Err(Error::Config("hidden_size is not a multiple of num_attention_heads".into())),
        };
        if v.get("hidden_act").and_then(Value::as_str).is_some_and(|a| a != "silu") {
            return Err(Error::Config(format!("hidden_act {} is not supported (only silu)", v["hidden_act"])));
        }
        for key in ["attention_bias", "mlp_bias"] {
            if v.get(key).and_then(Value::as_bool) == Some(true) {
                return Err(Error::Config(format!("{key} = true is not supported")));
            }
        }
        let (rope_theta, rope_scaling) = rope(&v)?;
        let mut max_position_embeddings = opt_usize(&v, "max_position_embeddings")?.unwrap_or(2048);
        if let Some(window) = opt_usize(&v, "sliding_window")? {
            // Without sliding-window attention the model is exact only up to its window.
            max_position_embeddings = max_position_embeddings.min(window);
        }
        let cfg = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: req_usize(&v, "intermediate_size")?,
            num_layers: req_usize(&v, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: req_usize(&v, "vocab_size")?,
            rms_norm_eps: opt_f64(&v, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            bos_token_id: opt_usize(&v, "bos_token_id")?.map(|x| x as u32),
            eos_token_ids: token_ids(v.get("eos_token_id"))?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, x)| *x == 0) {
            return Err(Error::Config(format!("{name} must be positive")));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!("head_dim {} must be even for RoPE", self.head_dim)));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(Error::Config("rms_norm_eps must be positive".into()));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return Err(Error::Config("rope_theta must be positive".into()));
        }
        Ok(())
    }

    /// Width of the fused Q, K and V projection output.
    pub fn qkv_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

fn architecture(v: &Value) -> Result<String> {
    let named = v.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str);
    let arch = match (named, v.get("model_type").and_then(Value::as_str)) {
        (Some(a), _) => a.to_string(),
        (None, Some("llama")) => "LlamaForCausalLM".to_string(),
        (None, Some("mistral")) => "MistralForCausalLM".to_string(),
        (None, Some(other)) => other.to_string(),
        (None, None) => return Err(Error::Config("neither architectures nor model_type is set".into())),
    };
    if SUPPORTED.contains(&arch.as_str()) {
        Ok(arch)
    } else {
        Err(Error::UnsupportedArchitecture(arch))
    }
}

fn rope(v: &Value) -> Result<(f32, RopeScaling)> {
    // transformers 5 writes {"rope_parameters": {"rope_type": .., "rope_theta": .., ...}}.
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(t) => t.as_f64().ok_or_else(|| Error::Config("rope_parameters.rope_theta must be a number".into()))?,
        None => opt_f64(v, "rope_theta")?.unwrap_or(10000.0),
    };
    let scaling = params.or_else(|| v.get("rope_scaling").filter(|s| !s.is_null()));
    let Some(s) = scaling else { return Ok((theta as f32, RopeScaling::None)) };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |key: &str| -> Result<f32> {
        s.get(key)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| Error::Config(format!("rope scaling {kind:?} needs a numeric {key}")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: num("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        other => return Err(Error::Config(format!("rope scaling type {other:?} is not supported (default, linear, llama3)"))),
    };
    Ok((theta as f32, scaling))
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    opt_usize(v, key)?.ok_or_else(|| Error::Config(format!("missing {key}")))
}

fn opt_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::Config(format!("{key} must be a non-negative integer, got {x}"))),
    }
}

fn opt_f64(v: &Value, key: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| Error::Config(format!("{key} must be a number, got {x}"))),
    }
}

fn token_ids(v: Option<&Value>) -> Result<Vec<u32>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().map(|n| n as u32).ok_or_else(|| Error::Config(format!("bad token id {x}"))))
            .collect(),
        Some(x) => x.as_u64().map(|n| vec![n as u32]).ok_or_else(|| Error::Config(format!("bad token id {x}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
        "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"rms_norm_eps":1e-5,
        "rope_theta":100000.0,"max_position_embeddings":8192,"vocab_size":49152,"tie_word_embeddings":true,
        "bos_token_id":1,"eos_token_id":2,"hidden_act":"silu"}"#;

    #[test]
    fn parses_smollm2() {
        let c = ModelConfig::from_json(SMOLLM2).unwrap();
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.qkv_width(), 15 * 64);
    }

    #[test]
    fn parses_llama3_scaling_in_both_spellings() {
        let old = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
            "num_attention_heads":4,"vocab_size":10,"rope_theta":500000,"eos_token_id":[1,2],
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#;
        let new = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
            "num_attention_heads":4,"vocab_size":10,"eos_token_id":[1,2],
            "rope_parameters":{"rope_type":"llama3","rope_theta":500000,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#;
        let a = ModelConfig::from_json(old).unwrap();
        let b = ModelConfig::from_json(new).unwrap();
        assert_eq!(a, b);
        assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { factor: 8.0, .. }));
        assert_eq!(a.head_dim, 16);
        assert_eq!(a.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn rejects_bad_configs_with_clear_errors() {
        let bad = [
            (r#"{"architectures":["GPT2LMHeadModel"]}"#, "GPT2LMHeadModel"),
            ("not json", "not valid JSON"),
            (r#"{"architectures":["LlamaForCausalLM"]}"#, "missing hidden_size"),
            (r#"{"model_type":"llama","hidden_size":64,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":3,"vocab_size":9}"#, "not a multiple"),
            (r#"{"model_type":"llama","hidden_size":-4}"#, "non-negative integer"),
            (r#"{"model_type":"llama","hidden_size":64,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":4,"vocab_size":9,"rope_scaling":{"type":"yarn","factor":2}}"#, "yarn"),
        ];
        for (json, needle) in bad {
            let err = ModelConfig::from_json(json).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
        let missing = ModelConfig::from_model_dir(Path::new("/nonexistent/tandem")).unwrap_err();
        assert!(missing.to_string().contains("not a directory"));
    }
}
