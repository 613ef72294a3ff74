//! [`MySqlStore`]'s construction: its pool and session settings, and its migrations.

use std::str::FromStr;
use std::time::Duration;

use idemkey_core::StoreError;
use sqlx::Executor;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

use crate::codes::{UNKNOWN_SYSTEM_VARIABLE, error, number};

/// Galera's causality checks for the session: reads (and `BEGIN`), updates and deletes,
/// inserts and replaces wait until the node has applied every write the cluster ordered
/// before them.
const SYNC_WAIT: &str = "SET SESSION wsrep_sync_wait = 7";

/// Makes the session's statements causal on a Galera node ([`SYNC_WAIT`]). Without the
/// checks a node answers from what it has applied so far: a claim there would not see a
/// record another node has committed, and a lost race would read no winner. MariaDB knows
/// the variable whether or not it runs in a cluster (out of one, it does nothing); MySQL
/// without Galera does not (error 1193), and then there is nothing to make causal.
async fn causal_reads(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
    match conn.execute(SYNC_WAIT).await {
        Err(e) if number(&e) == Some(UNKNOWN_SYSTEM_VARIABLE) => Ok(()),
        done => done.map(drop),
    }
}

/// An idempotency store in a MySQL 8 or MariaDB (10.6 and later) database, on InnoDB.
///
/// Its transactions run at the server's isolation level (InnoDB's default is REPEATABLE
/// READ), so the caller's effect written on the claim's transaction keeps the semantics the
/// application chose; the claim reads the record that took a key with a locking read,
/// which sees the latest committed row whatever the snapshot (docs/records.md, "MySQL and
/// MariaDB").
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pub(crate) pool: MySqlPool,
    /// How long the store's transactions wait for a lock when not told otherwise.
    pub(crate) lock_wait: Duration,
}

impl MySqlStore {
    /// The name of this crate's migration tracking table.
    pub const MIGRATIONS_TABLE: &'static str = "idemkey_migrations";

    /// How long a claim waits for another attempt holding the same key (InnoDB's
    /// `innodb_lock_wait_timeout`, set at the start of each of the store's transactions),
    /// then answers "in flight".
    pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(5);

    /// A store on an existing pool (for example the application's own). Its connections
    /// should be in strict mode (`STRICT_TRANS_TABLES` or `STRICT_ALL_TABLES`, the default
    /// of MySQL 8 and MariaDB 10.2.4 and later), as [`connect`](Self::connect)'s are: a
    /// server that is not would store a value that does not fit cut to fit, with a warning.
    /// On a Galera cluster they should also set `wsrep_sync_wait = 7`, as `connect`'s do.
    pub fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            lock_wait: Self::DEFAULT_LOCK_WAIT,
        }
    }

    /// Connects to `url` (`mysql://user:password@host:port/database`, MariaDB too) with a
    /// pool of `max_connections`. Each connection is put in strict mode
    /// (`STRICT_ALL_TABLES` added to the server's `sql_mode`), so a value that does not fit
    /// a column is an error, never cut to fit, and causal on a Galera node
    /// (`wsrep_sync_wait = 7`: a statement first waits until the node has applied what the
    /// cluster committed before it; MySQL without Galera lacks the variable and is left
    /// alone); the store's transactions wait
    /// [`DEFAULT_LOCK_WAIT`](Self::DEFAULT_LOCK_WAIT) for a lock.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options = MySqlConnectOptions::from_str(url).map_err(error)?;
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET SESSION sql_mode = CONCAT(@@sql_mode, ',STRICT_ALL_TABLES')")
                        .await?;
                    causal_reads(conn).await
                })
            })
            .connect_with(options)
            .await
            .map_err(error)?;
        Ok(Self::new(pool))
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// This store's migrations, tracked in [`MIGRATIONS_TABLE`](Self::MIGRATIONS_TABLE) so
    /// they share a database with the application's own.
    pub fn migrator() -> Migrator {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.dangerous_set_table_name(Self::MIGRATIONS_TABLE);
        migrator
    }

    /// Runs the pending migrations ([`migrate_with`](Self::migrate_with) this store's
    /// [`migrator`](Self::migrator)). MySQL commits each `CREATE TABLE` on its own (DDL is
    /// not transactional there): a run that failed half-way leaves its migration marked
    /// unfinished in the tracking table, and the next run refuses to go on until an
    /// operator has looked (sqlx's "dirty" migration).
    pub async fn migrate(&self) -> Result<(), MigrationError> {
        self.migrate_with(&[&Self::migrator()]).await
    }

    /// Runs `migrators` in order (this store's, the application's own) on one connection,
    /// holding a named lock of the database meanwhile (`GET_LOCK`, its answer checked), so
    /// that processes starting at once on a fresh database run each migration once. sqlx's
    /// own lock, `GET_LOCK(…, -1)` whose answer it does not read, let three servers starting
    /// together on MariaDB run the same migration at once, and the others found it half
    /// applied. The lock goes with the connection; a process waits for another one's
    /// migrations for at most [`MIGRATION_WAIT`](Self::MIGRATION_WAIT).
    pub async fn migrate_with(&self, migrators: &[&Migrator]) -> Result<(), MigrationError> {
        const LOCK: &str = "SELECT GET_LOCK(CONCAT('idemkey_migrate_', MD5(DATABASE())), ?)";
        const UNLOCK: &str = "SELECT RELEASE_LOCK(CONCAT('idemkey_migrate_', MD5(DATABASE())))";
        let mut conn = self.pool.acquire().await.map_err(MigrateError::Execute)?;
        let locked: Option<i64> = sqlx::query_scalar(LOCK)
            .bind(Self::MIGRATION_WAIT.as_secs())
            .fetch_one(&mut *conn)
            .await
            .map_err(MigrateError::Execute)?;
        if locked != Some(1) {
            return Err(MigrationError::Locked(Self::MIGRATION_WAIT));
        }
        let mut migrated = Ok(());
        for migrator in migrators {
            // `run` on a borrowed connection is refused in a `Send` future ("`Acquire` is not
            // general enough"); `run_direct` is sqlx's way around that, the same steps.
            if let Err(e) = migrator.run_direct(None, &mut *conn, false).await {
                migrated = Err(e.into());
                break;
            }
        }
        sqlx::query(UNLOCK)
            .execute(&mut *conn)
            .await
            .map_err(MigrateError::Execute)?;
        migrated
    }

    /// How long [`migrate_with`](Self::migrate_with) waits for another process's migrations
    /// on the same database.
    pub const MIGRATION_WAIT: Duration = Duration::from_secs(300);
}

/// Why [`MySqlStore::migrate`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// Another process held the database's migration lock for longer than the wait.
    #[error(
        "another process has been running idemkey's migrations on this database for over {0:?} (it holds the lock `idemkey_migrate_…`); try again once it is done"
    )]
    Locked(Duration),
    /// A migration failed, or the database could not be read.
    #[error(transparent)]
    Migrate(#[from] MigrateError),
}
