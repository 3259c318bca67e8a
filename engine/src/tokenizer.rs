//! The model's tokenizer: `tokenizer.json` through the `tokenizers` crate, plus what the
//! surrounding HF files add (special tokens, EOS ids, the chat template).
//!
//! Files read from the model directory:
//! - `tokenizer.json` (required): the tokenizer itself;
//! - `tokenizer_config.json` (optional): `chat_template` (a string, or a list of
//!   `{name, template}` of which `default` is used), `bos_token` / `eos_token` (a string or
//!   `{content: ...}`), `add_bos_token`;
//! - `chat_template.jinja` (optional): a template file, which wins over the config's;
//! - `generation_config.json` and `config.json` (optional): `eos_token_id` (an int or a list) and
//!   `bos_token_id`.
//!
//! Those files' contents travel as a [`TokenizerFiles`], so a process without the model
//! directory (a router) builds the same tokenizer from what a node sends it:
//! `from_model_dir(dir)` is exactly `from_files(&TokenizerFiles::read(dir)?)`, error paths
//! aside (errors of `from_files` name the file without a directory).
//!
//! How the engine encodes prompts: a chat prompt is rendered with
//! [`Tokenizer::apply_chat_template`] and encoded with `encode(chat_text, false)` (or both at once
//! with [`Tokenizer::encode_chat`]): the template writes every special token itself, including a
//! BOS where the model wants one, so encoding must not add another. A plain completion prompt is
//! encoded with `encode(text, true)`, which lets the tokenizer add its BOS.
//!
//! Invariants: [`Tokenizer::eos_token_ids`] is the de-duplicated union of the EOS ids named by
//! the three config files, in the order tokenizer_config, generation_config, config; a text
//! that already starts with the BOS text never gets a second BOS from `encode(text, true)`; a
//! chat template that fails to compile does not stop the tokenizer from loading, only
//! `apply_chat_template` reports it.

mod chat_template;
#[cfg(test)]
pub(crate) mod test_support;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::Error;
use chat_template::ChatTemplate;

/// One chat message, as the OpenAI API and HF chat templates see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...; passed to the template unchecked.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A loaded tokenizer with its special tokens and chat template.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
    /// `encode(text, true)` through the post-processor alone starts with the BOS id.
    post_processor_adds_bos: bool,
    /// The compiled template, or why there is none.
    chat_template: Result<ChatTemplate, String>,
}

