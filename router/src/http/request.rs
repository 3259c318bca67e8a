//! OpenAI request bodies → the router's requests: one `tandem.v1` request per choice, plus what the
//! answer must look like.
//!
//! The cluster serves one sequence per request, so `n` > 1 (and a list of prompts) becomes one request
//! per choice. Choice `k` of a prompt with `seed` s is sampled with seed [`choice_seed`]`(s, k)`, which
//! draws exactly the numbers the engine's sequence `k` of one request with `n` and seed s would draw
//! (`tandem_engine::sampling::sequence_seed`): choice 0 of a seeded request equals the same request
//! with `n` = 1.
//!
//! Defaults follow OpenAI's API, not `tandem generate`: temperature 1, `max_tokens` 16 for completions
//! and the rest of the context for chat.

use tandem_engine::sampling::MAX_N;
use tandem_proto::v1 as api;

use super::error::ApiError;
use super::wire::{
    ChatRequest, CommonFields, CompletionRequest, ContentInput, PromptInput, SeedInput, StopInput,
};
use crate::MaxTokens;

/// Which endpoint a request came in on (it decides the answer's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A validated request: what to ask the router and how to answer.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) endpoint: Endpoint,
    /// One request per choice, in choice order (prompt by prompt, `n` choices each).
    pub(crate) choices: Vec<api::GenerateRequest>,
    /// Choices per prompt (`n`): usage counts each prompt once.
    pub(crate) per_prompt: usize,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// Whether the answer carries logprobs.
    pub(crate) logprobs: bool,
    pub(crate) max_tokens: MaxTokens,
}

/// OpenAI's default `max_tokens` for `/v1/completions`.
const COMPLETION_MAX_TOKENS: u32 = 16;

/// The seed of choice `k` of a request seeded with `seed`: `sequence_seed(choice_seed(s, k), 0) ==
/// sequence_seed(s, k)`, so the cluster's one-sequence requests draw what the engine's `k`-th sequence
/// would.
pub(crate) fn choice_seed(seed: u64, k: usize) -> u64 {
    seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `/v1/completions`.
pub(crate) fn completion_plan(req: CompletionRequest) -> Result<Plan, ApiError> {
    if req.echo == Some(true) {
        return Err(ApiError::invalid(Some("echo"), "echo is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(Some("suffix"), "suffix is not supported"));
    }
    let n = choices_per_prompt(&req.common)?;
    if req.best_of.is_some_and(|b| b as usize != n && b > 1) {
        return Err(ApiError::invalid(
            Some("best_of"),
            "best_of other than n is not supported",
        ));
    }
    let prompts: Vec<api::generate_request::Prompt> = match req.prompt {
        None => return Err(ApiError::invalid(Some("prompt"), "prompt is required")),
        Some(PromptInput::Text(t)) => vec![api::generate_request::Prompt::Text(t)],
        Some(PromptInput::Texts(ts)) => ts
            .into_iter()
            .map(api::generate_request::Prompt::Text)
            .collect(),
        Some(PromptInput::Tokens(ids)) => {
            vec![api::generate_request::Prompt::TokenIds(api::TokenIds {
                ids,
            })]
        }
        Some(PromptInput::TokenLists(lists)) => lists
            .into_iter()
            .map(|ids| api::generate_request::Prompt::TokenIds(api::TokenIds { ids }))
            .collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(Some("prompt"), "prompt is an empty list"));
    }
    let sampling = sampling(&req.common, req.logprobs, Some(COMPLETION_MAX_TOKENS))?;
    plan(Endpoint::Completions, &req.common, prompts, sampling)
}

/// `/v1/chat/completions`.
pub(crate) fn chat_plan(req: ChatRequest) -> Result<Plan, ApiError> {
    if req.tools.as_ref().is_some_and(|t| !t.is_empty())
        || req.functions.as_ref().is_some_and(|f| !f.is_empty())
    {
        return Err(ApiError::invalid(
            Some("tools"),
            "tool calls are not supported",
        ));
    }
    if let Some(f) = &req.response_format
        && f.kind != "text"
    {
        return Err(ApiError::invalid(
            Some("response_format"),
            format!(
                "response_format {:?} is not supported (only \"text\")",
                f.kind
            ),
        ));
    }
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "top_logprobs needs logprobs: true",
            ));
        }
        (false, _) => None,
        (true, k) => Some(k.unwrap_or(0)),
    };
    let Some(input) = req.messages else {
        return Err(ApiError::invalid(Some("messages"), "messages is required"));
    };
    if input.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "messages is empty"));
    }
    let mut messages = Vec::with_capacity(input.len());
    for m in input {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::invalid(
                Some("messages"),
                format!(
                    "role {:?} is not supported (system, user, assistant)",
                    m.role
                ),
            ));
        }
        let content = match m.content {
            None => String::new(),
            Some(ContentInput::Text(t)) => t,
            Some(ContentInput::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                Some("messages"),
                                format!("content part {kind:?} is not supported (text only)"),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(api::ChatMessage {
            role: m.role,
            content,
        });
    }
    let prompts = vec![api::generate_request::Prompt::Chat(api::Chat { messages })];
    let sampling = sampling(&req.common, logprobs, None)?;
    plan(Endpoint::Chat, &req.common, prompts, sampling)
}

