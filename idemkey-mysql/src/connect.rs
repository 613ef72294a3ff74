//! [`MySqlStore`]'s construction: its pool and session settings, and its migrations.

use std::convert::Infallible;
use std::str::FromStr;
use std::time::Duration;

use idemkey_core::StoreError;
use sqlx::Executor;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

use idemkey_sqlx::Code;
use tokio::time::Instant;

use crate::codes::{DUPLICATE_KEY, UNKNOWN_SYSTEM_VARIABLE, code, error, error_number};

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
        Err(e) if error_number(&e) == Some(UNKNOWN_SYSTEM_VARIABLE) => Ok(()),
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
    /// How long [`MySqlStore::migrate_with`] waits for another process's migrations.
    migration_wait: Duration,
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
            migration_wait: Self::MIGRATION_WAIT,
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
    /// holding the database's migration lock meanwhile, so that processes starting at once
    /// on a fresh database run each migration once, on one server or on several nodes of a
    /// Galera cluster.
    ///
    /// The lock is a row of its own table, `idemkey_migration_lock`, created if missing
    /// before the lock is taken (it is not one of the migrations), inserted on its own
    /// (autocommit); it names its holder, the holder's node (`@@hostname:@@port`)
    /// and connection, and when it lapses. The insert that meets another's row (error 1062,
    /// or 1213 where Galera's certification let another node's insert win) waits, trying
    /// again every 100 ms for at most [`migration_wait`](Self::with_migration_wait), then
    /// fails with [`MigrationError::Locked`]. A row is taken over at once when it has lapsed,
    /// or when it is this node's and its holder's connection is gone (the holder holds a
    /// named lock of its own, `idemkey_migrate_<holder>`, on that connection). The holder
    /// renews the row every [`MIGRATION_LEASE`](Self::MIGRATION_LEASE) / 3 through another of
    /// the pool's connections (with a pool of one it cannot, and a run longer than the lease
    /// may be taken over), and deletes it once the migrations have run, whether or not they
    /// succeeded.
    pub async fn migrate_with(&self, migrators: &[&Migrator]) -> Result<(), MigrationError> {
        let mut conn = self.pool.acquire().await.map_err(MigrateError::Execute)?;
        // Dropped (the future cancelled), the connection closes and its named lock goes
        // with it: the row is then this node's with no one behind it.
        conn.close_on_drop();
        let holder = self.lock_migrations(&mut conn).await?;
        let migrated = tokio::select! {
            migrated = run_migrations(&mut conn, migrators) => migrated,
            never = renew_lease(&self.pool, &holder) => match never {},
        };
        let released = sqlx::query(RELEASE_LOCK)
            .bind(&holder)
            .execute(&mut *conn)
            .await
            .map_err(MigrateError::Execute);
        migrated?;
        released?;
        Ok(())
    }

    /// How long [`migrate_with`](Self::migrate_with) waits for another process's migrations
    /// on the same database unless told otherwise
    /// ([`with_migration_wait`](Self::with_migration_wait)).
    pub const MIGRATION_WAIT: Duration = Duration::from_secs(300);

    /// How long the migration lock of a process that stopped renewing it holds: another
    /// process takes it over once it has lapsed (at once on the holder's own node if the
    /// holder's connection is gone).
    pub const MIGRATION_LEASE: Duration = Duration::from_secs(60);

    /// This store with [`migrate_with`](Self::migrate_with) waiting at most `wait` for
    /// another process's migrations (default [`MIGRATION_WAIT`](Self::MIGRATION_WAIT)), for
    /// example to fail fast when a start has a deadline of its own.
    pub fn with_migration_wait(mut self, wait: Duration) -> Self {
        self.migration_wait = wait;
        self
    }

    /// Takes the migration lock on `conn`, waiting for another holder for at most the
    /// migration wait: the holder id to release it with.
    async fn lock_migrations(
        &self,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<String, MigrationError> {
        let deadline = Instant::now() + self.migration_wait;
        conn.execute(CREATE_LOCK_TABLE)
            .await
            .map_err(MigrateError::Execute)?;
        let (holder, node): (String, String) = sqlx::query_as(WHO)
            .fetch_one(&mut *conn)
            .await
            .map_err(MigrateError::Execute)?;
        let named: Option<i64> = sqlx::query_scalar(HOLD_NAMED_LOCK)
            .bind(&holder)
            .fetch_one(&mut *conn)
            .await
            .map_err(MigrateError::Execute)?;
        if named != Some(1) {
            // The name is this run's own: nobody else can hold it.
            return Err(MigrateError::Execute(sqlx::Error::Protocol(format!(
                "the named lock `idemkey_migrate_{holder}` was refused"
            )))
            .into());
        }
        loop {
            let taken = sqlx::query(TAKE_LOCK)
                .bind(&holder)
                .bind(&node)
                .bind(Self::MIGRATION_LEASE.as_secs())
                .execute(&mut *conn)
                .await;
            match taken {
                Ok(_) => return Ok(holder),
                Err(e) if held(&e) => {}
                Err(e) => return Err(MigrateError::Execute(e).into()),
            }
            let current: Option<(String, i64)> = sqlx::query_as(LOCK_HOLDER)
                .bind(&node)
                .fetch_optional(&mut *conn)
                .await
                .map_err(MigrateError::Execute)?;
            if let Some((other, 1)) = current {
                match sqlx::query(RELEASE_LOCK)
                    .bind(&other)
                    .execute(&mut *conn)
                    .await
                {
                    // Another process may have taken it over first: try again at once.
                    Ok(_) => continue,
                    Err(e) if held(&e) => continue,
                    Err(e) => return Err(MigrateError::Execute(e).into()),
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(MigrationError::Locked(self.migration_wait));
            }
            tokio::time::sleep(LOCK_POLL.min(deadline - now)).await;
        }
    }
}

/// How often a process waiting for another's migrations tries the lock again.
const LOCK_POLL: Duration = Duration::from_millis(100);

/// The migration lock's table, one row while a process runs the migrations. `expires_at` is in
/// the database's seconds (`UNIX_TIMESTAMP()`), so that the processes' clocks do not matter.
const CREATE_LOCK_TABLE: &str = "CREATE TABLE IF NOT EXISTS idemkey_migration_lock (
    id TINYINT PRIMARY KEY,
    holder VARCHAR(64) NOT NULL,
    node VARCHAR(255) NOT NULL,
    connection BIGINT UNSIGNED NOT NULL,
    expires_at BIGINT NOT NULL
) ENGINE = InnoDB";

