//! What several test files of the layer share.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use idemkey_core::{Clock, Timestamp};

/// A clock the test moves by hand (expiry and trust bounds without sleeping).
#[derive(Debug)]
pub(crate) struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock at a fixed time in 2027.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self(AtomicI64::new(1_800_000_000_000)))
    }

    /// Moves the clock forward by `by`.
    pub(crate) fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as i64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}
