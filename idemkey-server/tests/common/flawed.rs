//! Keyed `POST /orders` servers, in memory and in the test process, that `idemkey check` is
//! tested against: a correct reference ([`Flaw::Correct`]), variants of it with one flaw
//! each, which the check named for the flaw must fail, and variants that answer otherwise than
//! the reference in ways the rules allow, which must not fail.
//!
//! Every execution works until another attempt has looked its key up (at most [`WORK`]: the
//! work of a lone request), so a retry or a race meets it running whatever the timing; it
//! counts one effect (read at
//! `GET /effects` as a JSON number) and answers `201` with a body holding a fresh order id, so
//! two executions are told apart by their bodies. Keys follow the contract of the layer:
//! `Idempotency-Key` required and parsed by [`IdempotencyKey`], scoped by the caller's
//! `Authorization`, the fingerprint the body as JSON (member order and whitespace aside), a
//! replay the stored bytes with `Idempotent-Replayed: true`, `422` for the key with another
//! body and `409` with `Retry-After` while the first attempt runs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use idemkey_core::{HEADER_NAME, IdempotencyKey, KeyError, Mismatch, problem};
use idemkey_tower::{IdempotencyRejection, problem_response};
use serde_json::{Value, json};
use tokio::sync::Notify;

/// How long one execution works when no other attempt comes (the server's simulated work).
const WORK: Duration = Duration::from_millis(200);
/// [`Flaw::CheckThenInsert`]: how long an attempt waits between looking the key up and
/// inserting it when no other attempt comes.
const CHECK_GAP: Duration = Duration::from_millis(100);
/// The `Retry-After` of the in-flight answer.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Which server: the reference, the reference with one flaw, or with one difference the rules
/// allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flaw {
    /// No flaw: the reference.
    Correct,
    /// Looks the key up, works a while, then inserts it: attempts that arrive together all
    /// find it free and all execute.
    CheckThenInsert,
    /// A retry after the first attempt completed executes again.
    NoReplay,
    /// The body is not compared: another body with the same key gets the first answer.
    NoFingerprint,
    /// A replay is the answer re-serialized (pretty-printed): equal as JSON, other bytes.
    ReplayOtherBytes,
    /// No in-flight detection: a retry while the first attempt runs executes again; only a
    /// completed record replays.
    RunsWhileInFlight,
    /// Keys are not scoped by caller: another caller's key answers with the first caller's
    /// answer.
    SharedKeys,
    /// A request without a key executes anyway, unprotected.
    KeyOptional,
    /// A replay answers the first body with `409` instead of its `201` (as
    /// django-idempotency-key does by default).
    ReplayAsConflict,
    /// Not a flaw: a retry while the first attempt runs is answered `423 Locked` (as
    /// django-idempotency-key's lock answers it) instead of `409`.
    LockedWhileInFlight,
    /// Not a flaw under the IETF draft, which sets no length: a key longer than 255 characters
    /// is taken as it is sent (Stripe's rules refuse it).
    LongKeysAccepted,
}

/// What is kept per (caller, key).
enum Record {
    /// The first attempt is running.
    Running { fingerprint: Value },
    /// The first attempt answered `201` with `body`.
    Done { fingerprint: Value, body: Bytes },
}

impl Record {
    fn fingerprint(&self) -> &Value {
        match self {
            Self::Running { fingerprint } | Self::Done { fingerprint, .. } => fingerprint,
        }
    }
}

/// One server's state.
struct Orders {
    flaw: Flaw,
    records: Mutex<HashMap<(String, String), Record>>,
    executions: AtomicU64,
    /// Told each time an attempt has looked its key up: the work under way (and
    /// [`Flaw::CheckThenInsert`]'s gap) ends then, once the other attempt's answer is decided.
    looked_up: Notify,
}

