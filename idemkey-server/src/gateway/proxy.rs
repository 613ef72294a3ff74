//! Forwarding: every request goes to the upstream; keyed ones through the external-mode
//! protocol (reserve, lease, point of no return, complete / release / indeterminate).

use std::io;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, header};
use http_body_util::{BodyExt, Limited};
use hyper_util::rt::TokioIo;
use idemkey_core::protocol::{self, Claim, ClaimOutcome, Lease};
use idemkey_core::{
    FingerprintSpec, HEADER_NAME, IdempotencyKey, RequestParts, Scope, StoredResponse, Timestamp,
    fingerprint,
};
use idemkey_fault_proxy::strip_hop_by_hop;
use idemkey_tower::{
    IdempotencyRejection, KeyRequirement, Outcome, RETRY_AFTER, Tenant, add_expiry, answer_claim,
    is_safe, keep_alive, read_body, reserve_waiting, settle, status_url, store_unavailable,
    stored_headers,
};
use tokio::net::TcpStream;
use tracing::Instrument;

use super::{Gateway, RouteRule};
use crate::AppDb;

/// Every request that is not the gateway's own.
pub(super) async fn handle<S: AppDb>(State(gw): State<Gateway<S>>, req: Request) -> Response {
    let rule = if is_safe(req.method()) {
        None
    } else {
        gw.options
            .routes
            .iter()
            .find(|r| r.matches(req.method(), req.uri().path()))
            .cloned()
    };
    let Some(rule) = rule else {
        return forward_plain(&gw, req).await;
    };
    let fields = req.headers().get_all(HEADER_NAME);
    let key = match IdempotencyKey::from_fields(fields.iter().map(HeaderValue::as_bytes)) {
        Ok(Some(key)) => key,
        Ok(None) if rule.requirement == KeyRequirement::Optional => {
            return forward_plain(&gw, req).await;
        }
        Ok(None) => return rejected(&gw, IdempotencyRejection::KeyMissing),
        Err(e) => return rejected(&gw, IdempotencyRejection::KeyInvalid(e)),
    };
    // The keyed flow runs in its own task: a client that hangs up must not stop the owner
    // between the point of no return and the stored outcome.
    let task = tokio::spawn(keyed(gw, rule, key, req));
    match task.await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!(error = %e, "the keyed request task failed");
            IdempotencyRejection::Internal.into_response()
        }
    }
}

fn rejected<S>(gw: &Gateway<S>, rejection: IdempotencyRejection) -> Response {
    gw.metrics.attempt();
    gw.metrics.record(Outcome::Rejected, Duration::ZERO);
    rejection.into_response()
}

/// The request as the upstream gets it: its path under the upstream's base path, every
/// end-to-end header (`Idempotency-Key` and `Authorization` included), `Host` rewritten.
fn upstream_request<S>(gw: &Gateway<S>, parts: &Parts, body: Body) -> Request<Body> {
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = format!("{}{path}", gw.options.upstream.base_path)
        .parse()
        .unwrap_or_else(|_| http::Uri::from_static("/"));
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    if let Ok(host) = HeaderValue::from_str(&gw.options.upstream.authority) {
        headers.insert(header::HOST, host);
    }
    *req.headers_mut() = headers;
    req
}

