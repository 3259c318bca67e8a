//! Rebuilds a Hugging Face `tokenizer.json` and `tokenizer_config.json` from a GGUF's
//! `tokenizer.ggml.*` metadata (byte-level BPE, llama.cpp model name `gpt2`).
//!
//! The goal is that the result encodes exactly like the tokenizer transformers builds from the same
//! GGUF: vocabulary entries respelled into the byte alphabet when they are not already, the merges
//! as given, control tokens (type 3) as special added tokens and user-defined ones (type 4) as
//! plain added tokens, and the pre-tokenizer chosen from `tokenizer.ggml.pre`.
//!
//! Invariant: the JSON produced is checked by loading it with the `tokenizers` crate before the
//! import writes it, so an import never leaves an unloadable tokenizer.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde_json::{Map, Value, json};

use super::reader::{GgufFile, MetaValue};
use crate::Result;

/// llama.cpp's token type for control tokens such as `<|im_start|>`.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined added tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
/// The token GPT-2 style tokenizers treat as special by default.
const GPT2_DEFAULT_SPECIAL: &str = "<|endoftext|>";

/// Llama 3 style split: contractions, letters with one leading non-letter, numbers in threes.
const SPLIT_LLAMA3: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
/// Qwen2 style split: like Llama 3 but digits one at a time.
const SPLIT_QWEN2: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
/// Tekken (Mistral) split.
const SPLIT_TEKKEN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
/// GPT-4o style split: case-aware words with contractions attached.
const SPLIT_GPT4O: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// The split regex for a `tokenizer.ggml.pre` value, or `None` for GPT-2's own byte-level regex
/// (which is what `default`, `gpt-2`, `smollm`, `starcoder` and unknown values get).
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "dbrx" | "smaug-bpe" => SPLIT_LLAMA3,
        "qwen2" | "deepseek-r1-qwen" | "megrez" => SPLIT_QWEN2,
        "tekken" => SPLIT_TEKKEN,
        "gpt-4o" | "llama4" | "minimax-m2" => SPLIT_GPT4O,
        _ => return None,
    })
}

/// GPT-2's byte → printable character table: printable Latin-1 bytes stand for themselves, the
/// rest are moved to U+0100 and up, in byte order.
pub(crate) fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

/// Whether `c` is one of the 256 characters of [`byte_alphabet`]: a printable Latin-1 character
/// standing for itself, or one of the 68 stand-ins from U+0100 on.
fn in_byte_alphabet(c: char) -> bool {
    let printable = matches!(c, '!'..='~' | '\u{A1}'..='\u{AC}' | '\u{AE}'..='\u{FF}');
    printable || ('\u{100}'..'\u{144}').contains(&c)
}

/// What the import writes for the tokenizer.
#[derive(Debug)]
pub(crate) struct TokenizerFiles {
    /// `tokenizer.json`.
    pub(crate) tokenizer_json: String,
    /// `tokenizer_config.json`.
    pub(crate) tokenizer_config: Value,
    /// Number of entries in the token list.
    pub(crate) n_tokens: usize,
}

