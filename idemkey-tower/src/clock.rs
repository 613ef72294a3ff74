//! The production [`Clock`]: the system's time and tokio's timer.

use std::time::Duration;

use idemkey_core::{Clock, Sleep, Timestamp};

/// The system's clock and tokio's timer: the layer's default [`Clock`], and the one a
/// [`PurgeTask`](crate::PurgeTask) of the server reads.
///
/// Its [`sleep`](Clock::sleep) is tokio's, so a test under `tokio::time::pause` drives
/// leases, polls and purges without waiting; a test that also moves the records' time
/// passes a clock of its own to [`IdempotencyLayer::clock`](crate::IdempotencyLayer::clock).
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
