//! `idemkey gateway`: a reverse proxy that puts the idempotency contract in front of any
//! HTTP service, for effects that cannot share a transaction with the record.
//!
//! Each request's tenant comes from the one source the operator names ([`TenantSource`]):
//! API keys, a header set by an authenticating proxy in front, or one tenant for all.
//!
//! The gateway is the layer's external mode ([`IdempotencyLayer::external`](idemkey_tower::IdempotencyLayer::external)) with a proxy
//! handler: a keyed request is reserved with a lease, renewed while the upstream works; the
//! point of no return is passed once a connection to the upstream is open, just before the
//! request is written (marked by the reservation itself, or, with `--point-of-no-return
//! separate`, by a write of its own then); what becomes of the record afterwards is the layer's one decision
//! ([`idemkey_core::after_effect`]) under the route's [`AnswerRule`]. A refused connection
//! releases the key (nothing was sent); a time-out or reset after sending leaves the
//! operation indeterminate, resolved later by the reconciler (`reconciler.rs`) or an operator
//! (`idemkey keys resolve`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{Method, header};
use idemkey_core::{AnswerRule, FirstSentPolicy};
use idemkey_tower::{
    IdempotencyLayer, InFlightPolicy, KeyRequirement, Metrics, PurgeTask, SystemClock, Tenant, mode,
};

use crate::ApiKeys;
use crate::http_server::{self, HttpLimits};
use crate::secret::{KeySecretSource, KeySecrets, SecretUse, key_secrets};
use crate::serve::shutdown_signal;

use self::metrics::GatewayMetrics;

mod db;
mod metrics;
mod proxy;
mod reconciler;
mod rejection;
mod seal;
mod upstream;

pub use self::db::GatewayDb;
pub(crate) use self::db::mysql_settings_migrator;
pub use self::rejection::GatewayRejection;

pub(crate) use self::seal::KeySealer;

/// The upstream service: `http://host:port[/base]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `host:port`, for connecting and as the forwarded `Host`.
    pub authority: String,
    /// A path prefix put before every forwarded path ("" for none).
    pub base_path: String,
}

impl Upstream {
    /// Parses an `http://` URL.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("invalid upstream URL {url:?}: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "upstream URL {url:?}: only http:// is supported (put TLS in front of the gateway)"
            ));
        }
        let host = uri
            .host()
            .ok_or_else(|| format!("upstream URL {url:?} has no host"))?;
        let port = uri.port_u16().unwrap_or(80);
        if uri.query().is_some() {
            return Err(format!(
                "upstream URL {url:?}: a query string is not allowed"
            ));
        }
        Ok(Self {
            authority: format!("{host}:{port}"),
            base_path: uri.path().trim_end_matches('/').to_owned(),
        })
    }
}

/// One `--route` / `--optional-route`: `METHOD PATH [STATUS=ACTION …]`, PATH ending in `*`
/// for a prefix, METHOD `*` for any unsafe method, then the route's own changes to its
/// [`AnswerRule`] (e.g. `503=release 500=store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRule {
    /// `None`: any method.
    method: Option<Method>,
    /// The path as written (with the request's method, it names the scope's route:
    /// `POST /v1/*`).
    pattern: String,
    /// Whether `pattern` ends in `*`.
    prefix: bool,
    /// Whether a key is required or optional.
    requirement: KeyRequirement,
    /// Which upstream answers are stored, released or left indeterminate.
    answers: AnswerRule,
}