impl Tokenizer {
    /// Loads the tokenizer of the model in `dir` (see the module doc for the files read).
    ///
    /// Errors: [`Error::ModelDir`] if `tokenizer.json` is missing or a file cannot be read,
    /// [`Error::Tokenizer`] if `tokenizer.json` or `tokenizer_config.json` is invalid,
    /// [`Error::Config`] for an invalid `config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, Error> {
        Self::build(&TokenizerFiles::read(dir)?, Some(dir))
    }

    /// Builds the tokenizer from the files' contents, as [`Self::from_model_dir`] does from
    /// the directory they were read from.
    ///
    /// Errors: [`Error::Tokenizer`] if `tokenizer.json` or `tokenizer_config.json` is invalid,
    /// [`Error::ModelDir`] (naming the file alone) for an invalid `generation_config.json`,
    /// [`Error::Config`] for an invalid `config.json`.
    pub fn from_files(files: &TokenizerFiles) -> Result<Self, Error> {
        Self::build(files, None)
    }

    /// The shared loader; `dir`, when known, only names files in errors and logs.
    fn build(files: &TokenizerFiles, dir: Option<&Path>) -> Result<Self, Error> {
        let file = |name: &str| dir.map_or_else(|| PathBuf::from(name), |d| d.join(name));
        // The tokenizers crate panics ("Helper") on a JSON syntax error inside some sections (the
        // decoder's): check the syntax first so a bad file is an error, never a panic (found by fuzzing).
        serde_json::from_str::<serde::de::IgnoredAny>(&files.tokenizer_json).map_err(|e| {
            Error::Tokenizer(format!("invalid {}: {e}", file(TOKENIZER_JSON).display()))
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(files.tokenizer_json.as_bytes()).map_err(|e| {
            Error::Tokenizer(format!("invalid {}: {e}", file(TOKENIZER_JSON).display()))
        })?;

        let tok_cfg: TokenizerConfigFile = files
            .tokenizer_config_json
            .as_deref()
            .map(|text| {
                serde_json::from_str(text).map_err(|e| {
                    Error::Tokenizer(format!("invalid {}: {e}", file(TOKENIZER_CONFIG_JSON).display()))
                })
            })
            .transpose()?
            .unwrap_or_default();
        let gen_cfg: IdsFile = files
            .generation_config_json
            .as_deref()
            .map(|text| {
                serde_json::from_str(text).map_err(|e| Error::ModelDir {
                    path: file(GENERATION_CONFIG_JSON),
                    reason: format!("invalid JSON: {e}"),
                })
            })
            .transpose()?
            .unwrap_or_default();
        let model_cfg: IdsFile = files
            .config_json
            .as_deref()
            .map(|text| serde_json::from_str(text).map_err(|e| Error::Config(e.to_string())))
            .transpose()?
            .unwrap_or_default();

        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);

        let bos_text = tok_cfg.bos_token.map(TokenField::into_text);
        let eos_text = tok_cfg.eos_token.map(TokenField::into_text);
        let mut eos_token_ids = Vec::new();
        let eos_sources = eos_text
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .chain(
                gen_cfg
                    .eos_token_id
                    .map(IdField::into_ids)
                    .unwrap_or_default(),
            )
            .chain(
                model_cfg
                    .eos_token_id
                    .map(IdField::into_ids)
                    .unwrap_or_default(),
            );
        for id in eos_sources {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let bos_token_id = bos_text
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or_else(|| gen_cfg.bos_token_id.and_then(IdField::first))
            .or_else(|| model_cfg.bos_token_id.and_then(IdField::first));
        let bos_token = bos_text.or_else(|| bos_token_id.and_then(|id| inner.id_to_token(id)));
        let eos_token =
            eos_text.or_else(|| eos_token_ids.first().and_then(|&id| inner.id_to_token(id)));

        let post_processor_adds_bos = match bos_token_id {
            Some(bos) => {
                inner
                    .encode("", true)
                    .map_err(|e| {
                        Error::Tokenizer(format!("encoding the empty string failed: {e}"))
                    })?
                    .get_ids()
                    .first()
                    == Some(&bos)
            }
            None => false,
        };

        let source = match &files.chat_template_jinja {
            Some(text) => Ok(text.clone()),
            None => tok_cfg.chat_template.map_or_else(
                || Err("the model has no chat template".to_string()),
                ChatTemplateField::into_default,
            ),
        };
        let chat_template = source.and_then(ChatTemplate::compile);
        if let Err(why) = &chat_template {
            let dir = dir.map(|d| d.display().to_string()).unwrap_or_default();
            tracing::debug!(%dir, "no usable chat template: {why}");
        }

        Ok(Tokenizer {
            inner,
            vocab_size,
            eos_token_ids,
            bos_token_id,
            bos_token,
            eos_token,
            add_bos_token: tok_cfg.add_bos_token,
            post_processor_adds_bos,
            chat_template,
        })
    }

    /// Encodes `text`. With `add_special_tokens` the tokenizer's post-processor adds its special
    /// tokens (typically a BOS); `add_bos_token` from `tokenizer_config.json`, when present,
    /// decides whether a BOS is added; a text that already starts with the BOS text gets no
    /// BOS added. Use `false` for rendered chat templates (see the module doc).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Error> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens {
            self.adjust_bos(text, &mut ids);
        }
        Ok(ids)
    }

    /// Makes the leading BOS follow `add_bos_token` (default: whatever the post-processor does),
    /// except that a text starting with the BOS text supplies its own and gets none added.
    fn adjust_bos(&self, text: &str, ids: &mut Vec<u32>) {
        let (Some(bos), Some(bos_text)) = (self.bos_token_id, self.bos_token.as_deref()) else {
            return;
        };
        let text_has_bos = !bos_text.is_empty() && text.starts_with(bos_text);
        let want_added =
            self.add_bos_token.unwrap_or(self.post_processor_adds_bos) && !text_has_bos;
        if self.post_processor_adds_bos && !want_added && ids.first() == Some(&bos) {
            ids.remove(0);
        } else if !self.post_processor_adds_bos && want_added {
            ids.insert(0, bos);
        }
    }

    /// Decodes `ids` to text; ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, Error> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("decode failed: {e}")))
    }

    /// Renders the chat template for `messages`, ending with the assistant's turn header when
    /// `add_generation_prompt`. The template sees `messages`, `add_generation_prompt`,
    /// `bos_token`, `eos_token` (empty strings when unknown), `tools` and `documents` (none),
    /// and the functions `raise_exception(msg)` and `strftime_now(format)`.
    ///
    /// Errors: [`Error::ChatTemplate`] if the model has no template, it does not compile, or
    /// rendering fails (including `raise_exception`).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let template = self
            .chat_template
            .as_ref()
            .map_err(|why| Error::ChatTemplate(why.clone()))?;
        template.render(&chat_template::RenderInput {
            messages,
            add_generation_prompt,
            bos_token: self.bos_token.as_deref().unwrap_or(""),
            eos_token: self.eos_token.as_deref().unwrap_or(""),
        })
    }

    /// Renders the chat template and encodes it without adding special tokens (the template
    /// already wrote them).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, Error> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// True when the model ships a chat template that compiled.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_ok()
    }

    /// Token ids that end generation (see the module doc for where they come from); may be
    /// empty if no config names one.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The BOS token id, if the configs name one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The BOS token's text, if known.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The (first) EOS token's text, if known.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Number of token ids, added tokens included: one more than the largest id.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token string for `id` (byte-level tokens come back in their mapped form).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of an exact token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
