//! The operator's statements: releasing a record, the audit trail, listing and eviction.

use std::time::Duration;

use idemkey_core::protocol::{self, ClaimOutcome, Lease, Resolution};
use idemkey_core::{ListFilter, Store, StoreAdmin, Timestamp};

use super::{HOUR, Harness, claim_at, fetch, record_id, reserve_owned, run_once};

/// An operator may release an indeterminate operation; the next attempt executes it.
pub async fn released_indeterminate_record_executes_again<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-release");
    let lease = Duration::from_secs(30);
    let token = reserve_owned(&store, &claim_at(&id, 1, Timestamp::now()), lease).await;
    let owner = Lease::new(store.clone(), id.clone(), token, lease);
    owner
        .point_of_no_return()
        .await
        .expect("point of no return");
    owner.mark_indeterminate().await.expect("indeterminate");
    let outcome = protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
        .await
        .expect("reserve");
    assert!(
        matches!(outcome, ClaimOutcome::OutcomeUnknown { .. }),
        "{outcome:?}"
    );
    protocol::resolve(
        &store,
        &id,
        &Resolution::Released,
        "operator:test",
        None,
        Timestamp::now(),
    )
    .await
    .expect("resolve");
    let outcome = protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
        .await
        .expect("reserve");
    assert!(matches!(outcome, ClaimOutcome::Owned { .. }), "{outcome:?}");
}

/// A released reservation (nothing was sent) frees the key at once.
pub async fn released_reservation_frees_the_key<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-free");
    let lease = Duration::from_secs(30);
    let token = reserve_owned(&store, &claim_at(&id, 1, Timestamp::now()), lease).await;
    Lease::new(store.clone(), id.clone(), token, lease)
        .release()
        .await
        .expect("release");
    assert!(fetch(&h, &id).await.is_none());
    let outcome = protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
        .await
        .expect("reserve");
    assert!(matches!(outcome, ClaimOutcome::Owned { .. }), "{outcome:?}");
}

/// External mode keeps the sealed key with the record (and a takeover replaces it); every
/// resolution appends an audit entry that outlives a released record.
pub async fn resolutions_are_audited_and_sealed_keys_kept<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-audit");
    let lease = Duration::from_secs(30);
    let mut claim = claim_at(&id, 1, Timestamp::now().minus(HOUR));
    claim.sealed_key = Some(b"sealed-1".to_vec());
    let token = reserve_owned(&store, &claim, lease).await;
    let record = fetch(&h, &id).await.expect("record");
    assert_eq!(record.sealed_key.as_deref(), Some(&b"sealed-1"[..]));
    // The lease lapsed before the point of no return: a takeover writes its own sealed key.
    claim.now = Timestamp::now();
    claim.sealed_key = Some(b"sealed-2".to_vec());
    let ClaimOutcome::Owned { token: fresh, .. } = protocol::reserve(&store, &claim, lease)
        .await
        .expect("reserve")
    else {
        panic!("the lapsed reservation is taken over")
    };
    assert!(fresh > token);
    let record = fetch(&h, &id).await.expect("record");
    assert_eq!(record.sealed_key.as_deref(), Some(&b"sealed-2"[..]));
    let owner = Lease::new(store.clone(), id.clone(), fresh, lease);
    owner
        .point_of_no_return()
        .await
        .expect("point of no return");
    owner.mark_indeterminate().await.expect("indeterminate");
    protocol::resolve(
        &store,
        &id,
        &Resolution::Released,
        "operator:alice",
        Some("checked the ledger"),
        Timestamp::now(),
    )
    .await
    .expect("resolve");
    assert!(fetch(&h, &id).await.is_none(), "released");
    let mut conn = store.acquire().await.expect("acquire");
    let trail = store.audit(&mut conn, &id).await.expect("audit");
    assert_eq!(trail.len(), 1, "{trail:?}");
    assert_eq!(trail[0].id, id);
    assert_eq!(trail[0].actor, "operator:alice");
    assert_eq!(trail[0].action, "resolved-released");
    assert_eq!(trail[0].detail, "key released; checked the ledger");
    // A refused resolution writes nothing.
    let refused = protocol::resolve(
        &store,
        &id,
        &Resolution::Released,
        "x",
        None,
        Timestamp::now(),
    )
    .await;
    assert!(
        matches!(refused, Err(protocol::Error::NotFound)),
        "{refused:?}"
    );
    assert_eq!(store.audit(&mut conn, &id).await.expect("audit").len(), 1);
    let other = store
        .audit(&mut conn, &record_id("t2", "/v1/transfers", "k-audit"))
        .await
        .expect("audit");
    assert!(other.is_empty());
}

/// Operators list by tenant, state and age, and evict a record.
pub async fn operator_queries_list_and_evict<H: Harness>(h: H) {
    let store = h.store();
    let base = Timestamp::now().minus(HOUR);
    for (i, tenant) in ["t1", "t1", "t2"].iter().enumerate() {
        let id = record_id(tenant, "/v1/payments", &format!("op-{i}"));
        let at = base.plus(Duration::from_secs(60 * i as u64));
        run_once(&h, &claim_at(&id, 1, at), "op", "{}").await;
    }
    let mut conn = store.acquire().await.expect("acquire");
    let t1 = store
        .list(
            &mut conn,
            &ListFilter {
                tenant: Some("t1".into()),
                ..ListFilter::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(t1.len(), 2);
    assert!(t1[0].created_at > t1[1].created_at, "newest first");
    let older = store
        .list(
            &mut conn,
            &ListFilter {
                created_before: Some(base.plus(Duration::from_secs(90))),
                ..ListFilter::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(older.len(), 2);
    let limited = store
        .list(
            &mut conn,
            &ListFilter {
                limit: 1,
                ..ListFilter::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(limited.len(), 1);
    let victim = record_id("t2", "/v1/payments", "op-2");
    assert!(store.evict(&mut conn, &victim).await.expect("evict"));
    assert!(!store.evict(&mut conn, &victim).await.expect("evict"));
    assert!(
        store
            .fetch(&mut conn, &victim)
            .await
            .expect("fetch")
            .is_none()
    );
}
