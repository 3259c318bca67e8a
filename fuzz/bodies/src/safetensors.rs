//! Target `safetensors`: model weights as the engine loads them, `tandem_engine::weights::WeightStore`
//! (a memory-mapped `model.safetensors`, or the shards a `model.safetensors.index.json` names), through
//! real files in a per-process scratch directory.
//!
//! Input: first byte even → the rest is `model.safetensors`; odd → the rest is
//! `model.safetensors.index.json` beside one valid shard, `a.safetensors`.
//!
//! Invariants asserted:
//! - opening keeps at most 32 bytes live per input byte (plus 64 KiB): the header length and every
//!   tensor's extent are checked against the file before anything is sized by them;
//! - a file opens exactly when the `safetensors` crate accepts it; every tensor it lists is then found,
//!   reads as f32 for F32/BF16/F16 (one value per element, each exactly the converted stored value; a
//!   half-precision NaN stays a NaN) and
//!   is refused for other dtypes and for any other shape;
//! - an accepted file re-serializes to one that deserializes to the same tensors;
//! - an accepted index names only plain file names that exist (no path leaves the model directory).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tandem_engine::weights::WeightStore;

use crate::alloc;

/// The valid shard the index mode's directory holds.
const SHARD: &str = "a.safetensors";

/// The target.
pub fn run(data: &[u8]) {
    let Some((&mode, body)) = data.split_first() else { return };
    if mode % 2 == 0 { single(body) } else { index(body) }
}

fn single(body: &[u8]) {
    let dir = &dirs().0;
    std::fs::write(dir.join("model.safetensors"), body).expect("writing the scratch file");
    let opened = alloc::bounded("WeightStore::open", body.len(), 32, 64 << 10, || WeightStore::open(dir));
    let parsed = SafeTensors::deserialize(body);
    let (store, st) = match (opened, parsed) {
        (Ok(store), Ok(st)) => (store, st),
        (Err(_), Err(_)) => return,
        (Ok(_), Err(e)) => panic!("the engine opened a file the safetensors crate refuses: {e}"),
        (Err(e), Ok(_)) => panic!("the engine refused a file the safetensors crate accepts: {e}"),
    };
    for (name, view) in st.tensors() {
        assert!(store.contains(&name), "tensor {name} listed but not found");
        check_tensor(&store, &name, &view);
    }
    round_trip(&st);
}

/// Reads one tensor through the store and checks every value.
fn check_tensor(store: &WeightStore, name: &str, view: &TensorView<'_>) {
    let shape = view.shape();
    let read = store.f32(name, shape);
    let bytes = view.data();
    let expected: Option<Vec<u32>> = match view.dtype() {
        Dtype::F32 => Some(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        // bf16 → f32 is a shift; f16 → f32 is exact (NaN payloads kept), compared bit for bit.
        Dtype::BF16 => Some(bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])) << 16).collect()),
        Dtype::F16 => Some(bytes.chunks_exact(2).map(|b| f16_bits_to_f32_bits(u16::from_le_bytes([b[0], b[1]]))).collect()),
        _ => None,
    };
    match (read, expected) {
        (Ok(values), Some(expected)) => {
            assert_eq!(values.len(), shape.iter().product::<usize>(), "tensor {name}: one value per element");
            let got: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
            // Bit for bit, except that a half-precision NaN may come back quieted (the `half` crate
            // sets the quiet bit): a NaN must stay a NaN.
            for (g, e) in got.iter().zip(&expected) {
                let nan = f32::from_bits(*g).is_nan() && f32::from_bits(*e).is_nan();
                assert!(g == e || (nan && view.dtype() != Dtype::F32), "tensor {name}: {g:#010x} != {e:#010x}");
            }
        }
        (Err(e), Some(_)) => panic!("tensor {name} of a supported dtype was refused: {e}"),
        (Ok(_), None) => panic!("tensor {name} of dtype {:?} was read as f32", view.dtype()),
        (Err(_), None) => {}
    }
    let mut wrong = shape.to_vec();
    wrong.push(1);
    assert!(store.f32(name, &wrong).is_err(), "tensor {name} read with the wrong shape {wrong:?}");
}

/// f16 bits → f32 bits, exactly (subnormals normalised).
fn f16_bits_to_f32_bits(h: u16) -> u32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value m * 2^-24.
            let f = m as f32 * f32::from_bits(0x3380_0000); // 2^-24
            sign | f.to_bits()
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    }
}

fn round_trip(st: &SafeTensors<'_>) {
    let tensors = st.tensors();
    let bytes = match safetensors::serialize(tensors.iter().map(|(n, v)| (n.clone(), v.clone())), None) {
        Ok(b) => b,
        Err(e) => panic!("an accepted file does not re-serialize: {e}"),
    };
    let again = match SafeTensors::deserialize(&bytes) {
        Ok(a) => a,
        Err(e) => panic!("a re-serialized file does not deserialize: {e}"),
    };
    let mut before: Vec<_> = tensors.iter().map(|(n, v)| (n.clone(), v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    let mut after: Vec<_> = again.tensors().iter().map(|(n, v)| (n.clone(), v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    before.sort_by(|a, b| a.0.cmp(&b.0));
    after.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(before == after, "tensors changed on re-serialization");
}

fn index(body: &[u8]) {
    let dir = &dirs().1;
    std::fs::write(dir.join("model.safetensors.index.json"), body).expect("writing the scratch file");
    let Ok(store) = WeightStore::open(dir) else { return };
    // Accepted: every file the index names must have been the shard that exists.
    let v: serde_json::Value = serde_json::from_slice(body).expect("an accepted index is JSON");
    let map = v["weight_map"].as_object().expect("an accepted index has a weight_map");
    for file in map.values().filter_map(|f| f.as_str()) {
        assert_eq!(file, SHARD, "an accepted index names {file:?}");
    }
    assert!(store.contains("x"), "the shard's tensor is found");
}

/// The scratch directories (single file, index + shard), made once per process.
fn dirs() -> &'static (PathBuf, PathBuf) {
    static DIRS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    DIRS.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let root = base.join(format!("tandem-fuzz-safetensors-{}", std::process::id()));
        let (single, index) = (root.join("single"), root.join("index"));
        std::fs::create_dir_all(&single).expect("scratch directory");
        std::fs::create_dir_all(&index).expect("scratch directory");
        std::fs::write(index.join(SHARD), shard()).expect("writing the shard");
        (single, index)
    })
}

/// Removes the scratch directories (the corpus test calls it when done).
pub fn cleanup() {
    if let Some(single) = dirs().0.parent() {
        let _ = std::fs::remove_dir_all(single);
    }
}

/// A valid one-tensor file: `x`, F32, shape [2].
pub fn shard() -> Vec<u8> {
    let data: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, vec![2], &data).expect("a valid view");
    safetensors::serialize([("x", view)], None).expect("serializes")
}
