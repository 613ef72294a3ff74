//! [`RusqliteStore`](crate::RusqliteStore)'s WAL checkpoints, out of the writer's turn.
//!
//! Left to itself, SQLite checkpoints on the committing call once the WAL holds 1000
//! frames: it copies them into the database file and syncs both files while the store's
//! writer turn is held, so every writer queued behind it waits for two `fsync`s. Instead,
//! the writer connection's automatic checkpoint is off, and:
//!
//! - every [`WAKE_EVERY`] commits, or sooner once the commits since its last run changed
//!   [`WAKE_CHANGES`] rows, a thread of the store's own runs a `PASSIVE` checkpoint on a
//!   connection of its own. It copies the frames committed so far, syncs, and notes how
//!   long the WAL is. Writers go on meanwhile. (A commit that changes many rows, a purge
//!   batch or a bulk effect, writes as many frames as many small ones.)
//! - Those copies never catch up with a writer that keeps committing, and SQLite starts
//!   the WAL over only once every frame in it is copied. So once the checkpointer has seen
//!   [`WAL_FRAMES_BOUND`] frames, the next commit runs a `PASSIVE` checkpoint on the writer,
//!   in its turn: it copies only what the checkpointer has not, and the next write
//!   transaction starts the WAL from its beginning. While the checkpointer is at work, it
//!   holds the checkpoint and the writer's try does nothing; the writer tries again after
//!   each commit and does not wake the checkpointer until it has finished.
//!
//! Woken by commits alone, the checkpointer let the WAL grow to 615 MB under a purge of
//! 10⁶ records and to 706 MB under one of 10⁷. Woken by changed rows too, but with the
//! writer giving up its try whenever the checkpointer held the checkpoint (one try in three
//! under a purge), it grew to 83–428 MB. With both rules, it reached 78–104 MB in four purges
//! of 10⁶ and 118 MB in one of 10⁷ (under `scripts/bench_scale.sh`'s purge run).
//!
//! The writer thus syncs for a checkpoint about once per [`WAL_FRAMES_BOUND`] frames
//! instead of once per 1000, and the WAL file stays near that bound: 10 000 frames of
//! 4 KiB are about 41 MB; 46.7 MB was measured under `idemkey serve`, and up to 118 MB
//! under a purge. Durability is SQLite's: a checkpoint syncs the WAL before it copies, and
//! the database file before the WAL can start over (docs/decisions.md, "WAL checkpoints
//! out of the writer's turn").

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};

use idemkey_core::StoreError;
use rusqlite::Connection;

/// Commits between two wake-ups of the checkpointer (a payment of `idemkey serve` writes
/// about 7 frames, so about SQLite's own 1000 frames).
pub(crate) const WAKE_EVERY: u64 = 100;

/// Row changes (`sqlite3_total_changes` on the writer) that wake the checkpointer before
/// [`WAKE_EVERY`] commits: a row changed is about one or two frames.
pub(crate) const WAKE_CHANGES: u64 = 1000;

/// How long the WAL may grow, in frames, before the writer finishes a checkpoint itself.
pub(crate) const WAL_FRAMES_BOUND: u64 = 10_000;

/// When the checkpointer is woken, and when the writer finishes a checkpoint.
#[derive(Clone, Copy, Debug)]
struct Cadence {
    commits: u64,
    changes: u64,
    wal_frames: u64,
}

impl Cadence {
    const STORE: Self = Self {
        commits: WAKE_EVERY,
        changes: WAKE_CHANGES,
        wal_frames: WAL_FRAMES_BOUND,
    };
}

/// The writer's side of the checkpointer: dropping it ends the thread.
#[derive(Debug)]
pub(crate) struct Checkpoints {
    wake: SyncSender<()>,
    /// The WAL's length in frames when the checkpointer last ran; 0 once the writer has
    /// finished a checkpoint since.
    wal_frames: Arc<AtomicU64>,
    cadence: Cadence,
    /// Commits since the checkpointer was last woken.
    commits: AtomicU64,
    /// The writer's total of changed rows when the checkpointer was last woken.
    changes_at_wake: AtomicU64,
}