impl RouteRule {
    /// Parses `"METHOD PATH [STATUS=ACTION …]"`; the actions change `answers`, the rule of
    /// every route (`--answers`).
    pub fn parse(spec: &str, requirement: KeyRequirement, answers: &str) -> Result<Self, String> {
        let mut words = spec.split_whitespace();
        let (Some(method), Some(pattern)) = (words.next(), words.next()) else {
            return Err(format!(
                "route {spec:?}: expected \"METHOD PATH\", e.g. \"POST /v1/*\""
            ));
        };
        let overrides: Vec<&str> = words.collect();
        let answers: AnswerRule = format!("{answers} {}", overrides.join(" "))
            .parse()
            .map_err(|e| format!("route {spec:?}: {e}"))?;
        if !(pattern.starts_with('/') || pattern == "*") {
            return Err(format!(
                "route {spec:?}: the path must start with / (or be *)"
            ));
        }
        if pattern.trim_end_matches('*').contains('*') {
            return Err(format!("route {spec:?}: `*` is allowed only at the end"));
        }
        let method = match method.trim() {
            "*" => None,
            m => Some(
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("route {spec:?}: invalid method {m:?}"))?,
            ),
        };
        Ok(Self {
            method,
            prefix: pattern.ends_with('*'),
            pattern: pattern.to_owned(),
            requirement,
            answers,
        })
    }

    fn matches(&self, method: &Method, path: &str) -> bool {
        if self.method.as_ref().is_some_and(|m| m != method) {
            return false;
        }
        if self.prefix {
            path.starts_with(self.pattern.trim_end_matches('*'))
        } else {
            path == self.pattern
        }
    }

    /// The route template of the scope and the fingerprint: the path as written (the scope
    /// puts the request's method before it).
    fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Whether records of `route` (a scope's route: the request's method, a space, the
    /// pattern) are this rule's. The first rule that scopes a route is the one the request
    /// matched: a later one with the same pattern and method could not have.
    fn scopes(&self, route: &str) -> bool {
        route.split_once(' ').is_some_and(|(method, pattern)| {
            pattern == self.pattern && self.method.as_ref().is_none_or(|m| m.as_str() == method)
        })
    }
}

/// The longest tenant name a header or `--single-tenant` may give.
const MAX_TENANT_LEN: usize = 255;

/// Headers that carry credentials or the key: a tenant taken from one would be stored and
/// shown in clear.
const NOT_TENANT_HEADERS: [header::HeaderName; 4] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::COOKIE,
    header::HeaderName::from_static("idempotency-key"),
];

/// Where the gateway takes each request's tenant from: always a source the operator named,
/// never a default shared by every caller.
#[derive(Debug, Clone)]
pub enum TenantSource {
    /// `--api-key`: the tenant of the request's bearer token; 401 without a known token.
    ApiKeys(ApiKeys),
    /// `--tenant-header NAME`: the value of a header that an authenticating proxy in front
    /// of the gateway sets on every request, replacing whatever a caller sent; 401 without
    /// it (or with more than one, or with an empty or overlong value).
    Header(header::HeaderName),
    /// `--single-tenant NAME`: every caller is this one tenant, for an upstream that keeps
    /// no per-caller state.
    Single(String),
}

impl TenantSource {
    /// The one source the flags name: API keys (`api_keys`, none when empty), a header, or
    /// a single tenant. Naming none or several is an error that says how to name one.
    pub fn from_flags(
        api_keys: ApiKeys,
        tenant_header: Option<&str>,
        single: Option<&str>,
    ) -> Result<Self, String> {
        let named = [
            !api_keys.is_empty(),
            tenant_header.is_some(),
            single.is_some(),
        ];
        match named.iter().filter(|n| **n).count() {
            0 => {
                return Err(
                    "the gateway needs to know where each request's tenant comes from: \
                    give API keys (--api-key TENANT=TOKEN or IDEMKEY_API_KEYS), or \
                    --tenant-header NAME (a header an authenticating proxy in front sets), or \
                    --single-tenant NAME (one tenant for every caller, only for an upstream \
                    without per-caller state)"
                        .to_owned(),
                );
            }
            1 => {}
            _ => {
                return Err("name one tenant source only: API keys (--api-key, \
                    IDEMKEY_API_KEYS), --tenant-header or --single-tenant"
                    .to_owned());
            }
        }
        if let Some(name) = tenant_header {
            let name = header::HeaderName::from_bytes(name.trim().as_bytes())
                .map_err(|_| format!("--tenant-header {name:?} is not a header name"))?;
            if NOT_TENANT_HEADERS.contains(&name) {
                return Err(format!(
                    "--tenant-header {name}: that header carries a credential or the key, and a \
                     tenant is stored and shown in clear; name the header the proxy sets"
                ));
            }
            return Ok(Self::Header(name));
        }
        if let Some(name) = single {
            return valid_tenant(name)
                .map(Self::Single)
                .ok_or_else(|| format!("--single-tenant {name:?}: {TENANT_RULE}"));
        }
        Ok(Self::ApiKeys(api_keys))
    }

