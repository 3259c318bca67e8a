//! Test-only helpers: a small GGUF writer and reference quantizers, so tests can build GGUF files
//! with known contents (including broken ones) without shipping binary fixtures.
//!
//! Invariant: the writer lays files out exactly as the format says (header, metadata, tensor infos,
//! padding to the alignment, tensors each padded to the alignment), with no trailing padding after
//! the last tensor, so truncation tests cut real data.

use half::f16;

use super::ggml_type::GgmlType;
use super::reader::MetaValue;
use super::tokenizer::byte_alphabet;

/// One tensor to write.
pub(crate) struct TestTensor {
    pub(crate) name: String,
    pub(crate) dims: Vec<u64>,
    pub(crate) type_id: u32,
    pub(crate) data: Vec<u8>,
}

impl TestTensor {
    /// An F32 tensor; `dims` innermost first.
    pub(crate) fn f32(name: &str, dims: &[u64], values: &[f32]) -> Self {
        assert_eq!(dims.iter().product::<u64>() as usize, values.len());
        Self::raw(
            name,
            dims,
            GgmlType::F32.0,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    /// A tensor with the given type id and raw bytes.
    pub(crate) fn raw(name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        Self {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            data,
        }
    }
}

/// Builds a GGUF file in memory.
pub(crate) struct GgufBuilder {
    pub(crate) version: u32,
    pub(crate) alignment: usize,
    kvs: Vec<(String, MetaValue)>,
    tensors: Vec<TestTensor>,
    offset_overrides: Vec<(String, u64)>,
}

impl GgufBuilder {
    pub(crate) fn new(version: u32) -> Self {
        Self {
            version,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
            offset_overrides: Vec::new(),
        }
    }

    pub(crate) fn kv(&mut self, key: &str, value: MetaValue) {
        self.kvs.push((key.to_string(), value));
    }

    pub(crate) fn tensor(&mut self, t: TestTensor) {
        self.tensors.push(t);
    }

    /// Copies every metadata entry of `other`.
    pub(crate) fn copy_kvs_from(&mut self, other: &GgufBuilder) {
        self.kvs.extend(other.kvs.iter().cloned());
    }

    /// The metadata entries added so far.
    pub(crate) fn kvs(&self) -> &[(String, MetaValue)] {
        &self.kvs
    }

    /// The tensors added so far.
    pub(crate) fn tensors(&self) -> &[TestTensor] {
        &self.tensors
    }

    /// Writes `offset` as the tensor's data offset instead of the real one.
    pub(crate) fn override_offset(&mut self, name: &str, offset: u64) {
        self.offset_overrides.push((name.to_string(), offset));
    }

    pub(crate) fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let align = self.alignment;
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            offsets.push(offset);
            offset = (offset + t.data.len()).div_ceil(align) * align;
        }
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            let off = self
                .offset_overrides
                .iter()
                .find(|(n, _)| *n == t.name)
                .map_or(off as u64, |(_, o)| *o);
            out.extend_from_slice(&off.to_le_bytes());
        }
        let data_start = out.len().div_ceil(align) * align;
        out.resize(data_start, 0);
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::Str(s) => put_str(out, s),
        MetaValue::Array(items) => {
            // An empty array's element type is arbitrary; use u8.
            let elem = items.first().map_or(0, type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

/// Quantizes to Q8_0 the simple way (scale = max|x|/127, round to nearest). Returns the bytes and
/// the exact values a correct dequantizer must produce from them.
pub(crate) fn quantize_q8_0(values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut expect = Vec::new();
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0);
        let df = d.to_f32();
        bytes.extend_from_slice(&d.to_le_bytes());
        for &v in block {
            let q = if df == 0.0 {
                0
            } else {
                (v / df).round().clamp(-127.0, 127.0) as i8
            };
            bytes.push(q as u8);
            expect.push(f32::from(q) * df);
        }
    }
    (bytes, expect)
}

/// Quantizes to Q4_1 (scale = (max-min)/15, minimum = min). Returns bytes and exact expected values.
pub(crate) fn quantize_q4_1(values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut expect = Vec::new();
    for block in values.chunks(32) {
        let max = block.iter().copied().fold(f32::MIN, f32::max);
        let min = block.iter().copied().fold(f32::MAX, f32::min);
        let d = f16::from_f32((max - min) / 15.0);
        let m = f16::from_f32(min);
        let (df, mf) = (d.to_f32(), m.to_f32());
        bytes.extend_from_slice(&d.to_le_bytes());
        bytes.extend_from_slice(&m.to_le_bytes());
        let q: Vec<u8> = block
            .iter()
            .map(|&v| {
                if df == 0.0 {
                    0
                } else {
                    ((v - mf) / df).round().clamp(0.0, 15.0) as u8
                }
            })
            .collect();
        for j in 0..16 {
            bytes.push(q[j] | (q[j + 16] << 4));
        }
        expect.extend(q.iter().map(|&q| f32::from(q) * df + mf));
    }
    (bytes, expect)
}

/// A tiny byte-level vocabulary: all 256 byte symbols, a few merges, and ChatML specials.
pub(crate) fn tiny_tokenizer(b: &mut GgufBuilder, add_bos: bool, pre: &str) -> Vec<String> {
    let alphabet = byte_alphabet();
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    tokens.extend(alphabet.iter().map(|c| c.to_string()));
    let merges = [
        "H e", "l l", "He ll", "Hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld",
    ];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    tokens.push("<think>".into());
    let mut types = vec![3i32, 3, 3];
    types.extend(std::iter::repeat_n(1, 256 + merges.len()));
    types.push(4);
    b.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
    b.kv("tokenizer.ggml.pre", MetaValue::Str(pre.into()));
    b.kv(
        "tokenizer.ggml.tokens",
        MetaValue::Array(tokens.iter().map(|t| MetaValue::Str(t.clone())).collect()),
    );
    b.kv(
        "tokenizer.ggml.token_type",
        MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
    );
    b.kv(
        "tokenizer.ggml.merges",
        MetaValue::Array(
            merges
                .iter()
                .map(|m| MetaValue::Str((*m).to_string()))
                .collect(),
        ),
    );
    b.kv("tokenizer.ggml.bos_token_id", MetaValue::U32(1));
    b.kv("tokenizer.ggml.eos_token_id", MetaValue::U32(2));
    b.kv("tokenizer.ggml.add_bos_token", MetaValue::Bool(add_bos));
    b.kv(
        "tokenizer.chat_template",
        MetaValue::Str("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".into()),
    );
    tokens
}

/// llama.cpp's forward permutation (HF → GGUF), written from its description: view the rows of
/// each head as `[2, head_dim/2]` and swap the two axes.
pub(crate) fn permute_forward(hf: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = hf.len() / cols;
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(hf.len());
    for h in 0..n_heads {
        // After the swap the head's rows are indexed [half][2]: row (i, j) comes from (j, i).
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + j * half + i;
                out.extend_from_slice(&hf[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}
