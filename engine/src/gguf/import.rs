//! The import driver: plan every tensor, build the side files, stream the weights into
//! `model.safetensors` in a temporary directory, then rename it into place.
//!
//! Invariants:
//! - The plan (names, shapes, types, extents, tokenizer, configs) is complete and checked before
//!   the temporary directory is created.
//! - Tensors are produced one at a time by lazy safetensors views, so at most one tensor's f32
//!   values and output bytes are alive at once.
//! - The temporary directory is removed by a drop guard on every failure path; `out_dir` appears
//!   only through the final rename.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::{Dtype, View};

use super::dequant::dequantize;
use super::llama::{self, LlamaParams, Mapping, Permute};
use super::reader::GgufFile;
use super::tokenizer;
use super::{ImportOptions, ImportProgress, ImportSummary, OutDtype};
use crate::{Error, Result};

/// One tensor to write.
#[derive(Debug, Clone)]
struct Plan {
    /// Index into the GGUF's tensor list.
    gguf_index: usize,
    hf_name: String,
    shape: Vec<usize>,
    permute: Permute,
    out_bytes: usize,
}

/// Converts the GGUF at `file` into a Hugging Face model directory at `out_dir`.
///
/// `out_dir` must not exist, or be an empty directory. `progress` is called before the first
/// tensor and after each one.
pub fn import_gguf(
    file: &Path,
    out_dir: &Path,
    opts: &ImportOptions,
    progress: &mut dyn FnMut(&ImportProgress),
) -> Result<ImportSummary> {
    let g = GgufFile::open(file)?;
    let Prepared {
        architecture,
        params,
        plans,
        tied,
        tok,
    } = prepare(&g, opts)?;
    let mut type_counts: BTreeMap<String, usize> = BTreeMap::new();
    for t in g.tensors() {
        *type_counts.entry(t.ggml_type.to_string()).or_default() += 1;
    }

    check_out_dir(out_dir)?;
    let staging = Staging::create(out_dir)?;
    let side_files = [
        (
            "config.json",
            llama::config_json(&params, tied, opts.out_dtype),
        ),
        (
            "generation_config.json",
            llama::generation_config_json(&params),
        ),
        ("tokenizer_config.json", tok.tokenizer_config),
    ];
    for (name, value) in side_files {
        let text = serde_json::to_string_pretty(&value)
            .map_err(|e| g.error(format!("serializing {name} failed: {e}")))?;
        write_file(&staging.path.join(name), text.as_bytes())?;
    }
    write_file(
        &staging.path.join("tokenizer.json"),
        tok.tokenizer_json.as_bytes(),
    )?;
    let weights = staging.path.join("model.safetensors");
    write_weights(&g, &plans, opts.out_dtype, &weights, progress)?;
    // safetensors writes through a private temporary file; give the weights the same permissions
    // as the other files (which follow the umask).
    let perms = std::fs::metadata(staging.path.join("config.json"))
        .map_err(|e| Error::io("reading config.json permissions", e))?
        .permissions();
    std::fs::set_permissions(&weights, perms)
        .map_err(|e| Error::io("setting model.safetensors permissions", e))?;
    staging.finish(out_dir)?;

    Ok(ImportSummary {
        out_dir: out_dir.to_path_buf(),
        architecture,
        num_tensors: plans.len(),
        tensor_types: type_counts.into_iter().collect(),
    })
}

/// What the checks before writing produced.
struct Prepared {
    architecture: String,
    params: LlamaParams,
    plans: Vec<Plan>,
    tied: bool,
    tok: tokenizer::TokenizerFiles,
}

