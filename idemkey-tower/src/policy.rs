//! Per-route policies: whether a key is required and what to do while the first attempt
//! runs. Which answers are stored is the route's [`AnswerRule`](idemkey_core::AnswerRule).

use std::time::Duration;

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
