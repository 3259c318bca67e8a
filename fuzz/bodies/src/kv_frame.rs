//! Target `kv_frame`: the KV-transfer frame decoder (`tandem_kv_transfer::frame`) with arbitrary bytes.
//!
//! The input is read three ways:
//! 1. as a TCP byte stream, the way `transport/tcp.rs` reads it: a fixed prefix, `remaining_len` more
//!    header bytes, `decode`, and for a `Chunk` its `byte_len` payload bytes skipped; repeated until the
//!    input runs out or a frame is refused (a real receiver closes the link on the first bad frame);
//! 2. as one complete header handed straight to `Frame::decode`;
//! 3. "sealed": the first byte is a frame kind and the rest a body, wrapped in a well-formed prefix and
//!    a correct checksum trailer. Reads 1 and 2 must get past the xxh3 trailer by luck and libFuzzer's
//!    comparison tracing; this one hands every mutated body straight to the body decoders (the unit
//!    test `garbage_behind_a_valid_prefix_never_panics` in frame.rs does the same).
//!
//! Invariants asserted (any failure is a bug in frame.rs, not in this target):
//! - `remaining_len` never asks for more than `MAX_HEADER` header bytes in total, so a receiver's header
//!   buffer is bounded whatever the peer sends; this target reads headers into a fixed
//!   `MAX_HEADER`-byte buffer and allocates nothing sized by the input;
//! - a header that decodes re-encodes to exactly the same bytes (the encoding is canonical: no two
//!   distinct headers decode to the same frame, and nothing decodable is lost on re-encoding);
//! - decoding never panics (libFuzzer reports any panic as a crash).

use tandem_kv_transfer::frame::{Frame, MAX_HEADER, PREFIX_LEN, payload_checksum};

/// Bytes of the checksum trailer (private in frame.rs; the layout is in its module doc).
const TRAILER_LEN: usize = 4;

/// The target: reads `data` the three ways above.
pub fn run(data: &[u8]) {
    read_stream(data);
    if let Ok(frame) = Frame::decode(data) {
        assert_canonical(&frame, data);
    }
    read_sealed(data);
}

/// Reads `data` as a receiver reads its socket, frame after frame.
fn read_stream(mut data: &[u8]) {
    let mut header = [0u8; MAX_HEADER];
    loop {
        let Some((prefix, rest)) = data.split_first_chunk::<PREFIX_LEN>() else {
            return;
        };
        let Ok(remaining) = Frame::remaining_len(prefix) else {
            return;
        };
        assert!(
            remaining <= MAX_HEADER - PREFIX_LEN,
            "remaining_len {remaining} for prefix {prefix:02x?} exceeds MAX_HEADER {MAX_HEADER}"
        );
        let Some((body, rest)) = rest.split_at_checked(remaining) else {
            return;
        };
        let header = &mut header[..PREFIX_LEN + remaining];
        header[..PREFIX_LEN].copy_from_slice(prefix);
        header[PREFIX_LEN..].copy_from_slice(body);
        data = rest;
        let Ok(frame) = Frame::decode(header) else {
            return;
        };
        assert_canonical(&frame, header);
        if let Frame::Chunk(chunk) = frame {
            let skip = usize::try_from(chunk.byte_len).unwrap_or(usize::MAX).min(data.len());
            data = &data[skip..];
        }
    }
}

/// Decodes `kind = data[0]`, `body = data[1..]` behind a valid prefix and trailer.
fn read_sealed(data: &[u8]) {
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    if body.len() > MAX_HEADER - PREFIX_LEN - TRAILER_LEN {
        return;
    }
    let mut header = [0u8; MAX_HEADER];
    header[..4].copy_from_slice(b"TKV1");
    header[4] = kind;
    header[8..PREFIX_LEN].copy_from_slice(&(body.len() as u32).to_le_bytes());
    let signed = PREFIX_LEN + body.len();
    header[PREFIX_LEN..signed].copy_from_slice(body);
    // The header checksum is the low 32 bits of xxh3-64, the hash `payload_checksum` computes.
    let sum = payload_checksum([&header[..signed]]) as u32;
    header[signed..signed + TRAILER_LEN].copy_from_slice(&sum.to_le_bytes());
    let header = &header[..signed + TRAILER_LEN];
    match Frame::decode(header) {
        Ok(frame) => assert_canonical(&frame, header),
        // Guards the sealing itself: were it wrong, this read would silently test nothing.
        Err(e) => assert!(e.0 != "header checksum mismatch", "sealed header refused: {e}"),
    }
}

/// A decoded header must be exactly what encoding its frame produces.
fn assert_canonical(frame: &Frame, header: &[u8]) {
    assert!(header.len() <= MAX_HEADER, "decoded a {}-byte header", header.len());
    let encoded = frame.encode();
    if encoded != header {
        let first_diff =
            encoded.iter().zip(header).position(|(a, b)| a != b).unwrap_or(encoded.len().min(header.len()));
        let mut shown = format!("{frame:?}");
        if shown.len() > 160 {
            let mut end = 160;
            while !shown.is_char_boundary(end) {
                end -= 1;
            }
            shown.truncate(end);
            shown.push_str("...");
        }
        panic!(
            "decode/encode is not canonical: a {}-byte header decodes to {shown}, which re-encodes to {} bytes \
             (first difference at byte {first_diff})",
            header.len(),
            encoded.len(),
        );
    }
}