fn string_list<'a>(g: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let arr = v
        .as_array()
        .ok_or_else(|| g.error(format!("metadata {key} is not an array")))?;
    arr.iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str()
                .ok_or_else(|| g.error(format!("metadata {key}[{i}] is not a string")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Builds the tokenizer files from the GGUF metadata.
pub(crate) fn build(g: &GgufFile) -> Result<TokenizerFiles> {
    let model = g
        .get("tokenizer.ggml.model")
        .ok_or_else(|| {
            g.error("metadata tokenizer.ggml.model is missing: the file has no tokenizer")
        })?
        .as_str()
        .ok_or_else(|| g.error("metadata tokenizer.ggml.model is not a string"))?;
    if model != "gpt2" {
        return Err(g.error(format!(
            "tokenizer model {model:?} is not supported (tandem converts byte-level BPE, \"gpt2\")"
        )));
    }
    let tokens = string_list(g, "tokenizer.ggml.tokens")?
        .ok_or_else(|| g.error("metadata tokenizer.ggml.tokens is missing"))?;
    if tokens.is_empty() {
        return Err(g.error("metadata tokenizer.ggml.tokens is empty"));
    }
    let merges = string_list(g, "tokenizer.ggml.merges")?.ok_or_else(|| {
        g.error("metadata tokenizer.ggml.merges is missing (needed for a BPE tokenizer)")
    })?;
    let token_types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(v) => {
            let arr = v
                .as_array()
                .ok_or_else(|| g.error("metadata tokenizer.ggml.token_type is not an array"))?;
            if arr.len() != tokens.len() {
                return Err(g.error(format!(
                    "tokenizer.ggml.token_type has {} entries but there are {} tokens",
                    arr.len(),
                    tokens.len()
                )));
            }
            arr.iter()
                .map(|t| {
                    t.as_i64()
                        .ok_or_else(|| g.error("tokenizer.ggml.token_type holds a non-integer"))
                })
                .collect::<Result<_>>()?
        }
    };

    // Vocabulary, respelled into the byte alphabet where a token uses anything else.
    let alphabet = byte_alphabet();
    let in_alphabet = |s: &str| s.chars().all(in_byte_alphabet);
    let mut vocab: BTreeMap<String, usize> = BTreeMap::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(respell(tok, &alphabet), id);
    }

    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m
            .split_once(' ')
            .filter(|(_, b)| !b.contains(' '))
            .ok_or_else(|| {
                g.error(format!(
                    "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
                ))
            })?;
        merge_pairs.push(json!([a, b]));
    }

    // Added tokens: control tokens spelled in the byte alphabet become special (others are llama.cpp
    // mislabels that would grow the vocabulary), user-defined tokens present in the vocabulary
    // become plain added tokens. GPT-2's default special token joins them when the vocabulary has it.
    let mut added: Vec<(usize, String, bool)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut add = |content: &str, special: bool, added: &mut Vec<(usize, String, bool)>| {
        if let Some(&id) = vocab.get(content)
            && seen.insert(content.to_string())
        {
            added.push((id, content.to_string(), special));
        }
    };
    for (tok, &ty) in tokens.iter().zip(&token_types) {
        if ty == TOKEN_TYPE_CONTROL && in_alphabet(tok) {
            add(tok, true, &mut added);
        }
    }
    add(GPT2_DEFAULT_SPECIAL, true, &mut added);
    for (tok, &ty) in tokens.iter().zip(&token_types) {
        if ty == TOKEN_TYPE_USER_DEFINED {
            add(tok, false, &mut added);
        }
    }
    added.sort_by_key(|(id, _, _)| *id);
    let added_json: Vec<Value> = added
        .iter()
        .map(|(id, content, special)| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": special,
            })
        })
        .collect();

    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(MetaValue::as_str)
        .unwrap_or("default");
    let pre_tokenizer = match split_regex(pre) {
        Some(regex) => json!({
            "type": "Sequence",
            "pretokenizers": [
                { "type": "Split", "pattern": { "Regex": regex }, "behavior": "Isolated", "invert": false },
                { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false },
            ]
        }),
        None => {
            json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true })
        }
    };

    let flag = |key: &str| g.get(key).and_then(MetaValue::as_bool);
    let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(false);
    let add_eos = flag("tokenizer.ggml.add_eos_token").unwrap_or(false);
    // A special token's text, and the id the vocabulary gives that text (which differs from the
    // metadata id only when the token list repeats a string).
    let token_of = |key: &str| -> Result<Option<(&str, usize)>> {
        match g.get(key) {
            None => Ok(None),
            Some(v) => {
                let id = v
                    .as_u64()
                    .ok_or_else(|| g.error(format!("metadata {key} is not a token id")))?;
                let (index, tok) = usize::try_from(id)
                    .ok()
                    .and_then(|i| tokens.get(i).map(|t| (i, *t)))
                    .ok_or_else(|| {
                        g.error(format!(
                            "metadata {key} = {id} is outside the vocabulary of {} tokens",
                            tokens.len()
                        ))
                    })?;
                let vocab_id = vocab
                    .get(&respell(tok, &alphabet))
                    .copied()
                    .unwrap_or(index);
                Ok(Some((tok, vocab_id)))
            }
        }
    };
    let bos = token_of("tokenizer.ggml.bos_token_id")?;
    let eos = token_of("tokenizer.ggml.eos_token_id")?;
    let unk = token_of("tokenizer.ggml.unknown_token_id")?;
    let pad = token_of("tokenizer.ggml.padding_token_id")?;

    let post_processor = template_processing(bos.filter(|_| add_bos), eos.filter(|_| add_eos));

    let vocab_json: Map<String, Value> =
        vocab.iter().map(|(k, &v)| (k.clone(), json!(v))).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_json,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab_json,
            "merges": merge_pairs,
        },
    });
    let tokenizer_json = serde_json::to_string(&tokenizer)
        .map_err(|e| g.error(format!("serializing tokenizer.json failed: {e}")))?;
    tokenizers::Tokenizer::from_str(&tokenizer_json)
        .map_err(|e| g.error(format!("the rebuilt tokenizer does not load: {e}")))?;

    let mut config = json!({
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": g.get("llama.context_length").and_then(MetaValue::as_u64).unwrap_or(2048),
    });
    for (name, tok) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ] {
        config[name] = tok.map_or(Value::Null, |(t, _)| json!(t));
    }
    if let Some(t) = g.get("tokenizer.chat_template") {
        let t = t
            .as_str()
            .ok_or_else(|| g.error("metadata tokenizer.chat_template is not a string"))?;
        config["chat_template"] = json!(t);
    }
    let mut decoder = Map::new();
    for (id, content, special) in &added {
        decoder.insert(
            id.to_string(),
            json!({ "content": content, "lstrip": false, "normalized": false, "rstrip": false,
                    "single_word": false, "special": special }),
        );
    }
    config["added_tokens_decoder"] = Value::Object(decoder);

    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config: config,
        n_tokens: tokens.len(),
    })
}

