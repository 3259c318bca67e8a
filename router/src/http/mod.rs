//! The OpenAI-compatible HTTP API (as vLLM serves it) beside the gRPC one: `POST /v1/completions`,
//! `POST /v1/chat/completions` (streamed as server-sent events or not), `GET /v1/models`,
//! `GET /v1/models/{model}` and `GET /health`. Requests go through the same [`Router::open`] as gRPC
//! ones; this module only translates.
//!
//! Invariants:
//! - A request body is read into memory only up to [`MAX_BODY`] bytes; a larger one is answered 413
//!   (after the rest is read and dropped, up to [`DRAIN_LIMIT`], so the client sees the answer).
//! - Every error is OpenAI's `{"error": {...}}` with the status [`error::ApiError::from_status`] maps.
//! - A client that disconnects drops its response body, which drops every relay behind it (see
//!   `respond.rs`): the request is aborted on every node.
//!
//! More routes (e.g. `/metrics`) join in [`app`]; [`Http`] is the state every handler shares.

mod error;
#[doc(hidden)]
pub mod fuzz;
mod request;
mod respond;
pub mod tls;
mod wire;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

use self::error::ApiError;
use self::request::{Endpoint, Plan};
use self::respond::{EventStream, Reply};
use crate::Router;

/// Largest request body read (4 MiB).
pub const MAX_BODY: usize = 4 << 20;
/// Largest body read (and dropped) to answer 413 cleanly; past it the connection is closed.
pub const DRAIN_LIMIT: usize = 64 << 20;

/// What every handler shares.
#[derive(Clone)]
struct Http {
    router: Router,
    ids: Arc<Ids>,
}

/// Response ids: `cmpl-…`/`chatcmpl-…` from the router's start time and a counter, unique per router.
struct Ids {
    start: u64,
    next: AtomicU64,
}

impl Ids {
    fn next(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:x}{:06x}",
            self.start,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The HTTP API's routes over `router`.
pub fn app(router: Router) -> axum::Router {
    let start = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let state = Http {
        router,
        ids: Arc::new(Ids {
            start,
            next: AtomicU64::new(0),
        }),
    };
    // The API needs a key when the router has keys; health and metrics never do.
    let api = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_key));
    axum::Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .with_state(state)
}

/// Answers 401 (OpenAI's `invalid_api_key`) unless the request carries a key the router accepts.
async fn require_key(State(http): State<Http>, request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let given = request.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes());
    if http.router.inner.keys.allows(given) {
        next.run(request).await
    } else {
        ApiError::from(tonic::Status::unauthenticated(crate::auth::REFUSED)).into_response()
    }
}

/// Serves the HTTP API on `listener` until `shutdown` resolves, then lets responses in flight finish.
pub async fn serve(
    router: Router,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Streamed tokens leave at once instead of waiting for the peer's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app(router))
        .with_graceful_shutdown(shutdown)
        .await
}

/// [`serve`] over HTTPS: TLS with `config` (see [`tls`]).
pub async fn serve_tls(
    router: Router,
    listener: TcpListener,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(tls::TlsListener::new(listener, config)?, app(router))
        .with_graceful_shutdown(shutdown)
        .await
}

pub(crate) fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The body, at most [`MAX_BODY`] bytes of it.
async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    let mut chunks = body.into_data_stream();
    let mut kept = Vec::new();
    let mut total = 0usize;
    while let Some(chunk) = chunks.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::invalid(None, format!("reading the request body: {e}")))?;
        total = total.saturating_add(chunk.len());
        if total <= MAX_BODY {
            kept.extend_from_slice(&chunk);
        } else if total > DRAIN_LIMIT {
            break;
        }
    }
    if total > MAX_BODY {
        return Err(ApiError::too_large(MAX_BODY));
    }
    Ok(Bytes::from(kept))
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!("the request body is not a valid request: {e}"),
        )
    })
}

