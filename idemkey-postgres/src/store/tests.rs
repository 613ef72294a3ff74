use idemkey_core::RecordState;
use idemkey_core::protocol::{self, ClaimOutcome};
use idemkey_testkit::conformance::{begin_owned, claim_at, record_id, response};

use std::str::FromStr;

use idemkey_sqlx::group::{Completion, GroupWriter};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection};

use super::*;
use crate::group::completion_rows;
use crate::kept::Kept;
use crate::statements::PREPARE_GROUP;

/// The claim of `key` on one route, made at `now`.
fn claim(key: &str, now: Timestamp) -> protocol::Claim {
    claim_at(&record_id("t1", "/v1/transfers", key), 1, now)
}

/// An external-mode reservation of `key` (executing, a 30 s lease).
fn reservation(key: &str, now: Timestamp) -> NewRecord {
    let claim = claim(key, now);
    NewRecord {
        id: claim.id,
        fingerprint: claim.fingerprint,
        state: RecordState::Executing,
        token: 1,
        lease_expires_at: Some(now.plus(Duration::from_secs(30))),
        now,
        expires_at: now.plus(Duration::from_secs(3600)),
        sealed_key: None,
        first_sent: None,
    }
}

/// An external-mode completion of `key` by the owner holding `token`, at `now`.
fn done(key: &str, token: i64, now: Timestamp) -> Completion {
    Completion {
        id: claim(key, now).id,
        token,
        response: response("{\"done\":true}"),
        now,
    }
}

/// A migrated store of `max_connections` on a fresh database.
async fn migrated_store(max_connections: u32) -> PgStore {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("fresh database");
    let store = PgStore::connect(&url, max_connections)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    store
}

/// A migrated store of four connections on a fresh database, each connection with the
/// server setting `option`, and the database's URL.
async fn migrated_store_with(option: (&str, &str)) -> (PgStore, String) {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("fresh database");
    let options = PgConnectOptions::from_str(&url)
        .expect("url")
        .options([option]);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .expect("connect");
    let store = PgStore::new(pool);
    store.migrate().await.expect("migrate");
    (store, url)
}

/// The grouped completion looks each row up by its primary key whatever the table held
/// when its prepared statement was planned: the generic plan, made while the table holds
/// three records, is an index lookup (no scan of the table). Each completion gets its own
/// answer, a stale token `false`, from its statement's `RETURNING`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_group_looks_its_rows_up_by_key() {
    let store = migrated_store(4).await;
    let now = Timestamp::now();
    let claim = |key: &str| claim(key, now);
    let reserve = |key: &str| reservation(key, now);
    let reserved = store
        .insert_group(vec![reserve("a"), reserve("b"), reserve("c")])
        .await;
    assert!(
        reserved.iter().all(|r| matches!(r, Ok(Inserted::Owned))),
        "{reserved:?}"
    );
    let completion = |key: &str, token: i64| Completion {
        id: claim(key).id,
        token,
        response: StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: format!("{{\"key\":\"{key}\",\"quote\":\"it's\\\\\"}}").into_bytes(),
        },
        now,
    };
    let group = vec![
        completion("a", 1),
        completion("b", 2), // stale: b's owner holds token 1
        completion("c", 1),
    ];

    let rows: Vec<&Completion> = group.iter().collect();
    // A connection of its own (closed after; the reservations may have prepared the
    // statements on it), told to use the generic plan from the first execution, as it
    // would after five.
    let mut conn = store.pool().acquire().await.expect("connection").detach();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DEALLOCATE ALL; SET plan_cache_mode = force_generic_plan; {}",
        PREPARE_GROUP.join("; ")
    )))
    .execute(&mut conn)
    .await
    .expect("prepare");
    for statement in completion_rows(&rows).expect("statements") {
        let plan: Vec<String> = sqlx::raw_sql(AssertSqlSafe(format!("EXPLAIN {statement}")))
            .fetch_all(&mut conn)
            .await
            .expect("explain")
            .iter()
            .map(|row| row.try_get(0).expect("plan line"))
            .collect();
        let plan = plan.join("\n");
        assert!(
            plan.contains("Index Scan using idemkey_records_pkey"),
            "{plan}"
        );
        assert!(!plan.contains("Seq Scan on idemkey_records"), "{plan}");
    }
    conn.close().await.expect("close");

    let answers = store.complete_group(group).await;
    assert!(
        matches!(answers[..], [Ok(true), Ok(false), Ok(true)]),
        "{answers:?}"
    );
    let mut conn = store.acquire().await.expect("connection");
    let mut fetch = async |key: &str| {
        store
            .fetch(&mut conn, &claim(key).id)
            .await
            .expect("fetch")
            .expect("record")
    };
    let a = fetch("a").await;
    assert_eq!(a.state, RecordState::Completed);
    assert_eq!(a.response, Some(completion("a", 1).response));
    let b = fetch("b").await;
    assert_eq!(
        b.state,
        RecordState::Executing,
        "a stale completion wrote nothing"
    );
}