const GENERATION_CONFIG_JSON: &str = "generation_config.json";
const CONFIG_JSON: &str = "config.json";

/// The contents of every file [`Tokenizer::from_model_dir`] reads (see the module doc), `None`
/// for an optional file the directory lacks. Plain text, so it can be sent to a process without
/// the model directory, which builds the tokenizer with [`Tokenizer::from_files`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerFiles {
    /// `tokenizer.json` (required).
    pub tokenizer_json: String,
    /// `tokenizer_config.json`.
    pub tokenizer_config_json: Option<String>,
    /// `chat_template.jinja`.
    pub chat_template_jinja: Option<String>,
    /// `generation_config.json`.
    pub generation_config_json: Option<String>,
    /// `config.json`.
    pub config_json: Option<String>,
}

impl TokenizerFiles {
    /// Reads the files of the model in `dir`; parses nothing.
    ///
    /// Errors: [`Error::ModelDir`] if `tokenizer.json` is missing, or a file exists but cannot
    /// be read or is not UTF-8.
    pub fn read(dir: &Path) -> Result<Self, Error> {
        let tok_path = dir.join(TOKENIZER_JSON);
        if !tok_path.is_file() {
            return Err(Error::ModelDir {
                path: tok_path,
                reason: "tokenizer.json not found".into(),
            });
        }
        Ok(TokenizerFiles {
            tokenizer_json: read_text(&tok_path)?,
            tokenizer_config_json: read_optional_text(&dir.join(TOKENIZER_CONFIG_JSON))?,
            chat_template_jinja: read_optional_text(&dir.join(CHAT_TEMPLATE_JINJA))?,
            generation_config_json: read_optional_text(&dir.join(GENERATION_CONFIG_JSON))?,
            config_json: read_optional_text(&dir.join(CONFIG_JSON))?,
        })
    }
}

