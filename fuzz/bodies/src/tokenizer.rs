//! Target `tokenizer`: a model's tokenizer files as the engine (and the router, which gets them from a
//! node) loads them, `tandem_engine::tokenizer::Tokenizer::from_files`, then encoding, decoding and
//! chat-template rendering with arbitrary messages.
//!
//! Input: a control byte, then parts separated by the line `@@` (see [`crate::split_parts`]):
//! `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`,
//! `config.json` (an empty part is an absent file), then texts: each is encoded, and together they are
//! the contents of a chat whose roles the control byte's bits pick (or, for bit 7, that part's first
//! line).
//!
//! Invariants asserted:
//! - loading keeps at most 256 bytes live per input byte (plus 8 MiB);
//! - every id `encode` returns is below `vocab_size()` (the engine sizes and checks everything by it),
//!   with or without special tokens, and for rendered chats; `decode` of any ids never fails on ids
//!   outside the vocabulary (they are skipped);
//! - rendering a chat template never panics, whatever the template and the messages; a render either
//!   fails with a chat-template error or returns text.

use tandem_engine::tokenizer::{ChatMessage, Tokenizer, TokenizerFiles};

use crate::alloc;

/// Roles picked by the control byte.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// The target.
pub fn run(data: &[u8]) {
    let Some((&control, rest)) = data.split_first() else { return };
    let parts = crate::split_parts(rest);
    let text = |i: usize| parts.get(i).map(|p| String::from_utf8_lossy(p).into_owned());
    let optional = |i: usize| text(i).filter(|t| !t.is_empty());
    let files = TokenizerFiles {
        tokenizer_json: text(0).unwrap_or_default(),
        tokenizer_config_json: optional(1),
        chat_template_jinja: optional(2),
        generation_config_json: optional(3),
        config_json: optional(4),
    };
    let loaded = alloc::bounded("Tokenizer::from_files", data.len(), 256, 8 << 20, || Tokenizer::from_files(&files));
    let Ok(tok) = loaded else { return };
    let vocab = tok.vocab_size();
    let check_ids = |ids: &[u32], what: &str| {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            panic!("{what} produced id {bad}, outside the vocabulary of {vocab}");
        }
    };

    let texts: Vec<String> = parts.iter().skip(5).map(|p| String::from_utf8_lossy(p).into_owned()).collect();
    for t in &texts {
        for special in [false, true] {
            if let Ok(ids) = tok.encode(t, special) {
                check_ids(&ids, "encode");
                let _ = tok.decode(&ids, special);
            }
        }
    }
    // Ids from the input, in and out of the vocabulary: decoding skips what it does not know.
    let raw: Vec<u32> = rest.chunks_exact(4).take(64).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % (vocab as u32 + 8).max(1)).collect();
    let _ = tok.decode(&raw, control & 1 == 0);
    for id in &raw {
        let _ = tok.id_to_token(*id);
    }

    let messages: Vec<ChatMessage> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if control & 0x80 != 0 {
                let (role, content) = t.split_once('\n').unwrap_or((t, ""));
                ChatMessage::new(role, content)
            } else {
                ChatMessage::new(ROLES[(usize::from(control >> 1) + i) % ROLES.len()], t.clone())
            }
        })
        .collect();
    for add_generation_prompt in [false, true] {
        if let Ok(ids) = tok.encode_chat(&messages, add_generation_prompt) {
            check_ids(&ids, "encode_chat");
        }
    }
}
