//! The plugin's private wire format, and the blocking I/O loops that move it.
//!
//! One message on a link is a 16-byte prefix, the header bytes, then the payload bytes:
//!
//! ```text
//! magic "TKV1" (4 bytes) | header_len: u32 LE | payload_len: u64 LE | header | payload
//! ```
//!
//! Only two instances of this plugin ever read it; tandem never sees it. Invariants: a prefix is
//! accepted only with the right magic and `header_len <= TANDEM_KV_MAX_HEADER`, so nothing is ever
//! sized from an unchecked length; the payload length is never used to allocate (the payload goes into
//! host memory or through a fixed buffer, see `reader.rs`).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};

use crate::abi;

/// Bytes before each header.
pub(crate) const PREFIX_LEN: usize = 16;
/// First four bytes of every prefix; random bytes on the socket fail here.
const MAGIC: [u8; 4] = *b"TKV1";
/// `TANDEM_KV_MAX_HEADER` as a length.
pub(crate) const MAX_HEADER: usize = abi::TANDEM_KV_MAX_HEADER as usize;

/// The fixed-size part of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Prefix {
    /// Header bytes that follow; at most [`MAX_HEADER`].
    pub(crate) header_len: u32,
    /// Payload bytes after the header.
    pub(crate) payload_len: u64,
}

impl Prefix {
    /// The bytes on the wire.
    pub(crate) fn encode(self) -> [u8; PREFIX_LEN] {
        let mut bytes = [0u8; PREFIX_LEN];
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4..8].copy_from_slice(&self.header_len.to_le_bytes());
        bytes[8..].copy_from_slice(&self.payload_len.to_le_bytes());
        bytes
    }

    /// Checks and decodes a prefix; the error says why the bytes make no sense.
    pub(crate) fn decode(bytes: &[u8; PREFIX_LEN]) -> Result<Prefix, String> {
        let [
            m0,
            m1,
            m2,
            m3,
            h0,
            h1,
            h2,
            h3,
            p0,
            p1,
            p2,
            p3,
            p4,
            p5,
            p6,
            p7,
        ] = *bytes;
        let magic = [m0, m1, m2, m3];
        if magic != MAGIC {
            return Err(format!(
                "bad magic {magic:02x?} (not a tandem-kv-uds peer?)"
            ));
        }
        let header_len = u32::from_le_bytes([h0, h1, h2, h3]);
        let payload_len = u64::from_le_bytes([p0, p1, p2, p3, p4, p5, p6, p7]);
        if header_len > abi::TANDEM_KV_MAX_HEADER {
            return Err(format!(
                "header_len {header_len} exceeds TANDEM_KV_MAX_HEADER"
            ));
        }
        Ok(Prefix {
            header_len,
            payload_len,
        })
    }
}

/// Reads one prefix. `Ok(None)` is a clean end of stream before its first byte; an end of stream
/// inside the prefix is `UnexpectedEof`.
pub(crate) fn read_prefix(mut reader: impl Read) -> io::Result<Option<[u8; PREFIX_LEN]>> {
    let mut bytes = [0u8; PREFIX_LEN];
    let mut filled = 0;
    while filled < PREFIX_LEN {
        match reader.read(&mut bytes[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "end of stream inside a prefix",
                ));
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(bytes))
}

/// Writes every byte of `bufs`, in order, with as few `writev` calls as the socket allows.
pub(crate) fn write_all_vectored(
    mut writer: impl Write,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0); // skips leading empty slices
    while !bufs.is_empty() {
        match writer.write_vectored(bufs) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket accepted no bytes",
                ));
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills every byte of `bufs`, in order; an end of stream first is `UnexpectedEof`.
pub(crate) fn read_exact_vectored(
    mut reader: impl Read,
    mut bufs: &mut [IoSliceMut<'_>],
) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match reader.read_vectored(bufs) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "end of stream inside a payload",
                ));
            }
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops exactly `len` bytes through a small fixed buffer.
pub(crate) fn drain(reader: impl Read, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut reader.take(len), &mut io::sink())?;
    if copied == len {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "end of stream inside a discarded payload",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_round_trips_and_is_little_endian() {
        let prefix = Prefix {
            header_len: 0x0102,
            payload_len: 0x0a0b_0c0d_0e0f_1011,
        };
        let bytes = prefix.encode();
        assert_eq!(&bytes[..4], b"TKV1");
        assert_eq!(&bytes[4..8], &[0x02, 0x01, 0, 0]);
        assert_eq!(
            &bytes[8..],
            &[0x11, 0x10, 0x0f, 0x0e, 0x0d, 0x0c, 0x0b, 0x0a]
        );
        assert_eq!(Prefix::decode(&bytes), Ok(prefix));
        let max = Prefix {
            header_len: abi::TANDEM_KV_MAX_HEADER,
            payload_len: u64::MAX,
        };
        assert_eq!(Prefix::decode(&max.encode()), Ok(max));
    }

    #[test]
    fn nonsense_prefixes_are_rejected() {
        let mut bytes = Prefix {
            header_len: abi::TANDEM_KV_MAX_HEADER + 1,
            payload_len: 0,
        }
        .encode();
        assert!(Prefix::decode(&bytes).unwrap_err().contains("exceeds"));
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Prefix::decode(&bytes).is_err());
        let mut bytes = Prefix {
            header_len: 1,
            payload_len: 1,
        }
        .encode();
        bytes[0] = b'X';
        assert!(Prefix::decode(&bytes).unwrap_err().contains("magic"));
    }

    #[test]
    fn read_prefix_tells_clean_eof_from_truncation() {
        assert!(read_prefix(&[][..]).unwrap().is_none());
        let err = read_prefix(&[1u8, 2, 3][..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let bytes = Prefix {
            header_len: 3,
            payload_len: 9,
        }
        .encode();
        assert_eq!(read_prefix(&bytes[..]).unwrap(), Some(bytes));
    }

    /// A writer that takes at most 3 bytes per call, to exercise partial vectored writes.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(3);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_io_survives_partial_transfers() {
        let mut out = Trickle(Vec::new());
        let pieces: [&[u8]; 4] = [b"", b"hello", b"", b" world!"];
        let mut bufs: Vec<IoSlice<'_>> = pieces.iter().map(|p| IoSlice::new(p)).collect();
        write_all_vectored(&mut out, &mut bufs).unwrap();
        assert_eq!(out.0, b"hello world!");

        let (mut a, mut b) = ([0u8; 5], [0u8; 7]);
        let mut bufs = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
        read_exact_vectored(&b"hello world!"[..], &mut bufs).unwrap();
        assert_eq!((&a, &b), (b"hello", b" world!"));

        let mut c = [0u8; 4];
        let err = read_exact_vectored(&b"abc"[..], &mut [IoSliceMut::new(&mut c)]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn drain_reads_exactly_len() {
        let data = vec![7u8; 100_000];
        let mut reader = &data[..];
        drain(&mut reader, 99_999).unwrap();
        assert_eq!(reader, &[7u8]);
        assert_eq!(
            drain(&data[..10], 11).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
