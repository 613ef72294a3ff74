//! The middleware: claim, run the handler on the claim's transaction, store, commit.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use futures::future::BoxFuture;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use idemkey_core::protocol::{self, Claim, ClaimOutcome, Lease};
use idemkey_core::{
    HEADER_NAME, IdempotencyKey, RecordId, RequestParts, Scope, Store, StoreError, StoredResponse,
    Timestamp, fingerprint,
};
use tokio::sync::Mutex;
use tower_service::Service;
use tracing::Instrument;

use crate::External;
use crate::external::{Flags, keep_alive, reserve_waiting, settle};
use crate::layer::{Config, STATUS_PATH};
use crate::metrics::Outcome;
use crate::tx::{Slot, TxSlot};
use crate::{IdempotencyLayer, IdempotencyRejection, InFlightPolicy, StorePolicy, Tenant};

/// The header added to replayed responses.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The header that tells until when the key's outcome is kept (an HTTP date).
pub const EXPIRES_HEADER: &str = "idempotency-key-expires";

/// How long a client is asked to wait before retrying after a 409 or 503.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The [`Service`] built by [`IdempotencyLayer`].
#[derive(Debug, Clone)]
pub struct IdempotencyService<S, P, I> {
    pub(crate) inner: I,
    pub(crate) layer: IdempotencyLayer<S, P>,
}

impl<S, P, I> Service<Request<Body>> for IdempotencyService<S, P, I>
where
    S: Store,
    P: StorePolicy,
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

async fn handle<S, P, I>(layer: IdempotencyLayer<S, P>, inner: I, req: Request<Body>) -> Response
where
    S: Store,
    P: StorePolicy,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let config = layer.config.clone();
    if is_safe(req.method()) {
        return call(inner, req).await;
    }
    let key = match config.requirement {
        crate::KeyRequirement::Off => None,
        _ => {
            let fields = req.headers().get_all(HEADER_NAME);
            match IdempotencyKey::from_fields(fields.iter().map(HeaderValue::as_bytes)) {
                Ok(key) => key,
                Err(e) => {
                    config.metrics.attempt();
                    config.metrics.record(Outcome::Rejected, Duration::ZERO);
                    return IdempotencyRejection::KeyInvalid(e).into_response();
                }
            }
        }
    };
    match key {
        Some(key) => Keyed::new(layer, req, key).run(inner).await,
        None if config.requirement == crate::KeyRequirement::Required => {
            config.metrics.attempt();
            config.metrics.record(Outcome::Rejected, Duration::ZERO);
            IdempotencyRejection::KeyMissing.into_response()
        }
        None => unkeyed(layer, inner, req).await,
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

/// Runs the handler with `tx` in its request; returns the response and the transaction
/// back, or the answer to give when the handler panicked or kept the transaction.
async fn run_handler<S, I>(
    inner: I,
    mut req: Request<Body>,
    tx: S::Transaction,
) -> Result<(Response, S::Transaction), IdempotencyRejection>
where
    S: Store,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let slot: Slot<S> = Arc::new(Mutex::new(Some(tx)));
    req.extensions_mut().insert(TxSlot::<S>(slot.clone()));
    let response = AssertUnwindSafe(call(inner, req))
        .catch_unwind()
        .await
        // The transaction is dropped with the slot: rolled back.
        .map_err(|_| IdempotencyRejection::Internal)?;
    // The handler is done, so its guard is gone, unless it moved the `Tx` somewhere that
    // outlives it: then nothing can be committed safely.
    let tx = slot.try_lock().ok().and_then(|mut guard| guard.take());
    tx.map(|tx| (response, tx))
        .ok_or(IdempotencyRejection::TransactionUnavailable)
}

/// A request without a key (on an `optional` or `off` route): the handler still gets a
/// transaction, committed under the same rule as keyed requests.
async fn unkeyed<S, P, I>(layer: IdempotencyLayer<S, P>, inner: I, req: Request<Body>) -> Response
where
    S: Store,
    P: StorePolicy,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let tx = match layer.store.begin().await {
        Ok(tx) => tx,
        Err(e) => return store_unavailable(&e),
    };
    let (response, tx) = match run_handler::<S, I>(inner, req, tx).await {
        Ok(done) => done,
        Err(rejection) => return rejection.into_response(),
    };
    if layer.policy.stores(response.status())
        && let Err(e) = layer.store.commit(tx).await
    {
        return store_unavailable(&e);
    }
    response
}

