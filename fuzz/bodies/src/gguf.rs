//! Target `gguf`: the GGUF reader (`engine/src/gguf/reader.rs`: header, metadata, tensor infos) and
//! everything the importer checks before it writes (`tandem_engine::gguf::check_import`: hyper-parameters,
//! tensor mapping, the tokenizer rebuilt from GGUF metadata, dequantization of the tensor bytes).
//!
//! Invariants asserted:
//! - parsing keeps at most 48 bytes live per input byte (plus 64 KiB): no count or length read from the
//!   file sizes an allocation before it is checked against the bytes left;
//! - a file that parses re-encodes to a file that parses to the same header: same version, data offset,
//!   alignment, tensor directory and metadata (compared through their encoding, so NaNs compare equal),
//!   and every convertible tensor lies inside the file at an aligned offset;
//! - a file the importer accepts yields a `config.json` the engine loads and a `tokenizer.json` (with
//!   its `tokenizer_config.json`) the engine's tokenizer loads.

use std::path::Path;

use tandem_engine::config::ModelConfig;
use tandem_engine::gguf::{GgufFile, ImportOptions, MetaValue, TensorInfo, check_import};
use tandem_engine::tokenizer::{Tokenizer, TokenizerFiles};

use crate::alloc;

/// Tensor bytes dequantized per input at most (the fuzzer's inputs are small anyway).
const MAX_DEQUANT_BYTES: usize = 1 << 20;

/// The target.
pub fn run(data: &[u8]) {
    let path = Path::new("<fuzz input>");
    let parsed = alloc::bounded("GgufFile::from_bytes", data.len(), 48, 64 << 10, || GgufFile::from_bytes(data, path));
    let Ok(g) = parsed else { return };
    check_extents(&g, data.len() as u64);

    // Re-encoding: header fields are fixed-size, so the encoding has the same length and data offset.
    let data_section = data.get(g.data_offset() as usize..).unwrap_or(&[]);
    let again = encode(&g, data_section);
    let g2 = match GgufFile::from_bytes(&again, path) {
        Ok(g2) => g2,
        Err(e) => panic!("a GGUF that parsed does not parse after re-encoding: {e}"),
    };
    assert_eq!(g2.version(), g.version(), "version");
    assert_eq!(g2.alignment(), g.alignment(), "alignment");
    assert_eq!(g2.data_offset(), g.data_offset(), "data offset");
    assert_eq!(g2.tensors(), g.tensors(), "tensor directory");
    assert!(encode(&g2, data_section) == again, "metadata changed on re-encoding");

    let Ok(imported) = check_import(data, &ImportOptions::default(), MAX_DEQUANT_BYTES) else { return };
    if let Err(e) = ModelConfig::from_json(&imported.config_json) {
        panic!("the importer accepted a GGUF whose config.json does not load: {e}\n{}", imported.config_json);
    }
    let files = TokenizerFiles {
        tokenizer_json: imported.tokenizer_json,
        tokenizer_config_json: Some(imported.tokenizer_config_json),
        chat_template_jinja: None,
        generation_config_json: None,
        config_json: None,
    };
    if let Err(e) = Tokenizer::from_files(&files) {
        panic!("the importer accepted a GGUF whose tokenizer does not load: {e}");
    }
}

/// Every convertible tensor lies inside the file, at an aligned offset.
fn check_extents(g: &GgufFile, file_len: u64) {
    let a = g.alignment();
    assert!(a.is_power_of_two() && g.data_offset().is_multiple_of(a), "alignment {a}, data offset {}", g.data_offset());
    for t in g.tensors() {
        assert!(t.offset.is_multiple_of(a), "tensor {} at unaligned offset {}", t.name, t.offset);
        assert!((1..=4).contains(&t.dims.len()), "tensor {} has {} dims", t.name, t.dims.len());
        if t.ggml_type.layout().is_some()
            && let Some(len) = t.byte_len()
        {
            let end = g.data_offset().checked_add(t.offset).and_then(|s| s.checked_add(len));
            assert!(end.is_some_and(|e| e <= file_len), "tensor {} extends past the file", t.name);
        }
    }
}

/// Encodes a GGUF file: `g`'s header (metadata in key order, tensors in file order), padding to the
/// alignment, then `data`.
pub fn encode(g: &GgufFile, data: &[u8]) -> Vec<u8> {
    let mut w = Writer::default();
    w.0.extend_from_slice(b"GGUF");
    w.u32(g.version());
    w.u64(g.tensors().len() as u64);
    w.u64(g.metadata().len() as u64);
    for (key, value) in g.metadata() {
        w.str(key);
        w.u32(type_id(value));
        w.value(value);
    }
    for t in g.tensors() {
        w.tensor(t);
    }
    w.pad(g.alignment());
    w.0.extend_from_slice(data);
    w.0
}

/// A GGUF writer (also used to write the seeds).
#[derive(Default, Debug)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// A little-endian u32.
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// A little-endian u64.
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// A GGUF string (u64 length, bytes).
    pub fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }

    /// A metadata key/value.
    pub fn kv(&mut self, key: &str, value: &MetaValue) {
        self.str(key);
        self.u32(type_id(value));
        self.value(value);
    }

    /// A tensor info.
    pub fn tensor(&mut self, t: &TensorInfo) {
        self.str(&t.name);
        self.u32(t.dims.len() as u32);
        for &d in &t.dims {
            self.u64(d);
        }
        self.u32(t.ggml_type.0);
        self.u64(t.offset);
    }

    /// Zero bytes up to a multiple of `alignment`.
    pub fn pad(&mut self, alignment: u64) {
        while !(self.0.len() as u64).is_multiple_of(alignment) {
            self.0.push(0);
        }
    }

    /// A metadata value (without its type).
    pub fn value(&mut self, v: &MetaValue) {
        match v {
            MetaValue::U8(x) => self.0.push(*x),
            MetaValue::I8(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U16(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I16(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U32(x) => self.u32(*x),
            MetaValue::I32(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F32(x) => self.0.extend_from_slice(&x.to_bits().to_le_bytes()),
            MetaValue::Bool(x) => self.0.push(u8::from(*x)),
            MetaValue::Str(s) => self.str(s),
            MetaValue::Array(items) => {
                // An empty array's element type is not kept by the reader: u8 is as good as any.
                self.u32(items.first().map_or(0, type_id));
                self.u64(items.len() as u64);
                for item in items {
                    self.value(item);
                }
            }
            MetaValue::U64(x) => self.u64(*x),
            MetaValue::I64(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F64(x) => self.u64(x.to_bits()),
        }
    }
}

/// The GGUF type id of a value.
pub fn type_id(v: &MetaValue) -> u32 {
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
