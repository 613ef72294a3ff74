//! Local mode: the claim, the handler's effect and the stored answer in one transaction.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use http::Request;
use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{AfterEffect, CommitError, Store, StoreError, local_after_effect};
use tokio::sync::Mutex;
use tower_service::Service;

use super::stored::capture_outcome;
use super::{Keyed, call, store_unavailable};
use crate::metrics::Outcome;
use crate::mode::Mode;
use crate::tx::{Slot, TxSlot};
use crate::{IdempotencyLayer, IdempotencyRejection, InFlightPolicy};

impl<S: Store, M: Mode> Keyed<S, M> {
    /// What answers a request whose first attempt is too old for its record to be trusted to
    /// exist, claiming nothing that lasts; `None`: nothing does, refuse it. In external mode
    /// the record as read; in local mode an attempt of the key still running (in this
    /// process: at the store; elsewhere: its uncommitted claim, met by [`protocol::probe`])
    /// answers 409 `request-in-flight` at once, as a reservation does.
    pub(super) async fn look_up_late(
        &self,
        claim: &Claim,
    ) -> Result<Option<ClaimOutcome>, Response> {
        if self.layer.mode.external().is_some() {
            return self.look_up(&claim.id, claim).await;
        }
        // Not a turn of its own: late attempts of one key judged at once do not wait for
        // each other, and none of them is in flight.
        if self.config.turns.going(claim.id.digest()) {
            return Ok(Some(ClaimOutcome::InFlight {
                lease_expires_at: None,
                expires_at: None,
            }));
        }
        self.found(protocol::probe(&self.layer.store, claim)).await
    }

    /// The record another attempt committed for the key while this attempt's transaction
    /// failed or rolled back, as this attempt's retry would find it. Where the claim's row
    /// lock keeps every other attempt out until this one ends (PostgreSQL, SQLite, a single
    /// MySQL server) there is none; on a Galera cluster two nodes' attempts of one key run at
    /// once and certification commits one: the loser's transaction fails (error 1213 at
    /// `COMMIT`, or at a statement of the handler's before it), and it answers with the
    /// winner's record instead of its own failure. `None` also when the read fails: the
    /// attempt's own answer stands.
    async fn committed_by_another(&self, claim: &Claim) -> Option<ClaimOutcome> {
        let read = protocol::lookup(
            &self.layer.store,
            &claim.id,
            &claim.fingerprint,
            claim.first_sent,
            claim.now,
        );
        read.await.ok().flatten()
    }
}

