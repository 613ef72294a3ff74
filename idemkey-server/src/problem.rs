//! The payments API's own error answers, in the same problem+json shape as the layer's.
//!
//! Its own problem types are declared here ([`PAYMENTS`]), with the macro of the registry,
//! [`idemkey_core::problem`], whose types it answers too (`internal-error`,
//! `store-unavailable`, `server-overloaded`, `unauthorized`). A test checks
//! `docs/guide/contract.md` against both.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, header};
use idemkey_core::problem::{self, ProblemType};
use idemkey_tower::problem_response;

idemkey_core::problem_types! {
    /// Payments API: the body or query is invalid; nothing was done.
    INVALID_REQUEST = "invalid-request", 400, "Invalid request", retry: false;
    /// Payments API: the payment was declined (stored and replayed like any outcome).
    PAYMENT_DECLINED = "payment-declined", 402, "Payment declined", retry: false;
    /// Payments API: no such payment for this tenant.
    NOT_FOUND = "not-found", 404, "Not found", retry: false;
    /// Payments API: the tenant already made a payment with this `reference` (whatever its
    /// idempotency key); the answer names it (stored and replayed like any outcome).
    PAYMENT_REFERENCE_USED = "payment-reference-used", 409, "Payment reference already used",
        retry: false;
}

/// The payments API's own problem types. They are not in the client's registry
/// ([`problem::ALL`]): a client of another service never meets them.
pub const PAYMENTS: &[ProblemType] = &[
    INVALID_REQUEST,
    PAYMENT_DECLINED,
    NOT_FOUND,
    PAYMENT_REFERENCE_USED,
];

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
    /// The tenant already made the payment with this reference (stored and replayed like any
    /// outcome): it names that payment.
    ReferenceUsed {
        /// The existing payment.
        payment_id: String,
    },
    /// The database failed.
    Internal,
    /// The database cannot be reached (health check, or a server still starting); the
    /// detail says which. Answered with `Retry-After`.
    Unavailable(String),
    /// The server holds its limit of client connections (the number); the request was not
    /// run. Answered with `Retry-After`.
    Overloaded(usize),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut payment_id = None;
        let (problem, detail, errors) = match self {
            Self::Unauthorized => (
                &problem::UNAUTHORIZED,
                "a valid `Authorization: Bearer <token>` header is required".to_owned(),
                None,
            ),
            Self::InvalidRequest(errors) => (&INVALID_REQUEST, errors.join("; "), Some(errors)),
            Self::PaymentDeclined(reason) => (&PAYMENT_DECLINED, reason, None),
            Self::NotFound => (&NOT_FOUND, "no such payment".to_owned(), None),
            Self::ReferenceUsed { payment_id: id } => {
                let detail = format!("this reference was already used by payment {id}");
                payment_id = Some(id);
                (&PAYMENT_REFERENCE_USED, detail, None)
            }
            Self::Internal => (
                &problem::INTERNAL_ERROR,
                "the request failed; nothing was executed".to_owned(),
                None,
            ),
            Self::Unavailable(detail) => (&problem::STORE_UNAVAILABLE, detail, None),
            Self::Overloaded(limit) => (
                &problem::SERVER_OVERLOADED,
                format!(
                    "the server holds its limit of {limit} client connections; nothing was \
                     executed; retry after Retry-After"
                ),
                None,
            ),
        };
        let mut more = serde_json::Map::new();
        if let Some(errors) = errors {
            more.insert("errors".into(), serde_json::json!(errors));
        }
        if let Some(id) = payment_id {
            more.insert("payment_id".into(), serde_json::json!(id));
        }
        // The store or the server is busy: a retry a second later may get through.
        let retry_after = (problem.status == 503).then_some(1);
        let mut response = problem_response(problem, detail, more, retry_after, None);
        if problem.status == 401 {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;

    use super::*;

    #[test]
    fn its_own_types_are_not_the_registrys() {
        for p in PAYMENTS {
            assert_eq!(p.uri, format!("{}{}", problem::PROBLEM_TYPE_PREFIX, p.name));
            assert!(StatusCode::from_u16(p.status).is_ok(), "{}", p.name);
            assert!(
                problem::ALL.iter().all(|q| q.name != p.name),
                "{} is declared twice",
                p.name
            );
        }
    }
}