async fn completions(State(http): State<Http>, headers: HeaderMap, body: Body) -> Response {
    let plan = match read_body(body)
        .await
        .and_then(|b| request::completion_plan(parse(&b)?))
    {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    generate(http, plan, &headers)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(http): State<Http>, headers: HeaderMap, body: Body) -> Response {
    let plan = match read_body(body)
        .await
        .and_then(|b| request::chat_plan(parse(&b)?))
    {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    generate(http, plan, &headers)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Longest `X-Request-Id` taken from a client (the nodes know choice `i` as `ID-i`, which must stay
/// within the router's [`crate::MAX_REQUEST_ID`]).
pub const MAX_REQUEST_ID: usize = crate::MAX_REQUEST_ID - 8;

/// The client's `X-Request-Id`, if it sent one: visible ASCII, at most [`MAX_REQUEST_ID`] bytes.
fn client_request_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(REQUEST_ID) else { return Ok(None) };
    let bad = || {
        ApiError::invalid(
            None,
            format!("the X-Request-Id header must be 1 to {MAX_REQUEST_ID} visible ASCII characters"),
        )
    };
    let s = v.to_str().map_err(|_| bad())?;
    if s.is_empty() || s.len() > MAX_REQUEST_ID || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad());
    }
    Ok(Some(s.to_string()))
}

const REQUEST_ID: &str = "x-request-id";

/// Opens one relay per choice and answers from them. The nodes know choice `i` as `RID-i`, where RID
/// is the client's `X-Request-Id` or else the response's id; the response's `X-Request-Id` is RID.
async fn generate(http: Http, plan: Plan, headers: &HeaderMap) -> Result<Response, ApiError> {
    let id = http.ids.next(match plan.endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    });
    let rid = client_request_id(headers)?.unwrap_or_else(|| id.clone());
    let mut relays = Vec::with_capacity(plan.choices.len());
    for (i, mut req) in plan.choices.into_iter().enumerate() {
        req.request_id = format!("{rid}-{i}");
        relays.push(http.router.open(req, plan.max_tokens, crate::Caller::Http(headers)).await?);
    }
    let first = relays
        .first()
        .ok_or_else(|| ApiError::invalid(None, "nothing to generate"))?;
    let reply = Reply {
        endpoint: plan.endpoint,
        id,
        created: unix_now(),
        model: first.model().to_string(),
        tokenizer: Arc::clone(first.tokenizer()),
        per_prompt: plan.per_prompt,
        logprobs: plan.logprobs,
        include_usage: plan.include_usage,
    };
    let mut response = if plan.stream {
        Sse::new(EventStream::new(reply, relays)).into_response()
    } else {
        json_response(StatusCode::OK, respond::collect(reply, relays).await?)
    };
    if let Ok(v) = HeaderValue::from_str(&rid) {
        response.headers_mut().insert(REQUEST_ID, v);
    }
    Ok(response)
}

fn model_card(m: crate::ModelSummary, created: u64) -> wire::ModelCard {
    wire::ModelCard {
        root: m.id.clone(),
        id: m.id,
        object: "model",
        created,
        owned_by: "tandem",
        max_model_len: (m.max_model_len > 0).then_some(m.max_model_len),
    }
}

async fn models(State(http): State<Http>) -> Response {
    let created = unix_now();
    let data = http
        .router
        .models()
        .await
        .into_iter()
        .map(|m| model_card(m, created))
        .collect();
    json_response(
        StatusCode::OK,
        serde_json::to_string(&wire::ModelList {
            object: "list",
            data,
        })
        .unwrap_or_default(),
    )
}

async fn model(State(http): State<Http>, Path(id): Path<String>) -> Response {
    let created = unix_now();
    match http.router.models().await.into_iter().find(|m| m.id == id) {
        Some(m) => json_response(
            StatusCode::OK,
            serde_json::to_string(&model_card(m, created)).unwrap_or_default(),
        ),
        None => ApiError::from(tonic::Status::not_found(format!(
            "model {id:?} is not served here"
        )))
        .into_response(),
    }
}

/// The router's Prometheus metrics.
async fn metrics(State(http): State<Http>) -> Response {
    let text = crate::metrics::render(http.router.node_counts(), http.router.inner.admission.waiting());
    (StatusCode::OK, [(header::CONTENT_TYPE, tandem_node::metrics::CONTENT_TYPE)], text).into_response()
}

/// 200 while a decode node is live (the router can serve), 503 otherwise.
async fn health(State(http): State<Http>) -> Response {
    let (prefill_nodes, decode_nodes) = http.router.node_counts();
    let serving = decode_nodes > 0;
    let status = if serving {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        serde_json::to_string(&wire::Health {
            serving,
            prefill_nodes,
            decode_nodes,
        })
        .unwrap_or_default(),
    )
}