/// A connection on which one of the group's statements is missing while the other is
/// prepared (deallocated by hand): the group fails there however it is sent, so each write
/// is made alone and answered as such, and the connection is closed; the pool's next
/// connection prepares both and writes the next group as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_missing_one_group_statement_is_replaced() {
    let store = migrated_store(1).await;
    let now = Timestamp::now();
    let done = |key: &str| done(key, 1, now);
    let owned = store
        .insert_group(vec![reservation("a", now), reservation("b", now)])
        .await;
    assert!(
        owned.iter().all(|r| matches!(r, Ok(Inserted::Owned))),
        "{owned:?}"
    );
    let backend = |store: &PgStore| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(&pool)
                .await
                .expect("backend")
        }
    };
    let first = backend(&store).await;
    sqlx::raw_sql("DEALLOCATE idemkey_complete_row_v1")
        .execute(store.pool())
        .await
        .expect("deallocate");

    let (reserved, completed) = store
        .write_groups(
            vec![reservation("c", now), reservation("d", now)],
            vec![done("a"), done("b")],
        )
        .await;
    assert!(
        matches!(reserved[..], [Ok(Inserted::Owned), Ok(Inserted::Owned)]),
        "{reserved:?}"
    );
    assert!(
        matches!(completed[..], [Ok(true), Ok(true)]),
        "{completed:?}"
    );
    let second = backend(&store).await;
    assert_ne!(first, second, "the connection was replaced");

    // The new connection has neither statement: the next group prepares both on it (the
    // writes made alone use neither).
    let (reserved, completed) = store
        .write_groups(vec![reservation("e", now)], vec![done("c"), done("d")])
        .await;
    assert!(
        matches!(reserved[..], [Ok(Inserted::Owned)]),
        "{reserved:?}"
    );
    assert!(
        matches!(completed[..], [Ok(true), Ok(true)]),
        "{completed:?}"
    );
    let prepared: Vec<String> =
        sqlx::query_scalar("SELECT name FROM pg_prepared_statements ORDER BY name")
            .fetch_all(store.pool())
            .await
            .expect("prepared statements");
    assert!(
        prepared.contains(&"idemkey_complete_row_v1".to_owned())
            && prepared.contains(&"idemkey_reserve_group_v2".to_owned()),
        "{prepared:?}"
    );
    assert_eq!(backend(&store).await, second, "the new connection is kept");
}

