//! Errors of the HTTP API in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
//! matching HTTP status.
//!
//! Invariant: a gRPC status becomes an HTTP status in exactly one place, [`ApiError::from_status`]
//! (everything the router and the nodes refuse arrives as a `tonic::Status`, classified once by
//! `tandem_node::NodeError`); only what exists on HTTP alone (malformed JSON, a body over the limit, a
//! parameter the gRPC API cannot carry) is built here directly.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tandem_node::NodeError;
use tonic::{Code, Status};

/// An error answer of the HTTP API.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Detail<'a>,
}

/// The `error` object (also sent as an SSE event when a stream fails after it started).
#[derive(Serialize)]
pub(crate) struct Detail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    /// 400: a parameter is missing, malformed or not served; `param` names it.
    pub(crate) fn invalid(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }

    /// 413: the request body is over the limit.
    pub(crate) fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is over the limit of {limit} bytes"),
            param: None,
        }
    }

    /// 404: no such route.
    pub(crate) fn no_route(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route {path}"),
            param: None,
        }
    }

    /// The one mapping from a gRPC status to an HTTP error.
    pub(crate) fn from_status(s: &Status) -> ApiError {
        let status = match s.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                StatusCode::BAD_REQUEST
            }
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable | Code::Cancelled => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::Ok
            | Code::Unknown
            | Code::AlreadyExists
            | Code::Aborted
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let param = (s.code() == Code::NotFound).then_some("model");
        ApiError {
            status,
            message: s.message().to_string(),
            param,
        }
    }

    /// The HTTP status.
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// The `error` object.
    pub(crate) fn detail(&self) -> Detail<'_> {
        let (kind, code) = match self.status {
            StatusCode::BAD_REQUEST => ("invalid_request_error", None),
            StatusCode::NOT_FOUND if self.param.is_some() => {
                ("invalid_request_error", Some("model_not_found"))
            }
            StatusCode::NOT_FOUND => ("invalid_request_error", Some("not_found")),
            StatusCode::PAYLOAD_TOO_LARGE => ("invalid_request_error", Some("request_too_large")),
            StatusCode::TOO_MANY_REQUESTS => ("rate_limit_error", Some("rate_limit_exceeded")),
            StatusCode::SERVICE_UNAVAILABLE => {
                ("service_unavailable_error", Some("service_unavailable"))
            }
            StatusCode::GATEWAY_TIMEOUT => ("timeout_error", Some("timeout")),
            StatusCode::UNAUTHORIZED => ("invalid_request_error", Some("invalid_api_key")),
            StatusCode::FORBIDDEN => ("permission_error", None),
            _ => ("server_error", None),
        };
        Detail {
            message: &self.message,
            kind,
            param: self.param,
            code,
        }
    }

    /// `{"error": {...}}` as JSON text (for an SSE event).
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(&Body {
            error: self.detail(),
        })
        .unwrap_or_else(|_| r#"{"error":{"message":"internal error"}}"#.into())
    }
}

impl From<Status> for ApiError {
    fn from(s: Status) -> ApiError {
        ApiError::from_status(&s)
    }
}

impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> ApiError {
        ApiError::from_status(&Status::from(e))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = super::json_response(self.status(), self.to_json());
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // The bound is on work waiting now, which drains in about a second: clients that honour
            // Retry-After (the openai package does) come back then instead of at once.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}
