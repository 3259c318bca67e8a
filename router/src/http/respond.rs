//! Relayed token streams → OpenAI answers: one JSON body once every choice finished, or server-sent
//! events (`data: {chunk}`, then `data: [DONE]`) as tokens arrive.
//!
//! Invariants:
//! - The event stream owns the relays: when the client goes away, hyper drops the body, which drops
//!   every relay and so aborts each choice's request on its nodes.
//! - A stream that fails after it started (status 200 already sent) ends with one `data: {"error": ...}`
//!   event and `data: [DONE]`; the other choices' requests are dropped with it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::response::sse::Event;
use serde::Serialize;
use tandem_engine::tokenizer::Tokenizer;
use tandem_proto::v1 as api;
use tokio_stream::{Stream, StreamExt, StreamMap};

use super::error::ApiError;
use super::request::Endpoint;
use super::wire::{
    ChatChoice, ChatCompletion, ChatDelta, ChatLogprobs, ChatMessageOut, ChatTokenLogprob,
    ChatTopLogprob, Completion, CompletionChoice, CompletionLogprobs, PromptTokensDetails, TopMap,
    Usage,
};
use crate::Admitted as Relay;

/// What every part of one answer shares.
pub(crate) struct Reply {
    pub(crate) endpoint: Endpoint,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// Choices per prompt: usage counts each prompt once.
    pub(crate) per_prompt: usize,
    pub(crate) logprobs: bool,
    pub(crate) include_usage: bool,
}

/// One choice's progress.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<api::TokenLogprob>,
    /// Characters of text before the next token (completion logprobs' `text_offset`).
    offset: usize,
    finish: Option<&'static str>,
    usage: Option<api::Usage>,
    completion_tokens: u32,
}

fn finish_reason(code: i32) -> Option<&'static str> {
    match api::FinishReason::try_from(code).unwrap_or(api::FinishReason::Unspecified) {
        api::FinishReason::Unspecified => None,
        api::FinishReason::Stop => Some("stop"),
        api::FinishReason::Length => Some("length"),
        api::FinishReason::Abort => Some("abort"),
    }
}

/// JSON has no infinities: an impossible token's logprob is written as -9999 (as vLLM does).
fn finite(lp: f32) -> f32 {
    if lp.is_finite() { lp } else { -9999.0 }
}

fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| {
        ApiError::from(tonic::Status::internal(format!(
            "serialising the answer: {e}"
        )))
        .to_json()
    })
}

impl Reply {
    fn token(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    fn completion_logprobs(
        &self,
        lps: &[api::TokenLogprob],
        offset: &mut usize,
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for lp in lps {
            let token = self.token(lp.token_id);
            out.text_offset.push(*offset);
            *offset += token.chars().count();
            out.tokens.push(token);
            out.token_logprobs.push(finite(lp.logprob));
            out.top_logprobs.push(TopMap(
                lp.top
                    .iter()
                    .map(|t| (self.token(t.token_id), finite(t.logprob)))
                    .collect(),
            ));
        }
        out
    }

    fn chat_logprobs(&self, lps: &[api::TokenLogprob]) -> ChatLogprobs {
        let content = lps
            .iter()
            .map(|lp| {
                let token = self.token(lp.token_id);
                let top_logprobs = lp
                    .top
                    .iter()
                    .map(|t| {
                        let token = self.token(t.token_id);
                        ChatTopLogprob {
                            bytes: token.as_bytes().to_vec(),
                            token,
                            logprob: finite(t.logprob),
                        }
                    })
                    .collect();
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: finite(lp.logprob),
                    top_logprobs,
                }
            })
            .collect();
        ChatLogprobs { content }
    }

    /// Usage over every choice, counting each prompt once.
    fn usage(&self, choices: &[Choice]) -> Usage {
        let mut u = Usage::default();
        for (i, c) in choices.iter().enumerate() {
            let reported = c.usage.unwrap_or_default();
            if i % self.per_prompt.max(1) == 0 {
                u.prompt_tokens += reported.prompt_tokens;
                u.prompt_tokens_details = PromptTokensDetails {
                    cached_tokens: u.prompt_tokens_details.cached_tokens + reported.cached_tokens,
                };
            }
            u.completion_tokens += reported.completion_tokens.max(c.completion_tokens);
        }
        u.total_tokens = u.prompt_tokens + u.completion_tokens;
        u
    }

    /// The whole answer, once every choice finished.
    fn body(&self, choices: &mut [Choice]) -> String {
        let usage = Some(self.usage(choices));
        match self.endpoint {
            Endpoint::Completions => {
                let choices = choices
                    .iter_mut()
                    .enumerate()
                    .map(|(i, c)| CompletionChoice {
                        index: i as u32,
                        logprobs: self
                            .logprobs
                            .then(|| self.completion_logprobs(&c.logprobs, &mut 0)),
                        text: std::mem::take(&mut c.text),
                        finish_reason: c.finish,
                    })
                    .collect();
                to_json(&Completion {
                    id: &self.id,
                    object: "text_completion",
                    created: self.created,
                    model: &self.model,
                    choices,
                    usage,
                })
            }
            Endpoint::Chat => {
                let choices = choices
                    .iter_mut()
                    .enumerate()
                    .map(|(i, c)| ChatChoice {
                        index: i as u32,
                        message: Some(ChatMessageOut {
                            role: "assistant",
                            content: std::mem::take(&mut c.text),
                        }),
                        delta: None,
                        logprobs: self.logprobs.then(|| self.chat_logprobs(&c.logprobs)),
                        finish_reason: c.finish,
                    })
                    .collect();
                to_json(&ChatCompletion {
                    id: &self.id,
                    object: "chat.completion",
                    created: self.created,
                    model: &self.model,
                    choices,
                    usage,
                })
            }
        }
    }