/// A connection whose transaction the store committed is kept out of the pool, and the
/// next transaction begins on it (the same backend), whole: what it writes commits with
/// it, and dropped, it leaves nothing. Both ways of committing keep it: the completion
/// sent with the `COMMIT` (a keyed request) and a plain commit (an unkeyed one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_connection_begins_the_next_transaction() {
    let mut store = migrated_store(4).await;
    // Kept for good, so that nothing here races the sweep.
    store.kept = Kept::with_idle(store.pool(), Duration::from_secs(3600));
    sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    let backend = async |tx: &mut PgTransaction| -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut **tx)
            .await
            .expect("backend")
    };
    let effect = async |tx: &mut PgTransaction, label: &str| {
        sqlx::query("INSERT INTO effects (label) VALUES ($1)")
            .bind(label)
            .execute(&mut **tx)
            .await
            .expect("effect");
    };
    let now = Timestamp::now();
    let response = response("{}");

    let first = claim("kept-first", now);
    let (mut tx, token) = begin_owned(&store, &first).await;
    let pid = backend(&mut tx).await;
    effect(&mut tx, "completed").await;
    store
        .complete_and_commit(tx, &first.id, token, &response, now)
        .await
        .expect("committed");
    assert_eq!(store.kept.len(), 1, "kept after the completion's COMMIT");

    let second = claim("kept-second", now);
    let (mut tx, _) = begin_owned(&store, &second).await;
    assert_eq!(store.kept.len(), 0);
    assert_eq!(backend(&mut tx).await, pid, "begun on the kept connection");
    effect(&mut tx, "dropped").await;
    drop(tx);

    let mut tx = store.begin().await.expect("begin");
    let pid = backend(&mut tx).await;
    effect(&mut tx, "plain").await;
    store.commit(tx).await.expect("commit");
    assert_eq!(store.kept.len(), 1, "kept after a plain COMMIT");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(backend(&mut tx).await, pid, "begun on the kept connection");
    tx.rollback().await.expect("rollback");

    let labels: Vec<String> = sqlx::query_scalar("SELECT label FROM effects ORDER BY label")
        .fetch_all(store.pool())
        .await
        .expect("labels");
    assert_eq!(labels, ["completed", "plain"]);
    let mut conn = store.acquire().await.expect("connection");
    let first = store.fetch(&mut conn, &first.id).await.expect("fetch");
    assert_eq!(first.map(|r| r.state), Some(RecordState::Completed));
    let second = store.fetch(&mut conn, &second.id).await.expect("fetch");
    assert!(second.is_none(), "the dropped claim left no record");
}

/// A kept connection is the pool's again once unused for a moment: with a pool of one,
/// the application's own `acquire` gets the connection the store kept, and closing the
/// pool does not wait on it for good. (That it is kept at all is the test above; here
/// the sweep may take it back at any moment.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_goes_back_to_the_pool_unused() {
    let store = migrated_store(1).await;
    let commit_one = async || {
        let tx = store.begin().await.expect("begin");
        store.commit(tx).await.expect("commit");
    };

    commit_one().await;
    // Waits until the store gives it back; the pool's acquire time-out (5 s) would fail.
    let conn = store
        .pool()
        .acquire()
        .await
        .expect("the pool has its one connection back");
    assert_eq!(store.kept.len(), 0);
    drop(conn);

    commit_one().await;
    tokio::time::timeout(Duration::from_secs(30), store.pool().close())
        .await
        .expect("the pool closed");
    assert_eq!(store.kept.len(), 0);
    assert!(store.begin().await.is_err(), "a closed pool begins nothing");
}

