//! Writes the seed corpora of every fuzz target into `fuzz/corpus/TARGET/seed-*`. The output is
//! deterministic: re-running it rewrites the same files (the committed seeds are its output).
//!
//! Run from the repository root: `cargo run -p tandem-fuzz --example write_seeds`.
//!
//! - `kv_frame`: one `Frame::encode` header per frame kind, two more carrying the longest reason the
//!   encoder emits, the same frames again as `kind ++ body` for the target's sealed read, and one stream
//!   of several frames with a chunk payload between them;
//! - `kv_handshake`: programs for the target's little op language: a whole receive, a receive refused
//!   for its binding, a send answered by HelloAck and Done;
//! - `gguf`: a complete tiny Llama the importer accepts, and a header with nested arrays;
//! - `safetensors`: F32/BF16/F16/I32 tensors, and an index;
//! - `tokenizer`: the tiny test model's files with texts and a chat;
//! - `router_request`: OpenAI completion and chat bodies, and a gRPC message.

use std::path::{Path, PathBuf};

use prost::Message;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use tandem_engine::gguf::{GgmlType, MetaValue, TensorInfo};
use tandem_fuzz::gguf::Writer;
use tandem_kv_transfer::frame::{
    AbortCode, ChunkHeader, Frame, PREFIX_LEN, PROTOCOL_VERSION, blocks_hash, payload_checksum,
};
use tandem_kv_transfer::{DType, Geometry, GeometrySpec, Layout};
use tandem_proto::v1 as api;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn corpus(target: &str) -> Res<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus").join(target);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn main() -> Res<()> {
    kv_frame()?;
    kv_handshake()?;
    gguf()?;
    safetensors()?;
    tokenizer()?;
    router_request()?;
    println!("seeds written under fuzz/corpus/");
    Ok(())
}

fn kv_frame() -> Res<()> {
    let dir = corpus("kv_frame")?;
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
        ("chunk-unsummed", Frame::ChunkUnsummed(ChunkHeader { checksum: 0, ..chunk })),
        ("sums", Frame::Sums { id: 7, sums: vec![chunk.checksum, 1, u64::MAX] }),
        ("done", Frame::Done { id: 7 }),
        ("grant", Frame::Grant { id: 7, blocks_hash: 0x5eed, binding: 0x0b1d }),
        ("fence", Frame::Fence { id: 7 }),
        ("stopped", Frame::Stopped { id: 7 }),
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

    Ok(())
}

fn kv_handshake() -> Res<()> {
    let dir = corpus("kv_handshake")?;
    // Op bytes as `tandem_fuzz::kv_handshake` reads them.
    let expect = [0u8, 2, 1, 3, 0]; // blocks [1, 3], binding 0
    let hello = [1u8, 0, 1, 3]; // new link, right version and geometry
    let start = [2u8, 0, 0, 0]; // transfer 0, right in every field
    let chunk = |layer: u8, fill: u8| [3u8, 0, 0, layer, 0, 1, 1, 1, fill, 1, 1, 1];
    let mut whole = [expect.as_slice(), &hello, &start].concat();
    whole.extend_from_slice(&chunk(0, 0x55));
    whole.extend_from_slice(&chunk(1, 0x66));
    std::fs::write(dir.join("seed-receive"), &whole)?;
    let mut wrong = [expect.as_slice(), &hello, &[2u8, 0, 0, 0b1000]].concat();
    wrong.extend_from_slice(&chunk(0, 0x55));
    std::fs::write(dir.join("seed-wrong-binding"), &wrong)?;
    // Send blocks [2, 3] with id 7, push both layers, answer HelloAck, then Done.
    let mut send = vec![11u8, 2, 2, 2, 7, 0, 0, 0, 0, 0, 0, 0];
    send.extend_from_slice(&[13, 0, 0, 1]);
    send.extend_from_slice(&[12, 0, 0, 12, 0, 1]);
    send.extend_from_slice(&[13, 0, 3]);
    std::fs::write(dir.join("seed-send"), &send)?;
    Ok(())
}

/// The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + rank).expect("U+0100..U+0143 are chars")
    }
}

