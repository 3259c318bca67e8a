//! One routed request's token stream from its decode node, as every front end consumes it.
//!
//! Invariants:
//! - Dropping a [`Relay`] drops the decode node's stream, which aborts the request there (and its
//!   prefill); a relay dropped before the last message logs that it was cancelled.
//! - A decode node that fails mid-stream is quarantined and the request continues on another decode
//!   node without a repeated or skipped token (see [`crate::migrate`]); when it cannot, the failure
//!   reaches the caller as UNAVAILABLE. The relay ends after its first error.
//! - The relay is where the router's latency metrics are measured (see [`crate::metrics`]): it counts
//!   as running from [`Relay::new`] to its drop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tandem_engine::tokenizer::Tokenizer;
use tandem_proto::v1 as api;
use tokio_stream::Stream;
use tonic::Status;

use crate::migrate::Upstream;

/// What the router decided for a request it opened.
pub(crate) struct Opened {
    pub(crate) request_id: String,
    pub(crate) model: String,
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// When the request reached the router (TTFT and end-to-end latency count from here).
    pub(crate) started: Instant,
    /// The request's span: it ends when the relay is dropped.
    pub(crate) span: tracing::Span,
}

type Item = Option<Result<api::GenerateResponse, Status>>;

/// The upstream, idle between messages or busy fetching the next one (it owns itself meanwhile, so
/// dropping the relay drops whatever call is in flight).
enum Next {
    Idle(Box<Upstream>),
    Busy(Pin<Box<dyn Future<Output = (Item, Box<Upstream>)> + Send>>),
    Done,
}

/// An opened request: a stream of the decode nodes' messages, the last one carrying the finish reason
/// and usage.
pub(crate) struct Relay {
    opened: Opened,
    next: Next,
    ended: bool,
    /// When the last message with tokens arrived (none yet: the next one is the first token).
    last_token_at: Option<Instant>,
}

impl Relay {
    pub(crate) fn new(opened: Opened, upstream: Upstream) -> Relay {
        crate::metrics::router().running.inc();
        Relay {
            opened,
            next: Next::Idle(Box::new(upstream)),
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
        let item = loop {
            match std::mem::replace(&mut self.next, Next::Done) {
                Next::Idle(mut up) => {
                    self.next = Next::Busy(Box::pin(async move {
                        let item = up.next().await;
                        (item, up)
                    }));
                }
                Next::Busy(mut fetching) => match fetching.as_mut().poll(cx) {
                    Poll::Pending => {
                        self.next = Next::Busy(fetching);
                        return Poll::Pending;
                    }
                    Poll::Ready((item, up)) => {
                        self.next = Next::Idle(up);
                        break item;
                    }
                },
                Next::Done => break None,
            }
        };
        match &item {
            None | Some(Err(_)) => self.ended = true,
            Some(Ok(msg)) => {
                self.ended = msg.finish_reason != api::FinishReason::Unspecified as i32;
                self.record(msg);
            }
        }
        if self.ended {
            self.next = Next::Done; // drops the upstream (and its decode stream) at once
        }
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
