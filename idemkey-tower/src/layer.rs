//! The layer and its per-route configuration.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use axum::handler::Handler;
use http::{HeaderMap, HeaderName};
use idemkey_core::{
    AnswerRule, Clock, FingerprintSpec, FirstSentPolicy, FirstSentRequirement, KeyHasher, RecordId,
    Store,
};
use tower_layer::Layer;

use crate::SystemClock;
use crate::cache::{self, ReplayCache};
use crate::coalesce::Turns;
use crate::mode::{self, Extractors, Local, Mode};
use crate::{IdempotencyService, InFlightPolicy, KeyRequirement, Metrics};

/// Where the status resource lives; a key's URL is this prefix plus the encoded key.
pub const STATUS_PATH: &str = "/idempotency/v1/keys";

/// How long outcomes are kept and replayed unless
/// [`IdempotencyLayer::retention`] sets another: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The largest keyed request body unless [`IdempotencyLayer::max_request_body`] sets
/// another: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;

/// The largest response stored unless [`IdempotencyLayer::max_stored_response`] sets
/// another: 1 MiB.
pub const DEFAULT_MAX_STORED_RESPONSE: usize = 1024 * 1024;

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) hasher: KeyHasher,
    /// Key-secret rotation: the previous secret's hasher, still accepted for look-ups.
    pub(crate) previous_hasher: Option<KeyHasher>,
    pub(crate) requirement: KeyRequirement,
    pub(crate) in_flight: InFlightPolicy,
    pub(crate) retention: Duration,
    /// How `Repeatability-First-Sent` is read and judged.
    pub(crate) first_sent: FirstSentPolicy,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_response: usize,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) fingerprint: FingerprintSpec,
    pub(crate) metrics: Metrics,
    /// Which answers are stored, released or left indeterminate.
    pub(crate) answers: AnswerRule,
    /// The route of the scope; `None`: axum's matched path, else the request's path.
    pub(crate) route: Option<String>,
    pub(crate) clock: Arc<dyn Clock>,
    /// Completed records kept in memory; shared by every layer derived from this one.
    pub(crate) cache: Option<Arc<ReplayCache>>,
    /// Attempts of one key in this process go to the store one at a time; shared by every
    /// layer derived from this one.
    pub(crate) turns: Arc<Turns>,
    /// Set once a request without a [`Tenant`](crate::Tenant) was warned about; shared by
    /// every layer derived from this one, so the warning is given once.
    pub(crate) warned_untenanted: Arc<AtomicBool>,
}

impl Config {
    /// What of `headers` is stored with a completed answer of this route.
    pub(crate) fn stored_headers_of(&self, headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        crate::stored_headers(headers, &self.stored_headers)
    }
}

/// Seals a raw key for its record (see [`IdempotencyLayer::seal_keys`]).
type SealFn = dyn Fn(&str, &RecordId) -> Vec<u8> + Send + Sync;

#[derive(Clone)]
pub(crate) struct KeySeal(pub(crate) Arc<SealFn>);

impl std::fmt::Debug for KeySeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySeal(..)")
    }
}

/// Applies the idempotency contract to a route, in the route's own database transaction
/// ([`mode::Local`]) or, once turned [`external`](Self::external), around a call to another
/// service ([`mode::External`]).
///
/// Build one per application with [`new`](Self::new), then derive each route's layer from it
/// with the builder methods, and put the route's handler behind it with
/// [`handler`](Self::handler): a local route's handler takes a [`Tx`](crate::Tx) for its
/// effect, an external route's an [`External`](crate::External) handle, and a handler that
/// takes the other mode's is refused (a panic) when the router is built. As a tower
/// [`Layer`] (`.layer(idempotency)` on a router of several routes, or around a service) it
/// cannot see the handlers: there such a handler answers 500 `transaction-unavailable`.
///
/// ```no_run
/// use axum::{Router, routing::post};
/// use idemkey_core::KeyHasher;
/// use idemkey_sqlite::SqliteStore;
/// use idemkey_tower::{IdempotencyLayer, Tx};
///
/// async fn create_order(mut tx: Tx<SqliteStore>) -> (http::StatusCode, &'static str) {
///     sqlx::query("INSERT INTO orders (item) VALUES ('book')")
///         .execute(&mut *tx)
///         .await
///         .unwrap();
///     (http::StatusCode::CREATED, "{\"ok\":true}")
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = SqliteStore::connect("sqlite:app.db").await?;
/// store.migrate().await?;
/// let idempotency = IdempotencyLayer::new(store, KeyHasher::new(b"a long random secret"));
/// let app: Router = Router::new().route(
///     "/orders",
///     post(idempotency.clone().handler(create_order)),
/// );
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyLayer<S, M = Local> {
    pub(crate) store: S,
    pub(crate) config: Arc<Config>,
    pub(crate) mode: M,
}

