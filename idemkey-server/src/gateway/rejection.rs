//! The gateway's own error answers: about its tenants, its upstream and what it cannot
//! proxy. Each case names its problem type next to its definition; the types are declared in
//! the registry's list of the gateway's ([`idemkey_core::problem::GATEWAY`]), so that a client
//! knows whether to retry them, but for a method it does not forward, which is the HTTP
//! server's 405 ([`crate::problem::HTTP_SERVER`]). Everything else the gateway answers is the
//! layer's ([`IdempotencyRejection`](idemkey_tower::IdempotencyRejection)).

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Method, StatusCode, header};
use idemkey_core::problem::{self, ProblemType};
use idemkey_tower::problem_response;

/// An error answered by the gateway itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayRejection {
    /// No or an unknown bearer token (tenants from API keys).
    #[error("a valid `Authorization: Bearer <token>` header is required")]
    Unauthorized,
    /// The tenant header is missing (or not a single, valid tenant): the request did not come
    /// through the authenticating proxy.
    #[error("the request carries no authenticated tenant")]
    Unauthenticated,
    /// The upstream could not be reached (connection refused or timed out); nothing was sent
    /// and the key is free again.
    #[error("the upstream service could not be reached; the request was not sent")]
    UpstreamUnavailable {
        /// When to try again.
        retry_after: Duration,
    },
    /// The request was sent upstream, and no complete answer came back (time-out, reset,
    /// closed connection). The operation may or may not have happened; it is not re-executed
    /// until it is resolved.
    #[error(
        "the request was sent to the upstream service and no answer came back; its outcome is unknown and it will not be retried automatically"
    )]
    UpstreamOutcomeUnknown {
        /// The status resource of the key.
        status_url: String,
    },
    /// A request without a key: the upstream gave no complete answer. Nothing is known about
    /// the outcome and nothing protects a retry.
    #[error("the upstream service gave no complete answer")]
    UpstreamFailed,
    /// A method the gateway does not forward: `CONNECT` asks for a tunnel, which a reverse
    /// proxy does not open. Nothing was forwarded; `Allow` lists the methods it forwards.
    #[error("the gateway does not forward {0}: it forwards requests, it opens no tunnels")]
    NotForwarded(Method),
}

/// The `Allow` of [`GatewayRejection::NotForwarded`]: the methods of HTTP's own the gateway
/// forwards (others, registered or not, it forwards too).
const FORWARDED: &str = "GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE";

impl GatewayRejection {
    /// The problem type of this answer: its `type`, status and title, and whether a client
    /// may retry it with the same key.
    pub fn problem(&self) -> &'static ProblemType {
        match self {
            Self::Unauthorized | Self::Unauthenticated => &problem::UNAUTHORIZED,
            Self::UpstreamUnavailable { .. } => &problem::UPSTREAM_UNAVAILABLE,
            Self::UpstreamOutcomeUnknown { .. } => &problem::UPSTREAM_OUTCOME_UNKNOWN,
            Self::UpstreamFailed => &problem::UPSTREAM_FAILED,
            Self::NotForwarded(_) => &crate::problem::METHOD_NOT_ALLOWED,
        }
    }

    /// The HTTP status of this answer.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.problem().status)
            .expect("every registered problem type has a valid status")
    }
}

impl IntoResponse for GatewayRejection {
    fn into_response(self) -> Response {
        let retry_after = match &self {
            Self::UpstreamUnavailable { retry_after } => Some(retry_after.as_secs().max(1)),
            _ => None,
        };
        let status_url = match &self {
            Self::UpstreamOutcomeUnknown { status_url } => Some(status_url.as_str()),
            _ => None,
        };
        let mut response = problem_response(
            self.problem(),
            self.to_string(),
            serde_json::Map::new(),
            retry_after,
            status_url,
        );
        let headers = response.headers_mut();
        match self {
            Self::Unauthorized | Self::Unauthenticated => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            Self::NotForwarded(_) => {
                headers.insert(header::ALLOW, HeaderValue::from_static(FORWARDED));
            }
            _ => {}
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use idemkey_core::problem::PROBLEM_JSON;

    use super::*;

    #[test]
    fn every_rejection_is_one_of_the_gateways_types_or_the_servers_405() {
        let all = [
            GatewayRejection::Unauthorized,
            GatewayRejection::Unauthenticated,
            GatewayRejection::UpstreamUnavailable {
                retry_after: Duration::from_secs(1),
            },
            GatewayRejection::UpstreamOutcomeUnknown {
                status_url: "/idempotency-keys/k".into(),
            },
            GatewayRejection::UpstreamFailed,
            GatewayRejection::NotForwarded(Method::CONNECT),
        ];
        for rejection in all {
            let p = rejection.problem();
            let types = match rejection {
                GatewayRejection::NotForwarded(_) => crate::problem::HTTP_SERVER,
                _ => problem::GATEWAY,
            };
            assert!(types.contains(p), "{}", p.name);
            let response = rejection.into_response();
            assert_eq!(response.status().as_u16(), p.status);
            assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        }
    }

    #[test]
    fn an_unknown_outcome_links_its_status_resource() {
        let response = GatewayRejection::UpstreamOutcomeUnknown {
            status_url: "/idempotency-keys/k".into(),
        }
        .into_response();
        assert_eq!(
            response.headers()[header::LINK],
            "</idempotency-keys/k>; rel=\"status\""
        );
        let response = GatewayRejection::UpstreamUnavailable {
            retry_after: Duration::ZERO,
        }
        .into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }
}