/// Every check [`import_gguf`] makes before it writes anything: tensor types, architecture,
/// hyperparameters, the tensor mapping and the tokenizer.
fn prepare(g: &GgufFile, opts: &ImportOptions) -> Result<Prepared> {
    // Fail fast, before any metadata is interpreted, on a tensor type tandem cannot convert.
    if let Some(t) = g.tensors().iter().find(|t| t.ggml_type.layout().is_none()) {
        return Err(g.error(format!(
            "tensor {} has type {} which tandem cannot convert (supported: {})",
            t.name,
            t.ggml_type,
            super::GgmlType::convertible_list()
        )));
    }
    let architecture = g
        .get("general.architecture")
        .ok_or_else(|| g.error("metadata general.architecture is missing"))?
        .as_str()
        .ok_or_else(|| g.error("metadata general.architecture is not a string"))?
        .to_string();
    if architecture != llama::ARCH {
        return Err(g.error(format!(
            "architecture {architecture:?} is not supported (tandem converts \"{}\")",
            llama::ARCH
        )));
    }
    let params = LlamaParams::from_gguf(g)?;
    let plans = plan_tensors(g, &params, opts.out_dtype)?;
    let tied = !plans.iter().any(|p| p.hf_name == "lm_head.weight");
    let tok = tokenizer::build(g)?;
    if tok.n_tokens > params.vocab_size {
        return Err(g.error(format!(
            "the tokenizer has {} tokens but the model's vocabulary is {}",
            tok.n_tokens, params.vocab_size
        )));
    }
    Ok(Prepared {
        architecture,
        params,
        plans,
        tied,
        tok,
    })
}

/// What [`check_import`] found: the side files an import would write.
#[doc(hidden)]
#[derive(Debug)]
pub struct CheckedImport {
    /// `config.json`.
    pub config_json: String,
    /// `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json`.
    pub tokenizer_config_json: String,
    /// HF name and shape of every tensor `model.safetensors` would hold.
    pub tensors: Vec<(String, Vec<usize>)>,
}

/// The fuzzing entry point: [`import_gguf`] of a GGUF file held in memory up to the point where it
/// writes, plus the dequantization of every planned tensor whose bytes total at most
/// `max_dequant_bytes` (the file's bytes are untrusted too); nothing touches the disk.
#[doc(hidden)]
pub fn check_import(bytes: &[u8], opts: &ImportOptions, max_dequant_bytes: usize) -> Result<CheckedImport> {
    let g = GgufFile::from_bytes(bytes, Path::new("<fuzz input>"))?;
    let Prepared {
        params,
        plans,
        tied,
        tok,
        ..
    } = prepare(&g, opts)?;
    let mut budget = max_dequant_bytes;
    for plan in &plans {
        let info = &g.tensors()[plan.gguf_index];
        let Some(len) = info.byte_len().and_then(|l| usize::try_from(l).ok()) else {
            continue;
        };
        if len > budget {
            continue;
        }
        budget -= len;
        let start = usize::try_from(g.data_offset() + info.offset).map_err(|_| g.error("offset"))?;
        let src = bytes.get(start..start + len).ok_or_else(|| g.error("a checked extent is outside the file"))?;
        let mut out = vec![0f32; plan.shape.iter().product()];
        dequantize(info.ggml_type, src, &mut out).map_err(|e| g.error(format!("tensor {}: {e}", info.name)))?;
    }
    let json = |v: &serde_json::Value| serde_json::to_string_pretty(v).map_err(|e| g.error(e.to_string()));
    Ok(CheckedImport {
        config_json: json(&llama::config_json(&params, tied, opts.out_dtype))?,
        tokenizer_json: tok.tokenizer_json,
        tokenizer_config_json: json(&tok.tokenizer_config)?,
        tensors: plans.into_iter().map(|p| (p.hf_name, p.shape)).collect(),
    })
}

/// Maps and checks every tensor, and makes sure nothing the model needs is missing.
fn plan_tensors(g: &GgufFile, p: &LlamaParams, dtype: OutDtype) -> Result<Vec<Plan>> {
    let mut plans = Vec::with_capacity(g.tensors().len());
    let mut seen = HashSet::new();
    for (i, t) in g.tensors().iter().enumerate() {
        let Mapping::Tensor {
            name,
            shape,
            permute,
        } = llama::map_tensor(g, p, t)?
        else {
            continue;
        };
        let elems: usize = shape.iter().product();
        let out_bytes = elems
            .checked_mul(dtype.size())
            .ok_or_else(|| g.error(format!("tensor {} is too large", t.name)))?;
        seen.insert(name.clone());
        plans.push(Plan {
            gguf_index: i,
            hf_name: name,
            shape,
            permute,
            out_bytes,
        });
    }
    let missing: Vec<String> = llama::required_names(p)
        .into_iter()
        .filter(|n| !seen.contains(n))
        .collect();
    if let Some(first) = missing.first() {
        return Err(g.error(format!(
            "the file lacks {} tensor(s) a {}-layer Llama needs, e.g. {first}",
            missing.len(),
            p.n_layers
        )));
    }
    Ok(plans)
}