    /// The tenant of a request with these headers, or the rejection (401).
    fn tenant_of(&self, headers: &http::HeaderMap) -> Result<String, GatewayRejection> {
        match self {
            Self::ApiKeys(keys) => headers
                .get(header::AUTHORIZATION)
                .and_then(|v| keys.tenant_of_authorization(v))
                .map(str::to_owned)
                .ok_or(GatewayRejection::Unauthorized),
            Self::Header(name) => {
                let mut values = headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (Some(value), None) => value.to_str().ok().and_then(valid_tenant),
                    _ => None,
                }
                .ok_or(GatewayRejection::Unauthenticated)
            }
            Self::Single(tenant) => Ok(tenant.clone()),
        }
    }
}

/// What a tenant name from a header or `--single-tenant` must be.
const TENANT_RULE: &str = "a tenant is 1 to 255 printable ASCII characters";

/// `name` trimmed, if it is a tenant name ([`TENANT_RULE`]).
fn valid_tenant(name: &str) -> Option<String> {
    let name = name.trim();
    let visible = name.bytes().all(|b| b.is_ascii_graphic() || b == b' ');
    (!name.is_empty() && name.len() <= MAX_TENANT_LEN && visible).then(|| name.to_owned())
}

/// Options of `idemkey gateway`.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Where requests go.
    pub upstream: Upstream,
    /// Keyed routes, required ones first; the first match wins.
    pub routes: Vec<RouteRule>,
    /// What a retry gets while the first attempt runs.
    pub in_flight: InFlightPolicy,
    /// How long an owner holds a reservation without renewing it.
    pub lease: Duration,
    /// The reservation marks the point of no return (else a write of its own does, once the
    /// upstream connection is open).
    pub mark_at_reservation: bool,
    /// Bound of the TCP connect to the upstream.
    pub connect_timeout: Duration,
    /// How long a connection to the upstream is kept idle for the next keyed request; below
    /// the upstream's keep-alive time-out. Zero: one connection per request.
    pub upstream_idle_timeout: Duration,
    /// Bound of the upstream's answer, body included.
    pub upstream_timeout: Duration,
    /// Largest keyed request body (413 past it).
    pub max_request_body: usize,
    /// Largest upstream answer that is stored.
    pub max_stored_response: usize,
    /// How long outcomes are kept.
    pub retention: Duration,
    /// Where each request's tenant comes from.
    pub tenants: TenantSource,
    /// How keyed requests' first-attempt times are read and judged.
    pub first_sent: FirstSentPolicy,
    /// The database URL, as messages name it.
    pub database_url: crate::secret::SecretUrl,
    /// The key secret (and the previous one); without one, see `key_secret_in_database`.
    pub secret: KeySecretSource,
    /// Keep a secret in the database when none is given (SQLite does so by default).
    pub key_secret_in_database: bool,
    /// The reconciler's URL template (`{key}` and `{tenant}` are replaced by the
    /// percent-encoded key and tenant).
    pub reconcile_url: Option<String>,
    /// How often the reconciler runs.
    pub reconcile_interval: Duration,
    /// Test and demo aid: wait this long after the reservation, before connecting upstream.
    pub simulate_delay_before_forward: Duration,
    /// How often expired records are purged.
    pub purge_interval: Duration,
    /// Timeouts and the connection limit of the HTTP server.
    pub limits: HttpLimits,
}

