//! Where the retry loop reads the time and waits.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

/// A wait in progress, as returned by [`Clock::sleep`].
pub type Sleep<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// The time as the retry loop sees it: what time it is, and how to wait.
///
/// The loop reads [`now`](Self::now) to start an operation's retention horizon, to check that
/// an attempt is clear of it, to turn a `Retry-After` date into a delay, and to measure the
/// time spent against [`RetryPolicy::max_elapsed`](crate::RetryPolicy::max_elapsed). It waits
/// between attempts with [`sleep`](Self::sleep), and nowhere else. (A per-attempt timeout is
/// the `reqwest::Client`'s own and runs on tokio's timer.)
///
/// The default is [`SystemClock`]. A test can pass a clock whose `sleep` returns at once and
/// moves its time forward, so that a `Retry-After: 30` takes no time and the waits can be
/// checked:
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use std::time::{Duration, SystemTime};
///
/// use idemkey_client::{Clock, IdempotentClient, Sleep};
///
/// #[derive(Debug)]
/// struct ManualClock {
///     now: Mutex<SystemTime>,
///     waits: Mutex<Vec<Duration>>,
/// }
///
/// impl Clock for ManualClock {
///     fn now(&self) -> SystemTime {
///         *self.now.lock().unwrap()
///     }
///
///     fn sleep(&self, duration: Duration) -> Sleep<'_> {
///         *self.now.lock().unwrap() += duration;
///         self.waits.lock().unwrap().push(duration);
///         Box::pin(std::future::ready(()))
///     }
/// }
///
/// let clock = Arc::new(ManualClock {
///     now: Mutex::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)),
///     waits: Mutex::new(Vec::new()),
/// });
/// let client = IdempotentClient::new(reqwest::Client::new()).with_clock(clock.clone());
/// ```
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now(&self) -> SystemTime;

    /// Waits for `duration` (the loop awaits it before the next attempt).
    fn sleep(&self, duration: Duration) -> Sleep<'_>;
}

/// The system's clock and tokio's timer: the default [`Clock`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        Box::pin(tokio::time::sleep(duration))
    }
}
