//! External mode: reservations, leases, takeovers and the point of no return.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::protocol::{self, ClaimOutcome, Lease, Resolution};
use idemkey_core::{ListFilter, RecordId, RecordState, Store, StoreAdmin, Timestamp};
use tokio::sync::Barrier;

use super::{HOUR, Harness, RETENTION, claim_at, fetch, fp, record_id, reserve_owned, response};

/// External mode: a reservation commits at once and holds off other attempts while its
/// lease lives; the owner completes with its token and retries replay.
pub async fn reservation_holds_the_key_while_leased<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-ext");
    let now = Timestamp::now();
    let lease = Duration::from_secs(30);
    let first = protocol::reserve(&store, &claim_at(&id, 1, now), lease)
        .await
        .expect("reserve");
    let ClaimOutcome::Owned { token, .. } = first else {
        panic!("{first:?}")
    };
    let second = protocol::reserve(&store, &claim_at(&id, 1, now), lease)
        .await
        .expect("reserve");
    assert_eq!(
        second,
        ClaimOutcome::InFlight {
            lease_expires_at: Some(now.plus(lease)),
            expires_at: Some(now.plus(RETENTION)),
        }
    );
    let owner = Lease::new(store.clone(), id.clone(), token, lease);
    owner.renew().await.expect("renew");
    owner
        .point_of_no_return()
        .await
        .expect("point of no return");
    owner
        .complete(&response("{\"ok\":true}"))
        .await
        .expect("complete");
    let third = protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
        .await
        .expect("reserve");
    assert!(matches!(third, ClaimOutcome::Replay { .. }), "{third:?}");
}

/// A lapsed lease before the point of no return is taken over; the stale owner can then
/// neither renew, pass the point of no return, complete nor release.
pub async fn takeover_before_point_of_no_return_fences_the_stale_owner<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-takeover");
    let lease = Duration::from_secs(30);
    let then = Timestamp::now().minus(HOUR);
    let ClaimOutcome::Owned { token: stale, .. } =
        protocol::reserve(&store, &claim_at(&id, 1, then), lease)
            .await
            .expect("reserve")
    else {
        panic!("first reservation must own the key")
    };
    // The first owner's lease lapsed an hour ago: the next attempt takes over.
    let outcome = protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
        .await
        .expect("reserve");
    let ClaimOutcome::Owned { token: fresh, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(fresh > stale);
    let stale_owner = Lease::new(store.clone(), id.clone(), stale, lease);
    assert!(matches!(
        stale_owner.renew().await,
        Err(protocol::Error::Fenced)
    ));
    assert!(matches!(
        stale_owner.point_of_no_return().await,
        Err(protocol::Error::Fenced)
    ));
    assert!(matches!(
        stale_owner
            .clone()
            .complete(&response("{\"stale\":true}"))
            .await,
        Err(protocol::Error::Fenced)
    ));
    assert!(matches!(
        stale_owner.release().await,
        Err(protocol::Error::Fenced)
    ));
    Lease::new(store.clone(), id.clone(), fresh, lease)
        .complete(&response("{\"fresh\":true}"))
        .await
        .expect("the new owner completes");
    let record = fetch(&h, &id).await.expect("record");
    assert_eq!(record.response.expect("response").body, b"{\"fresh\":true}");
}

