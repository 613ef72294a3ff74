//! The payments API's own error answers, in the same problem+json shape as the layer's.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use idemkey_tower::{PROBLEM_JSON, PROBLEM_TYPE_PREFIX};

/// An error of the payments API.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum ApiError {
    /// No or an unknown bearer token.
    Unauthorized,
    /// The request body or query is not valid; nothing was done.
    InvalidRequest(Vec<String>),
    /// The payment was declined (stored and replayed like any outcome).
    PaymentDeclined(String),
    /// No such payment for this tenant.
    NotFound,
    /// The database failed.
    Internal,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, name, title, detail, errors) = match self {
            Self::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Unauthorized",
                "a valid `Authorization: Bearer <token>` header is required".to_owned(),
                None,
            ),
            Self::InvalidRequest(errors) => (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request",
                errors.join("; "),
                Some(errors),
            ),
            Self::PaymentDeclined(reason) => (
                StatusCode::PAYMENT_REQUIRED,
                "payment-declined",
                "Payment declined",
                reason,
                None,
            ),
            Self::NotFound => (
                StatusCode::NOT_FOUND,
                "not-found",
                "Not found",
                "no such payment".to_owned(),
                None,
            ),
            Self::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal-error",
                "Internal error",
                "the request failed; nothing was executed".to_owned(),
                None,
            ),
        };
        let mut body = serde_json::json!({
            "type": format!("{PROBLEM_TYPE_PREFIX}{name}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        if let Some(errors) = errors {
            body["errors"] = serde_json::json!(errors);
        }
        let mut response = (status, body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
