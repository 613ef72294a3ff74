//! The conformance suite on `RusqliteStore`: each test on a fresh database file, migrated
//! through sqlx as `SqliteStore`'s is, the statements run through rusqlite.

use idemkey_core::Store;
use idemkey_sqlite::RusqliteStore;
use idemkey_sqlite::rusqlite::{Connection, params};
use idemkey_testkit::Harness;

struct RusqliteHarness {
    store: RusqliteStore,
    _dir: tempfile::TempDir,
}

impl RusqliteHarness {
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = RusqliteStore::open(dir.path().join("test.db")).expect("open");
        store.migrate().await.expect("migrate");
        store
            .with_connection(|c| c.execute_batch("CREATE TABLE effects (label TEXT NOT NULL)"))
            .expect("effects table");
        Self { store, _dir: dir }
    }
}

impl Harness for RusqliteHarness {
    type Store = RusqliteStore;

    fn store(&self) -> &RusqliteStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut Connection, label: &str) {
        conn.execute("INSERT INTO effects (label) VALUES (?1)", params![label])
            .expect("effect");
    }

    async fn count_effects(&self) -> i64 {
        self.store
            .with_connection(|c| c.query_row("SELECT count(*) FROM effects", [], |r| r.get(0)))
            .expect("count")
    }

    async fn sever(&self, tx: <RusqliteStore as Store>::Transaction) {
        // No server session to kill: dropping the transaction rolls it back, as a closed
        // connection would.
        drop(tx);
    }
}

idemkey_testkit::conformance_tests!(RusqliteHarness::new());
