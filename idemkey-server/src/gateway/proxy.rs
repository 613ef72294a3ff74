//! Forwarding. A request on a keyed route goes through the layer's external mode
//! ([`IdempotencyLayer::external`]), whose handler here is [`forward_keyed`]: take a
//! connection (kept or new, `upstream.rs`), mark the point of no return, send, and hand back
//! the upstream's answer (or say that none came, or that nothing was sent after all). What
//! becomes of the record is the layer's one decision ([`idemkey_core::after_effect`]), not
//! the gateway's. Every other request is streamed through, on a connection of its own.

use std::io;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Body as _;
use idemkey_core::HEADER_NAME;
use idemkey_core::hop::strip_hop_by_hop;
use idemkey_tower::{
    External, IdempotencyLayer, IdempotencyRejection, KeyRequirement, RETRY_AFTER, Tenant, is_safe,
    mode,
};
use tower::ServiceExt;

use super::GatewayDb;
use super::upstream::{Connection, Connections};
use super::{Gateway, GatewayOptions, GatewayRejection, RouteRule};

/// What forwarding needs: the options, and the connections kept to the upstream.
#[derive(Debug)]
pub(super) struct Forwarder {
    pub(super) options: Arc<GatewayOptions>,
    connections: Connections,
}

impl Forwarder {
    pub(super) fn new(options: Arc<GatewayOptions>) -> Self {
        let connections = Connections::new(
            options.upstream.authority.clone(),
            options.connect_timeout,
            options.upstream_idle_timeout,
        );
        Self {
            options,
            connections,
        }
    }
}

/// The service of one keyed route: the layer's external mode around [`forward_keyed`].
pub(super) fn keyed_route<S: GatewayDb>(
    layer: IdempotencyLayer<S, mode::External>,
    forwarder: Arc<Forwarder>,
) -> axum::Router {
    axum::Router::new().fallback_service(layer.handler_service(forward_keyed::<S>, forwarder))
}

/// Every request that is not the gateway's own: refused when it asks for a tunnel
/// (`CONNECT`), which a reverse proxy does not open; else forwarded.
pub(super) async fn handle<S: GatewayDb>(State(gw): State<Gateway<S>>, req: Request) -> Response {
    if req.method() == Method::CONNECT {
        return GatewayRejection::NotForwarded(Method::CONNECT).into_response();
    }
    let rule = if is_safe(req.method()) {
        None
    } else {
        gw.options()
            .routes
            .iter()
            .position(|r| r.matches(req.method(), req.uri().path()))
    };
    let Some(i) = rule else {
        return forward_plain(&gw.forwarder, req).await;
    };
    let RouteRule { requirement, .. } = &gw.options().routes[i];
    if *requirement == KeyRequirement::Optional && !req.headers().contains_key(HEADER_NAME) {
        return forward_plain(&gw.forwarder, req).await;
    }
    match gw.keyed[i].clone().oneshot(req).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The layer's handler on keyed routes: the request is reserved and the lease renewed; this
/// forwards it, marking the point of no return once a connection to the upstream is open and
/// ready, just before the request is written.
async fn forward_keyed<S: GatewayDb>(
    State(forwarder): State<Arc<Forwarder>>,
    op: External<S>,
    req: Request,
) -> Response {
    let options = &forwarder.options;
    if !options.simulate_delay_before_forward.is_zero() {
        tokio::time::sleep(options.simulate_delay_before_forward).await;
    }
    // The layer read the body whole.
    let (parts, body) = req.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    // Connections are kept per tenant: an upstream that answers once too often on one gives
    // the extra answer to a request of the same tenant at worst, never to another's.
    let tenant = parts
        .extensions
        .get::<Tenant>()
        .map_or("", |t| t.0.as_str());
    let mut reuse = true;
    loop {
        // Nothing has been sent yet: whatever happens here frees the key.
        let connection = match forwarder.connections.get(tenant, reuse).await {
            Ok(connection) => connection,
            Err(error) => return unreachable(&error),
        };
        if let Err(rejection) = op.point_of_no_return().await {
            tracing::warn!(error = %rejection, "cannot mark the point of no return; nothing was sent");
            return rejection.into_response();
        }
        let reused = connection.reused;
        let Some(body) = connection.begin(Body::from(bytes.clone())) else {
            // The upstream wrote on the connection with no request outstanding (whatever it
            // wrote is no answer to this request), or closed it: not sent on it.
            op.nothing_sent();
            if reused {
                reuse = false;
                continue;
            }
            return unreachable(&io::Error::other(
                "the upstream wrote on, or closed, a new connection before any request",
            ));
        };
        // The point of no return: from here the effect may happen.
        let mut req = upstream_request(options, &parts, body);
        req.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        match exchange(&forwarder, tenant, connection, req).await {
            Upstreamed::Answer(head, body) => return downstream(head, Body::from(body)),
            Upstreamed::NotSent(error) => {
                // The connection had closed; hyper handed the request back unwritten.
                op.nothing_sent();
                if reused {
                    // A kept connection the upstream closed while it sat idle: once more,
                    // on a new one.
                    reuse = false;
                    continue;
                }
                return unreachable(&io::Error::other(error));
            }
            Upstreamed::TooLarge => {
                // The upstream answered, so it had the request: its effect may have happened.
                tracing::warn!(
                    limit = options.max_stored_response,
                    "the upstream's answer is too large to store: the outcome is unknown"
                );
                op.outcome_unknown();
                return IdempotencyRejection::ResponseTooLarge {
                    limit: options.max_stored_response,
                    status_url: Some(op.status_url().to_owned()),
                }
                .into_response();
            }
            Upstreamed::Unknown(reason) => {
                tracing::warn!(%reason, "sent upstream, no answer to store: the outcome is unknown");
                op.outcome_unknown();
                return GatewayRejection::UpstreamOutcomeUnknown {
                    status_url: op.status_url().to_owned(),
                }
                .into_response();
            }
        }
    }
}

/// The request as the upstream gets it: its path under the upstream's base path, every
/// end-to-end header (`Idempotency-Key` and `Authorization` included), `Host` rewritten.
fn upstream_request(options: &GatewayOptions, parts: &Parts, body: Body) -> Request<Body> {
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    let unknown_length = body.size_hint().exact().is_none();
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = format!("{}{path}", options.upstream.base_path)
        .parse()
        .unwrap_or_else(|_| http::Uri::from_static("/"));
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    // A body of unknown length (chunked from the client) goes on chunked: said outright,
    // since hyper sends none with a GET or a HEAD that does not say it.
    if unknown_length && !headers.contains_key(header::CONTENT_LENGTH) {
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
    }
    if let Ok(host) = HeaderValue::from_str(&options.upstream.authority) {
        headers.insert(header::HOST, host);
    }
    *req.headers_mut() = headers;
    req
}

/// 503 `upstream-unavailable`: no connection to the upstream, nothing was sent.
fn unreachable(error: &io::Error) -> Response {
    tracing::warn!(%error, "upstream unreachable; nothing was sent");
    GatewayRejection::UpstreamUnavailable {
        retry_after: RETRY_AFTER,
    }
    .into_response()
}

fn downstream(mut head: http::response::Parts, body: Body) -> Response {
    strip_hop_by_hop(&mut head.headers);
    // The gateway answers in its own protocol version, whatever the upstream spoke.
    head.version = http::Version::default();
    Response::from_parts(head, body)
}

/// A request without idempotency: streamed through, on a new connection.
async fn forward_plain(forwarder: &Forwarder, req: Request) -> Response {
    let options = &forwarder.options;
    let (parts, body) = req.into_parts();
    let mut sender = match forwarder.connections.open().await {
        Ok(sender) => sender,
        Err(error) => return unreachable(&error),
    };
    let sending = sender.send_request(upstream_request(options, &parts, body));
    match tokio::time::timeout(options.upstream_timeout, sending).await {
        Ok(Ok(response)) => {
            let (head, body) = response.into_parts();
            downstream(head, Body::new(body))
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "upstream failed");
            GatewayRejection::UpstreamFailed.into_response()
        }
        Err(_) => {
            tracing::warn!("upstream timed out");
            GatewayRejection::UpstreamFailed.into_response()
        }
    }
}

