//! The bodies of tandem's fuzz targets: one function per decoder that reads untrusted bytes, each taking
//! the fuzzer's input and asserting invariants (re-encoding equality, bounded allocation, the decoder's
//! own promises), not only the absence of panics.
//!
//! `fuzz/fuzz_targets/*.rs` are one-line libFuzzer wrappers around these (`cargo fuzz run TARGET` in
//! `fuzz/`, nightly); `tests/corpus.rs` feeds every committed file of `fuzz/corpus/TARGET/` through the
//! same function on stable Rust, so the corpora (and every crash ever found) are regression tests in CI.
//!
//! Invariant: a target body panics only when an invariant of the code under test is broken; every
//! refusal of bad input is an `Err` the body accepts.

pub mod alloc;
pub mod gguf;
pub mod kv_frame;
pub mod kv_handshake;
#[cfg(feature = "router")]
pub mod router_request;
pub mod safetensors;
pub mod tokenizer;

/// A target body: takes the fuzzer's input, panics only on a broken invariant.
pub type Body = fn(&[u8]);

/// Every target, by the name of its binary and corpus directory.
pub const TARGETS: &[(&str, Body)] = &[
    ("kv_frame", kv_frame::run),
    ("kv_handshake", kv_handshake::run),
    ("gguf", gguf::run),
    ("safetensors", safetensors::run),
    ("tokenizer", tokenizer::run),
    #[cfg(feature = "router")]
    ("router_request", router_request::run),
];

/// Reads an input as a sequence of small fields; past the end every read gives zeros, so any input is
/// a complete program for the structured targets.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads `data` from its start.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// One byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// Up to `n` bytes.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.data.split_at(n.min(self.data.len()));
        self.data = tail;
        head
    }

    /// A length-prefixed (u16) byte string.
    pub fn chunk(&mut self) -> &'a [u8] {
        let n = self.u16() as usize;
        self.bytes(n)
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }
}

/// Splits `data` into parts at the separator line `\n@@\n` (how the multi-file targets pack files).
pub fn split_parts(data: &[u8]) -> Vec<&[u8]> {
    const SEP: &[u8] = b"\n@@\n";
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(SEP.len()).position(|w| w == SEP) {
        parts.push(&rest[..i]);
        rest = &rest[i + SEP.len()..];
    }
    parts.push(rest);
    parts
}
