//! Forwarding. A request on a keyed route goes through the layer's external mode
//! ([`IdempotencyLayer::external`]), whose handler here is [`forward_keyed`]: connect, mark
//! the point of no return, send, and hand back the upstream's answer (or say that none came).
//! What becomes of the record is the layer's one decision ([`idemkey_core::after_effect`]),
//! not the gateway's. Every other request is streamed through.

use std::io;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, header};
use http_body_util::{BodyExt, Limited};
use hyper_util::rt::TokioIo;
use idemkey_core::HEADER_NAME;
use idemkey_fault_proxy::strip_hop_by_hop;
use idemkey_tower::{
    External, IdempotencyLayer, IdempotencyRejection, KeyRequirement, RETRY_AFTER, is_safe,
};
use tokio::net::TcpStream;
use tower::{Layer, ServiceExt};

use super::{Gateway, GatewayOptions, RouteRule};
use crate::AppDb;

/// The service of one keyed route: the layer's external mode around [`forward_keyed`].
pub(super) fn keyed_route<S: AppDb>(
    layer: IdempotencyLayer<S>,
    options: std::sync::Arc<GatewayOptions>,
) -> axum::Router {
    let handler = axum::handler::Handler::with_state(forward_keyed::<S>, options);
    axum::Router::new().fallback_service(layer.layer(handler))
}

/// Every request that is not the gateway's own.
pub(super) async fn handle<S: AppDb>(State(gw): State<Gateway<S>>, req: Request) -> Response {
    let rule = if is_safe(req.method()) {
        None
    } else {
        gw.options
            .routes
            .iter()
            .position(|r| r.matches(req.method(), req.uri().path()))
    };
    let Some(i) = rule else {
        return forward_plain(&gw.options, req).await;
    };
    let RouteRule { requirement, .. } = &gw.options.routes[i];
    if *requirement == KeyRequirement::Optional && !req.headers().contains_key(HEADER_NAME) {
        return forward_plain(&gw.options, req).await;
    }
    match gw.keyed[i].clone().oneshot(req).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The layer's handler on keyed routes: the request is reserved and the lease renewed; this
/// forwards it, marking the point of no return once a connection to the upstream is open,
/// just before the request is written.
async fn forward_keyed<S: AppDb>(
    State(options): State<std::sync::Arc<GatewayOptions>>,
    op: External<S>,
    req: Request,
) -> Response {
    if !options.simulate_delay_before_forward.is_zero() {
        tokio::time::sleep(options.simulate_delay_before_forward).await;
    }
    // Nothing has been sent yet: whatever happens here frees the key.
    let stream = match connect(&options).await {
        Ok(stream) => stream,
        Err(unreachable) => return unreachable,
    };
    if let Err(rejection) = op.point_of_no_return().await {
        tracing::warn!(error = %rejection, "cannot mark the point of no return; nothing was sent");
        return rejection.into_response();
    }
    // The point of no return: from here the effect may happen. The layer read the body.
    let (parts, body) = req.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut req = upstream_request(&options, &parts, Body::from(bytes.clone()));
    req.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    match exchange(&options, stream, req).await {
        Upstreamed::Answer(head, body) => downstream(head, Body::from(body)),
        Upstreamed::Unknown(reason) => {
            tracing::warn!(%reason, "sent upstream, no complete answer: the outcome is unknown");
            op.outcome_unknown();
            IdempotencyRejection::UpstreamOutcomeUnknown {
                status_url: op.status_url().to_owned(),
            }
            .into_response()
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
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = format!("{}{path}", options.upstream.base_path)
        .parse()
        .unwrap_or_else(|_| http::Uri::from_static("/"));
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    if let Ok(host) = HeaderValue::from_str(&options.upstream.authority) {
        headers.insert(header::HOST, host);
    }
    *req.headers_mut() = headers;
    req
}

/// Opens a connection to the upstream, or answers 503 `upstream-unavailable`: nothing was
/// sent.
async fn connect(options: &GatewayOptions) -> Result<TcpStream, Response> {
    let connecting = TcpStream::connect(options.upstream.authority.as_str());
    let error = match tokio::time::timeout(options.connect_timeout, connecting).await {
        Ok(Ok(stream)) => return Ok(stream),
        Ok(Err(e)) => e,
        Err(_) => io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
    };
    tracing::warn!(%error, "upstream unreachable; nothing was sent");
    Err(IdempotencyRejection::UpstreamUnavailable {
        retry_after: RETRY_AFTER,
    }
    .into_response())
}

/// Sends `req` on an open connection (HTTP/1.1, one request per connection).
async fn send(
    stream: TcpStream,
    req: Request<Body>,
) -> Result<http::Response<hyper::body::Incoming>, hyper::Error> {
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    sender.send_request(req).await
}

fn downstream(mut head: http::response::Parts, body: Body) -> Response {
    strip_hop_by_hop(&mut head.headers);
    // The gateway answers in its own protocol version, whatever the upstream spoke.
    head.version = http::Version::default();
    Response::from_parts(head, body)
}

/// A request without idempotency: streamed through.
async fn forward_plain(options: &GatewayOptions, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let stream = match connect(options).await {
        Ok(stream) => stream,
        Err(unreachable) => return unreachable,
    };
    let sending = send(stream, upstream_request(options, &parts, body));
    match tokio::time::timeout(options.upstream_timeout, sending).await {
        Ok(Ok(response)) => {
            let (head, body) = response.into_parts();
            downstream(head, Body::new(body))
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "upstream failed");
            IdempotencyRejection::UpstreamFailed.into_response()
        }
        Err(_) => {
            tracing::warn!("upstream timed out");
            IdempotencyRejection::UpstreamFailed.into_response()
        }
    }
}

/// What came back from the upstream.
enum Upstreamed {
    /// A complete answer.
    Answer(http::response::Parts, Bytes),
    /// The request was sent and no complete answer came back.
    Unknown(String),
}

async fn exchange(options: &GatewayOptions, stream: TcpStream, req: Request<Body>) -> Upstreamed {
    let limit = options.max_stored_response;
    let round_trip = async {
        let response = send(stream, req).await.map_err(|e| e.to_string())?;
        let (head, body) = response.into_parts();
        let body = Limited::new(body, limit)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        Ok::<_, String>((head, body))
    };
    match tokio::time::timeout(options.upstream_timeout, round_trip).await {
        Ok(Ok((head, body))) => Upstreamed::Answer(head, body),
        Ok(Err(e)) => Upstreamed::Unknown(e),
        Err(_) => Upstreamed::Unknown(format!("no answer within {:?}", options.upstream_timeout)),
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