/// Claims the key in a new transaction, runs the handler on it, and stores its answer in it
/// when the route's rule says so (then commits; otherwise rolls back: no record, no effect).
pub(super) async fn run<S, M, I>(
    keyed: Keyed<S, M>,
    inner: I,
    req: Request<Body>,
    claim: Claim,
    wait_left: Option<Duration>,
) -> Response
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let store = keyed.layer.store.clone();
    let config = keyed.config.clone();
    // What is left of the in-flight bound after waiting for this process's other attempts
    // (never zero: PostgreSQL reads a zero lock time-out as "wait forever").
    let wait = match config.in_flight {
        InFlightPolicy::Wait(bound) => {
            let left = wait_left.unwrap_or(bound).max(Duration::from_millis(1));
            (left != InFlightPolicy::DEFAULT_WAIT).then_some(left)
        }
        InFlightPolicy::Reject => Some(Duration::from_millis(1)),
    };
    let (tx, outcome) = match protocol::begin_claim(&store, &claim, wait).await {
        Ok(begun) => begun,
        Err(protocol::Error::Store(e)) => {
            return keyed.finish(Outcome::StoreError, store_unavailable(&e));
        }
        Err(e) => {
            tracing::error!(error = %e, "claim failed");
            return keyed.finish(Outcome::StoreError, IdempotencyRejection::Internal);
        }
    };
    let (token, mut tx) = match (outcome, tx) {
        (ClaimOutcome::Owned { token, .. }, Some(tx)) => (token, tx),
        (other, tx) => {
            // Nothing of the caller's was written; committing keeps a possible
            // `indeterminate` mark the claim left.
            if let Some(tx) = tx {
                let _ = store.commit(tx).await;
            }
            return keyed.answer_existing(other, &claim.id, &claim.fingerprint);
        }
    };
    if wait.is_some() {
        // The bound was for the claim; the handler's own statements get the default.
        if let Err(e) = store
            .limit_lock_wait(&mut tx, InFlightPolicy::DEFAULT_WAIT)
            .await
        {
            return keyed.finish(Outcome::StoreError, store_unavailable(&e));
        }
    }
    let expires_at = claim.now.plus(config.retention);

    let operation = hex::encode(claim.id.digest());
    let (response, tx) = match run_handler::<S, I>(inner, req, tx, operation).await {
        Ok((response, tx)) => (response, Some(tx)),
        Err(rejection) => (rejection.into_response(), None),
    };
    // In one transaction nothing can be half done: what is not stored rolls back.
    let status = response.status().as_u16();
    let tx = match (
        local_after_effect(status, tx.is_some(), &config.answers),
        tx,
    ) {
        (AfterEffect::Complete, Some(tx)) => tx,
        (_, tx) => {
            drop(tx);
            if response.status().is_server_error()
                && let Some(outcome) = keyed.committed_by_another(&claim).await
            {
                return keyed.answer_existing(outcome, &claim.id, &claim.fingerprint);
            }
            return keyed.finish(Outcome::NotStored, response);
        }
    };
    // An answer to store that cannot be read whole leaves nothing the transaction can commit.
    let captured = capture_outcome(response, &config).await;
    let captured = match (
        local_after_effect(status, captured.is_ok(), &config.answers),
        captured,
    ) {
        (AfterEffect::Complete, Ok(captured)) => captured,
        (_, answer) => {
            drop(tx);
            let answer = match answer {
                Ok(captured) => captured.into_response(None),
                Err(rejection) => rejection.into_response(),
            };
            return keyed.finish(Outcome::NotStored, answer);
        }
    };
    let done = store
        .complete_and_commit(tx, &claim.id, token, &captured.stored, config.clock.now())
        .await;
    if let Err(e) = done {
        let answer = match e {
            CommitError::NotCommitted(e @ StoreError::Busy(_)) => {
                match keyed.committed_by_another(&claim).await {
                    Some(outcome) => {
                        return keyed.answer_existing(outcome, &claim.id, &claim.fingerprint);
                    }
                    None => store_unavailable(&e),
                }
            }
            CommitError::NotCommitted(e) => {
                tracing::error!(error = %e, "storing the response failed");
                store_unavailable(&e)
            }
            CommitError::Unknown(e) => {
                // The commit may or may not have happened; a retry replays or runs afresh.
                tracing::warn!(error = %e, "committing the outcome failed; the outcome is unknown");
                IdempotencyRejection::CommitUnknown {
                    retry_after: super::RETRY_AFTER,
                }
                .into_response()
            }
            e => {
                tracing::error!(error = %e, "storing the response failed");
                IdempotencyRejection::Internal.into_response()
            }
        };
        return keyed.finish(Outcome::StoreError, answer);
    }
    keyed.cache_completed(&claim.id, &claim.fingerprint, &captured.stored, expires_at);
    keyed.finish(Outcome::Executed, captured.into_response(Some(expires_at)))
}

/// An operation id for a transaction without a record: unique within the process and
/// unlikely to meet another process's (it only orders the transaction's outbox messages).
fn unkeyed_operation() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("tx-{}-{started:x}-{n}", std::process::id())
}

/// Runs the handler with `tx` in its request; returns the response and the transaction
/// back, or the answer to give when the handler panicked or kept the transaction.
async fn run_handler<S, I>(
    inner: I,
    mut req: Request<Body>,
    tx: S::Transaction,
    operation: String,
) -> Result<(Response, S::Transaction), IdempotencyRejection>
where
    S: Store,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let slot: Slot<S> = Arc::new(Mutex::new(Some(tx)));
    req.extensions_mut().insert(TxSlot::<S> {
        slot: slot.clone(),
        operation: operation.into(),
    });
    let response = AssertUnwindSafe(call(inner, req))
        .catch_unwind()
        .await
        // The transaction is dropped with the slot: rolled back.
        .map_err(|_| IdempotencyRejection::Internal)?;
    // The handler is done, so its guard is gone, unless it moved the `Tx` somewhere that
    // outlives it: then nothing can be committed safely.
    let tx = slot.try_lock().ok().and_then(|mut guard| guard.take());
    tx.map(|tx| (response, tx))
        .ok_or(IdempotencyRejection::TransactionUnavailable)
}

/// A request without a key (on an `optional` or `off` route): the handler still gets a
/// transaction, committed under the same rule as keyed requests.
pub(super) async fn unkeyed<S, M, I>(
    layer: IdempotencyLayer<S, M>,
    inner: I,
    req: Request<Body>,
) -> Response
where
    S: Store,
    M: Mode,
    I: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    I::Future: Send + 'static,
{
    let tx = match layer.store.begin().await {
        Ok(tx) => tx,
        Err(e) => return store_unavailable(&e),
    };
    let (response, tx) = match run_handler::<S, I>(inner, req, tx, unkeyed_operation()).await {
        Ok(done) => done,
        Err(rejection) => return rejection.into_response(),
    };
    let stored = local_after_effect(response.status().as_u16(), true, &layer.config.answers);
    if stored == AfterEffect::Complete
        && let Err(e) = layer.store.commit(tx).await
    {
        return store_unavailable(&e);
    }
    response
}
