//! The handler's side of external mode: the [`External`] extractor.
//!
//! For effects the store cannot share a transaction with (a call to a bank, another
//! service), the claim commits at once as a reservation with a lease; the handler marks the
//! point of no return just before it calls out; the layer then completes the record, frees
//! the key, or leaves the operation indeterminate, as [`after_effect`](idemkey_core::after_effect)
//! decides. The owner flow itself is in `service/external.rs`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;
use idemkey_core::Store;
use idemkey_core::protocol::{self, Lease};

use crate::{IdempotencyRejection, RETRY_AFTER};

#[derive(Debug, Default)]
pub(crate) struct Flags {
    past_point_of_no_return: AtomicBool,
    outcome_unknown: AtomicBool,
}

impl Flags {
    /// Whether the request may have left (the point of no return was marked).
    pub(crate) fn sent(&self) -> bool {
        self.past_point_of_no_return.load(Ordering::SeqCst)
    }

    /// Whether the handler reported that it cannot know the outcome.
    pub(crate) fn unknown(&self) -> bool {
        self.outcome_unknown.load(Ordering::SeqCst)
    }
}

/// The handler's side of an external-mode claim (a route built with
/// [`IdempotencyLayer::external`](crate::IdempotencyLayer::external)). A local route has
/// none: [`IdempotencyLayer::handler`](crate::IdempotencyLayer::handler) refuses a handler
/// that takes one there when the router is built.
///
/// Call [`point_of_no_return`](Self::point_of_no_return) just before the request leaves for
/// the other service, and [`outcome_unknown`](Self::outcome_unknown) when it timed out or the
/// connection broke after that ([`nothing_sent`](Self::nothing_sent) when the call is known
/// not to have left after all). What becomes of the record is then the same rule for every
/// route and for `idemkey gateway` (`docs/guide/contract.md`, "After the point of no return"):
///
/// - before the point of no return, whatever the handler does frees the key: nothing can
///   have happened elsewhere, so a retry runs the handler again (always mark the point of
///   no return before calling out);
/// - after it, a panic or an unknown outcome leaves the operation indeterminate (never
///   re-executed on its own); an answer is stored, frees the key, or leaves the operation
///   indeterminate, as the route's [`AnswerRule`](idemkey_core::AnswerRule) says of its
///   status (by default: refusals such as 400 or 429 free it, 5xx are indeterminate, every
///   other answer is stored).
///
/// The handler runs on a task of its own: a client that hangs up does not stop it.
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
    pub(crate) status_url: Arc<str>,
}

impl<S: Store> Clone for External<S> {
    fn clone(&self) -> Self {
        Self {
            lease: self.lease.clone(),
            flags: self.flags.clone(),
            status_url: self.status_url.clone(),
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
    /// call out. On a route whose reservation marked it already
    /// ([`point_of_no_return_at_reservation`](crate::IdempotencyLayer::point_of_no_return_at_reservation))
    /// it writes nothing, and fails (409) only once the reservation's lease has lapsed.
    pub async fn point_of_no_return(&self) -> Result<(), IdempotencyRejection> {
        match self.lease.point_of_no_return().await {
            Ok(()) => {
                self.flags
                    .past_point_of_no_return
                    .store(true, Ordering::SeqCst);
                Ok(())
            }
            Err(protocol::Error::Fenced) => Err(IdempotencyRejection::InFlight {
                retry_after: RETRY_AFTER,
            }),
            Err(_) => Err(IdempotencyRejection::StoreUnavailable {
                retry_after: RETRY_AFTER,
            }),
        }
    }

    /// Takes the [`point_of_no_return`](Self::point_of_no_return) back: the call out did
    /// not leave after all, so what the handler answers frees the key, as before the point of
    /// no return, and a retry runs the handler again. For a call the handler *knows* was not
    /// sent, such as a request a kept-alive connection handed back unwritten because it had
    /// closed (hyper's `try_send_request`); a connection that broke after writing is
    /// [`outcome_unknown`](Self::outcome_unknown). Said of a call that may have left, this
    /// lets a retry run the effect twice. The handler may mark the point of no return again
    /// before it calls out anew.
    pub fn nothing_sent(&self) {
        self.flags
            .past_point_of_no_return
            .store(false, Ordering::SeqCst);
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

    /// The status resource of this key, for an answer that says the outcome is unknown.
    pub fn status_url(&self) -> &str {
        &self.status_url
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

/// `Option<External<S>>`: `None` for a request without a key on an `optional` route.
impl<S: Store, State: Send + Sync> OptionalFromRequestParts<State> for External<S> {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _: &State,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<External<S>>().cloned())
    }
}
