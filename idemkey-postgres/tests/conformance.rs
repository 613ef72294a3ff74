//! The conformance suite on PostgreSQL: each test on a fresh database of a throwaway
//! server (or of the server `DATABASE_URL` names).

use idemkey_core::Store;
use idemkey_postgres::PgStore;
use idemkey_testkit::Harness;
use sqlx::postgres::PgConnection;

struct PgHarness {
    store: PgStore,
}

impl PgHarness {
    async fn new() -> Self {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        // Room for every claimant of the 64-way race to hold its own transaction.
        let store = PgStore::connect(&url, 80).await.expect("connect");
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Self { store }
    }
}

impl Harness for PgHarness {
    type Store = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut PgConnection, label: &str) {
        sqlx::query("INSERT INTO effects (label) VALUES ($1)")
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

    async fn sever(&self, mut tx: <PgStore as Store>::Transaction) {
        // The server kills the owner's backend mid-transaction, as if its client crashed.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .expect("pid");
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(self.store.pool())
            .await
            .expect("terminate");
        assert!(killed, "the owner's backend was terminated");
        drop(tx);
    }
}

idemkey_testkit::conformance_tests!(PgHarness::new());
