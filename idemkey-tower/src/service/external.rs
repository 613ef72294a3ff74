//! External mode: the owner flow after a reservation, for effects the store cannot share a
//! transaction with. `idemkey gateway` is this flow plus a proxy handler.
//!
//! Steps 1 to 3 run on a task of their own, from just before the reservation: a client that
//! hangs up (its server drops the layer's future) cannot strand a committed reservation
//! that nobody owns, nor stop the owner between the point of no return and the recorded
//! outcome; its answer is stored for its retry. Only a wait for another process's owner
//! (step 1's polling) ends when the client goes.
//!
//! 1. Reserve the key with a lease; with
//!    [`point_of_no_return_at_reservation`](crate::IdempotencyLayer::point_of_no_return_at_reservation),
//!    the reservation marks the point of no return too. Under `wait`, attempts of one
//!    record in this process take turns first (`crate::coalesce`): the owner holds the turn
//!    until its outcome is written and cached, and the others wait for it in memory, then
//!    find the outcome in the replay cache. Only the attempt holding the turn polls a
//!    reservation held by another process, until its owner finishes or the bound passes.
//! 2. Run the handler with an [`External`] handle while the lease is renewed.
//! 3. Ask [`after_effect`] what becomes of the record, given how far the handler got
//!    ([`owner_progress`]) and the route's [`AnswerRule`](idemkey_core::AnswerRule) (an
//!    answer to store that cannot be read whole: [`answer_not_captured`]), and write that
//!    with the fencing token: complete, release, or mark indeterminate. A write the store
//!    refuses is retried, then logged and counted (`idemkey_owner_write_failures_total`); the
//!    lease is the backstop.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use http::Request;
use idemkey_core::protocol::{self, Claim, ClaimOutcome, Lease};
use idemkey_core::{AfterEffect, Clock, Store, after_effect, answer_not_captured, owner_progress};
use tokio::sync::oneshot;
use tower_service::Service;
use tracing::Instrument;

use super::stored::{Captured, add_expiry, capture_outcome, status_url};
use super::{Keyed, call, store_unavailable};
use crate::coalesce::TurnGuard;
use crate::external::{External, Flags};
use crate::metrics::Outcome;
use crate::mode::{self, Mode};
use crate::{IdempotencyRejection, InFlightPolicy};

/// How often a waiting attempt looks at a reservation held by another process's attempt.
const POLL: Duration = Duration::from_millis(50);

/// How many times an owner's final write is tried.
const WRITE_ATTEMPTS: usize = 5;

pub(super) async fn run<S, M, I>(
    keyed: Keyed<S, M>,
    inner: I,
    req: Request<Body>,
    claim: Claim,
    mode: mode::External,
    turn: Option<TurnGuard>,
    wait_left: Option<Duration>,
) -> Response
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    // From the reservation on, the attempt runs on a task of its own: a client that hangs
    // up (its server drops this future) cannot leave a reservation committed that nobody
    // owns, nor stop the owner. The answer comes back on `answer`, whose receiver goes with
    // the client.
    let (mut answer, answered) = oneshot::channel();
    tokio::spawn(
        async move {
            let response = attempt(keyed, inner, req, claim, mode, wait_left, &mut answer).await;
            // This process's other attempts wake once the outcome is written and cached.
            drop(turn);
            let _ = answer.send(response);
        }
        .in_current_span(),
    );
    answered.await.unwrap_or_else(|_| {
        tracing::error!("the owner's task failed");
        IdempotencyRejection::Internal.into_response()
    })
}

