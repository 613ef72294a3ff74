//! The end-to-end scenarios on PostgreSQL behind PgBouncer in transaction pooling mode
//! (`pool_mode = transaction`, only `extra_float_digits` ignored): every `idemkey serve`
//! process and operator command of a test reaches a fresh database through the pooler,
//! whose server connections each client's transactions land on in turn. The test's own
//! reads go to the database directly.

mod common;

use common::e2e_scenarios;

e2e_scenarios!(common::Backend::postgres_through_pgbouncer());

/// Three processes through the pooler race for the same keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_across_three_processes() {
    common::race_across_three_processes(common::Backend::postgres_through_pgbouncer().await).await;
}

/// `idemkey migrate` through the pooler, run again and again: nothing of a run is left on
/// the pooler's server connections for the next (sqlx's prepared statements, its advisory
/// lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_runs_again_and_again() {
    let backend = common::Backend::postgres_through_pgbouncer().await;
    for _ in 0..3 {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(["migrate", "--database-url", backend.url()])
            .env_remove("IDEMKEY_DATABASE_URL")
            .output()
            .await
            .expect("run idemkey migrate");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    backend.snapshot().await.assert_consistent(0);
}

/// `idemkey serve` given the pooler's URL without `?idemkey-pooler=transaction`: PgBouncer
/// refuses the startup parameter idemkey then sends, and the server stops at once, saying
/// what the URL lacks, instead of answering 503 while it waits for a database that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_pooler_the_url_does_not_name() {
    let backend = common::Backend::postgres_through_pgbouncer().await;
    let url = backend
        .url()
        .replace("?idemkey-pooler=transaction", "")
        .replace("&idemkey-pooler=transaction", "");
    assert_ne!(url, backend.url(), "the test URL names the pooler");
    let serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &url])
        .args(["--api-key", "t1=tok1"])
        .env(
            "IDEMKEY_KEY_SECRET",
            "a test secret, apart from the database",
        )
        .env_remove("IDEMKEY_DATABASE_URL")
        .kill_on_drop(true)
        .output();
    // A bound on the wait for the process, not a timing of it: before the fix it never ended.
    let output = tokio::time::timeout(std::time::Duration::from_secs(60), serve)
        .await
        .expect("serve stops instead of waiting")
        .expect("run idemkey serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("?idemkey-pooler=transaction"), "{stderr}");
}
