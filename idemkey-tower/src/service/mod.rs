//! The middleware: one request's way through the layer.
//!
//! - this file: the `Service`, the key, and the claim every keyed request makes (tenant →
//!   scope → record id → fingerprint), whatever the mode;
//! - [`local`]: local mode, the claim and the handler's effect in one transaction;
//! - [`external`]: external mode, the owner flow after a reservation (shared by
//!   `idemkey gateway`, which is this mode plus a proxy handler);
//! - [`stored`]: what is kept of an answer, and the replay;
//! - [`coding`]: content codings: a stored body's, what a retry accepts, a request body's;
//! - [`body`]: bounded request bodies, and their content.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Method, Request, header};
use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    FIRST_SENT_HEADER, Fingerprint, HEADER_NAME, IdempotencyKey, REPEATABILITY_RESULT_HEADER,
    RecordId, RequestParts, Scope, Store, StoreError, StoredResponse, Timestamp, fingerprint,
};
use tower_service::Service;
use tracing::Instrument;

use crate::InFlightPolicy;
use crate::coalesce::{self, Turn, TurnGuard};
use crate::layer::Config;
use crate::metrics::Outcome;
use crate::mode::Mode;
use crate::{IdempotencyLayer, IdempotencyRejection, KeyRequirement, Tenant};

mod body;
mod coding;
mod external;
mod local;
mod stored;

pub use self::stored::{EXPIRES_HEADER, REPLAYED_HEADER, stored_headers};

/// How long a client is asked to wait before retrying after a 409 or 503.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The [`Service`] built by [`IdempotencyLayer`].
#[derive(Debug, Clone)]
pub struct IdempotencyService<S, M, I> {
    pub(crate) inner: I,
    pub(crate) layer: IdempotencyLayer<S, M>,
}

impl<S, M, I> Service<Request<Body>> for IdempotencyService<S, M, I>
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    I::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The ready service goes with this request; the clone waits for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        Box::pin(async move { Ok(handle(layer, inner, req).await) })
    }
}

/// Whether `method` is safe (`GET`, `HEAD`, `OPTIONS`, `TRACE`): never keyed.
pub fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

async fn handle<S, M, I>(layer: IdempotencyLayer<S, M>, inner: I, req: Request<Body>) -> Response
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let config = layer.config.clone();
    if is_safe(req.method()) {
        return call(inner, req).await;
    }
    let key = match config.requirement {
        KeyRequirement::Off => None,
        _ => {
            let fields = req.headers().get_all(HEADER_NAME);
            match IdempotencyKey::from_fields(fields.iter().map(HeaderValue::as_bytes)) {
                Ok(key) => key,
                Err(e) => return refused(&config, req, IdempotencyRejection::KeyInvalid(e)).await,
            }
        }
    };
    match key {
        Some(key) => {
            // The time of the first attempt, read before anything else of a keyed request.
            let fields = req.headers().get_all(FIRST_SENT_HEADER);
            let stated = fields.iter().next().is_some();
            let now = config.clock.now();
            match config.first_sent.read(
                fields.iter().map(HeaderValue::as_bytes),
                now,
                config.retention,
            ) {
                Ok(first_sent) => {
                    Keyed::new(layer, key, req.headers(), first_sent, stated)
                        .run(inner, req)
                        .await
                }
                Err(e) => {
                    let mut response =
                        refused(&config, req, IdempotencyRejection::FirstSent(e)).await;
                    if stated {
                        repeatability_result(&mut response, Outcome::Rejected);
                    }
                    response
                }
            }
        }
        None if config.requirement == KeyRequirement::Required => {
            refused(&config, req, IdempotencyRejection::KeyMissing).await
        }
        // Without a key there is nothing to reserve: the handler calls out unprotected.
        None if layer.mode.external().is_some() => call(inner, req).await,
        None => local::unkeyed(layer, inner, req).await,
    }
}

