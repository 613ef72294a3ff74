//! The outbox's claim on MariaDB: relays on pools of their own race for one table and no
//! message is claimed by two of them while a claim holds; a claim that loses with 1213 is an
//! empty round.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemkey_core::outbox::{Message, MessageState, OutboxStore};
use idemkey_core::{Store, Timestamp};
use idemkey_mysql::MySqlStore;
use idemkey_outbox::{DeliveryError, Relay, RelayConfig, Sink};
use tokio::sync::Barrier;

use support::{all_messages, enqueue_many, fresh_mysql};

/// Claims batches in rounds, both relays at once in each round (`round` is their barrier),
/// until every one of the `total` messages is claimed (`done` counts both relays' claims; a
/// round can be empty while messages remain, when the claim lost with 1213): every id this
/// relay claimed, in the order it claimed them.
async fn claim_in_rounds(
    store: MySqlStore,
    relay: String,
    round: Arc<Barrier>,
    done: Arc<AtomicUsize>,
    total: usize,
) -> Vec<String> {
    let mut conn = store.acquire().await.unwrap();
    let mut claimed = Vec::new();
    for _ in 0..10_000 {
        // Both relays have counted the last round's claims once they pass the barrier, so
        // both read the same count and stop together.
        round.wait().await;
        if done.load(Ordering::SeqCst) == total {
            return claimed;
        }
        let now = Timestamp::now();
        let batch = store
            .claim_due(
                &mut conn,
                &relay,
                now,
                now.plus(Duration::from_secs(3600)),
                7,
            )
            .await
            .unwrap();
        done.fetch_add(batch.len(), Ordering::SeqCst);
        for message in batch {
            assert_eq!(message.claimed_by.as_deref(), Some(relay.as_str()));
            assert_eq!(message.attempts, 1, "{} claimed before", message.id);
            claimed.push(message.id);
        }
    }
    panic!("relay {relay}: messages left unclaimed after 10 000 rounds");
}

/// Two relays, each on a pool of its own, claim from one table at the same time: between
/// them they claim every message, and none is claimed by both within its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_on_their_own_pools_claim_each_message_once_per_lease() {
    const N: usize = 400;
    let (first, url) = fresh_mysql().await;
    let ids: HashSet<String> = enqueue_many(&first, "thing.happened", N)
        .await
        .into_iter()
        .collect();
    let second = MySqlStore::connect(&url, 4).await.unwrap();
    let (round, done) = (Arc::new(Barrier::new(2)), Arc::new(AtomicUsize::new(0)));
    let a = tokio::spawn(claim_in_rounds(
        first.clone(),
        "a".into(),
        round.clone(),
        done.clone(),
        N,
    ));
    let b = tokio::spawn(claim_in_rounds(second, "b".into(), round, done, N));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let (in_a, in_b): (HashSet<_>, HashSet<_>) =
        (a.iter().cloned().collect(), b.iter().cloned().collect());
    println!("relay a claimed {}, relay b {}", a.len(), b.len());
    assert_eq!(a.len(), in_a.len(), "relay a claimed a message twice");
    assert_eq!(b.len(), in_b.len(), "relay b claimed a message twice");
    assert!(
        in_a.is_disjoint(&in_b),
        "claimed by both: {:?}",
        in_a.intersection(&in_b).collect::<Vec<_>>()
    );
    assert_eq!(&in_a | &in_b, ids, "every message claimed");
    assert!(!a.is_empty() && !b.is_empty(), "both relays claimed");

    // Each claim is the claimer's to close: the other relay's mark does nothing.
    let mut conn = first.acquire().await.unwrap();
    let now = Timestamp::now();
    for id in &a {
        assert!(!first.mark_sent(&mut conn, id, "b", now).await.unwrap());
        assert!(first.mark_sent(&mut conn, id, "a", now).await.unwrap());
    }
    for id in &b {
        assert!(first.mark_sent(&mut conn, id, "b", now).await.unwrap());
    }
    let messages = all_messages(&first).await;
    assert!(messages.iter().all(|m| m.state == MessageState::Sent));
    assert!(messages.iter().all(|m| m.attempts == 1));
}

/// A claim that fails with 1213 (InnoDB's deadlock victim; on Galera, the claim of a relay
/// whose rows another node's relay claimed and committed first) claimed nothing: the round is
/// empty, not an error, and the message stays for the next claim. The error is raised here by
/// a trigger on the claim's `UPDATE`, with the number the server gives both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_loses_with_1213_claims_nothing_that_round() {
    let (store, _url) = fresh_mysql().await;
    let ids = enqueue_many(&store, "thing.happened", 1).await;
    sqlx::raw_sql(
        "CREATE TRIGGER lose BEFORE UPDATE ON idemkey_outbox FOR EACH ROW \
         IF NEW.claimed_by = 'loser' THEN \
         SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'certification failed'; \
         ELSEIF NEW.claimed_by = 'broken' THEN \
         SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'something else'; \
         END IF",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let relay = |name: &str| {
        Relay::new(store.clone(), Arc::new(Collect::default())).config(RelayConfig {
            name: name.to_owned(),
            ..RelayConfig::default()
        })
    };
    let round = relay("loser").run_once().await.unwrap();
    assert_eq!(round.claimed, 0);
    let mut conn = store.acquire().await.unwrap();
    let left = store.message(&mut conn, &ids[0]).await.unwrap().unwrap();
    assert_eq!((left.claimed_by, left.attempts), (None, 0), "rolled back");

    let now = Timestamp::now();
    let other = store
        .claim_due(
            &mut conn,
            "broken",
            now,
            now.plus(Duration::from_secs(60)),
            1,
        )
        .await;
    assert!(other.is_err(), "any other error stays one: {other:?}");

    let winner = relay("winner");
    assert_eq!(winner.run_once().await.unwrap().sent, 1, "the next claim");
}

/// A sink that takes every message.
#[derive(Default)]
struct Collect(std::sync::Mutex<Vec<String>>);

impl Sink for Collect {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        self.0.lock().unwrap().push(message.id.clone());
        Ok(())
    }
}
