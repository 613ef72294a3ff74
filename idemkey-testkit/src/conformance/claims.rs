//! Claims in a transaction: a fresh key owned and replayed, a mismatch named, what a
//! record stores (member digests, the first attempt's time, its scope) read back as written.

use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    Fingerprint, FingerprintSpec, IdempotencyKey, Inserted, NewRecord, RecordId, RecordState,
    RequestParts, Store, StoreAdmin, Timestamp,
};

use super::{HOUR, Harness, RETENTION, claim_at, fetch, fp, hasher, record_id, response, run_once};

/// A fresh key is owned; the retry replays the stored response byte for byte.
pub async fn claims_fresh_key_then_replays<H: Harness>(h: H) {
    let id = record_id("t1", "/v1/payments", "k-1");
    let now = Timestamp::now();
    let first = run_once(&h, &claim_at(&id, 1, now), "k-1", "{\"id\":1}").await;
    assert!(matches!(first, ClaimOutcome::Owned { .. }), "{first:?}");
    let again = run_once(&h, &claim_at(&id, 1, now), "k-1", "{\"id\":2}").await;
    assert_eq!(
        again,
        ClaimOutcome::Replay {
            response: response("{\"id\":1}"),
            expires_at: now.plus(RETENTION),
            first_sent: None,
        }
    );
    assert_eq!(h.count_effects().await, 1);
    let record = fetch(&h, &id).await.expect("record exists");
    assert_eq!(record.state, RecordState::Completed);
}

/// A claim on a key completed earlier gets the record from the claim's insert itself (on
/// PostgreSQL that is one statement: no second read) and replays it, in a transaction and
/// in external mode alike; nothing is written.
pub async fn claim_on_completed_key_returns_the_record<H: Harness>(h: H) {
    let store = h.store();
    let id = record_id("t1", "/v1/payments", "k-done");
    let now = Timestamp::now();
    run_once(&h, &claim_at(&id, 1, now), "k-done", "{\"id\":1}").await;
    let stored = fetch(&h, &id).await.expect("record");
    assert_eq!(stored.state, RecordState::Completed);

    let new = NewRecord {
        id: id.clone(),
        fingerprint: fp(1),
        state: RecordState::Executing,
        token: idemkey_core::fresh_token(),
        lease_expires_at: None,
        now,
        expires_at: now.plus(RETENTION),
        sealed_key: None,
        first_sent: None,
    };
    let mut tx = store.begin().await.expect("begin");
    let found = store.insert(&mut tx, &new).await.expect("insert");
    assert_eq!(found, Inserted::Existing(Box::new(stored.clone())));
    let outcome = protocol::claim(store, &mut tx, &claim_at(&id, 1, now))
        .await
        .expect("claim");
    let replay = ClaimOutcome::Replay {
        response: response("{\"id\":1}"),
        expires_at: now.plus(RETENTION),
        first_sent: None,
    };
    assert_eq!(outcome, replay);
    store.commit(tx).await.expect("commit");

    let reserved = protocol::reserve(store, &claim_at(&id, 1, now), HOUR)
        .await
        .expect("reserve");
    assert_eq!(reserved, replay);
    assert_eq!(
        fetch(&h, &id).await,
        Some(stored),
        "the record is unchanged"
    );
    assert_eq!(h.count_effects().await, 1);
}

