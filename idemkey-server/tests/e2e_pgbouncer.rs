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