/// The answer when the store fails outside the claim: 503 with `Retry-After`, `store-busy`
/// when a lock was not granted in time (on SQLite that lock is the whole database's, held by
/// any request, so it says nothing about this key), `store-unavailable` otherwise.
pub fn store_unavailable(error: &StoreError) -> Response {
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
struct Keyed<S, P> {
    layer: IdempotencyLayer<S, P>,
    config: Arc<Config>,
    req: Request<Body>,
    key: IdempotencyKey,
    started: Instant,
}

impl<S: Store, P: StorePolicy> Keyed<S, P> {
    fn new(layer: IdempotencyLayer<S, P>, req: Request<Body>, key: IdempotencyKey) -> Self {
        let config = layer.config.clone();
        config.metrics.attempt();
        Self {
            layer,
            config,
            req,
            key,
            started: Instant::now(),
        }
    }

    fn finish(&self, outcome: Outcome, response: impl IntoResponse) -> Response {
        self.config.metrics.record(outcome, self.started.elapsed());
        tracing::Span::current().record("outcome", tracing::field::debug(outcome));
        response.into_response()
    }

    async fn run<I>(self, inner: I) -> Response
    where
        I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
        I::Future: Send + 'static,
    {
        let route = match self.req.extensions().get::<MatchedPath>() {
            Some(path) => path.as_str().to_owned(),
            None => self.req.uri().path().to_owned(),
        };
        let tenant = self
            .req
            .extensions()
            .get::<Tenant>()
            .map_or_else(|| Tenant::DEFAULT.to_owned(), |t| t.0.clone());
        let scope = Scope::new(tenant, self.req.method().as_str(), &route);
        let id = self.config.hasher.record_id(&scope, &self.key);
        let span = tracing::info_span!(
            "idempotency",
            key_id = %id.key_id(),
            route = %scope.route,
            outcome = tracing::field::Empty,
        );
        self.claim_and_run(inner, route, id).instrument(span).await
    }

    async fn claim_and_run<I>(mut self, inner: I, route: String, id: RecordId) -> Response
    where
        I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
        I::Future: Send + 'static,
    {
        let store = self.layer.store.clone();
        let (parts, body) = std::mem::take(&mut self.req).into_parts();
        let bytes = match read_body(&parts.headers, body, self.config.max_request_body).await {
            Ok(bytes) => bytes,
            Err(rejection) => return self.finish(Outcome::Rejected, rejection),
        };
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        let fingerprint = fingerprint(
            &RequestParts {
                method: parts.method.as_str(),
                route: &route,
                path_params: &[("path", parts.uri.path())],
                query: parts.uri.query(),
                content_type,
                body: &bytes,
            },
            &self.config.fingerprint,
        );
        let claim = Claim {
            id,
            fingerprint,
            now: Timestamp::now(),
            retention: self.config.retention,
            sealed_key: None,
        };
        if let Some(lease) = self.config.external {
            let req = Request::from_parts(parts, Body::from(bytes));
            return self.run_external(inner, req, claim, lease).await;
        }

        let mut tx = match store.begin().await {
            Ok(tx) => tx,
            Err(e) => return self.finish(Outcome::StoreError, store_unavailable(&e)),
        };
        let wait = match self.config.in_flight {
            InFlightPolicy::Wait(bound) if bound == InFlightPolicy::DEFAULT_WAIT => None,
            InFlightPolicy::Wait(bound) => Some(bound),
            InFlightPolicy::Reject => Some(Duration::from_millis(1)),
        };
        if let Some(wait) = wait
            && let Err(e) = store.limit_lock_wait(&mut tx, wait).await
        {
            return self.finish(Outcome::StoreError, store_unavailable(&e));
        }
        let outcome = match protocol::claim(&store, &mut tx, &claim).await {
            Ok(outcome) => outcome,
            Err(protocol::Error::Store(e)) => {
                return self.finish(Outcome::StoreError, store_unavailable(&e));
            }
            Err(e) => {
                tracing::error!(error = %e, "claim failed");
                return self.finish(Outcome::StoreError, IdempotencyRejection::Internal);
            }
        };
        let token = match outcome {
            ClaimOutcome::Owned { token, .. } => token,
            other => {
                // Nothing of the caller's was written; committing keeps a possible
                // `indeterminate` mark the claim left.
                let _ = store.commit(tx).await;
                return self.answer_existing(other);
            }
        };
        if wait.is_some() {
            // The bound was for the claim; the handler's own statements get the default.
            if let Err(e) = store
                .limit_lock_wait(&mut tx, InFlightPolicy::DEFAULT_WAIT)
                .await
            {
                return self.finish(Outcome::StoreError, store_unavailable(&e));
            }
        }
        let expires_at = claim.now.plus(self.config.retention);

        let req = Request::from_parts(parts, Body::from(bytes));
        let (response, mut tx) = match run_handler::<S, I>(inner, req, tx).await {
            Ok(done) => done,
            Err(rejection) => return self.finish(Outcome::NotStored, rejection),
        };
        if !self.layer.policy.stores(response.status()) {
            drop(tx); // rolled back: no record, no effect, the key stays free
            return self.finish(Outcome::NotStored, response);
        }
        let (mut head, body) = response.into_parts();
        let limit = self.config.max_stored_response;
        let Ok(body) = axum::body::to_bytes(body, limit).await else {
            drop(tx);
            return self.finish(
                Outcome::NotStored,
                IdempotencyRejection::ResponseTooLarge { limit },
            );
        };
        let stored = StoredResponse {
            status: head.status.as_u16(),
            headers: stored_headers(&head.headers, &self.config.stored_headers),
            body: body.to_vec(),
        };
        if let Err(e) = protocol::complete(&store, &mut tx, &claim.id, token, &stored).await {
            tracing::error!(error = %e, "storing the response failed");
            return self.finish(Outcome::StoreError, storing_failed(e));
        }
        if let Err(e) = store.commit(tx).await {
            // The commit may or may not have happened; a retry replays or runs afresh.
            return self.finish(Outcome::StoreError, store_unavailable(&e));
        }
        add_expiry(&mut head.headers, expires_at);
        self.finish(
            Outcome::Executed,
            Response::from_parts(head, Body::from(body)),
        )
    }

    /// External mode: reserve with a lease, run the handler with an [`External`] handle while
    /// the lease is renewed, then complete, release or mark the outcome unknown.
    async fn run_external<I>(
        self,
        inner: I,
        mut req: Request<Body>,
        mut claim: Claim,
        lease_time: Duration,
    ) -> Response
    where
        I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
        I::Future: Send + 'static,
    {
        let store = self.layer.store.clone();
        let reserved = reserve_waiting(&store, &mut claim, lease_time, self.config.in_flight).await;
        let (token, expires_at) = match reserved {
            Ok(ClaimOutcome::Owned { token, expires_at }) => (token, expires_at),
            Ok(other) => return self.answer_existing(other),
            Err(protocol::Error::Store(e)) => {
                return self.finish(Outcome::StoreError, store_unavailable(&e));
            }
            Err(e) => {
                tracing::error!(error = %e, "reservation failed");
                return self.finish(Outcome::StoreError, IdempotencyRejection::Internal);
            }
        };
        let lease = Lease::new(store, claim.id.clone(), token, lease_time);
        let renewal = keep_alive(lease.clone(), lease_time / 3);
        let flags = Arc::new(Flags::default());
        req.extensions_mut().insert(External {
            lease: lease.clone(),
            flags: flags.clone(),
        });
        let result = AssertUnwindSafe(call(inner, req)).catch_unwind().await;
        drop(renewal);
        let sent = flags.past_point_of_no_return.load(Ordering::SeqCst);
        let unknown = flags.outcome_unknown.load(Ordering::SeqCst);
        // Whatever the handler says, an effect that may have happened is never freed.
        let metrics = self.config.metrics.clone();
        let give_up = |lease: Lease<S>| async move {
            if sent {
                metrics.marked_indeterminate();
            }
            let write = if sent {
                settle("marking the outcome unknown", || {
                    lease.clone().indeterminate()
                })
                .await
            } else {
                settle("releasing the key", || lease.clone().release()).await
            };
            if let Err(e) = write {
                tracing::warn!(error = %e, "could not settle the reservation; its lease will lapse");
            }
        };
        let response = match result {
            Ok(response) => response,
            Err(_panic) => {
                give_up(lease).await;
                return self.finish(Outcome::NotStored, IdempotencyRejection::Internal);
            }
        };
        if unknown {
            give_up(lease).await;
            return self.finish(Outcome::Indeterminate, response);
        }
        if !self.layer.policy.stores(response.status()) {
            give_up(lease).await;
            return self.finish(Outcome::NotStored, response);
        }
        let (mut head, body) = response.into_parts();
        let limit = self.config.max_stored_response;
        let Ok(body) = axum::body::to_bytes(body, limit).await else {
            give_up(lease).await;
            return self.finish(
                Outcome::NotStored,
                IdempotencyRejection::ResponseTooLarge { limit },
            );
        };
        let stored = StoredResponse {
            status: head.status.as_u16(),
            headers: stored_headers(&head.headers, &self.config.stored_headers),
            body: body.to_vec(),
        };
        match settle("storing the outcome", || lease.clone().complete(&stored)).await {
            Ok(()) => {
                add_expiry(&mut head.headers, expires_at);
                self.finish(
                    Outcome::Executed,
                    Response::from_parts(head, Body::from(body)),
                )
            }
            Err(e) => {
                // A newer owner or an operator settled the record first, or the store is
                // gone: this attempt's answer is still the truth for this attempt.
                tracing::warn!(error = %e, "the outcome could not be stored");
                self.finish(
                    Outcome::NotStored,
                    Response::from_parts(head, Body::from(body)),
                )
            }
        }
    }

    fn answer_existing(&self, outcome: ClaimOutcome) -> Response {
        let (outcome, response) = answer_claim(outcome, &self.key);
        self.finish(outcome, response)
    }
}

/// The answer to a claim this attempt did not win: a replay, 422 `key-reused`, 409
/// `request-in-flight` (with `Retry-After` from the owner's lease) or 409 `outcome-unknown`,
/// with the metrics outcome it counts as. Shared by the layer and the gateway.
pub fn answer_claim(outcome: ClaimOutcome, key: &IdempotencyKey) -> (Outcome, Response) {
    match outcome {
        ClaimOutcome::Replay {
            response,
            expires_at,
        } => (Outcome::Replayed, replay(response, expires_at)),
        ClaimOutcome::Mismatch(m) => (
            Outcome::Mismatched,
            IdempotencyRejection::KeyReused(m).into_response(),
        ),
        ClaimOutcome::InFlight { lease_expires_at } => {
            let retry_after = lease_expires_at
                .map(|t| Timestamp::now().until(t))
                .filter(|d| !d.is_zero())
                .unwrap_or(RETRY_AFTER);
            (
                Outcome::InFlight,
                IdempotencyRejection::InFlight { retry_after }.into_response(),
            )
        }
        ClaimOutcome::OutcomeUnknown => (
            Outcome::Indeterminate,
            IdempotencyRejection::OutcomeUnknown {
                status_url: status_url(key),
            }
            .into_response(),
        ),
        ClaimOutcome::Owned { .. } => (
            Outcome::StoreError,
            IdempotencyRejection::Internal.into_response(),
        ),
    }
}

fn storing_failed(e: protocol::Error) -> Response {
    match e {
        protocol::Error::Store(e) => store_unavailable(&e),
        _ => IdempotencyRejection::Internal.into_response(),
    }
}

/// How much of an over-limit body is read and discarded before the 413, so the client,
/// still sending, gets the answer instead of a reset connection.
const DRAIN_LIMIT: usize = 4 * 1024 * 1024;

/// Reads a request body of at most `limit` bytes: 413 `request-too-large` past it (an
/// over-limit body is drained up to 4 MiB beyond the limit first, so a client still sending
/// gets the answer), 400 `request-unreadable` when it cannot be read.
pub async fn read_body(
    headers: &HeaderMap,
    mut body: Body,
    limit: usize,
) -> Result<bytes::Bytes, IdempotencyRejection> {
    let too_large = IdempotencyRejection::RequestTooLarge { limit };
    let drain_cap = limit.saturating_add(DRAIN_LIMIT);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > drain_cap as u64) {
        return Err(too_large);
    }
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| IdempotencyRejection::RequestUnreadable)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen > drain_cap {
            return Err(too_large);
        }
        if seen <= limit {
            buf.extend_from_slice(&data);
        }
    }
    if seen > limit {
        return Err(too_large);
    }
    Ok(buf.freeze())
}