fn choices_per_prompt(c: &CommonFields) -> Result<usize, ApiError> {
    match c.n.unwrap_or(1) {
        0 => Err(ApiError::invalid(Some("n"), "n must be at least 1")),
        n => Ok(n as usize),
    }
}

/// One request per prompt and choice, each choice `k` with its own seed.
fn plan(
    endpoint: Endpoint,
    c: &CommonFields,
    prompts: Vec<api::generate_request::Prompt>,
    sampling: api::SamplingParams,
) -> Result<Plan, ApiError> {
    let n = choices_per_prompt(c)?;
    let total = prompts.len().saturating_mul(n);
    if total > MAX_N {
        return Err(ApiError::invalid(
            Some("n"),
            format!("{total} choices asked (prompts × n); at most {MAX_N} are served per request"),
        ));
    }
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            Some("stream_options"),
            "stream_options is only allowed when stream is true",
        ));
    }
    let include_usage = c
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let model = c.model.clone().unwrap_or_default();
    let logprobs = sampling.logprobs.is_some();
    let max_tokens = match endpoint {
        Endpoint::Completions => MaxTokens::EngineDefault, // always set: OpenAI's default is 16
        Endpoint::Chat => MaxTokens::RestOfContext,
    };
    let mut choices = Vec::with_capacity(total);
    for prompt in prompts {
        for k in 0..n {
            let mut sampling = sampling.clone();
            sampling.seed = sampling.seed.map(|s| choice_seed(s, k));
            choices.push(api::GenerateRequest {
                model: model.clone(),
                prompt: Some(prompt.clone()),
                sampling: Some(sampling),
                request_id: String::new(),
            });
        }
    }
    Ok(Plan {
        endpoint,
        choices,
        per_prompt: n,
        stream,
        include_usage,
        logprobs,
        max_tokens,
    })
}

/// The sampling parameters both endpoints share; `logprobs` is the number of alternatives asked for.
fn sampling(
    c: &CommonFields,
    logprobs: Option<u32>,
    default_max_tokens: Option<u32>,
) -> Result<api::SamplingParams, ApiError> {
    if c.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::invalid(
            Some("logit_bias"),
            "logit_bias is not supported",
        ));
    }
    let top_k = match c.top_k {
        None => None,
        // vLLM: -1 (and 0) turn the filter off.
        Some(-1 | 0) => Some(0),
        Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(k) => {
            return Err(ApiError::invalid(
                Some("top_k"),
                format!("top_k must be -1, 0 or positive, got {k}"),
            ));
        }
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(v)) => v.clone(),
    };
    Ok(api::SamplingParams {
        max_tokens: c
            .max_completion_tokens
            .or(c.max_tokens)
            .or(default_max_tokens),
        temperature: Some(c.temperature.unwrap_or(1.0)),
        top_p: c.top_p,
        top_k,
        min_p: c.min_p,
        repetition_penalty: c.repetition_penalty,
        presence_penalty: c.presence_penalty,
        frequency_penalty: c.frequency_penalty,
        seed: c.seed.map(|s| match s {
            SeedInput::Unsigned(u) => u,
            SeedInput::Signed(i) => i as u64,
        }),
        stop,
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        logprobs,
    })
}

#[cfg(test)]
mod tests {
    use tandem_engine::sampling::sequence_seed;

