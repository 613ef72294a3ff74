//! The end-to-end scenarios on PostgreSQL: each test starts `idemkey serve` processes on a
//! fresh database of the test server (a throwaway one, or the server `DATABASE_URL` names).
//! Every server of a test shares that database, and with it the key-hashing secret.

mod common;

use common::e2e_scenarios;

e2e_scenarios!(common::Backend::postgres());

/// Three processes on one database race for the same keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_across_three_processes() {
    common::race_across_three_processes(common::Backend::postgres().await).await;
}
