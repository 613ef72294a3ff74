//! The conformance suite on SQLite: each test on a fresh database file, once on a store from
//! `SqliteStore::connect` (write transactions on the store's own writer connection) and once
//! on a store made with `SqliteStore::new` on a pool (each transaction's connection from the
//! pool, in the same writer queue).

use std::future::Future;
use std::str::FromStr;

use idemkey_core::Store;
use idemkey_sqlite::SqliteStore;
use idemkey_testkit::Harness;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions};

struct SqliteHarness {
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl SqliteHarness {
    async fn new() -> Self {
        Self::with(|url| async move { SqliteStore::connect(&url).await.expect("connect") }).await
    }

    async fn on_pool() -> Self {
        Self::with(|url| async move {
            let options = SqliteConnectOptions::from_str(&url)
                .expect("url")
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal);
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await
                .expect("pool");
            SqliteStore::new(pool)
        })
        .await
    }

    async fn with<F: Future<Output = SqliteStore>>(open: impl FnOnce(String) -> F) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("test.db").display());
        let store = open(url).await;
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Self { store, _dir: dir }
    }
}

impl Harness for SqliteHarness {
    type Store = SqliteStore;

    fn store(&self) -> &SqliteStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut SqliteConnection, label: &str) {
        sqlx::query("INSERT INTO effects (label) VALUES (?1)")
            .bind(label)
            .execute(conn)
            .await
            .expect("effect");
    }

    async fn count_effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(self.store.pool())
            .await
            .expect("count")
    }

    async fn sever(&self, tx: <SqliteStore as Store>::Transaction) {
        // SQLite has no server session to kill; dropping the transaction rolls it back
        // and returns the connection, as a closed connection would.
        drop(tx);
    }
}

idemkey_testkit::conformance_tests!(SqliteHarness::new());

mod on_the_applications_pool {
    use super::SqliteHarness;

    idemkey_testkit::conformance_tests!(SqliteHarness::on_pool());
}