fn gguf() -> Res<()> {
    let dir = corpus("gguf")?;
    let (h, heads, kv_heads, hd, ffn) = (4u64, 2u64, 1u64, 2u64, 4u64);
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    let merges = ["H e", "l l", "He ll"];
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let vocab = tokens.len() as u64;
    let mut types = vec![3i32; 3];
    types.extend(std::iter::repeat_n(1, tokens.len() - 3));
    let str_array = |v: &[String]| MetaValue::Array(v.iter().map(|s| MetaValue::Str(s.clone())).collect());
    let meta: Vec<(&str, MetaValue)> = vec![
        ("general.architecture", MetaValue::Str("llama".into())),
        ("llama.attention.head_count", MetaValue::U32(heads as u32)),
        ("llama.attention.head_count_kv", MetaValue::U32(kv_heads as u32)),
        ("llama.embedding_length", MetaValue::U32(h as u32)),
        ("llama.feed_forward_length", MetaValue::U32(ffn as u32)),
        ("llama.block_count", MetaValue::U32(1)),
        ("llama.context_length", MetaValue::U32(32)),
        ("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5)),
        ("llama.rope.freq_base", MetaValue::F32(10000.0)),
        ("tokenizer.ggml.model", MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre", MetaValue::Str("smollm".into())),
        ("tokenizer.ggml.tokens", str_array(&tokens)),
        ("tokenizer.ggml.token_type", MetaValue::Array(types.into_iter().map(MetaValue::I32).collect())),
        ("tokenizer.ggml.merges", str_array(&merges.iter().map(|m| m.to_string()).collect::<Vec<_>>())),
        ("tokenizer.ggml.bos_token_id", MetaValue::U32(1)),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(2)),
        ("tokenizer.ggml.add_bos_token", MetaValue::Bool(false)),
        ("tokenizer.chat_template", MetaValue::Str("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".into())),
    ];
    // GGUF dims are innermost first: an HF [rows, cols] matrix is [cols, rows].
    let shapes: Vec<(&str, Vec<u64>)> = vec![
        ("token_embd.weight", vec![h, vocab]),
        ("output_norm.weight", vec![h]),
        ("blk.0.attn_norm.weight", vec![h]),
        ("blk.0.ffn_norm.weight", vec![h]),
        ("blk.0.attn_q.weight", vec![h, heads * hd]),
        ("blk.0.attn_k.weight", vec![h, kv_heads * hd]),
        ("blk.0.attn_v.weight", vec![h, kv_heads * hd]),
        ("blk.0.attn_output.weight", vec![heads * hd, h]),
        ("blk.0.ffn_gate.weight", vec![h, ffn]),
        ("blk.0.ffn_up.weight", vec![h, ffn]),
        ("blk.0.ffn_down.weight", vec![ffn, h]),
    ];
    let mut w = Writer::default();
    w.0.extend_from_slice(b"GGUF");
    w.u32(3);
    w.u64(shapes.len() as u64);
    w.u64(meta.len() as u64);
    for (k, v) in &meta {
        w.kv(k, v);
    }
    let mut offset = 0u64;
    let mut data = Vec::new();
    for (i, (name, dims)) in shapes.iter().enumerate() {
        // F16 and F32 tensors both appear: two dequantizers.
        let f16 = i % 2 == 1;
        let n: u64 = dims.iter().product();
        let t = TensorInfo { name: name.to_string(), dims: dims.clone(), ggml_type: GgmlType(if f16 { 1 } else { 0 }), offset };
        w.tensor(&t);
        for j in 0..n {
            let x = (j % 7) as f32 * 0.125 - 0.25;
            if f16 {
                data.extend_from_slice(&half_bits(x).to_le_bytes());
            } else {
                data.extend_from_slice(&x.to_le_bytes());
            }
        }
        while data.len() % 32 != 0 {
            data.push(0);
        }
        offset = data.len() as u64;
    }
    w.pad(32);
    w.0.extend_from_slice(&data);
    std::fs::write(dir.join("seed-tiny-llama"), &w.0)?;

    // A header with every value type and nested arrays, one tensor of an unconvertible type.
    let mut w = Writer::default();
    w.0.extend_from_slice(b"GGUF");
    w.u32(2);
    w.u64(1);
    let values = vec![
        MetaValue::U8(1),
        MetaValue::I8(-1),
        MetaValue::U16(2),
        MetaValue::I16(-2),
        MetaValue::U32(3),
        MetaValue::I32(-3),
        MetaValue::F32(0.5),
        MetaValue::Bool(true),
        MetaValue::Str("s".into()),
        MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::U64(4), MetaValue::U64(5)]), MetaValue::Array(vec![])]),
        MetaValue::U64(6),
        MetaValue::I64(-6),
        MetaValue::F64(0.25),
        MetaValue::U32(64),
    ];
    w.u64(values.len() as u64);
    for (i, v) in values.iter().enumerate() {
        let key = if i + 1 == values.len() { "general.alignment".to_string() } else { format!("k{i}") };
        w.kv(&key, v);
    }
    w.tensor(&TensorInfo { name: "t".into(), dims: vec![32, 2], ggml_type: GgmlType(39), offset: 0 });
    w.pad(64);
    w.0.extend_from_slice(&[0u8; 64]);
    std::fs::write(dir.join("seed-every-type"), &w.0)?;
    Ok(())
}

