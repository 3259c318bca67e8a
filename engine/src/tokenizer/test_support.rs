//! Test fixture: a tiny byte-level BPE model directory written to a tempdir.
//!
//! The vocabulary is the 256 byte-level symbols (ids 0..256 in byte order), a few merges (some of
//! which end in the middle of a multi-byte UTF-8 character, so tokens carry partial characters),
//! then the special tokens of [`SPECIALS`]. The default `tokenizer_config.json` carries a ChatML
//! template, BOS `<|endoftext|>` and EOS `<|im_end|>`.

use std::path::Path;

use serde_json::{Value, json};

/// The added special tokens, in id order after the merges.
pub(crate) const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The ChatML template the default fixture ships.
pub(crate) const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards.
pub(crate) fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + rank).expect("U+0100..U+0143 are chars")
    }
}

/// The byte-level token string for raw bytes.
pub(crate) fn bytes_to_chars(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_char(b)).collect()
}

/// What to write into the model directory.
#[derive(Clone, Debug)]
pub(crate) struct Fixture {
    /// `tokenizer_config.json`, if any.
    pub(crate) tokenizer_config: Option<Value>,
    /// `generation_config.json`, if any.
    pub(crate) generation_config: Option<Value>,
    /// `config.json`, if any.
    pub(crate) config: Option<Value>,
    /// `chat_template.jinja`, if any.
    pub(crate) template_file: Option<String>,
    /// Post-processor adds `<|endoftext|>` as BOS (otherwise plain byte-level).
    pub(crate) bos_post_processor: bool,
}

impl Default for Fixture {
    fn default() -> Self {
        Fixture {
            tokenizer_config: Some(json!({
                "chat_template": CHATML,
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
            })),
            generation_config: Some(json!({
                "eos_token_id": [Fixture::special_id(2), Fixture::special_id(0)],
            })),
            config: None,
            template_file: None,
            bos_post_processor: false,
        }
    }
}

impl Fixture {
    /// Merges as byte sequences (left, right), applied in this order.
    pub(crate) fn merges(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let raw: [(&[u8], &[u8]); 10] = [
            (b"h", b"e"),
            (b"l", b"l"),
            (b" ", b"t"),
            (b" t", b"he"),
            (b"he", b"ll"),
            (b"hell", b"o"),
            // 你 = E4 BD A0: first two bytes merge, the last stays alone.
            (&[0xE4], &[0xBD]),
            // 好 = E5 A5 BD: last two bytes merge.
            (&[0xA5], &[0xBD]),
            // 😀 = F0 9F 98 80: first three bytes merge.
            (&[0xF0], &[0x9F]),
            (&[0xF0, 0x9F], &[0x98]),
        ];
        raw.iter().map(|(a, b)| (a.to_vec(), b.to_vec())).collect()
    }

    /// The id of `SPECIALS[i]`.
    pub(crate) fn special_id(i: usize) -> u32 {
        (256 + Fixture::default_merge_count() + i) as u32
    }

    fn default_merge_count() -> usize {
        10
    }

    /// The `tokenizer.json` document.
    pub(crate) fn tokenizer_json(&self) -> Value {
        let merges = self.merges();
        assert_eq!(merges.len(), Fixture::default_merge_count());
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(bytes_to_chars(&[b]), json!(b));
        }
        for (i, (a, b)) in merges.iter().enumerate() {
            let joined = [a.as_slice(), b.as_slice()].concat();
            vocab.insert(bytes_to_chars(&joined), json!(256 + i));
        }
        let merge_list: Vec<Value> = merges
            .iter()
            .map(|(a, b)| json!([bytes_to_chars(a), bytes_to_chars(b)]))
            .collect();
        let added: Vec<Value> = SPECIALS
            .iter()
            .enumerate()
            .map(|(i, s)| {
                json!({
                    "id": Fixture::special_id(i), "content": s, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true
                })
            })
            .collect();
        let byte_level = json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
        });
        let post = if self.bos_post_processor {
            let bos = SPECIALS[0];
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [
                    {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}
                ],
                "special_tokens": {bos: {"id": bos, "ids": [Fixture::special_id(0)], "tokens": [bos]}}
            })
        } else {
            byte_level.clone()
        };
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": post,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merge_list
            }
        })
    }

    /// Writes the model directory and returns it (deleted on drop).
    pub(crate) fn write(&self) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        self.write_into(dir.path());
        dir
    }

    fn write_into(&self, dir: &Path) {
        let put = |name: &str, v: &Value| {
            std::fs::write(
                dir.join(name),
                serde_json::to_string_pretty(v).expect("json"),
            )
            .expect("write fixture file");
        };
        put("tokenizer.json", &self.tokenizer_json());
        if let Some(v) = &self.tokenizer_config {
            put("tokenizer_config.json", v);
        }
        if let Some(v) = &self.generation_config {
            put("generation_config.json", v);
        }
        if let Some(v) = &self.config {
            put("config.json", v);
        }
        if let Some(t) = &self.template_file {
            std::fs::write(dir.join("chat_template.jinja"), t).expect("write template");
        }
    }
}

/// Loads the default fixture: the tokenizer and the directory keeping its files alive.
pub(crate) fn default_tokenizer() -> (tempfile::TempDir, super::Tokenizer) {
    let dir = Fixture::default().write();
    let tok = super::Tokenizer::from_model_dir(dir.path()).expect("fixture loads");
    (dir, tok)
}

#[test]
fn byte_alphabet_matches_the_tokenizers_crate() {
    let mine: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
    let theirs: std::collections::HashSet<char> =
        tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
    assert_eq!(mine, theirs);
    assert_eq!(byte_char(b' '), 'Ġ');
    assert_eq!(byte_char(b'\n'), 'Ċ');
}
