//! A bounds-checked reader for GGUF files (versions 2 and 3, little-endian).
//!
//! It parses the header, every metadata key/value (arrays included, nested up to
//! [`MAX_ARRAY_NESTING`]), the tensor infos and the aligned start of the data section, and reads
//! tensor bytes on request.
//!
//! Invariants:
//! - Nothing read from the file sizes an allocation before it is checked against the bytes that are
//!   left in the file: a count of N items that each need at least K bytes is refused unless N*K
//!   bytes remain. A corrupt file gives [`Error::Gguf`], never a panic or an out-of-memory abort.
//! - Every tensor of a convertible type lies inside the file ([`GgufFile::open`] checks it); tensors
//!   of other types are kept so the caller can name them in its error.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::ggml_type::GgmlType;
use crate::{Error, Result};

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// How deeply arrays may nest inside arrays.
pub const MAX_ARRAY_NESTING: usize = 4;
/// GGML tensors have at most this many dimensions.
pub const MAX_DIMS: usize = 4;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// uint8
    U8(u8),
    /// int8
    I8(i8),
    /// uint16
    U16(u16),
    /// int16
    I16(i16),
    /// uint32
    U32(u32),
    /// int32
    I32(i32),
    /// uint64
    U64(u64),
    /// int64
    I64(i64),
    /// float32
    F32(f32),
    /// float64
    F64(f64),
    /// bool
    Bool(bool),
    /// UTF-8 string
    Str(String),
    /// Array of values of one type.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::Str(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }
}

/// One tensor's description from the GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The llama.cpp tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as GGUF lists them: innermost (contiguous) first.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the tensor's bytes from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements (the product of the dimensions; checked against overflow at parse time).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes the tensor occupies, if its type is convertible and its rows hold whole blocks.
    pub fn byte_len(&self) -> Option<u64> {
        let layout = self.ggml_type.layout()?;
        let row = *self.dims.first().unwrap_or(&1);
        let block = layout.block_elems as u64;
        if !row.is_multiple_of(block) {
            return None;
        }
        (self.n_elements() / block).checked_mul(layout.block_bytes as u64)
    }
}

/// A parsed GGUF file: its metadata and tensor directory. Tensor bytes are read on demand.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
    file_size: u64,
}

impl GgufFile {
    /// Opens and parses `path`. Fails with [`Error::Gguf`] on anything malformed.
    pub fn open(path: &Path) -> Result<Self> {
        let file =
            File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let file_size = file
            .metadata()
            .map_err(|e| Error::io(format!("reading the size of {}", path.display()), e))?
            .len();
        Self::parse_from(BufReader::new(file), file_size, path)
    }

    /// Parses a GGUF file held in memory exactly as [`GgufFile::open`] parses one on disk (the fuzzing
    /// entry point; `path` only names the file in errors).
    #[doc(hidden)]
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        Self::parse_from(bytes, bytes.len() as u64, path)
    }

    fn parse_from<R: Read>(inner: R, file_size: u64, path: &Path) -> Result<Self> {
        let mut r = Bounded {
            inner,
            pos: 0,
            len: file_size,
            path,
        };
        let parsed = parse(&mut r)?;
        let gguf = GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            file_size,
        };
        gguf.check_tensor_extents()?;
        Ok(gguf)
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Alignment of the data section and of every tensor in it.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// An error about this file.
    pub fn error(&self, reason: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    /// Reads the raw bytes of `info` from `file` (an open handle on this GGUF). The type must be
    /// convertible; the extent was checked at open time.
    pub fn read_tensor_bytes(&self, file: &mut File, info: &TensorInfo) -> Result<Vec<u8>> {
        let len = self.checked_extent(info)?;
        let start = self.data_offset + info.offset;
        let len_usize = usize::try_from(len).map_err(|_| {
            self.error(format!(
                "tensor {} is too large for this machine",
                info.name
            ))
        })?;
        let mut buf = vec![0u8; len_usize];
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| {
                Error::io(
                    format!("reading tensor {} from {}", info.name, self.path.display()),
                    e,
                )
            })?;
        Ok(buf)
    }

    /// The byte length of a convertible tensor, after checking it lies inside the file.
    fn checked_extent(&self, info: &TensorInfo) -> Result<u64> {
        if info.ggml_type.layout().is_none() {
            return Err(self.error(format!(
                "tensor {} has type {} which tandem cannot convert (supported: {})",
                info.name,
                info.ggml_type,
                GgmlType::convertible_list()
            )));
        }
        let len = info.byte_len().ok_or_else(|| {
            self.error(format!(
                "tensor {} of type {} has a row length {} that is not a whole number of blocks",
                info.name,
                info.ggml_type,
                info.dims.first().copied().unwrap_or(1)
            ))
        })?;
        let end = self
            .data_offset
            .checked_add(info.offset)
            .and_then(|s| s.checked_add(len));
        match end {
            Some(end) if end <= self.file_size => Ok(len),
            _ => Err(self.error(format!(
                "tensor {} ({} bytes at data offset {}) extends past the end of the file ({} bytes)",
                info.name, len, info.offset, self.file_size
            ))),
        }
    }

    /// Checks every convertible tensor's bytes lie inside the file and are aligned.
    fn check_tensor_extents(&self) -> Result<()> {
        for info in &self.tensors {
            if info.offset % self.alignment != 0 {
                return Err(self.error(format!(
                    "tensor {} starts at data offset {} which is not a multiple of the alignment {}",
                    info.name, info.offset, self.alignment
                )));
            }
            if info.ggml_type.layout().is_some() {
                self.checked_extent(info)?;
            }
        }
        Ok(())
    }
}

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// A reader that knows how many bytes are left and refuses to go past them.
struct Bounded<'p, R> {
    inner: R,
    pos: u64,
    len: u64,
    path: &'p Path,
}

