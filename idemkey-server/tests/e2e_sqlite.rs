//! The end-to-end scenarios on SQLite: each test starts `idemkey serve` processes on a
//! fresh SQLite file in a temporary directory.

mod common;

use common::e2e_scenarios;

e2e_scenarios!(common::Backend::sqlite());

/// The layer's early 413 and the connection it leaves (store-independent, so run once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_connection() {
    common::oversized_body_connection(common::Backend::sqlite().await).await;
}