/// Reserves, then owns what it reserved to the end, whether the client waits or not.
async fn attempt<S, M, I>(
    keyed: Keyed<S, M>,
    inner: I,
    req: Request<Body>,
    mut claim: Claim,
    mode: mode::External,
    wait_left: Option<Duration>,
    client: &mut oneshot::Sender<Response>,
) -> Response
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let store = keyed.layer.store.clone();
    let reserved = reserve_waiting(&keyed, &mut claim, &mode, wait_left, client).await;
    let (token, expires_at) = match reserved {
        Ok(ClaimOutcome::Owned { token, expires_at }) => (token, expires_at),
        Ok(other) => return keyed.answer_existing(other, &claim.id, &claim.fingerprint),
        Err(protocol::Error::Store(e)) => {
            return keyed.finish(Outcome::StoreError, store_unavailable(&e));
        }
        Err(e) => {
            tracing::error!(error = %e, "reservation failed");
            return keyed.finish(Outcome::StoreError, IdempotencyRejection::Internal);
        }
    };
    let mut lease =
        Lease::new(store, claim.id, token, mode.lease).with_clock(keyed.config.clock.clone());
    if mode.marked_at_reservation {
        lease = lease.marked_at_reservation(claim.now);
    }
    own(keyed, inner, req, lease, claim.fingerprint, expires_at).await
}

/// Reserves `claim` with a lease. Under [`InFlightPolicy::Wait`], a reservation held by
/// another attempt (of another process: this process's wait in memory for their turn) is
/// polled until its owner finishes or the bound passes (`wait_left` of it, after a wait for
/// the turn), or the `client` has gone; then the last answer stands (`InFlight`). Each read
/// runs to its end: one that reserves is owned whether the client waits or not.
async fn reserve_waiting<S: Store, M: Mode>(
    keyed: &Keyed<S, M>,
    claim: &mut Claim,
    mode: &mode::External,
    wait_left: Option<Duration>,
    client: &mut oneshot::Sender<Response>,
) -> protocol::Result<ClaimOutcome> {
    let clock = &keyed.config.clock;
    claim.now = clock.now();
    let deadline = match keyed.config.in_flight {
        InFlightPolicy::Wait(bound) => Some(clock.now().plus(wait_left.unwrap_or(bound))),
        InFlightPolicy::Reject => None,
    };
    loop {
        let store = &keyed.layer.store;
        let outcome = if mode.marked_at_reservation {
            protocol::reserve_at_point_of_no_return(store, claim, mode.lease).await?
        } else {
            protocol::reserve(store, claim, mode.lease).await?
        };
        match (&outcome, deadline) {
            (ClaimOutcome::InFlight { .. }, Some(deadline))
                if clock.now().plus(POLL) < deadline =>
            {
                tokio::select! {
                    () = clock.sleep(POLL) => {}
                    // Nobody waits for the answer: the turn goes to whoever does.
                    () = client.closed() => return Ok(outcome),
                }
                claim.now = clock.now();
            }
            _ => return Ok(outcome),
        }
    }
}

/// What the owner holds once the handler is done.
enum Answer {
    /// Read whole, to be stored.
    Captured(Captured),
    /// Passed on as it is.
    Plain(Response),
}

