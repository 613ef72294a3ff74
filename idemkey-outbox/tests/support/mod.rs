//! What the outbox's test files share: fresh stores with an `effects` table, and messages
//! enqueued one transaction each.

#![allow(dead_code)] // not every test file uses every helper

#[cfg(feature = "nats")]
pub(crate) mod nats;

use futures::future::BoxFuture;
use idemkey_core::BoxError;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use idemkey_core::Store;
use idemkey_core::outbox::{Message, MessageFilter, OutboxStore};
use idemkey_mysql::MySqlStore;
use idemkey_outbox::Round;
use idemkey_outbox::{Outgoing, enqueue_on};
use idemkey_postgres::PgStore;
use idemkey_sqlite::rusqlite::params;
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use tempfile::TempDir;
use tokio::sync::watch;

/// A fresh store of any kind with an `effects` table (no unique constraint: only the
/// inbox keeps duplicates out); the guard keeps a SQLite file.
pub(crate) trait Fresh: OutboxStore + Sized {
    /// A migrated store on a fresh database, and the guard of its SQLite file.
    async fn fresh() -> (Self, Option<TempDir>);
    /// Writes one effect row labelled `label` on `conn`.
    fn insert_effect(
        conn: &mut Self::Connection,
        label: String,
    ) -> BoxFuture<'_, Result<(), BoxError>>;
    /// How many effect rows labelled `label` are committed.
    async fn effects(&self, label: &str) -> i64;
}

impl Fresh for SqliteStore {
    async fn fresh() -> (Self, Option<TempDir>) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("outbox.db").display());
        let store = SqliteStore::connect(&url).await.unwrap();
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        (store, Some(dir))
    }
    fn insert_effect(
        conn: &mut sqlx::SqliteConnection,
        label: String,
    ) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (label) VALUES (?1)")
                .bind(label)
                .execute(conn)
                .await
                .map(|_| ())
                .map_err(BoxError::from)
        })
    }
    async fn effects(&self, label: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = ?1")
            .bind(label)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }
}

impl Fresh for RusqliteStore {
    async fn fresh() -> (Self, Option<TempDir>) {
        let dir = tempfile::tempdir().unwrap();
        let store = RusqliteStore::open(dir.path().join("outbox.db")).unwrap();
        store.migrate().await.unwrap();
        store
            .with_connection(|c| c.execute_batch("CREATE TABLE effects (label TEXT NOT NULL)"))
            .unwrap();
        (store, Some(dir))
    }
    fn insert_effect(
        conn: &mut idemkey_sqlite::rusqlite::Connection,
        label: String,
    ) -> BoxFuture<'_, Result<(), BoxError>> {
        let done = conn.execute("INSERT INTO effects (label) VALUES (?1)", params![label]);
        Box::pin(async move { done.map(|_| ()).map_err(BoxError::from) })
    }
    async fn effects(&self, label: &str) -> i64 {
        self.with_connection(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM effects WHERE label = ?1",
                params![label],
                |r| r.get(0),
            )
        })
        .unwrap()
    }
}

impl Fresh for PgStore {
    async fn fresh() -> (Self, Option<TempDir>) {
        (fresh_postgres().await.0, None)
    }
    fn insert_effect(
        conn: &mut sqlx::PgConnection,
        label: String,
    ) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (label) VALUES ($1)")
                .bind(label)
                .execute(conn)
                .await
                .map(|_| ())
                .map_err(BoxError::from)
        })
    }
    async fn effects(&self, label: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = $1")
            .bind(label)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }
}

impl Fresh for MySqlStore {
    async fn fresh() -> (Self, Option<TempDir>) {
        (fresh_mysql().await.0, None)
    }
    fn insert_effect(
        conn: &mut sqlx::MySqlConnection,
        label: String,
    ) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (label) VALUES (?)")
                .bind(label)
                .execute(conn)
                .await
                .map(|_| ())
                .map_err(BoxError::from)
        })
    }
    async fn effects(&self, label: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = ?")
            .bind(label)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }
}

/// The MariaDB server of this test binary, started by the first test that needs it.
fn mariadb() -> &'static idemkey_testkit::MariaDb {
    static SERVER: OnceLock<idemkey_testkit::MariaDb> = OnceLock::new();
    SERVER.get_or_init(idemkey_testkit::MariaDb::start)
}

/// A fresh, migrated database on this binary's MariaDB server with an `effects` table, and
/// its URL.
pub(crate) async fn fresh_mysql() -> (MySqlStore, String) {
    let url = tokio::task::spawn_blocking(|| mariadb().fresh_database())
        .await
        .unwrap();
    let store = MySqlStore::connect(&url, 24).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (label VARCHAR(255) NOT NULL) ENGINE = InnoDB")
        .execute(store.pool())
        .await
        .unwrap();
    (store, url)
}

/// A fresh, migrated PostgreSQL database with an `effects` table, and its URL.
pub(crate) async fn fresh_postgres() -> (PgStore, String) {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .unwrap();
    let store = PgStore::connect(&url, 24).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    (store, url)
}

/// Enqueues `n` messages of type `kind`, one transaction each, in groups of their own.
pub(crate) async fn enqueue_many<S: OutboxStore>(store: &S, kind: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let mut tx = store.begin().await.unwrap();
        let message = Outgoing::new(kind, &serde_json::json!({ "n": i })).unwrap();
        ids.push(
            enqueue_on::<S>(&mut tx, &format!("op-{i}"), message)
                .await
                .unwrap(),
        );
        store.commit(tx).await.unwrap();
    }
    ids
}

/// Every message, newest first.
pub(crate) async fn all_messages<S: OutboxStore>(store: &S) -> Vec<Message> {
    let mut conn = store.acquire().await.unwrap();
    let filter = MessageFilter {
        state: None,
        limit: 100_000,
    };
    store.messages(&mut conn, &filter).await.unwrap()
}

/// Messages not yet sent (pending or dead).
pub(crate) async fn unsent(store: &PgStore) -> u64 {
    let mut conn = store.acquire().await.unwrap();
    let stats = store.outbox_stats(&mut conn).await.unwrap();
    stats.pending + stats.dead
}

/// Waits until at most `left` messages are unsent; fails after `within`. With the `rounds`
/// of a relay in this process it looks again after each of the relay's rounds; without (a
/// relay in another process, whose progress only the store shows) it polls the store.
pub(crate) async fn until_unsent_at_most(
    store: &PgStore,
    left: u64,
    within: Duration,
    what: &str,
    mut rounds: Option<watch::Receiver<Round>>,
) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let now_unsent = unsent(store).await;
        if now_unsent <= left {
            return now_unsent;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {now_unsent} unsent after {within:?}"
        );
        match rounds.as_mut() {
            Some(rounds) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = tokio::time::timeout(left, rounds.changed()).await;
            }
            None => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}