impl Checkpoints {
    /// Starts the checkpointer, which opens its connection with `open` when first woken
    /// (and again after an error).
    pub(crate) fn start(
        open: impl Fn() -> Result<Connection, StoreError> + Send + 'static,
    ) -> Result<Self, StoreError> {
        let (checkpoints, woken) = Self::new(Cadence::STORE);
        let seen = checkpoints.wal_frames.clone();
        std::thread::Builder::new()
            .name("idemkey-sqlite-checkpoint".into())
            .spawn(move || checkpointer(&open, &woken, &seen))
            .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
        Ok(checkpoints)
    }

    /// The writer's side, and the checkpointer's wake-ups.
    fn new(cadence: Cadence) -> (Self, Receiver<()>) {
        // One wake-up pending at most: a checkpointer still at work sees the newer frames
        // when it next runs.
        let (wake, woken) = mpsc::sync_channel(1);
        let checkpoints = Self {
            wake,
            wal_frames: Arc::new(AtomicU64::new(0)),
            cadence,
            commits: AtomicU64::new(0),
            changes_at_wake: AtomicU64::new(0),
        };
        (checkpoints, woken)
    }

    /// Called by the writer after each commit, still in its turn.
    pub(crate) fn after_commit(&self, writer: &Connection) {
        self.after_commit_with(writer.total_changes(), || passive_checkpoint(writer));
    }

    /// [`after_commit`](Self::after_commit), given the writer's total of changed rows and
    /// its `PASSIVE` checkpoint.
    fn after_commit_with(
        &self,
        changes: u64,
        finish: impl FnOnce() -> rusqlite::Result<Checkpointed>,
    ) {
        let commits = self.commits.fetch_add(1, Ordering::Relaxed) + 1;
        if self.wal_frames.load(Ordering::Relaxed) >= self.cadence.wal_frames {
            match finish() {
                // The checkpointer is at work and holds the checkpoint: tried again after
                // the next commit. It is not woken meanwhile, or it could keep taking the
                // checkpoint from the writer while the WAL grows (under a purge it did,
                // one try in three).
                Ok(Checkpointed::Busy) => return,
                // Whether or not it copied everything (a reader may still need old
                // frames), the next try waits for the checkpointer's next look at the WAL.
                Ok(Checkpointed::Done { .. }) | Err(_) => {
                    self.wal_frames.store(0, Ordering::Relaxed);
                }
            }
        }
        // A writer connection opened again counts from 0.
        let changed = changes
            .checked_sub(self.changes_at_wake.load(Ordering::Relaxed))
            .unwrap_or(changes);
        if commits >= self.cadence.commits || changed >= self.cadence.changes {
            self.commits.store(0, Ordering::Relaxed);
            self.changes_at_wake.store(changes, Ordering::Relaxed);
            // Full: a wake-up is pending already.
            let _ = self.wake.try_send(());
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
        checkpoint_once(open, &mut conn, wal_frames);
    }
}

/// One wake-up's work: a `PASSIVE` checkpoint on `conn` (opened first if it is not), and
/// the WAL's length for the writer.
fn checkpoint_once(
    open: &dyn Fn() -> Result<Connection, StoreError>,
    conn: &mut Option<Connection>,
    wal_frames: &AtomicU64,
) {
    if conn.is_none() {
        *conn = open().ok();
    }
    let Some(c) = conn.as_ref() else { return };
    match passive_checkpoint(c) {
        Ok(Checkpointed::Done { wal_frames: frames }) => {
            wal_frames.store(frames, Ordering::Relaxed);
        }
        // The writer is finishing a checkpoint: it reports nothing new.
        Ok(Checkpointed::Busy) => {}
        // Opened again at the next wake-up.
        Err(_) => *conn = None,
    }
}

/// What a `PASSIVE` checkpoint did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checkpointed {
    /// It copied what it could; the WAL holds `wal_frames` frames.
    Done { wal_frames: u64 },
    /// Another connection was checkpointing: nothing done.
    Busy,
}

