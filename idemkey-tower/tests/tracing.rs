//! Traces carry a derived key identifier (a keyed hash), never the raw key.

use std::io::Write;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::{IdempotencyKey, KeyHasher, Scope};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{IdempotencyLayer, KeyRequirement, Tenant, Tx};
use tower::ServiceExt;
use tracing_subscriber::fmt::MakeWriter;

/// Collects everything the subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

async fn handler(mut tx: Tx<SqliteStore>) -> StatusCode {
    tracing::info!("the handler runs");
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    StatusCode::CREATED
}

#[tokio::test]
async fn spans_carry_the_key_id_never_the_raw_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let hasher = KeyHasher::new(b"secret");
    let app = Router::new().route(
        "/orders",
        post(handler).layer(IdempotencyLayer::new(store, hasher.clone())),
    );

    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let raw = "order-4711-customer-alice";
    let mut request = Request::post("/orders")
        .header("idempotency-key", raw)
        .body(Body::from("{}"))
        .unwrap();
    request.extensions_mut().insert(Tenant("acme".to_owned()));
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let key = IdempotencyKey::parse(raw.as_bytes()).unwrap();
    let key_id = hasher
        .record_id(&Scope::new("acme", "POST", "/orders"), &key)
        .key_id();
    assert!(
        logs.contains(&format!("key_id={key_id}")),
        "the handler's log line is inside the idempotency span: {logs}"
    );
    assert!(logs.contains("the handler runs"), "{logs}");
    assert!(
        !logs.contains(raw),
        "the raw key leaked into the logs: {logs}"
    );
    assert!(!logs.contains("4711"), "part of the raw key leaked: {logs}");
}

#[tokio::test]
async fn a_request_without_a_tenant_is_warned_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let layer = IdempotencyLayer::new(store, KeyHasher::new(b"secret"));
    let app = Router::new()
        .route("/orders", post(handler).layer(layer.clone()))
        .route(
            "/refunds",
            post(handler).layer(layer.requirement(KeyRequirement::Optional)),
        );

    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let warnings = || {
        String::from_utf8(captured.0.lock().unwrap().clone())
            .unwrap()
            .matches("without a Tenant")
            .count()
    };

    let send = |path: &str, key: &str, tenant: Option<&str>| {
        let mut request = Request::post(path)
            .header("idempotency-key", key)
            .body(Body::from("{}"))
            .unwrap();
        if let Some(tenant) = tenant {
            request.extensions_mut().insert(Tenant(tenant.to_owned()));
        }
        app.clone().oneshot(request)
    };
    assert_eq!(
        send("/orders", "k1", Some("acme")).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(warnings(), 0, "a request with a tenant is not warned about");
    assert_eq!(
        send("/orders", "k2", None).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(
        warnings(),
        1,
        "the first request without a tenant is warned about"
    );
    assert_eq!(
        send("/orders", "k3", None).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(
        send("/refunds", "k4", None).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(warnings(), 1, "and only once, on every route of the layer");
}
