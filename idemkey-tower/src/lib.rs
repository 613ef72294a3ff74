//! # idemkey-tower
//!
//! A tower [`Layer`](tower_layer::Layer) and an axum extractor that make retried HTTP writes
//! safe: a client sends the same `Idempotency-Key` on every attempt of one logical write;
//! the layer claims the key in a database transaction, the handler writes its effect on that
//! same transaction ([`Tx`]), and the layer stores the response in it and commits. Every
//! retry gets the stored response, byte for byte, with `Idempotent-Replayed: true`.
//!
//! | situation | answer |
//! |---|---|
//! | first attempt | the handler runs; its outcome is stored with its effect |
//! | same key, same request, completed | the stored status, allowlisted headers and body |
//! | same key, different request | 422 `key-reused`, naming what differs |
//! | same key, first attempt running | wait (default 5 s) then replay; or 409 + `Retry-After` |
//! | outcome unknown | 409 `outcome-unknown`, with the status resource's URL |
//! | store unreachable | 503 + `Retry-After`; the handler does not run |
//!
//! For an effect outside the store's database (a call to another service), the layer's
//! external mode ([`mode::External`]) reserves the key first and hands the handler an
//! [`External`] instead. The mode is the layer's type, and a route built with
//! [`IdempotencyLayer::handler`] has its handler's extractors checked against it when the
//! router is built.
//!
//! Errors are `application/problem+json` ([`IdempotencyRejection`]). The full contract is
//! in `docs/guide/contract.md`. See [`IdempotencyLayer`] for an example.

mod cache;
mod clock;
mod coalesce;
mod external;
mod layer;
mod metrics;
pub mod mode;
mod policy;
mod problem;
mod purge;
mod service;
mod status;
mod tx;

pub use self::cache::{
    DEFAULT_BYTES as REPLAY_CACHE_MAX_BYTES, DEFAULT_ENTRIES as REPLAY_CACHE_DEFAULT_ENTRIES,
    UNNOTIFIED_BOUND as REPLAY_CACHE_UNNOTIFIED_BOUND,
};
pub use self::clock::SystemClock;
pub use self::external::External;
pub use self::layer::{
    DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_STORED_RESPONSE, DEFAULT_RETENTION, IdempotencyLayer,
    STATUS_PATH,
};
pub use self::metrics::{Metrics, Outcome};
pub use self::policy::{InFlightPolicy, KeyRequirement};
pub use self::problem::{
    IdempotencyRejection, PROBLEM_JSON, PROBLEM_TYPE_PREFIX, problem_response,
};
pub use self::purge::{PURGE_BATCH, PurgeStats, PurgeTask};
pub use self::service::{
    EXPIRES_HEADER, IdempotencyService, REPLAYED_HEADER, RETRY_AFTER, is_safe, stored_headers,
};
pub use self::status::status_router;
pub use self::tx::Tx;
pub use idemkey_core::{AfterEffect, AnswerRule};

/// The authenticated tenant of a request, as a request extension set by the application's
/// authentication middleware. Keys are scoped by it. Requests without one share the
/// [`Tenant::DEFAULT`] tenant, and the layer warns once, at the first such keyed request:
/// callers sharing a tenant can be answered with one another's stored responses. A service
/// with one caller sets a fixed `Tenant` itself to say so.
///
/// ```
/// use axum::{extract::Request, middleware::Next, response::{IntoResponse, Response}};
/// use http::StatusCode;
/// use idemkey_tower::Tenant;
///
/// /// Runs before the idempotency layer (add it with `Router::layer(from_fn(authenticate))`
/// /// outside the routes' layers): keys are scoped by the tenant it sets.
/// async fn authenticate(mut request: Request, next: Next) -> Response {
///     let token = request
///         .headers()
///         .get(http::header::AUTHORIZATION)
///         .and_then(|value| value.to_str().ok());
///     // Stand-in lookup: map a verified credential to its tenant.
///     let tenant = match token {
///         Some("Bearer tok_acme") => "acme",
///         _ => return StatusCode::UNAUTHORIZED.into_response(),
///     };
///     request.extensions_mut().insert(Tenant(tenant.to_owned()));
///     next.run(request).await
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

impl Tenant {
    /// The tenant of requests that carry no [`Tenant`] extension.
    pub const DEFAULT: &'static str = "default";
}
