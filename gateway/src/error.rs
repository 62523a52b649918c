//! Typed errors and their one rendering at the edge: the OpenAI envelope
//! `{"error": {"message", "type", "param", "code"}}` with a string code and
//! the matching HTTP status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// String code, e.g. `model_not_found`.
    pub code: String,
    /// The offending request parameter, if any.
    pub param: Option<String>,
    /// Human-readable message.
    pub message: String,
    /// Seconds for `Retry-After` (429, 503).
    pub retry_after: Option<u64>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            code: code.into(),
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// 400 naming the parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e =
            Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_value", message);
        e.param = Some(param.into());
        e
    }

    /// 400 for a parameter whose value cannot be honoured.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "unsupported_parameter",
            message,
        );
        e.param = Some(param.into());
        e
    }

    /// 400 for a missing required parameter.
    pub fn missing(param: &str) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "missing_required_parameter",
            format!("missing required parameter: '{param}'"),
        );
        e.param = Some(param.into());
        e
    }

    /// 400 for a body that is not JSON.
    pub fn malformed_json(detail: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            format!("the request body is not valid JSON: {detail}"),
        )
    }

    /// 401: one answer for missing, unknown, revoked and expired keys, so
    /// the answer reveals nothing about which keys exist.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Incorrect or missing API key. Pass 'Authorization: Bearer gnus_...'.",
        )
    }

    /// 403 naming what the key may not use.
    pub fn forbidden(param: &str, message: impl Into<String>) -> Self {
        let mut e =
            Self::new(StatusCode::FORBIDDEN, "permission_error", "permission_denied", message);
        e.param = Some(param.into());
        e
    }

    /// 404 for a model nobody serves or has served.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("The model '{model}' does not exist or no node in the network serves it."),
        );
        e.param = Some("model".into());
        e
    }

    /// 404 for an unknown path.
    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "unknown_url",
            format!("Unknown request URL: {path}."),
        )
    }

    /// 405.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            "Method not allowed for this URL.",
        )
    }

    /// 413.
    pub fn too_large(max: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("The request body exceeds the limit of {max} bytes."),
        )
    }

    /// 408: the body did not arrive within `secs`.
    pub fn request_timeout(secs: u64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!("The request body did not arrive within {secs} s."),
        )
    }

    /// 415: the body is declared as something other than JSON.
    pub fn unsupported_media_type(declared: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            format!(
                "The request body must be JSON (Content-Type: application/json), not '{declared}'."
            ),
        )
    }

    /// 422: the idempotency key belongs to a request with another body.
    pub fn idempotency_conflict(job_id: &str) -> Self {
        let mut e = Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request_error",
            "idempotency_key_reused",
            format!(
                "This Idempotency-Key was already used for request {job_id} with a different body."
            ),
        );
        e.param = Some("Idempotency-Key".into());
        e
    }

    /// 429 with Retry-After.
    pub fn rate_limited(code: &str, message: impl Into<String>, retry_after_s: u64) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", code, message);
        e.retry_after = Some(retry_after_s.max(1));
        e
    }

    /// 503: no worker in the network can serve this now.
    pub fn no_capable_nodes(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "gnus_no_capable_nodes",
            format!("No node in the network can serve '{model}' right now."),
        );
        e.retry_after = Some(5);
        e
    }

    /// 503 for anything else transient.
    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "service_unavailable",
            message,
        );
        e.retry_after = Some(1);
        e
    }

    /// 504.
    pub fn timeout(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", code, message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }

    /// A worker- or network-side error (26.17.2) mapped to its status.
    pub fn from_info(e: &gcs_protocol::ErrorInfo) -> Self {
        let status = match (e.kind.as_str(), e.code.as_str()) {
            (_, "gnus_no_capable_nodes") => StatusCode::SERVICE_UNAVAILABLE,
            ("timeout", _) => StatusCode::GATEWAY_TIMEOUT,
            ("invalid_request_error", _) => StatusCode::BAD_REQUEST,
            ("service_unavailable", _) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let kind = match status {
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            StatusCode::GATEWAY_TIMEOUT => "timeout",
            StatusCode::BAD_REQUEST => "invalid_request_error",
            _ => "server_error",
        };
        let mut out = Self::new(status, kind, &e.code, e.message.clone());
        if status == StatusCode::SERVICE_UNAVAILABLE {
            out.retry_after = Some(5);
        }
        out
    }

    /// The envelope body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind,
                         "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, crate::json_body(&self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}