fn read_text(path: &Path) -> Result<String, Error> {
    let bytes = std::fs::read(path).map_err(|e| Error::ModelDir {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    String::from_utf8(bytes).map_err(|_| Error::ModelDir {
        path: path.to_path_buf(),
        reason: "not UTF-8".into(),
    })
}

/// The file's text if it exists.
fn read_optional_text(path: &Path) -> Result<Option<String>, Error> {
    if !path.is_file() {
        return Ok(None);
    }
    read_text(path).map(Some)
}

/// The fields of `tokenizer_config.json` tandem uses; everything else is ignored.
#[derive(Debug, Default, Deserialize)]
struct TokenizerConfigFile {
    #[serde(default)]
    chat_template: Option<ChatTemplateField>,
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    eos_token: Option<TokenField>,
    #[serde(default)]
    add_bos_token: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChatTemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

impl ChatTemplateField {
    fn into_default(self) -> Result<String, String> {
        match self {
            ChatTemplateField::One(t) => Ok(t),
            ChatTemplateField::Named(list) => {
                let names: Vec<String> = list.iter().map(|t| t.name.clone()).collect();
                list.into_iter().find(|t| t.name == "default").map(|t| t.template).ok_or_else(|| {
                    format!("tokenizer_config.json has no chat template named \"default\" (has {names:?})")
                })
            }
        }
    }
}

/// A special token written as `"<s>"` or as `{"content": "<s>", ...}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Object { content: String },
}

impl TokenField {
    fn into_text(self) -> String {
        match self {
            TokenField::Text(t) | TokenField::Object { content: t } => t,
        }
    }
}

/// `eos_token_id` / `bos_token_id` of `generation_config.json` and `config.json`.
#[derive(Debug, Default, Deserialize)]
struct IdsFile {
    #[serde(default)]
    eos_token_id: Option<IdField>,
    #[serde(default)]
    bos_token_id: Option<IdField>,
}

/// A token id written as one integer or a list; ids that are not valid `u32` are dropped.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IdField {
    One(i64),
    Many(Vec<i64>),
}

impl IdField {
    fn into_ids(self) -> Vec<u32> {
        let all = match self {
            IdField::One(id) => vec![id],
            IdField::Many(ids) => ids,
        };
        all.into_iter()
            .filter_map(|id| u32::try_from(id).ok())
            .collect()
    }

    fn first(self) -> Option<u32> {
        self.into_ids().into_iter().next()
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{self, Fixture, bytes_to_chars};
    use super::*;

    fn chatml() -> (tempfile::TempDir, Tokenizer) {
        test_support::default_tokenizer()
    }

    #[test]
    fn tokenizer_and_streaming_state_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Tokenizer>();
        send_sync::<crate::detok::IncrementalDetokenizer>();
        send_sync::<crate::detok::StopMatcher>();
        send_sync::<crate::sampling::Sampler>();
    }

    #[test]
    fn round_trips_text_including_multibyte() {
        let (_d, tok) = chatml();
        for text in [
            "hello the world",
            "你好, 世界!",
            "emoji 😀🎉 mix",
            "",
            "  spaces\n\ttabs ",
        ] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
    }

    #[test]
    fn merges_are_used() {
        let (_d, tok) = chatml();
        let ids = tok.encode("hello", false).unwrap();
        assert_eq!(ids, vec![tok.token_to_id("hello").unwrap()]);
        let ids = tok.encode(" the", false).unwrap();
        assert_eq!(
            ids,
            vec![tok.token_to_id(&bytes_to_chars(b" the")).unwrap()]
        );
    }

    #[test]
    fn special_tokens_encode_as_one_id_and_can_be_skipped() {
        let (_d, tok) = chatml();
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        let ids = tok.encode("hi<|im_end|>", false).unwrap();
        assert_eq!(*ids.last().unwrap(), im_end);
        assert_eq!(tok.decode(&ids, false).unwrap(), "hi<|im_end|>");
        assert_eq!(tok.decode(&ids, true).unwrap(), "hi");
    }

    #[test]
    fn vocab_size_counts_added_tokens_and_unknown_ids_decode_to_nothing() {
        let (_d, tok) = chatml();
        let f = Fixture::default();
        assert_eq!(
            tok.vocab_size(),
            256 + f.merges().len() + test_support::SPECIALS.len()
        );
        assert_eq!(
            tok.id_to_token(tok.vocab_size() as u32 - 1).as_deref(),
            Some("<|im_end|>")
        );
        assert_eq!(tok.id_to_token(tok.vocab_size() as u32), None);
        assert_eq!(
            tok.decode(&[tok.vocab_size() as u32 + 5], false).unwrap(),
            ""
        );
    }

    #[test]
    fn special_ids_from_configs() {
        let (_d, tok) = chatml();
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        let eot = tok.token_to_id("<|endoftext|>").unwrap();
        // tokenizer_config eos first, then generation_config's list, de-duplicated.
        assert_eq!(tok.eos_token_ids(), &[im_end, eot]);
        assert_eq!(tok.bos_token_id(), Some(eot));
        assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    }

    #[test]
    fn ids_from_config_json_when_tokenizer_config_is_silent() {
        let f = Fixture {
            tokenizer_config: Some(serde_json::json!({})),
            generation_config: None,
            config: Some(serde_json::json!({"eos_token_id": [5, -1], "bos_token_id": 7})),
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token_ids(), &[5]);
        assert_eq!(tok.bos_token_id(), Some(7));
        assert_eq!(tok.bos_token(), tok.id_to_token(7).as_deref());
        assert!(!tok.has_chat_template());
    }

    #[test]
    fn token_fields_as_objects_and_named_templates() {
        let f = Fixture {
            tokenizer_config: Some(serde_json::json!({
                "bos_token": {"content": "<|im_start|>", "lstrip": false},
                "eos_token": null,
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}
                ]
            })),
            generation_config: None,
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token(), Some("<|im_start|>"));
        let text = tok
            .apply_chat_template(&[ChatMessage::new("user", "x")], false)
            .unwrap();
        assert_eq!(text, "<|im_start|>x");
    }

    #[test]
    fn named_templates_without_default_is_a_chat_template_error() {
        let f = Fixture {
            tokenizer_config: Some(serde_json::json!({
                "chat_template": [{"name": "tool_use", "template": "T"}]
            })),
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let err = tok.apply_chat_template(&[], true).unwrap_err();
        assert!(
            matches!(&err, Error::ChatTemplate(m) if m.contains("tool_use")),
            "{err}"
        );
    }

    #[test]
    fn chat_template_renders_chatml() {
        let (_d, tok) = chatml();
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "你好"),
        ];
        let text = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let no_gen = tok.apply_chat_template(&msgs[..2], false).unwrap();
        assert_eq!(
            no_gen,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        let ids = tok.encode_chat(&msgs[1..2], true).unwrap();
        let im_start = tok.token_to_id("<|im_start|>").unwrap();
        assert_eq!(ids[0], im_start);
        assert_eq!(ids.iter().filter(|&&t| t == im_start).count(), 2);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chat_template_file_wins_over_config() {
        let f = Fixture {
            template_file: Some("FILE {{ messages | length }}".into()),
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(
            tok.apply_chat_template(&[ChatMessage::new("user", "a")], true)
                .unwrap(),
            "FILE 1"
        );
    }

    #[test]
    fn missing_template_and_failing_template_are_chat_template_errors() {
        let f = Fixture {
            tokenizer_config: None,
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let err = tok
            .apply_chat_template(&[ChatMessage::new("user", "a")], true)
            .unwrap_err();
        assert!(
            matches!(&err, Error::ChatTemplate(m) if m.contains("no chat template")),
            "{err}"
        );

        let f = Fixture {
            tokenizer_config: Some(serde_json::json!({
                "chat_template": "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}ok"
            })),
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let err = tok
            .apply_chat_template(&[ChatMessage::new("user", "a")], true)
            .unwrap_err();
        assert!(
            matches!(&err, Error::ChatTemplate(m) if m.contains("first message must be system")),
            "{err}"
        );
        assert_eq!(
            tok.apply_chat_template(&[ChatMessage::new("system", "a")], true)
                .unwrap(),
            "ok"
        );

        let f = Fixture {
            tokenizer_config: Some(serde_json::json!({"chat_template": "{% for m in messages %}"})),
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert!(!tok.has_chat_template());
        assert!(matches!(
            tok.apply_chat_template(&[], true),
            Err(Error::ChatTemplate(_))
        ));
    }

    /// Found by the fuzzer (`fuzz/corpus/tokenizer/crash-decoder-control-character`): a control
    /// character inside a string of the `decoder` section made the tokenizers crate panic.
    #[test]
    fn a_json_syntax_error_in_the_decoder_is_an_error_not_a_panic() {
        let json = "{\"version\": \"1.0\", \"decoder\": {\"type\": \"By\u{1}teLevel\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}";
        let files = TokenizerFiles {
            tokenizer_json: json.into(),
            tokenizer_config_json: None,
            chat_template_jinja: None,
            generation_config_json: None,
            config_json: None,
        };
        let err = Tokenizer::from_files(&files).expect_err("refused");
        assert!(matches!(err, Error::Tokenizer(_)), "{err}");
    }

    #[test]
    fn missing_tokenizer_json_is_a_model_dir_error() {
        let dir = tempfile::tempdir().unwrap();
        match Tokenizer::from_model_dir(dir.path()) {
            Err(Error::ModelDir { path, reason }) => {
                assert_eq!(path, dir.path().join("tokenizer.json"));
                assert!(reason.contains("not found"));
            }
            other => panic!("expected ModelDir, got {other:?}"),
        }
        let missing = dir.path().join("nope");
        assert!(matches!(
            Tokenizer::from_model_dir(&missing),
            Err(Error::ModelDir { .. })
        ));
    }

    #[test]
    fn invalid_files_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
        assert!(matches!(
            Tokenizer::from_model_dir(dir.path()),
            Err(Error::Tokenizer(_))
        ));
        std::fs::write(
            dir.path().join("tokenizer.json"),
            r#"{"model": {"type": "Nope"}}"#,
        )
        .unwrap();
        assert!(matches!(
            Tokenizer::from_model_dir(dir.path()),
            Err(Error::Tokenizer(_))
        ));

        let dir = Fixture::default().write();
        std::fs::write(dir.path().join("tokenizer_config.json"), "[1, 2").unwrap();
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::Tokenizer(m) if m.contains("tokenizer_config.json")),
            "{err}"
        );

        let dir = Fixture::default().write();
        std::fs::write(dir.path().join("generation_config.json"), "{").unwrap();
        assert!(matches!(
            Tokenizer::from_model_dir(dir.path()),
            Err(Error::ModelDir { .. })
        ));

        let dir = Fixture::default().write();
        std::fs::write(dir.path().join("config.json"), "{\"eos_token_id\": \"x\"}").unwrap();
        assert!(matches!(
            Tokenizer::from_model_dir(dir.path()),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn bos_is_added_once() {
        let f = Fixture {
            bos_post_processor: true,
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let bos = tok.bos_token_id().unwrap();
        let plain = tok.encode("hello", true).unwrap();
        assert_eq!(plain[0], bos);
        assert_eq!(&plain[1..], tok.encode("hello", false).unwrap().as_slice());
        // Text that already carries the BOS text keeps exactly one BOS.
        let with_bos = tok.encode("<|endoftext|>hello", true).unwrap();
        assert_eq!(with_bos, plain);
        // Chat prompts are encoded without special tokens: the template's BOS is the only one.
        let chat = tok.encode("<|endoftext|>hello", false).unwrap();
        assert_eq!(chat, plain);
        // Two BOS written deliberately stay two.
        let two = tok.encode("<|endoftext|><|endoftext|>hello", true).unwrap();
        assert_eq!(two.iter().take_while(|&&t| t == bos).count(), 2);
    }

    #[test]
    fn add_bos_token_flag_overrides_the_post_processor() {
        let mut cfg = Fixture::default().tokenizer_config.unwrap();
        cfg["add_bos_token"] = serde_json::json!(true);
        let f = Fixture {
            tokenizer_config: Some(cfg.clone()),
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let bos = tok.bos_token_id().unwrap();
        assert_eq!(tok.encode("hi", true).unwrap()[0], bos);
        assert_ne!(tok.encode("hi", false).unwrap()[0], bos);

        cfg["add_bos_token"] = serde_json::json!(false);
        let f = Fixture {
            tokenizer_config: Some(cfg),
            bos_post_processor: true,
            ..Fixture::default()
        };
        let dir = f.write();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(
            tok.encode("hi", true).unwrap(),
            tok.encode("hi", false).unwrap()
        );
    }

    /// Everything observable about a tokenizer on `texts`, for comparing two loads.
    fn behaviour(tok: &Tokenizer, texts: &[&str]) -> Vec<String> {
        let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "hello 你好")];
        let mut out = vec![
            format!("{:?} {:?} {:?} {:?}", tok.eos_token_ids(), tok.bos_token_id(), tok.bos_token(), tok.eos_token()),
            format!("{} {}", tok.vocab_size(), tok.has_chat_template()),
            format!("{:?}", tok.apply_chat_template(&msgs, true).map_err(|e| e.to_string())),
            format!("{:?}", tok.encode_chat(&msgs, false).map_err(|e| e.to_string())),
        ];
        for text in texts {
            for special in [false, true] {
                let ids = tok.encode(text, special).unwrap();
                out.push(format!("{ids:?} {:?} {:?}", tok.decode(&ids, false).unwrap(), tok.decode(&ids, true).unwrap()));
            }
        }
        out
    }

    const TEXTS: [&str; 5] = ["hello the world", "<|im_start|>user\nhi<|im_end|>", "你好, 世界!", "", " the hello"];

    #[test]
    fn from_files_equals_from_model_dir_on_the_tiny_model_fixtures() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny");
        for variant in ["llama", "gqa-tied", "llama3-rope", "mistral"] {
            let dir = root.join(variant);
            let files = TokenizerFiles::read(&dir).unwrap();
            assert_eq!(files.tokenizer_json, std::fs::read_to_string(dir.join("tokenizer.json")).unwrap());
            assert!(files.tokenizer_config_json.is_some() && files.generation_config_json.is_some());
            assert!(files.config_json.is_some() && files.chat_template_jinja.is_none());
            let from_dir = Tokenizer::from_model_dir(&dir).unwrap();
            let from_files = Tokenizer::from_files(&files).unwrap();
            assert!(from_dir.has_chat_template(), "{variant}: the fixture ships a template");
            assert!(!from_dir.eos_token_ids().is_empty());
            assert_eq!(behaviour(&from_files, &TEXTS), behaviour(&from_dir, &TEXTS), "{variant}");
        }
    }

    #[test]
    fn from_files_equals_from_model_dir_with_a_template_file_and_bos() {
        for f in [
            Fixture { template_file: Some("T{{ bos_token }}{{ messages | length }}".into()), ..Fixture::default() },
            Fixture { bos_post_processor: true, config: Some(serde_json::json!({"eos_token_id": 7})), ..Fixture::default() },
            Fixture { tokenizer_config: None, generation_config: None, ..Fixture::default() },
        ] {
            let dir = f.write();
            let files = TokenizerFiles::read(dir.path()).unwrap();
            assert_eq!(files.chat_template_jinja, f.template_file);
            assert_eq!(files.tokenizer_config_json.is_some(), f.tokenizer_config.is_some());
            // The contents are all there is: the directory may be gone.
            drop(dir);
            let from_files = Tokenizer::from_files(&files).unwrap();
            let dir = f.write();
            let from_dir = Tokenizer::from_model_dir(dir.path()).unwrap();
            assert_eq!(behaviour(&from_files, &TEXTS), behaviour(&from_dir, &TEXTS), "{f:?}");
        }
    }

    #[test]
    fn from_files_errors_name_the_file_and_read_errors_are_model_dir_errors() {
        let dir = Fixture::default().write();
        let good = TokenizerFiles::read(dir.path()).unwrap();
        let bad_cfg = TokenizerFiles { tokenizer_config_json: Some("[1, 2".into()), ..good.clone() };
        let err = Tokenizer::from_files(&bad_cfg).unwrap_err();
        assert!(matches!(&err, Error::Tokenizer(m) if m.starts_with("invalid tokenizer_config.json")), "{err}");
        let bad_tok = TokenizerFiles { tokenizer_json: "{ not json".into(), ..good.clone() };
        assert!(matches!(Tokenizer::from_files(&bad_tok), Err(Error::Tokenizer(_))));
        let bad_gen = TokenizerFiles { generation_config_json: Some("{".into()), ..good.clone() };
        assert!(matches!(Tokenizer::from_files(&bad_gen), Err(Error::ModelDir { path, .. }) if path == Path::new("generation_config.json")));
        let bad_model = TokenizerFiles { config_json: Some("{\"eos_token_id\": \"x\"}".into()), ..good };
        assert!(matches!(Tokenizer::from_files(&bad_model), Err(Error::Config(_))));

        std::fs::write(dir.path().join("chat_template.jinja"), [0xff, 0xfe]).unwrap();
        assert!(matches!(TokenizerFiles::read(dir.path()), Err(Error::ModelDir { path, .. }) if path.ends_with("chat_template.jinja")));
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(TokenizerFiles::read(empty.path()), Err(Error::ModelDir { .. })));
    }
}
