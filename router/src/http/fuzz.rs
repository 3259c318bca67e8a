//! The fuzzing entry point of the router's request validation (`fuzz/bodies/src/router_request.rs`):
//! a request body or message as a client sends it, through the same parsing, planning and checks a
//! request meets before anything reaches a node.
//!
//! [`admit`] runs, for the OpenAI API, `parse` and `completion_plan`/`chat_plan` as the handlers do,
//! and for gRPC a `GenerateRequest` (the caller decodes it with prost, as tonic's codec does); then, per request, the
//! synchronous checks of `Router::route` in its order: request id, roles, prompt size before
//! tokenizing, tokenizing, the empty prompt, sampling parameters and the context limit. (Model
//! resolution and node choice need live nodes and are not here.) Keep it in step with `route`.

use tandem_engine::sampling::SamplingParams;
use tandem_engine::tokenizer::Tokenizer;
use tandem_node::convert;
use tandem_proto::v1 as api;

use super::request::{self, Plan};
use crate::MaxTokens;

/// Which OpenAI endpoint a fuzz input arrives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

/// One request that passed every check.
#[derive(Debug)]
pub struct Admitted {
    /// The request as routed.
    pub request: api::GenerateRequest,
    /// Its prompt's token ids.
    pub prompt: Vec<u32>,
    /// Its sampling parameters as the engine will see them.
    pub sampling: SamplingParams,
}

/// Parses and checks the JSON `body` as `api` receives it; one result per request it makes (a body
/// with `n` > 1 or several prompts makes several), or one error for a body refused as a whole.
pub fn admit_http(api: Api, body: &[u8], tokenizer: &Tokenizer, max_model_len: usize) -> Vec<Result<Admitted, String>> {
    let plan = match api {
        Api::Completions => super::parse(body).and_then(request::completion_plan),
        Api::Chat => super::parse(body).and_then(request::chat_plan),
    };
    let plan: Plan = match plan {
        Ok(plan) => plan,
        Err(e) => return vec![Err(format!("{e:?}"))],
    };
    let max_tokens = plan.max_tokens;
    plan.choices
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            // As `generate` names choice i of a response without a client id.
            r.request_id = format!("chatcmpl-1-{i}");
            check(r, max_tokens, tokenizer, max_model_len)
        })
        .collect()
}

/// Checks a gRPC `GenerateRequest` (decoded by the caller, as tonic's codec decodes it).
pub fn admit_grpc(req: api::GenerateRequest, tokenizer: &Tokenizer, max_model_len: usize) -> Result<Admitted, String> {
    check(req, MaxTokens::EngineDefault, tokenizer, max_model_len)
}

/// `Router::route`'s checks, in its order.
fn check(req: api::GenerateRequest, max_tokens: MaxTokens, tokenizer: &Tokenizer, max_model_len: usize) -> Result<Admitted, String> {
    crate::check_request_id(&req.request_id).map_err(|e| e.to_string())?;
    crate::check_roles(&req).map_err(|e| e.to_string())?;
    crate::check_prompt_size(&req, max_model_len).map_err(|e| e.to_string())?;
    let prompt = crate::Router::tokenize(tokenizer, &req).map_err(|e| e.to_string())?;
    if prompt.is_empty() {
        return Err("empty prompt".into());
    }
    let mut sampling = req.sampling.clone().unwrap_or_default();
    if sampling.max_tokens.is_none() && max_tokens == MaxTokens::RestOfContext {
        let rest = max_model_len.saturating_sub(prompt.len()).max(1);
        sampling.max_tokens = Some(u32::try_from(rest).unwrap_or(u32::MAX));
    }
    let params = convert::sampling_from_proto(Some(&sampling)).map_err(|e| e.to_string())?;
    if prompt.len() + params.max_tokens > max_model_len {
        return Err("prompt too long".into());
    }
    Ok(Admitted { request: req, prompt, sampling: params })
}
