//! Target `router_request`: the router's request validation (`tandem_router::http::fuzz`), with the
//! tiny test model's tokenizer (`tests/fixtures/tiny/llama`): a JSON body for `/v1/completions` or
//! `/v1/chat/completions`, or a protobuf `GenerateRequest` for gRPC, through parsing, planning and the
//! checks `Router::route` makes before anything reaches a node.
//!
//! Input: byte 0 picks the API (`% 3`: completions, chat, gRPC), byte 1 the model's context
//! (`1 + 2 * byte`), the rest is the body.
//!
//! Invariants asserted for every request the router lets through:
//! - its request id is at most `MAX_REQUEST_ID` visible ASCII characters; chat roles are system, user
//!   or assistant; text prompts are at most `PROMPT_BYTES_PER_TOKEN` bytes per context token (so
//!   nothing longer is ever tokenized);
//! - its prompt has 1 to `max_model_len` tokens, every id inside the vocabulary for text and chat
//!   prompts, and prompt + `max_tokens` fits the context; its sampling parameters validate;
//! - an HTTP body makes at most `MAX_N` requests;
//! - validation keeps at most 64 bytes live per input byte (plus 4 MiB): nothing is sized by a
//!   number in the request.

use std::sync::OnceLock;

use prost::Message;
use tandem_engine::sampling::MAX_N;
use tandem_engine::tokenizer::{Tokenizer, TokenizerFiles};
use tandem_proto::v1 as api;
use tandem_router::http::fuzz::{Admitted, Api, admit_grpc, admit_http};
use tandem_router::{MAX_REQUEST_ID, PROMPT_BYTES_PER_TOKEN};

use crate::alloc;

/// The tiny test model's tokenizer.
pub fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let files = TokenizerFiles {
            tokenizer_json: include_str!("../../../tests/fixtures/tiny/llama/tokenizer.json").into(),
            tokenizer_config_json: Some(include_str!("../../../tests/fixtures/tiny/llama/tokenizer_config.json").into()),
            chat_template_jinja: None,
            generation_config_json: Some(include_str!("../../../tests/fixtures/tiny/llama/generation_config.json").into()),
            config_json: Some(include_str!("../../../tests/fixtures/tiny/llama/config.json").into()),
        };
        Tokenizer::from_files(&files).expect("the fixture tokenizer loads")
    })
}

/// The target.
pub fn run(data: &[u8]) {
    let tok = tokenizer();
    let Some((&api, rest)) = data.split_first() else { return };
    let Some((&ctx, body)) = rest.split_first() else { return };
    let max_model_len = 1 + 2 * usize::from(ctx);
    let results = alloc::bounded("request validation", data.len(), 64, 4 << 20, || match api % 3 {
        0 => admit_http(Api::Completions, body, tok, max_model_len),
        1 => admit_http(Api::Chat, body, tok, max_model_len),
        _ => match api::GenerateRequest::decode(body) {
            Ok(req) => vec![admit_grpc(req, tok, max_model_len)],
            Err(_) => Vec::new(),
        },
    });
    assert!(results.len() <= MAX_N, "{} requests from one body", results.len());
    for admitted in results.into_iter().flatten() {
        check(&admitted, max_model_len, tok.vocab_size());
    }
}

fn check(a: &Admitted, max_model_len: usize, vocab: usize) {
    use api::generate_request::Prompt;
    let id = &a.request.request_id;
    assert!(id.len() <= MAX_REQUEST_ID && id.bytes().all(|b| b.is_ascii_graphic()), "request id {id:?} let through");
    let text_bytes = match &a.request.prompt {
        Some(Prompt::Text(t)) => Some(t.len()),
        Some(Prompt::Chat(c)) => {
            for m in &c.messages {
                assert!(matches!(m.role.as_str(), "system" | "user" | "assistant"), "role {:?} let through", m.role);
            }
            Some(c.messages.iter().map(|m| m.content.len() + m.role.len()).sum())
        }
        Some(Prompt::TokenIds(_)) => None,
        None => panic!("a request without a prompt let through"),
    };
    if let Some(bytes) = text_bytes {
        assert!(bytes <= max_model_len * PROMPT_BYTES_PER_TOKEN, "{bytes} bytes of prompt text tokenized for a context of {max_model_len}");
        assert!(a.prompt.iter().all(|&id| (id as usize) < vocab), "the tokenizer made an id outside the vocabulary");
    }
    let n = a.prompt.len();
    assert!(n >= 1 && n + a.sampling.max_tokens <= max_model_len, "{n} prompt tokens + {} let through for {max_model_len}", a.sampling.max_tokens);
    assert!(a.sampling.validate().is_ok(), "sampling parameters let through that do not validate: {:?}", a.sampling);
}
