//! The wire protocol (version [`PROTOCOL_VERSION`]): a handful of frames, encoded little-endian by hand.
//! TCP writes `header ++ payload` on the socket; a plugin carries the same header bytes as its opaque
//! message header and the payload separately.
//!
//! Header layout: `magic u32 | kind u8 | 0u8 | 0u16 | body_len u32 | body | xxh3_32(prefix ++ body) u32`.
//! Only `Chunk` and `ChunkUnsummed` frames have a payload; its length is the chunk's `byte_len`.
//!
//! Invariants:
//! - Decoding never panics and never allocates more than [`MAX_HEADER`] bytes, whatever the input
//!   (fuzzed by `fuzz/` targets kv_frame and kv_handshake, random-tested below).
//! - A header whose checksum does not match is refused as a whole: a corrupted frame header can never be
//!   mistaken for a valid frame of another transfer.

use std::hash::Hasher;

use twox_hash::XxHash3_64;

fn xxh3_64(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

use crate::geometry::{DType, Geometry, GeometrySpec, Layout};

/// Newest protocol version spoken by this build. (3: chunks announced before their checksum,
/// `ChunkUnsummed` and `Sums`; 4: `Grant`, `Fence` and `Stopped`, for links whose sender writes the
/// receiver's blocks itself.)
pub const PROTOCOL_VERSION: u16 = 4;
/// Oldest protocol version this build still speaks: a receiver answers a sender's `Hello` of any
/// version from this one to [`PROTOCOL_VERSION`] with that version (which the link then speaks), so
/// senders of the previous release keep working during a rolling upgrade; anything else is refused.
pub const MIN_PROTOCOL_VERSION: u16 = 3;
/// Most checksums in one [`Frame::Sums`].
pub const MAX_SUMS: usize = 256;
/// Largest encoded frame header (matches `TANDEM_KV_MAX_HEADER` in the C header).
pub const MAX_HEADER: usize = 4096;
/// Bytes before the body: magic, kind, two reserved bytes... see the module doc.
pub const PREFIX_LEN: usize = 12;
const MAGIC: u32 = u32::from_le_bytes(*b"TKV1");
const TRAILER_LEN: usize = 4;
const MAX_REASON: usize = 1024;

/// Why a transfer was aborted, as carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortCode {
    /// A handle was dropped or cancelled.
    Cancelled,
    /// The receiver does not expect this transfer (unknown id or wrong blocks).
    Rejected,
    /// A chunk failed a check.
    Integrity,
    /// The deadline passed.
    Timeout,
    /// Anything else.
    Internal,
}

impl AbortCode {
    fn code(self) -> u8 {
        match self {
            AbortCode::Cancelled => 1,
            AbortCode::Rejected => 2,
            AbortCode::Integrity => 3,
            AbortCode::Timeout => 4,
            AbortCode::Internal => 5,
        }
    }
    fn from_code(c: u8) -> Option<AbortCode> {
        Some(match c {
            1 => AbortCode::Cancelled,
            2 => AbortCode::Rejected,
            3 => AbortCode::Integrity,
            4 => AbortCode::Timeout,
            5 => AbortCode::Internal,
            _ => return None,
        })
    }
}

/// The header of one chunk: blocks `[block_start, block_start + block_count)` of the transfer's block
/// list, one layer, `byte_len` bytes of payload whose xxh3-64 is `checksum`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Transfer id.
    pub id: u64,
    /// Layer index.
    pub layer: u32,
    /// First block, as an index into the transfer's block list.
    pub block_start: u32,
    /// Number of blocks.
    pub block_count: u32,
    /// Payload bytes (block_count * block_bytes).
    pub byte_len: u64,
    /// xxh3-64 of the payload.
    pub checksum: u64,
}

