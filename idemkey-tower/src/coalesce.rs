//! Attempts of one key in one process take turns here, before the store: the first goes on
//! to claim, the others wait for it in memory, holding no database connection.
//!
//! Without this, every duplicate of a request in flight opens a transaction and waits on
//! the owner's row lock (PostgreSQL) or the write lock (SQLite), each holding a pooled
//! connection (local mode), or reads the reservation again and again until its owner is
//! done (external mode): a retry storm on one key drains the pool and slows every other
//! key. With it, a process sends at most one attempt per record to the store at a time;
//! when that attempt ends (in external mode: once the owner's outcome is written), the next
//! one finds its answer in the replay cache (or claims, if the first stored nothing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// The attempts going to the store now, by record digest.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    going: Mutex<HashMap<[u8; 32], Going>>,
}

#[derive(Debug)]
struct Going {
    /// Closed (its sender dropped) when the attempt ends.
    done: watch::Receiver<()>,
    serial: u64,
}

/// Whose turn it is.
pub(crate) enum Turn {
    /// This attempt goes to the store; others wait until the guard is dropped.
    Mine(TurnGuard),
    /// Another attempt of this process is at the store: wait for it to end.
    Wait(watch::Receiver<()>),
}

/// Held while an attempt is at the store.
pub(crate) struct TurnGuard {
    turns: Arc<Turns>,
    digest: [u8; 32],
    serial: u64,
    _done: watch::Sender<()>,
}

impl Turns {
    /// Takes the turn for `digest`, or says whom to wait for.
    pub(crate) fn take(self: &Arc<Self>, digest: [u8; 32]) -> Turn {
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut going = self.going.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = going.get(&digest)
            && other.done.has_changed().is_ok()
        {
            return Turn::Wait(other.done.clone());
        }
        let (done_tx, done) = watch::channel(());
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        going.insert(digest, Going { done, serial });
        Turn::Mine(TurnGuard {
            turns: self.clone(),
            digest,
            serial,
            _done: done_tx,
        })
    }

    /// Whether an attempt of `digest` is at the store now, without taking a turn.
    pub(crate) fn going(&self, digest: [u8; 32]) -> bool {
        let going = self.going.lock().unwrap_or_else(|e| e.into_inner());
        going
            .get(&digest)
            .is_some_and(|other| other.done.has_changed().is_ok())
    }

    /// Attempts at the store now (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.going.lock().unwrap().len()
    }
}

impl Drop for TurnGuard {
    fn drop(&mut self) {
        let mut going = self.turns.going.lock().unwrap_or_else(|e| e.into_inner());
        if going
            .get(&self.digest)
            .is_some_and(|g| g.serial == self.serial)
        {
            going.remove(&self.digest);
        }
        // The sender drops after this: every waiter wakes.
    }
}

/// Waits until the attempt behind `done` has ended.
pub(crate) async fn ended(mut done: watch::Receiver<()>) {
    while done.changed().await.is_ok() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_turn_per_digest_and_waiters_wake_when_it_ends() {
        let turns = Arc::new(Turns::default());
        let Turn::Mine(first) = turns.take([1; 32]) else {
            panic!("the first attempt goes to the store")
        };
        let Turn::Wait(done) = turns.take([1; 32]) else {
            panic!("the second waits")
        };
        assert!(
            matches!(turns.take([2; 32]), Turn::Mine(_)),
            "other keys do not wait"
        );
        let waiter = tokio::spawn(ended(done));
        drop(first);
        waiter.await.unwrap();
        assert_eq!(turns.len(), 0);
        assert!(
            matches!(turns.take([1; 32]), Turn::Mine(_)),
            "the next attempt's turn"
        );
    }
}
