//! Owners that fail: rolled back, severed, cancelled, or writing with a stale token;
//! none leaves a record or an effect behind.

use std::sync::Arc;

use idemkey_core::protocol::{self, ClaimOutcome};
use idemkey_core::{Store, Timestamp};

use super::{Harness, begin_owned, claim_at, fetch, record_id, response, run_once};

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
