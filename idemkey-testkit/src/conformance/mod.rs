//! The conformance suite: one set of behaviours every store must show, run against each
//! store by [`conformance_tests!`](crate::conformance_tests) on a fresh database per test.

use std::future::Future;
use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    Fingerprint, FingerprintParts, IdempotencyKey, KeyHasher, RecordId, Scope, Store, StoreAdmin,
    StoredResponse, Timestamp,
};

// One file per group of behaviours; this one holds the harness, the shared helpers and
// the macro that runs every behaviour against a store.
mod claims;
mod external;
mod failed_owners;
mod operator;
mod races;
mod retention;

pub use self::claims::{
    claim_on_completed_key_returns_the_record, claims_fresh_key_then_replays,
    first_sent_is_stored_and_compared, json_fp, member_digests_round_trip,
    rejects_mismatched_fingerprint, scope_text_is_stored_as_given, scopes_are_independent,
};
pub use self::external::{
    claim_anew_after_release_fences_the_earlier_owner,
    concurrent_reservations_and_completions_answer_each_writer,
    lapsed_lease_after_point_of_no_return_turns_indeterminate,
    reservation_holds_the_key_while_leased, reservation_marked_at_the_point_of_no_return,
    takeover_before_point_of_no_return_fences_the_stale_owner,
};
pub use self::failed_owners::{
    cancelled_owner_task_leaves_nothing, fenced_completion_commits_nothing,
    rolled_back_owner_leaves_nothing, severed_owner_leaves_nothing, stale_token_cannot_complete,
};
pub use self::operator::{
    operator_queries_list_and_evict, released_indeterminate_record_executes_again,
    released_reservation_frees_the_key, resolutions_are_audited_and_sealed_keys_kept,
};
pub use self::races::{
    one_of_64_concurrent_claims_owns_the_key, two_hundred_keys_sixteen_claimants_one_effect_each,
};
pub use self::retention::{
    expired_record_is_claimed_anew, late_lookup_after_purge_finds_nothing_and_writes_nothing,
    purge_removes_expired_records_in_batches,
    purge_takes_the_earliest_expiry_first_from_where_it_is_told,
};

/// A store under test, on its own fresh database, with a table of effects the tests write
/// next to their claims.
pub trait Harness: Send + Sync + 'static {
    /// The store under test: the claim protocol's statements and the operator's.
    type Store: StoreAdmin;

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

/// Reserves `claim` in external mode ([`protocol::reserve`]) on a key that must be fresh:
/// the owner's token.
pub async fn reserve_owned<S: Store>(store: &S, claim: &Claim, lease: Duration) -> i64 {
    match protocol::reserve(store, claim, lease)
        .await
        .expect("reserve")
    {
        ClaimOutcome::Owned { token, .. } => token,
        outcome => panic!("a fresh key is owned: {outcome:?}"),
    }
}

async fn fetch<H: Harness>(h: &H, id: &RecordId) -> Option<idemkey_core::Record> {
    let mut conn = h.store().acquire().await.expect("acquire");
    h.store().fetch(&mut conn, id).await.expect("fetch")
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
            claim_anew_after_release_fences_the_earlier_owner,
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
