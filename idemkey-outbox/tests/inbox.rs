//! The inbox on every store: concurrent deliveries of one message make one effect, a failing
//! handler leaves neither effect nor record, and two consumers each handle a message once.

mod support;

use std::sync::Arc;

use idemkey_core::{KeyHasher, Store};
use idemkey_outbox::{Handled, Inbox, InboxError};
use idemkey_postgres::PgStore;
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use tokio::sync::Barrier;

use support::Fresh;

fn inbox<S: Store>(store: &S, consumer: &str) -> Inbox<S> {
    Inbox::new(
        store.clone(),
        KeyHasher::new(b"inbox-test"),
        consumer,
        "payments",
    )
}

/// Sixteen deliveries of one message released at once: one runs the handler, the others
/// find its record and run nothing, and one effect exists.
async fn concurrent_deliveries_of_one_message_make_one_effect<S: Fresh>() {
    const RUNS: usize = 16;
    let (store, _guard) = S::fresh().await;
    let inbox = Arc::new(inbox(&store, "billing"));
    let barrier = Arc::new(Barrier::new(RUNS));
    let runs: Vec<_> = (0..RUNS)
        .map(|_| {
            let inbox = inbox.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                inbox
                    .run("msg_race", |conn| {
                        S::insert_effect(conn, "msg_race".to_owned())
                    })
                    .await
            })
        })
        .collect();
    let mut ran = 0;
    let mut duplicates = 0;
    for run in runs {
        match run.await.unwrap() {
            Ok(Handled::Ran(())) => ran += 1,
            Ok(Handled::Duplicate) => duplicates += 1,
            Err(e) => panic!("a delivery failed: {e:?}"),
        }
    }
    let effects = store.effects("msg_race").await;
    println!("{RUNS} concurrent deliveries: {ran} ran, {duplicates} duplicates, {effects} effect");
    assert_eq!(ran, 1, "exactly one delivery runs the handler");
    assert_eq!(duplicates, RUNS - 1);
    assert_eq!(effects, 1, "one effect");
}

/// A handler that wrote its effect and then failed leaves no effect and no record: the
/// redelivery runs, and the one after it is a duplicate.
async fn a_failing_handler_leaves_neither_effect_nor_record<S: Fresh>() {
    let (store, _guard) = S::fresh().await;
    let inbox = inbox(&store, "billing");
    let failed = inbox
        .run("msg_1", |conn| {
            Box::pin(async move {
                S::insert_effect(conn, "msg_1".to_owned()).await.unwrap();
                Err::<(), _>("the downstream refused")
            })
        })
        .await;
    assert!(
        matches!(failed, Err(InboxError::Handler("the downstream refused"))),
        "{failed:?}"
    );
    assert_eq!(
        store.effects("msg_1").await,
        0,
        "the effect was rolled back"
    );
    let id = inbox.record_id("msg_1").unwrap();
    let mut conn = store.acquire().await.unwrap();
    assert!(
        store.fetch(&mut conn, &id).await.unwrap().is_none(),
        "the record was rolled back"
    );
    drop(conn);
    let again = inbox
        .run("msg_1", |conn| S::insert_effect(conn, "msg_1".to_owned()))
        .await
        .unwrap();
    assert_eq!(again, Handled::Ran(()), "the redelivery runs");
    let third = inbox
        .run("msg_1", |conn| S::insert_effect(conn, "msg_1".to_owned()))
        .await
        .unwrap();
    assert_eq!(third, Handled::Duplicate);
    assert_eq!(store.effects("msg_1").await, 1);
}

/// The record's tenant is the consumer: two consumers of one message each handle it once;
/// an id that cannot be a key is refused before anything runs.
async fn each_consumer_handles_a_message_once<S: Fresh>() {
    let (store, _guard) = S::fresh().await;
    for consumer in ["billing", "shipping", "billing", "shipping"] {
        let label = format!("msg_2 {consumer}");
        let first = store.effects(&label).await == 0;
        let handled = inbox(&store, consumer)
            .run("msg_2", |conn| S::insert_effect(conn, label.clone()))
            .await
            .unwrap();
        assert_eq!(handled.ran(), first, "{consumer}");
        assert_eq!(store.effects(&label).await, 1, "{consumer}");
    }
    let refused = inbox(&store, "billing")
        .run("has space", |conn| S::insert_effect(conn, "x".to_owned()))
        .await;
    assert!(
        matches!(refused, Err(InboxError::InvalidId { .. })),
        "{refused:?}"
    );
    assert_eq!(store.effects("x").await, 0);
}

macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<SqliteStore>().await })*
        }
        mod rusqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<RusqliteStore>().await })*
        }
        mod postgres {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<PgStore>().await })*
        }
    };
}

on_every_store!(
    concurrent_deliveries_of_one_message_make_one_effect,
    a_failing_handler_leaves_neither_effect_nor_record,
    each_consumer_handles_a_message_once,
);
