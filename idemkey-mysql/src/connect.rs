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

    /// Runs the pending migrations. MySQL commits each `CREATE TABLE` on its own (DDL is
    /// not transactional there): a run that failed half-way leaves its migration marked
    /// unfinished in the tracking table, and the next run refuses to go on until an
    /// operator has looked (sqlx's "dirty" migration).
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        Self::migrator().run(&self.pool).await
    }
}