/// The headers that are stored and replayed: `Content-Type`, `Location`, `ETag` and the
/// route's own.
pub fn stored_headers(headers: &HeaderMap, extra: &[HeaderName]) -> Vec<(String, Vec<u8>)> {
    let base = [header::CONTENT_TYPE, header::LOCATION, header::ETAG];
    base.iter()
        .chain(extra)
        .flat_map(|name| {
            headers
                .get_all(name)
                .iter()
                .map(move |v| (name.as_str().to_owned(), v.as_bytes().to_vec()))
        })
        .collect()
}

/// A replay of `stored`: its status, headers and body byte for byte, with
/// `Idempotent-Replayed: true` and `Idempotency-Key-Expires`.
pub fn replay(stored: StoredResponse, expires_at: Timestamp) -> Response {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    add_expiry(headers, expires_at);
    response
}

/// Adds `Idempotency-Key-Expires: <HTTP date>` to a keyed response.
pub fn add_expiry(headers: &mut HeaderMap, expires_at: Timestamp) {
    let at = expires_at.to_system_time();
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(at)) {
        headers.insert(EXPIRES_HEADER, value);
    }
}

/// The status resource URL of `key` (percent-encoded).
pub fn status_url(key: &IdempotencyKey) -> String {
    let mut url = format!("{STATUS_PATH}/");
    for b in key.as_str().bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            url.push(b as char);
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}
