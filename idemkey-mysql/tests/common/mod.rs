//! The MySQL store's test harness: one throwaway MariaDB server per test binary, a fresh
//! database on it per test, with a table of effects the tests write next to their claims.

#![allow(dead_code)] // Each test binary uses its part.

use std::sync::OnceLock;

use idemkey_core::Store;
use idemkey_mysql::MySqlStore;
use idemkey_testkit::{Harness, MariaDb};
use sqlx::mysql::{MySqlConnection, MySqlPool};

/// The server of this test binary, started by the first test that needs it.
pub(crate) fn server() -> &'static MariaDb {
    static SERVER: OnceLock<MariaDb> = OnceLock::new();
    SERVER.get_or_init(MariaDb::start)
}

pub(crate) struct MySqlHarness {
    pub(crate) store: MySqlStore,
    /// The fresh database's URL.
    pub(crate) url: String,
    /// A pool of its own for the harness's checks.
    pub(crate) admin: MySqlPool,
}

impl MySqlHarness {
    /// A migrated store on a fresh database.
    pub(crate) async fn new() -> Self {
        let url = tokio::task::spawn_blocking(|| server().fresh_database())
            .await
            .expect("fresh database");
        // Room for every claimant of the 64-way race to hold its own transaction.
        let store = MySqlStore::connect(&url, 80).await.expect("connect");
        store.migrate().await.expect("migrate");
        let admin = MySqlPool::connect(&url).await.expect("admin");
        sqlx::query("CREATE TABLE effects (label VARCHAR(255) NOT NULL) ENGINE = InnoDB")
            .execute(&admin)
            .await
            .expect("effects table");
        Self { store, url, admin }
    }

    /// How many row lock waits there are on the server now (`Innodb_row_lock_current_waits`,
    /// counted as they begin and end; `information_schema.innodb_trx` is a cache refreshed
    /// only after 100 ms without reads, so a loop reading it never sees a change). Tests
    /// that count waits take [`one_at_a_time`] first, so the waits are theirs.
    pub(crate) async fn lock_waits(&self) -> usize {
        self.status("Innodb_row_lock_current_waits").await
    }

    async fn status(&self, name: &str) -> usize {
        let count: String = sqlx::query_scalar(
            "SELECT variable_value FROM information_schema.global_status
              WHERE variable_name = ?",
        )
        .bind(name.to_uppercase())
        .fetch_one(&self.admin)
        .await
        .expect(name);
        count.parse().expect("a count")
    }

    /// How many deadlocks InnoDB has broken on the server so far.
    pub(crate) async fn deadlocks(&self) -> usize {
        self.status("Innodb_deadlocks").await
    }
}

/// A guard for the tests of one binary that wait on locks, held for the whole test: they
/// run one at a time, so each counts only its own waits ([`MySqlHarness::lock_waits`]).
pub(crate) async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK_WAITERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK_WAITERS.lock().await
}

impl Harness for MySqlHarness {
    type Store = MySqlStore;

    fn store(&self) -> &MySqlStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut MySqlConnection, label: &str) {
        write_effect(conn, label).await;
    }

    async fn count_effects(&self) -> i64 {
        count_effects(&self.admin).await
    }

    async fn sever(&self, tx: <MySqlStore as Store>::Transaction) {
        sever(&self.admin, tx).await;
    }
}

/// Writes one effect row labelled `label` on `conn`.
pub(crate) async fn write_effect(conn: &mut MySqlConnection, label: &str) {
    sqlx::query("INSERT INTO effects (label) VALUES (?)")
        .bind(label)
        .execute(conn)
        .await
        .expect("effect");
}

/// How many effect rows are committed, read on `admin`.
pub(crate) async fn count_effects(admin: &MySqlPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(admin)
        .await
        .expect("count")
}

/// The server kills the owner's session mid-transaction (through `admin`), as if its client
/// crashed.
pub(crate) async fn sever(admin: &MySqlPool, mut tx: <MySqlStore as Store>::Transaction) {
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *tx)
        .await
        .expect("connection id");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
        .execute(admin)
        .await
        .expect("kill");
    drop(tx);
}

/// Asserts that every one of idemkey's migrations is applied on `pool`'s database, once and
/// whole (`context` names the case in the failure).
pub(crate) async fn assert_migrated(pool: &MySqlPool, context: &str) {
    let applied: Vec<(i64, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT version, success FROM {} ORDER BY version",
        MySqlStore::MIGRATIONS_TABLE
    )))
    .fetch_all(pool)
    .await
    .expect("the tracking table");
    let expected: Vec<(i64, bool)> = MySqlStore::migrator()
        .iter()
        .map(|m| (m.version, true))
        .collect();
    assert_eq!(
        applied, expected,
        "{context}: each migration applied once, whole"
    );
}