/// One protocol frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Sender → receiver, first frame of a link: who we are.
    Hello {
        /// Sender's protocol version.
        version: u16,
        /// Sender's pool geometry.
        geometry: Geometry,
    },
    /// Receiver → sender: geometry and version accepted.
    HelloAck {
        /// Receiver's protocol version.
        version: u16,
    },
    /// Receiver → sender: refused, with the reason; the link is closed after it.
    HelloReject {
        /// Why.
        reason: String,
    },
    /// Sender → receiver: transfer `id` begins; the destination block list has `num_blocks` entries and
    /// xxh3-64 `blocks_hash` (of the little-endian u32s), and the content sent is tagged `binding`
    /// (protocol 2).
    Start {
        /// Transfer id.
        id: u64,
        /// Destination blocks.
        num_blocks: u32,
        /// Hash of the destination block list.
        blocks_hash: u64,
        /// The sender's tag of the content it sends (see `TransferDescriptor::binding`).
        binding: u64,
    },
    /// Sender → receiver: one chunk; `byte_len` payload bytes follow.
    Chunk(ChunkHeader),
    /// Sender → receiver: one chunk whose checksum comes later, in a [`Frame::Sums`] (protocol 3: a
    /// sender of device memory announces a group of chunks first and sums them while they move);
    /// the header's `checksum` is not used. `byte_len` payload bytes follow.
    ChunkUnsummed(ChunkHeader),
    /// Sender → receiver: the checksums of transfer `id`'s oldest chunks announced unsummed whose
    /// checksums have not come yet, in order (1 to [`MAX_SUMS`]).
    Sums {
        /// Transfer id.
        id: u64,
        /// One checksum per chunk.
        sums: Vec<u64>,
    },
    /// Receiver → sender: every chunk of `id` landed and verified.
    Done {
        /// Transfer id.
        id: u64,
    },
    /// Receiver → sender, on a link whose sender writes the receiver's blocks itself
    /// ([`crate::transport::Link::writes_directly`]): transfer `id` is expected here; the sender may
    /// write its destination blocks directly (protocol 4) — only if its own `Start` would carry
    /// these `blocks_hash` and `binding` (content the receiver would refuse is never written).
    Grant {
        /// Transfer id.
        id: u64,
        /// [`blocks_hash`] of the destination blocks the receiver expects.
        blocks_hash: u64,
        /// The content binding the receiver expects.
        binding: u64,
    },
    /// Receiver → sender, on such a link: transfer `id` ended here unsuccessfully; write nothing more
    /// for it, now or later, and answer [`Frame::Stopped`] once every write made has landed
    /// (protocol 4).
    Fence {
        /// Transfer id.
        id: u64,
    },
    /// Sender → receiver: the answer to [`Frame::Fence`]: nothing more will be written for `id` and
    /// everything written for it has landed (protocol 4).
    Stopped {
        /// Transfer id.
        id: u64,
    },
    /// Either way: transfer `id` is over, unsuccessfully.
    Abort {
        /// Transfer id.
        id: u64,
        /// Classification.
        code: AbortCode,
        /// Human-readable reason.
        reason: String,
    },
}

/// Why a header could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError(pub String);

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed frame: {}", self.0)
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, FrameError> {
    Err(FrameError(msg.into()))
}

/// Hash of a destination block list, as carried in `Start`.
pub fn blocks_hash(blocks: &[u32]) -> u64 {
    // One pass over the ids' little-endian bytes (what hashing them one by one gives, ~10x faster:
    // it is on the path between `send_ready` and the first byte moving).
    let mut bytes = Vec::with_capacity(4 * blocks.len());
    for b in blocks {
        bytes.extend_from_slice(&b.to_le_bytes());
    }
    XxHash3_64::oneshot(&bytes)
}

/// Checksum of a payload given as consecutive byte slices.
pub fn payload_checksum<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    // twox-hash picks AVX2/SSE2 at run time (~3x the portable path), which matters on the hot path.
    let mut h = XxHash3_64::new();
    for p in parts {
        h.write(p);
    }
    h.finish()
}