/// What came back from the upstream.
enum Upstreamed {
    /// A complete answer.
    Answer(http::response::Parts, Bytes),
    /// The connection had closed, and the request was handed back unwritten.
    NotSent(hyper::Error),
    /// An answer came back, with a body larger than `--max-stored-response`.
    TooLarge,
    /// The request was sent and no answer to store came back: none, an incomplete one, or
    /// one that came before the request was written whole.
    Unknown(String),
}

/// Sends `req` on `connection` and reads the answer whole; keeps the connection for a later
/// request of `tenant` when the answer came back complete, and closes it otherwise.
async fn exchange(
    forwarder: &Forwarder,
    tenant: &str,
    mut connection: Connection,
    req: Request<Body>,
) -> Upstreamed {
    let limit = forwarder.options.max_stored_response;
    let round_trip = async {
        let response = match connection.sender.try_send_request(req).await {
            Ok(response) => response,
            Err(mut e) => {
                return Err(match e.take_message() {
                    Some(_unsent) => Upstreamed::NotSent(e.into_error()),
                    None => Upstreamed::Unknown(e.into_error().to_string()),
                });
            }
        };
        if connection.answered_early() {
            // An extra answer to an earlier request, or one to a request the upstream did
            // not read: not this request's to store.
            return Err(Upstreamed::Unknown(
                "the upstream answered before it had the whole request".to_owned(),
            ));
        }
        let (head, body) = response.into_parts();
        let body = Limited::new(body, limit)
            .collect()
            .await
            .map_err(|e| match e.downcast_ref::<LengthLimitError>() {
                Some(_) => Upstreamed::TooLarge,
                None => Upstreamed::Unknown(format!("reading the answer: {e}")),
            })?
            .to_bytes();
        Ok((head, body))
    };
    match tokio::time::timeout(forwarder.options.upstream_timeout, round_trip).await {
        Ok(Ok((head, body))) => {
            forwarder.connections.put(tenant, connection);
            Upstreamed::Answer(head, body)
        }
        Ok(Err(failed)) => failed,
        Err(_) => Upstreamed::Unknown(format!(
            "no answer within {:?}",
            forwarder.options.upstream_timeout
        )),
    }
}

#[cfg(test)]
mod downstream_tests {
    use super::*;

    #[test]
    fn answers_in_its_own_version_without_hop_by_hop_headers() {
        let upstream = http::Response::builder()
            .version(http::Version::HTTP_10)
            .status(201)
            .header(header::CONNECTION, "keep-alive")
            .header("keep-alive", "timeout=5")
            .header(header::LOCATION, "/v1/transfers/1")
            .body(())
            .unwrap();
        let (head, ()) = upstream.into_parts();
        let response = downstream(head, Body::empty());
        assert_eq!(response.version(), http::Version::HTTP_11);
        assert_eq!(response.status(), 201);
        assert!(response.headers().get(header::CONNECTION).is_none());
        assert!(response.headers().get("keep-alive").is_none());
        assert_eq!(response.headers()[header::LOCATION], "/v1/transfers/1");
    }
}
