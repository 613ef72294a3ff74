use idemkey_core::{ListFilter, Store, StoreAdmin};

use super::*;
use crate::listen::{NotListening, listen};

#[test]
fn the_pooler_parameter_is_read_and_removed() {
    let read = |url: &str| pooler_parameter(url).map_err(|e| e.to_string());
    assert_eq!(
        read("postgres://a@h:6432/db?idemkey-pooler=transaction"),
        Ok(("postgres://a@h:6432/db".to_owned(), true))
    );
    assert_eq!(
        read("postgres://a@h/db?sslmode=disable&idemkey-pooler=transaction&application_name=x"),
        Ok((
            "postgres://a@h/db?sslmode=disable&application_name=x".to_owned(),
            true
        ))
    );
    assert_eq!(
        read("postgres://a@h/db?sslmode=disable"),
        Ok(("postgres://a@h/db?sslmode=disable".to_owned(), false))
    );
    assert!(read("postgres://a@h/db?idemkey-pooler=statement").is_err());
}

/// A fresh database: its direct URL, and its URL through PgBouncer in transaction mode
/// (without idemkey's parameter).
async fn pooled_database() -> (String, String) {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("fresh database");
    let direct = url.clone();
    let pooled = tokio::task::spawn_blocking(move || idemkey_testkit::pgbouncer_url(&direct))
        .await
        .expect("pgbouncer");
    (url, pooled)
}

/// A store through PgBouncer in transaction mode, on a fresh database, and the
/// database's direct URL.
async fn pooled_store() -> (PgStore, String) {
    let (url, pooled) = pooled_database().await;
    let pooled = format!("{pooled}?{}=transaction", PgStore::POOLER_PARAMETER);
    let store = PgStore::connect(&pooled, 4).await.expect("connect");
    assert!(store.through_pooler());
    (store, url)
}

/// Through PgBouncer without the parameter, `connect` is refused at once: the pooler
/// refuses the `lock_timeout` the store then sets at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_through_pgbouncer_without_the_parameter_is_refused() {
    let (_, pooled) = pooled_database().await;
    let refused = PgStore::connect(&pooled, 4).await;
    assert!(refused.is_err(), "connected through the pooler unmarked");
}

/// Through the pooler, migrations run, and run again (each run on a server connection
/// an earlier one may have used): nothing of a run is left on its server connection,
/// neither the migrator's prepared statements nor its advisory lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_again_and_again_through_pgbouncer() {
    let (store, _) = pooled_store().await;
    for _ in 0..3 {
        store.migrate().await.expect("migrate through the pooler");
    }
    let mut conn = store.acquire().await.expect("connection");
    let listed = store.list(&mut conn, &ListFilter::default()).await;
    assert!(
        matches!(listed, Ok(ref records) if records.is_empty()),
        "{listed:?}"
    );
}

/// Migrations run by several processes at once on a fresh database (as `serve`s started
/// together do), directly and through the pooler: each run waits for the one before it
/// to commit, so every one succeeds and the schema is made once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_wait_for_each_other() {
    let (url, pooled) = pooled_database().await;
    let pooled = format!("{pooled}?{}=transaction", PgStore::POOLER_PARAMETER);
    let mut stores = Vec::new();
    for url in [&url, &url, &pooled, &pooled] {
        stores.push(PgStore::connect(url, 2).await.expect("connect"));
    }
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(stores.len()));
    let mut runs = tokio::task::JoinSet::new();
    for store in stores {
        let start = start.clone();
        runs.spawn(async move {
            start.wait().await;
            store.migrate().await
        });
    }
    while let Some(run) = runs.join_next().await {
        run.expect("task").expect("every concurrent run succeeds");
    }
}

/// A listener connected directly hears its probe; one through the pooler in transaction
/// mode never can, and says so rather than claiming to listen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_through_pgbouncer_is_refused_by_its_probe() {
    // An application's pool through the pooler, given to the store unmarked.
    let (url, pooled) = pooled_database().await;
    let pooled = PgStore::new(PgPool::connect(&pooled).await.expect("connect"));
    let direct = PgStore::connect(&url, 2).await.expect("connect");
    let listener_pool = |store: &PgStore| {
        PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(store.pool().connect_options().as_ref().clone())
    };
    assert!(
        listen(&listener_pool(&direct), direct.pool()).await.is_ok(),
        "a direct listener hears its probe"
    );
    let refused = listen(&listener_pool(&pooled), pooled.pool()).await;
    assert!(
        matches!(refused, Err(NotListening::MissedProbe)),
        "a listener through the pooler is refused"
    );
}