impl<S> IdempotencyLayer<S> {
    /// A layer on `store`, hashing keys with `hasher`: key required, wait up to 5 s for an
    /// attempt in flight, 24 h retention, 1 MiB request bodies, 1 MiB stored responses, the
    /// default [`AnswerRule`], the system clock, a replay cache of 100 000 entries / 64 MiB
    /// (see [`replay_cache`](Self::replay_cache)).
    ///
    /// ```
    /// # use idemkey_core::KeyHasher;
    /// # use idemkey_tower::IdempotencyLayer;
    /// # fn f<S>(store: S) -> IdempotencyLayer<S> {
    /// // The secret hashes the keys: keep it stable, and out of the code and the database.
    /// IdempotencyLayer::new(store, KeyHasher::new(b"a long random secret"))
    /// # }
    /// ```
    pub fn new(store: S, hasher: KeyHasher) -> Self {
        Self {
            store,
            config: Arc::new(Config {
                hasher,
                previous_hasher: None,
                requirement: KeyRequirement::Required,
                in_flight: InFlightPolicy::default(),
                retention: DEFAULT_RETENTION,
                first_sent: FirstSentPolicy::default(),
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                max_stored_response: DEFAULT_MAX_STORED_RESPONSE,
                stored_headers: Vec::new(),
                fingerprint: FingerprintSpec::default(),
                metrics: Metrics::new(),
                answers: AnswerRule::default(),
                route: None,
                clock: Arc::new(SystemClock),
                cache: Some(Arc::new(ReplayCache::new(
                    cache::DEFAULT_ENTRIES,
                    cache::DEFAULT_BYTES,
                ))),
                turns: Arc::new(Turns::default()),
                warned_untenanted: Arc::new(AtomicBool::new(false)),
            }),
            mode: Local,
        }
    }

    /// External mode, for effects outside the store's database: the claim commits at once as
    /// a reservation holding a lease of this length (renewed while the handler runs), and the
    /// handler takes an [`External`](crate::External) instead of a [`Tx`](crate::Tx), marks
    /// the point of no return before it calls out, and reports an unknown outcome.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::time::Duration;
    ///
    /// // The handler takes an `External<S>` and calls out to another service.
    /// let layer = idempotency.clone().external(Duration::from_secs(10));
    /// # }
    /// ```
    ///
    /// The external mode's settings exist only on the external layer's type:
    ///
    /// ```compile_fail
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// // A local layer has no reservation to mark the point of no return with.
    /// let layer = idempotency.point_of_no_return_at_reservation();
    /// # }
    /// ```
    pub fn external(self, lease: Duration) -> IdempotencyLayer<S, mode::External> {
        IdempotencyLayer {
            store: self.store,
            config: self.config,
            mode: mode::External::new(lease),
        }
    }
}

