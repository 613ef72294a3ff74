//! Concurrent claims on one key and on many: one owner per key, one effect each.

use std::collections::HashMap;
use std::sync::Arc;

use idemkey_core::protocol::ClaimOutcome;
use idemkey_core::{ListFilter, RecordState, Store, StoreAdmin, Timestamp};
use tokio::sync::Barrier;

use super::{Harness, claim_at, fetch, record_id, run_once};

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
