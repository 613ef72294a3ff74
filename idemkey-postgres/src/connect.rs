//! [`PgStore`]'s construction: its pool and connect options, the pooler parameter of its
//! URL, and its migrations.

use std::str::FromStr;
use std::time::Duration;

use idemkey_core::StoreError;
use idemkey_sqlx::group::GroupedWrites;
use sqlx::Connection;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use crate::kept::Kept;
use crate::migrate::Unprepared;
use crate::sqlstate::error;

/// An idempotency store in a PostgreSQL database.
#[derive(Debug, Clone)]
pub struct PgStore {
    pub(crate) pool: PgPool,
    /// External mode's reservations and completions, committed in groups
    /// (`idemkey_sqlx::group`).
    pub(crate) grouped: GroupedWrites,
    /// Connections the store's own `COMMIT`s ended, kept for its next transactions without
    /// the pool's test on release (`crate::kept`).
    pub(crate) kept: Kept,
    /// How long the store's transactions wait for a lock, set in each of them (`None`: the
    /// connections' own setting): through a pooler in transaction mode.
    pub(crate) lock_wait: Option<Duration>,
    /// The URL names a pooler in transaction mode ([`PgStore::POOLER_PARAMETER`]).
    pub(crate) pooled: bool,
}

impl PgStore {
    /// The name of this crate's migration tracking table.
    pub const MIGRATIONS_TABLE: &'static str = "idemkey_migrations";

    /// A store on an existing pool (for example the application's own).
    ///
    /// Between its own transactions the store keeps up to half of the pool's connections,
    /// out of the pool, so that a connection its `COMMIT` ended needs no test by the pool
    /// before the next transaction (docs/decisions.md, "No round trip to test a PostgreSQL
    /// connection"): a kept connection goes back to the pool after 50 ms unused, so
    /// the application's own queries on a pool the store has exhausted wait at most about
    /// that long for one.
    pub fn new(pool: PgPool) -> Self {
        Self {
            kept: Kept::new(&pool),
            pool,
            // One group of each kind at a time: the writes that arrive while it commits make
            // the next group, so each commit carries more rows (docs/decisions.md,
            // "Concurrent external-mode writes are committed in groups").
            grouped: GroupedWrites::default(),
            lock_wait: None,
            pooled: false,
        }
    }

    /// How long a statement waits for a lock on connections made by
    /// [`connect`](Self::connect): a claim waits this long for another attempt holding the
    /// same key, then answers "in flight". Pools made elsewhere keep their own setting.
    pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(5);