impl<S, M: Mode> IdempotencyLayer<S, M> {
    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// `handler` behind this layer, for a route of a router (`post(layer.handler(h))`).
    ///
    /// Its extractors are checked against the mode here, when the router is built: a handler
    /// that takes a [`Tx`](crate::Tx) behind an external layer, or an
    /// [`External`](crate::External) behind a local one, would answer every request with 500
    /// `transaction-unavailable`, so this panics instead, naming the handler.
    ///
    /// ```should_panic
    /// use std::time::Duration;
    /// use axum::{Router, routing::post};
    /// use idemkey_core::KeyHasher;
    /// use idemkey_sqlite::SqliteStore;
    /// use idemkey_tower::{IdempotencyLayer, Tx};
    ///
    /// async fn create_order(tx: Tx<SqliteStore>) -> &'static str {
    ///     "created"
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// let external = IdempotencyLayer::new(store, KeyHasher::new(b"a long random secret"))
    ///     .external(Duration::from_secs(10));
    /// // Panics here: an external route's claim commits before its handler runs.
    /// let app: Router = Router::new().route("/orders", post(external.handler(create_order)));
    /// # }
    /// ```
    pub fn handler<H, T, St>(self, handler: H) -> impl Handler<T, St>
    where
        S: Store,
        H: Handler<T, St>,
        T: Extractors,
        St: Clone + Send + Sync + 'static,
    {
        check_extractors::<S, M, H, T>("handler");
        handler.layer(self)
    }

    /// `handler` with its `state` behind this layer, as one service built here, once: for
    /// [`Router::route_service`](axum::Router::route_service) or
    /// [`fallback_service`](axum::Router::fallback_service). Its extractors are checked as
    /// [`handler`](Self::handler) checks them. (`handler` is rebuilt around the handler on
    /// every request, as axum's `Handler::layer` is; this is not.)
    pub fn handler_service<H, T, St>(
        self,
        handler: H,
        state: St,
    ) -> IdempotencyService<S, M, axum::handler::HandlerService<H, T, St>>
    where
        S: Store + Clone,
        M: Clone,
        H: Handler<T, St>,
        T: Extractors,
        St: Clone + Send + Sync + 'static,
    {
        check_extractors::<S, M, H, T>("handler_service");
        self.layer(handler.with_state(state))
    }

    /// Sets the key requirement: [`KeyRequirement::Required`] (the default: a request
    /// without a key is refused with 400 `key-missing`, the handler does not run),
    /// [`Optional`](KeyRequirement::Optional) (a request without a key runs without
    /// protection) or [`Off`](KeyRequirement::Off) (keys are ignored). In local mode an
    /// unkeyed request's handler still gets its `Tx`.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use idemkey_tower::KeyRequirement;
    ///
    /// // Keyed requests are protected; requests without a key run as before.
    /// let layer = idempotency.clone().requirement(KeyRequirement::Optional);
    /// # }
    /// ```
    pub fn requirement(self, requirement: KeyRequirement) -> Self {
        self.with(|c| c.requirement = requirement)
    }

    /// What a retry gets while the first attempt runs.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::time::Duration;
    /// use idemkey_tower::InFlightPolicy;
    ///
    /// // Hold a retry up to 2 s for the first attempt, then replay its outcome...
    /// let waits = idempotency.clone().in_flight(InFlightPolicy::Wait(Duration::from_secs(2)));
    /// // ...or answer 409 `request-in-flight` with Retry-After at once.
    /// let refuses = idempotency.clone().in_flight(InFlightPolicy::Reject);
    /// # }
    /// ```
    pub fn in_flight(self, policy: InFlightPolicy) -> Self {
        self.with(|c| c.in_flight = policy)
    }

    /// How long outcomes are kept and replayed.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::time::Duration;
    ///
    /// // Replay outcomes for a week (the key's horizon, advertised in Idempotency-Key-Expires).
    /// let layer = idempotency.clone().retention(Duration::from_secs(7 * 24 * 3600));
    /// # }
    /// ```
    pub fn retention(self, retention: Duration) -> Self {
        self.with(|c| c.retention = retention)
    }

    /// Whether keyed requests must state their first attempt's time in
    /// `Repeatability-First-Sent` (default: optional; required: 400 `first-sent-missing`
    /// without it).
    ///
    /// A keyed request that states it is refused with 412 `first-sent-expired` when that time
    /// is longer ago than the retention less a margin for clock skew
    /// ([`FirstSentPolicy::margin`]: the skew allowance, at most a quarter of the retention)
    /// and neither a live record nor an attempt in flight (409) answers it. Nothing such a
    /// request claims lasts, and it does not wait for an attempt in flight.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use idemkey_core::FirstSentRequirement;
    ///
    /// // A payment route: a retry that cannot prove it is inside the window is refused.
    /// let layer = idempotency.clone().first_sent(FirstSentRequirement::Required);
    /// # }
    /// ```
    pub fn first_sent(self, requirement: FirstSentRequirement) -> Self {
        self.with(|c| c.first_sent.requirement = requirement)
    }

