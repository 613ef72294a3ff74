//! [`RusqliteStore`](crate::RusqliteStore)'s WAL checkpoints, out of the writer's turn.
//!
//! Left to itself, SQLite checkpoints on the committing call once the WAL holds 1000
//! frames: it copies them into the database file and syncs both files while the store's
//! writer turn is held, so every writer queued behind it waits for two `fsync`s. Instead,
//! the writer connection's automatic checkpoint is off, and:
//!
//! - every [`WAKE_EVERY`] commits, a thread of the store's own runs a `PASSIVE`
//!   checkpoint on a connection of its own. It copies the frames committed so far, syncs,
//!   and notes how long the WAL is. Writers go on meanwhile.
//! - Those copies never catch up with a writer that keeps committing, and SQLite starts
//!   the WAL over only once every frame in it is copied. So once the checkpointer has seen
//!   [`WAL_FRAMES_BOUND`] frames, the next commit runs a `PASSIVE` checkpoint on the writer,
//!   in its turn: it copies only what the checkpointer has not, and the next write
//!   transaction starts the WAL from its beginning.
//!
//! The writer thus syncs for a checkpoint about once per [`WAL_FRAMES_BOUND`] frames
//! instead of once per 1000, and the WAL file stays near that bound (10 000 frames of 4 KiB
//! are about 41 MB; 46.7 MB was measured under `idemkey serve`). Durability is SQLite's: a checkpoint syncs the WAL before it copies, and the
//! database file before the WAL can start over (docs/decisions.md, "WAL checkpoints out of
//! the writer's turn").

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};

use idemkey_core::StoreError;
use rusqlite::Connection;

/// Commits between two wake-ups of the checkpointer (a payment of `idemkey serve` writes
/// about 7 frames, so about SQLite's own 1000 frames).
pub(crate) const WAKE_EVERY: u64 = 100;

/// How long the WAL may grow, in frames, before the writer finishes a checkpoint itself.
pub(crate) const WAL_FRAMES_BOUND: u64 = 10_000;

/// The writer's side of the checkpointer: dropping it ends the thread.
#[derive(Debug)]
pub(crate) struct Checkpoints {
    wake: SyncSender<()>,
    /// The WAL's length in frames when the checkpointer last ran; 0 once the writer has
    /// finished a checkpoint since.
    wal_frames: Arc<AtomicU64>,
    commits: AtomicU64,
}

impl Checkpoints {
    /// Starts the checkpointer, which opens its connection with `open` when first woken
    /// (and again after an error).
    pub(crate) fn start(
        open: impl Fn() -> Result<Connection, StoreError> + Send + 'static,
    ) -> Result<Self, StoreError> {
        // One wake-up pending at most: a checkpointer still at work sees the newer frames
        // when it next runs.
        let (wake, woken) = mpsc::sync_channel(1);
        let wal_frames = Arc::new(AtomicU64::new(0));
        let seen = wal_frames.clone();
        std::thread::Builder::new()
            .name("idemkey-sqlite-checkpoint".into())
            .spawn(move || checkpointer(&open, &woken, &seen))
            .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
        Ok(Self {
            wake,
            wal_frames,
            commits: AtomicU64::new(0),
        })
    }

    /// Called by the writer after each commit, still in its turn.
    pub(crate) fn after_commit(&self, writer: &Connection) {
        let commits = self.commits.fetch_add(1, Ordering::Relaxed) + 1;
        if commits.is_multiple_of(WAKE_EVERY) {
            // Full: a wake-up is pending already.
            let _ = self.wake.try_send(());
        }
        if self.wal_frames.load(Ordering::Relaxed) >= WAL_FRAMES_BOUND {
            // Whether or not it copies everything (a reader may still need old frames, or
            // the checkpointer holds the checkpoint lock), the next try waits for the
            // checkpointer's next look at the WAL, not for the next commit.
            self.wal_frames.store(0, Ordering::Relaxed);
            let _ = passive_checkpoint(writer);
        }
    }
}

/// The checkpointer thread: a `PASSIVE` checkpoint per wake-up, until the store is gone.
fn checkpointer(
    open: &dyn Fn() -> Result<Connection, StoreError>,
    woken: &Receiver<()>,
    wal_frames: &AtomicU64,
) {
    let mut conn = None;
    while woken.recv().is_ok() {
        if conn.is_none() {
            conn = open().ok();
        }
        let Some(c) = &conn else { continue };
        match passive_checkpoint(c) {
            Ok(frames) => wal_frames.store(frames, Ordering::Relaxed),
            // Opened again at the next wake-up.
            Err(_) => conn = None,
        }
    }
}

/// Runs a `PASSIVE` checkpoint (it waits for no one) and answers the WAL's length in frames.
fn passive_checkpoint(conn: &Connection) -> rusqlite::Result<u64> {
    // Columns: busy, frames in the WAL, frames copied (-1, -1 when not in WAL mode).
    let frames: i64 = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get(1))?;
    Ok(u64::try_from(frames).unwrap_or(0))
}
