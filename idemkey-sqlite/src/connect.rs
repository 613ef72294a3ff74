//! [`SqliteStore`]'s construction: its pool, connect options and writer, and its migrations.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::StoreError;
use idemkey_sqlx::group::GroupedWrites;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::store::error;
use crate::writer::Writer;

/// An idempotency store in a SQLite database.
///
/// Its write transactions ([`Store::begin`]) take turns in a first-come, first-served queue
/// in memory, shared by the store's clones: clone the store rather than make two on one
/// database, or the two queues meet in SQLite's busy handler again.
///
/// [`Store::begin`]: idemkey_core::Store::begin
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pub(crate) pool: SqlitePool,
    pub(crate) writer: Arc<Writer>,
    /// External mode's reservations and completions, written in groups, each group in one
    /// turn of the writer (`idemkey_sqlx::group`).
    pub(crate) grouped: GroupedWrites,
}

impl SqliteStore {
    /// The name of this crate's migration tracking table.
    pub const MIGRATIONS_TABLE: &'static str = "idemkey_migrations";

    /// A store on an existing pool. The pool should use WAL and a busy time-out, as
    /// [`connect`](Self::connect) sets up; the busy time-out its connections report
    /// (`PRAGMA busy_timeout`, read once) also bounds the wait in the writer queue. Each
    /// write transaction takes its connection from the pool, in turn (so the pool's
    /// `before_acquire` hooks run for it), where [`connect`](Self::connect)'s store keeps
    /// one writer connection of its own.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            writer: Arc::new(Writer::new(None, false)),
            grouped: GroupedWrites::default(),
        }
    }

    /// The busy time-out of [`connect`](Self::connect): how long a claim waits for the write
    /// lock before it fails with [`StoreError::Busy`] (503 `store-busy`).
    pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

    /// Opens (creating if missing) the database at `url` (`sqlite:path.db`), in WAL mode with
    /// a 5 s busy time-out. Write transactions take turns on one connection the store keeps
    /// for them; the pool of eight serves the rest.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_busy_timeout(url, Self::DEFAULT_BUSY_TIMEOUT).await
    }

    /// Like [`connect`](Self::connect), with another busy time-out. SQLite serializes writers,
    /// so this bounds how long any claim waits, whichever key holds the lock: it is the
    /// SQLite form of the in-flight wait bound. It bounds the wait in the store's writer
    /// queue, and then SQLite's own wait for writers outside the queue.
    pub async fn connect_with_busy_timeout(
        url: &str,
        busy_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url).map_err(error)?;
        Self::connect_with(options, busy_timeout).await
    }

    /// Like [`connect_with_busy_timeout`](Self::connect_with_busy_timeout), on the file at
    /// `path` as it is named: no URL is parsed, so a `%` or `?` in the name is part of it.
    pub async fn open_file(path: &Path, busy_timeout: Duration) -> Result<Self, StoreError> {
        Self::connect_with(SqliteConnectOptions::new().filename(path), busy_timeout).await
    }

    async fn connect_with(
        options: SqliteConnectOptions,
        busy_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(busy_timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .map_err(error)?;
        Ok(Self {
            pool,
            writer: Arc::new(Writer::new(Some(busy_timeout), true)),
            grouped: GroupedWrites::default(),
        })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// This store's migrations, tracked in [`MIGRATIONS_TABLE`](Self::MIGRATIONS_TABLE) so
    /// they share a database with the application's own.
    pub fn migrator() -> Migrator {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.dangerous_set_table_name(Self::MIGRATIONS_TABLE);
        migrator
    }

    /// Runs the pending migrations.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        Self::migrator().run(&self.pool).await
    }
}
