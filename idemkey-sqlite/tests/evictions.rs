//! Evictions announced on one store reach another store on the same file, on both SQLite
//! stores: each writes the announcement with the eviction and follows the table.

use futures::StreamExt;
use idemkey_core::{EvictionNotice, EvictionNotices, Store, StoreAdmin};
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use idemkey_testkit::conformance::record_id;

/// `follower` says it listens, then `announcer` evicts a record (and announces it on the
/// eviction's transaction): `follower` hands out that record's digest.
async fn an_announced_eviction_reaches_the_follower<S: Store, T: StoreAdmin>(
    follower: &S,
    announcer: &T,
) {
    let mut notices = follower
        .eviction_notices()
        .expect("a SQLite store follows evictions");
    assert_eq!(next(&mut notices).await, Some(EvictionNotice::Listening));

    let id = record_id("t1", "/v1/payments", "k-evicted");
    let mut tx = announcer.begin().await.unwrap();
    announcer.evict(&mut tx, &id).await.unwrap();
    announcer.notify_evicted(&mut tx, &id).await.unwrap();
    announcer.commit(tx).await.unwrap();

    assert_eq!(
        next(&mut notices).await,
        Some(EvictionNotice::Evicted(id.digest()))
    );
}

/// The next notice, or a failure if none comes within a bound far above the follower's poll
/// interval: a follower that stopped reading the table fails the test instead of hanging it.
async fn next(notices: &mut EvictionNotices) -> Option<EvictionNotice> {
    let bound = idemkey_sqlite::EVICTION_POLL * 120;
    tokio::time::timeout(bound, notices.next())
        .await
        .expect("the follower hands out a notice")
}

/// Both stores on one new file, its migrations run.
async fn both_stores() -> (tempfile::TempDir, SqliteStore, RusqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("evictions.db");
    let sqlx = SqliteStore::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    sqlx.migrate().await.unwrap();
    let rusqlite = RusqliteStore::open(&path).unwrap();
    (dir, sqlx, rusqlite)
}

#[tokio::test]
async fn an_eviction_reaches_a_sqlx_store_from_a_rusqlite_one() {
    let (_dir, sqlx, rusqlite) = both_stores().await;
    an_announced_eviction_reaches_the_follower(&sqlx, &rusqlite).await;
}

#[tokio::test]
async fn an_eviction_reaches_a_rusqlite_store_from_a_sqlx_one() {
    let (_dir, sqlx, rusqlite) = both_stores().await;
    an_announced_eviction_reaches_the_follower(&rusqlite, &sqlx).await;
}
