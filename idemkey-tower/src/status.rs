//! The status resource: `GET /idempotency/v1/keys/{key}` answers the caller's own records.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idemkey_core::{Clock, IdempotencyKey, KeyHasher, Record, RecordId, Store, Timestamp};
use serde::Serialize;

use crate::layer::STATUS_PATH;
use crate::{IdempotencyRejection, SystemClock, Tenant};

#[derive(Clone)]
struct StatusState<S> {
    store: S,
    hasher: KeyHasher,
    previous_hasher: Option<KeyHasher>,
    clock: Arc<dyn Clock>,
}

/// One record, as the status resource shows it.
#[derive(Debug, Serialize)]
struct RecordView {
    route: String,
    state: &'static str,
    created_at: String,
    updated_at: String,
    expires_at: String,
    /// The first attempt's time the claiming request stated, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    first_sent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_status: Option<u16>,
}

#[derive(Debug, Serialize)]
struct KeyView {
    key_id: String,
    records: Vec<RecordView>,
}

pub(crate) fn rfc3339(t: Timestamp) -> String {
    humantime::format_rfc3339_millis(t.to_system_time()).to_string()
}

impl From<&Record> for RecordView {
    fn from(r: &Record) -> Self {
        Self {
            route: r.id.route.clone(),
            state: r.state.as_str(),
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            expires_at: rfc3339(r.expires_at),
            first_sent: r.first_sent.map(rfc3339),
            response_status: r.response.as_ref().map(|resp| resp.status),
        }
    }
}

/// A router with the status resource at `/idempotency/v1/keys/{key}`.
///
/// It answers only the caller's own records: the tenant comes from the [`Tenant`] request
/// extension, so put it behind the same authentication as the keyed routes. Expired
/// records are not shown (they no longer protect anything).
///
/// ```no_run
/// use axum::Router;
/// use idemkey_core::KeyHasher;
/// use idemkey_sqlite::SqliteStore;
/// use idemkey_tower::status_router;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = SqliteStore::connect("sqlite:app.db").await?;
/// store.migrate().await?;
/// // The same hasher (the same secret) as the layer's, or no key is found.
/// let hasher = KeyHasher::new(b"the layer's secret");
/// let app: Router = Router::new()
///     // .route(...) the keyed routes
///     .merge(status_router(store, hasher)); // GET /idempotency/v1/keys/{key}
/// # Ok(()) }
/// ```
///
/// After a key-secret rotation, use
/// [`IdempotencyLayer::status_router`](crate::IdempotencyLayer::status_router), which also
/// finds records made under the previous secret and reads the layer's clock (this one reads
/// the [`SystemClock`](crate::SystemClock)).
pub fn status_router<S: Store>(store: S, hasher: KeyHasher) -> axum::Router {
    router(store, hasher, None, Arc::new(SystemClock))
}

pub(crate) fn router<S: Store>(
    store: S,
    hasher: KeyHasher,
    previous_hasher: Option<KeyHasher>,
    clock: Arc<dyn Clock>,
) -> axum::Router {
    axum::Router::new()
        .route(&format!("{STATUS_PATH}/{{key}}"), get(key_status::<S>))
        .with_state(StatusState {
            store,
            hasher,
            previous_hasher,
            clock,
        })
}

/// `%XX` sequences decoded to their bytes; anything else kept as is.
fn percent_decode(segment: &str) -> Vec<u8> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

async fn key_status<S: Store>(
    State(state): State<StatusState<S>>,
    tenant: Option<axum::Extension<Tenant>>,
    uri: http::Uri,
    key: Result<Path<String>, PathRejection>,
) -> Response {
    let tenant = tenant.map_or_else(|| Tenant::DEFAULT.to_owned(), |t| t.0.0);
    // A key that does not decode to UTF-8 is refused by `Path` with a plain-text 400; it is
    // a malformed key like any other, answered as one (problem+json, the byte named).
    let key = match key {
        Ok(Path(key)) => key.into_bytes(),
        Err(_) => percent_decode(uri.path().rsplit('/').next().unwrap_or_default()),
    };
    let key = match IdempotencyKey::parse(&key) {
        Ok(key) => key,
        Err(e) => return IdempotencyRejection::KeyInvalid(e).into_response(),
    };
    let key_hash = state.hasher.key_hash(&tenant, &key);
    let previous_hash = state
        .previous_hasher
        .as_ref()
        .map(|h| h.key_hash(&tenant, &key));
    let records = async {
        let mut conn = state.store.acquire().await?;
        let mut records = state
            .store
            .find_by_key(&mut conn, &tenant, &key_hash)
            .await?;
        if let Some(previous_hash) = &previous_hash {
            // Routes not claimed again under the current secret since the rotation.
            let previous = state
                .store
                .find_by_key(&mut conn, &tenant, previous_hash)
                .await?;
            let previous: Vec<Record> = previous
                .into_iter()
                .filter(|p| !records.iter().any(|r| r.id.route == p.id.route))
                .collect();
            records.extend(previous);
        }
        Ok::<_, idemkey_core::StoreError>(records)
    }
    .await;
    let records = match records {
        Ok(records) => records,
        Err(_) => {
            return IdempotencyRejection::StoreUnavailable {
                retry_after: Duration::from_secs(1),
            }
            .into_response();
        }
    };
    let now = state.clock.now();
    let records: Vec<RecordView> = records
        .iter()
        .filter(|r| !r.is_expired(now))
        .map(RecordView::from)
        .collect();
    if records.is_empty() {
        return IdempotencyRejection::KeyNotFound.into_response();
    }
    let key_id = RecordId::key_id_of(&key_hash);
    Json(KeyView { key_id, records }).into_response()
}
