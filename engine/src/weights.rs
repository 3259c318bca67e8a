//! Weights from a Hugging Face-style directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; tensors are converted to f32 on load
//! (F32, BF16 and F16 on disk).
//!
//! Invariant: every header is validated when the store opens, so a corrupt file fails before any
//! tensor is read; a missing tensor or a wrong shape is an [`Error::Weights`] naming both.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::{Error, Result};

/// The memory-mapped safetensors files of one model and where each tensor lives.
pub struct WeightStore {
    files: Vec<(PathBuf, Mmap)>,
    location: HashMap<String, usize>,
}

impl WeightStore {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let paths = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_paths(dir, &index)?
        } else {
            return Err(Error::ModelDir {
                path: dir.to_path_buf(),
                reason: "has neither model.safetensors nor model.safetensors.index.json".into(),
            });
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut location = HashMap::new();
        for path in paths {
            let file = File::open(&path).map_err(|e| weights_err(&path, format!("cannot open: {e}")))?;
            // SAFETY: the map is read-only and tandem never writes model files while serving; a
            // concurrent external truncation is the documented hazard of memory-mapping weights.
            #[allow(unsafe_code)]
            let map = unsafe { Mmap::map(&file) }.map_err(|e| weights_err(&path, format!("cannot map: {e}")))?;
            let tensors = SafeTensors::deserialize(&map).map_err(|e| weights_err(&path, format!("bad safetensors file: {e}")))?;
            for name in tensors.names() {
                location.insert(name.to_string(), files.len());
            }
            files.push((path, map));
        }
        Ok(WeightStore { files, location })
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// Reads tensor `name` as f32, checking it has exactly `shape`.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let Some(&i) = self.location.get(name) else {
            let path = self.files.first().map(|(p, _)| p.clone()).unwrap_or_default();
            return Err(weights_err(&path, format!("missing tensor {name}")));
        };
        let (path, map) = &self.files[i];
        let tensors = SafeTensors::deserialize(map).map_err(|e| weights_err(path, e.to_string()))?;
        let view = tensors.tensor(name).map_err(|e| weights_err(path, e.to_string()))?;
        if view.shape() != shape {
            return Err(weights_err(path, format!("tensor {name} has shape {:?}, expected {shape:?}", view.shape())));
        }
        let bytes = view.data();
        let out = match view.dtype() {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => return Err(weights_err(path, format!("tensor {name} has dtype {other:?} (supported: F32, BF16, F16)"))),
        };
        Ok(out)
    }
}

fn shard_paths(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| weights_err(index, format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| weights_err(index, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| weights_err(index, "no weight_map object".into()))?;
    let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    if names.is_empty() {
        return Err(weights_err(index, "weight_map names no files".into()));
    }
    names
        .into_iter()
        .map(|n| {
            if n.contains('/') || n.contains("..") {
                return Err(weights_err(index, format!("shard name {n:?} must be a plain file name")));
            }
            Ok(dir.join(n))
        })
        .collect()
}

fn weights_err(path: &Path, reason: String) -> Error {
    Error::Weights { path: path.to_path_buf(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn reads_f32_bf16_f16_and_shards() {
        let dir = tempfile::tempdir().unwrap();
        let f32s: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf16s: Vec<u8> = [0.25f32, 3.0].iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
        let f16s: Vec<u8> = [-0.5f32].iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
        write(&dir.path().join("a.safetensors"), &[("x", Dtype::F32, vec![2], f32s), ("y", Dtype::BF16, vec![1, 2], bf16s)]);
        write(&dir.path().join("b.safetensors"), &[("z", Dtype::F16, vec![1], f16s)]);
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#,
        )
        .unwrap();
        let store = WeightStore::open(dir.path()).unwrap();
        assert_eq!(store.f32("x", &[2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(store.f32("y", &[1, 2]).unwrap(), vec![0.25, 3.0]);
        assert_eq!(store.f32("z", &[1]).unwrap(), vec![-0.5]);
        assert!(store.f32("x", &[3]).unwrap_err().to_string().contains("shape [2], expected [3]"));
        assert!(store.f32("w", &[1]).unwrap_err().to_string().contains("missing tensor w"));
    }

    #[test]
    fn corrupt_header_and_missing_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(WeightStore::open(dir.path()).err().unwrap().to_string().contains("neither model.safetensors"));
        let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{\"x\":");
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        let err = WeightStore::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("bad safetensors file"), "{err}");
    }
}
