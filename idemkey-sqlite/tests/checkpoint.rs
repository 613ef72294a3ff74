//! `RusqliteStore`'s WAL checkpoints run out of the writer's turn (`src/checkpoint.rs`):
//! under a writer that never stops, the WAL must still start over, and what was committed
//! must be in the file when the store is opened again.

use idemkey_core::Store;
use idemkey_sqlite::RusqliteStore;
use idemkey_sqlite::rusqlite::params;

/// Rows of 12 KiB: each commit writes about five 4 KiB frames (measured: 169 MB of WAL for
/// the 8000 commits below when it never starts over).
const ROW: usize = 12 * 1024;
/// Commits the test makes at most: about 41 000 frames (169 MB of WAL when it never starts
/// over), four times the store's bound of 10 000 frames before the writer finishes a
/// checkpoint. It stops once the WAL has started over.
const COMMITS: usize = 8000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_starts_over_under_a_writer_that_never_stops() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("test.db");
    let store = RusqliteStore::open(&path).expect("open");
    store
        .with_connection(|c| c.execute_batch("CREATE TABLE blobs (n INTEGER, data BLOB)"))
        .expect("table");

    // A WAL that starts over is written again from its beginning, not truncated: the
    // file's length is the most it ever held. One that never started over holds every
    // frame, more than the rows' bytes. The store's bound is 10 000 frames of 4 KiB
    // (about 41 MB), acted on once the checkpointer has seen it, so the WAL falls behind
    // the rows' bytes once the checkpointer has reported it (on a busy machine, later).
    let wal_len = || {
        std::fs::metadata(path.with_extension("db-wal"))
            .expect("the WAL is there while the store is open")
            .len()
    };
    let data = vec![7u8; ROW];
    let mut commits = 0;
    while commits < COMMITS && wal_len() >= (commits * ROW) as u64 {
        let tx = store.begin().await.expect("begin");
        tx.execute(
            "INSERT INTO blobs (n, data) VALUES (?1, ?2)",
            params![commits, data],
        )
        .expect("insert");
        tx.commit().expect("commit");
        commits += 1;
    }
    let written = (commits * ROW) as u64;
    let wal = wal_len();
    assert!(
        wal < written,
        "the WAL grew to {wal} bytes for {written} bytes of rows: it never started over"
    );

    drop(store);
    let again = RusqliteStore::open(&path).expect("open again");
    let (rows, sum): (i64, i64) = again
        .with_connection(|c| {
            c.query_row("SELECT count(*), sum(length(data)) FROM blobs", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
        })
        .expect("count");
    assert_eq!(rows, commits as i64, "every committed row is there");
    assert_eq!(sum, written as i64);
}