    use super::*;

    fn completion(body: &str) -> Result<Plan, ApiError> {
        completion_plan(serde_json::from_str(body).expect("parses"))
    }

    fn chat(body: &str) -> Result<Plan, ApiError> {
        chat_plan(serde_json::from_str(body).expect("parses"))
    }

    #[test]
    fn a_choice_seed_draws_what_the_engines_sequence_would() {
        for seed in [0, 1, 42, u64::MAX] {
            for k in 0..64 {
                assert_eq!(
                    sequence_seed(choice_seed(seed, k), 0),
                    sequence_seed(seed, k),
                    "seed {seed} choice {k}"
                );
            }
        }
    }

    #[test]
    fn prompts_and_n_make_one_request_per_choice() {
        let p = completion(
            r#"{"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 7, "max_tokens": 5}"#,
        )
        .unwrap();
        assert_eq!(p.choices.len(), 6);
        assert_eq!(p.per_prompt, 3);
        let seeds: Vec<u64> = p
            .choices
            .iter()
            .map(|c| c.sampling.as_ref().unwrap().seed.unwrap())
            .collect();
        assert_eq!(seeds[0], 7, "choice 0 keeps the request's seed");
        assert_eq!(
            seeds[..3],
            seeds[3..],
            "each prompt's choices use the same seeds"
        );
        assert_ne!(seeds[1], seeds[0]);
        let p = completion(r#"{"prompt": [[1, 2], [3]]}"#).unwrap();
        assert_eq!(p.choices.len(), 2);
        let s = p.choices[0].sampling.as_ref().unwrap();
        assert_eq!(
            (s.max_tokens, s.temperature),
            (Some(16), Some(1.0)),
            "OpenAI's defaults"
        );
        let p = completion(r#"{"prompt": [5, 6, 7], "top_k": -1, "stop": "x", "logprobs": 2}"#)
            .unwrap();
        let s = p.choices[0].sampling.as_ref().unwrap();
        assert_eq!(
            (s.top_k, s.stop.clone(), s.logprobs),
            (Some(0), vec!["x".to_string()], Some(2))
        );
        assert!(p.logprobs);
    }

    #[test]
    fn chat_maps_roles_parts_and_logprobs() {
        let p = chat(
            r#"{"model": "m", "messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
                "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 9, "stream": true,
                "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        let Some(api::generate_request::Prompt::Chat(c)) = &p.choices[0].prompt else {
            panic!("a chat")
        };
        assert_eq!(c.messages[1].content, "hi there");
        let s = p.choices[0].sampling.as_ref().unwrap();
        assert_eq!((s.logprobs, s.max_tokens), (Some(2), Some(9)));
        assert!(p.stream && p.include_usage && p.logprobs);
        assert_eq!(p.max_tokens, MaxTokens::RestOfContext);
    }

    #[test]
    fn what_cannot_be_honoured_is_refused() {
        let bad = |r: Result<Plan, ApiError>| r.expect_err("refused").status().as_u16();
        assert_eq!(
            bad(chat(r#"{"messages": [{"role": "tool", "content": "x"}]}"#)),
            400
        );
        assert_eq!(bad(chat(r#"{"messages": []}"#)), 400);
        assert_eq!(
            bad(chat(
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#
            )),
            400
        );
        assert_eq!(
            bad(chat(
                r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}"#
            )),
            400
        );
        assert_eq!(
            bad(chat(
                r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}"#
            )),
            400
        );
        assert_eq!(bad(completion(r#"{"prompt": "x", "n": 0}"#)), 400);
        assert_eq!(bad(completion(r#"{"prompt": "x", "n": 200}"#)), 400);
        assert_eq!(bad(completion(r#"{"prompt": []}"#)), 400);
        assert_eq!(bad(completion(r#"{"prompt": "x", "echo": true}"#)), 400);
        assert_eq!(
            bad(completion(r#"{"prompt": "x", "logit_bias": {"5": 1.0}}"#)),
            400
        );
        assert_eq!(
            bad(completion(
                r#"{"prompt": "x", "stream_options": {"include_usage": true}}"#
            )),
            400
        );
        assert_eq!(bad(completion(r#"{"prompt": "x", "top_k": -3}"#)), 400);
    }
}