/// The owner: runs the handler, decides, writes the decision.
async fn own<S, M, I>(
    keyed: Keyed<S, M>,
    inner: I,
    mut req: Request<Body>,
    lease: Lease<S>,
    fingerprint: idemkey_core::Fingerprint,
    expires_at: idemkey_core::Timestamp,
) -> Response
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let config = keyed.config.clone();
    let clock = &*config.clock;
    let renewal = keep_alive(lease.clone(), lease.duration() / 3, config.clock.clone());
    let flags = Arc::new(Flags::default());
    req.extensions_mut().insert(External {
        lease: lease.clone(),
        flags: flags.clone(),
        status_url: status_url(&keyed.key).into(),
    });
    let result = AssertUnwindSafe(call(inner, req)).catch_unwind().await;
    let (status, response) = match result {
        Err(_panic) => (None, IdempotencyRejection::Internal.into_response()),
        Ok(response) => (Some(response.status().as_u16()), response),
    };
    let progress = owner_progress(flags.sent(), flags.unknown(), status);
    let (decision, answer) = match after_effect(progress, &config.answers) {
        AfterEffect::Complete => match capture_outcome(response, &config).await {
            Ok(captured) => (AfterEffect::Complete, Answer::Captured(captured)),
            // An answer that cannot be stored is known to this attempt only; the call went
            // out, so the operation is left indeterminate and the answer links its status.
            Err(_too_large) => {
                let rejection = IdempotencyRejection::ResponseTooLarge {
                    limit: config.max_stored_response,
                    status_url: Some(status_url(&keyed.key)),
                };
                let decision = answer_not_captured(progress);
                (decision, Answer::Plain(rejection.into_response()))
            }
        },
        other => (other, Answer::Plain(response)),
    };
    drop(renewal);
    if decision == AfterEffect::Indeterminate {
        config.metrics.marked_indeterminate();
    }
    let written = match (&decision, &answer) {
        (AfterEffect::Complete, Answer::Captured(c)) => {
            persist(clock, "storing the outcome", || lease.complete(&c.stored)).await
        }
        (AfterEffect::Indeterminate, _) => {
            persist(clock, "marking the outcome unknown", || {
                lease.mark_indeterminate()
            })
            .await
        }
        _ => persist(clock, "releasing the key", || lease.release()).await,
    };
    match &written {
        Ok(()) => {}
        Err(protocol::Error::Fenced) => tracing::info!(
            write = %decision,
            "a newer owner or an operator holds the record now; this owner's write was refused"
        ),
        Err(e) => {
            tracing::warn!(error = %e, write = %decision, "the owner's last write failed; the record is left to its lease");
            config.metrics.owner_write_failed(decision);
        }
    }
    if let (AfterEffect::Complete, Ok(()), Answer::Captured(c)) = (&decision, &written, &answer) {
        keyed.cache_completed(lease.id(), &fingerprint, &c.stored, expires_at);
    }
    let outcome = match decision {
        AfterEffect::Complete if written.is_ok() => Outcome::Executed,
        AfterEffect::Indeterminate => Outcome::Indeterminate,
        _ => Outcome::NotStored,
    };
    // The record stays (completed or indeterminate) when its write went through: then this
    // attempt's answer carries its expiry too, like every later answer from that record.
    let kept = (written.is_ok() && decision != AfterEffect::Release).then_some(expires_at);
    let response = match answer {
        // This attempt's answer is the truth for this attempt, stored or not.
        Answer::Captured(c) => c.into_response(kept),
        Answer::Plain(mut response) => {
            if let Some(expires_at) = kept {
                add_expiry(response.headers_mut(), expires_at);
            }
            response
        }
    };
    keyed.finish(outcome, response)
}

/// Keeps a lease alive while its owner works; renewal stops when this is dropped.
struct Renewal(tokio::task::JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews `lease` every `every` of `clock` until the returned [`Renewal`] is dropped, or
/// until a newer owner took the record over.
fn keep_alive<S: Store>(lease: Lease<S>, every: Duration, clock: Arc<dyn Clock>) -> Renewal {
    Renewal(tokio::spawn(async move {
        loop {
            clock.sleep(every).await;
            match lease.renew().await {
                Ok(()) => {}
                Err(protocol::Error::Fenced) => {
                    tracing::warn!(key_id = %lease.id().key_id(), "lease lost to a newer owner");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "lease renewal failed; will try again"),
            }
        }
    }))
}

/// Retries a write that records what already happened, on store errors (a busy SQLite, a
/// blip): giving up early would turn a known outcome into an unknown one. The pauses
/// between attempts are `clock`'s.
async fn persist<F, Fut>(clock: &dyn Clock, what: &str, mut write: F) -> protocol::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = protocol::Result<()>>,
{
    let mut pause = Duration::from_millis(50);
    let mut last = None;
    for _ in 0..WRITE_ATTEMPTS {
        match write().await {
            Err(protocol::Error::Store(e)) => {
                tracing::warn!(error = %e, "{what} failed; trying again");
                last = Some(e);
                clock.sleep(pause).await;
                pause *= 2;
            }
            other => return other,
        }
    }
    Err(protocol::Error::Store(last.expect("at least one attempt")))
}