/// f32 → IEEE half bits, round to nearest (seed values are exact in f16).
fn half_bits(x: f32) -> u16 {
    if x == 0.0 {
        return 0;
    }
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let man = ((bits >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | man
}

fn safetensors() -> Res<()> {
    let dir = corpus("safetensors")?;
    let f32s: Vec<u8> = [1.5f32, -2.0, 0.0, 3.25].iter().flat_map(|x| x.to_le_bytes()).collect();
    let bf16s: Vec<u8> = [0x3f80u16, 0xc000, 0x7fc0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let f16s: Vec<u8> = [0x3c00u16, 0x0001, 0xfc00].iter().flat_map(|x| x.to_le_bytes()).collect();
    let i32s: Vec<u8> = [7i32, -7].iter().flat_map(|x| x.to_le_bytes()).collect();
    let views = vec![
        ("a", TensorView::new(Dtype::F32, vec![2, 2], &f32s)?),
        ("b", TensorView::new(Dtype::BF16, vec![3], &bf16s)?),
        ("c", TensorView::new(Dtype::F16, vec![1, 3], &f16s)?),
        ("d", TensorView::new(Dtype::I32, vec![2], &i32s)?),
        ("e", TensorView::new(Dtype::F32, vec![0], &[])?),
    ];
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut single = vec![0u8];
    single.extend(safetensors::serialize(views, Some(meta))?);
    std::fs::write(dir.join("seed-dtypes"), single)?;
    let mut shard = vec![0u8];
    shard.extend(tandem_fuzz::safetensors::shard());
    std::fs::write(dir.join("seed-shard"), shard)?;
    std::fs::write(dir.join("seed-index"), b"\x01{\"metadata\": {}, \"weight_map\": {\"x\": \"a.safetensors\"}}")?;
    std::fs::write(dir.join("seed-index-escape"), b"\x01{\"weight_map\": {\"x\": \"../a.safetensors\", \"y\": \"b.safetensors\"}}")?;
    Ok(())
}

fn fixture(name: &str) -> Res<Vec<u8>> {
    Ok(std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama").join(name))?)
}

fn tokenizer() -> Res<()> {
    let dir = corpus("tokenizer")?;
    let sep = b"\n@@\n".as_slice();
    let parts = |template: &[u8], texts: &[&[u8]]| -> Res<Vec<u8>> {
        let mut out = vec![0b10u8];
        let files = [fixture("tokenizer.json")?, fixture("tokenizer_config.json")?, template.to_vec(), fixture("generation_config.json")?, fixture("config.json")?];
        let all: Vec<&[u8]> = files.iter().map(Vec::as_slice).chain(texts.iter().copied()).collect();
        out.extend(all.join(sep));
        Ok(out)
    };
    std::fs::write(dir.join("seed-fixture"), parts(b"", &[b"Hello world", "é ✓ 🦀".as_bytes()])?)?;
    let template = b"{%- for m in messages -%}{%- if m.role == 'system' -%}{{ bos_token }}{%- endif -%}{{ m.role | upper }}: {{ m['content'].strip() }}{{ eos_token }}\n{%- endfor -%}{%- if add_generation_prompt %}ASSISTANT:{% endif -%}";
    std::fs::write(dir.join("seed-template"), parts(template, &[b"be brief", b" hi ", b"hello"])?)?;
    Ok(())
}

fn router_request() -> Res<()> {
    let dir = corpus("router_request")?;
    let mut completion = vec![0u8, 100];
    completion.extend_from_slice(br#"{"model": "m", "prompt": ["Hello", "world"], "n": 2, "seed": 7, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "stop": "x", "logprobs": 2}"#);
    std::fs::write(dir.join("seed-completion"), completion)?;
    let mut tokens = vec![0u8, 10];
    tokens.extend_from_slice(br#"{"prompt": [[1, 2, 3], [4]], "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}"#);
    std::fs::write(dir.join("seed-token-ids"), tokens)?;
    let mut chat = vec![1u8, 120];
    chat.extend_from_slice(br#"{"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}], "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 9, "presence_penalty": 0.5}"#);
    std::fs::write(dir.join("seed-chat"), chat)?;
    let req = api::GenerateRequest {
        model: "m".into(),
        request_id: "client-1".into(),
        prompt: Some(api::generate_request::Prompt::Chat(api::Chat {
            messages: vec![api::ChatMessage { role: "user".into(), content: "hello".into() }],
        })),
        sampling: Some(api::SamplingParams { max_tokens: Some(4), temperature: Some(0.0), ..Default::default() }),
    };
    let mut grpc = vec![2u8, 60];
    grpc.extend(req.encode_to_vec());
    std::fs::write(dir.join("seed-grpc"), grpc)?;
    Ok(())
}