/// What the gateway's handlers share.
#[derive(Debug)]
struct Inner<S> {
    store: S,
    sealer: KeySealer,
    /// Rotation: the previous secret's sealer, which unseals keys sealed before it.
    previous_sealer: Option<KeySealer>,
    /// The status resource, under both secrets during a rotation.
    status: Router,
    metrics: GatewayMetrics,
    /// The options, with the connections kept to the upstream.
    forwarder: Arc<proxy::Forwarder>,
    /// Per route rule (same order as `options.routes`): the layer's external mode around
    /// the forwarding handler.
    keyed: Vec<Router>,
    /// Per route rule (same order): that layer, for what it stores with an answer.
    layers: Vec<IdempotencyLayer<S, mode::External>>,
}

impl<S> Inner<S> {
    fn options(&self) -> &GatewayOptions {
        &self.forwarder.options
    }

    /// What of `headers` is stored with an answer for a record of `route` (its scope's
    /// route, `POST /v1/*`): what that route's layer stores on a normal completion. A route
    /// no longer configured stores the headers every route stores.
    fn stored_headers(&self, route: &str, headers: &http::HeaderMap) -> Vec<(String, Vec<u8>)> {
        let rules = &self.options().routes;
        match rules.iter().position(|rule| rule.scopes(route)) {
            Some(i) => self.layers[i].stored_headers_of(headers),
            None => idemkey_tower::stored_headers(headers, &[]),
        }
    }
}

/// The gateway's state.
#[derive(Debug)]
struct Gateway<S>(Arc<Inner<S>>);

impl<S> Clone for Gateway<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S> std::ops::Deref for Gateway<S> {
    type Target = Inner<S>;

    fn deref(&self) -> &Inner<S> {
        &self.0
    }
}

/// The tenant of every request, from the source the operator named (401 without one).
async fn authenticate<S: GatewayDb>(
    State(gw): State<Gateway<S>>,
    mut req: Request,
    next: Next,
) -> Response {
    match gw.options().tenants.tenant_of(req.headers()) {
        Ok(tenant) => {
            req.extensions_mut().insert(Tenant(tenant));
            next.run(req).await
        }
        Err(rejection) => rejection.into_response(),
    }
}

fn router<S: GatewayDb>(gw: Gateway<S>) -> Router {
    let registry = gw.metrics.registry();
    let proxied = Router::new()
        .fallback(proxy::handle::<S>)
        .with_state(gw.clone());
    let api = gw
        .status
        .clone()
        .merge(proxied)
        .layer(from_fn_with_state(gw, authenticate::<S>));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", crate::metrics::route(registry))
        .merge(api)
}

/// The gateway's routes over `db`, without listening and without the purge and the
/// reconciler that [`gateway`] runs beside them: `/healthz`, `/metrics`, the status resource,
/// and every other request (authenticated) forwarded to the upstream, the keyed routes
/// through the layer's external mode. The database must be migrated.
pub fn app<S: GatewayDb>(
    db: S,
    secrets: &KeySecrets,
    metrics: Metrics,
    options: &GatewayOptions,
) -> Router {
    router(build(db, secrets, metrics, options))
}

/// The gateway's state: keys hashed and sealed with `secrets`, a layer per route rule.
fn build<S: GatewayDb>(
    db: S,
    secrets: &KeySecrets,
    metrics: Metrics,
    options: &GatewayOptions,
) -> Gateway<S> {
    let sealer = KeySealer::new(secrets.current());
    let previous_sealer = secrets.previous().map(KeySealer::new);
    let base = secrets.layer(db.clone());
    let forwarder = Arc::new(proxy::Forwarder::new(Arc::new(options.clone())));
    let (keyed, layers) = options
        .routes
        .iter()
        .map(|rule| {
            let sealer = sealer.clone();
            let mut layer = base.clone().external(options.lease);
            if options.mark_at_reservation {
                layer = layer.point_of_no_return_at_reservation();
            }
            let layer = layer
                .requirement(rule.requirement)
                .route(rule.pattern())
                .answers(rule.answers.clone())
                .in_flight(options.in_flight)
                .retention(options.retention)
                .first_sent(options.first_sent.requirement)
                .first_sent_skew(options.first_sent.skew)
                .max_request_body(options.max_request_body)
                .max_stored_response(options.max_stored_response)
                .metrics(metrics.clone())
                .seal_keys(move |key, id| sealer.seal(key, &id.key_hash));
            (proxy::keyed_route(layer.clone(), forwarder.clone()), layer)
        })
        .unzip();
    Gateway(Arc::new(Inner {
        store: db.clone(),
        sealer,
        previous_sealer,
        status: base.status_router(),
        metrics: GatewayMetrics::new(metrics),
        forwarder,
        keyed,
        layers,
    }))
}