/// A keyed request refused before any claim.
///
/// Its body is read (and dropped) first, within the route's limit as a keyed request's
/// would be: an answer given over an unread body makes the server close the connection
/// without saying so, and a client that reuses it fails its next request. A body over the
/// limit is not read; the answer then says `Connection: close`.
async fn refused(config: &Config, req: Request<Body>, rejection: IdempotencyRejection) -> Response {
    config.metrics.attempt();
    config.metrics.record(Outcome::Rejected, Duration::ZERO);
    let (parts, body) = req.into_parts();
    let drained = body::read_body(&parts.headers, body, config.max_request_body)
        .await
        .is_ok();
    let mut response = rejection.into_response();
    if !drained {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// `Repeatability-Result` for a request that stated its first attempt's time: `accepted`
/// when the handler ran or its stored outcome was replayed, `rejected` otherwise.
fn repeatability_result(response: &mut Response, outcome: Outcome) {
    let result = match outcome {
        Outcome::Executed | Outcome::NotStored | Outcome::Replayed => "accepted",
        _ => "rejected",
    };
    response.headers_mut().insert(
        REPEATABILITY_RESULT_HEADER,
        HeaderValue::from_static(result),
    );
}

/// Warns, once per layer, that a keyed request came without a [`Tenant`]: every such
/// caller shares one key space, so one caller's retry can be answered with another's
/// stored response. A single-tenant service silences it by setting a `Tenant` itself.
fn warn_untenanted(config: &Config, route: &str) {
    if !config.warned_untenanted.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            route,
            "a keyed request came without a Tenant extension: every caller without one \
             shares the tenant \"{}\" and can be answered with another's stored response; \
             set the authenticated caller's Tenant before the idempotency layer",
            Tenant::DEFAULT
        );
    }
}

