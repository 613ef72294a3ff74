//! The layer's modes against the handlers' extractors: a route built with
//! `IdempotencyLayer::handler` (or `handler_service`) whose handler takes the other mode's extractor is refused when
//! the router is built, before any request; a matching handler is served.

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::KeyHasher;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{External, IdempotencyLayer, IdempotencyRejection, Tx};
use tempfile::TempDir;
use tower::ServiceExt;

async fn setup() -> (TempDir, IdempotencyLayer<SqliteStore>) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("modes.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    (dir, IdempotencyLayer::new(store, KeyHasher::new(b"modes")))
}

async fn local(tx: Tx<SqliteStore>, _body: Bytes) -> (StatusCode, String) {
    (StatusCode::CREATED, tx.operation_id().to_owned())
}

async fn local_checked(tx: Result<Tx<SqliteStore>, IdempotencyRejection>) -> StatusCode {
    if tx.is_ok() {
        StatusCode::CREATED
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

async fn external(op: External<SqliteStore>, _body: Bytes) -> (StatusCode, String) {
    op.point_of_no_return().await.unwrap();
    (StatusCode::CREATED, op.key_id())
}

async fn external_optional(op: Option<External<SqliteStore>>) -> StatusCode {
    match op {
        Some(op) => {
            op.point_of_no_return().await.unwrap();
            StatusCode::CREATED
        }
        None => StatusCode::OK,
    }
}

async fn send(app: &Router) -> StatusCode {
    let req = Request::post("/r")
        .header("idempotency-key", "k1")
        .body(Body::from("{}"))
        .unwrap();
    app.clone().oneshot(req).await.unwrap().status()
}

#[tokio::test]
#[should_panic(expected = "takes a `Tx`, which a route in external mode does not give")]
async fn a_tx_handler_behind_an_external_layer_is_refused_when_the_router_is_built() {
    let (_dir, layer) = setup().await;
    let layer = layer.external(Duration::from_secs(10));
    let _app: Router = Router::new().route("/r", post(layer.handler(local)));
}

#[tokio::test]
#[should_panic(expected = "takes a `Tx`, which a route in external mode does not give")]
async fn a_checked_tx_behind_an_external_layer_is_refused_when_the_router_is_built() {
    let (_dir, layer) = setup().await;
    let layer = layer.external(Duration::from_secs(10));
    let _app: Router = Router::new().route("/r", post(layer.handler(local_checked)));
}

#[tokio::test]
#[should_panic(expected = "takes an `External`, which only a route in external mode gives")]
async fn an_external_handler_behind_a_local_layer_is_refused_when_the_router_is_built() {
    let (_dir, layer) = setup().await;
    let _app: Router = Router::new().route("/r", post(layer.handler(external)));
}

#[tokio::test]
#[should_panic(expected = "takes an `External`, which only a route in external mode gives")]
async fn an_optional_external_behind_a_local_layer_is_refused_when_the_router_is_built() {
    let (_dir, layer) = setup().await;
    let _app: Router = Router::new().route("/r", post(layer.handler(external_optional)));
}

#[tokio::test]
#[should_panic(expected = "takes a `Tx`, which a route in external mode does not give")]
async fn a_tx_handler_service_behind_an_external_layer_is_refused_when_it_is_built() {
    let (_dir, layer) = setup().await;
    let layer = layer.external(Duration::from_secs(10));
    let _app: Router = Router::new().route_service("/r", layer.handler_service(local, ()));
}

/// A handler's service built once, with its state, is served as its handler would be.
#[tokio::test]
async fn a_handler_service_of_the_layers_mode_is_served() {
    let (_dir, layer) = setup().await;
    let external_layer = layer.clone().external(Duration::from_secs(10));
    let app = Router::new()
        .route_service("/r", layer.handler_service(local, ()))
        .route_service("/e", external_layer.handler_service(external, ()));
    assert_eq!(send(&app).await, StatusCode::CREATED);
    let req = Request::post("/e")
        .header("idempotency-key", "k1")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(
        app.clone().oneshot(req).await.unwrap().status(),
        StatusCode::CREATED
    );
}

/// The check refuses only the other mode's extractors: each mode's own handlers are built
/// and served.
#[tokio::test]
async fn handlers_of_the_layers_mode_are_served() {
    let (_dir, layer) = setup().await;
    let external_layer = layer.clone().external(Duration::from_secs(10));
    let app = Router::new()
        .route("/r", post(layer.clone().handler(local)))
        .route("/checked", post(layer.handler(local_checked)))
        .route("/e", post(external_layer.clone().handler(external)))
        .route("/o", post(external_layer.handler(external_optional)));
    assert_eq!(send(&app).await, StatusCode::CREATED);
    for path in ["/checked", "/e", "/o"] {
        let req = Request::post(path)
            .header("idempotency-key", "k1")
            .body(Body::from("{}"))
            .unwrap();
        let status = app.clone().oneshot(req).await.unwrap().status();
        assert_eq!(status, StatusCode::CREATED, "{path}");
    }
}

/// Through `.layer(..)` the layer cannot see the handler: the mismatch is answered per
/// request (500 `transaction-unavailable`), which is why routes go through `handler`.
#[tokio::test]
async fn a_mismatch_through_layer_is_answered_per_request() {
    let (_dir, layer) = setup().await;
    let app = Router::new().route(
        "/r",
        post(local).layer(layer.external(Duration::from_secs(10))),
    );
    assert_eq!(send(&app).await, StatusCode::INTERNAL_SERVER_ERROR);
}
