//! Per-route policies: whether a key is required, what to do while the first attempt runs,
//! and which responses are stored.

use std::time::Duration;

use http::StatusCode;

/// Whether a route takes an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyRequirement {
    /// A request without a key is refused with 400 `key-missing`.
    #[default]
    Required,
    /// A request without a key runs without protection.
    Optional,
    /// Keys are ignored; the layer only provides the transaction.
    Off,
}

/// What a retry gets while the first attempt with its key is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlightPolicy {
    /// Wait up to the bound for the first attempt to finish, then replay its outcome; past
    /// the bound, 409 `request-in-flight` with `Retry-After`.
    Wait(Duration),
    /// Answer 409 `request-in-flight` with `Retry-After` at once.
    Reject,
}

impl InFlightPolicy {
    /// The default bound of [`InFlightPolicy::Wait`]: 5 seconds.
    pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);
}

impl Default for InFlightPolicy {
    fn default() -> Self {
        Self::Wait(Self::DEFAULT_WAIT)
    }
}

/// Decides whether a response the handler produced is stored (its transaction commits, and
/// retries replay it) or not (its transaction rolls back and the key stays free).
///
/// Implemented for closures `Fn(StatusCode) -> bool`.
pub trait StorePolicy: Clone + Send + Sync + 'static {
    /// `true`: store and commit; `false`: roll back.
    fn stores(&self, status: StatusCode) -> bool;
}

impl<F> StorePolicy for F
where
    F: Fn(StatusCode) -> bool + Clone + Send + Sync + 'static,
{
    fn stores(&self, status: StatusCode) -> bool {
        self(status)
    }
}

/// The default: every outcome is stored — successes and business errors alike (a card
/// decline, a business 409, a 404) — except responses that say the request itself was
/// rejected before any effect could happen (400, 401, 403, 405, 406, 408, 411, 413, 414,
/// 415, 422, 429) and server errors (5xx), which roll back so a retry runs fresh.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStorePolicy;

impl StorePolicy for DefaultStorePolicy {
    fn stores(&self, status: StatusCode) -> bool {
        !(status.is_server_error()
            || matches!(
                status.as_u16(),
                400 | 401 | 403 | 405 | 406 | 408 | 411 | 413 | 414 | 415 | 422 | 429
            ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_stores_outcomes_not_rejections() {
        let p = DefaultStorePolicy;
        for s in [200, 201, 202, 204, 402, 404, 409, 410] {
            assert!(p.stores(StatusCode::from_u16(s).unwrap()), "{s} is stored");
        }
        for s in [400, 401, 413, 422, 429, 500, 502, 503] {
            assert!(
                !p.stores(StatusCode::from_u16(s).unwrap()),
                "{s} is not stored"
            );
        }
    }

    #[test]
    fn closures_are_policies() {
        let only_created = |s: StatusCode| s == StatusCode::CREATED;
        assert!(only_created.stores(StatusCode::CREATED));
        assert!(!only_created.stores(StatusCode::OK));
    }
}
