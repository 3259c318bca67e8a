//! The nccl backend's control channel: what the two ends say over TCP (the bytes themselves go
//! through NCCL). Every message is a kind byte, a `u32` length and a body of at most 64 KiB;
//! decoding checks every length and never panics or allocates more than the body it was given.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::ffi::{UNIQUE_ID_BYTES, UniqueId, version_text};

/// Version of this control protocol (4: batches may move straight between the pools, one NCCL
/// operation per payload, [`Moved::Direct`]; 5: each end states its [`Side::lanes`], and a link's
/// operations go round-robin over that many communicators; 6: a sender granted a transfer may
/// send its layers ahead of their messages, [`Control::Ahead`], which the receiver receives
/// straight into the named blocks and confirms with [`Control::Landed`]).
pub(crate) const VERSION: u16 = 6;
/// Largest control message body.
pub(crate) const MAX_MESSAGE: usize = 64 * 1024;
/// Longest reason text carried (longer ones are cut at a character boundary).
const MAX_REASON: usize = 1024;

const K_HELLO: u8 = 1;
const K_ACCEPT: u8 = 2;
const K_REFUSE: u8 = 3;
const K_MSG: u8 = 4;
// (5 and 6 were protocol 2's go-ahead and send report.)
const K_BATCH: u8 = 7;
const K_AHEAD: u8 = 8;
const K_LANDED: u8 = 9;
/// Most payload messages in one [`Control::Batch`].
pub(crate) const MAX_BATCH: usize = 32;
/// Most operations one [`Control::Ahead`] announces.
pub(crate) const MAX_AHEAD: usize = 4096;

/// What each end states at connect: protocol and NCCL versions, its GPU, its pool's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Side {
    /// Control protocol version ([`VERSION`]).
    pub(crate) version: u16,
    /// NCCL version code this end loaded.
    pub(crate) nccl: i32,
    /// The pool's GPU (`cuDeviceGetUuid`).
    pub(crate) gpu: [u8; 16],
    /// Bytes of one block.
    pub(crate) block_bytes: u64,
    /// Layers of the pool.
    pub(crate) num_layers: u32,
    /// Communicators this end makes per link at most (at least 1); a link has the fewer of its
    /// two ends' (see [`Side::lanes_with`]).
    pub(crate) lanes: u8,
}

const SIDE_BYTES: usize = 2 + 4 + 16 + 8 + 4 + 1;

impl Side {
    fn put(&self, out: &mut Vec<u8>) {
        out.reserve(SIDE_BYTES);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.nccl.to_le_bytes());
        out.extend_from_slice(&self.gpu);
        out.extend_from_slice(&self.block_bytes.to_le_bytes());
        out.extend_from_slice(&self.num_layers.to_le_bytes());
        out.push(self.lanes);
    }

    fn take(r: &mut Cursor<'_>) -> Result<Side, String> {
        Ok(Side {
            version: r.u16()?,
            nccl: r.i32()?,
            gpu: r.take()?,
            block_bytes: r.u64()?,
            num_layers: r.u32()?,
            lanes: r.take::<1>()?[0],
        })
    }

    /// The communicators of a link between this end and `peer`: the fewer of the two ends', at
    /// least 1 (both ends compute the same).
    pub(crate) fn lanes_with(&self, peer: &Side) -> usize {
        usize::from(self.lanes.min(peer.lanes).max(1))
    }

    /// Whether both pools have the same layout (block bytes and layers); a link between pools of
    /// different layouts carries no payload (the connector's handshake refuses it, with the reason).
    pub(crate) fn same_layout(&self, peer: &Side) -> bool {
        self.block_bytes == peer.block_bytes && self.num_layers == peer.num_layers
    }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