/// Kept connections under a race: sixteen tasks committing transactions back to back and
/// four using the pool directly, all on a pool of four (two of them kept at most), each
/// task released by one barrier. Every transaction's effect is there exactly once, and
/// no one times out waiting for a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_connections_serve_racing_transactions_and_the_pools_own_queries() {
    const STORE_TASKS: usize = 16;
    const POOL_TASKS: usize = 4;
    const ROUNDS: usize = 25;
    let store = migrated_store(4).await;
    sqlx::query("CREATE TABLE effects (task INT NOT NULL, round INT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(STORE_TASKS + POOL_TASKS));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..STORE_TASKS {
        let (store, start) = (store.clone(), start.clone());
        tasks.spawn(async move {
            start.wait().await;
            for round in 0..ROUNDS {
                let mut tx = store.begin().await.expect("begin");
                sqlx::query("INSERT INTO effects (task, round) VALUES ($1, $2)")
                    .bind(task as i32)
                    .bind(round as i32)
                    .execute(&mut *tx)
                    .await
                    .expect("effect");
                store.commit(tx).await.expect("commit");
            }
        });
    }
    for _ in 0..POOL_TASKS {
        let (store, start) = (store.clone(), start.clone());
        tasks.spawn(async move {
            start.wait().await;
            for _ in 0..ROUNDS {
                let mut conn = store.pool().acquire().await.expect("the pool's own query");
                sqlx::query("SELECT 1")
                    .execute(&mut *conn)
                    .await
                    .expect("select");
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("task");
    }

    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (task, round)) FROM effects")
            .fetch_one(store.pool())
            .await
            .expect("count");
    assert_eq!(effects, (STORE_TASKS * ROUNDS) as i64);
    assert_eq!(distinct, effects, "each effect once");
}

/// A kept connection sits in the empty transaction `COMMIT; BEGIN` leaves; a server whose
/// `idle_in_transaction_session_timeout` ends it meanwhile answers its next message with
/// SQLSTATE 25P03. The next claim then begins on another connection, as after any lost
/// one, and goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_the_server_timed_out_is_replaced() {
    let (mut store, url) =
        migrated_store_with(("idle_in_transaction_session_timeout", "100ms")).await;
    // Kept for good, so that only the server can end it.
    store.kept = Kept::with_idle(store.pool(), Duration::from_secs(3600));
    let now = Timestamp::now();

    let first = claim("timed-out-first", now);
    let (mut tx, token) = begin_owned(&store, &first).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .expect("backend");
    store
        .complete_and_commit(tx, &first.id, token, &response("{}"), now)
        .await
        .expect("committed");
    assert_eq!(store.kept.len(), 1);
    // The server's timer is the only signal: watch for the backend to be gone.
    let mut admin = <PgConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("admin");
    let gone = async {
        loop {
            let alive: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
                    .bind(pid)
                    .fetch_one(&mut admin)
                    .await
                    .expect("pg_stat_activity");
            if alive == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), gone)
        .await
        .expect("the server ended the kept connection's session");

    let second = claim("timed-out-second", now);
    let (tx, token) = begin_owned(&store, &second).await;
    store
        .complete_and_commit(tx, &second.id, token, &response("{}"), now)
        .await
        .expect("committed on another connection");
}

/// The table does not check the record's state (migration 0006), so the read does: a
/// state none of the store's statements writes is `Corrupt`, both when the record is
/// read and when a retry's claim finds it, and nothing is replayed from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_the_store_never_writes_is_refused_when_read() {
    let store = migrated_store(4).await;
    let now = Timestamp::now();
    let claim = claim("unknown-state", now);
    let (tx, token) = begin_owned(&store, &claim).await;
    let response = response("{}");
    store
        .complete_and_commit(tx, &claim.id, token, &response, now)
        .await
        .expect("completed");
    let changed = sqlx::query("UPDATE idemkey_records SET state = 'archived'")
        .execute(store.pool())
        .await
        .expect("the table takes any state")
        .rows_affected();
    assert_eq!(changed, 1);

    let mut conn = store.acquire().await.expect("connection");
    let read = store.fetch(&mut conn, &claim.id).await;
    assert!(
        matches!(&read, Err(StoreError::Corrupt(what)) if what.contains("unknown state")),
        "{read:?}"
    );
    let retried = protocol::begin_claim(&store, &claim, None).await;
    assert!(
        matches!(
            &retried,
            Err(protocol::Error::Store(StoreError::Corrupt(_)))
        ),
        "{:?}",
        retried.map(|(_, outcome)| outcome)
    );
}

