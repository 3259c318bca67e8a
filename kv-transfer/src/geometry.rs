//! What a block pool looks like: model, dtype, block size, layers, KV heads, head dim and layout. Two
//! connectors may exchange blocks only if their geometries are equal; [`Geometry::check_compatible`]
//! is the handshake's verdict and names every field that differs.
//!
//! Invariant: a `Geometry` is validated at construction (every dimension > 0, model id non-empty and at
//! most [`MAX_MODEL_ID`] bytes), so `block_bytes` never overflows or returns 0.

use crate::error::{Error, Result};

/// Longest model id carried in a handshake.
pub(crate) const MAX_MODEL_ID: usize = 256;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float (tandem's CPU engine).
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        match code {
            1 => Some(DType::F32),
            2 => Some(DType::F16),
            3 => Some(DType::BF16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// How one block of one layer is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[K, V][kv_heads][block_size][head_dim]`, one contiguous slice per (layer, block): the layout of
    /// `tandem_engine::model::KvCache`.
    KvHeadTokenDim,
}

impl Layout {
    pub(crate) fn code(self) -> u8 {
        match self {
            Layout::KvHeadTokenDim => 1,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Layout> {
        match code {
            1 => Some(Layout::KvHeadTokenDim),
            _ => None,
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Layout::KvHeadTokenDim => "[K,V][kv_heads][block_size][head_dim]",
        })
    }
}

/// The shape of a KV block pool, as both sides of a transfer must agree on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Geometry {
    model_id: String,
    dtype: DType,
    block_size: u32,
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    layout: Layout,
}

/// The fields of a [`Geometry`], for construction.
#[derive(Debug, Clone)]
pub struct GeometrySpec {
    /// Identifies the weights (two different models must never exchange KV).
    pub model_id: String,
    /// Element type.
    pub dtype: DType,
    /// Tokens per block.
    pub block_size: u32,
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Memory layout of a block.
    pub layout: Layout,
}

impl Geometry {
    /// Validates and builds a geometry.
    pub fn new(spec: GeometrySpec) -> Result<Geometry> {
        if spec.model_id.is_empty() || spec.model_id.len() > MAX_MODEL_ID {
            return Err(Error::Invalid(format!(
                "model id must be 1..={MAX_MODEL_ID} bytes, got {}",
                spec.model_id.len()
            )));
        }
        for (name, v) in [
            ("block_size", spec.block_size),
            ("num_layers", spec.num_layers),
            ("num_kv_heads", spec.num_kv_heads),
            ("head_dim", spec.head_dim),
        ] {
            if v == 0 {
                return Err(Error::Invalid(format!("{name} must be > 0")));
            }
        }
        // 2 (K,V) * heads * tokens * dim * dtype must fit comfortably in a u64 and in usize.
        let bytes = 2u128
            * u128::from(spec.num_kv_heads)
            * u128::from(spec.block_size)
            * u128::from(spec.head_dim)
            * spec.dtype.size() as u128;
        if bytes > (1u128 << 40) {
            return Err(Error::Invalid(format!("a block of {bytes} bytes is not plausible")));
        }
        Ok(Geometry {
            model_id: spec.model_id,
            dtype: spec.dtype,
            block_size: spec.block_size,
            num_layers: spec.num_layers,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            layout: spec.layout,
        })
    }

    /// The model id.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Layers.
    pub fn num_layers(&self) -> u32 {
        self.num_layers
    }
    /// KV heads.
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }
    /// Head dimension.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Block layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Bytes of one block of one layer (K and V).
    pub fn block_bytes(&self) -> usize {
        2 * self.num_kv_heads as usize * self.block_size as usize * self.head_dim as usize * self.dtype.size()
    }

    /// `Ok` when `peer` can exchange blocks with `self`; otherwise an [`Error::Incompatible`] naming every
    /// field that differs, ours first.
    pub fn check_compatible(&self, peer: &Geometry) -> Result<()> {
        let mut diffs = Vec::new();
        if self.model_id != peer.model_id {
            diffs.push(format!("model {:?} != {:?}", self.model_id, peer.model_id));
        }
        if self.dtype != peer.dtype {
            diffs.push(format!("dtype {} != {}", self.dtype, peer.dtype));
        }
        for (name, a, b) in [
            ("block_size", self.block_size, peer.block_size),
            ("num_layers", self.num_layers, peer.num_layers),
            ("num_kv_heads", self.num_kv_heads, peer.num_kv_heads),
            ("head_dim", self.head_dim, peer.head_dim),
        ] {
            if a != b {
                diffs.push(format!("{name} {a} != {b}"));
            }
        }
        if self.layout != peer.layout {
            diffs.push(format!("layout {} != {}", self.layout, peer.layout));
        }
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(Error::Incompatible(diffs.join(", ")))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn small(model: &str) -> Geometry {
        Geometry::new(GeometrySpec {
            model_id: model.into(),
            dtype: DType::F32,
            block_size: 4,
            num_layers: 3,
            num_kv_heads: 2,
            head_dim: 8,
            layout: Layout::KvHeadTokenDim,
        })
        .unwrap()
    }

    #[test]
    fn block_bytes_counts_k_and_v() {
        assert_eq!(small("m").block_bytes(), 2 * 2 * 4 * 8 * 4);
    }

    #[test]
    fn mismatch_names_every_field() {
        let a = small("a");
        let mut spec = GeometrySpec {
            model_id: "b".into(),
            dtype: DType::BF16,
            block_size: 16,
            num_layers: 3,
            num_kv_heads: 2,
            head_dim: 8,
            layout: Layout::KvHeadTokenDim,
        };
        let err = a.check_compatible(&Geometry::new(spec.clone()).unwrap()).unwrap_err().to_string();
        assert!(err.contains("model \"a\" != \"b\""), "{err}");
        assert!(err.contains("dtype f32 != bf16"), "{err}");
        assert!(err.contains("block_size 4 != 16"), "{err}");
        assert!(!err.contains("num_layers"), "{err}");
        spec.model_id = "a".into();
        spec.dtype = DType::F32;
        spec.block_size = 4;
        assert!(a.check_compatible(&Geometry::new(spec).unwrap()).is_ok());
    }

    #[test]
    fn invalid_specs_are_refused() {
        let ok = GeometrySpec {
            model_id: "m".into(),
            dtype: DType::F16,
            block_size: 16,
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            layout: Layout::KvHeadTokenDim,
        };
        assert!(Geometry::new(ok.clone()).is_ok());
        assert!(Geometry::new(GeometrySpec { model_id: String::new(), ..ok.clone() }).is_err());
        assert!(Geometry::new(GeometrySpec { block_size: 0, ..ok.clone() }).is_err());
        assert!(Geometry::new(GeometrySpec { head_dim: u32::MAX, num_kv_heads: u32::MAX, ..ok }).is_err());
    }
}