pub(crate) fn gpu_name(uuid: &[u8; 16]) -> String {
    let h: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Whether `mine` may open a communicator with `peer`: same control protocol, same NCCL major.minor
/// (NCCL does not promise anything across versions), and two different GPUs (NCCL refuses two ranks
/// on one GPU). Pool layouts are the connector's handshake's to refuse.
pub(crate) fn check_peer(mine: &Side, peer: &Side) -> Result<(), String> {
    if peer.version != mine.version {
        return Err(format!(
            "nccl control protocol: this side speaks {}, the peer {}",
            mine.version, peer.version
        ));
    }
    if peer.nccl / 100 != mine.nccl / 100 {
        return Err(format!(
            "NCCL versions differ: this side loads {}, the peer {} (both ends must load the same NCCL major.minor)",
            version_text(mine.nccl),
            version_text(peer.nccl)
        ));
    }
    if peer.gpu == mine.gpu {
        return Err(format!(
            "both pools are on the same GPU ({}): nccl connects two GPUs (use cuda-ipc within one GPU)",
            gpu_name(&mine.gpu)
        ));
    }
    Ok(())
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Control {
    /// Sender → receiver, first: who is connecting.
    Hello(Side),
    /// Receiver → sender: accepted; the receiver's side and the communicator's rendezvous id.
    Accept(Side, UniqueId),
    /// Receiver → sender: refused, and why.
    Refuse(String),
    /// Either way: one transport message without payload (a connector frame); `payload_len` is
    /// always 0 (payloads travel in batches).
    Msg {
        /// Payload bytes (0; anything else is a protocol error).
        payload_len: u64,
        /// The connector's frame header.
        header: Vec<u8>,
    },
    /// Sender → receiver: up to [`MAX_BATCH`] transport messages whose payloads (each `(payload
    /// bytes, frame header)`, bytes positive) come through NCCL in this order, as `moved` says —
    /// sends already enqueued when this is written, so the receiver always posts the matching
    /// receives, whether it wants the payloads or not.
    Batch {
        /// `(payload bytes, frame header)` of each message.
        items: Vec<(u64, Vec<u8>)>,
        /// How the payloads travel.
        moved: Moved,
    },
    /// Sender → receiver: one NCCL operation per run, in order, already enqueued when this is
    /// written — each run `(layer, first block, blocks)` of the receiver's pool, contiguous, for
    /// a transfer the receiver granted (see docs/rfc-kv-sender-writes.md) — whose messages follow
    /// as [`Moved::Ahead`] batches naming the runs by ticket (`first`, `first + 1`, ...). The
    /// receiver posts a receive straight into each run's blocks.
    Ahead {
        /// The transfer whose blocks the runs are: the receiver posts nothing unless it granted
        /// that transfer to this link and every run lies in its blocks.
        id: u64,
        /// Ticket of the first run.
        first: u64,
        /// `(layer, first block, blocks)` of each run.
        runs: Vec<(u32, u32, u32)>,
    },
    /// Receiver → sender: the receives of every run announced ahead with a ticket below `upto`
    /// finished (nothing of them lands any more).
    Landed {
        /// One past the last ticket landed.
        upto: u64,
    },
}

/// How a [`Control::Batch`]'s payloads travel through NCCL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Moved {
    /// Gathered into the sender's staging buffer and sent as one operation, back to back.
    Staged,
    /// The sender could not stage them: it sends its buffer anyway (one operation of the batch's
    /// bytes, to keep the pair's NCCL operations matched), which is not the payloads.
    StageFailed(String),
    /// One operation per payload, in order, each straight from the sender's pool (its blocks are
    /// contiguous); the receiver receives each straight into its blocks where those are contiguous
    /// too. `corrupt`: the integrity test hook asks the receiver to flip a byte of this payload
    /// once it landed, before it is verified.
    Direct {
        /// Index of the payload to corrupt.
        corrupt: Option<u32>,
    },
    /// No NCCL operation: each payload came through the run of a [`Control::Ahead`] its ticket
    /// names (one ticket per payload, in order). `corrupt` as for [`Moved::Direct`].
    Ahead {
        /// Each payload's ticket.
        tickets: Vec<u64>,
        /// Index of the payload to corrupt.
        corrupt: Option<u32>,
    },
}

fn cut(reason: &str) -> &str {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

impl Control {
    fn kind(&self) -> u8 {
        match self {
            Control::Hello(_) => K_HELLO,
            Control::Accept(..) => K_ACCEPT,
            Control::Refuse(_) => K_REFUSE,
            Control::Msg { .. } => K_MSG,
            Control::Batch { .. } => K_BATCH,
            Control::Ahead { .. } => K_AHEAD,
            Control::Landed { .. } => K_LANDED,
        }
    }

    /// The message on the wire: kind, body length, body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Control::Hello(side) => side.put(&mut body),
            Control::Accept(side, id) => {
                side.put(&mut body);
                body.extend_from_slice(&id.0);
            }
            Control::Refuse(reason) => body.extend_from_slice(cut(reason).as_bytes()),
            Control::Msg {
                payload_len,
                header,
            } => {
                body.extend_from_slice(&payload_len.to_le_bytes());
                body.extend_from_slice(header);
            }
            Control::Batch { items, moved } => {
                body.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for (len, header) in items {
                    body.extend_from_slice(&len.to_le_bytes());
                    body.extend_from_slice(&(header.len() as u32).to_le_bytes());
                    body.extend_from_slice(header);
                }
                match moved {
                    Moved::Staged => body.push(1),
                    Moved::StageFailed(reason) => {
                        body.push(0);
                        body.extend_from_slice(cut(reason).as_bytes());
                    }
                    Moved::Direct { corrupt } => {
                        body.push(2);
                        body.extend_from_slice(&corrupt.unwrap_or(u32::MAX).to_le_bytes());
                    }
                    Moved::Ahead { tickets, corrupt } => {
                        body.push(3);
                        body.extend_from_slice(&corrupt.unwrap_or(u32::MAX).to_le_bytes());
                        for t in tickets {
                            body.extend_from_slice(&t.to_le_bytes());
                        }
                    }
                }
            }
            Control::Ahead { id, first, runs } => {
                body.extend_from_slice(&id.to_le_bytes());
                body.extend_from_slice(&first.to_le_bytes());
                body.extend_from_slice(&(runs.len() as u32).to_le_bytes());
                for (layer, block, count) in runs {
                    body.extend_from_slice(&layer.to_le_bytes());
                    body.extend_from_slice(&block.to_le_bytes());
                    body.extend_from_slice(&count.to_le_bytes());
                }
            }
            Control::Landed { upto } => body.extend_from_slice(&upto.to_le_bytes()),
        }
        let mut out = Vec::with_capacity(5 + body.len());
        out.push(self.kind());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decodes one message's `kind` and `body`.
    pub(crate) fn decode(kind: u8, body: &[u8]) -> Result<Control, String> {
        let mut r = Cursor { buf: body };
        let text =
            |b: &[u8]| cut(&String::from_utf8_lossy(&b[..b.len().min(MAX_REASON)])).to_string();
        let msg = match kind {
            K_HELLO => Control::Hello(Side::take(&mut r)?),
            K_ACCEPT => {
                let side = Side::take(&mut r)?;
                Control::Accept(side, UniqueId(r.take::<UNIQUE_ID_BYTES>()?))
            }
            K_REFUSE => return Ok(Control::Refuse(text(body))),
            K_MSG => {
                let payload_len = r.u64()?;
                return Ok(Control::Msg {
                    payload_len,
                    header: r.buf.to_vec(),
                });
            }
            K_BATCH => {
                let n = r.u32()? as usize;
                if n == 0 || n > MAX_BATCH {
                    return Err(format!("a batch of {n} payloads"));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = r.u64()?;
                    if len == 0 {
                        return Err("an empty payload in a batch".into());
                    }
                    let header_len = r.u32()? as usize;
                    if header_len > r.buf.len() {
                        return Err("nccl control message too short".into());
                    }
                    let (header, rest) = r.buf.split_at(header_len);
                    r.buf = rest;
                    items.push((len, header.to_vec()));
                }
                let moved = match r.u8()? {
                    1 => Moved::Staged,
                    0 => return Ok(Control::Batch { items, moved: Moved::StageFailed(text(r.buf)) }),
                    2 => Moved::Direct { corrupt: corrupt_index(r.u32()?, items.len())? },
                    3 => {
                        let corrupt = corrupt_index(r.u32()?, items.len())?;
                        let tickets = (0..items.len()).map(|_| r.u64()).collect::<Result<Vec<u64>, String>>()?;
                        Moved::Ahead { tickets, corrupt }
                    }
                    b => return Err(format!("a staging verdict of {b}")),
                };
                Control::Batch { items, moved }
            }
            K_AHEAD => {
                let id = r.u64()?;
                let first = r.u64()?;
                let n = r.u32()? as usize;
                if n == 0 || n > MAX_AHEAD {
                    return Err(format!("{n} operations announced ahead"));
                }
                let runs = (0..n)
                    .map(|_| Ok((r.u32()?, r.u32()?, r.u32()?)))
                    .collect::<Result<Vec<(u32, u32, u32)>, String>>()?;
                if runs.iter().any(|&(_, _, count)| count == 0) {
                    return Err("an empty run announced ahead".into());
                }
                if first.checked_add(n as u64).is_none() {
                    return Err("tickets announced ahead overflow".into());
                }
                Control::Ahead { id, first, runs }
            }
            K_LANDED => Control::Landed { upto: r.u64()? },
            k => return Err(format!("unknown nccl control message {k}")),
        };
        if !r.buf.is_empty() {
            return Err(format!(
                "{} stray bytes after nccl control message {kind}",
                r.buf.len()
            ));
        }
        Ok(msg)
    }
}

/// The payload a batch asks to corrupt (`u32::MAX`: none), if it is one of its `n`.
fn corrupt_index(i: u32, n: usize) -> Result<Option<u32>, String> {
    match i {
        u32::MAX => Ok(None),
        i if (i as usize) < n => Ok(Some(i)),
        i => Err(format!("payload {i} of a batch of {n} to corrupt")),
    }
}

/// Writes `msg` whole.
pub(crate) async fn write<W: AsyncWrite + Unpin>(w: &mut W, msg: &Control) -> std::io::Result<()> {
    w.write_all(&msg.encode()).await
}

/// Reads and decodes one message.
pub(crate) async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Control, String> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            "peer closed the connection".to_string()
        } else {
            e.to_string()
        }
    })?;
    let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
    if len > MAX_MESSAGE {
        return Err(format!("a control message of {len} bytes"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| e.to_string())?;
    Control::decode(head[0], &body)
}

/// Reads little-endian fields; running past the end is an error, never a panic.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        if self.buf.len() < N {
            return Err("nccl control message too short".into());
        }
        let (head, tail) = self.buf.split_at(N);
        self.buf = tail;
        Ok(head.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn side(gpu: u8) -> Side {
        Side {
            version: VERSION,
            nccl: 22703,
            gpu: [gpu; 16],
            block_bytes: 65536,
            num_layers: 32,
            lanes: 4,
        }
    }

    fn samples() -> Vec<Control> {
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        vec![
            Control::Hello(side(1)),
            Control::Accept(side(2), UniqueId(id)),
            Control::Refuse("both pools are on the same GPU ✗".into()),
            Control::Msg {
                payload_len: 0,
                header: vec![],
            },
            Control::Msg {
                payload_len: 1 << 24,
                header: vec![7; 300],
            },
            Control::Batch { items: vec![(1 << 23, vec![1; 40])], moved: Moved::Staged },
            Control::Batch { items: vec![(4096, vec![]), (1 << 20, vec![9; 64]), (7, vec![3])], moved: Moved::Staged },
            Control::Batch { items: vec![(8, vec![2; 3])], moved: Moved::StageFailed("the payload is not whole blocks".into()) },
            Control::Batch { items: vec![(4096, vec![]), (1 << 20, vec![9; 64])], moved: Moved::Direct { corrupt: None } },
            Control::Batch { items: vec![(4096, vec![]), (1 << 20, vec![9; 64])], moved: Moved::Direct { corrupt: Some(1) } },
            Control::Batch { items: vec![(4096, vec![1]), (1 << 20, vec![9; 64])], moved: Moved::Ahead { tickets: vec![7, 8], corrupt: None } },
            Control::Batch { items: vec![(1 << 20, vec![9; 64])], moved: Moved::Ahead { tickets: vec![u64::MAX - 1], corrupt: Some(0) } },
            Control::Ahead { id: 3, first: 0, runs: vec![(0, 16, 256)] },
            Control::Ahead { id: u64::MAX, first: 1 << 40, runs: (0..32).map(|l| (l, 4096, 16)).collect() },
            Control::Landed { upto: 0 },
            Control::Landed { upto: 12345 },
        ]
    }

    async fn through_the_wire(msg: &Control) -> Result<Control, String> {
        let bytes = msg.encode();
        read(&mut &bytes[..]).await
    }

    #[tokio::test]
    async fn every_message_round_trips() {
        for m in samples() {
            assert_eq!(through_the_wire(&m).await.unwrap(), m);
        }
    }

    #[tokio::test]
    async fn long_reasons_are_cut_at_a_character() {
        let long = "é".repeat(MAX_REASON);
        let Control::Refuse(back) = through_the_wire(&Control::Refuse(long.clone()))
            .await
            .unwrap()
        else {
            panic!()
        };
        assert!(
            back.len() <= MAX_REASON && long.starts_with(&back),
            "{}",
            back.len()
        );
    }

    #[tokio::test]
    async fn oversized_and_truncated_messages_are_errors() {
        let mut big = vec![K_MSG];
        big.extend_from_slice(&((MAX_MESSAGE + 1) as u32).to_le_bytes());
        assert!(read(&mut &big[..]).await.unwrap_err().contains("bytes"));
        let hello = Control::Hello(side(1)).encode();
        assert!(read(&mut &hello[..hello.len() - 1]).await.is_err());
        // A body one byte longer than its kind takes.
        let mut long = hello.clone();
        long.push(0);
        long[1..5].copy_from_slice(&((SIDE_BYTES + 1) as u32).to_le_bytes());
        assert!(read(&mut &long[..]).await.unwrap_err().contains("stray"));
    }

    #[test]
    fn batches_are_bounded() {
        let batch = |n: usize| Control::Batch { items: (0..n).map(|i| (i as u64 + 1, vec![i as u8])).collect(), moved: Moved::Staged }.encode();
        let full = batch(MAX_BATCH);
        assert!(Control::decode(full[0], &full[5..]).is_ok());
        let over = batch(MAX_BATCH + 1);
        assert!(Control::decode(over[0], &over[5..]).unwrap_err().contains("batch of"));
        let empty = [0u8; 4];
        assert!(Control::decode(K_BATCH, &empty).is_err());
        let zero = Control::Batch { items: vec![(0, vec![])], moved: Moved::Staged }.encode();
        assert!(Control::decode(zero[0], &zero[5..]).unwrap_err().contains("empty payload"));
        // No staging verdict, and a header longer than what is left.
        let mut cut = batch(1);
        cut.truncate(cut.len() - 1);
        assert!(Control::decode(cut[0], &cut[5..]).unwrap_err().contains("too short"));
        cut.truncate(cut.len() - 1);
        assert!(Control::decode(cut[0], &cut[5..]).is_err());
        let mut odd = batch(1);
        *odd.last_mut().unwrap() = 7;
        assert!(Control::decode(odd[0], &odd[5..]).unwrap_err().contains("verdict"));
        // A direct batch names a payload it has to corrupt, or none (u32::MAX); it has its index.
        let direct = |n: usize, corrupt: u32| {
            let mut m = Control::Batch { items: (0..n).map(|i| (i as u64 + 1, vec![i as u8])).collect(), moved: Moved::Direct { corrupt: None } }.encode();
            let at = m.len() - 4;
            m[at..].copy_from_slice(&corrupt.to_le_bytes());
            m
        };
        assert!(matches!(Control::decode(K_BATCH, &direct(3, 2)[5..]), Ok(Control::Batch { moved: Moved::Direct { corrupt: Some(2) }, .. })));
        assert!(Control::decode(K_BATCH, &direct(3, 3)[5..]).unwrap_err().contains("to corrupt"));
        let mut short = direct(3, u32::MAX);
        short.truncate(short.len() - 1);
        assert!(Control::decode(K_BATCH, &short[5..]).is_err());
    }

    #[test]
    fn runs_announced_ahead_are_bounded_and_name_their_payloads() {
        let ahead = |n: usize| Control::Ahead { id: 9, first: 5, runs: (0..n as u32).map(|l| (l, 0, 4)).collect() }.encode();
        let full = ahead(MAX_AHEAD);
        assert!(full.len() - 5 <= MAX_MESSAGE);
        assert!(Control::decode(full[0], &full[5..]).is_ok());
        let over = ahead(MAX_AHEAD + 1);
        assert!(Control::decode(over[0], &over[5..]).unwrap_err().contains("ahead"));
        let none = ahead(0);
        assert!(Control::decode(none[0], &none[5..]).unwrap_err().contains("ahead"));
        let empty = Control::Ahead { id: 9, first: 0, runs: vec![(1, 2, 0)] }.encode();
        assert!(Control::decode(empty[0], &empty[5..]).unwrap_err().contains("empty run"));
        let wraps = Control::Ahead { id: 9, first: u64::MAX, runs: vec![(1, 2, 3)] }.encode();
        assert!(Control::decode(wraps[0], &wraps[5..]).unwrap_err().contains("overflow"));
        let mut cut = ahead(2);
        cut.truncate(cut.len() - 1);
        assert!(Control::decode(cut[0], &cut[5..]).is_err());
        // A batch sent ahead names one ticket per payload: one short is an error, one more stray.
        let batch = Control::Batch { items: vec![(8, vec![1]), (8, vec![2])], moved: Moved::Ahead { tickets: vec![3, 4], corrupt: Some(1) } }.encode();
        assert!(Control::decode(batch[0], &batch[5..]).is_ok());
        assert!(Control::decode(batch[0], &batch[5..batch.len() - 8]).unwrap_err().contains("too short"));
        let mut stray = batch.clone();
        stray.extend_from_slice(&[0; 8]);
        assert!(Control::decode(stray[0], &stray[5..]).unwrap_err().contains("stray"));
        let mut bad = batch.clone();
        let at = bad.len() - 20;
        bad[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
        assert!(Control::decode(bad[0], &bad[5..]).unwrap_err().contains("to corrupt"));
    }

    #[test]
    fn peers_are_checked() {
        let (a, b) = (side(1), side(2));
        assert!(check_peer(&a, &b).is_ok());
        let same = check_peer(&a, &a).unwrap_err();
        assert!(
            same.contains("same GPU") && same.contains("GPU-01010101-0101-0101-0101-010101010101"),
            "{same}"
        );
        let old = Side { nccl: 22605, ..b };
        assert!(check_peer(&a, &old).unwrap_err().contains("2.26.5"));
        // Patch levels may differ.
        assert!(check_peer(&a, &Side { nccl: 22701, ..b }).is_ok());
        assert!(
            check_peer(
                &a,
                &Side {
                    version: VERSION + 1,
                    ..b
                }
            )
            .unwrap_err()
            .contains("protocol")
        );
        // Layouts are not this check's business (the connector's handshake says why they differ).
        assert!(
            check_peer(
                &a,
                &Side {
                    block_bytes: 1,
                    ..b
                }
            )
            .is_ok()
        );
        assert!(
            !a.same_layout(&Side {
                block_bytes: 1,
                ..b
            }) && a.same_layout(&b)
        );
    }

    #[test]
    fn a_link_has_the_fewer_lanes_of_its_two_ends_and_at_least_one() {
        let (a, b) = (side(1), side(2));
        assert_eq!(a.lanes_with(&Side { lanes: 2, ..b }), 2);
        assert_eq!(Side { lanes: 2, ..a }.lanes_with(&b), 2);
        assert_eq!(a.lanes_with(&b), 4);
        assert_eq!(a.lanes_with(&Side { lanes: 0, ..b }), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]
        #[test]
        fn garbage_never_panics(kind in 0u8..10, body in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(m) = Control::decode(kind, &body) {
                // Whatever decodes re-encodes to a message that decodes the same.
                let bytes = m.encode();
                prop_assert_eq!(Control::decode(bytes[0], &bytes[5..]).unwrap(), m);
            }
        }

        #[test]
        fn sides_round_trip(version: u16, nccl: i32, gpu: [u8; 16], block_bytes: u64, num_layers: u32, lanes: u8) {
            let s = Side { version, nccl, gpu, block_bytes, num_layers, lanes };
            let bytes = Control::Hello(s).encode();
            prop_assert_eq!(bytes.len(), 5 + SIDE_BYTES);
            prop_assert_eq!(Control::decode(bytes[0], &bytes[5..]).unwrap(), Control::Hello(s));
        }
    }
}
