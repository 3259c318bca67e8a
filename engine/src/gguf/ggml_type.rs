//! GGML tensor element types as GGUF files number them, and the block layout of the ones tandem
//! can convert.
//!
//! Invariant: [`GgmlType::layout`] returns `Some` exactly for the types that
//! [`crate::gguf::dequant`] can decode, so "has a layout" and "is convertible" never disagree.

use std::fmt;

/// A GGML element type id, as stored in a GGUF tensor info. Unknown ids are kept, not rejected,
/// so that the error can name the tensor that uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

/// How a convertible type packs its elements: `block_elems` elements in `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    /// Elements per block (1 for plain float types).
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

/// Elements in one K-quant super-block.
pub(crate) const QK_K: usize = 256;

impl GgmlType {
    /// 32-bit float.
    pub const F32: Self = Self(0);
    /// IEEE half.
    pub const F16: Self = Self(1);
    /// 4-bit, one f16 scale per 32.
    pub const Q4_0: Self = Self(2);
    /// 4-bit, f16 scale and minimum per 32.
    pub const Q4_1: Self = Self(3);
    /// 5-bit, one f16 scale per 32.
    pub const Q5_0: Self = Self(6);
    /// 5-bit, f16 scale and minimum per 32.
    pub const Q5_1: Self = Self(7);
    /// 8-bit, one f16 scale per 32.
    pub const Q8_0: Self = Self(8);
    /// 2-bit K-quant.
    pub const Q2_K: Self = Self(10);
    /// 3-bit K-quant.
    pub const Q3_K: Self = Self(11);
    /// 4-bit K-quant.
    pub const Q4_K: Self = Self(12);
    /// 5-bit K-quant.
    pub const Q5_K: Self = Self(13);
    /// 6-bit K-quant.
    pub const Q6_K: Self = Self(14);
    /// 64-bit float.
    pub const F64: Self = Self(28);
    /// bfloat16.
    pub const BF16: Self = Self(30);

    /// Every type tandem can convert, in the order error messages list them.
    pub const CONVERTIBLE: [Self; 14] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::F64,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    /// The name llama.cpp uses for this type, or `None` for an id it does not define.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return None,
        })
    }

    /// The block layout, for convertible types only.
    pub fn layout(self) -> Option<BlockLayout> {
        let (block_elems, block_bytes) = match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::F64 => (1, 8),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q2_K => (QK_K, 84),
            Self::Q3_K => (QK_K, 110),
            Self::Q4_K => (QK_K, 144),
            Self::Q5_K => (QK_K, 176),
            Self::Q6_K => (QK_K, 210),
            _ => return None,
        };
        Some(BlockLayout {
            block_elems,
            block_bytes,
        })
    }

    /// The list of convertible type names, for error messages.
    pub fn convertible_list() -> String {
        Self::CONVERTIBLE
            .iter()
            .filter_map(|t| t.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown type id {}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_convertible_type_has_a_name_and_a_layout() {
        for t in GgmlType::CONVERTIBLE {
            assert!(t.name().is_some(), "{t:?}");
            assert!(t.layout().is_some(), "{t:?}");
        }
        assert!(GgmlType(15).layout().is_none());
        assert_eq!(GgmlType(999).to_string(), "unknown type id 999");
        assert_eq!(GgmlType::Q4_1.to_string(), "Q4_1");
    }
}
