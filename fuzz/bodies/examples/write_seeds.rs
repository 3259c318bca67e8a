//! Writes the seed corpus of the `frame_decoder` fuzz target: one valid header per frame kind made by
//! `Frame::encode`, two more carrying the longest reason the encoder emits, the same frames again as
//! `kind ++ body` for the target's sealed read, and one stream of several frames with a chunk payload
//! between them.
//!
//! Run once from `kv-transfer/fuzz`: `cargo run --example write_seeds`. The output is deterministic,
//! so re-running it rewrites the same files (the committed seeds are its output).

use std::path::Path;

use tandem_kv_transfer::frame::{
    AbortCode, ChunkHeader, Frame, PREFIX_LEN, PROTOCOL_VERSION, blocks_hash, payload_checksum,
};
use tandem_kv_transfer::{DType, Geometry, GeometrySpec, Layout};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/frame_decoder");
    std::fs::create_dir_all(&dir)?;

    let geometry = Geometry::new(GeometrySpec {
        model_id: "smollm2-135m".into(),
        dtype: DType::F32,
        block_size: 16,
        num_layers: 30,
        num_kv_heads: 3,
        head_dim: 64,
        layout: Layout::KvHeadTokenDim,
    })?;
    let payload: Vec<u8> = (0..48u8).collect();
    let chunk = ChunkHeader {
        id: 7,
        layer: 2,
        block_start: 0,
        block_count: 3,
        byte_len: payload.len() as u64,
        checksum: payload_checksum([payload.as_slice()]),
    };
    let start = Frame::Start { id: 7, num_blocks: 3, blocks_hash: blocks_hash(&[4, 5, 6]), binding: 9 };

    let singles = [
        ("hello", Frame::Hello { version: PROTOCOL_VERSION, geometry }),
        ("hello-ack", Frame::HelloAck { version: PROTOCOL_VERSION }),
        ("hello-reject", Frame::HelloReject { reason: "block_size 16 != 32".into() }),
        ("start", start.clone()),
        ("chunk", Frame::Chunk(chunk)),
        ("done", Frame::Done { id: 7 }),
        ("abort", Frame::Abort { id: 7, code: AbortCode::Timeout, reason: "deadline passed".into() }),
        // The encoder cuts reasons to its limit: these are the longest reasons it emits.
        ("hello-reject-long", Frame::HelloReject { reason: "r".repeat(5000) }),
        ("abort-long", Frame::Abort { id: 8, code: AbortCode::Internal, reason: "é".repeat(2500) }),
    ];
    for (name, frame) in &singles {
        let header = frame.encode();
        // The target's "sealed" read takes `kind ++ body` and adds prefix and trailer itself.
        let mut sealed = vec![header[4]];
        sealed.extend_from_slice(&header[PREFIX_LEN..header.len() - 4]);
        std::fs::write(dir.join(format!("seed-{name}")), header)?;
        std::fs::write(dir.join(format!("seed-sealed-{name}")), sealed)?;
    }

    // What a receiver sees on one link: start, a chunk header and its payload, done.
    let mut stream = start.encode();
    stream.extend_from_slice(&Frame::Chunk(chunk).encode());
    stream.extend_from_slice(&payload);
    stream.extend_from_slice(&Frame::Done { id: 7 }.encode());
    std::fs::write(dir.join("seed-stream"), stream)?;

    println!("wrote {} seeds to {}", 2 * singles.len() + 1, dir.display());
    Ok(())
}