/// A key claimed anew after its record was released starts at a token no earlier claim
/// held: the earlier owner, late (its answer lost, its lease long lapsed), can neither
/// release, complete, mark indeterminate nor renew the new claim, whether the record was
/// released by a reconciler (the other service knew nothing of the operation) or by an
/// operator's resolution. The new owner completes, and retries replay its outcome.
pub async fn claim_anew_after_release_fences_the_earlier_owner<H: Harness>(h: H) {
    let store = h.store().clone();
    let lease = Duration::from_secs(30);
    for (key, by_operator) in [("k-anew-reconciled", false), ("k-anew-resolved", true)] {
        let id = record_id("t1", "/v1/transfers", key);
        // Owner 0 reserved an hour ago, marking the point of no return; its lease lapsed.
        let then = Timestamp::now().minus(HOUR);
        let claim = claim_at(&id, 1, then);
        let ClaimOutcome::Owned { token: stale, .. } =
            protocol::reserve_at_point_of_no_return(&store, &claim, lease)
                .await
                .expect("reserve")
        else {
            panic!("a fresh key is owned")
        };
        let owner_0 = Lease::new(store.clone(), id.clone(), stale, lease);

        // The record is in doubt and the other service never saw the operation: released.
        let now = Timestamp::now();
        if by_operator {
            protocol::resolve(
                &store,
                &id,
                &Resolution::Released,
                "operator:test",
                None,
                now,
            )
            .await
            .expect("resolve");
        } else {
            let mut conn = store.acquire_for_write().await.expect("acquire");
            let held = store.fetch(&mut conn, &id).await.expect("fetch");
            let held = held.expect("the record").token;
            assert!(store.release(&mut conn, &id, held).await.expect("release"));
        }
        assert!(fetch(&h, &id).await.is_none(), "released");

        // Another request claims the key anew and calls out.
        let fresh = reserve_owned(&store, &claim_at(&id, 2, now), lease).await;
        let owner_1 = Lease::new(store.clone(), id.clone(), fresh, lease);
        owner_1
            .point_of_no_return()
            .await
            .expect("point of no return");
        let claimed = fetch(&h, &id).await.expect("the new claim");

        // Owner 0's late writes change nothing.
        let late = [
            ("release", owner_0.release().await),
            ("complete", owner_0.complete(&response("{\"by\":0}")).await),
            ("mark indeterminate", owner_0.mark_indeterminate().await),
            ("renew", owner_0.renew().await),
        ];
        for (write, result) in late {
            assert!(
                matches!(result, Err(protocol::Error::Fenced)),
                "owner 0's late {write} ({key}): {result:?}"
            );
        }
        assert_eq!(fetch(&h, &id).await, Some(claimed), "the new claim stays");

        owner_1
            .complete(&response("{\"by\":1}"))
            .await
            .expect("owner 1 completes");
        let retry = protocol::reserve(&store, &claim_at(&id, 2, Timestamp::now()), lease)
            .await
            .expect("retry");
        assert!(
            matches!(&retry, ClaimOutcome::Replay { response: r, .. } if *r == response("{\"by\":1}")),
            "{retry:?}"
        );
    }
}