    /// How far the clocks of client and server may disagree (default 5 minutes), at most a
    /// quarter of the retention ([`FirstSentPolicy::margin`]): a `Repeatability-First-Sent`
    /// further ahead of the server's clock is refused with 400 `first-sent-invalid`, and as
    /// much is taken off the retention before a first attempt counts as too old. One
    /// quantity for both, so that a time accepted ahead never outlives its record; a larger
    /// skew is held to the quarter (`idemkey serve` and `gateway` refuse one at start).
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::time::Duration;
    ///
    /// let layer = idempotency.clone().first_sent_skew(Duration::from_secs(60));
    /// # }
    /// ```
    pub fn first_sent_skew(self, skew: Duration) -> Self {
        self.with(|c| c.first_sent.skew = skew)
    }

    /// The largest request body accepted on keyed requests (larger: 413, nothing stored).
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// let layer = idempotency.clone().max_request_body(64 * 1024);
    /// # }
    /// ```
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_request_body = bytes)
    }

    /// The largest response body stored, counted as sent (compressed, when the answer is).
    /// A larger response cannot be replayed, so its transaction rolls back and the client
    /// gets 500 `response-too-large`; in external mode the call went out, so the operation
    /// is left indeterminate instead.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// let layer = idempotency.clone().max_stored_response(256 * 1024);
    /// # }
    /// ```
    pub fn max_stored_response(self, bytes: usize) -> Self {
        self.with(|c| c.max_stored_response = bytes)
    }

    /// Stores and replays this response header too (besides `Content-Type`,
    /// `Content-Encoding`, `Vary`, `Location`, `ETag`).
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use http::HeaderName;
    ///
    /// let layer = idempotency.clone().store_header(HeaderName::from_static("x-order-number"));
    /// # }
    /// ```
    pub fn store_header(self, name: HeaderName) -> Self {
        self.with(|c| c.stored_headers.push(name))
    }

    /// What of `headers` this layer stores and replays with an answer it completes: the
    /// headers of [`stored_headers`](crate::stored_headers) plus the route's own
    /// ([`store_header`](Self::store_header)). For one that completes a record of this
    /// route elsewhere (a reconciler), so that it stores what the layer would have.
    pub fn stored_headers_of(&self, headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        self.config.stored_headers_of(headers)
    }

    /// Only these JSON fields (JSON Pointers) define the operation in the fingerprint.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// // Only these members define the operation: a client timestamp in the body may differ.
    /// let layer = idempotency.clone().fingerprint_fields(["/amount", "/currency", "/customer"]);
    /// # }
    /// ```
    pub fn fingerprint_fields<I: IntoIterator<Item = T>, T: Into<String>>(
        self,
        pointers: I,
    ) -> Self {
        let fields = pointers.into_iter().map(Into::into).collect();
        self.with(|c| {
            c.fingerprint = FingerprintSpec {
                fields: Some(fields),
            }
        })
    }

    /// Counts into `metrics` (share one [`Metrics`] across routes and render it).
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use idemkey_tower::Metrics;
    ///
    /// let metrics = Metrics::new();
    /// let orders = idempotency.clone().metrics(metrics.clone());
    /// let refunds = idempotency.clone().metrics(metrics.clone());
    /// print!("{}", metrics.render()); // both routes' counts
    /// # }
    /// ```
    pub fn metrics(self, metrics: Metrics) -> Self {
        self.with(|c| c.metrics = metrics)
    }

    /// Which answers the route stores, which say nothing was done (the key is released, or
    /// in local mode the transaction rolls back), and which leave the outcome unknown
    /// (external mode: the record turns indeterminate). See [`AnswerRule`] for the default
    /// and `docs/guide/contract.md` for the whole table.
    ///
    /// ```
    /// # use idemkey_core::{AfterEffect, AnswerRule, KeyHasher};
    /// # use idemkey_tower::IdempotencyLayer;
    /// # fn f<S>(layer: IdempotencyLayer<S>) -> IdempotencyLayer<S> {
    /// // This service's 503 means it did nothing; its 500 is an outcome worth replaying.
    /// layer.answers(AnswerRule::new().status(503, AfterEffect::Release).status(500, AfterEffect::Complete))
    /// # }
    /// ```
    pub fn answers(self, rule: AnswerRule) -> Self {
        self.with(|c| c.answers = rule)
    }

    /// Scopes this layer's records by `route` (e.g. `POST /v1/*`, a proxy's rule) instead of
    /// the route axum matched (or, without one, the request's path).
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// // Every path under /v1/ shares one scope of keys, as one proxy rule.
    /// let layer = idempotency.clone().route("POST /v1/*");
    /// # }
    /// ```
    pub fn route(self, route: impl Into<String>) -> Self {
        let route = route.into();
        self.with(|c| c.route = Some(route))
    }

    /// Key-secret rotation: records made under the previous secret (hashed by `hasher`) are
    /// still found until they expire. Before a claim under the current secret, the layer
    /// looks up the key's record under the previous one; a live record there answers the
    /// request as a claim that lost to it would be answered (a replay, 422, 409), and new
    /// records are made under the current secret only. Costs one read per keyed request
    /// while set: drop it once the retention has passed since the rotation.
    ///
    /// ```
    /// # use idemkey_core::KeyHasher;
    /// # use idemkey_tower::IdempotencyLayer;
    /// # fn f<S>(store: S) -> IdempotencyLayer<S> {
    /// IdempotencyLayer::new(store, KeyHasher::new(b"the new secret"))
    ///     .previous_key_hasher(KeyHasher::new(b"the old secret"))
    /// # }
    /// ```
    pub fn previous_key_hasher(self, hasher: KeyHasher) -> Self {
        self.with(|c| c.previous_hasher = Some(hasher))
    }

    /// The status resource ([`status_router`](crate::status_router)) for this layer's store
    /// and secrets, the previous one included. Mount it behind the same authentication as the
    /// keyed routes.
    ///
    /// ```
    /// # use axum::Router;
    /// # use idemkey_core::StoreAdmin;
    /// # use idemkey_tower::IdempotencyLayer;
    /// # fn f<S: StoreAdmin>(idempotency: IdempotencyLayer<S>) -> Router {
    /// Router::new().merge(idempotency.status_router()) // GET /idempotency/v1/keys/{key}
    /// # }
    /// ```
    pub fn status_router(&self) -> axum::Router
    where
        S: idemkey_core::StoreAdmin,
    {
        crate::status::router(
            self.store.clone(),
            self.config.hasher.clone(),
            self.config.previous_hasher.clone(),
            self.config.clock.clone(),
        )
    }

    /// Keeps up to `entries` completed records (and at most 64 MiB of them) in memory, and
    /// answers retries of them without the database: replays and 422 `key-reused`, decided
    /// by the same rules as from the store. On by default, with 100 000 entries.
    ///
    /// An entry lives until its record expires while the store announces evictions
    /// (`idemkey keys evict`: PostgreSQL notifies every instance, SQLite writes a table each
    /// instance polls); otherwise at most
    /// [`REPLAY_CACHE_UNNOTIFIED_BOUND`](crate::REPLAY_CACHE_UNNOTIFIED_BOUND) (5 s) before
    /// the store is asked again. The cache is shared by every layer derived
    /// from this one after this call.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// let layer = idempotency.clone().replay_cache(100_000);
    /// # }
    /// ```
    pub fn replay_cache(self, entries: usize) -> Self {
        let cache = Arc::new(ReplayCache::new(entries, cache::DEFAULT_BYTES));
        self.with(|c| c.cache = Some(cache))
    }

    /// Every retry is answered from the store: no replay cache.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// let layer = idempotency.clone().no_replay_cache();
    /// # }
    /// ```
    pub fn no_replay_cache(self) -> Self {
        self.with(|c| c.cache = None)
    }

    /// Told each time the replay cache drops entries on the store's word (an eviction notice,
    /// or a lost or regained notice channel): its value counts them. `None` without a cache.
    /// For tests that wait for an eviction to reach this instance: only with the crate's
    /// `test-util` feature, which tests enable as a dev-dependency's.
    ///
    /// ```no_run
    /// # async fn run<S: idemkey_core::Store>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// if let Some(mut changes) = idempotency.replay_cache_changes() {
    ///     changes.changed().await.ok(); // the next eviction (or channel change) applied
    /// }
    /// # }
    /// ```
    #[cfg(feature = "test-util")]
    pub fn replay_cache_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.config.cache.as_ref().map(|c| c.changes())
    }

    /// Reads the time and waits on `clock` (claims, completion, expiry, the status
    /// resource, leases, in-flight waits, purges) instead of the [`SystemClock`].
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::sync::Arc;
    /// use idemkey_tower::SystemClock;
    ///
    /// // Tests pass a clock they move by hand; this is the default.
    /// let layer = idempotency.clone().clock(Arc::new(SystemClock));
    /// # }
    /// ```
    pub fn clock(self, clock: Arc<dyn Clock>) -> Self {
        self.with(|c| c.clock = clock)
    }
}

