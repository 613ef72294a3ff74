//! # idemkey-server
//!
//! The `idemkey` binary's library: a reference payments API built on the idempotency layer
//! the way a user's own service would be ([`app`]), the server around it ([`serve()`]), and
//! the operator commands ([`keys`]), and where the key secret comes from ([`secret`]).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post_service};
use idemkey_core::{Clock, FirstSentPolicy};
use idemkey_outbox::OutboxMetrics;
use idemkey_tower::{InFlightPolicy, KeyRequirement, Metrics};
use prometheus_client::registry::Registry;

mod auth;
pub mod bench;
pub mod check;
pub mod cli;
mod db;
pub mod demo;
pub mod gateway;
mod http_server;
pub mod keys;
mod metrics;
pub mod outbox;
mod payments;
pub mod problem;
pub mod secret;
mod serve;

pub use self::auth::{ApiKeys, DuplicateToken};
pub use self::http_server::HttpLimits;

/// The Rust samples of the README and of `docs/`, compiled by `cargo test --doc`: a sample
/// that no longer compiles fails the tests. (Only under `cfg(doctest)`: the packaged crate
/// does not need the workspace's files.)
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
#[doc = include_str!("../../docs/guide/getting-started.md")]
#[doc = include_str!("../../docs/guide/contract.md")]
#[doc = include_str!("../../docs/guide/modes.md")]
#[doc = include_str!("../../docs/guide/gateway.md")]
#[doc = include_str!("../../docs/guide/outbox.md")]
#[doc = include_str!("../../docs/guide/operating.md")]
#[doc = include_str!("../../docs/guide/scaling-out.md")]
#[doc = include_str!("../../docs/guide/troubleshooting.md")]
#[doc = include_str!("../../docs/README.md")]
#[doc = include_str!("../../docs/records.md")]
#[doc = include_str!("../../docs/fingerprint.md")]
#[doc = include_str!("../../docs/metrics.md")]
#[doc = include_str!("../../docs/benchmarks.md")]
#[doc = include_str!("../../docs/decisions.md")]
#[doc = include_str!("../../docs/reliability.md")]
pub struct ReadmeDoctests;
pub use self::db::{
    AppDb, Backend, DatabaseOptions, OnDatabase, Payment, Unavailable, open_existing, with_database,
};
pub use self::gateway::GatewayDb;
pub use self::secret::KeySecrets;
pub use self::serve::{ServeOptions, serve, serve_on, serve_with};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState<S> {
    /// The store, which also holds the payments tables.
    pub db: S,
    /// How long the payment handler waits inside its transaction (demos, race tests).
    pub simulate_latency: Duration,
    /// Whether each succeeded payment enqueues a `payment.succeeded` outbox message.
    pub emit_messages: bool,
}

/// How long `GET /healthz` waits for the database before it answers 503.
const HEALTH_BOUND: Duration = Duration::from_secs(1);

/// `GET /healthz`: 200 `ok` when the database answers a `SELECT 1` within a second, else
/// 503 `store-unavailable` (problem+json, `Retry-After`): every keyed write would fail too.
async fn healthz<S: AppDb>(State(db): State<S>) -> Response {
    match tokio::time::timeout(HEALTH_BOUND, db.ping()).await {
        Ok(Ok(())) => "ok\n".into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "health check: the database failed");
            problem::ApiError::Unavailable("the database is unreachable".to_owned()).into_response()
        }
        Err(_) => {
            tracing::warn!("health check: the database did not answer within {HEALTH_BOUND:?}");
            problem::ApiError::Unavailable(format!(
                "the database did not answer within {HEALTH_BOUND:?}"
            ))
            .into_response()
        }
    }
}

/// How the payments API applies the idempotency contract.
#[derive(Debug, Clone)]
pub struct AppConfig {
    /// Bearer token → tenant.
    pub api_keys: ApiKeys,
    /// Wait inside the payment transaction (0: none).
    pub simulate_latency: Duration,
    /// How long outcomes are kept.
    pub retention: Duration,
    /// What a retry gets while the first attempt runs.
    pub in_flight: InFlightPolicy,
    /// How keyed requests' first-attempt times are read and judged.
    pub first_sent: FirstSentPolicy,
    /// Where the layer reads the time (the system clock; the late demo moves its own).
    pub clock: Arc<dyn Clock>,
    /// With an outbox sink: each succeeded payment enqueues a `payment.succeeded` message,
    /// and `/metrics` shows these counters too.
    pub outbox: Option<OutboxMetrics>,
}

/// The payments API:
///
/// - `POST /v1/payments` (key required) and `GET /v1/payments[/{id}]`;
/// - `POST /v1/baseline/payments`: the same effect without idempotency, the baseline that
///   `idemkey bench` compares against;
/// - `GET /idempotency/v1/keys/{key}`: the status resource;
/// - `GET /metrics` (Prometheus text) and `GET /healthz` (200, or 503 problem+json when the
///   database does not answer), without authentication.
///
/// Keys are hashed with the current secret of `secrets`; during a rotation, records made
/// under the previous one still answer (the layer and the status resource look there too).
pub fn app<S: AppDb>(db: S, secrets: &KeySecrets, metrics: Metrics, config: &AppConfig) -> Router {
    let idempotency = secrets
        .layer(db.clone())
        .retention(config.retention)
        .in_flight(config.in_flight)
        .first_sent(config.first_sent.requirement)
        .first_sent_skew(config.first_sent.skew)
        .clock(config.clock.clone())
        .metrics(metrics.clone());
    let state = AppState {
        db: db.clone(),
        simulate_latency: config.simulate_latency,
        emit_messages: config.outbox.is_some(),
    };
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    if let Some(outbox) = &config.outbox {
        outbox.register(&mut registry);
    }
    let api = Router::new()
        .route(
            "/v1/payments",
            post_service(
                idempotency
                    .clone()
                    .requirement(KeyRequirement::Required)
                    .handler_service(payments::create_payment::<S>, state.clone()),
            )
            .get(payments::list_payments::<S>),
        )
        .route("/v1/payments/{id}", get(payments::get_payment::<S>))
        .route(
            "/v1/baseline/payments",
            post_service(
                idempotency
                    .clone()
                    .requirement(KeyRequirement::Off)
                    .handler_service(payments::create_payment::<S>, state.clone()),
            ),
        )
        .with_state(state)
        .merge(idempotency.status_router())
        .layer(from_fn_with_state(
            config.api_keys.clone(),
            auth::authenticate,
        ));
    Router::new()
        .route("/healthz", get(healthz::<S>).with_state(db.clone()))
        .route("/metrics", crate::metrics::route(registry))
        .merge(api)
}