/// A group whose `INSERT` fails (one of its keys is held by an uncommitted claim past
/// the lock time-out) answers each reservation alone: the held key is busy, the others
/// are owned, and when the holder rolls back the held key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_group_answers_each_reservation_alone() {
    let (store, _) = migrated_store_with(("lock_timeout", "200ms")).await;
    let now = Timestamp::now();
    let claim = |key: &str| claim(key, now);
    let new = |key: &str| reservation(key, now);
    let (holder, _) = begin_owned(&store, &claim("held")).await;

    let group = vec![new("free-1"), new("held"), new("free-2"), new("free-1")];
    let answers = store.insert_group(group).await;
    assert!(matches!(answers[0], Ok(Inserted::Owned)), "{answers:?}");
    assert!(
        matches!(answers[1], Err(StoreError::Busy(_))),
        "{answers:?}"
    );
    assert!(matches!(answers[2], Ok(Inserted::Owned)), "{answers:?}");
    // The second write of a record in one group is made alone after it: it finds the
    // first one's record.
    assert!(
        matches!(&answers[3], Ok(Inserted::Existing(r)) if r.id == claim("free-1").id),
        "{answers:?}"
    );

    holder.rollback().await.expect("rollback");
    let again =
        protocol::reserve_at_point_of_no_return(&store, &claim("held"), Duration::from_secs(30))
            .await
            .expect("reserve");
    assert!(matches!(again, ClaimOutcome::Owned { .. }), "{again:?}");
}

/// A group of reservations and completions goes in one message, one transaction: each
/// write is answered as its kind's group answers it (an owner's completion `true`, a stale
/// one `false`, a new key owned, a taken one a conflict). If that transaction fails (one of
/// its keys is held by an uncommitted claim past the lock time-out), neither kind committed,
/// and each write is answered alone: the held key busy, the rest as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_both_kinds_commits_once_and_fails_whole() {
    let (store, _) = migrated_store_with(("lock_timeout", "200ms")).await;
    let now = Timestamp::now();
    let new = |key: &str| reservation(key, now);
    let done = |key: &str, token: i64| done(key, token, now);
    let owned = store
        .insert_group(vec![new("a"), new("b"), new("c"), new("d")])
        .await;
    assert!(
        owned.iter().all(|r| matches!(r, Ok(Inserted::Owned))),
        "{owned:?}"
    );

    let (reserved, completed) = store
        .write_groups(vec![new("e"), new("a")], vec![done("a", 1), done("b", 7)])
        .await;
    assert!(
        matches!(reserved[..], [Ok(Inserted::Owned), Ok(Inserted::Conflict)]),
        "{reserved:?}"
    );
    assert!(
        matches!(completed[..], [Ok(true), Ok(false)]),
        "{completed:?}"
    );

    let (holder, _) = begin_owned(&store, &claim("held", now)).await;
    let (reserved, completed) = store
        .write_groups(vec![new("f"), new("held")], vec![done("c", 1)])
        .await;
    assert!(
        matches!(
            reserved[..],
            [Ok(Inserted::Owned), Err(StoreError::Busy(_))]
        ),
        "{reserved:?}"
    );
    assert!(matches!(completed[..], [Ok(true)]), "{completed:?}");
    holder.rollback().await.expect("rollback");

    let mut conn = store.acquire().await.expect("connection");
    for (key, state) in [
        ("a", RecordState::Completed),
        ("b", RecordState::Executing),
        ("c", RecordState::Completed),
        ("d", RecordState::Executing),
        ("e", RecordState::Executing),
        ("f", RecordState::Executing),
    ] {
        let record = store
            .fetch(&mut conn, &claim(key, now).id)
            .await
            .expect("fetch")
            .expect("record");
        assert_eq!(record.state, state, "{key}");
    }
    assert!(
        store
            .fetch(&mut conn, &claim("held", now).id)
            .await
            .expect("fetch")
            .is_none(),
        "the held key's claim rolled back"
    );
}
