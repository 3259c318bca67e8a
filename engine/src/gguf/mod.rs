//! GGUF → Hugging Face model directory conversion.
//!
//! [`import_gguf`] reads a llama.cpp GGUF file (our own bounds-checked [`reader`]), dequantizes its
//! tensors, renames them to Hugging Face Llama names (undoing llama.cpp's q/k row permutation), and
//! writes `model.safetensors`, `config.json`, `generation_config.json`, `tokenizer.json` and
//! `tokenizer_config.json` into a directory the rest of the engine loads like any HF checkout.
//!
//! Invariants:
//! - Everything that can be checked before writing is checked first (metadata, tensor names,
//!   shapes, types, extents, the tokenizer); a bad file fails before any output exists.
//! - Output goes to a temporary directory beside `out_dir` that is renamed into place only when
//!   complete, and removed on failure: a failed import never leaves a directory that looks valid.
//! - Peak memory is about two copies of the largest tensor, not the whole model.

mod dequant;
pub mod ggml_type;
mod import;
mod llama;
pub mod reader;
#[cfg(test)]
mod test_util;
mod tokenizer;

use std::path::PathBuf;

pub use ggml_type::GgmlType;
pub use import::import_gguf;
#[doc(hidden)]
pub use import::{CheckedImport, check_import};
pub use reader::{GgufFile, MetaValue, TensorInfo};

/// Element type of the written safetensors weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutDtype {
    /// 32-bit floats: exactly the dequantized values.
    #[default]
    F32,
    /// bfloat16, rounded to nearest even from the dequantized f32 values.
    Bf16,
}

impl OutDtype {
    /// The `torch_dtype` string for config.json.
    pub fn torch_name(self) -> &'static str {
        match self {
            OutDtype::F32 => "float32",
            OutDtype::Bf16 => "bfloat16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            OutDtype::F32 => 4,
            OutDtype::Bf16 => 2,
        }
    }
}

/// Options for [`import_gguf`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// Element type of the written weights.
    pub out_dtype: OutDtype,
}

/// Progress of a running import, reported after each tensor (and once before the first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportProgress {
    /// Tensors written so far.
    pub tensors_done: usize,
    /// Tensors to write in all.
    pub tensors_total: usize,
    /// Output bytes written so far.
    pub bytes_done: u64,
    /// Output bytes to write in all.
    pub bytes_total: u64,
    /// The HF name of the tensor just written (empty before the first).
    pub current: String,
}

/// What an import produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSummary {
    /// The model directory written.
    pub out_dir: PathBuf,
    /// The GGUF's `general.architecture`.
    pub architecture: String,
    /// Tensors written to `model.safetensors`.
    pub num_tensors: usize,
    /// GGUF tensor type name → how many tensors of the file had it, sorted by name.
    pub tensor_types: Vec<(String, usize)>,
}
