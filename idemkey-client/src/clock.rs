//! Where the retry loop reads the time and waits: core's [`Clock`], on tokio's timer by
//! default.

use std::time::Duration;

pub use idemkey_core::{Clock, Sleep, Timestamp};

/// The system's clock and tokio's timer: the default [`Clock`] of the retry loop.
///
/// The loop reads [`now`](Clock::now) to start an operation's retention horizon, to check
/// that an attempt is clear of it, to turn a `Retry-After` date into a delay, and to measure
/// the time spent against [`RetryPolicy::max_elapsed`](crate::RetryPolicy::max_elapsed). It
/// waits between attempts with [`sleep`](Clock::sleep), and nowhere else. (A per-attempt
/// timeout is the `reqwest::Client`'s own and runs on tokio's timer.)
///
/// A test can pass a clock whose `sleep` returns at once and moves its time forward, so that
/// a `Retry-After: 30` takes no time and the waits can be checked:
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use std::time::Duration;
///
/// use idemkey_client::{Clock, IdempotentClient, Sleep, Timestamp};
///
/// #[derive(Debug)]
/// struct ManualClock {
///     now: Mutex<Timestamp>,
///     waits: Mutex<Vec<Duration>>,
/// }
///
/// impl Clock for ManualClock {
///     fn now(&self) -> Timestamp {
///         *self.now.lock().unwrap()
///     }
///
///     fn sleep(&self, duration: Duration) -> Sleep<'_> {
///         let mut now = self.now.lock().unwrap();
///         *now = now.plus(duration);
///         self.waits.lock().unwrap().push(duration);
///         Box::pin(std::future::ready(()))
///     }
/// }
///
/// let clock = Arc::new(ManualClock {
///     now: Mutex::new(Timestamp(1_800_000_000_000)),
///     waits: Mutex::new(Vec::new()),
/// });
/// let client = IdempotentClient::new(reqwest::Client::new()).with_clock(clock.clone());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }

    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        Box::pin(tokio::time::sleep(duration))
    }
}
