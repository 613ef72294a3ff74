//! `GET /metrics` of `serve`, `gateway` and `relay`: the registry a process fills at start,
//! encoded in the Prometheus text format at each request.

use std::sync::Arc;

use axum::routing::{MethodRouter, get};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;

/// The `Content-Type` of `/metrics`: the Prometheus text format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// `GET /metrics`: every family of `registry`, with the counts of the moment.
pub(crate) fn route<S: Clone + Send + Sync + 'static>(registry: Registry) -> MethodRouter<S> {
    let registry = Arc::new(registry);
    get(move || {
        let registry = registry.clone();
        async move {
            let mut text = String::new();
            // Writing to a `String` does not fail.
            let _ = prometheus_text::encode(&mut text, &registry);
            ([(http::header::CONTENT_TYPE, CONTENT_TYPE)], text)
        }
    })
}
