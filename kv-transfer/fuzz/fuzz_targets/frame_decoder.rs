//! Fuzzes the KV-transfer frame decoder (`tandem_kv_transfer::frame`) with arbitrary bytes.
//!
//! The input is read twice:
//! 1. as a TCP byte stream, the way `transport/tcp.rs` reads it: a fixed prefix, `remaining_len` more
//!    header bytes, `decode`, and for a `Chunk` its `byte_len` payload bytes skipped; repeated until the
//!    input runs out or a frame is refused (a real receiver closes the link on the first bad frame);
//! 2. as one complete header handed straight to `Frame::decode`.
//!
//! Invariants asserted (any failure is a bug in frame.rs, not in this target):
//! - `remaining_len` never asks for more than `MAX_HEADER` header bytes in total, so a receiver's header
//!   buffer is bounded whatever the peer sends; this target reads headers into a fixed
//!   `MAX_HEADER`-byte buffer and allocates nothing sized by the input;
//! - a header that decodes re-encodes to exactly the same bytes (the encoding is canonical: no two
//!   distinct headers decode to the same frame, and nothing decodable is lost on re-encoding);
//! - decoding never panics (libFuzzer reports any panic as a crash).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_kv_transfer::frame::{Frame, MAX_HEADER, PREFIX_LEN};

fuzz_target!(|data: &[u8]| {
    read_stream(data);
    if let Ok(frame) = Frame::decode(data) {
        assert_canonical(&frame, data);
    }
});

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
