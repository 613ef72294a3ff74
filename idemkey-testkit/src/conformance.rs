//! The conformance suite: one set of behaviours every store must show, run against each
//! store by [`conformance_tests!`](crate::conformance_tests) on a fresh database per test.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome, Lease, Resolution};
use idemkey_core::{
    Fingerprint, FingerprintParts, FingerprintSpec, IdempotencyKey, Inserted, KeyHasher,
    ListFilter, NewRecord, Purged, RecordId, RecordState, RequestParts, Scope, Store,
    StoredResponse, Timestamp,
};
use tokio::sync::Barrier;

/// A store under test, on its own fresh database, with a table of effects the tests write
/// next to their claims.
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: Store;

    /// The store (migrated).
    fn store(&self) -> &Self::Store;

    /// Writes one effect row labelled `label` on `conn` (the claim's transaction).
    fn write_effect<'a>(
        &'a self,
        conn: &'a mut <Self::Store as Store>::Connection,
        label: &'a str,
    ) -> impl Future<Output = ()> + Send + 'a;

    /// How many effect rows are committed.
    fn count_effects(&self) -> impl Future<Output = i64> + Send + '_;

    /// Ends the transaction's database session abruptly, as a crashed client would leave it
    /// (for PostgreSQL: the server terminates the backend), without committing.
    fn sever(
        &self,
        tx: <Self::Store as Store>::Transaction,
    ) -> impl Future<Output = ()> + Send + '_;
}

const RETENTION: Duration = Duration::from_secs(24 * 3600);
const HOUR: Duration = Duration::from_secs(3600);

fn hasher() -> KeyHasher {
    KeyHasher::new(b"conformance-secret")
}

/// The record identity of `key` under tenant `tenant` and `POST route` (a fixed test secret).
pub fn record_id(tenant: &str, route: &str, key: &str) -> RecordId {
    let key = IdempotencyKey::parse(key.as_bytes()).expect("test keys are valid");
    hasher().record_id(&Scope::new(tenant, "POST", route), &key)
}

fn fp(body: u8) -> Fingerprint {
    Fingerprint {
        digest: [body; 32],
        parts: FingerprintParts {
            params: [0; 8],
            query: [0; 8],
            body: [body; 8],
        },
        members: None,
    }
}

/// A claim of `id` at `now`, its fingerprint made of `body` (claims with another `body` mismatch).
pub fn claim_at(id: &RecordId, body: u8, now: Timestamp) -> Claim {
    Claim {
        id: id.clone(),
        fingerprint: fp(body),
        now,
        retention: RETENTION,
        sealed_key: None,
        first_sent: None,
    }
}

/// A 201 JSON response with `body`, as the conformance tests store it.
pub fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("location".into(), b"/v1/things/1".to_vec()),
        ],
        body: body.as_bytes().to_vec(),
    }
}

/// Claims `claim` as the layer does ([`protocol::begin_claim`]); when it owns the key,
/// writes an effect labelled `label` and stores `body` with the commit
/// ([`Store::complete_and_commit`]). Returns what the claim answered.
async fn run_once<H: Harness>(h: &H, claim: &Claim, label: &str, body: &str) -> ClaimOutcome {
    run_once_on(h, h.store(), claim, label, body).await
}

/// Claims `claim` on `store` (another store over the harness's database: one with another
/// pool, say) as the layer does, as the suite's own tests do on the harness's store: when it
/// owns the key, writes an effect labelled `label` and stores `body` with the commit.
/// Returns what the claim answered.
pub async fn run_once_on<H: Harness>(
    h: &H,
    store: &H::Store,
    claim: &Claim,
    label: &str,
    body: &str,
) -> ClaimOutcome {
    let (tx, outcome) = protocol::begin_claim(store, claim, None)
        .await
        .expect("claim");
    match (&outcome, tx) {
        (ClaimOutcome::Owned { token, .. }, Some(mut tx)) => {
            h.write_effect(&mut tx, label).await;
            store
                .complete_and_commit(tx, &claim.id, *token, &response(body), claim.now)
                .await
                .expect("complete and commit");
        }
        (_, Some(tx)) => store.commit(tx).await.expect("commit"),
        (_, None) => {}
    }
    outcome
}