impl<S> IdempotencyLayer<S, mode::External> {
    /// External mode: the reservation itself marks the point of no return, one write less
    /// per request, for handlers that call out as soon as they start (`idemkey gateway`).
    ///
    /// The handler still calls [`External::point_of_no_return`](crate::External::point_of_no_return)
    /// just before the request leaves; it then writes nothing, and fails only when the lease
    /// has lapsed. Returning before it still releases the key. The cost is in the crash
    /// window: a process that dies after the reservation and before its request left leaves
    /// the operation indeterminate (a reconciler or an operator resolves it) instead of free
    /// for a retry to take over once the lease lapses.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::time::Duration;
    ///
    /// let layer = idempotency
    ///     .clone()
    ///     .external(Duration::from_secs(10))
    ///     .point_of_no_return_at_reservation();
    /// # }
    /// ```
    pub fn point_of_no_return_at_reservation(mut self) -> Self {
        self.mode.marked_at_reservation = true;
        self
    }

    /// External mode: also keep each raw key in its record, sealed by `seal` (given the key
    /// and the record's identity), so a reconciler can ask the other service about it. By
    /// default only the keyed hash is stored.
    ///
    /// ```
    /// # fn f<S: Clone>(idempotency: idemkey_tower::IdempotencyLayer<S>) {
    /// use std::time::Duration;
    ///
    /// /// Stand-in: encrypt the key with a key of your own (e.g. ChaCha20-Poly1305).
    /// fn encrypt(key: &[u8]) -> Vec<u8> {
    ///     key.to_vec()
    /// }
    ///
    /// let layer = idempotency
    ///     .clone()
    ///     .external(Duration::from_secs(10))
    ///     .seal_keys(|key, _record| encrypt(key.as_bytes()));
    /// # }
    /// ```
    pub fn seal_keys(
        mut self,
        seal: impl Fn(&str, &RecordId) -> Vec<u8> + Send + Sync + 'static,
    ) -> Self {
        self.mode.seal = Some(KeySeal(Arc::new(seal)));
        self
    }
}

/// Panics, naming the handler `H`, when one of its extractors `T` is one the mode `M` gives
/// none of (a `Tx` behind an external layer, an `External` behind a local one).
fn check_extractors<S: Store, M: Mode, H, T: Extractors>(method: &str) {
    let refused = <M as mode::sealed::Mode>::refused::<S>();
    for extractor in <T as mode::sealed::Extractors>::types() {
        if let Some((_, say)) = refused.iter().find(|(ty, _)| *ty == extractor) {
            panic!(
                "IdempotencyLayer::{method}: the handler `{}` {say}",
                std::any::type_name::<H>()
            );
        }
    }
}

impl<S: Clone, M: Clone, I> Layer<I> for IdempotencyLayer<S, M> {
    type Service = IdempotencyService<S, M, I>;

    fn layer(&self, inner: I) -> Self::Service {
        IdempotencyService {
            inner,
            layer: self.clone(),
        }
    }
}