fn check_out_dir(out_dir: &Path) -> Result<()> {
    match std::fs::read_dir(out_dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(Error::ModelDir {
                    path: out_dir.to_path_buf(),
                    reason:
                        "already exists and is not empty; remove it or choose another directory"
                            .into(),
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if out_dir.exists() && !out_dir.is_dir() => Err(Error::ModelDir {
            path: out_dir.to_path_buf(),
            reason: format!("exists and is not a directory ({e})"),
        }),
        Err(e) => Err(Error::io(format!("checking {}", out_dir.display()), e)),
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// A temporary directory beside the destination, removed on drop unless renamed into place.
struct Staging {
    path: PathBuf,
    done: bool,
}

impl Staging {
    fn create(out_dir: &Path) -> Result<Self> {
        let parent = match out_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        let base = out_dir
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = parent.join(format!(
            ".{base}.tandem-import-{}-{stamp}",
            std::process::id()
        ));
        std::fs::create_dir(&path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        Ok(Self { path, done: false })
    }

    fn finish(mut self, out_dir: &Path) -> Result<()> {
        if out_dir.is_dir() {
            // Checked empty before we started; remove it so the rename can take its place.
            std::fs::remove_dir(out_dir)
                .map_err(|e| Error::io(format!("replacing {}", out_dir.display()), e))?;
        }
        std::fs::rename(&self.path, out_dir).map_err(|e| {
            Error::io(
                format!("moving {} to {}", self.path.display(), out_dir.display()),
                e,
            )
        })?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            // Best effort: a leftover hidden temp directory is harmless and clearly named.
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Shared state of the lazy views while safetensors pulls their bytes.
struct Producer<'a> {
    g: &'a GgufFile,
    file: RefCell<File>,
    dtype: OutDtype,
    /// The first failure; later tensors are skipped and the import fails once writing ends.
    error: RefCell<Option<Error>>,
    progress: RefCell<ProgressSink<'a>>,
}

/// The running totals and the caller's callback.
struct ProgressSink<'a> {
    state: ImportProgress,
    callback: &'a mut dyn FnMut(&ImportProgress),
}

impl Producer<'_> {
    fn produce(&self, plan: &Plan) -> Vec<u8> {
        if self.error.borrow().is_some() {
            return vec![0; plan.out_bytes];
        }
        match self.convert(plan) {
            Ok(bytes) => {
                let mut sink = self.progress.borrow_mut();
                let ProgressSink { state, callback } = &mut *sink;
                state.tensors_done += 1;
                state.bytes_done += plan.out_bytes as u64;
                state.current.clone_from(&plan.hf_name);
                callback(state);
                bytes
            }
            Err(e) => {
                *self.error.borrow_mut() = Some(e);
                vec![0; plan.out_bytes]
            }
        }
    }

    fn convert(&self, plan: &Plan) -> Result<Vec<u8>> {
        let info = &self.g.tensors()[plan.gguf_index];
        let raw = self
            .g
            .read_tensor_bytes(&mut self.file.borrow_mut(), info)?;
        let n: usize = plan.shape.iter().product();
        let mut values = vec![0f32; n];
        dequantize(info.ggml_type, &raw, &mut values)
            .map_err(|r| self.g.error(format!("tensor {}: {r}", info.name)))?;
        drop(raw);
        if let Permute::Heads(heads) = plan.permute {
            let cols = plan.shape.get(1).copied().unwrap_or(1);
            values = llama::unpermute_rows(&values, heads, cols);
        }
        let mut out = Vec::with_capacity(plan.out_bytes);
        match self.dtype {
            OutDtype::F32 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            OutDtype::Bf16 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        }
        Ok(out)
    }
}

/// A tensor whose bytes are produced when safetensors asks for them.
struct LazyTensor<'a> {
    producer: &'a Producer<'a>,
    plan: &'a Plan,
}

impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        match self.producer.dtype {
            OutDtype::F32 => Dtype::F32,
            OutDtype::Bf16 => Dtype::BF16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.plan.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.producer.produce(self.plan))
    }

    fn data_len(&self) -> usize {
        self.plan.out_bytes
    }
}

fn write_weights(
    g: &GgufFile,
    plans: &[Plan],
    dtype: OutDtype,
    path: &Path,
    progress: &mut dyn FnMut(&ImportProgress),
) -> Result<()> {
    let file = File::open(g.path())
        .map_err(|e| Error::io(format!("opening {}", g.path().display()), e))?;
    let start = ImportProgress {
        tensors_done: 0,
        tensors_total: plans.len(),
        bytes_done: 0,
        bytes_total: plans.iter().map(|p| p.out_bytes as u64).sum(),
        current: String::new(),
    };
    progress(&start);
    let producer = Producer {
        g,
        file: RefCell::new(file),
        dtype,
        error: RefCell::new(None),
        progress: RefCell::new(ProgressSink {
            state: start,
            callback: progress,
        }),
    };
    let views = plans.iter().map(|plan| {
        (
            plan.hf_name.clone(),
            LazyTensor {
                producer: &producer,
                plan,
            },
        )
    });
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let written = safetensors::serialize_to_file(views, Some(metadata), path);
    if let Some(e) = producer.error.borrow_mut().take() {
        return Err(e);
    }
    written.map_err(|e| Error::Weights {
        path: path.to_path_buf(),
        reason: format!("writing failed: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgmlType;
    use crate::gguf::reader::MetaValue;
    use crate::gguf::test_util::{
        GgufBuilder, TestTensor, permute_forward, quantize_q4_1, quantize_q8_0, tiny_tokenizer,
    };
    use rand::{Rng, SeedableRng};
    use std::str::FromStr;

    const HIDDEN: usize = 64;
    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 16;
    const FFN: usize = 96;
    const LAYERS: usize = 2;

    /// A synthetic 2-layer Llama: each tensor's HF-order values and the GGUF tensor holding them.
    struct Synthetic {
        builder: GgufBuilder,
        /// HF name → (HF shape, exact values the import must write).
        expect: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
        tokens: Vec<String>,
    }

    #[derive(Clone, Copy)]
    enum Enc {
        F32,
        Q8_0,
        Q4_1,
    }

    fn synthetic(seed: u64, untied: bool) -> Synthetic {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut b = GgufBuilder::new(3);
        b.kv("general.architecture", MetaValue::Str("llama".into()));
        b.kv("llama.block_count", MetaValue::U32(LAYERS as u32));
        b.kv("llama.context_length", MetaValue::U32(512));
        b.kv("llama.embedding_length", MetaValue::U32(HIDDEN as u32));
        b.kv("llama.feed_forward_length", MetaValue::U32(FFN as u32));
        b.kv("llama.attention.head_count", MetaValue::U32(HEADS as u32));
        b.kv(
            "llama.attention.head_count_kv",
            MetaValue::U32(KV_HEADS as u32),
        );
        b.kv("llama.rope.freq_base", MetaValue::F32(100_000.0));
        b.kv(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        );
        b.kv(
            "llama.rope.dimension_count",
            MetaValue::U32(HEAD_DIM as u32),
        );
        let tokens = tiny_tokenizer(&mut b, false, "smollm");
        let vocab = tokens.len();
        let mut expect = BTreeMap::new();
        let mut add = |b: &mut GgufBuilder,
                       gguf: &str,
                       hf: &str,
                       shape: Vec<usize>,
                       enc: Enc,
                       heads: Option<usize>| {
            let n: usize = shape.iter().product();
            let hf_values: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let cols = *shape.last().unwrap();
            // llama.cpp stores q/k with rows permuted; quantization blocks lie within rows, so
            // permuting rows commutes with quantizing.
            let stored = match heads {
                Some(h) => permute_forward(&hf_values, h, cols),
                None => hf_values.clone(),
            };
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            let (tensor, exact_stored) = match enc {
                Enc::F32 => (TestTensor::f32(gguf, &dims, &stored), stored.clone()),
                Enc::Q8_0 => {
                    let (bytes, ex) = quantize_q8_0(&stored);
                    (TestTensor::raw(gguf, &dims, GgmlType::Q8_0.0, bytes), ex)
                }
                Enc::Q4_1 => {
                    let (bytes, ex) = quantize_q4_1(&stored);
                    (TestTensor::raw(gguf, &dims, GgmlType::Q4_1.0, bytes), ex)
                }
            };
            b.tensor(tensor);
            // The exact HF values: the stored exact values with rows put back in HF order.
            let exact_hf = match heads {
                Some(h) => {
                    let (bytes, ex) = match enc {
                        Enc::F32 => (vec![], hf_values.clone()),
                        Enc::Q8_0 => quantize_q8_0(&hf_values),
                        Enc::Q4_1 => quantize_q4_1(&hf_values),
                    };
                    drop(bytes);
                    assert_eq!(permute_forward(&ex, h, cols), exact_stored);
                    ex
                }
                None => exact_stored,
            };
            expect.insert(hf.to_string(), (shape, exact_hf));
        };
        add(
            &mut b,
            "token_embd.weight",
            "model.embed_tokens.weight",
            vec![vocab, HIDDEN],
            Enc::Q8_0,
            None,
        );
        add(
            &mut b,
            "output_norm.weight",
            "model.norm.weight",
            vec![HIDDEN],
            Enc::F32,
            None,
        );
        if untied {
            add(
                &mut b,
                "output.weight",
                "lm_head.weight",
                vec![vocab, HIDDEN],
                Enc::Q4_1,
                None,
            );
        }
        for l in 0..LAYERS {
            let layer = |p: &str| format!("blk.{l}.{p}.weight");
            let hf = |p: &str| format!("model.layers.{l}.{p}.weight");
            let q = HEADS * HEAD_DIM;
            let kv = KV_HEADS * HEAD_DIM;
            add(
                &mut b,
                &layer("attn_norm"),
                &hf("input_layernorm"),
                vec![HIDDEN],
                Enc::F32,
                None,
            );
            add(
                &mut b,
                &layer("attn_q"),
                &hf("self_attn.q_proj"),
                vec![q, HIDDEN],
                Enc::Q4_1,
                Some(HEADS),
            );
            add(
                &mut b,
                &layer("attn_k"),
                &hf("self_attn.k_proj"),
                vec![kv, HIDDEN],
                Enc::Q8_0,
                Some(KV_HEADS),
            );
            add(
                &mut b,
                &layer("attn_v"),
                &hf("self_attn.v_proj"),
                vec![kv, HIDDEN],
                Enc::F32,
                None,
            );
            add(
                &mut b,
                &layer("attn_output"),
                &hf("self_attn.o_proj"),
                vec![HIDDEN, q],
                Enc::Q4_1,
                None,
            );
            add(
                &mut b,
                &layer("ffn_norm"),
                &hf("post_attention_layernorm"),
                vec![HIDDEN],
                Enc::F32,
                None,
            );
            add(
                &mut b,
                &layer("ffn_gate"),
                &hf("mlp.gate_proj"),
                vec![FFN, HIDDEN],
                Enc::Q8_0,
                None,
            );
            add(
                &mut b,
                &layer("ffn_up"),
                &hf("mlp.up_proj"),
                vec![FFN, HIDDEN],
                Enc::Q4_1,
                None,
            );
            add(
                &mut b,
                &layer("ffn_down"),
                &hf("mlp.down_proj"),
                vec![HIDDEN, FFN],
                Enc::Q8_0,
                None,
            );
        }
        Synthetic {
            builder: b,
            expect,
            tokens,
        }
    }

    fn write_gguf(dir: &Path, b: &GgufBuilder) -> PathBuf {
        let path = dir.join("model.gguf");
        std::fs::write(&path, b.build()).unwrap();
        path
    }

    fn read_json(path: &Path) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn imports_a_synthetic_llama_exactly() {
        for untied in [false, true] {
            let s = synthetic(11, untied);
            let dir = tempfile::tempdir().unwrap();
            let gguf = write_gguf(dir.path(), &s.builder);
            let out = dir.path().join("models").join("tiny");
            let mut reports = Vec::new();
            let summary = import_gguf(&gguf, &out, &ImportOptions::default(), &mut |p| {
                reports.push(p.clone())
            })
            .unwrap();
            assert_eq!(summary.architecture, "llama");
            assert_eq!(summary.num_tensors, s.expect.len());
            let f32_count = summary
                .tensor_types
                .iter()
                .find(|(t, _)| t == "F32")
                .unwrap()
                .1;
            assert_eq!(f32_count, 1 + LAYERS * 3);

            // Progress: starts at zero, counts every tensor once, ends complete.
            assert_eq!(reports.first().unwrap().tensors_done, 0);
            let last = reports.last().unwrap();
            assert_eq!(last.tensors_done, s.expect.len());
            assert_eq!(last.tensors_total, s.expect.len());
            assert_eq!(last.bytes_done, last.bytes_total);
            assert!(
                reports
                    .windows(2)
                    .all(|w| w[1].bytes_done > w[0].bytes_done)
            );

            // Weights: exactly the expected names, shapes and values.
            let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
            names.sort();
            assert_eq!(names, s.expect.keys().cloned().collect::<Vec<_>>());
            for (name, (shape, values)) in &s.expect {
                let t = st.tensor(name).unwrap();
                assert_eq!(t.dtype(), Dtype::F32, "{name}");
                assert_eq!(t.shape(), shape.as_slice(), "{name}");
                let got: Vec<f32> = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                assert_eq!(&got, values, "{name}");
            }

            // Config.
            let c = read_json(&out.join("config.json"));
            assert_eq!(c["architectures"][0], "LlamaForCausalLM");
            assert_eq!(c["num_hidden_layers"], LAYERS);
            assert_eq!(c["num_key_value_heads"], KV_HEADS);
            assert_eq!(c["head_dim"], HEAD_DIM);
            assert_eq!(c["vocab_size"], s.tokens.len());
            assert_eq!(c["tie_word_embeddings"], !untied);
            assert_eq!(c["rope_theta"], 100_000.0);
            assert_eq!(c["max_position_embeddings"], 512);
            assert_eq!(c["bos_token_id"], 1);
            assert_eq!(c["eos_token_id"], 2);
            assert_eq!(c["torch_dtype"], "float32");
            assert_eq!(c["rms_norm_eps"], 1e-5);
            assert_eq!(
                read_json(&out.join("generation_config.json"))["eos_token_id"],
                2
            );

            // Tokenizer files.
            let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
            let enc = tok.encode("<|im_start|>Hello world", false).unwrap();
            let id = |t: &str| s.tokens.iter().position(|x| x == t).unwrap() as u32;
            assert_eq!(enc.get_ids(), &[1, id("Hello"), id("Ġworld")]);
            let tc = read_json(&out.join("tokenizer_config.json"));
            assert_eq!(tc["bos_token"], "<|im_start|>");
            assert!(
                tc["chat_template"]
                    .as_str()
                    .unwrap()
                    .contains("<|im_start|>")
            );

            // Nothing else was left beside the output.
            let leftovers: Vec<_> = std::fs::read_dir(out.parent().unwrap()).unwrap().collect();
            assert_eq!(leftovers.len(), 1);
        }
    }

    #[test]
    fn bf16_output_rounds_the_dequantized_values() {
        let s = synthetic(3, false);
        let dir = tempfile::tempdir().unwrap();
        let gguf = write_gguf(dir.path(), &s.builder);
        let out = dir.path().join("bf");
        import_gguf(
            &gguf,
            &out,
            &ImportOptions {
                out_dtype: OutDtype::Bf16,
            },
            &mut |_| {},
        )
        .unwrap();
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, values) = &s.expect["model.layers.1.self_attn.q_proj.weight"];
        let t = st.tensor("model.layers.1.self_attn.q_proj.weight").unwrap();
        assert_eq!(t.dtype(), Dtype::BF16);
        let got: Vec<u16> = t
            .data()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let want: Vec<u16> = values
            .iter()
            .map(|v| bf16::from_f32(*v).to_bits())
            .collect();
        assert_eq!(got, want);
        assert_eq!(
            read_json(&out.join("config.json"))["torch_dtype"],
            "bfloat16"
        );
    }

    fn import_err(b: &GgufBuilder) -> (String, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let gguf = write_gguf(dir.path(), b);
        let out = dir.path().join("out");
        let err = import_gguf(&gguf, &out, &ImportOptions::default(), &mut |_| {}).unwrap_err();
        assert!(
            !out.exists(),
            "a failed import must not leave the output directory"
        );
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert_eq!(
            names,
            vec!["model.gguf".to_string()],
            "no temporary directory may be left"
        );
        (err.to_string(), dir)
    }

    #[test]
    fn unsupported_type_fails_before_writing_and_names_the_tensor() {
        let mut s = synthetic(5, false);
        s.builder.tensor(TestTensor::raw(
            "blk.1.attn_q_extra.weight",
            &[64],
            0,
            vec![0; 256],
        ));
        let (err, _d) = import_err(&s.builder);
        assert!(
            err.contains("blk.1.attn_q_extra.weight has no Hugging Face Llama counterpart"),
            "{err}"
        );

        // Rebuild with one layer tensor stored as IQ2_XXS (type 16), which tandem cannot convert.
        let s = synthetic(5, false);
        let mut b = GgufBuilder::new(3);
        b.copy_kvs_from(&s.builder);
        for t in s.builder.tensors() {
            if t.name == "blk.0.ffn_up.weight" {
                b.tensor(TestTensor::raw(
                    &t.name,
                    &t.dims,
                    16,
                    vec![0; 66 * FFN * HIDDEN / 256],
                ));
            } else {
                b.tensor(TestTensor::raw(&t.name, &t.dims, t.type_id, t.data.clone()));
            }
        }
        let (err, _d) = import_err(&b);
        assert!(
            err.contains("tensor blk.0.ffn_up.weight has type IQ2_XXS which tandem cannot convert"),
            "{err}"
        );
    }

    #[test]
    fn missing_and_misshapen_tensors_are_errors() {
        let s = synthetic(9, false);
        let rebuild = |skip: &str, replace: Option<TestTensor>| {
            let mut b = GgufBuilder::new(3);
            b.copy_kvs_from(&s.builder);
            for t in s.builder.tensors() {
                if t.name != skip {
                    b.tensor(TestTensor::raw(&t.name, &t.dims, t.type_id, t.data.clone()));
                }
            }
            if let Some(r) = replace {
                b.tensor(r);
            }
            b
        };
        let (err, _d) = import_err(&rebuild("blk.1.ffn_norm.weight", None));
        assert!(
            err.contains("model.layers.1.post_attention_layernorm.weight"),
            "{err}"
        );
        let wrong = TestTensor::f32("blk.1.ffn_norm.weight", &[32], &[0.0; 32]);
        let (err, _d) = import_err(&rebuild("blk.1.ffn_norm.weight", Some(wrong)));
        assert!(
            err.contains("blk.1.ffn_norm.weight has shape [32]"),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_non_empty_output_directory() {
        let s = synthetic(1, false);
        let dir = tempfile::tempdir().unwrap();
        let gguf = write_gguf(dir.path(), &s.builder);
        let out = dir.path().join("taken");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("keep.txt"), "mine").unwrap();
        let err = import_gguf(&gguf, &out, &ImportOptions::default(), &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("not empty"), "{err}");
        assert_eq!(
            std::fs::read_to_string(out.join("keep.txt")).unwrap(),
            "mine"
        );
        // An empty directory is fine.
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        import_gguf(&gguf, &empty, &ImportOptions::default(), &mut |_| {}).unwrap();
        assert!(empty.join("model.safetensors").is_file());
    }

    #[test]
    fn corrupted_metadata_never_panics_the_import() {
        let clean = synthetic(21, false).builder.build();
        // Corrupt only the header and metadata region, where values steer the conversion.
        let header_len = clean.len() / 4;
        let mut rng = rand::rngs::SmallRng::seed_from_u64(99);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.gguf");
        let mut imported = 0;
        for i in 0..120 {
            let mut bytes = clean.clone();
            let at = rng.random_range(0..header_len);
            bytes[at] = rng.random();
            std::fs::write(&path, &bytes).unwrap();
            let out = dir.path().join(format!("out{i}"));
            if import_gguf(&path, &out, &ImportOptions::default(), &mut |_| {}).is_ok() {
                imported += 1;
                assert!(out.join("model.safetensors").is_file());
            } else {
                assert!(!out.exists());
            }
        }
        assert!(imported < 120, "some corruptions must be detected");
    }

    #[test]
    fn absurd_layer_count_is_refused() {
        let mut s = synthetic(2, false);
        let mut b = GgufBuilder::new(3);
        for (k, v) in s.builder.kvs() {
            if k == "llama.block_count" {
                b.kv(k, MetaValue::U64(1 << 40));
            } else {
                b.kv(k, v.clone());
            }
        }
        for t in s.builder.tensors() {
            b.tensor(TestTensor::raw(&t.name, &t.dims, t.type_id, t.data.clone()));
        }
        s.builder = b;
        let (err, _d) = import_err(&s.builder);
        assert!(err.contains("llama.block_count is 1099511627776"), "{err}");
    }

    #[test]
    fn other_architectures_are_refused() {
        let mut b = GgufBuilder::new(3);
        b.kv("general.architecture", MetaValue::Str("mamba".into()));
        let (err, _d) = import_err(&b);
        assert!(
            err.contains("architecture \"mamba\" is not supported"),
            "{err}"
        );
    }

    /// Imports the real SmolLM2 GGUF when `TANDEM_TEST_GGUF` points at it.
    #[test]
    fn imports_the_real_smollm2_gguf() {
        let Some(path) = std::env::var_os("TANDEM_TEST_GGUF") else {
            eprintln!(
                "skipping: set TANDEM_TEST_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf to run this test"
            );
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("smollm2");
        let mut last = None;
        let summary = import_gguf(
            Path::new(&path),
            &out,
            &ImportOptions::default(),
            &mut |p| last = Some(p.clone()),
        )
        .unwrap();
        assert_eq!(summary.architecture, "llama");
        assert_eq!(last.unwrap().tensors_done, summary.num_tensors);
        let c = read_json(&out.join("config.json"));
        assert_eq!(c["num_hidden_layers"], 30);
        assert_eq!(c["hidden_size"], 576);
        assert_eq!(c["num_attention_heads"], 9);
        assert_eq!(c["num_key_value_heads"], 3);
        assert_eq!(c["head_dim"], 64);
        assert_eq!(c["vocab_size"], 49152);
        assert_eq!(c["tie_word_embeddings"], true);
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for l in 0..30 {
            for part in [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "mlp.down_proj",
                "input_layernorm",
            ] {
                assert!(
                    st.tensor(&format!("model.layers.{l}.{part}.weight"))
                        .is_ok(),
                    "layer {l} {part}"
                );
            }
        }
        assert_eq!(
            st.tensor("model.layers.0.self_attn.k_proj.weight")
                .unwrap()
                .shape(),
            &[192, 576]
        );
        assert_eq!(
            st.tensor("model.embed_tokens.weight").unwrap().shape(),
            &[49152, 576]
        );
        let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        // The ids transformers' GGUF tokenizer gives for this text.
        assert_eq!(
            tok.encode("Hello, world!", false).unwrap().get_ids(),
            &[19556, 28, 905, 17]
        );
        let chat = "<|im_start|>user\nHi<|im_end|>";
        let ids = tok.encode(chat, false).unwrap().get_ids().to_vec();
        assert_eq!(ids.first(), Some(&1));
        assert_eq!(ids.last(), Some(&2));
        assert_eq!(tok.decode(&ids, false).unwrap(), chat);
        let tc = read_json(&out.join("tokenizer_config.json"));
        assert_eq!(tc["eos_token"], "<|im_end|>");
        assert!(
            tc["chat_template"]
                .as_str()
                .unwrap()
                .contains("<|im_start|>")
        );
        let _ = tokenizers::Tokenizer::from_str(
            &std::fs::read_to_string(out.join("tokenizer.json")).unwrap(),
        );
    }
}