    /// Connects to `url` (`postgres://…`) with a pool of `max_connections`; the store's
    /// transactions and grouped writes wait [`DEFAULT_LOCK_WAIT`](Self::DEFAULT_LOCK_WAIT) for
    /// a lock.
    ///
    /// The store sends no statement that outlives its transaction, so `url` may name a
    /// pooler in transaction mode (PgBouncer's `pool_mode = transaction`) as well as the
    /// server: see docs/guide/operating.md, "Behind a pooler". Directly, the wait is each
    /// connection's `lock_timeout`, set when it connects; through such a pooler, which
    /// refuses that startup setting, it is set in each transaction (`SET LOCAL`).
    ///
    /// The pool hands out connections without pinging them first (a round trip per request
    /// saved). A connection the server has dropped meanwhile shows at its first statement:
    /// [`begin`](idemkey_core::Store::begin) then starts the transaction again on another
    /// connection (a `BEGIN` has no effect of its own); any other first statement fails as
    /// [`StoreError::Unavailable`].
    ///
    /// A URL through a pooler in transaction mode says so with
    /// [`POOLER_PARAMETER`](Self::POOLER_PARAMETER) (`?idemkey-pooler=transaction`): the
    /// store then follows no eviction notices (`LISTEN` needs a session of its own), and an
    /// in-process cache of answers trusts each entry for a bounded time only.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let (url, pooled) = pooler_parameter(url)?;
        let mut options = PgConnectOptions::from_str(&url).map_err(error)?;
        // Set once per connection where a connection is a session: one statement less in
        // every transaction's first message (a measured cost on the database's CPU).
        let wait = format!("{}ms", Self::DEFAULT_LOCK_WAIT.as_millis());
        if !pooled {
            options = options.options([("lock_timeout", wait)]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(error)?;
        Ok(Self {
            lock_wait: pooled.then_some(Self::DEFAULT_LOCK_WAIT),
            pooled,
            ..Self::new(pool)
        })
    }

    /// The parameter of a [`connect`](Self::connect) URL that says it names a pooler in
    /// transaction mode (PgBouncer's `pool_mode = transaction`); its one value is
    /// `transaction`. It is idemkey's, not sent to the pooler.
    pub const POOLER_PARAMETER: &'static str = "idemkey-pooler";

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether the store was connected through a pooler in transaction mode
    /// ([`POOLER_PARAMETER`](Self::POOLER_PARAMETER)). The application's own statements
    /// with parameters must then not be kept prepared (sqlx's
    /// [`persistent(false)`](sqlx::query::Query::persistent)) and must run inside a
    /// transaction: sqlx parses and executes such a statement in two exchanges, which only
    /// a transaction keeps on one server connection. See docs/guide/operating.md, "Behind a
    /// pooler".
    pub fn through_pooler(&self) -> bool {
        self.pooled
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
        self.migrate_with(&Self::migrator()).await
    }

    /// Runs the pending migrations of `migrator` (this crate's or the application's own),
    /// all in one transaction on a connection of their own; a migration marked
    /// `-- no-transaction` runs in it too.
    ///
    /// sqlx's migrator decides what to run (what is applied, the checksums, a database left
    /// dirty) and keeps its table as it does with its own runner, so `sqlx migrate info`
    /// reads it; each statement goes as a simple query, none kept prepared. So the run
    /// neither meets nor leaves a named statement on the server connection, which behind a
    /// pooler in transaction mode other clients use before and after it (docs/decisions.md,
    /// "Migrations run as simple queries"). Concurrent runs on one database wait for each
    /// other on the advisory lock of sqlx's migrator, taken as a transaction's lock, which
    /// only the `COMMIT` releases: the next run sees what this one created. If anything
    /// fails the connection is closed unfinished, and the server (or the pooler, which drops
    /// a server connection its client left inside a transaction) rolls back and releases
    /// everything.
    pub async fn migrate_with(&self, migrator: &Migrator) -> Result<(), MigrateError> {
        let mut conn = PgConnection::connect_with(&self.pool.connect_options()).await?;
        let migrated = async {
            let mut tx = conn.begin().await?;
            // What `run` does once it has a connection; `run` itself, generic over
            // `Acquire`, makes a future the compiler cannot prove `Send` here.
            migrator
                .run_direct(None, &mut Unprepared(&mut tx), false)
                .await?;
            tx.commit().await?;
            Ok::<_, MigrateError>(())
        }
        .await;
        match migrated {
            Ok(()) => {
                // Closing only says goodbye: everything is committed.
                let _ = conn.close().await;
                Ok(())
            }
            Err(e) => {
                drop(conn);
                Err(e)
            }
        }
    }
}

/// `url` without [`PgStore::POOLER_PARAMETER`], and whether it said `transaction`. Any
/// other value is refused.
pub(crate) fn pooler_parameter(url: &str) -> Result<(String, bool), StoreError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), false));
    };
    let mut pooled = false;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some((PgStore::POOLER_PARAMETER, "transaction")) => pooled = true,
            Some((PgStore::POOLER_PARAMETER, value)) => {
                return Err(error(sqlx::Error::Configuration(
                    format!(
                        "{}={value} is not a pooler mode idemkey knows: the one it takes is \
                         `transaction` (a pooler in session mode needs no parameter)",
                        PgStore::POOLER_PARAMETER
                    )
                    .into(),
                )));
            }
            _ => kept.push(pair),
        }
    }
    Ok(match kept.is_empty() {
        true => (base.to_owned(), pooled),
        false => (format!("{base}?{}", kept.join("&")), pooled),
    })
}

#[cfg(test)]
mod tests;