/// The token as the vocabulary stores it: unchanged if every character is in the byte alphabet,
/// otherwise its UTF-8 bytes spelled in that alphabet.
fn respell(tok: &str, alphabet: &[char; 256]) -> String {
    if tok.chars().all(in_byte_alphabet) {
        tok.to_string()
    } else {
        tok.bytes().map(|b| alphabet[b as usize]).collect()
    }
}

/// A TemplateProcessing post-processor adding `bos` before and `eos` after each sequence.
fn template_processing(bos: Option<(&str, usize)>, eos: Option<(&str, usize)>) -> Value {
    let seq = |id: &str, type_id: u32| json!({ "Sequence": { "id": id, "type_id": type_id } });
    let special =
        |tok: &str, type_id: u32| json!({ "SpecialToken": { "id": tok, "type_id": type_id } });
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Map::new();
    for (sequence, type_id) in [("A", 0u32), ("B", 1)] {
        let target = if sequence == "A" {
            &mut single
        } else {
            &mut pair
        };
        if let Some((t, _)) = bos {
            target.push(special(t, type_id));
        }
        target.push(seq(sequence, type_id));
        if let Some((t, _)) = eos {
            target.push(special(t, type_id));
        }
    }
    let mut pair_full = single.clone();
    pair_full.extend(pair);
    for (t, id) in bos.into_iter().chain(eos) {
        specials.insert(
            t.to_string(),
            json!({ "id": t, "ids": [id], "tokens": [t] }),
        );
    }
    json!({ "type": "TemplateProcessing", "single": single, "pair": pair_full, "special_tokens": specials })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::test_util::{GgufBuilder, tiny_tokenizer};

    fn strs(v: &[&str]) -> MetaValue {
        MetaValue::Array(v.iter().map(|s| MetaValue::Str((*s).to_string())).collect())
    }

    fn open(b: &GgufBuilder) -> (tempfile::TempDir, GgufFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        std::fs::write(&path, b.build()).unwrap();
        let g = GgufFile::open(&path).unwrap();
        (dir, g)
    }

    #[test]
    fn byte_alphabet_is_a_bijection_onto_printables() {
        let a = byte_alphabet();
        let set: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'A' as usize], 'A');
        for c in a {
            assert!(in_byte_alphabet(c), "{c:?}");
        }
        assert!(!in_byte_alphabet(' '));
        assert!(!in_byte_alphabet('\u{144}'));
        assert!(!in_byte_alphabet('\u{AD}'));
    }

    #[test]
    fn tiny_tokenizer_encodes_with_merges_and_specials() {
        let mut b = GgufBuilder::new(3);
        let tokens = tiny_tokenizer(&mut b, false, "smollm");
        let (_d, g) = open(&b);
        let files = build(&g).unwrap();
        let tok = tokenizers::Tokenizer::from_str(&files.tokenizer_json).unwrap();
        let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u32;
        let enc = tok
            .encode("<|im_start|>Hello world<|im_end|><think>", false)
            .unwrap();
        assert_eq!(
            enc.get_ids(),
            &[1, id("Hello"), id("Ġworld"), 2, id("<think>")]
        );
        let dec = tok.decode(enc.get_ids(), false).unwrap();
        assert_eq!(dec, "<|im_start|>Hello world<|im_end|><think>");
        // Specials are skipped on request, user-defined tokens are not.
        assert_eq!(
            tok.decode(enc.get_ids(), true).unwrap(),
            "Hello world<think>"
        );
        // Bytes outside ASCII go through the byte alphabet.
        let enc = tok.encode("é", false).unwrap();
        let alpha = byte_alphabet();
        assert_eq!(
            enc.get_ids(),
            &[id(&alpha[0xC3].to_string()), id(&alpha[0xA9].to_string())]
        );
        assert_eq!(files.tokenizer_config["eos_token"], "<|im_end|>");
        assert_eq!(files.tokenizer_config["add_bos_token"], false);
        assert!(
            files.tokenizer_config["chat_template"]
                .as_str()
                .unwrap()
                .contains("im_start")
        );
        assert_eq!(files.n_tokens, tokens.len());
    }

    #[test]
    fn add_bos_token_adds_bos() {
        let mut b = GgufBuilder::new(3);
        tiny_tokenizer(&mut b, true, "smollm");
        let (_d, g) = open(&b);
        let files = build(&g).unwrap();
        let tok = tokenizers::Tokenizer::from_str(&files.tokenizer_json).unwrap();
        let enc = tok.encode("Hello", true).unwrap();
        assert_eq!(enc.get_ids()[0], 1);
        assert_eq!(enc.get_ids().len(), 2);
        assert_eq!(tok.encode("Hello", false).unwrap().get_ids().len(), 1);
    }

    #[test]
    fn known_pre_tokenizer_uses_its_split() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let splits = |pre: &str| {
            let mut b = GgufBuilder::new(3);
            tiny_tokenizer(&mut b, false, pre);
            let (_d, g) = open(&b);
            let tok = tokenizers::Tokenizer::from_str(&build(&g).unwrap().tokenizer_json).unwrap();
            let mut s = PreTokenizedString::from("abc 12345");
            tok.get_pre_tokenizer()
                .unwrap()
                .pre_tokenize(&mut s)
                .unwrap();
            s.get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(piece, _, _)| piece.to_string())
                .collect::<Vec<_>>()
        };
        // GPT-2's regex keeps a run of digits whole with its leading space; Llama 3's cuts it in
        // threes and leaves the space alone.
        assert_eq!(splits("smollm"), vec!["abc", "Ġ12345"]);
        assert_eq!(splits("llama-bpe"), vec!["abc", "Ġ", "123", "45"]);
        assert_eq!(splits("qwen2"), vec!["abc", "Ġ", "1", "2", "3", "4", "5"]);
    }

    #[test]
    fn rejects_other_tokenizer_models_and_bad_merges() {
        let mut b = GgufBuilder::new(3);
        b.kv("tokenizer.ggml.model", MetaValue::Str("llama".into()));
        let (_d, g) = open(&b);
        assert!(
            build(&g)
                .unwrap_err()
                .to_string()
                .contains("\"llama\" is not supported")
        );

        let mut b = GgufBuilder::new(3);
        b.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
        b.kv("tokenizer.ggml.tokens", strs(&["a", "b"]));
        b.kv("tokenizer.ggml.merges", strs(&["ab"]));
        let (_d, g) = open(&b);
        assert!(
            build(&g)
                .unwrap_err()
                .to_string()
                .contains("not two tokens")
        );

        let mut b = GgufBuilder::new(3);
        b.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
        b.kv("tokenizer.ggml.tokens", strs(&["a", "b"]));
        b.kv("tokenizer.ggml.merges", strs(&[]));
        b.kv("tokenizer.ggml.eos_token_id", MetaValue::U32(9));
        let (_d, g) = open(&b);
        assert!(
            build(&g)
                .unwrap_err()
                .to_string()
                .contains("outside the vocabulary")
        );
    }

    #[test]
    fn tokens_outside_the_alphabet_are_respelled() {
        let mut b = GgufBuilder::new(3);
        b.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
        // "a b" contains a real space (outside the alphabet): it is stored as "aĠb".
        b.kv("tokenizer.ggml.tokens", strs(&["a", "b", "Ġ", "a b"]));
        b.kv("tokenizer.ggml.merges", strs(&[]));
        let (_d, g) = open(&b);
        let files = build(&g).unwrap();
        let v: Value = serde_json::from_str(&files.tokenizer_json).unwrap();
        assert_eq!(v["model"]["vocab"]["aĠb"], 3);
        assert!(v["model"]["vocab"].get("a b").is_none());
    }
}