async fn connect<S>(gw: &Gateway<S>) -> io::Result<TcpStream> {
    let connecting = TcpStream::connect(gw.options.upstream.authority.as_str());
    match tokio::time::timeout(gw.options.connect_timeout, connecting).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
    }
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
async fn forward_plain<S: AppDb>(gw: &Gateway<S>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let stream = match connect(gw).await {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(error = %e, "upstream unreachable");
            return IdempotencyRejection::UpstreamUnavailable {
                retry_after: RETRY_AFTER,
            }
            .into_response();
        }
    };
    let sending = send(stream, upstream_request(gw, &parts, body));
    match tokio::time::timeout(gw.options.upstream_timeout, sending).await {
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

async fn exchange<S>(gw: &Gateway<S>, stream: TcpStream, req: Request<Body>) -> Upstreamed {
    let limit = gw.options.max_stored_response;
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
    match tokio::time::timeout(gw.options.upstream_timeout, round_trip).await {
        Ok(Ok((head, body))) => Upstreamed::Answer(head, body),
        Ok(Err(e)) => Upstreamed::Unknown(e),
        Err(_) => Upstreamed::Unknown(format!(
            "no answer within {:?}",
            gw.options.upstream_timeout
        )),
    }
}

/// One keyed request.
async fn keyed<S: AppDb>(
    gw: Gateway<S>,
    rule: RouteRule,
    key: IdempotencyKey,
    req: Request,
) -> Response {
    let started = Instant::now();
    gw.metrics.attempt();
    let finish = |outcome: Outcome, response: Response| {
        gw.metrics.record(outcome, started.elapsed());
        response
    };
    let tenant = req
        .extensions()
        .get::<Tenant>()
        .map_or_else(|| Tenant::DEFAULT.to_owned(), |t| t.0.clone());
    let (parts, body) = req.into_parts();
    let bytes = match read_body(&parts.headers, body, gw.options.max_request_body).await {
        Ok(bytes) => bytes,
        Err(rejection) => return finish(Outcome::Rejected, rejection.into_response()),
    };
    let route = rule.pattern();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let fingerprint = fingerprint(
        &RequestParts {
            method: parts.method.as_str(),
            route,
            path_params: &[("path", parts.uri.path())],
            query: parts.uri.query(),
            content_type,
            body: &bytes,
        },
        &FingerprintSpec::default(),
    );
    let id = gw
        .hasher
        .record_id(&Scope::new(tenant, parts.method.as_str(), route), &key);
    let span = tracing::info_span!("idempotency", key_id = %id.key_id(), route = %id.route);
    let sealed_key = Some(gw.sealer.seal(key.as_str(), &id.key_hash));
    let claim = Claim {
        id,
        fingerprint,
        now: Timestamp::now(),
        retention: gw.options.retention,
        sealed_key,
    };
    owned_flow(gw.clone(), key, parts, bytes, claim, started)
        .instrument(span)
        .await
}

/// Reserves the key and, when this attempt owns it, forwards the request and records what
/// came back.
async fn owned_flow<S: AppDb>(
    gw: Gateway<S>,
    key: IdempotencyKey,
    parts: Parts,
    bytes: Bytes,
    mut claim: Claim,
    started: Instant,
) -> Response {
    let finish = |outcome: Outcome, response: Response| {
        gw.metrics.record(outcome, started.elapsed());
        response
    };
    let lease_time = gw.options.lease;

    // The reservation; under `wait`, poll a record held by another attempt until it settles.
    let reserved = reserve_waiting(&gw.store, &mut claim, lease_time, gw.options.in_flight).await;
    let (token, expires_at) = match reserved {
        Ok(ClaimOutcome::Owned { token, expires_at }) => (token, expires_at),
        Ok(other) => {
            let (outcome, response) = answer_claim(other, &key);
            return finish(outcome, response);
        }
        Err(protocol::Error::Store(e)) => {
            return finish(Outcome::StoreError, store_unavailable(&e));
        }
        Err(e) => {
            tracing::error!(error = %e, "reservation failed");
            return finish(
                Outcome::StoreError,
                IdempotencyRejection::Internal.into_response(),
            );
        }
    };
    let lease = Lease::new(gw.store.clone(), claim.id.clone(), token, lease_time);
    let renewal = keep_alive(lease.clone(), lease_time / 3);
    if !gw.options.simulate_delay_before_forward.is_zero() {
        tokio::time::sleep(gw.options.simulate_delay_before_forward).await;
    }

    // Nothing has been sent yet: a failed connect frees the key.
    let stream = match connect(&gw).await {
        Ok(stream) => stream,
        Err(e) => {
            drop(renewal);
            tracing::warn!(error = %e, "upstream unreachable; releasing the key");
            if let Err(e) = settle("releasing the key", || lease.clone().release()).await {
                tracing::warn!(error = %e, "could not release the key; it frees itself when the lease lapses");
            }
            return finish(
                Outcome::NotStored,
                IdempotencyRejection::UpstreamUnavailable {
                    retry_after: RETRY_AFTER,
                }
                .into_response(),
            );
        }
    };
    match lease.point_of_no_return().await {
        Ok(()) => {}
        Err(protocol::Error::Fenced) => {
            // The lease lapsed and another attempt took over; it will do the work.
            return finish(
                Outcome::InFlight,
                IdempotencyRejection::InFlight {
                    retry_after: RETRY_AFTER,
                }
                .into_response(),
            );
        }
        Err(e) => {
            drop(renewal);
            tracing::warn!(error = %e, "cannot mark the point of no return; nothing was sent");
            let _ = lease.clone().release().await;
            return finish(
                Outcome::StoreError,
                match e {
                    protocol::Error::Store(e) => store_unavailable(&e),
                    _ => IdempotencyRejection::Internal.into_response(),
                },
            );
        }
    }

    // The point of no return: from here the effect may happen.
    let mut req = upstream_request(&gw, &parts, Body::from(bytes.clone()));
    req.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    let answer = exchange(&gw, stream, req).await;
    drop(renewal);
    let (head, body) = match answer {
        Upstreamed::Answer(head, body) => (head, body),
        Upstreamed::Unknown(reason) => {
            tracing::warn!(%reason, "sent upstream, no complete answer: the outcome is unknown");
            if let Err(e) = settle("marking the outcome unknown", || {
                lease.clone().indeterminate()
            })
            .await
            {
                tracing::warn!(error = %e, "could not mark the outcome unknown; the lapsed lease will");
            }
            gw.metrics.marked_indeterminate();
            return finish(
                Outcome::Indeterminate,
                IdempotencyRejection::UpstreamOutcomeUnknown {
                    status_url: status_url(&key),
                }
                .into_response(),
            );
        }
    };
    if head.status.is_server_error() && !gw.options.store_5xx {
        if let Err(e) = settle("releasing the key", || lease.clone().release()).await {
            tracing::warn!(error = %e, "could not release the key after an upstream 5xx");
        }
        return finish(Outcome::NotStored, downstream(head, Body::from(body)));
    }
    let stored = StoredResponse {
        status: head.status.as_u16(),
        headers: stored_headers(&head.headers, &[]),
        body: body.to_vec(),
    };
    match settle("storing the outcome", || lease.clone().complete(&stored)).await {
        Ok(()) => {
            let mut response = downstream(head, Body::from(body));
            add_expiry(response.headers_mut(), expires_at);
            finish(Outcome::Executed, response)
        }
        Err(e) => {
            // A newer owner or an operator settled the record first (fenced), or the store
            // is gone: this attempt's answer is still the truth for this attempt.
            tracing::warn!(error = %e, "the upstream's answer could not be stored");
            finish(Outcome::NotStored, downstream(head, Body::from(body)))
        }
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
