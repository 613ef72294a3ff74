//! Wall-clock time as stored in records: milliseconds since the Unix epoch.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time, in milliseconds since the Unix epoch (UTC).
///
/// Records store times as plain integers so that both stores compare them the same way.
/// The application's clock is the reference; every store call takes `now` explicitly, which
/// keeps expiry testable without sleeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// The current time from the system clock.
    pub fn now() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        Self(ms)
    }

    /// Milliseconds since the epoch.
    pub fn as_millis(self) -> i64 {
        self.0
    }

    /// This time plus `d` (saturating).
    pub fn plus(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_add(d.as_millis().min(i64::MAX as u128) as i64),
        )
    }

    /// This time minus `d` (saturating).
    pub fn minus(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_sub(d.as_millis().min(i64::MAX as u128) as i64),
        )
    }

    /// This time as a [`SystemTime`] (times before the epoch are clamped to it).
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0.max(0) as u64)
    }

    /// The time from `self` until `later`, zero if `later` is not later.
    pub fn until(self, later: Timestamp) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0).max(0) as u64)
    }
}

/// Where the current time comes from: the system clock in production, a clock a test moves
/// by hand in tests (expiry, leases and `Retry-After` without sleeping).
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}
