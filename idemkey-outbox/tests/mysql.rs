//! The outbox's claim on MariaDB: relays on pools of their own race for one table and no
//! message is claimed by two of them while a claim holds; a claim that loses with 1213 is an
//! empty round.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::outbox::{Message, MessageState, OutboxStore};
use idemkey_core::{Store, Timestamp};
use idemkey_mysql::MySqlStore;
use idemkey_outbox::{DeliveryError, Relay, RelayConfig, Sink};
use tokio::sync::Barrier;

use support::{all_messages, enqueue_many, fresh_mysql};

/// Claims batches until a round finds nothing due, with a lease that outlasts the test:
/// every id this relay claimed, in the order it claimed them.
async fn claim_until_empty(store: MySqlStore, relay: String, start: Arc<Barrier>) -> Vec<String> {
    let mut conn = store.acquire().await.unwrap();
    let mut claimed = Vec::new();
    start.wait().await;
    loop {
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
        if batch.is_empty() {
            return claimed;
        }
        for message in batch {
            assert_eq!(message.claimed_by.as_deref(), Some(relay.as_str()));
            assert_eq!(message.attempts, 1, "{} claimed before", message.id);
            claimed.push(message.id);
        }
        tokio::task::yield_now().await;
    }
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
    let start = Arc::new(Barrier::new(2));
    let a = tokio::spawn(claim_until_empty(first.clone(), "a".into(), start.clone()));
    let b = tokio::spawn(claim_until_empty(second, "b".into(), start));
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