    /// One chunk carrying a message of choice `index` (`None` when it says nothing).
    fn chunk(
        &self,
        index: usize,
        msg: &api::GenerateResponse,
        choice: &mut Choice,
    ) -> Option<String> {
        let finish = finish_reason(msg.finish_reason);
        if msg.text.is_empty() && msg.logprobs.is_empty() && finish.is_none() {
            return None;
        }
        let index = index as u32;
        Some(match self.endpoint {
            Endpoint::Completions => {
                let logprobs = self
                    .logprobs
                    .then(|| self.completion_logprobs(&msg.logprobs, &mut choice.offset));
                let choices = vec![CompletionChoice {
                    index,
                    text: msg.text.clone(),
                    logprobs,
                    finish_reason: finish,
                }];
                to_json(&Completion {
                    id: &self.id,
                    object: "text_completion",
                    created: self.created,
                    model: &self.model,
                    choices,
                    usage: None,
                })
            }
            Endpoint::Chat => {
                let delta = ChatDelta {
                    role: None,
                    content: (!msg.text.is_empty()).then(|| msg.text.clone()),
                };
                let logprobs = self.logprobs.then(|| self.chat_logprobs(&msg.logprobs));
                self.chat_chunk(
                    vec![ChatChoice {
                        index,
                        message: None,
                        delta: Some(delta),
                        logprobs,
                        finish_reason: finish,
                    }],
                    None,
                )
            }
        })
    }

    fn chat_chunk(&self, choices: Vec<ChatChoice>, usage: Option<Usage>) -> String {
        to_json(&ChatCompletion {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }

    /// The last chunk with `include_usage`: no choices, the usage.
    fn usage_chunk(&self, choices: &[Choice]) -> String {
        let usage = Some(self.usage(choices));
        match self.endpoint {
            Endpoint::Completions => to_json(&Completion {
                id: &self.id,
                object: "text_completion",
                created: self.created,
                model: &self.model,
                choices: Vec::new(),
                usage,
            }),
            Endpoint::Chat => self.chat_chunk(Vec::new(), usage),
        }
    }
}

fn relays_by_choice(relays: Vec<Relay>) -> StreamMap<usize, Relay> {
    let mut map = StreamMap::with_capacity(relays.len());
    for (i, r) in relays.into_iter().enumerate() {
        map.insert(i, r);
    }
    map
}

fn record(choice: &mut Choice, msg: &api::GenerateResponse) {
    choice.completion_tokens += msg.token_ids.len() as u32;
    if let Some(f) = finish_reason(msg.finish_reason) {
        choice.finish = Some(f);
        choice.usage = msg.usage;
    }
}

fn unfinished() -> ApiError {
    ApiError::from(tonic::Status::internal(
        "a decode node ended a stream before the request finished",
    ))
}

/// Waits for every choice and answers with the whole completion.
pub(crate) async fn collect(reply: Reply, relays: Vec<Relay>) -> Result<String, ApiError> {
    let mut choices: Vec<Choice> = relays.iter().map(|_| Choice::default()).collect();
    let mut streams = relays_by_choice(relays);
    while let Some((i, item)) = streams.next().await {
        let msg = item?;
        let choice = &mut choices[i];
        choice.text.push_str(&msg.text);
        choice.logprobs.extend(msg.logprobs.iter().cloned());
        record(choice, &msg);
    }
    if choices.iter().any(|c| c.finish.is_none()) {
        return Err(unfinished());
    }
    Ok(reply.body(&mut choices))
}

/// The answer as server-sent events.
pub(crate) struct EventStream {
    reply: Reply,
    relays: StreamMap<usize, Relay>,
    choices: Vec<Choice>,
    queue: VecDeque<String>,
    done: bool,
}

impl EventStream {
    pub(crate) fn new(reply: Reply, relays: Vec<Relay>) -> EventStream {
        let choices: Vec<Choice> = relays.iter().map(|_| Choice::default()).collect();
        let mut queue = VecDeque::new();
        if reply.endpoint == Endpoint::Chat {
            // Each choice opens with the assistant's role, as OpenAI's stream does.
            for index in 0..choices.len() {
                let delta = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                };
                queue.push_back(reply.chat_chunk(
                    vec![ChatChoice {
                        index: index as u32,
                        message: None,
                        delta: Some(delta),
                        logprobs: None,
                        finish_reason: None,
                    }],
                    None,
                ));
            }
        }
        EventStream {
            reply,
            relays: relays_by_choice(relays),
            choices,
            queue,
            done: false,
        }
    }

    fn on_message(&mut self, i: usize, msg: api::GenerateResponse) {
        let choice = &mut self.choices[i];
        record(choice, &msg);
        if let Some(chunk) = self.reply.chunk(i, &msg, choice) {
            self.queue.push_back(chunk);
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.relays.clear(); // aborts every other choice's request
        self.queue.push_back(e.to_json());
        self.end();
    }

    fn end(&mut self) {
        self.queue.push_back("[DONE]".into());
        self.done = true;
    }

    fn on_end(&mut self) {
        if self.choices.iter().any(|c| c.finish.is_none()) {
            return self.fail(unfinished());
        }
        if self.reply.include_usage {
            let chunk = self.reply.usage_chunk(&self.choices);
            self.queue.push_back(chunk);
        }
        self.end();
    }
}

impl Stream for EventStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(data) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(Event::default().data(data))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.relays).poll_next(cx)) {
                Some((i, Ok(msg))) => this.on_message(i, msg),
                Some((_, Err(s))) => this.fail(ApiError::from(s)),
                None => this.on_end(),
            }
        }
    }
}