/// A holder id of this run's own, and the node its connection is on.
const WHO: &str = "SELECT UUID(), CONCAT(@@hostname, ':', @@port)";

/// The holder's named lock on its connection: while it is held the holder is alive.
const HOLD_NAMED_LOCK: &str = "SELECT GET_LOCK(CONCAT('idemkey_migrate_', ?), 0)";

const TAKE_LOCK: &str =
    "INSERT INTO idemkey_migration_lock (id, holder, node, connection, expires_at)
     VALUES (1, ?, ?, CONNECTION_ID(), UNIX_TIMESTAMP() + ?)";

/// The lock's holder, and 1 when it is gone: its lease has lapsed, or it is on this node
/// (bound) and its named lock is free, its connection having ended.
const LOCK_HOLDER: &str = "SELECT holder,
        expires_at < UNIX_TIMESTAMP()
        OR (node = ? AND IS_USED_LOCK(CONCAT('idemkey_migrate_', holder)) IS NULL)
   FROM idemkey_migration_lock WHERE id = 1";

const RENEW_LOCK: &str = "UPDATE idemkey_migration_lock SET expires_at = UNIX_TIMESTAMP() + ?
  WHERE id = 1 AND holder = ?";

const RELEASE_LOCK: &str = "DELETE FROM idemkey_migration_lock WHERE id = 1 AND holder = ?";

/// Whether `e` says another process's statement on the lock row won: the row is there
/// (1062), or ours lost to it (busy: 1213 on Galera's certification, 1205).
fn held(e: &sqlx::Error) -> bool {
    error_number(e).is_some_and(|n| n == DUPLICATE_KEY || code(n) == Code::Busy)
}

/// Runs `migrators` in order on `conn`, stopping at the first that fails.
async fn run_migrations(
    conn: &mut sqlx::MySqlConnection,
    migrators: &[&Migrator],
) -> Result<(), MigrationError> {
    for migrator in migrators {
        // `run` on a borrowed connection is refused in a `Send` future ("`Acquire` is not
        // general enough"); `run_direct` is sqlx's way around that, the same steps.
        migrator.run_direct(None, &mut *conn, false).await?;
    }
    Ok(())
}

/// Renews `holder`'s migration lock every third of its lease, through the pool, until
/// dropped. A renewal that fails is tried again at the next one: the lease outlasts two.
async fn renew_lease(pool: &MySqlPool, holder: &str) -> Infallible {
    let period = MySqlStore::MIGRATION_LEASE / 3;
    let mut renewals = tokio::time::interval_at(Instant::now() + period, period);
    loop {
        renewals.tick().await;
        let _ = sqlx::query(RENEW_LOCK)
            .bind(MySqlStore::MIGRATION_LEASE.as_secs())
            .bind(holder)
            .execute(pool)
            .await;
    }
}

/// Why [`MySqlStore::migrate`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// Another process held the database's migration lock for longer than the wait.
    #[error(
        "another process has been running idemkey's migrations on this database for over {0:?} (its row in `idemkey_migration_lock` names its node and connection); try again once it is done"
    )]
    Locked(Duration),
    /// A migration failed, or the database could not be read.
    #[error(transparent)]
    Migrate(#[from] MigrateError),
}
