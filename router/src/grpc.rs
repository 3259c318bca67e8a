//! The gRPC service as served: tonic's generated `TandemServer`, except that a request tonic cannot
//! decode (malformed protobuf, a string field that is not UTF-8) is the caller's fault and answered
//! INVALID_ARGUMENT, not the INTERNAL tonic's codec reports for every decode error.
//!
//! Invariant: only a trailers-only answer whose status is INTERNAL with prost's decode-error message
//! is rewritten; every other response passes through untouched.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tandem_proto::v1::tandem_server::TandemServer;

use crate::Router;

/// prost's `DecodeError` message, as tonic percent-encodes it into `grpc-message`.
const DECODE_ERROR: &str = "failed%20to%20decode%20Protobuf%20message";

/// [`TandemServer`] with decode errors answered INVALID_ARGUMENT.
#[derive(Clone)]
pub struct Service(TandemServer<Router>);

impl Service {
    pub(crate) fn new(router: Router) -> Service {
        Service(TandemServer::new(router))
    }
}

impl NamedService for Service {
    const NAME: &'static str = <TandemServer<Router> as NamedService>::NAME;
}

/// Rewrites a decode error's INTERNAL to INVALID_ARGUMENT.
fn remap(mut response: http::Response<Body>) -> http::Response<Body> {
    let headers = response.headers();
    let decode_error = headers.get("grpc-status").is_some_and(|s| s == "13")
        && headers.get("grpc-message").and_then(|m| m.to_str().ok()).is_some_and(|m| m.starts_with(DECODE_ERROR));
    if decode_error {
        response.headers_mut().insert("grpc-status", http::HeaderValue::from_static("3"));
    }
    response
}

impl tower_service::Service<http::Request<Body>> for Service {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower_service::Service::<http::Request<Body>>::poll_ready(&mut self.0, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let answer = tower_service::Service::<http::Request<Body>>::call(&mut self.0, request);
        Box::pin(async move { answer.await.map(remap) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: &str, message: &str) -> http::Response<Body> {
        let mut r = http::Response::new(Body::empty());
        r.headers_mut().insert("grpc-status", status.parse().unwrap());
        r.headers_mut().insert("grpc-message", message.parse().unwrap());
        r
    }

    #[test]
    fn only_decode_errors_become_invalid_argument() {
        let status = |r: http::Response<Body>| r.headers()["grpc-status"].to_str().unwrap().to_string();
        let decode = format!("{DECODE_ERROR}:%20invalid%20string%20value:%20data%20is%20not%20UTF-8%20encoded");
        assert_eq!(status(remap(answer("13", &decode))), "3");
        assert_eq!(status(remap(answer("13", "engine%20failed"))), "13");
        assert_eq!(status(remap(answer("14", &decode))), "14");
        let ok = remap(http::Response::new(Body::empty()));
        assert!(ok.headers().get("grpc-status").is_none());
    }
}
