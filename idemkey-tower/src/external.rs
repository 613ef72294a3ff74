//! External mode: for effects the store cannot share a transaction with (a call to a bank,
//! another service). The claim commits at once as a reservation with a lease; the handler
//! marks the point of no return just before it calls out; the layer completes the record
//! with the fencing token, or leaves it indeterminate when the outcome cannot be known.
//!
//! The reservation wait, the lease renewal and the retried settling writes here are shared
//! with `idemkey gateway`.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use http::request::Parts;
use idemkey_core::Store;
use idemkey_core::protocol::{self, Claim, ClaimOutcome, Lease};

use crate::{IdempotencyRejection, InFlightPolicy};

/// How often a waiting attempt looks at a reservation held by another attempt.
const POLL: Duration = Duration::from_millis(50);

/// How many times a write that records what already happened is tried.
const SETTLE_ATTEMPTS: usize = 5;

/// Reserves `claim` with a lease. Under [`InFlightPolicy::Wait`], a reservation held by
/// another attempt is polled until it settles or the bound passes; then the last answer
/// stands (`InFlight`).
pub async fn reserve_waiting<S: Store>(
    store: &S,
    claim: &mut Claim,
    lease: Duration,
    policy: InFlightPolicy,
) -> protocol::Result<ClaimOutcome> {
    let started = Instant::now();
    loop {
        claim.now = idemkey_core::Timestamp::now();
        let outcome = protocol::reserve(store, claim, lease).await?;
        match (&outcome, policy) {
            (ClaimOutcome::InFlight { .. }, InFlightPolicy::Wait(bound))
                if started.elapsed() + POLL < bound =>
            {
                tokio::time::sleep(POLL).await;
            }
            _ => return Ok(outcome),
        }
    }
}

/// Keeps a lease alive while its owner works; renewal stops when this is dropped.
#[derive(Debug)]
pub struct Renewal(tokio::task::JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews `lease` every `every` until the returned [`Renewal`] is dropped, or until a newer
/// owner took the record over.
pub fn keep_alive<S: Store>(lease: Lease<S>, every: Duration) -> Renewal {
    Renewal(tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
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
/// blip): giving up early would turn a known outcome into an unknown one.
pub async fn settle<F, Fut>(what: &str, mut write: F) -> protocol::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = protocol::Result<()>>,
{
    let mut pause = Duration::from_millis(50);
    let mut last = None;
    for _ in 0..SETTLE_ATTEMPTS {
        match write().await {
            Err(protocol::Error::Store(e)) => {
                tracing::warn!(error = %e, "{what} failed; trying again");
                last = Some(e);
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            other => return other,
        }
    }
    Err(protocol::Error::Store(last.expect("at least one attempt")))
}

#[derive(Debug, Default)]
pub(crate) struct Flags {
    pub(crate) past_point_of_no_return: AtomicBool,
    pub(crate) outcome_unknown: AtomicBool,
}

/// The handler's side of an external-mode claim (a route built with
/// [`IdempotencyLayer::external`](crate::IdempotencyLayer::external)).
///
/// Call [`point_of_no_return`](Self::point_of_no_return) just before the request leaves for
/// the other service, and [`outcome_unknown`](Self::outcome_unknown) when it timed out or the
/// connection broke after that. The layer then stores the response the handler returns, or
/// marks the operation indeterminate (never re-executed on its own) when the outcome is
/// unknown, or when the handler fails after the point of no return. Before the point of no
/// return, a failure frees the key.
///
/// ```no_run
/// use idemkey_sqlite::SqliteStore;
/// use idemkey_tower::External;
/// use http::StatusCode;
///
/// async fn transfer(op: External<SqliteStore>) -> (StatusCode, String) {
///     if let Err(rejection) = op.point_of_no_return().await {
///         return (rejection.status(), rejection.to_string());
///     }
///     match call_the_bank(op.key_id()).await {
///         Ok(receipt) => (StatusCode::CREATED, receipt),
///         Err(_timeout) => {
///             op.outcome_unknown();
///             (StatusCode::GATEWAY_TIMEOUT, "the bank did not answer".into())
///         }
///     }
/// }
/// # async fn call_the_bank(_: String) -> Result<String, ()> { Ok(String::new()) }
/// ```
pub struct External<S: Store> {
    pub(crate) lease: Lease<S>,
    pub(crate) flags: Arc<Flags>,
}

impl<S: Store> Clone for External<S> {
    fn clone(&self) -> Self {
        Self {
            lease: self.lease.clone(),
            flags: self.flags.clone(),
        }
    }
}

impl<S: Store> std::fmt::Debug for External<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("External")
            .field("key_id", &self.lease.id().key_id())
            .field("token", &self.lease.token())
            .finish()
    }
}

impl<S: Store> External<S> {
    /// Marks the point of no return. Fails when the lease was lost to a newer owner (409:
    /// that owner does the work) or the store is unreachable (503); in both cases do not
    /// call out.
    pub async fn point_of_no_return(&self) -> Result<(), IdempotencyRejection> {
        match self.lease.point_of_no_return().await {
            Ok(()) => {
                self.flags
                    .past_point_of_no_return
                    .store(true, Ordering::SeqCst);
                Ok(())
            }
            Err(protocol::Error::Fenced) => Err(IdempotencyRejection::InFlight {
                retry_after: Duration::from_secs(1),
            }),
            Err(_) => Err(IdempotencyRejection::StoreUnavailable {
                retry_after: Duration::from_secs(1),
            }),
        }
    }

    /// Declares that the call out may or may not have taken effect (a time-out, a reset
    /// after sending): the record becomes indeterminate whatever the handler answers.
    pub fn outcome_unknown(&self) {
        self.flags.outcome_unknown.store(true, Ordering::SeqCst);
    }

    /// The fencing token of this attempt's ownership, to send along to services that accept
    /// one.
    pub fn token(&self) -> i64 {
        self.lease.token()
    }

    /// A log-safe identifier of the key (never the raw key).
    pub fn key_id(&self) -> String {
        self.lease.id().key_id()
    }
}

impl<S: Store, State: Send + Sync> FromRequestParts<State> for External<S> {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &State) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<External<S>>()
            .cloned()
            .ok_or(IdempotencyRejection::TransactionUnavailable)
    }
}
