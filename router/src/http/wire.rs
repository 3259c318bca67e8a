//! The OpenAI API's JSON shapes (as vLLM serves them): request bodies as they arrive and the
//! responses, chunks and lists the handlers write. Parsing only; what the values mean and whether
//! they are allowed is decided in `request.rs`.
//!
//! Unknown request fields are ignored (vLLM does the same; `user` is one of them); fields whose meaning tandem cannot honour
//! are parsed so that `request.rs` can refuse them instead of silently ignoring them.

use serde::de::IgnoredAny;
use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};

/// `prompt` of `/v1/completions`.
#[derive(Deserialize, Debug)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids or a list of token-id lists"
)]
pub(crate) enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub(crate) enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// `seed`: any 64-bit integer, signed or not.
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(untagged, expecting = "an integer")]
pub(crate) enum SeedInput {
    Unsigned(u64),
    Signed(i64),
}

/// `stream_options`.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: Option<bool>,
}

/// The fields both endpoints share.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct CommonFields {
    pub(crate) model: Option<String>,
    pub(crate) max_tokens: Option<u32>,
    pub(crate) max_completion_tokens: Option<u32>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) n: Option<u32>,
    pub(crate) stream: Option<bool>,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) stop: Option<StopInput>,
    pub(crate) seed: Option<SeedInput>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) frequency_penalty: Option<f32>,
    pub(crate) logit_bias: Option<std::collections::HashMap<String, f32>>,
    // vLLM's extras.
    pub(crate) top_k: Option<i64>,
    pub(crate) min_p: Option<f32>,
    pub(crate) repetition_penalty: Option<f32>,
    pub(crate) ignore_eos: Option<bool>,
    pub(crate) stop_token_ids: Option<Vec<u32>>,
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug)]
pub(crate) struct CompletionRequest {
    pub(crate) prompt: Option<PromptInput>,
    /// Top alternatives per token (0..=20); unset: none.
    pub(crate) logprobs: Option<u32>,
    pub(crate) echo: Option<bool>,
    pub(crate) suffix: Option<String>,
    pub(crate) best_of: Option<u32>,
    #[serde(flatten)]
    pub(crate) common: CommonFields,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug)]
pub(crate) struct ChatRequest {
    pub(crate) messages: Option<Vec<MessageInput>>,
    pub(crate) logprobs: Option<bool>,
    pub(crate) top_logprobs: Option<u32>,
    pub(crate) tools: Option<Vec<IgnoredAny>>,
    pub(crate) functions: Option<Vec<IgnoredAny>>,
    pub(crate) response_format: Option<ResponseFormat>,
    #[serde(flatten)]
    pub(crate) common: CommonFields,
}

/// `response_format`: only `{"type": "text"}` is served.
#[derive(Deserialize, Debug)]
pub(crate) struct ResponseFormat {
    #[serde(rename = "type")]
    pub(crate) kind: String,
}

/// One chat message.
#[derive(Deserialize, Debug)]
pub(crate) struct MessageInput {
    pub(crate) role: String,
    #[serde(default)]
    pub(crate) content: Option<ContentInput>,
}

/// A message's content: a string or a list of parts.
#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or a list of content parts")]
pub(crate) enum ContentInput {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One content part; only `{"type": "text", "text": ...}` is served.
#[derive(Deserialize, Debug)]
pub(crate) struct ContentPart {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) text: Option<String>,
}

/// `usage`.
#[derive(Serialize, Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: u32,
    pub(crate) completion_tokens: u32,
    pub(crate) total_tokens: u32,
    pub(crate) prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Serialize, Debug, Clone, Copy, Default)]
pub(crate) struct PromptTokensDetails {
    /// Prompt tokens served from a decode node's prefix cache.
    pub(crate) cached_tokens: u32,
}

/// A `/v1/completions` response or stream chunk (`object: "text_completion"` for both, as OpenAI).
#[derive(Serialize, Debug)]
pub(crate) struct Completion<'a> {
    pub(crate) id: &'a str,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    pub(crate) choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage: Option<Usage>,
}

/// One choice of a completion (or its delta in a chunk).
#[derive(Serialize, Debug)]
pub(crate) struct CompletionChoice {
    pub(crate) index: u32,
    pub(crate) text: String,
    pub(crate) logprobs: Option<CompletionLogprobs>,
    pub(crate) finish_reason: Option<&'static str>,
}

/// Completion logprobs: parallel lists, one entry per token.
#[derive(Serialize, Debug, Default)]
pub(crate) struct CompletionLogprobs {
    pub(crate) tokens: Vec<String>,
    pub(crate) token_logprobs: Vec<f32>,
    pub(crate) top_logprobs: Vec<TopMap>,
    pub(crate) text_offset: Vec<usize>,
}

/// `{token: logprob, ...}` in the order given (most likely first).
#[derive(Debug, Default)]
pub(crate) struct TopMap(pub(crate) Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

/// A `/v1/chat/completions` response (`chat.completion`) or stream chunk (`chat.completion.chunk`).
#[derive(Serialize, Debug)]
pub(crate) struct ChatCompletion<'a> {
    pub(crate) id: &'a str,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    pub(crate) choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage: Option<Usage>,
}

/// One chat choice: `message` in a response, `delta` in a chunk.
#[derive(Serialize, Debug)]
pub(crate) struct ChatChoice {
    pub(crate) index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) message: Option<ChatMessageOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) delta: Option<ChatDelta>,
    pub(crate) logprobs: Option<ChatLogprobs>,
    pub(crate) finish_reason: Option<&'static str>,
}

/// The assistant's message.
#[derive(Serialize, Debug)]
pub(crate) struct ChatMessageOut {
    pub(crate) role: &'static str,
    pub(crate) content: String,
}

/// A chunk's change to the message.
#[derive(Serialize, Debug, Default)]
pub(crate) struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) content: Option<String>,
}

/// Chat logprobs.
#[derive(Serialize, Debug, Default)]
pub(crate) struct ChatLogprobs {
    pub(crate) content: Vec<ChatTokenLogprob>,
}

/// One token's chat logprob with its alternatives.
#[derive(Serialize, Debug)]
pub(crate) struct ChatTokenLogprob {
    pub(crate) token: String,
    pub(crate) logprob: f32,
    pub(crate) bytes: Vec<u8>,
    pub(crate) top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative.
#[derive(Serialize, Debug)]
pub(crate) struct ChatTopLogprob {
    pub(crate) token: String,
    pub(crate) logprob: f32,
    pub(crate) bytes: Vec<u8>,
}

/// `GET /v1/models`.
#[derive(Serialize, Debug)]
pub(crate) struct ModelList {
    pub(crate) object: &'static str,
    pub(crate) data: Vec<ModelCard>,
}

/// One model, with vLLM's `max_model_len` (absent until a decode node of it answered).
#[derive(Serialize, Debug)]
pub(crate) struct ModelCard {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) owned_by: &'static str,
    pub(crate) root: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_model_len: Option<u32>,
}

/// `GET /health`.
#[derive(Serialize, Debug)]
pub(crate) struct Health {
    pub(crate) serving: bool,
    pub(crate) prefill_nodes: u32,
    pub(crate) decode_nodes: u32,
}