async fn call<I>(mut inner: I, req: Request<Body>) -> Response
where
    I: Service<Request<Body>, Response = Response, Error = Infallible>,
{
    match inner.call(req).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The answer when the store fails: 503 with `Retry-After`, `store-busy` when a lock was not
/// granted in time (on SQLite that lock is the whole database's, held by any request, so it
/// says nothing about this key), `store-unavailable` otherwise.
fn store_unavailable(error: &StoreError) -> Response {
    tracing::warn!(error = %error, source = ?std::error::Error::source(error), "idempotency store failed");
    match error {
        StoreError::Busy(_) => IdempotencyRejection::StoreBusy {
            retry_after: RETRY_AFTER,
        },
        _ => IdempotencyRejection::StoreUnavailable {
            retry_after: RETRY_AFTER,
        },
    }
    .into_response()
}

/// One keyed request on its way through the layer.
struct Keyed<S, M> {
    layer: IdempotencyLayer<S, M>,
    config: Arc<Config>,
    key: IdempotencyKey,
    /// The request's `Accept-Encoding` fields: the codings a replay may be sent in.
    accept_encoding: Vec<HeaderValue>,
    /// The first attempt's time the request stated, accepted by the route's policy.
    first_sent: Option<Timestamp>,
    /// Whether the request carried `Repeatability-First-Sent`: its answers then carry
    /// `Repeatability-Result`.
    stated: bool,
    started: Instant,
    /// The replay cache's generation before this request read the store: a fill from an
    /// older read is refused (see `crate::cache`).
    ticket: crate::cache::Ticket,
}

impl<S: Store, M: Mode> Keyed<S, M> {
    fn new(
        layer: IdempotencyLayer<S, M>,
        key: IdempotencyKey,
        headers: &HeaderMap,
        first_sent: Option<Timestamp>,
        stated: bool,
    ) -> Self {
        let config = layer.config.clone();
        config.metrics.attempt();
        Self {
            layer,
            config,
            key,
            accept_encoding: (headers.get_all(header::ACCEPT_ENCODING).iter())
                .cloned()
                .collect(),
            first_sent,
            stated,
            started: Instant::now(),
            ticket: crate::cache::Ticket::default(),
        }
    }

    fn finish(&self, outcome: Outcome, response: impl IntoResponse) -> Response {
        self.config.metrics.record(outcome, self.started.elapsed());
        tracing::Span::current().record("outcome", tracing::field::debug(outcome));
        let mut response = response.into_response();
        if self.stated {
            repeatability_result(&mut response, outcome);
        }
        response
    }

    /// The answer from the record `id` this attempt did not claim; a replay is cached.
    fn answer_existing(
        &self,
        outcome: ClaimOutcome,
        id: &RecordId,
        fingerprint: &Fingerprint,
    ) -> Response {
        if let ClaimOutcome::Replay {
            response,
            expires_at,
            first_sent,
        } = &outcome
        {
            self.keep(id, fingerprint, *first_sent, response, *expires_at);
        }
        self.answer(outcome)
    }

    /// The answer a record gives, as [`stored::answer_claim`] makes it.
    fn answer(&self, outcome: ClaimOutcome) -> Response {
        let now = self.config.clock.now();
        let (outcome, response) = stored::answer_claim(
            outcome,
            &self.key,
            now,
            &self.accept_encoding,
            self.config.max_stored_response,
        );
        self.finish(outcome, response)
    }

    /// Keeps the record this attempt completed in the replay cache (when there is one).
    fn cache_completed(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) {
        self.keep(id, fingerprint, self.first_sent, response, expires_at);
    }

    /// Keeps a completed record in the replay cache (when there is one).
    fn keep(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        first_sent: Option<Timestamp>,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) {
        if let Some(cache) = &self.config.cache {
            let now = self.config.clock.now();
            cache.insert(
                self.ticket,
                id,
                fingerprint,
                first_sent,
                response,
                expires_at,
                now,
            );
        }
    }

    /// What the record `id` answers this request, read without a claim
    /// ([`protocol::lookup`]); a store failure is the answer.
    async fn look_up(
        &self,
        id: &RecordId,
        claim: &Claim,
    ) -> Result<Option<ClaimOutcome>, Response> {
        let store = &self.layer.store;
        let read = protocol::lookup(store, id, &claim.fingerprint, claim.first_sent, claim.now);
        self.found(read).await
    }

    /// What `read`, a read of the store, found; a store failure is the answer.
    async fn found(
        &self,
        read: impl Future<Output = protocol::Result<Option<ClaimOutcome>>>,
    ) -> Result<Option<ClaimOutcome>, Response> {
        match read.await {
            Ok(outcome) => Ok(outcome),
            Err(protocol::Error::Store(e)) => {
                Err(self.finish(Outcome::StoreError, store_unavailable(&e)))
            }
            Err(e) => {
                tracing::error!(error = %e, "looking up an idempotency record failed");
                Err(self.finish(Outcome::StoreError, IdempotencyRejection::Internal))
            }
        }
    }

    /// Waits, in memory, until no other attempt of this record is at the store in this
    /// process (see `crate::coalesce`), then holds the turn. Under [`InFlightPolicy::Wait`]
    /// the wait counts against its bound, and what is left of it after a wait is returned
    /// for the claim's lock wait (`None`: there was no wait, the whole bound is left); a
    /// completed answer found in the replay cache after the wait is the answer. Under
    /// `Reject` nobody waits here.
    async fn take_turn(
        &mut self,
        claim: &mut Claim,
    ) -> Result<(Option<TurnGuard>, Option<Duration>), Response> {
        let InFlightPolicy::Wait(bound) = self.config.in_flight else {
            return Ok((None, None));
        };
        // Counted on the layer's clock from the claim's time (saturating, so a bound past
        // what the clock can count waits as long as it can).
        let deadline = claim.now.plus(bound);
        let config = self.config.clone();
        let mut waited = false;
        loop {
            let done = match config.turns.take(claim.id.digest()) {
                Turn::Mine(guard) => {
                    let left = waited.then(|| config.clock.now().until(deadline));
                    return Ok((Some(guard), left));
                }
                Turn::Wait(done) => done,
            };
            waited = true;
            let ended = {
                // Counted while waiting, also when the request is dropped mid-wait.
                let _waiting = config.metrics.waiting();
                let left = config.clock.now().until(deadline);
                tokio::select! {
                    () = coalesce::ended(done) => true,
                    () = config.clock.sleep(left) => false,
                }
            };
            if !ended {
                return Err(self.answer(ClaimOutcome::InFlight {
                    lease_expires_at: None,
                    expires_at: None,
                }));
            }
            claim.now = config.clock.now();
            if let Some(cache) = &config.cache {
                if let Some(outcome) =
                    cache.answer(&claim.id, &claim.fingerprint, claim.first_sent, claim.now)
                {
                    config.metrics.replay_cache_hit();
                    return Err(self.answer(outcome));
                }
                self.ticket = cache.ticket();
            }
        }
    }

    /// Tenant → scope → record id, then the body and the fingerprint: the claim, made by
    /// the mode of the route.
    async fn run<I>(mut self, inner: I, req: Request<Body>) -> Response
    where
        I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
        I::Future: Send + 'static,
    {
        let route = match (&self.config.route, req.extensions().get::<MatchedPath>()) {
            (Some(route), _) => route.clone(),
            (None, Some(path)) => path.as_str().to_owned(),
            (None, None) => req.uri().path().to_owned(),
        };
        let tenant = match req.extensions().get::<Tenant>() {
            Some(tenant) => tenant.0.clone(),
            None => {
                warn_untenanted(&self.config, &route);
                Tenant::DEFAULT.to_owned()
            }
        };
        let scope = Scope::new(tenant, req.method().as_str(), &route);
        let id = self.config.hasher.record_id(&scope, &self.key);
        let previous_id = (self.config.previous_hasher.as_ref())
            .map(|previous| previous.record_id(&scope, &self.key));
        let span = tracing::info_span!(
            "idempotency",
            key_id = %id.key_id(),
            route = %scope.route,
            outcome = tracing::field::Empty,
        );
        async move {
            let (parts, body) = req.into_parts();
            let config = &self.config;
            let bytes = match body::read_body(&parts.headers, body, config.max_request_body).await {
                Ok(bytes) => bytes,
                Err(rejection) => return self.finish(Outcome::Rejected, rejection),
            };
            let content_type = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok());
            // Of the content: a body in a content coding is fingerprinted decoded, so that
            // the same content compressed anew is the same request. It goes on as it came.
            let content = match body::content(&parts.headers, &bytes, config.max_request_body) {
                Ok(content) => content,
                Err(rejection) => return self.finish(Outcome::Rejected, rejection),
            };
            let fingerprint = fingerprint(
                &RequestParts {
                    method: parts.method.as_str(),
                    route: &route,
                    path_params: &[("path", parts.uri.path())],
                    query: parts.uri.query(),
                    content_type,
                    body: &content,
                },
                &config.fingerprint,
            );
            drop(content);
            let mut claim = Claim {
                id,
                fingerprint,
                now: config.clock.now(),
                retention: config.retention,
                sealed_key: None,
                first_sent: self.first_sent,
            };
            // A completed record in memory answers as the store would, without the store.
            if let Some(cache) = &config.cache {
                cache.follow(&self.layer.store);
                self.ticket = cache.ticket();
                for id in std::iter::once(&claim.id).chain(&previous_id) {
                    let first_sent = claim.first_sent;
                    if let Some(outcome) =
                        cache.answer(id, &claim.fingerprint, first_sent, claim.now)
                    {
                        // Not filled again: an entry's trust is counted from the store read.
                        config.metrics.replay_cache_hit();
                        return self.answer(outcome);
                    }
                }
            }
            // Key-secret rotation: a live record under the previous secret answers first.
            if let Some(previous_id) = &previous_id {
                match self.look_up(previous_id, &claim).await {
                    Ok(Some(outcome)) => {
                        return self.answer_existing(outcome, previous_id, &claim.fingerprint);
                    }
                    Ok(None) => {}
                    Err(answer) => return answer,
                }
            }
            // A first attempt too old for its record to be trusted to exist: a live record
            // or an attempt in flight answers, else the request is refused. Nothing it
            // claims lasts, so no attempt of it can run.
            if let Some(sent) = claim.first_sent
                && config.first_sent.is_late(sent, claim.now, config.retention)
            {
                return match self.look_up_late(&claim).await {
                    Ok(Some(outcome)) => {
                        self.answer_existing(outcome, &claim.id, &claim.fingerprint)
                    }
                    Ok(None) => self.finish(
                        Outcome::Rejected,
                        IdempotencyRejection::FirstSentExpired {
                            first_sent: sent,
                            retention: config.retention,
                            margin: config.first_sent.margin(config.retention),
                        },
                    ),
                    Err(answer) => answer,
                };
            }
            // Only a request that goes on to claim needs its key sealed (external mode).
            let external = self.layer.mode.external().cloned();
            if let Some(seal) = external.as_ref().and_then(|mode| mode.seal.as_ref()) {
                claim.sealed_key = Some((seal.0)(self.key.as_str(), &claim.id));
            }
            let req = Request::from_parts(parts, Body::from(bytes));
            let (turn, wait) = match self.take_turn(&mut claim).await {
                Ok(turn) => turn,
                Err(answer) => return answer,
            };
            match external {
                // The owner keeps the turn until its outcome is written.
                Some(mode) => external::run(self, inner, req, claim, mode, turn, wait).await,
                None => {
                    let response = local::run(self, inner, req, claim, wait).await;
                    drop(turn);
                    response
                }
            }
        }
        .instrument(span)
        .await
    }
}