/// Runs a `PASSIVE` checkpoint (it waits for no one).
fn passive_checkpoint(conn: &Connection) -> rusqlite::Result<Checkpointed> {
    // Columns: busy, frames in the WAL, frames copied (-1, -1 when not in WAL mode).
    let (busy, frames): (i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })?;
    Ok(if busy != 0 {
        Checkpointed::Busy
    } else {
        Checkpointed::Done {
            wal_frames: u64::try_from(frames).unwrap_or(0),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rusqlite_store::error;

    const CADENCE: Cadence = Cadence {
        commits: 100,
        changes: 50,
        wal_frames: 200,
    };

    /// While the checkpointer holds the checkpoint, the writer tries again after each
    /// commit, and does not wake the checkpointer; once it has finished, the WAL's length
    /// waits for the checkpointer's next look, and wake-ups go on.
    #[test]
    fn the_writer_finishes_when_the_checkpointer_lets_it() {
        let (checkpoints, woken) = Checkpoints::new(CADENCE);
        // The checkpointer's last look: over the bound.
        checkpoints.wal_frames.store(250, Ordering::Relaxed);
        let mut tries = 0;
        let mut changes = 0;
        for _ in 0..3 {
            changes += CADENCE.changes;
            checkpoints.after_commit_with(changes, || {
                tries += 1;
                Ok(Checkpointed::Busy)
            });
            assert!(
                woken.try_recv().is_err(),
                "not woken while the writer waits to finish"
            );
        }
        assert_eq!(tries, 3, "one try after each commit");
        assert_eq!(checkpoints.wal_frames.load(Ordering::Relaxed), 250);

        changes += CADENCE.changes;
        checkpoints.after_commit_with(changes, || Ok(Checkpointed::Done { wal_frames: 250 }));
        assert_eq!(
            checkpoints.wal_frames.load(Ordering::Relaxed),
            0,
            "finished: the next try waits for the checkpointer"
        );
        assert!(woken.try_recv().is_ok(), "the changes since wake it");
        changes += CADENCE.changes;
        checkpoints.after_commit_with(changes, || unreachable!("under the bound: no try"));
    }

    /// A frame: a 4 KiB page and its 24-byte header.
    const FRAME: u64 = 4096 + 24;

    /// A few commits that each change many rows must wake the checkpointer, as many small
    /// commits do. The checkpointer's work runs in line here, right after each wake-up, so
    /// the WAL's length does not depend on how the test's threads are scheduled.
    #[test]
    fn commits_that_change_many_rows_wake_the_checkpointer() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("test.db");
        let writer = Connection::open(&path).expect("open");
        writer
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA wal_autocheckpoint = 0;
                 CREATE TABLE rows (data BLOB)",
            )
            .expect("set up");
        // Far fewer commits than wake the checkpointer by their number.
        let (checkpoints, woken) = Checkpoints::new(CADENCE);
        let open = || Connection::open(&path).map_err(error);
        let mut checker = None;
        // Rows of 3000 bytes, one to a page: a commit of 50 rows writes about 50 frames.
        let data = vec![7u8; 3000];
        let commits = 30;
        let mut wakes = 0;
        for _ in 0..commits {
            writer.execute_batch("BEGIN IMMEDIATE").expect("begin");
            for _ in 0..CADENCE.changes {
                writer
                    .execute("INSERT INTO rows (data) VALUES (?1)", [&data])
                    .expect("insert");
            }
            writer.execute_batch("COMMIT").expect("commit");
            checkpoints.after_commit(&writer);
            if woken.try_recv().is_ok() {
                wakes += 1;
                checkpoint_once(&open, &mut checker, &checkpoints.wal_frames);
            }
        }
        assert_eq!(wakes, commits, "each commit changed enough rows to wake it");
        // A WAL that starts over is written again from its start, so the file's length is
        // the most it held: here about one commit's frames. Had the checkpointer slept
        // through, it would hold all 30 commits' (about 1500 frames, 6 MB).
        let wal = std::fs::metadata(path.with_extension("db-wal"))
            .expect("the WAL")
            .len();
        let written = commits * CADENCE.changes * FRAME;
        assert!(
            wal < written / 4,
            "the WAL grew to {wal} bytes of the {written} written: the checkpointer slept"
        );
    }
}
