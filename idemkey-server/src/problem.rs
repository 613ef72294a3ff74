//! The payments API's own error answers, in the same problem+json shape as the layer's.
//!
//! Its own problem types are declared here ([`PAYMENTS`]), with the macro of the registry,
//! [`idemkey_core::problem`], whose types it answers too (`internal-error`,
//! `store-unavailable`, `server-overloaded`, `unauthorized`); so are the HTTP server's
//! ([`HTTP_SERVER`]), which `serve` and `gateway` answer to a request no route runs. A test
//! checks `docs/guide/contract.md` against every list.

use axum::Router;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Method, Uri, header};
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

idemkey_core::problem_types! {
    /// `serve` and `gateway`: the request line or a header field is not HTTP/1.1; nothing was
    /// run and the connection is closed.
    REQUEST_MALFORMED = "request-malformed", 400, "Malformed request", retry: false;
    /// `serve` and `gateway`: the request target is longer than the server reads; nothing
    /// was run and the connection is closed.
    URI_TOO_LONG = "uri-too-long", 414, "URI too long", retry: false;
    /// `serve` and `gateway`: the header section has more fields or bytes than the server
    /// reads; nothing was run and the connection is closed.
    HEADERS_TOO_LARGE = "headers-too-large", 431, "Request header fields too large",
        retry: false;
    /// `serve` and `relay`: no route has this path.
    ROUTE_NOT_FOUND = "route-not-found", 404, "Route not found", retry: false;
    /// `serve` and `gateway`: the route exists, without this method (the gateway: `CONNECT`,
    /// which it does not forward); `Allow` lists its methods.
    METHOD_NOT_ALLOWED = "method-not-allowed", 405, "Method not allowed", retry: false;
}

/// The HTTP server's problem types: what `serve` and `gateway` answer to a request that no
/// route runs (a head that cannot be read, a path or a method no route has). The server
/// answers `server-overloaded` too, which is the contract's.
pub const HTTP_SERVER: &[ProblemType] = &[
    REQUEST_MALFORMED,
    URI_TOO_LONG,
    HEADERS_TOO_LARGE,
    ROUTE_NOT_FOUND,
    METHOD_NOT_ALLOWED,
];

/// `router` answering a path no route has with 404 `route-not-found`, and a method its
/// route lacks with 405 `method-not-allowed` (see [`method_not_allowed`]).
pub(crate) fn route_not_found(router: Router) -> Router {
    method_not_allowed(router.fallback(|method: Method, uri: Uri| async move {
        ApiError::RouteNotFound(format!("{method} {}", uri.path())).into_response()
    }))
}

/// `router` answering a method that a route of it lacks with 405 `method-not-allowed`; the
/// `Allow` header axum sets is kept. Only the routes `router` has so far get it.
pub(crate) fn method_not_allowed(router: Router) -> Router {
    router.method_not_allowed_fallback(|method: Method, uri: Uri| async move {
        ApiError::MethodNotAllowed {
            method,
            path: uri.path().to_owned(),
        }
        .into_response()
    })
}

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
    /// The request head could not be parsed.
    RequestMalformed,
    /// The request target is too long.
    UriTooLong,
    /// The header section is too large.
    HeadersTooLarge,
    /// No route has the path of this request (`METHOD /path`).
    RouteNotFound(String),
    /// The route of this path lacks this method.
    MethodNotAllowed {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
    },
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
            Self::RequestMalformed => (
                &REQUEST_MALFORMED,
                "the request line or a header field is not HTTP/1.1; nothing was executed"
                    .to_owned(),
                None,
            ),
            Self::UriTooLong => (
                &URI_TOO_LONG,
                "the request target is longer than 65,534 bytes; nothing was executed".to_owned(),
                None,
            ),
            Self::HeadersTooLarge => (
                &HEADERS_TOO_LARGE,
                "the header section has more than 100 fields, or more bytes than the server \
                 reads (about 400 KiB); nothing was executed"
                    .to_owned(),
                None,
            ),
            Self::RouteNotFound(request) => {
                (&ROUTE_NOT_FOUND, format!("no route for {request}"), None)
            }
            Self::MethodNotAllowed { method, path } => (
                &METHOD_NOT_ALLOWED,
                format!("{path} does not take {method}; Allow lists the methods it takes"),
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
        let own: Vec<&ProblemType> = PAYMENTS.iter().chain(HTTP_SERVER).collect();
        for (i, p) in own.iter().enumerate() {
            assert!(
                own[i + 1..].iter().all(|q| q.name != p.name),
                "{} is declared twice",
                p.name
            );
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