/// A lapsed lease after the point of no return makes the record indeterminate; it is never
/// handed out for execution again until an operator resolves it.
pub async fn lapsed_lease_after_point_of_no_return_turns_indeterminate<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-unknown");
    let lease = Duration::from_secs(30);
    let token = reserve_owned(&store, &claim_at(&id, 1, Timestamp::now()), lease).await;
    Lease::new(store.clone(), id.clone(), token, lease)
        .point_of_no_return()
        .await
        .expect("point of no return");
    // Seen from an hour later, the owner's lease has lapsed after the point of no return.
    let later = Timestamp::now().plus(HOUR);
    for _ in 0..3 {
        let outcome = protocol::reserve(&store, &claim_at(&id, 1, later), lease)
            .await
            .expect("reserve");
        assert!(
            matches!(outcome, ClaimOutcome::OutcomeUnknown { .. }),
            "{outcome:?}"
        );
    }
    let record = fetch(&h, &id).await.expect("record");
    assert_eq!(record.state, RecordState::Indeterminate);
    let mut conn = store.acquire().await.expect("acquire");
    let listed = store
        .list(
            &mut conn,
            &ListFilter {
                state: Some(RecordState::Indeterminate),
                ..ListFilter::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(listed.len(), 1);
    drop(conn);

    protocol::resolve(
        &store,
        &id,
        &Resolution::Completed(response("{\"resolved\":1}")),
        "operator:test",
        None,
        Timestamp::now(),
    )
    .await
    .expect("resolve");
    let outcome = protocol::reserve(&store, &claim_at(&id, 1, later), lease)
        .await
        .expect("reserve");
    assert!(
        matches!(&outcome, ClaimOutcome::Replay { response, .. } if response.body == b"{\"resolved\":1}"),
        "{outcome:?}"
    );
    // The stale owner cannot overwrite the operator's answer.
    let late = Lease::new(store.clone(), id.clone(), token, lease)
        .complete(&response("{\"late\":1}"))
        .await;
    assert!(matches!(late, Err(protocol::Error::Fenced)), "{late:?}");
    // Resolving a completed record is refused.
    let again = protocol::resolve(
        &store,
        &id,
        &Resolution::Released,
        "operator:test",
        None,
        Timestamp::now(),
    )
    .await;
    assert!(
        matches!(again, Err(protocol::Error::NotIndeterminate(_))),
        "{again:?}"
    );
}

/// A reservation that marks the point of no return in its own write: it holds off other
/// attempts like any reservation and completes with its token; its owner passes the point of
/// no return without a write while the reservation's lease lives and is refused after; a
/// lapsed one is never taken over (the request may have left) but turns indeterminate; and
/// an owner that knows nothing left can still release the key.
pub async fn reservation_marked_at_the_point_of_no_return<H: Harness>(h: H) {
    let store = h.store().clone();
    let lease = Duration::from_secs(30);
    let reserve = |id: RecordId, at: Timestamp| {
        let store = store.clone();
        async move {
            protocol::reserve_at_point_of_no_return(&store, &claim_at(&id, 1, at), lease)
                .await
                .expect("reserve")
        }
    };
    let owned = |outcome: ClaimOutcome| match outcome {
        ClaimOutcome::Owned { token, .. } => token,
        other => panic!("must own the key: {other:?}"),
    };

    // Completed by its owner.
    let done = record_id("t1", "/v1/transfers", "k-marked-done");
    let now = Timestamp::now();
    let token = owned(reserve(done.clone(), now).await);
    assert_eq!(
        fetch(&h, &done).await.expect("record").state,
        RecordState::Executing
    );
    let second = reserve(done.clone(), now).await;
    assert!(
        matches!(second, ClaimOutcome::InFlight { .. }),
        "{second:?}"
    );
    let owner = Lease::new(store.clone(), done.clone(), token, lease).marked_at_reservation(now);
    owner.point_of_no_return().await.expect("inside the lease");
    owner
        .complete(&response("{\"ok\":true}"))
        .await
        .expect("complete");
    let replay = reserve(done.clone(), Timestamp::now()).await;
    assert!(matches!(replay, ClaimOutcome::Replay { .. }), "{replay:?}");

    // Lapsed: never taken over, and its owner may no longer send.
    let lapsed = record_id("t1", "/v1/transfers", "k-marked-lapsed");
    let then = Timestamp::now().minus(HOUR);
    let token = owned(reserve(lapsed.clone(), then).await);
    let late = Lease::new(store.clone(), lapsed.clone(), token, lease).marked_at_reservation(then);
    assert!(matches!(
        late.point_of_no_return().await,
        Err(protocol::Error::Fenced)
    ));
    let retry = reserve(lapsed.clone(), Timestamp::now()).await;
    assert!(
        matches!(retry, ClaimOutcome::OutcomeUnknown { .. }),
        "{retry:?}"
    );
    assert_eq!(
        fetch(&h, &lapsed).await.expect("record").state,
        RecordState::Indeterminate
    );

    // Nothing left: the owner releases, and the next attempt executes.
    let freed = record_id("t1", "/v1/transfers", "k-marked-freed");
    let token = owned(reserve(freed.clone(), now).await);
    Lease::new(store.clone(), freed.clone(), token, lease)
        .marked_at_reservation(now)
        .release()
        .await
        .expect("release");
    owned(reserve(freed.clone(), Timestamp::now()).await);
}

/// External mode under a race, as the gateway makes it: 50 keys × 4 concurrent
/// reservations (each claimant with a body of its own; the losers are answered in flight or
/// mismatched), then every owner's completion beside a stale one per key and the
/// reservations of 50 more keys × 4, all at once. A store may commit such concurrent writes
/// together, reservations and completions in one group ([`Store::insert_autocommit`],
/// [`Store::complete_autocommit`]); each must still be answered as if written alone: one
/// owner per key, whose own record was stored; every stale completion refused; every
/// owner's outcome replayed to its own body, and a mismatch to the others.
pub async fn concurrent_reservations_and_completions_answer_each_writer<H: Harness>(h: H) {
    const KEYS: usize = 50;
    const CLAIMANTS: u8 = 4;
    let lease = Duration::from_secs(30);
    let store = h.store().clone();
    let now = Timestamp::now();
    let id = |k: usize| record_id("t1", "/v1/transfers", &format!("race-{k}"));

    // Every claimant of keys `keys` reserves once `barrier` lets it.
    let race = |keys: std::ops::Range<usize>, barrier: Arc<Barrier>| {
        let mut tasks = Vec::new();
        for k in keys {
            for body in 1..=CLAIMANTS {
                let (store, barrier, claim) =
                    (store.clone(), barrier.clone(), claim_at(&id(k), body, now));
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let outcome = protocol::reserve_at_point_of_no_return(&store, &claim, lease)
                        .await
                        .expect("reserve");
                    (k, body, outcome)
                }));
            }
        }
        tasks
    };
    // One owner per key, holding its own record.
    let owners_of = async |tasks: Vec<tokio::task::JoinHandle<(usize, u8, ClaimOutcome)>>| {
        let mut owners: HashMap<usize, (u8, i64)> = HashMap::new();
        for task in tasks {
            match task.await.expect("task") {
                (k, body, ClaimOutcome::Owned { token, .. }) => {
                    assert!(
                        owners.insert(k, (body, token)).is_none(),
                        "key {k} owned twice"
                    );
                }
                // The owner's record answers another body with a mismatch.
                (_, _, ClaimOutcome::InFlight { .. } | ClaimOutcome::Mismatch { .. }) => {}
                (_, _, other) => panic!("a reserved key is not the others': {other:?}"),
            }
        }
        assert_eq!(owners.len(), KEYS, "every key has its owner");
        for (&k, &(body, _)) in &owners {
            let record = fetch(&h, &id(k)).await.expect("record");
            assert_eq!(record.state, RecordState::Executing);
            assert_eq!(
                record.fingerprint,
                fp(body),
                "key {k} holds its owner's record"
            );
        }
        owners
    };
    let claimants = KEYS * usize::from(CLAIMANTS);
    let owners = owners_of(race(0..KEYS, Arc::new(Barrier::new(claimants)))).await;

    // The owners complete, each beside a stale completion, while 50 more keys are raced.
    let barrier = Arc::new(Barrier::new(2 * KEYS + claimants));
    let more = race(KEYS..2 * KEYS, barrier.clone());
    let mut tasks = Vec::new();
    for (&k, &(_, token)) in &owners {
        for stale in [false, true] {
            let (store, barrier) = (store.clone(), barrier.clone());
            let token = if stale { token - 1 } else { token };
            let owner = Lease::new(store, id(k), token, lease);
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let done = owner.complete(&response(&format!("{{\"key\":{k}}}"))).await;
                (k, stale, done)
            }));
        }
    }
    for task in tasks {
        match task.await.expect("task") {
            (_, false, done) => done.expect("the owner completes"),
            (k, true, done) => assert!(
                matches!(done, Err(protocol::Error::Fenced)),
                "key {k}: a stale completion is refused: {done:?}"
            ),
        }
    }
    owners_of(more).await;
    for (&k, &(body, _)) in &owners {
        let replay = protocol::reserve_at_point_of_no_return(
            &store,
            &claim_at(&id(k), body, Timestamp::now()),
            lease,
        )
        .await
        .expect("replay");
        match replay {
            ClaimOutcome::Replay { response, .. } => {
                assert_eq!(response.body, format!("{{\"key\":{k}}}").into_bytes())
            }
            other => panic!("key {k}: the owner's outcome is replayed: {other:?}"),
        }
        let other = protocol::reserve_at_point_of_no_return(
            &store,
            &claim_at(&id(k), body % CLAIMANTS + 1, Timestamp::now()),
            lease,
        )
        .await
        .expect("mismatch");
        assert!(
            matches!(other, ClaimOutcome::Mismatch { .. }),
            "key {k}: another body mismatches: {other:?}"
        );
    }
}
