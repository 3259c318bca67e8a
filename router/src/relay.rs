//! One routed request's token stream from its decode node, as every front end consumes it.
//!
//! Invariants:
//! - Dropping a [`Relay`] drops the decode node's stream, which aborts the request there (and its
//!   prefill); a relay dropped before the last message logs that it was cancelled.
//! - A decode node that fails mid-stream (unavailable, or an unknown error) is quarantined and the
//!   failure reaches the caller as UNAVAILABLE; the relay ends after its first error.
//! - The relay is where the router's latency metrics are measured (see [`crate::metrics`]): it counts
//!   as running from [`Relay::new`] to its drop.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use tandem_engine::tokenizer::Tokenizer;
use tandem_proto::v1 as api;
use tokio_stream::Stream;
use tonic::{Code, Status};

use crate::Router;

/// What the router decided for a request it opened.
pub(crate) struct Opened {
    pub(crate) request_id: String,
    pub(crate) model: String,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) decode_id: String,
    /// When the request reached the router (TTFT and end-to-end latency count from here).
    pub(crate) started: Instant,
    /// The request's span: it ends when the relay is dropped.
    pub(crate) span: tracing::Span,
}

/// An opened request: a stream of the decode node's messages, the last one carrying the finish reason
/// and usage.
pub(crate) struct Relay {
    router: Router,
    opened: Opened,
    upstream: tonic::Streaming<api::GenerateResponse>,
    ended: bool,
    /// When the last message with tokens arrived (none yet: the next one is the first token).
    last_token_at: Option<Instant>,
}

impl Relay {
    pub(crate) fn new(
        router: Router,
        opened: Opened,
        upstream: tonic::Streaming<api::GenerateResponse>,
    ) -> Relay {
        crate::metrics::router().running.inc();
        Relay {
            router,
            opened,
            upstream,
            ended: false,
            last_token_at: None,
        }
    }

    /// The id the nodes know the request by.
    pub(crate) fn request_id(&self) -> &str {
        &self.opened.request_id
    }

    /// The model that serves it.
    pub(crate) fn model(&self) -> &str {
        &self.opened.model
    }

    /// The model's tokenizer (for rendering token ids, e.g. in logprobs).
    pub(crate) fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.opened.tokenizer
    }
}

impl Relay {
    /// Records a message's latencies and, for the last one, the request's outcome and tokens.
    fn record(&mut self, msg: &api::GenerateResponse) {
        let m = crate::metrics::router();
        let now = Instant::now();
        if !msg.token_ids.is_empty() {
            match self.last_token_at {
                None => {
                    m.ttft.observe_duration(now - self.opened.started);
                    tracing::info!(parent: &self.opened.span, ttft_ms = tandem_node::ms(now - self.opened.started), "first token");
                }
                Some(t) => m.itl.observe_duration(now - t),
            }
            self.last_token_at = Some(now);
        }
        if self.ended {
            let reason = match api::FinishReason::try_from(msg.finish_reason) {
                Ok(api::FinishReason::Stop) => "stop",
                Ok(api::FinishReason::Length) => "length",
                Ok(api::FinishReason::Abort) => "abort",
                _ => "unknown",
            };
            m.success.inc(&[reason]);
            m.e2e.observe_duration(now - self.opened.started);
            if let Some(u) = &msg.usage {
                self.opened.span.record("completion_tokens", u.completion_tokens);
                m.prompt_tokens.add(u64::from(u.prompt_tokens));
                m.generation_tokens.add(u64::from(u.completion_tokens));
            }
        }
    }
}

impl Stream for Relay {
    type Item = Result<api::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let item = ready!(Pin::new(&mut self.upstream).poll_next(cx));
        let item = match item {
            None => {
                self.ended = true;
                None
            }
            Some(Ok(msg)) => {
                self.ended = msg.finish_reason != api::FinishReason::Unspecified as i32;
                self.record(&msg);
                Some(Ok(msg))
            }
            Some(Err(s)) => {
                self.ended = true;
                if matches!(s.code(), Code::Unavailable | Code::Unknown) {
                    self.router.quarantine(&self.opened.decode_id);
                    Some(Err(Status::unavailable(format!(
                        "the decode node failed mid-request: {}",
                        s.message()
                    ))))
                } else {
                    Some(Err(s))
                }
            }
        };
        Poll::Ready(item)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        crate::metrics::router().running.dec();
        if !self.ended {
            tracing::info!(request_id = %self.opened.request_id, "client cancelled");
        }
    }
}