/// Starts the server with `flaw` on `127.0.0.1:0`; returns its base URL (`http://127.0.0.1:port`).
/// It serves until the test's runtime ends.
pub(crate) async fn start(flaw: Flaw) -> String {
    let orders = Arc::new(Orders {
        flaw,
        records: Mutex::default(),
        executions: AtomicU64::new(0),
        looked_up: Notify::new(),
    });
    let app = Router::new()
        .route("/orders", post(create_order))
        .route("/effects", get(effects))
        .with_state(orders);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// `GET /effects`: the executions so far.
async fn effects(State(orders): State<Arc<Orders>>) -> Json<u64> {
    Json(orders.executions.load(Ordering::SeqCst))
}

/// `POST /orders`. The work runs to its end in a task of its own, as a server's does when the
/// client goes away.
async fn create_order(
    State(orders): State<Arc<Orders>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    tokio::spawn(orders.handle(headers, body))
        .await
        .unwrap_or_else(|_| IdempotencyRejection::Internal.into_response())
}

impl Orders {
    async fn handle(self: Arc<Self>, headers: HeaderMap, body: Bytes) -> Response {
        let fields = headers
            .get_all(HEADER_NAME)
            .iter()
            .map(HeaderValue::as_bytes);
        let key = match IdempotencyKey::from_fields(fields) {
            Ok(Some(key)) => Some(key.as_str().to_owned()),
            Ok(None) if self.flaw == Flaw::KeyOptional => None,
            Ok(None) => return IdempotencyRejection::KeyMissing.into_response(),
            Err(KeyError::TooLong { .. }) if self.flaw == Flaw::LongKeysAccepted => headers
                .get(HEADER_NAME)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            Err(e) => return IdempotencyRejection::KeyInvalid(e).into_response(),
        };
        let Ok(request) = serde_json::from_slice::<Value>(&body) else {
            let detail = "the request body is not JSON".to_owned();
            return problem_response(
                &problem::REQUEST_UNREADABLE,
                detail,
                Default::default(),
                None,
                None,
            );
        };
        let Some(key) = key else {
            return created(self.execute(&request).await, false);
        };
        let caller = match (self.flaw, headers.get(header::AUTHORIZATION)) {
            (Flaw::SharedKeys, _) | (_, None) => String::new(),
            (_, Some(value)) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
        };
        let id = (caller, key);
        let answer = self.look_up(&id, &request);
        self.looked_up.notify_waiters();
        if let Some(answer) = answer {
            return answer;
        }
        if self.flaw == Flaw::CheckThenInsert {
            self.until_another_looks_up(CHECK_GAP).await;
            self.records().insert(
                id.clone(),
                Record::Running {
                    fingerprint: request.clone(),
                },
            );
        }
        let body = self.execute(&request).await;
        self.records().insert(
            id,
            Record::Done {
                fingerprint: request,
                body: body.clone(),
            },
        );
        created(body, false)
    }

    /// The answer the record of `id` gives, or `None` when this attempt is to execute (then
    /// claimed as running, except by [`Flaw::CheckThenInsert`], which claims later).
    fn look_up(&self, id: &(String, String), request: &Value) -> Option<Response> {
        let mut records = self.records();
        match records.get(id) {
            Some(record) if self.flaw != Flaw::NoFingerprint && record.fingerprint() != request => {
                let mismatch = Mismatch {
                    body: true,
                    ..Mismatch::default()
                };
                Some(IdempotencyRejection::KeyReused(mismatch).into_response())
            }
            Some(Record::Done { body, .. }) if self.flaw == Flaw::ReplayAsConflict => Some(
                (
                    StatusCode::CONFLICT,
                    [(header::CONTENT_TYPE, "application/json")],
                    body.clone(),
                )
                    .into_response(),
            ),
            Some(Record::Done { body, .. }) if self.flaw != Flaw::NoReplay => {
                Some(created(self.replayed(body), true))
            }
            Some(Record::Running { .. }) if self.flaw == Flaw::LockedWhileInFlight => Some(
                (
                    StatusCode::LOCKED,
                    Json(json!({ "error": "the first request with this key is running" })),
                )
                    .into_response(),
            ),
            Some(Record::Running { .. }) if self.flaw != Flaw::RunsWhileInFlight => Some(
                IdempotencyRejection::InFlight {
                    retry_after: RETRY_AFTER,
                }
                .into_response(),
            ),
            _ => {
                if self.flaw != Flaw::CheckThenInsert {
                    let fingerprint = request.clone();
                    records.insert(id.clone(), Record::Running { fingerprint });
                }
                None
            }
        }
    }

    /// The bytes a replay answers: the stored ones, or, [`Flaw::ReplayOtherBytes`], the same
    /// JSON pretty-printed.
    fn replayed(&self, body: &Bytes) -> Bytes {
        match self.flaw {
            Flaw::ReplayOtherBytes => serde_json::from_slice::<Value>(body)
                .and_then(|v| serde_json::to_vec_pretty(&v))
                .map_or_else(|_| body.clone(), Bytes::from),
            _ => body.clone(),
        }
    }

    /// One execution: the work, one effect counted, a new order.
    async fn execute(&self, request: &Value) -> Bytes {
        self.until_another_looks_up(WORK).await;
        let n = self.executions.fetch_add(1, Ordering::SeqCst) + 1;
        Bytes::from(json!({ "id": format!("ord_{n}"), "order": request }).to_string())
    }

    /// Waits until another attempt has looked its key up, or `bound` (a lone request's work)
    /// has passed.
    async fn until_another_looks_up(&self, bound: Duration) {
        let _ = tokio::time::timeout(bound, self.looked_up.notified()).await;
    }

    fn records(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Record>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A `201` with `body` as JSON, marked replayed when it is one.
fn created(body: Bytes, replayed: bool) -> Response {
    let mut response = (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response();
    if replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}
