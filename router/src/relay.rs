//! One routed request's token stream from its decode node, as every front end consumes it.
//!
//! Invariants:
//! - Dropping a [`Relay`] drops the decode node's stream, which aborts the request there (and its
//!   prefill); a relay dropped before the last message logs that it was cancelled.
//! - A decode node that fails mid-stream (unavailable, or an unknown error) is quarantined and the
//!   failure reaches the caller as UNAVAILABLE; the relay ends after its first error.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

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
}

/// An opened request: a stream of the decode node's messages, the last one carrying the finish reason
/// and usage.
pub(crate) struct Relay {
    router: Router,
    opened: Opened,
    upstream: tonic::Streaming<api::GenerateResponse>,
    ended: bool,
}

impl Relay {
    pub(crate) fn new(
        router: Router,
        opened: Opened,
        upstream: tonic::Streaming<api::GenerateResponse>,
    ) -> Relay {
        Relay {
            router,
            opened,
            upstream,
            ended: false,
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
        if !self.ended {
            tracing::info!(request_id = %self.opened.request_id, "client cancelled");
        }
    }
}