impl<R: Read> Bounded<'_, R> {
    fn error(&self, reason: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        let n = buf.len() as u64;
        if n > self.remaining() {
            return Err(self.error(format!(
                "file is truncated: {what} needs {n} bytes at offset {} but the file has {} bytes",
                self.pos, self.len
            )));
        }
        self.inner
            .read_exact(buf)
            .map_err(|e| Error::io(format!("reading {what} from {}", self.path.display()), e))?;
        self.pos += n;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Refuses a count of `count` items needing at least `min_each` bytes each unless that many
    /// bytes are left; returns the count as usize.
    fn count(&mut self, count: u64, min_each: u64, what: &str) -> Result<usize> {
        let needed = count.checked_mul(min_each);
        match needed {
            Some(needed) if needed <= self.remaining() => usize::try_from(count)
                .map_err(|_| self.error(format!("{what} count {count} is too large"))),
            _ => Err(self.error(format!(
                "{what} count {count} is impossible: the {} bytes left in the file cannot hold it",
                self.remaining()
            ))),
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = self.count(len, 1, &format!("{what} length"))?;
        let mut buf = vec![0u8; len];
        self.fill(&mut buf, what)?;
        String::from_utf8(buf).map_err(|_| self.error(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<MetaValue> {
        Ok(match type_id {
            0 => MetaValue::U8(self.u8(key)?),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.u8(key)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(
                        self.error(format!("metadata {key}: bool byte {b} is neither 0 nor 1"))
                    );
                }
            },
            8 => MetaValue::Str(self.string(&format!("metadata {key}"))?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(self.error(format!(
                        "metadata {key}: arrays nested deeper than {MAX_ARRAY_NESTING} levels"
                    )));
                }
                let elem_type = self.u32(key)?;
                let min_each = min_value_size(elem_type).ok_or_else(|| {
                    self.error(format!(
                        "metadata {key}: unknown array element type {elem_type}"
                    ))
                })?;
                let n = self.u64(key)?;
                let n = self.count(n, min_each, &format!("metadata {key} array"))?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_type, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(self.error(format!("metadata {key}: unknown value type {t}"))),
        })
    }
}

/// The fewest bytes a value of this type can occupy, or `None` for an unknown type.
fn min_value_size(type_id: u32) -> Option<u64> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // u64 length
        9 => 4 + 8, // element type + count
        10..=12 => 8,
        _ => return None,
    })
}

