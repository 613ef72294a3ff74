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

/// The `Bearer` scheme's name is matched in any case, as HTTP says of every scheme.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_case_bearer_scheme_is_accepted() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let client = reqwest::Client::new();
    for (scheme, key) in [("bearer", "k-lower"), ("BEARER", "k-upper")] {
        let response = client
            .post(format!("{}/v1/payments", server.base()))
            .header("authorization", format!("{scheme} tok1"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(common::payment(100, "case"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{scheme}");
    }
    let wrong = client
        .post(format!("{}/v1/payments", server.base()))
        .header("authorization", "Basic tok1")
        .header("idempotency-key", "k-basic")
        .body(common::payment(100, "case"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
}