/// Runs idemkey's migrations and the settings' (none of the payments API's), then proxies
/// until SIGTERM or Ctrl-C, with the purge and (when configured) the
/// reconciler running beside it.
pub async fn gateway<S: GatewayDb>(db: S, options: GatewayOptions) -> anyhow::Result<()> {
    // idemkey's tables and the settings', none of the payments API's.
    db.migrate_gateway().await.context("migrations failed")?;
    let secrets = key_secrets(
        &db,
        &options.database_url,
        &options.secret,
        SecretUse::Start {
            in_database: options.key_secret_in_database,
        },
    )
    .await?;
    let metrics = Metrics::new();
    let gw = build(db.clone(), &secrets, metrics.clone(), &options);
    // Each client connection may hold one to the upstream too.
    let listener = http_server::bind(options.listen, &options.limits, 2).await?;
    let routes: Vec<String> = options
        .routes
        .iter()
        .map(|r| {
            let method = r.method.as_ref().map_or("*", Method::as_str);
            let kind = match r.requirement {
                KeyRequirement::Optional => "key optional",
                _ => "key required",
            };
            format!("{method} {} ({kind}; answers: {})", r.pattern, r.answers)
        })
        .collect();
    println!(
        "upstream http://{}{}; keyed routes:\n  {}",
        options.upstream.authority,
        options.upstream.base_path,
        routes.join("\n  ")
    );
    println!(
        "idemkey gateway listening on http://{}",
        listener.local_addr()?
    );
    let purge = PurgeTask::spawn(db, options.purge_interval, metrics, Arc::new(SystemClock));
    let reconcile = options.reconcile_url.clone().map(|template| {
        tokio::spawn(reconciler::run(
            gw.clone(),
            template,
            options.reconcile_interval,
            Arc::new(SystemClock),
        ))
    });
    http_server::run(listener, router(gw), options.limits, shutdown_signal()).await;
    drop(purge);
    if let Some(r) = reconcile {
        r.abort();
    }
    println!("idemkey gateway stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_upstreams() {
        assert_eq!(
            Upstream::parse("http://127.0.0.1:9000").unwrap(),
            Upstream {
                authority: "127.0.0.1:9000".into(),
                base_path: String::new()
            }
        );
        assert_eq!(
            Upstream::parse("http://svc/api/").unwrap(),
            Upstream {
                authority: "svc:80".into(),
                base_path: "/api".into()
            }
        );
        assert!(Upstream::parse("https://svc").is_err());
        assert!(Upstream::parse("svc:80").is_err());
    }

    #[test]
    fn matches_routes() {
        let any = RouteRule::parse("POST *", KeyRequirement::Required, "").unwrap();
        assert!(any.matches(&Method::POST, "/anything"));
        assert!(!any.matches(&Method::PUT, "/anything"));
        let prefix = RouteRule::parse("* /v1/*", KeyRequirement::Optional, "").unwrap();
        assert!(prefix.matches(&Method::PATCH, "/v1/transfers"));
        assert!(!prefix.matches(&Method::PATCH, "/v2/transfers"));
        let exact = RouteRule::parse("post /v1/transfers", KeyRequirement::Required, "").unwrap();
        assert!(exact.matches(&Method::POST, "/v1/transfers"));
        assert!(!exact.matches(&Method::POST, "/v1/transfers/1"));
        assert_eq!(exact.pattern(), "/v1/transfers");
        assert!(RouteRule::parse("POST", KeyRequirement::Required, "").is_err());
        assert!(RouteRule::parse("POST /a*b", KeyRequirement::Required, "").is_err());
        assert!(RouteRule::parse("POST v1", KeyRequirement::Required, "").is_err());
    }

    #[test]
    fn tenant_sources() {
        use http::HeaderMap;
        let keys = ApiKeys::new([("acme".to_owned(), "tok".to_owned())]).unwrap();
        let none = TenantSource::from_flags(ApiKeys::default(), None, None).unwrap_err();
        assert!(none.contains("--tenant-header"), "{none}");
        assert!(TenantSource::from_flags(keys.clone(), Some("X-Tenant"), None).is_err());
        assert!(TenantSource::from_flags(ApiKeys::default(), Some("a b"), None).is_err());
        assert!(TenantSource::from_flags(ApiKeys::default(), Some("cookie"), None).is_err());
        assert!(TenantSource::from_flags(ApiKeys::default(), None, Some("")).is_err());
        let by_header =
            TenantSource::from_flags(ApiKeys::default(), Some("X-Tenant"), None).unwrap();
        fn tenant(source: &TenantSource, pairs: &[(&str, &str)]) -> Option<String> {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                let name = header::HeaderName::from_bytes(name.as_bytes()).unwrap();
                headers.append(name, value.parse().unwrap());
            }
            source.tenant_of(&headers).ok()
        }
        assert_eq!(
            tenant(&by_header, &[("x-tenant", " acme ")]).as_deref(),
            Some("acme")
        );
        assert_eq!(tenant(&by_header, &[]), None);
        assert_eq!(tenant(&by_header, &[("x-tenant", "")]), None);
        assert_eq!(
            tenant(&by_header, &[("x-tenant", "a"), ("x-tenant", "b")]),
            None
        );
        let overlong = "t".repeat(256);
        assert_eq!(tenant(&by_header, &[("x-tenant", &overlong)]), None);
        let by_key = TenantSource::from_flags(keys, None, None).unwrap();
        assert_eq!(
            tenant(&by_key, &[("authorization", "Bearer tok")]).as_deref(),
            Some("acme")
        );
        assert_eq!(tenant(&by_key, &[("authorization", "Bearer other")]), None);
        assert_eq!(tenant(&by_key, &[("x-tenant", "acme")]), None);
        let single = TenantSource::from_flags(ApiKeys::default(), None, Some("all")).unwrap();
        assert_eq!(tenant(&single, &[]).as_deref(), Some("all"));
    }

    #[test]
    fn routes_carry_their_answer_rule() {
        use idemkey_core::AfterEffect;
        let rule = RouteRule::parse(
            "POST /v1/* 503=release",
            KeyRequirement::Required,
            "5xx=store",
        )
        .unwrap();
        assert_eq!(rule.pattern(), "/v1/*");
        assert_eq!(rule.answers.classify(503), AfterEffect::Release);
        assert_eq!(rule.answers.classify(500), AfterEffect::Complete);
        let plain = RouteRule::parse("POST /v1/*", KeyRequirement::Required, "").unwrap();
        assert_eq!(plain.answers, AnswerRule::default());
        let e = RouteRule::parse("POST /v1/* 503=maybe", KeyRequirement::Required, "").unwrap_err();
        assert!(e.contains("503=maybe"), "{e}");
    }

    #[test]
    fn a_records_route_names_the_rule_that_scoped_it() {
        let rule = |spec| RouteRule::parse(spec, KeyRequirement::Required, "").unwrap();
        let (post, any) = (rule("POST /v1/*"), rule("* /v1/x"));
        assert!(post.scopes("POST /v1/*"));
        assert!(!post.scopes("PUT /v1/*"));
        assert!(
            !post.scopes("POST /v1/x"),
            "a path the prefix matches is not its route"
        );
        assert!(any.scopes("PUT /v1/x") && any.scopes("POST /v1/x"));
        assert!(!any.scopes("POST /v1/*") && !any.scopes("/v1/x"));
    }
}
