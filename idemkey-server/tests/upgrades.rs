//! Two versions on one database, as `docs/guide/upgrading.md` tells it, on `idemkey serve`
//! over SQLite. The rows another version writes are made here by hand, between two runs of the
//! server (a fresh process: nothing of them in its replay cache):
//!
//! - a record a later version might write, in a state this one does not know, is answered 503
//!   `store-unavailable` for its key and runs nothing, while other keys are served;
//! - a record an older version wrote, without the columns later migrations added, is replayed,
//!   and a retry with another body is still refused 422;
//! - a database a later version migrated (a migration this binary does not have) is refused by
//!   `serve` and `migrate`, naming the migration.

mod common;

use std::process::{Command, Stdio};

use common::{Backend, TOKEN1, payment};

/// Runs `statement` on the backend's SQLite file, no server running, past the table's
/// `CHECK` on the state (as a later version's migration would widen it).
async fn execute(backend: &Backend, statement: &'static str) {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(backend.url())
        .await
        .expect("open the SQLite database");
    sqlx::raw_sql("PRAGMA ignore_check_constraints = ON")
        .execute(&pool)
        .await
        .expect("PRAGMA ignore_check_constraints");
    sqlx::query(statement)
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_in_a_state_this_version_does_not_know_is_answered_503_and_runs_nothing() {
    let backend = Backend::sqlite().await;
    let body = payment(500, "from a later version");
    let server = backend.start(&[]).await;
    let first = server.api().pay_ok(TOKEN1, "later-1", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    drop(server);

    execute(&backend, "UPDATE idemkey_records SET state = 'paused'").await;
    let server = backend.start(&[]).await;
    let api = server.api();
    let retry = api.pay_ok(TOKEN1, "later-1", &body).await;
    retry.assert_problem(503, "store-unavailable");
    assert!(retry.header("retry-after").is_some(), "{}", retry.text());
    assert_eq!(api.total(TOKEN1).await, 1, "the retry ran nothing");
    let other = api
        .pay_ok(TOKEN1, "later-2", &payment(600, "another key"))
        .await;
    assert_eq!(other.status, 201, "other keys are served: {}", other.text());
    assert_eq!(api.total(TOKEN1).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_without_the_later_columns_is_replayed() {
    let backend = Backend::sqlite().await;
    let body = payment(700, "from an older version");
    let server = backend.start(&[]).await;
    let first = server.api().pay_ok(TOKEN1, "older-1", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    drop(server);

    execute(
        &backend,
        "UPDATE idemkey_records SET first_sent = NULL, fingerprint_members = NULL, \
         sealed_key = NULL",
    )
    .await;
    let server = backend.start(&[]).await;
    let api = server.api();
    let retry = api.pay_ok(TOKEN1, "older-1", &body).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.replayed(), "replayed");
    assert_eq!(retry.body, first.body, "the same payment");
    let other_body = api
        .pay_ok(TOKEN1, "older-1", &payment(701, "from an older version"))
        .await;
    other_body.assert_problem(422, "key-reused");
    assert_eq!(api.total(TOKEN1).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_a_later_version_migrated_is_refused_at_start() {
    let backend = Backend::sqlite().await;
    drop(backend.start(&[]).await);
    execute(
        &backend,
        "INSERT INTO idemkey_migrations \
         (version, description, success, checksum, execution_time) \
         VALUES (9999, 'from a later version', TRUE, x'00', 0)",
    )
    .await;
    for command in [
        vec!["migrate", "--database-url", backend.url()],
        vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            backend.url(),
        ],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(&command)
            .env_remove("IDEMKEY_DATABASE_URL")
            .env_remove("IDEMKEY_KEY_SECRET")
            .stdin(Stdio::null())
            .output()
            .expect("run idemkey");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{command:?}: {stderr}");
        assert!(
            stderr.contains("migration 9999 was previously applied but is missing"),
            "{command:?}: {stderr}"
        );
    }
}
