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

/// Two instances (two layers, each with its own replay cache) on one database: both answer
/// a completed key from memory, and `idemkey keys evict` reaches both through
/// `NOTIFY idemkey_evict`, so the next request runs again instead of a replay from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_evict_reaches_every_instance_replay_cache() {
    use axum::body::{Body, Bytes};
    use axum::response::Response;
    use axum::routing::post;
    use http::{Request, StatusCode};
    use idemkey_core::KeyHasher;
    use idemkey_postgres::PgStore;
    use idemkey_server::AppDb;
    use idemkey_tower::{IdempotencyLayer, Metrics, REPLAYED_HEADER, Tx};
    use tower::ServiceExt;

    const SECRET: &str = "replay-cache-test-secret-0123456789abcdef";
    const WAIT: std::time::Duration = std::time::Duration::from_secs(20);

    async fn create(mut tx: Tx<PgStore>, _body: Bytes) -> Response {
        let id: i64 = sqlx::query_scalar("INSERT INTO cache_effects DEFAULT VALUES RETURNING id")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        Response::builder()
            .status(StatusCode::CREATED)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(format!("{{\"effect\":{id}}}")))
            .unwrap()
    }

    struct Instance {
        app: axum::Router,
        metrics: Metrics,
        changes: tokio::sync::watch::Receiver<u64>,
    }

    impl Instance {
        fn new(store: &PgStore) -> Self {
            let metrics = Metrics::new();
            let layer = IdempotencyLayer::new(store.clone(), KeyHasher::new(SECRET.as_bytes()))
                .metrics(metrics.clone());
            let changes = layer
                .replay_cache_changes()
                .expect("the cache is on by default");
            let app = axum::Router::new().route("/orders", post(create).layer(layer));
            Self {
                app,
                metrics,
                changes,
            }
        }

        /// `(replayed, body)` of `POST /orders` with key `k1`.
        async fn send(&self) -> (bool, Bytes) {
            let req = Request::post("/orders")
                .header("idempotency-key", "k1")
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from("{}"))
                .unwrap();
            let response = self.app.clone().oneshot(req).await.unwrap();
            assert_eq!(response.status(), StatusCode::CREATED);
            let replayed = response.headers().contains_key(REPLAYED_HEADER);
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
            (replayed, body)
        }

        /// Waits (bounded) until the cache has applied more than `seen` invalidations.
        async fn changed_past(&mut self, seen: u64) {
            tokio::time::timeout(WAIT, self.changes.wait_for(|n| *n > seen))
                .await
                .expect("the eviction notice did not reach this instance in time")
                .expect("the cache is alive");
        }
    }

    let url = idemkey_testkit::fresh_database_url();
    let store = PgStore::connect(&url, 4).await.unwrap();
    store.migrate_all().await.unwrap();
    sqlx::query("CREATE TABLE cache_effects (id BIGSERIAL PRIMARY KEY)")
        .execute(store.pool())
        .await
        .unwrap();
    let (mut a, mut b) = (Instance::new(&store), Instance::new(&store));

    // A completes; each instance's first request starts its listener. What an instance
    // cached before it listened is kept for the short bound only.
    let (replayed, first) = a.send().await;
    assert!(!replayed);
    a.changed_past(0).await;
    assert_eq!(b.send().await, (true, first.clone()));
    b.changed_past(0).await;
    // Both cache the record (A from its completion, B from a replay out of the store) and
    // answer from memory.
    for instance in [&a, &b] {
        assert_eq!(instance.send().await, (true, first.clone()));
        assert_eq!(instance.send().await, (true, first.clone()));
        assert_eq!(instance.metrics.replay_cache_hits(), 2);
    }

    let seen = (*a.changes.borrow(), *b.changes.borrow());
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args([
            "keys",
            "evict",
            "--database-url",
            &url,
            "--key-secret",
            SECRET,
        ])
        .args(["--tenant", "default", "--route", "POST /orders", "k1"])
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_PREVIOUS_KEY_SECRET")
        .output()
        .expect("run idemkey keys evict");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    a.changed_past(seen.0).await;
    b.changed_past(seen.1).await;

    // Neither replays from memory: the key runs again (once), and that answer is replayed.
    let (replayed, second) = b.send().await;
    assert!(!replayed, "evicted, yet replayed");
    assert_ne!(second, first);
    assert_eq!(a.send().await, (true, second.clone()));
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM cache_effects")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(effects, 2);
}