fn parse<R: Read>(r: &mut Bounded<'_, R>) -> Result<Parsed> {
    let magic: [u8; 4] = r.array("the magic number")?;
    if magic != GGUF_MAGIC {
        return Err(r.error(format!(
            "bad magic {magic:02x?}: not a GGUF file (expected \"GGUF\")"
        )));
    }
    let version = r.u32("the version")?;
    if version == 0x0300_0000 || version == 0x0200_0000 {
        return Err(r.error("big-endian GGUF files are not supported"));
    }
    if version != 2 && version != 3 {
        return Err(r.error(format!(
            "GGUF version {version} is not supported (tandem reads versions 2 and 3)"
        )));
    }
    let n_tensors = r.u64("the tensor count")?;
    let n_kv = r.u64("the metadata count")?;
    // A key/value needs a key length (8), a type (4) and at least one byte of value.
    let n_kv = r.count(n_kv, 13, "metadata")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let type_id = r.u32(&format!("metadata {key} type"))?;
        let value = r.value(type_id, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(r.error(format!("metadata key {key} appears twice")));
        }
    }
    // A tensor info needs a name length (8), a dim count (4), a type (4) and an offset (8).
    let n_tensors = r.count(n_tensors, 24, "tensor")?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut names = std::collections::HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string("a tensor name")?;
        let n_dims = r.u32(&format!("tensor {name} dimension count"))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(r.error(format!(
                "tensor {name} has {n_dims} dimensions (GGML allows 1 to {MAX_DIMS})"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64(&format!("tensor {name} dimensions"))?);
        }
        let elems = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        if elems.is_none_or(|e| e > i64::MAX as u64) {
            return Err(r.error(format!("tensor {name} has an impossible shape {dims:?}")));
        }
        let ggml_type = GgmlType(r.u32(&format!("tensor {name} type"))?);
        let offset = r.u64(&format!("tensor {name} offset"))?;
        if !names.insert(name.clone()) {
            return Err(r.error(format!("tensor {name} appears twice")));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(r.error(format!("general.alignment {v:?} is not a power of two"))),
        },
    };
    let data_offset = r.pos.div_ceil(alignment) * alignment;
    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::test_util::{GgufBuilder, TestTensor};

    fn write(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    fn reason(err: Error) -> String {
        match err {
            Error::Gguf { reason, .. } => reason,
            other => panic!("expected a GGUF error, got {other:?}"),
        }
    }

    fn sample() -> GgufBuilder {
        let mut b = GgufBuilder::new(3);
        b.kv("general.architecture", MetaValue::Str("llama".into()));
        b.kv("some.u8", MetaValue::U8(7));
        b.kv("some.i64", MetaValue::I64(-5));
        b.kv("some.f64", MetaValue::F64(0.25));
        b.kv("some.bool", MetaValue::Bool(true));
        b.kv(
            "some.nested",
            MetaValue::Array(vec![
                MetaValue::Array(vec![MetaValue::I16(-1), MetaValue::I16(2)]),
                MetaValue::Array(vec![]),
            ]),
        );
        b.kv(
            "some.strings",
            MetaValue::Array(vec![
                MetaValue::Str("a b".into()),
                MetaValue::Str("ĠT".into()),
            ]),
        );
        b.tensor(TestTensor::f32(
            "w",
            &[3, 2],
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        ));
        b.tensor(TestTensor::f32("v", &[5], &[9.0; 5]));
        b
    }

    #[test]
    fn parses_metadata_of_every_type_and_tensor_infos() {
        for version in [2, 3] {
            let mut b = sample();
            b.version = version;
            let (_d, path) = write(&b.build());
            let g = GgufFile::open(&path).unwrap();
            assert_eq!(g.version(), version);
            assert_eq!(
                g.get("general.architecture").unwrap().as_str(),
                Some("llama")
            );
            assert_eq!(g.get("some.u8").unwrap().as_u64(), Some(7));
            assert_eq!(g.get("some.i64").unwrap().as_i64(), Some(-5));
            assert_eq!(g.get("some.i64").unwrap().as_u64(), None);
            assert_eq!(g.get("some.f64").unwrap().as_f64(), Some(0.25));
            assert_eq!(g.get("some.bool").unwrap().as_bool(), Some(true));
            let nested = g.get("some.nested").unwrap().as_array().unwrap();
            assert_eq!(
                nested[0],
                MetaValue::Array(vec![MetaValue::I16(-1), MetaValue::I16(2)])
            );
            assert_eq!(
                g.get("some.strings").unwrap().as_array().unwrap()[1].as_str(),
                Some("ĠT")
            );
            let w = g.tensor("w").unwrap();
            assert_eq!(w.dims, vec![3, 2]);
            assert_eq!(w.ggml_type, GgmlType::F32);
            assert_eq!(g.data_offset() % 32, 0);
            let mut f = File::open(&path).unwrap();
            let bytes = g.read_tensor_bytes(&mut f, g.tensor("v").unwrap()).unwrap();
            assert_eq!(bytes.len(), 20);
            assert_eq!(f32::from_le_bytes(bytes[16..20].try_into().unwrap()), 9.0);
        }
    }

    #[test]
    fn honours_custom_alignment() {
        let mut b = sample();
        b.alignment = 64;
        b.kv("general.alignment", MetaValue::U32(64));
        let (_d, path) = write(&b.build());
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.data_offset() % 64, 0);
        let mut f = File::open(&path).unwrap();
        let bytes = g.read_tensor_bytes(&mut f, g.tensor("v").unwrap()).unwrap();
        assert_eq!(f32::from_le_bytes(bytes[0..4].try_into().unwrap()), 9.0);
    }

    #[test]
    fn rejects_bad_magic() {
        let mut bytes = sample().build();
        bytes[0] = b'X';
        let (_d, path) = write(&bytes);
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("bad magic"));
    }

    #[test]
    fn rejects_unsupported_version() {
        let mut b = sample();
        b.version = 1;
        let (_d, path) = write(&b.build());
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("version 1"));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().build();
        // Every prefix must fail cleanly; none may panic or allocate absurdly.
        for cut in 0..bytes.len() {
            let (_d, path) = write(&bytes[..cut]);
            let err = GgufFile::open(&path).unwrap_err();
            let r = reason(err);
            assert!(
                r.contains("truncated") || r.contains("impossible") || r.contains("past the end"),
                "cut at {cut}: {r}"
            );
        }
    }

    #[test]
    fn rejects_absurd_counts_without_allocating() {
        // A header claiming 2^60 metadata entries in a 24-byte file.
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"GGUF");
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        let (_d, path) = write(&bytes);
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("impossible"));

        // A string claiming u64::MAX bytes.
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"GGUF");
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        bytes.extend_from_slice(&[0u8; 16]);
        let (_d, path) = write(&bytes);
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("impossible"));

        // An array claiming 2^40 u32 elements: magic, version, two counts (24 bytes), key length (8),
        // key "x" (1), value type (4), element type (4), then the element count.
        let mut b = GgufBuilder::new(3);
        b.kv("x", MetaValue::Array(vec![MetaValue::U32(1)]));
        let mut bytes = b.build();
        let count_at = 24 + 8 + 1 + 4 + 4;
        assert_eq!(bytes[count_at..count_at + 8], 1u64.to_le_bytes());
        bytes[count_at..count_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let (_d, path) = write(&bytes);
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("impossible"));
    }

    #[test]
    fn random_corruption_never_panics() {
        use rand::{Rng, SeedableRng};
        let clean = sample().build();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(42);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.gguf");
        let (mut ok, mut err) = (0, 0);
        for _ in 0..400 {
            let mut bytes = clean.clone();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
            }
            std::fs::write(&path, &bytes).unwrap();
            match GgufFile::open(&path) {
                Ok(g) => {
                    ok += 1;
                    let mut f = File::open(&path).unwrap();
                    for t in g.tensors() {
                        let _ = g.read_tensor_bytes(&mut f, t);
                    }
                }
                Err(e) => {
                    err += 1;
                    assert!(matches!(e, Error::Gguf { .. }), "{e}");
                }
            }
        }
        assert!(
            ok > 0 && err > 0,
            "corruptions should both survive and fail ({ok} ok, {err} errors)"
        );
    }

    #[test]
    fn rejects_tensor_past_eof() {
        let mut b = sample();
        b.tensor(TestTensor::f32("big", &[4], &[0.0; 4]));
        b.override_offset("big", 1 << 20);
        let (_d, path) = write(&b.build());
        let r = reason(GgufFile::open(&path).unwrap_err());
        assert!(
            r.contains("tensor big") && r.contains("past the end"),
            "{r}"
        );
    }

    #[test]
    fn unsupported_type_is_kept_then_named() {
        let mut b = sample();
        // Q8_K (type 15) is a real GGML type that tandem does not convert.
        b.tensor(TestTensor::raw(
            "blk.0.attn_q.weight",
            &[256, 1],
            15,
            vec![0u8; 292],
        ));
        let (_d, path) = write(&b.build());
        let g = GgufFile::open(&path).unwrap();
        let t = g.tensor("blk.0.attn_q.weight").unwrap().clone();
        let mut f = File::open(&path).unwrap();
        let r = reason(g.read_tensor_bytes(&mut f, &t).unwrap_err());
        assert!(
            r.contains("blk.0.attn_q.weight has type Q8_K which tandem cannot convert"),
            "{r}"
        );
        assert!(r.contains("supported: F32, F16, BF16"), "{r}");
    }

    #[test]
    fn rejects_bad_structure() {
        // Zero dims.
        let mut b = sample();
        b.tensor(TestTensor::raw("nodims", &[], 0, vec![]));
        let (_d, path) = write(&b.build());
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("nodims has 0 dimensions"));
        // Duplicate tensor.
        let mut b = sample();
        b.tensor(TestTensor::f32("w", &[1], &[0.0]));
        let (_d, path) = write(&b.build());
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("w appears twice"));
        // Bad alignment value.
        let mut b = sample();
        b.kv("general.alignment", MetaValue::U32(3));
        let (_d, path) = write(&b.build());
        assert!(reason(GgufFile::open(&path).unwrap_err()).contains("general.alignment"));
        // Row not a whole number of blocks.
        let mut b = sample();
        b.tensor(TestTensor::raw(
            "q",
            &[16, 1],
            GgmlType::Q8_0.0,
            vec![0u8; 34],
        ));
        let (_d, path) = write(&b.build());
        assert!(
            reason(GgufFile::open(&path).unwrap_err()).contains("not a whole number of blocks")
        );
    }
}
