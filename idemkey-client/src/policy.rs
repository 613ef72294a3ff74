//! When to retry and when to stop.

use std::time::Duration;

use rand::Rng;

/// How retries are spaced and bounded.
///
/// | setting | default |
/// |---|---|
/// | [`initial_delay`](Self::with_initial_delay) | 100 ms |
/// | [`multiplier`](Self::with_multiplier) | 2 |
/// | [`max_delay`](Self::with_max_delay) | 5 s |
/// | [`max_attempts`](Self::with_max_attempts) (the first attempt included) | 10 |
/// | [`max_elapsed`](Self::with_max_elapsed) (from the first attempt of one call) | 60 s |
/// | [`retention`](Self::with_retention) (when the server advertises no expiry) | 24 h |
/// | [`expiry_margin`](Self::with_expiry_margin) (kept clear of the horizon) | 1 s |
/// | [`attempt_timeout`](Self::with_attempt_timeout) | none: the `reqwest::Client`'s own |
///
/// Without `Retry-After`, the delay before retry *n* is drawn uniformly from
/// `0..=min(max_delay, initial_delay × multiplier^(n-1))` ("full jitter"). A `Retry-After`
/// (seconds or an HTTP-date) is honoured as given instead.
///
/// A retry is given up when the attempts are spent, or when waiting for it would go past
/// `max_elapsed`. It is never scheduled at or after the key's retention horizon less
/// `expiry_margin`: the horizon is the last `Idempotency-Key-Expires` the server advertised,
/// or, before any, the operation's first attempt plus `retention`.
///
/// ```
/// use std::time::Duration;
/// use idemkey_client::RetryPolicy;
///
/// let policy = RetryPolicy::new()
///     .with_initial_delay(Duration::from_millis(200))
///     .with_max_delay(Duration::from_secs(2))
///     .with_max_attempts(6)
///     .with_max_elapsed(Duration::from_secs(30))
///     .with_attempt_timeout(Duration::from_secs(5));
/// assert_eq!(policy.max_attempts(), 6);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    initial_delay: Duration,
    multiplier: f64,
    max_delay: Duration,
    max_attempts: u32,
    max_elapsed: Duration,
    retention: Duration,
    expiry_margin: Duration,
    attempt_timeout: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial_delay: Duration::from_millis(100),
            multiplier: 2.0,
            max_delay: Duration::from_secs(5),
            max_attempts: 10,
            max_elapsed: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 60 * 60),
            expiry_margin: Duration::from_secs(1),
            attempt_timeout: None,
        }
    }
}

impl RetryPolicy {
    /// The defaults (see the table above).
    pub fn new() -> Self {
        Self::default()
    }

    /// The cap of the first backoff delay.
    pub fn with_initial_delay(mut self, delay: Duration) -> Self {
        self.initial_delay = delay;
        self
    }

    /// How much the backoff cap grows per retry (at least 1).
    pub fn with_multiplier(mut self, multiplier: f64) -> Self {
        self.multiplier = if multiplier.is_finite() && multiplier >= 1.0 {
            multiplier
        } else {
            1.0
        };
        self
    }

    /// The largest backoff delay (`Retry-After` is not capped by it).
    pub fn with_max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// Attempts per call, the first one included (at least 1: 1 means no retry).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The longest one call may spend retrying, measured from its first attempt.
    pub fn with_max_elapsed(mut self, elapsed: Duration) -> Self {
        self.max_elapsed = elapsed;
        self
    }

    /// How long the server keeps an outcome, from the operation's first attempt; used until
    /// the server advertises `Idempotency-Key-Expires`.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How far before the horizon the last attempt must start (for clock skew).
    pub fn with_expiry_margin(mut self, margin: Duration) -> Self {
        self.expiry_margin = margin;
        self
    }

    /// A timeout for each attempt, for requests that do not set their own.
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The cap of the first backoff delay.
    pub fn initial_delay(&self) -> Duration {
        self.initial_delay
    }

    /// How much the backoff cap grows per retry.
    pub fn multiplier(&self) -> f64 {
        self.multiplier
    }

    /// The largest backoff delay.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// Attempts per call, the first one included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The longest one call may spend retrying.
    pub fn max_elapsed(&self) -> Duration {
        self.max_elapsed
    }

    /// The assumed retention, from the first attempt.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How far before the horizon the last attempt must start.
    pub fn expiry_margin(&self) -> Duration {
        self.expiry_margin
    }

    /// The per-attempt timeout, if any.
    pub fn attempt_timeout(&self) -> Option<Duration> {
        self.attempt_timeout
    }

    /// The upper bound of the backoff delay before retry `retry` (1 for the first retry).
    pub(crate) fn backoff_cap(&self, retry: u32) -> Duration {
        let exponent = i32::try_from(retry.saturating_sub(1)).unwrap_or(i32::MAX);
        let secs = self.initial_delay.as_secs_f64() * self.multiplier.powi(exponent);
        let cap = self.max_delay.as_secs_f64();
        Duration::try_from_secs_f64(secs.min(cap)).unwrap_or(self.max_delay)
    }

    /// A full-jitter backoff delay before retry `retry`.
    pub(crate) fn backoff(&self, retry: u32) -> Duration {
        let cap = self.backoff_cap(retry);
        if cap.is_zero() {
            return cap;
        }
        let secs = rand::thread_rng().gen_range(0.0..=cap.as_secs_f64());
        Duration::try_from_secs_f64(secs).unwrap_or(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_grow_exponentially_up_to_the_max() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff_cap(1), Duration::from_millis(100));
        assert_eq!(p.backoff_cap(2), Duration::from_millis(200));
        assert_eq!(p.backoff_cap(4), Duration::from_millis(800));
        assert_eq!(p.backoff_cap(7), Duration::from_secs(5));
        assert_eq!(p.backoff_cap(u32::MAX), Duration::from_secs(5));
    }

    #[test]
    fn jitter_stays_within_the_cap() {
        let p = RetryPolicy::default();
        for retry in 1..20 {
            assert!(p.backoff(retry) <= p.backoff_cap(retry));
        }
    }

    #[test]
    fn setters_clamp_nonsense() {
        let p = RetryPolicy::new()
            .with_max_attempts(0)
            .with_multiplier(f64::NAN);
        assert_eq!(p.max_attempts(), 1);
        assert_eq!(p.multiplier(), 1.0);
    }
}