/// The same key with another request is refused, naming the part that differs.
pub async fn rejects_mismatched_fingerprint<H: Harness>(h: H) {
    let id = record_id("t1", "/v1/payments", "k-1");
    let now = Timestamp::now();
    run_once(&h, &claim_at(&id, 1, now), "k-1", "{}").await;
    let other = run_once(&h, &claim_at(&id, 2, now), "k-1", "{}").await;
    match other {
        ClaimOutcome::Mismatch {
            mismatch: m,
            expires_at,
        } => {
            assert!(m.body && !m.params && !m.query);
            assert_eq!(
                expires_at,
                now.plus(RETENTION),
                "the stored record's expiry"
            );
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    assert_eq!(h.count_effects().await, 1);
}

/// The fingerprint of a JSON `POST /v1/payments` with `body`, member digests included.
pub fn json_fp(body: &str) -> Fingerprint {
    idemkey_core::fingerprint(
        &RequestParts {
            method: "POST",
            route: "/v1/payments",
            path_params: &[],
            query: None,
            content_type: Some("application/json"),
            body: body.as_bytes(),
        },
        &FingerprintSpec::default(),
    )
}

/// The member digests of a JSON body are stored with the claim and with a takeover, read
/// back equal (digests only, never pointers), and name the first differing member of a
/// mismatched retry; a body without them stores none.
pub async fn member_digests_round_trip<H: Harness>(h: H) {
    let key = record_id("t1", "/v1/payments", "k-members");
    let now = Timestamp::now();
    let first = json_fp(r#"{"amount":500,"currency":"EUR","items":[{"qty":1},{"qty":2}]}"#);
    let claim = Claim {
        fingerprint: first.clone(),
        ..claim_at(&key, 1, now)
    };
    run_once(&h, &claim, "k-members", "{}").await;
    let record = fetch(&h, &key).await.expect("record");
    let stored = record.fingerprint.members.expect("members stored");
    assert_eq!(Some(&stored), first.members.as_ref());
    assert_eq!(stored.digests().len(), 8);
    assert!(stored.pointers().is_empty(), "no pointer is stored");

    let retry = Claim {
        fingerprint: json_fp(r#"{"items":[{"qty":1},{"qty":2}],"currency":"EUR","amount":600}"#),
        ..claim_at(&key, 1, now)
    };
    match run_once(&h, &retry, "k-members", "{}").await {
        ClaimOutcome::Mismatch { mismatch, .. } => {
            assert_eq!(mismatch.pointer.as_deref(), Some("/amount"), "{mismatch:?}");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }

    // A takeover of the expired record writes the new request's digests.
    let later = now.plus(RETENTION);
    let second = json_fp(r#"{"amount":7}"#);
    let takeover = Claim {
        fingerprint: second.clone(),
        ..claim_at(&key, 1, later)
    };
    let outcome = run_once(&h, &takeover, "k-members", "{}").await;
    assert!(matches!(outcome, ClaimOutcome::Owned { .. }), "{outcome:?}");
    let record = fetch(&h, &key).await.expect("record");
    assert_eq!(record.fingerprint.members, second.members);

    // A fingerprint without member digests stores none.
    let plain = record_id("t1", "/v1/payments", "k-no-members");
    run_once(&h, &claim_at(&plain, 1, now), "k-no-members", "{}").await;
    let record = fetch(&h, &plain).await.expect("record");
    assert_eq!(record.fingerprint.members, None);
}

/// Tenants and routes with quotes, backslashes and non-ASCII text are stored and found
/// again as they are, on every path a claim takes (fresh, replay, mismatch).
pub async fn scope_text_is_stored_as_given<H: Harness>(h: H) {
    let tenant = "t'; DROP TABLE idemkey_records; --\\";
    let route = "/v1/it's/\\x41/ünï";
    let id = record_id(tenant, route, "k-text");
    let now = Timestamp::now();
    let first = run_once(&h, &claim_at(&id, 1, now), "k-text", "{\"n\":1}").await;
    assert!(matches!(first, ClaimOutcome::Owned { .. }), "{first:?}");
    let again = run_once(&h, &claim_at(&id, 1, now), "k-text", "{}").await;
    assert!(
        matches!(&again, ClaimOutcome::Replay { response, .. } if response.body == b"{\"n\":1}"),
        "{again:?}"
    );
    let other = run_once(&h, &claim_at(&id, 2, now), "k-text", "{}").await;
    assert!(matches!(other, ClaimOutcome::Mismatch { .. }), "{other:?}");
    let record = fetch(&h, &id).await.expect("record");
    assert_eq!(record.id.tenant, tenant);
    assert_eq!(record.id.route, id.route);
    assert!(record.id.route.ends_with(route), "{}", record.id.route);
    assert_eq!(h.count_effects().await, 1);
}

/// The first attempt's time is stored with the record by every write that claims one (the
/// layer's claim, a claim on the caller's transaction, a reservation, a takeover) and read
/// back; a retry stating the same time, or none, replays, one stating another time is a
/// mismatch naming it.
pub async fn first_sent_is_stored_and_compared<H: Harness>(h: H) {
    let store = h.store().clone();
    let now = Timestamp::now();
    let sent = |secs: u64| Some(now.minus(Duration::from_secs(secs)));
    let stating = |id: &RecordId, first_sent| Claim {
        first_sent,
        ..claim_at(id, 1, now)
    };

    let claimed = record_id("t1", "/v1/payments", "k-sent-claimed");
    run_once(&h, &stating(&claimed, sent(10)), "claimed", "{}").await;
    let on_tx = record_id("t1", "/v1/payments", "k-sent-on-tx");
    let mut tx = store.begin().await.expect("begin");
    let owned = protocol::claim(&store, &mut tx, &stating(&on_tx, sent(20)))
        .await
        .expect("claim");
    assert!(matches!(owned, ClaimOutcome::Owned { .. }), "{owned:?}");
    store.commit(tx).await.expect("commit");
    let reserved = record_id("t1", "/v1/transfers", "k-sent-reserved");
    let owned = protocol::reserve(&store, &stating(&reserved, sent(30)), HOUR)
        .await
        .expect("reserve");
    assert!(matches!(owned, ClaimOutcome::Owned { .. }), "{owned:?}");
    let taken_over = record_id("t1", "/v1/payments", "k-sent-taken-over");
    let then = now.minus(RETENTION + HOUR);
    run_once(&h, &claim_at(&taken_over, 1, then), "old", "{}").await;
    let owned = run_once(&h, &stating(&taken_over, sent(40)), "new", "{}").await;
    assert!(matches!(owned, ClaimOutcome::Owned { .. }), "{owned:?}");
    for (id, expected) in [
        (&claimed, sent(10)),
        (&on_tx, sent(20)),
        (&reserved, sent(30)),
        (&taken_over, sent(40)),
    ] {
        let record = fetch(&h, id).await.expect("record");
        assert_eq!(record.first_sent, expected, "{:?}", id.route);
    }

    let effects = h.count_effects().await;
    for stated in [sent(10), None] {
        let again = run_once(&h, &stating(&claimed, stated), "again", "{}").await;
        assert!(
            matches!(again, ClaimOutcome::Replay { first_sent, .. } if first_sent == sent(10)),
            "{stated:?}: {again:?}"
        );
    }
    match run_once(&h, &stating(&claimed, sent(11)), "changed", "{}").await {
        ClaimOutcome::Mismatch { mismatch, .. } => {
            assert!(mismatch.first_sent && !mismatch.body, "{mismatch:?}");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    assert_eq!(h.count_effects().await, effects, "no retry ran");
}

/// The same key in two tenants, or on two routes, names two independent records.
pub async fn scopes_are_independent<H: Harness>(h: H) {
    let now = Timestamp::now();
    for (tenant, route) in [("t1", "/a"), ("t2", "/a"), ("t1", "/b")] {
        let id = record_id(tenant, route, "shared-key");
        let outcome = run_once(&h, &claim_at(&id, 1, now), tenant, "{}").await;
        assert!(
            matches!(outcome, ClaimOutcome::Owned { .. }),
            "{tenant} {route}: {outcome:?}"
        );
    }
    assert_eq!(h.count_effects().await, 3);
    let mut conn = h.store().acquire().await.expect("acquire");
    let key = IdempotencyKey::parse(b"shared-key").expect("key");
    let t1 = h
        .store()
        .find_by_key(&mut conn, "t1", &hasher().key_hash("t1", &key))
        .await
        .expect("find");
    assert_eq!(t1.len(), 2, "t1 has the key on two routes");
    assert!(t1.iter().all(|r| r.id.tenant == "t1"));
}
