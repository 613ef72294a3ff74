//! Expiry and retention: expired records claimed anew, late look-ups, and purges.

use std::sync::Arc;
use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{ListFilter, Purged, Store, StoreAdmin, Timestamp};
use tokio::sync::Barrier;

use super::{HOUR, Harness, RETENTION, claim_at, fetch, record_id, run_once};

/// Expired records are never replayed, and the key can be claimed anew (the work runs
/// again: the documented limit of retention).
pub async fn expired_record_is_claimed_anew<H: Harness>(h: H) {
    let id = record_id("t1", "/v1/payments", "k-old");
    let then = Timestamp::now().minus(RETENTION + HOUR);
    run_once(&h, &claim_at(&id, 1, then), "k-old", "{\"n\":1}").await;
    let now = Timestamp::now();
    // Even a different request may use the key once the old record expired.
    let again = run_once(&h, &claim_at(&id, 2, now), "k-old-2", "{\"n\":2}").await;
    assert!(matches!(again, ClaimOutcome::Owned { .. }), "{again:?}");
    let replay = run_once(&h, &claim_at(&id, 2, now), "k-old-3", "{}").await;
    assert!(
        matches!(&replay, ClaimOutcome::Replay { response, .. } if response.body == b"{\"n\":2}"),
        "{replay:?}"
    );
    assert_eq!(h.count_effects().await, 2);
}

/// What the layer does for a first attempt too old for its record to be trusted: a look-up,
/// never a claim. A live record answers it (a replay); once the record is purged, nothing
/// does, and the look-up writes nothing, also when 32 attempts look it up at once.
pub async fn late_lookup_after_purge_finds_nothing_and_writes_nothing<H: Harness>(h: H) {
    let h = Arc::new(h);
    let store = h.store().clone();
    let id = record_id("t1", "/v1/payments", "k-purged");
    let then = Timestamp::now().minus(RETENTION + HOUR);
    let first = Claim {
        first_sent: Some(then),
        ..claim_at(&id, 1, then)
    };
    run_once(&*h, &first, "first", "{}").await;
    let live = protocol::lookup(&store, &id, &first.fingerprint, first.first_sent, then)
        .await
        .expect("look up");
    assert!(
        matches!(live, Some(ClaimOutcome::Replay { .. })),
        "{live:?}"
    );

    let now = Timestamp::now();
    assert_eq!(
        protocol::purge_expired(&store, now, 100)
            .await
            .expect("purge"),
        1
    );
    let barrier = Arc::new(Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (store, barrier, id, fp) = (
                store.clone(),
                barrier.clone(),
                id.clone(),
                first.fingerprint.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                protocol::lookup(&store, &id, &fp, Some(then), now).await
            })
        })
        .collect();
    for task in tasks {
        let answer = task.await.expect("task").expect("look up");
        assert_eq!(answer, None, "nothing answers a purged record");
    }
    assert!(fetch(&*h, &id).await.is_none(), "nothing was stored");
    assert_eq!(h.count_effects().await, 1, "nothing ran again");
}

/// Purge deletes expired records only, in batches of the configured size.
pub async fn purge_removes_expired_records_in_batches<H: Harness>(h: H) {
    let store = h.store();
    let old = Timestamp::now().minus(RETENTION + HOUR);
    for i in 0..25 {
        let id = record_id("t1", "/v1/payments", &format!("old-{i}"));
        run_once(&h, &claim_at(&id, 1, old), "old", "{}").await;
    }
    for i in 0..5 {
        let id = record_id("t1", "/v1/payments", &format!("new-{i}"));
        run_once(&h, &claim_at(&id, 1, Timestamp::now()), "new", "{}").await;
    }
    let now = Timestamp::now();
    let mut conn = store.acquire().await.expect("acquire");
    assert_eq!(
        store
            .purge_batch(&mut conn, now, None, 10)
            .await
            .expect("purge")
            .deleted,
        10
    );
    drop(conn);
    assert_eq!(
        protocol::purge_expired(store, now, 10)
            .await
            .expect("purge"),
        15
    );
    let mut conn = store.acquire().await.expect("acquire");
    let left = store
        .list(&mut conn, &ListFilter::default())
        .await
        .expect("list");
    assert_eq!(left.len(), 5);
    assert!(left.iter().all(|r| !r.is_expired(now)));
}

/// A purge batch deletes the earliest expiries first, from the expiry it is given on, and
/// says where the next batch starts.
pub async fn purge_takes_the_earliest_expiry_first_from_where_it_is_told<H: Harness>(h: H) {
    let store = h.store();
    let old = Timestamp::now().minus(RETENTION + HOUR);
    // Written out of expiry order: record `i` expired `i` minutes after record 0.
    for i in [3, 0, 5, 1, 4, 2] {
        let id = record_id("t1", "/v1/payments", &format!("old-{i}"));
        let at = old.plus(Duration::from_secs(60 * i));
        run_once(&h, &claim_at(&id, 1, at), "old", "{}").await;
    }
    let expiry = |i: u64| old.plus(Duration::from_secs(60 * i)).plus(RETENTION);
    let now = Timestamp::now();
    let mut conn = store.acquire().await.expect("acquire");
    let first = store
        .purge_batch(&mut conn, now, None, 2)
        .await
        .expect("purge");
    assert_eq!((first.deleted, first.through), (2, Some(expiry(1))));
    assert_eq!(
        minutes_after(store, &mut conn, expiry(0)).await,
        [2, 3, 4, 5]
    );
    // From record 4's expiry on: record 2 and 3 expired before it and stay.
    let from = store
        .purge_batch(&mut conn, now, Some(expiry(4)), 10)
        .await
        .expect("purge");
    assert_eq!((from.deleted, from.through), (2, Some(expiry(5))));
    assert_eq!(minutes_after(store, &mut conn, expiry(0)).await, [2, 3]);
    let none = store
        .purge_batch(&mut conn, now, Some(expiry(5)), 10)
        .await
        .expect("purge");
    assert_eq!(none, Purged::default());
    drop(conn);
    assert_eq!(
        protocol::purge_expired(store, now, 1).await.expect("purge"),
        2
    );
}

/// The expiries of the records left, in minutes after `base`, earliest first.
async fn minutes_after<S: StoreAdmin>(
    store: &S,
    conn: &mut S::Connection,
    base: Timestamp,
) -> Vec<i64> {
    let mut minutes: Vec<i64> = store
        .list(conn, &ListFilter::default())
        .await
        .expect("list")
        .iter()
        .map(|r| (r.expires_at.as_millis() - base.as_millis()) / 60_000)
        .collect();
    minutes.sort_unstable();
    minutes
}