/// Begins `claim` as the layer does ([`protocol::begin_claim`]) on a key that must be
/// fresh: the owner's transaction and token.
pub async fn begin_owned<S: Store>(store: &S, claim: &Claim) -> (S::Transaction, i64) {
    let (tx, outcome) = protocol::begin_claim(store, claim, None)
        .await
        .expect("claim");
    match (outcome, tx) {
        (ClaimOutcome::Owned { token, .. }, Some(tx)) => (tx, token),
        (outcome, _) => panic!("a fresh key is owned: {outcome:?}"),
    }
}

/// A completion with a stale token, sent with the commit, commits nothing: neither the
/// effect nor the claim; the key is free again.
pub async fn fenced_completion_commits_nothing<H: Harness>(h: H) {
    let store = h.store();
    let id = record_id("t1", "/v1/payments", "k-fenced");
    let claim = claim_at(&id, 1, Timestamp::now());
    let (mut tx, token) = begin_owned(store, &claim).await;
    h.write_effect(&mut tx, "k-fenced").await;
    let refused = store
        .complete_and_commit(tx, &id, token + 1, &response("{}"), claim.now)
        .await;
    assert!(
        matches!(refused, Err(idemkey_core::CommitError::Fenced)),
        "{refused:?}"
    );
    assert!(fetch(&h, &id).await.is_none());
    assert_eq!(h.count_effects().await, 0);
    let next = run_once(&h, &claim, "k-fenced", "{}").await;
    assert!(matches!(next, ClaimOutcome::Owned { .. }), "{next:?}");
    assert_eq!(h.count_effects().await, 1);
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

async fn fetch<H: Harness>(h: &H, id: &RecordId) -> Option<idemkey_core::Record> {
    let mut conn = h.store().acquire().await.expect("acquire");
    h.store().fetch(&mut conn, id).await.expect("fetch")
}

/// The fingerprint of a JSON request with `body`, member digests included.
fn json_fp(body: &str) -> Fingerprint {
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

/// A fresh key is owned; the retry replays the stored response byte for byte.
pub async fn claims_fresh_key_then_replays<H: Harness>(h: H) {
    let id = record_id("t1", "/v1/payments", "k-1");
    let now = Timestamp::now();
    let first = run_once(&h, &claim_at(&id, 1, now), "k-1", "{\"id\":1}").await;
    assert!(
        matches!(first, ClaimOutcome::Owned { token: 1, .. }),
        "{first:?}"
    );
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

/// 64 tasks claim one key at once: exactly one owns it, and every other one replays the
/// owner's response (or was told it is in flight).
pub async fn one_of_64_concurrent_claims_owns_the_key<H: Harness>(h: H) {
    let h = Arc::new(h);
    let barrier = Arc::new(Barrier::new(64));
    let id = record_id("t1", "/v1/payments", "contended");
    let now = Timestamp::now();
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let (h, barrier, claim) = (h.clone(), barrier.clone(), claim_at(&id, 1, now));
            tokio::spawn(async move {
                barrier.wait().await;
                run_once(&*h, &claim, "contended", &format!("{{\"winner\":{i}}}")).await
            })
        })
        .collect();
    let mut owners = 0;
    let mut replayed = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            ClaimOutcome::Owned { .. } => owners += 1,
            ClaimOutcome::Replay { response, .. } => replayed.push(response.body),
            ClaimOutcome::InFlight { .. } => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(owners, 1, "exactly one claimant owns the key");
    assert_eq!(h.count_effects().await, 1);
    let stored = fetch(&*h, &id)
        .await
        .expect("record")
        .response
        .expect("response");
    assert!(
        replayed.iter().all(|b| *b == stored.body),
        "replays are the stored body"
    );
}

/// 200 keys × 16 concurrent claimants, each writing its effect in its own transaction:
/// exactly 200 effects and 200 completed records.
pub async fn two_hundred_keys_sixteen_claimants_one_effect_each<H: Harness>(h: H) {
    const KEYS: usize = 200;
    const CLAIMANTS: usize = 16;
    let h = Arc::new(h);
    let barrier = Arc::new(Barrier::new(KEYS * CLAIMANTS));
    let now = Timestamp::now();
    let mut tasks = Vec::new();
    for k in 0..KEYS {
        for _ in 0..CLAIMANTS {
            let (h, barrier) = (h.clone(), barrier.clone());
            let key = format!("key-{k}");
            let claim = claim_at(&record_id("t1", "/v1/payments", &key), 1, now);
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let outcome = run_once(&*h, &claim, &key, &format!("{{\"key\":\"{key}\"}}")).await;
                (key, outcome)
            }));
        }
    }
    let mut owners: HashMap<String, usize> = HashMap::new();
    for task in tasks {
        let (key, outcome) = task.await.expect("task");
        match outcome {
            ClaimOutcome::Owned { .. } => *owners.entry(key).or_default() += 1,
            ClaimOutcome::Replay { response, .. } => {
                assert_eq!(response.body, format!("{{\"key\":\"{key}\"}}").into_bytes())
            }
            ClaimOutcome::InFlight { .. } => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(owners.len(), KEYS, "every key was executed");
    assert!(
        owners.values().all(|&n| n == 1),
        "no key was executed twice"
    );
    assert_eq!(h.count_effects().await, KEYS as i64);
    let mut conn = h.store().acquire().await.expect("acquire");
    let completed = h
        .store()
        .list(
            &mut conn,
            &ListFilter {
                state: Some(RecordState::Completed),
                limit: 10_000,
                ..ListFilter::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(completed.len(), KEYS);
}

/// An owner that rolls back leaves neither record nor effect; the next claim owns the key.
pub async fn rolled_back_owner_leaves_nothing<H: Harness>(h: H) {
    let store = h.store();
    let id = record_id("t1", "/v1/payments", "k-rb");
    let claim = claim_at(&id, 1, Timestamp::now());
    let mut tx = store.begin().await.expect("begin");
    let outcome = protocol::claim(store, &mut tx, &claim)
        .await
        .expect("claim");
    assert!(matches!(outcome, ClaimOutcome::Owned { .. }));
    h.write_effect(&mut tx, "k-rb").await;
    drop(tx); // rolled back
    assert!(fetch(&h, &id).await.is_none());
    assert_eq!(h.count_effects().await, 0);
    let next = run_once(&h, &claim, "k-rb", "{}").await;
    assert!(matches!(next, ClaimOutcome::Owned { .. }), "{next:?}");
    assert_eq!(h.count_effects().await, 1);
}

/// An owner whose session dies mid-transaction leaves neither record nor effect.
pub async fn severed_owner_leaves_nothing<H: Harness>(h: H) {
    let store = h.store();
    let id = record_id("t1", "/v1/payments", "k-sever");
    let claim = claim_at(&id, 1, Timestamp::now());
    let mut tx = store.begin().await.expect("begin");
    let outcome = protocol::claim(store, &mut tx, &claim)
        .await
        .expect("claim");
    assert!(matches!(outcome, ClaimOutcome::Owned { .. }));
    h.write_effect(&mut tx, "k-sever").await;
    h.sever(tx).await;
    assert!(fetch(&h, &id).await.is_none());
    assert_eq!(h.count_effects().await, 0);
    let next = run_once(&h, &claim, "k-sever", "{}").await;
    assert!(matches!(next, ClaimOutcome::Owned { .. }), "{next:?}");
}

/// An owner task cancelled mid-transaction (a dropped connection in a server) leaves
/// nothing, and a waiting claimant then owns the key.
pub async fn cancelled_owner_task_leaves_nothing<H: Harness>(h: H) {
    let h = Arc::new(h);
    let id = record_id("t1", "/v1/payments", "k-cancel");
    let claim = claim_at(&id, 1, Timestamp::now());
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let owner = {
        let (h, claim) = (h.clone(), claim.clone());
        tokio::spawn(async move {
            let store = h.store();
            let mut tx = store.begin().await.expect("begin");
            let outcome = protocol::claim(store, &mut tx, &claim)
                .await
                .expect("claim");
            assert!(matches!(outcome, ClaimOutcome::Owned { .. }));
            h.write_effect(&mut tx, "k-cancel").await;
            ready_tx.send(()).ok();
            std::future::pending::<()>().await;
        })
    };
    ready_rx.await.expect("owner claimed");
    owner.abort();
    assert!(owner.await.expect_err("aborted").is_cancelled());
    let next = run_once(&*h, &claim, "k-cancel", "{}").await;
    assert!(matches!(next, ClaimOutcome::Owned { .. }), "{next:?}");
    assert_eq!(h.count_effects().await, 1);
}

/// A write with a stale token is refused.
pub async fn stale_token_cannot_complete<H: Harness>(h: H) {
    let store = h.store();
    let id = record_id("t1", "/v1/payments", "k-stale");
    let mut tx = store.begin().await.expect("begin");
    let now = Timestamp::now();
    let outcome = protocol::claim(store, &mut tx, &claim_at(&id, 1, now))
        .await
        .expect("claim");
    let ClaimOutcome::Owned { token, .. } = outcome else {
        panic!("{outcome:?}")
    };
    let refused = protocol::complete(store, &mut tx, &id, token + 1, &response("{}"), now).await;
    assert!(
        matches!(refused, Err(protocol::Error::Fenced)),
        "{refused:?}"
    );
    protocol::complete(store, &mut tx, &id, token, &response("{}"), now)
        .await
        .expect("the owner's token completes");
    store.commit(tx).await.expect("commit");
}

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
async fn minutes_after<S: Store>(store: &S, conn: &mut S::Connection, base: Timestamp) -> Vec<i64> {
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

/// A lapsed lease after the point of no return makes the record indeterminate; it is never
/// handed out for execution again until an operator resolves it.
pub async fn lapsed_lease_after_point_of_no_return_turns_indeterminate<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-unknown");
    let lease = Duration::from_secs(30);
    let ClaimOutcome::Owned { token, .. } =
        protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
            .await
            .expect("reserve")
    else {
        panic!("must own the key")
    };
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
/// mismatched), then every owner's completion beside
/// a stale one per key, all at once. A store may commit such concurrent writes together
/// ([`Store::insert_autocommit`], [`Store::complete_autocommit`]); each must still be
/// answered as if written alone: one owner per key, whose own record was stored; every
/// stale completion refused; every owner's outcome replayed to its own body, and a
/// mismatch to the others.
pub async fn concurrent_reservations_and_completions_answer_each_writer<H: Harness>(h: H) {
    const KEYS: usize = 50;
    const CLAIMANTS: u8 = 4;
    let lease = Duration::from_secs(30);
    let store = h.store().clone();
    let now = Timestamp::now();
    let id = |k: usize| record_id("t1", "/v1/transfers", &format!("race-{k}"));

    let barrier = Arc::new(Barrier::new(KEYS * usize::from(CLAIMANTS)));
    let mut tasks = Vec::new();
    for k in 0..KEYS {
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

    let barrier = Arc::new(Barrier::new(2 * KEYS));
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

/// An operator may release an indeterminate operation; the next attempt executes it.
pub async fn released_indeterminate_record_executes_again<H: Harness>(h: H) {
    let store = h.store().clone();
    let id = record_id("t1", "/v1/transfers", "k-release");
    let lease = Duration::from_secs(30);
    let ClaimOutcome::Owned { token, .. } =
        protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
            .await
            .expect("reserve")
    else {
        panic!("must own the key")
    };
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
    let ClaimOutcome::Owned { token, .. } =
        protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
            .await
            .expect("reserve")
    else {
        panic!("must own the key")
    };
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
    let ClaimOutcome::Owned { token, .. } = protocol::reserve(&store, &claim, lease)
        .await
        .expect("reserve")
    else {
        panic!("must own the key")
    };
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

/// Generates one `#[tokio::test]` per conformance behaviour. `$harness` is an expression
/// (usually an `async` block) that yields a fresh [`Harness`] for each test.
///
/// ```ignore
/// idemkey_testkit::conformance_tests!(SqliteHarness::new());
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr) => {
        $crate::conformance_tests!(@each $harness;
            claims_fresh_key_then_replays,
            claim_on_completed_key_returns_the_record,
            rejects_mismatched_fingerprint,
            member_digests_round_trip,
            one_of_64_concurrent_claims_owns_the_key,
            two_hundred_keys_sixteen_claimants_one_effect_each,
            rolled_back_owner_leaves_nothing,
            severed_owner_leaves_nothing,
            cancelled_owner_task_leaves_nothing,
            stale_token_cannot_complete,
            fenced_completion_commits_nothing,
            scope_text_is_stored_as_given,
            expired_record_is_claimed_anew,
            first_sent_is_stored_and_compared,
            late_lookup_after_purge_finds_nothing_and_writes_nothing,
            purge_removes_expired_records_in_batches,
            purge_takes_the_earliest_expiry_first_from_where_it_is_told,
            scopes_are_independent,
            reservation_holds_the_key_while_leased,
            takeover_before_point_of_no_return_fences_the_stale_owner,
            lapsed_lease_after_point_of_no_return_turns_indeterminate,
            reservation_marked_at_the_point_of_no_return,
            concurrent_reservations_and_completions_answer_each_writer,
            released_indeterminate_record_executes_again,
            released_reservation_frees_the_key,
            resolutions_are_audited_and_sealed_keys_kept,
            operator_queries_list_and_evict
        );
    };
    (@each $harness:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::conformance::$name($harness.await).await;
            }
        )*
    };
}