fn kind_of(frame: &Frame) -> u8 {
    match frame {
        Frame::Hello { .. } => 1,
        Frame::HelloAck { .. } => 2,
        Frame::HelloReject { .. } => 3,
        Frame::Start { .. } => 4,
        Frame::Chunk(_) => 5,
        Frame::Done { .. } => 6,
        Frame::Abort { .. } => 7,
        Frame::ChunkUnsummed(_) => 8,
        Frame::Sums { .. } => 9,
        Frame::Grant { .. } => 10,
        Frame::Fence { .. } => 11,
        Frame::Stopped { .. } => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let s = truncate(s, MAX_REASON);
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Frame {
    /// Encodes the frame header (the payload of a chunk is not included).
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(64);
        match self {
            Frame::Hello { version, geometry } => {
                body.extend_from_slice(&version.to_le_bytes());
                body.push(geometry.dtype().code());
                body.push(geometry.layout().code());
                for v in [geometry.block_size(), geometry.num_layers(), geometry.num_kv_heads(), geometry.head_dim()] {
                    body.extend_from_slice(&v.to_le_bytes());
                }
                put_str(&mut body, geometry.model_id());
            }
            Frame::HelloAck { version } => body.extend_from_slice(&version.to_le_bytes()),
            Frame::HelloReject { reason } => put_str(&mut body, reason),
            Frame::Grant { id, blocks_hash, binding } => {
                body.extend_from_slice(&id.to_le_bytes());
                body.extend_from_slice(&blocks_hash.to_le_bytes());
                body.extend_from_slice(&binding.to_le_bytes());
            }
            Frame::Start { id, num_blocks, blocks_hash, binding } => {
                body.extend_from_slice(&id.to_le_bytes());
                body.extend_from_slice(&num_blocks.to_le_bytes());
                body.extend_from_slice(&blocks_hash.to_le_bytes());
                body.extend_from_slice(&binding.to_le_bytes());
            }
            Frame::Chunk(c) | Frame::ChunkUnsummed(c) => {
                body.extend_from_slice(&c.id.to_le_bytes());
                body.extend_from_slice(&c.layer.to_le_bytes());
                body.extend_from_slice(&c.block_start.to_le_bytes());
                body.extend_from_slice(&c.block_count.to_le_bytes());
                body.extend_from_slice(&c.byte_len.to_le_bytes());
                body.extend_from_slice(&c.checksum.to_le_bytes());
            }
            Frame::Done { id } | Frame::Fence { id } | Frame::Stopped { id } => body.extend_from_slice(&id.to_le_bytes()),
            Frame::Sums { id, sums } => {
                body.extend_from_slice(&id.to_le_bytes());
                body.extend_from_slice(&(sums.len() as u16).to_le_bytes());
                for sum in sums {
                    body.extend_from_slice(&sum.to_le_bytes());
                }
            }
            Frame::Abort { id, code, reason } => {
                body.extend_from_slice(&id.to_le_bytes());
                body.push(code.code());
                put_str(&mut body, reason);
            }
        }
        let mut out = Vec::with_capacity(PREFIX_LEN + body.len() + TRAILER_LEN);
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.push(kind_of(self));
        out.extend_from_slice(&[0, 0, 0]);
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        let sum = xxh3_64(&out) as u32;
        out.extend_from_slice(&sum.to_le_bytes());
        debug_assert!(out.len() <= MAX_HEADER);
        out
    }

    /// Reads the fixed prefix and returns how many more header bytes follow it (body + trailer).
    pub fn remaining_len(prefix: &[u8; PREFIX_LEN]) -> Result<usize, FrameError> {
        let magic = u32::from_le_bytes(prefix[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return err(format!("bad magic {magic:#010x} (not a tandem KV peer, or protocol 0)"));
        }
        let body_len = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes")) as usize;
        if body_len > MAX_HEADER - PREFIX_LEN - TRAILER_LEN {
            return err(format!("header body of {body_len} bytes exceeds {MAX_HEADER}"));
        }
        Ok(body_len + TRAILER_LEN)
    }

    /// Decodes one complete header (prefix, body and trailer, nothing more).
    pub fn decode(header: &[u8]) -> Result<Frame, FrameError> {
        if header.len() < PREFIX_LEN + TRAILER_LEN || header.len() > MAX_HEADER {
            return err(format!("header of {} bytes", header.len()));
        }
        let prefix: &[u8; PREFIX_LEN] = header[..PREFIX_LEN].try_into().expect("prefix");
        let rest = Frame::remaining_len(prefix)?;
        if header.len() != PREFIX_LEN + rest {
            return err(format!("header is {} bytes but declares {}", header.len(), PREFIX_LEN + rest));
        }
        let (signed, trailer) = header.split_at(header.len() - TRAILER_LEN);
        let sum = u32::from_le_bytes(trailer.try_into().expect("4 bytes"));
        if xxh3_64(signed) as u32 != sum {
            return err("header checksum mismatch");
        }
        if prefix[5..8] != [0, 0, 0] {
            return err("reserved bytes set");
        }
        let mut r = Reader { buf: &signed[PREFIX_LEN..] };
        let frame = match prefix[4] {
            1 => {
                let version = r.u16()?;
                let dtype = DType::from_code(r.u8()?).ok_or_else(|| FrameError("unknown dtype".into()))?;
                let layout = Layout::from_code(r.u8()?).ok_or_else(|| FrameError("unknown layout".into()))?;
                let (block_size, num_layers, num_kv_heads, head_dim) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
                let model_id = r.string()?;
                let geometry = Geometry::new(GeometrySpec {
                    model_id,
                    dtype,
                    block_size,
                    num_layers,
                    num_kv_heads,
                    head_dim,
                    layout,
                })
                .map_err(|e| FrameError(format!("hello geometry: {e}")))?;
                Frame::Hello { version, geometry }
            }
            2 => Frame::HelloAck { version: r.u16()? },
            3 => Frame::HelloReject { reason: r.string()? },
            4 => Frame::Start { id: r.u64()?, num_blocks: r.u32()?, blocks_hash: r.u64()?, binding: r.u64()? },
            5 | 8 => {
                let h = ChunkHeader {
                    id: r.u64()?,
                    layer: r.u32()?,
                    block_start: r.u32()?,
                    block_count: r.u32()?,
                    byte_len: r.u64()?,
                    checksum: r.u64()?,
                };
                if prefix[4] == 5 { Frame::Chunk(h) } else { Frame::ChunkUnsummed(h) }
            }
            9 => {
                let id = r.u64()?;
                let n = r.u16()? as usize;
                if n == 0 || n > MAX_SUMS {
                    return err(format!("a sums frame of {n} checksums"));
                }
                let sums = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
                Frame::Sums { id, sums }
            }
            6 => Frame::Done { id: r.u64()? },
            10 => Frame::Grant { id: r.u64()?, blocks_hash: r.u64()?, binding: r.u64()? },
            11 => Frame::Fence { id: r.u64()? },
            12 => Frame::Stopped { id: r.u64()? },
            7 => {
                let id = r.u64()?;
                let code = AbortCode::from_code(r.u8()?).ok_or_else(|| FrameError("unknown abort code".into()))?;
                Frame::Abort { id, code, reason: r.string()? }
            }
            k => return err(format!("unknown frame kind {k}")),
        };
        if !r.buf.is_empty() {
            return err(format!("{} trailing body bytes", r.buf.len()));
        }
        Ok(frame)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        if self.buf.len() < N {
            return err("body too short");
        }
        let (head, tail) = self.buf.split_at(N);
        self.buf = tail;
        Ok(head.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn string(&mut self) -> Result<String, FrameError> {
        let len = self.u16()? as usize;
        // The encoder never writes longer strings: refusing them keeps decoding canonical
        // (decode(encode(f)) == f and encode(decode(h)) == h).
        if len > MAX_REASON {
            return err(format!("string of {len} bytes exceeds {MAX_REASON}"));
        }
        if len > self.buf.len() {
            return err("string runs past the body");
        }
        let (s, tail) = self.buf.split_at(len);
        self.buf = tail;
        String::from_utf8(s.to_vec()).map_err(|_| FrameError("string is not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::tests::small;
    use proptest::prelude::*;

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello { version: PROTOCOL_VERSION, geometry: small("smollm2") },
            Frame::HelloAck { version: 1 },
            Frame::HelloReject { reason: "block_size 16 != 32".into() },
            Frame::Start { id: 0xdead_beef, num_blocks: 7, blocks_hash: blocks_hash(&[1, 2, 3]), binding: 0x1234_5678_9abc_def0 },
            Frame::Chunk(ChunkHeader { id: 9, layer: 2, block_start: 4, block_count: 3, byte_len: 1536, checksum: 77 }),
            Frame::ChunkUnsummed(ChunkHeader { id: 9, layer: 3, block_start: 0, block_count: 1, byte_len: 512, checksum: 0 }),
            Frame::Sums { id: 9, sums: vec![1, u64::MAX, 0x0123_4567_89ab_cdef] },
            Frame::Done { id: u64::MAX },
            Frame::Abort { id: 1, code: AbortCode::Integrity, reason: "checksum ✗".into() },
            Frame::Grant { id: 0x0bad_cafe, blocks_hash: blocks_hash(&[4, 5]), binding: 0x0123_4567 },
            Frame::Fence { id: 0x0bad_cafe },
            Frame::Stopped { id: 0x0bad_cafe },
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        for f in samples() {
            let bytes = f.encode();
            let prefix: [u8; PREFIX_LEN] = bytes[..PREFIX_LEN].try_into().unwrap();
            assert_eq!(PREFIX_LEN + Frame::remaining_len(&prefix).unwrap(), bytes.len());
            assert_eq!(Frame::decode(&bytes).unwrap(), f);
        }
    }

    #[test]
    fn any_single_bit_flip_is_refused() {
        for f in samples() {
            let bytes = f.encode();
            for bit in 0..bytes.len() * 8 {
                let mut b = bytes.clone();
                b[bit / 8] ^= 1 << (bit % 8);
                assert!(Frame::decode(&b).is_err(), "{f:?} bit {bit}");
            }
        }
    }

    #[test]
    fn sums_frames_are_bounded() {
        let full = Frame::Sums { id: 1, sums: vec![7; MAX_SUMS] };
        assert_eq!(Frame::decode(&full.encode()).unwrap(), full);
        assert!(full.encode().len() <= MAX_HEADER);
        let over = Frame::Sums { id: 1, sums: vec![7; MAX_SUMS + 1] }.encode();
        assert!(Frame::decode(&over).unwrap_err().0.contains("sums frame of"));
        let empty = Frame::Sums { id: 1, sums: vec![] }.encode();
        assert!(Frame::decode(&empty).unwrap_err().0.contains("sums frame of 0"));
    }

    #[test]
    fn huge_length_fields_are_refused_before_allocating() {
        let mut bytes = Frame::Done { id: 1 }.encode();
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let prefix: [u8; PREFIX_LEN] = bytes[..PREFIX_LEN].try_into().unwrap();
        assert!(Frame::remaining_len(&prefix).is_err());
        assert!(Frame::decode(&bytes).is_err());
    }

    #[test]
    fn long_reasons_are_truncated_on_a_char_boundary() {
        let f = Frame::HelloReject { reason: "é".repeat(2000) };
        let Frame::HelloReject { reason } = Frame::decode(&f.encode()).unwrap() else { panic!() };
        assert!(reason.len() <= MAX_REASON && reason.chars().all(|c| c == 'é'));
    }

    /// Found by the fuzzer: a reason longer than the encoder writes must be refused, not truncated on
    /// re-encoding.
    #[test]
    fn over_long_strings_are_refused() {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.push(3);
        out.extend_from_slice(&[0, 0, 0]);
        let reason = vec![b'a'; MAX_REASON + 1];
        out.extend_from_slice(&((reason.len() + 2) as u32).to_le_bytes());
        out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
        out.extend_from_slice(&reason);
        let sum = xxh3_64(&out) as u32;
        out.extend_from_slice(&sum.to_le_bytes());
        assert!(Frame::decode(&out).is_err());
    }

    proptest! {
        // The wire value of `blocks_hash`: the ids hashed one by one as little-endian u32s (the
        // streaming definition peers of earlier builds compute).
        #[test]
        fn blocks_hash_is_the_ids_hashed_one_by_one(ids in proptest::collection::vec(any::<u32>(), 0..600)) {
            let mut h = XxHash3_64::new();
            for b in &ids {
                h.write(&b.to_le_bytes());
            }
            prop_assert_eq!(blocks_hash(&ids), h.finish());
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]
        #[test]
        fn random_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Frame::decode(&bytes);
            if bytes.len() >= PREFIX_LEN {
                let prefix: [u8; PREFIX_LEN] = bytes[..PREFIX_LEN].try_into().unwrap();
                if let Ok(n) = Frame::remaining_len(&prefix) {
                    prop_assert!(n <= MAX_HEADER);
                }
            }
        }

        #[test]
        fn garbage_behind_a_valid_prefix_never_panics(kind in 0u8..12, body in proptest::collection::vec(any::<u8>(), 0..200)) {
            // A well-formed prefix and trailer around random bodies reaches every body decoder.
            let mut out = Vec::new();
            out.extend_from_slice(&MAGIC.to_le_bytes());
            out.push(kind);
            out.extend_from_slice(&[0, 0, 0]);
            out.extend_from_slice(&(body.len() as u32).to_le_bytes());
            out.extend_from_slice(&body);
            let sum = xxh3_64(&out) as u32;
            out.extend_from_slice(&sum.to_le_bytes());
            let _ = Frame::decode(&out);
        }
    }
}
