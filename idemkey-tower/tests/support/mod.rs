//! What several test files of the layer share.

use std::sync::Arc;
use std::time::Duration;

use idemkey_core::{Clock, Sleep, Timestamp};
use tokio::sync::watch;

/// A clock the test moves by hand (expiry, trust bounds, leases and waits without
/// sleeping): its time moves only on [`advance`](Self::advance), and a
/// [`sleep`](Clock::sleep) on it ends once the time has been moved past its end.
#[derive(Debug)]
pub(crate) struct ManualClock {
    /// The time, in milliseconds since the epoch.
    now: watch::Sender<i64>,
    /// How many sleeps have begun, so that a test can wait for a task to be asleep.
    sleeps: watch::Sender<u64>,
}

impl ManualClock {
    /// A clock at a fixed time in 2027.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            now: watch::Sender::new(1_800_000_000_000),
            sleeps: watch::Sender::new(0),
        })
    }

    /// Moves the clock forward by `by`, ending the sleeps that end by then.
    pub(crate) fn advance(&self, by: Duration) {
        self.now.send_modify(|ms| *ms += by.as_millis() as i64);
    }

    /// How many sleeps have begun on this clock so far.
    #[allow(dead_code)] // not every test file waits for a sleeper
    pub(crate) fn sleeps_begun(&self) -> u64 {
        *self.sleeps.borrow()
    }

    /// Waits until `n` sleeps in all have begun on this clock (a task that sleeps on it
    /// is then parked until the clock moves).
    #[allow(dead_code)] // not every test file waits for a sleeper
    pub(crate) async fn sleeping(&self, n: u64) {
        let mut begun = self.sleeps.subscribe();
        begun
            .wait_for(|b| *b >= n)
            .await
            .expect("the clock is alive");
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(*self.now.borrow())
    }

    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        let until = self.now().plus(duration).as_millis();
        let mut now = self.now.subscribe();
        self.sleeps.send_modify(|b| *b += 1);
        Box::pin(async move {
            now.wait_for(|ms| *ms >= until)
                .await
                .expect("the clock is alive");
        })
    }
}
