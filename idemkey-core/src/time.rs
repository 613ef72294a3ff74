//! Wall-clock time as stored in records: milliseconds since the Unix epoch.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time, in milliseconds since the Unix epoch (UTC).
///
/// Records store times as plain integers so that both stores compare them the same way.
/// The application's clock is the reference; every store call takes `now` explicitly, which
/// keeps expiry testable without sleeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// The latest time an HTTP date or an RFC 3339 date can spell: 9999-12-31T23:59:59.999Z.
    /// [`to_system_time`](Self::to_system_time) goes no further, so that formatting a time
    /// read from a record can never fail, however far in the future the record says.
    pub const MAX_FORMATTABLE: Self = Self(253_402_300_799_999);

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

    /// This time as a [`SystemTime`], clamped to the epoch and to
    /// [`MAX_FORMATTABLE`](Self::MAX_FORMATTABLE): `httpdate` and `humantime` format every
    /// value it returns without a panic.
    pub fn to_system_time(self) -> SystemTime {
        let ms = self.0.clamp(0, Self::MAX_FORMATTABLE.0) as u64;
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    /// The time from `self` until `later`, zero if `later` is not later.
    pub fn until(self, later: Timestamp) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0).max(0) as u64)
    }
}

/// A wait in progress, as returned by [`Clock::sleep`].
pub type Sleep<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Where the time comes from and how to wait for it to pass: the system clock and the
/// runtime's timer in production, a clock a test moves by hand in tests (expiry, leases,
/// purges and `Retry-After` without sleeping).
///
/// Core holds no timer: the implementation that sleeps on a runtime lives where the runtime
/// is (`idemkey_tower::SystemClock` and `idemkey_client::SystemClock` on tokio's timer).
/// A request reads [`now`](Self::now) on its hot path; only a request that waits (a lease
/// renewal, a poll of a reservation held elsewhere, a purge between rounds) calls
/// [`sleep`](Self::sleep), which boxes its future.
///
/// ```
/// use std::sync::Mutex;
/// use std::time::Duration;
///
/// use idemkey_core::{Clock, Sleep, Timestamp};
///
/// /// A clock whose time moves only when something sleeps on it.
/// #[derive(Debug)]
/// struct Skipping(Mutex<Timestamp>);
///
/// impl Clock for Skipping {
///     fn now(&self) -> Timestamp {
///         *self.0.lock().unwrap()
///     }
///
///     fn sleep(&self, duration: Duration) -> Sleep<'_> {
///         let mut now = self.0.lock().unwrap();
///         *now = now.plus(duration);
///         Box::pin(std::future::ready(()))
///     }
/// }
///
/// let clock = Skipping(Mutex::new(Timestamp(1_800_000_000_000)));
/// drop(clock.sleep(Duration::from_secs(30)));
/// assert_eq!(clock.now(), Timestamp(1_800_000_030_000));
/// ```
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;

    /// Waits until `duration` has passed on this clock.
    fn sleep(&self, duration: Duration) -> Sleep<'_>;
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn any_time_and_duration_add_and_format_without_a_panic(
            ms in any::<i64>(),
            secs in any::<u64>(),
            nanos in 0u32..1_000_000_000,
        ) {
            let t = Timestamp(ms);
            let d = Duration::new(secs, nanos);
            for t in [t, t.plus(d), t.minus(d)] {
                let at = t.to_system_time();
                let http = httpdate::fmt_http_date(at);
                let rfc = humantime::format_rfc3339_millis(at).to_string();
                prop_assert!(!http.is_empty() && !rfc.is_empty());
                let _ = t.until(Timestamp::now());
                let _ = Timestamp::now().until(t);
            }
        }

        #[test]
        fn formattable_times_round_trip(ms in 0i64..=Timestamp::MAX_FORMATTABLE.0) {
            let at = Timestamp(ms).to_system_time();
            let rfc = humantime::format_rfc3339_millis(at).to_string();
            prop_assert_eq!(humantime::parse_rfc3339(&rfc).unwrap(), at);
            let http = httpdate::fmt_http_date(at);
            let secs = Duration::from_secs((ms / 1000) as u64);
            prop_assert_eq!(httpdate::parse_http_date(&http).unwrap(), UNIX_EPOCH + secs);
        }
    }

    #[test]
    fn the_far_future_is_formatted_as_the_last_formattable_time() {
        let far = Timestamp(i64::MAX).to_system_time();
        assert_eq!(
            httpdate::fmt_http_date(far),
            "Fri, 31 Dec 9999 23:59:59 GMT"
        );
        assert_eq!(
            humantime::format_rfc3339_millis(far).to_string(),
            "9999-12-31T23:59:59.999Z"
        );
    }
}
