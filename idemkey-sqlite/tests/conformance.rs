//! The conformance suite on SQLite: each test on a fresh database file.

use idemkey_core::Store;
use idemkey_sqlite::SqliteStore;
use idemkey_testkit::Harness;
use sqlx::sqlite::SqliteConnection;

struct SqliteHarness {
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl SqliteHarness {
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("test.db").display());
        let store = SqliteStore::connect(&url).await.expect("connect");
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
