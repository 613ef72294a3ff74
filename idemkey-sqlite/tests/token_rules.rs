//! The fencing token as the store writes it, stated once in `idemkey-model` (`InsertToken`):
//! a claim starts a record at a token no earlier claim of the key held, whether the key was
//! never claimed or its record was deleted (released, resolved released, purged) and the key
//! is claimed anew.

use std::time::Duration;

use idemkey_core::Timestamp;
use idemkey_core::protocol::{self, ClaimOutcome, Lease, Resolution};
use idemkey_sqlite::SqliteStore;
use idemkey_testkit::conformance::{claim_at, record_id, reserve_owned};

#[tokio::test]
async fn a_key_claimed_anew_after_its_record_was_released_starts_at_a_token_no_claim_held() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("tokens.db").display());
    let store = SqliteStore::connect_with_busy_timeout(&url, Duration::from_secs(5))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let id = record_id("t1", "/v1/transfers", "k-anew");
    let lease = Duration::from_secs(30);
    let first = reserve_owned(&store, &claim_at(&id, 1, Timestamp::now()), lease).await;
    assert!((0..1 << 62).contains(&first), "{first}");
    let owner = Lease::new(store.clone(), id.clone(), first, lease);
    owner
        .point_of_no_return()
        .await
        .expect("point of no return");
    owner.mark_indeterminate().await.expect("indeterminate");
    protocol::resolve(
        &store,
        &id,
        &Resolution::Released,
        "reconciler",
        None,
        Timestamp::now(),
    )
    .await
    .expect("resolve");
    let anew = protocol::reserve(&store, &claim_at(&id, 1, Timestamp::now()), lease)
        .await
        .expect("reserve");
    let ClaimOutcome::Owned { token: anew, .. } = anew else {
        panic!("the key is claimed anew: {anew:?}")
    };
    // The earlier claim held its start and the raises of its resolutions.
    let held = first..=first + 3;
    assert!(
        !held.contains(&anew) && (0..1 << 62).contains(&anew),
        "the claim anew starts at {anew}; the earlier claim held {held:?}"
    );
}
