//! The databases idemkey runs on: which store a URL names ([`with_database`], the one place
//! that tells the kinds apart), how each kind's store is opened ([`Backend`]), and the
//! payments API's own SQL, per backend. The idempotency records are the store's; these are
//! the effects the layer protects. What the gateway and the operator commands need as well
//! (settings, health, idemkey's migrations) is [`GatewayDb`], which [`AppDb`] extends.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use idemkey_core::Store;
use idemkey_core::outbox::OutboxStore;
use idemkey_mysql::MySqlStore;
use idemkey_postgres::PgStore;
use idemkey_sqlite::rusqlite::{self, OptionalExtension};
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use serde::Serialize;
use sqlx::migrate::Migrator;
use sqlx::mysql::MySqlConnection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

use crate::gateway::GatewayDb;
use crate::secret::{SecretUrl, redacted};

/// Work to do on the database a URL names, whichever its kind: [`with_database`] runs it
/// with that kind's store as `S`, which the work opens itself ([`Backend::connect`],
/// [`open_existing`]), or keeps trying to, as `serve` does while a database server starts.
pub trait OnDatabase {
    /// What the work answers.
    type Output;

    /// Does the work on a database whose store is `S`.
    fn run<S: Backend>(self) -> impl Future<Output = anyhow::Result<Self::Output>>;
}

/// Runs `work` with the store of the database kind `url` names by its scheme: `sqlite:` a
/// [`RusqliteStore`] (which runs its statements on the calling thread: docs/decisions.md,
/// "SQLite's writer without sqlx's worker thread"), `postgres://` (or `postgresql://`) a
/// [`PgStore`], `mysql://` (or `mariadb://`) a [`MySqlStore`]. Any other URL is refused,
/// naming the kinds there are. Every command and `serve`, `gateway` and the demo
/// pick their store here, and nowhere else.
///
/// To add a database: give its store the traits `serve` and the commands use ([`AppDb`],
/// with [`GatewayDb`] and the outbox's store) and [`Backend`], then add its scheme here, one
/// arm, and name it in the refusal.
///
/// ```no_run
/// use idemkey_server::{Backend, DatabaseOptions, OnDatabase, with_database};
///
/// /// Runs idemkey's and the payments API's migrations, as `idemkey migrate` does.
/// struct Migrate(DatabaseOptions);
///
/// impl OnDatabase for Migrate {
///     type Output = ();
///
///     async fn run<S: Backend>(self) -> anyhow::Result<()> {
///         S::connect(&self.0).await?.migrate_all().await
///     }
/// }
///
/// # async fn example() -> anyhow::Result<()> {
/// let url = "sqlite:idemkey.db";
/// with_database(url, Migrate(DatabaseOptions::new(url.to_owned(), 32))).await
/// # }
/// ```
pub async fn with_database<W: OnDatabase>(url: &str, work: W) -> anyhow::Result<W::Output> {
    if url.starts_with("sqlite:") {
        work.run::<RusqliteStore>().await
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        work.run::<PgStore>().await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        work.run::<MySqlStore>().await
    } else {
        anyhow::bail!(
            "unsupported database URL {:?}: expected sqlite:<path>, postgres://… or mysql://…",
            redacted(url)
        )
    }
}

/// Where the database is, and how long a claim waits for SQLite's write lock.
#[derive(Debug, Clone)]
pub struct DatabaseOptions {
    /// The database URL: `sqlite:<path>`, `postgres://…` or `mysql://…`.
    pub url: SecretUrl,
    /// Connections in the pool (PostgreSQL, MySQL).
    pub max_connections: u32,
    /// How long a SQLite claim waits for the database's single write lock (its busy
    /// time-out); PostgreSQL's and MySQL's claims are bounded per route by the layer.
    pub lock_wait: Duration,
}

impl DatabaseOptions {
    /// The lock wait unless told otherwise: SQLite's default busy time-out, 5 s.
    pub const DEFAULT_LOCK_WAIT: Duration = idemkey_sqlite::SqliteStore::DEFAULT_BUSY_TIMEOUT;

    /// The database at `url`, with a pool of `max_connections` and the default lock wait.
    pub fn new(url: impl Into<SecretUrl>, max_connections: u32) -> Self {
        Self {
            url: url.into(),
            max_connections,
            lock_wait: Self::DEFAULT_LOCK_WAIT,
        }
    }
}

/// A store that opens itself from [`DatabaseOptions`]: one for each kind of database
/// [`with_database`] tells apart.
pub trait Backend: AppDb {
    /// Connects to `db`, creating what is missing (a SQLite file): for `serve`, `gateway`,
    /// `migrate` and the demo.
    fn connect(db: &DatabaseOptions) -> impl Future<Output = anyhow::Result<Self>> + Send;

    /// Opens `db` as it is and creates nothing (a missing SQLite file is an error naming
    /// it); [`open_existing`] also checks it has idemkey's tables.
    fn open(db: &DatabaseOptions) -> impl Future<Output = anyhow::Result<Self>> + Send;
}

/// How an operator command is told to name the database `idemkey serve` uses.
const NAME_THE_DATABASE: &str =
    "pass --database-url (or IDEMKEY_DATABASE_URL) naming the database `idemkey serve` uses";

impl Backend for RusqliteStore {
    async fn connect(db: &DatabaseOptions) -> anyhow::Result<Self> {
        let file = sqlite_file(&db.url)?;
        private_sqlite_file(&file)?;
        RusqliteStore::open_with_busy_timeout(&file, db.lock_wait)
            .with_context(|| format!("cannot open the SQLite database {}", &*db.url))
    }

    async fn open(db: &DatabaseOptions) -> anyhow::Result<Self> {
        let url = &*db.url;
        let file = sqlite_file(url)?;
        if !file.exists() {
            anyhow::bail!("`{url}` does not exist; {NAME_THE_DATABASE}");
        }
        // Opened as it is: nothing is created, and the journal mode is left as the file says
        // (WAL once `serve` made it), as setting it would write to a file that may not be ours.
        RusqliteStore::open_existing(&file, db.lock_wait)
            .with_context(|| format!("cannot open the SQLite database `{url}`"))
    }
}

impl Backend for PgStore {
    async fn connect(db: &DatabaseOptions) -> anyhow::Result<Self> {
        PgStore::connect(&db.url, db.max_connections)
            .await
            .with_context(|| format!("cannot connect to PostgreSQL at `{}`", redacted(&db.url)))
    }

    async fn open(db: &DatabaseOptions) -> anyhow::Result<Self> {
        <Self as Backend>::connect(db).await
    }
}

impl Backend for MySqlStore {
    async fn connect(db: &DatabaseOptions) -> anyhow::Result<Self> {
        MySqlStore::connect(&db.url, db.max_connections)
            .await
            .with_context(|| format!("cannot connect to MySQL at `{}`", redacted(&db.url)))
    }

    async fn open(db: &DatabaseOptions) -> anyhow::Result<Self> {
        <Self as Backend>::connect(db).await
    }
}

/// Opens the database `db` names for an operator command: it must exist and carry idemkey's
/// tables (`idemkey serve`, `gateway` or `migrate` made them, or an application's own run of
/// idemkey's migrations). Creates nothing: a missing SQLite file or missing tables is an
/// error naming the URL and how to fix it.
pub async fn open_existing<S: Backend>(db: &DatabaseOptions) -> anyhow::Result<S> {
    let store = S::open(db).await?;
    let shown = redacted(&db.url);
    let missing = store
        .missing_tables()
        .await
        .with_context(|| format!("cannot read the tables of `{shown}`"))?;
    if !missing.is_empty() {
        anyhow::bail!(
            "`{shown}` has no idemkey tables ({} missing): idemkey's migrations did not run on \
             it; {NAME_THE_DATABASE}, or run `idemkey migrate --database-url …` first",
            missing.join(", ")
        );
    }
    Ok(store)
}

/// The file a `sqlite:` URL names, as sqlx reads the URL: `sqlite:<path>` or
/// `sqlite://<path>`, %-escapes decoded. The store opens that path and nothing else, so a URL
/// it cannot honour is refused, naming it and what to write instead: an in-memory database
/// ([`in_memory`]) or none (each of the store's connections would open a database of its
/// own), a SQLite `file:` URI (SQLite would open another file than the one
/// [`private_sqlite_file`] made), query parameters (the store applies none: sqlx's `mode`,
/// `cache`, `immutable` and `vfs` would have no effect), or a name that the migrations,
/// given `sqlite:<path>`, would read as another file (a `?` or a %-escape in it).
fn sqlite_file(url: &str) -> anyhow::Result<PathBuf> {
    let shown = redacted(url);
    let (location, query) = url
        .split_once('?')
        .map_or((url, None), |(location, query)| (location, Some(query)));
    let options = SqliteConnectOptions::from_str(location)
        .with_context(|| format!("invalid SQLite URL `{shown}`"))?;
    let file = options.get_filename();
    if in_memory(url, file) {
        anyhow::bail!(
            "`{shown}` is an in-memory database, which the server's connections cannot share; \
             name a file (sqlite:idemkey.db)"
        );
    }
    let name = file.to_string_lossy();
    if name.is_empty() {
        anyhow::bail!(
            "`{shown}` names no file, and SQLite would open a temporary database for each of \
             the server's connections; name a file (sqlite:idemkey.db)"
        );
    }
    if let Some(uri) = name.strip_prefix("file:") {
        anyhow::bail!(
            "`{shown}` names its file as a SQLite `file:` URI, which the server does not read \
             (SQLite would open another file than the one it makes private); write \
             `sqlite:{}`, or `sqlite:./file:…` for a file whose name begins with `file:`",
            uri_path(uri)
        );
    }
    let parameters: Vec<&str> = query
        .into_iter()
        .flat_map(|query| query.split('&'))
        .filter(|pair| !pair.is_empty())
        .map(|pair| pair.split_once('=').map_or(pair, |(name, _)| name))
        .collect();
    if !parameters.is_empty() {
        anyhow::bail!(
            "`{shown}` has query parameters ({}), which the server does not apply: it opens \
             the file by its path, read-write; write `{location}`",
            parameters.join(", ")
        );
    }
    let reread = SqliteConnectOptions::from_str(&format!("sqlite:{name}"));
    if !reread.is_ok_and(|reread| reread.get_filename() == file) {
        anyhow::bail!(
            "`{shown}` names the file `{name}`, which the migrations would read as another \
             file (they are given `sqlite:{name}`, whose `?` or %-escape they read again); \
             name a file without `?` or %-escapes"
        );
    }
    Ok(file.to_owned())
}

/// The path of the `file:` URI whose text after `file:` is `uri`, as SQLite reads it: without
/// its query, and without its authority (empty or `localhost`).
fn uri_path(uri: &str) -> &str {
    let path = uri.split(['?', '#']).next().unwrap_or_default();
    match path.strip_prefix("//") {
        Some(authority_and_path) => authority_and_path
            .find('/')
            .map_or(authority_and_path, |slash| &authority_and_path[slash..]),
        None => path,
    }
}

/// Whether `url`, whose file sqlx reads as `file`, names an in-memory database: as sqlx
/// reads it (`:memory:`, which it renames `file:sqlx-in-memory-N`, or `mode=memory` in the
/// URL's query) or as SQLite reads the file it is opened as (`:memory:`, or a `file:` URI
/// whose path is `:memory:` or whose query has `mode=memory`, SQLite being built to read
/// URIs). Opened as a path, sqlx's name or a URI would otherwise be a new file in the
/// working directory.
fn in_memory(url: &str, file: &Path) -> bool {
    fn asks_memory(query: Option<&str>) -> bool {
        query.is_some_and(|q| q.split('&').any(|pair| pair == "mode=memory"))
    }
    let file = file.to_string_lossy();
    let uri = file.strip_prefix("file:");
    let (path, query) = match uri {
        Some(uri) => uri
            .split_once('?')
            .map_or((uri, None), |(path, query)| (path, Some(query))),
        None => (&*file, None),
    };
    path == ":memory:"
        || uri.is_some_and(|uri| uri.starts_with("sqlx-in-memory-"))
        || asks_memory(query)
        || asks_memory(url.split_once('?').map(|(_, query)| query))
}

/// Makes sure the SQLite file at `path` is readable by its owner only before SQLite opens
/// it: it keeps the idempotency records and, by default, the key secret. A missing file is
/// created empty with mode 0600, and SQLite gives its `-wal` and `-shm` files the same mode.
/// An existing file keeps its mode (the operator chose it), with a warning when other users
/// may read it.
pub(crate) fn private_sqlite_file(path: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

        let created = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path);
        match created {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let mode = std::fs::metadata(path)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    let shown = path.display();
                    eprintln!(
                        "warning: {shown} is open to other users (mode {mode:o}); it holds the \
                         idempotency records and may hold the key secret: `chmod 600 {shown}`"
                    );
                }
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!("cannot create the SQLite file {}", path.display())));
            }
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// A payment, as stored and as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Payment {
    /// `pay_` and 24 hex digits.
    pub id: String,
    /// The owning tenant (not shown to callers).
    #[serde(skip)]
    pub tenant: String,
    /// Minor units.
    pub amount: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The customer reference.
    pub customer: String,
    /// Free text.
    pub description: Option<String>,
    /// Always `succeeded` here.
    pub status: String,
    /// RFC 3339.
    pub created_at: String,
    /// The client's own reference, unique per tenant for good.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// What [`AppDb::insert_payment`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentWrite {
    /// The payment and its ledger entry are written.
    Created,
    /// The tenant already has a payment with this reference: nothing was written.
    ReferenceUsed {
        /// The existing payment.
        payment_id: String,
    },
}

/// A store that also holds the payments tables: what `idemkey serve` runs on.
pub trait AppDb: GatewayDb + OutboxStore {
    /// Runs idemkey's migrations, the settings' and the payments API's.
    fn migrate_all(&self) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Writes a payment and its ledger entry on `conn` (the claim's transaction), unless the
    /// tenant already has a payment with its reference: then nothing, and that payment's id.
    fn insert_payment<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        payment: &'a Payment,
    ) -> impl Future<Output = anyhow::Result<PaymentWrite>> + Send + 'a;

    /// One of a tenant's payments.
    fn payment(
        &self,
        tenant: &str,
        id: &str,
    ) -> impl Future<Output = anyhow::Result<Option<Payment>>> + Send;

    /// A tenant's newest payments, and how many it has in all.
    fn payments(
        &self,
        tenant: &str,
        limit: i64,
    ) -> impl Future<Output = anyhow::Result<(Vec<Payment>, i64)>> + Send;

    /// Whether `error`, an error of the database's own (`sqlx::Error::Database`), says it
    /// cannot take work now (and why), as opposed to a statement it refused; classified by
    /// the dialect's codes, never by message. The server asks it of every database
    /// error, and answers for the errors that are not the database's (I/O, the pool) itself.
    fn unavailable(error: &sqlx::Error) -> Option<Unavailable>;
}

/// Why the database cannot take work now: what `serve` answers 503 `store-unavailable` for,
/// rather than 500, and waits out at start when the database is [`unreachable`](Self::unreachable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unavailable {
    /// Why, for the problem's detail (`the database is read-only`).
    pub reason: &'static str,
    /// Whether there is no connection to it (refused, lost, or the server starting up or
    /// shutting down), as opposed to a database that answered and cannot take a write.
    pub unreachable: bool,
}

impl Unavailable {
    /// No connection to the database: refused or lost.
    pub const UNREACHABLE: Self = Self {
        reason: "the database is unreachable",
        unreachable: true,
    };
    /// The server ended the connection, or refuses new ones while it starts or stops.
    pub const CONNECTION_LOST: Self = Self {
        reason: "the connection to the database was lost",
        unreachable: true,
    };

    /// The database answered and cannot take a write now, for `reason`.
    pub const fn answered(reason: &'static str) -> Self {
        Self {
            reason,
            unreachable: false,
        }
    }
}

/// Whether `error`, from a store `S`, says the database cannot take work now: no connection
/// (I/O, TLS, the wire protocol, a pool time-out), a closed pool, or what
/// [`AppDb::unavailable`] reads in the database's own error. `None` for anything else.
pub(crate) fn unavailable<S: AppDb>(error: &sqlx::Error) -> Option<Unavailable> {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut => Some(Unavailable::UNREACHABLE),
        // Closed as the server stops: nothing to wait for, but not the statement's fault.
        sqlx::Error::PoolClosed => Some(Unavailable::answered("the database is unreachable")),
        sqlx::Error::Database(_) => S::unavailable(error),
        _ => None,
    }
}

/// Why SQLite cannot take a write now, from its (extended) result code: the primary code is
/// its low byte.
pub(crate) fn sqlite_unavailable(code: i32) -> Option<Unavailable> {
    let reason = match code & 0xff {
        13 => "the database is full",
        8 => "the database is read-only",
        5 | 6 => "the database is locked by another writer",
        10 => "the database file could not be read or written",
        14 => "the database file could not be opened",
        _ => return None,
    };
    Some(Unavailable::answered(reason))
}

/// SQLite's [`AppDb::unavailable`], from the code sqlx gives as text.
fn sqlite_db_unavailable(error: &sqlx::Error) -> Option<Unavailable> {
    let sqlx::Error::Database(db) = error else {
        return None;
    };
    sqlite_unavailable(db.code()?.parse().ok()?)
}

static SQLITE_APP_MIGRATIONS: Migrator = sqlx::migrate!("./migrations/sqlite");
static PG_APP_MIGRATIONS: Migrator = sqlx::migrate!("./migrations/postgres");
static MYSQL_APP_MIGRATIONS: Migrator = sqlx::migrate!("./migrations/mysql");

/// The payments API's SQL on SQLite, run through sqlx by [`SqliteStore`] and through
/// rusqlite by [`RusqliteStore`], with the same `?N` parameters.
mod sqlite_sql {
    /// The payment, `?1`–`?9` in the order of the `payments` table; nothing when the
    /// tenant's reference is taken.
    macro_rules! insert_payment {
        () => {
            "INSERT INTO payments
                 (id, tenant, amount, currency, customer, description, status, created_at,
                  reference)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
             ON CONFLICT (tenant, reference) WHERE reference IS NOT NULL DO NOTHING"
        };
    }
    /// Its ledger entry, from the same parameters, when the payment was written.
    macro_rules! insert_ledger_entry {
        () => {
            "INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
             SELECT ?1, ?2, ?3, ?4, ?8
              WHERE EXISTS (SELECT 1 FROM payments WHERE id = ?1 AND reference IS ?9)"
        };
    }
    /// The payment that holds a tenant's reference.
    pub(super) const PAYMENT_BY_REFERENCE: &str =
        "SELECT id FROM payments WHERE tenant = ?1 AND reference = ?2";
    pub(super) const INSERT_PAYMENT: &str = insert_payment!();
    pub(super) const INSERT_LEDGER_ENTRY: &str = insert_ledger_entry!();
    /// Both, in one string: sqlx binds `?N` by number across its statements.
    pub(super) const INSERT_PAYMENT_AND_LEDGER_ENTRY: &str =
        concat!(insert_payment!(), ";\n", insert_ledger_entry!());
    pub(super) const PAYMENT: &str = "SELECT * FROM payments WHERE tenant = ?1 AND id = ?2";
    pub(super) const PAYMENTS: &str =
        "SELECT * FROM payments WHERE tenant = ?1 ORDER BY created_at DESC, id LIMIT ?2";
    pub(super) const COUNT_PAYMENTS: &str = "SELECT count(*) FROM payments WHERE tenant = ?1";
}

impl AppDb for SqliteStore {
    fn unavailable(error: &sqlx::Error) -> Option<Unavailable> {
        sqlite_db_unavailable(error)
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        // The payments API's first, whose first migration makes the settings' table too.
        SQLITE_APP_MIGRATIONS.run(self.pool()).await?;
        self.migrate_gateway().await
    }

    async fn insert_payment(
        &self,
        conn: &mut SqliteConnection,
        p: &Payment,
    ) -> anyhow::Result<PaymentWrite> {
        // Both rows in one call to SQLite (one hand-off to the connection's worker thread).
        let written = bind_payment(sqlx::query(sqlite_sql::INSERT_PAYMENT_AND_LEDGER_ENTRY), p)
            .execute(&mut *conn)
            .await?;
        if written.rows_affected() > 0 {
            return Ok(PaymentWrite::Created);
        }
        let payment_id = sqlx::query_scalar(sqlite_sql::PAYMENT_BY_REFERENCE)
            .bind(&p.tenant)
            .bind(&p.reference)
            .fetch_one(conn)
            .await?;
        Ok(PaymentWrite::ReferenceUsed { payment_id })
    }

    async fn payment(&self, tenant: &str, id: &str) -> anyhow::Result<Option<Payment>> {
        Ok(sqlx::query_as(sqlite_sql::PAYMENT)
            .bind(tenant)
            .bind(id)
            .fetch_optional(self.pool())
            .await?)
    }

    async fn payments(&self, tenant: &str, limit: i64) -> anyhow::Result<(Vec<Payment>, i64)> {
        let data = sqlx::query_as(sqlite_sql::PAYMENTS)
            .bind(tenant)
            .bind(limit)
            .fetch_all(self.pool())
            .await?;
        let total = sqlx::query_scalar(sqlite_sql::COUNT_PAYMENTS)
            .bind(tenant)
            .fetch_one(self.pool())
            .await?;
        Ok((data, total))
    }
}

/// A payment's columns as rusqlite parameters `?1`–`?9`, in the order of the table.
fn payment_params(p: &Payment) -> impl rusqlite::Params + '_ {
    (
        &p.id,
        &p.tenant,
        p.amount,
        &p.currency,
        &p.customer,
        &p.description,
        &p.status,
        &p.created_at,
        &p.reference,
    )
}

fn payment_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<Payment> {
    Ok(Payment {
        id: row.get("id")?,
        tenant: row.get("tenant")?,
        amount: row.get("amount")?,
        currency: row.get("currency")?,
        customer: row.get("customer")?,
        description: row.get("description")?,
        status: row.get("status")?,
        created_at: row.get("created_at")?,
        reference: row.get("reference")?,
    })
}

/// A short-lived sqlx store on a [`RusqliteStore`]'s file, for the migrations sqlx runs on
/// it (opened by its path, so no URL is rebuilt from the name).
pub(crate) async fn sqlx_store(
    store: &RusqliteStore,
) -> Result<SqliteStore, idemkey_core::StoreError> {
    SqliteStore::open_file(store.path(), SqliteStore::DEFAULT_BUSY_TIMEOUT).await
}

impl AppDb for RusqliteStore {
    /// Its migrations' errors are sqlx's; its statements' are rusqlite's, which
    /// the server reads by the same codes.
    fn unavailable(error: &sqlx::Error) -> Option<Unavailable> {
        sqlite_db_unavailable(error)
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        // The payments API's migrations are sqlx's, as on `SqliteStore`, through a
        // short-lived sqlx connection to the same file; they come first, as there.
        let sqlx = sqlx_store(self).await?;
        let migrated = SQLITE_APP_MIGRATIONS.run(sqlx.pool()).await;
        sqlx.pool().close().await;
        migrated?;
        self.migrate_gateway().await
    }

    async fn insert_payment(
        &self,
        conn: &mut rusqlite::Connection,
        p: &Payment,
    ) -> anyhow::Result<PaymentWrite> {
        // On the calling thread, in the writer's turn: no hand-off.
        if conn
            .prepare_cached(sqlite_sql::INSERT_PAYMENT)?
            .execute(payment_params(p))?
            == 0
        {
            let payment_id = conn
                .prepare_cached(sqlite_sql::PAYMENT_BY_REFERENCE)?
                .query_row((&p.tenant, &p.reference), |r| r.get(0))?;
            return Ok(PaymentWrite::ReferenceUsed { payment_id });
        }
        conn.prepare_cached(sqlite_sql::INSERT_LEDGER_ENTRY)?
            .execute(payment_params(p))?;
        Ok(PaymentWrite::Created)
    }

    async fn payment(&self, tenant: &str, id: &str) -> anyhow::Result<Option<Payment>> {
        Ok(self.with_connection(|c| {
            c.prepare_cached(sqlite_sql::PAYMENT)?
                .query_row([tenant, id], payment_row)
                .optional()
        })?)
    }

    async fn payments(&self, tenant: &str, limit: i64) -> anyhow::Result<(Vec<Payment>, i64)> {
        Ok(self.with_connection(|c| {
            let data = c
                .prepare_cached(sqlite_sql::PAYMENTS)?
                .query_map(rusqlite::params![tenant, limit], payment_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            let total = c.query_row(sqlite_sql::COUNT_PAYMENTS, [tenant], |r| r.get(0))?;
            Ok((data, total))
        })?)
    }
}

impl AppDb for PgStore {
    /// By SQLSTATE: 53100 disk full, class 53 out of resources, 25006 read-only, and a lost
    /// connection or a server starting up or shutting down
    /// ([`idemkey_postgres::is_database_unavailable`]).
    fn unavailable(error: &sqlx::Error) -> Option<Unavailable> {
        if idemkey_postgres::is_database_unavailable(error) {
            return Some(Unavailable::CONNECTION_LOST);
        }
        let sqlx::Error::Database(db) = error else {
            return None;
        };
        let code = db.code()?;
        if code == "53100" {
            Some(Unavailable::answered("the database's disk is full"))
        } else if code.starts_with("53") {
            Some(Unavailable::answered("the database is out of resources"))
        } else if code == "25006" {
            Some(Unavailable::answered("the database is read-only"))
        } else {
            None
        }
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        // The payments API's first, whose first migration makes the settings' table too.
        self.migrate_with(&PG_APP_MIGRATIONS).await?;
        self.migrate_gateway().await
    }

    async fn insert_payment(
        &self,
        conn: &mut PgConnection,
        p: &Payment,
    ) -> anyhow::Result<PaymentWrite> {
        // Both rows in one statement (one round trip): the ledger entry is made from the
        // payment row the first insert returns, none when the reference is taken (the insert
        // waits for a transaction that holds it uncommitted, then sees its outcome).
        let written = bind_payment(
            sqlx::query(
                "WITH payment AS (
                 INSERT INTO payments
                     (id, tenant, amount, currency, customer, description, status, created_at,
                      reference)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                 ON CONFLICT (tenant, reference) WHERE reference IS NOT NULL DO NOTHING
                 RETURNING id, tenant, amount, currency, created_at
             )
             INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
             SELECT id, tenant, amount, currency, created_at FROM payment",
            ),
            p,
        )
        // Kept prepared on a direct connection; behind a pooler the next transaction may
        // be on another server connection, which would not have it.
        .persistent(!self.through_pooler())
        .execute(&mut *conn)
        .await?;
        if written.rows_affected() > 0 {
            return Ok(PaymentWrite::Created);
        }
        // A statement of its own: it sees the row committed while the insert waited on it.
        let payment_id =
            sqlx::query_scalar("SELECT id FROM payments WHERE tenant = $1 AND reference = $2")
                .bind(&p.tenant)
                .bind(&p.reference)
                .persistent(!self.through_pooler())
                .fetch_one(conn)
                .await?;
        Ok(PaymentWrite::ReferenceUsed { payment_id })
    }

    async fn payment(&self, tenant: &str, id: &str) -> anyhow::Result<Option<Payment>> {
        let mut conn = PgReader::new(self).await?;
        let payment = sqlx::query_as("SELECT * FROM payments WHERE tenant = $1 AND id = $2")
            .bind(tenant)
            .bind(id)
            .persistent(conn.persistent())
            .fetch_optional(&mut *conn)
            .await?;
        conn.finish(self).await?;
        Ok(payment)
    }

    async fn payments(&self, tenant: &str, limit: i64) -> anyhow::Result<(Vec<Payment>, i64)> {
        let mut conn = PgReader::new(self).await?;
        let data = sqlx::query_as(
            "SELECT * FROM payments WHERE tenant = $1 ORDER BY created_at DESC, id LIMIT $2",
        )
        .bind(tenant)
        .bind(limit)
        .persistent(conn.persistent())
        .fetch_all(&mut *conn)
        .await?;
        let total = sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant = $1")
            .bind(tenant)
            .persistent(conn.persistent())
            .fetch_one(&mut *conn)
            .await?;
        conn.finish(self).await?;
        Ok((data, total))
    }
}

/// The payments API's SQL on MySQL and MariaDB. `tenant` and `reference` are bytes
/// (VARBINARY, compared byte for byte), read back as text.
mod mysql_sql {
    /// The columns of a payment, in the order of the `payments` table.
    macro_rules! payment_columns {
        () => {
            "id, CONVERT(tenant USING utf8mb4) AS tenant, amount, currency, customer,
             description, status, created_at, CONVERT(reference USING utf8mb4) AS reference"
        };
    }
    /// The payment, its nine columns in the order of the table. A taken reference is
    /// error 1062, which ends this statement only.
    pub(super) const INSERT_PAYMENT: &str = "INSERT INTO payments
             (id, tenant, amount, currency, customer, description, status, created_at,
              reference)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)";
    /// Its ledger entry: payment id, tenant, amount, currency, time.
    pub(super) const INSERT_LEDGER_ENTRY: &str =
        "INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
         VALUES (?, ?, ?, ?, ?)";
    /// The payment that holds a tenant's reference: a locking read, which sees the latest
    /// committed row whatever the transaction's snapshot (REPEATABLE READ's began before).
    /// By the unique index's columns: `reference_tenant` is the tenant of a payment with a
    /// reference (migration 0003).
    pub(super) const PAYMENT_BY_REFERENCE: &str =
        "SELECT id FROM payments WHERE reference_tenant = ? AND reference = ? LOCK IN SHARE MODE";
    pub(super) const PAYMENT: &str = concat!(
        "SELECT ",
        payment_columns!(),
        " FROM payments WHERE tenant = ? AND id = ?"
    );
    pub(super) const PAYMENTS: &str = concat!(
        "SELECT ",
        payment_columns!(),
        " FROM payments WHERE tenant = ? ORDER BY created_at DESC, id LIMIT ?"
    );
    pub(super) const COUNT_PAYMENTS: &str = "SELECT count(*) FROM payments WHERE tenant = ?";
}

impl AppDb for MySqlStore {
    /// By error number: a lost connection or a server shutting down
    /// ([`idemkey_mysql::is_connection_lost`]: 1040, 1053, 1152, 1184, 1927, 4031), 1021
    /// disk full, 1114 table full, 1037, 1038 and 1041 out of memory or resources, 1290,
    /// 1792 and 1836 read-only (`read_only`, a read-only transaction or server).
    fn unavailable(error: &sqlx::Error) -> Option<Unavailable> {
        if idemkey_mysql::is_connection_lost(error) {
            return Some(Unavailable::CONNECTION_LOST);
        }
        let reason = match idemkey_mysql::error_number(error)? {
            1021 => "the database's disk is full",
            1114 => "the database is full",
            1037 | 1038 | 1041 => "the database is out of resources",
            1290 | 1792 | 1836 => "the database is read-only",
            _ => return None,
        };
        Some(Unavailable::answered(reason))
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        // The payments API's first, whose first migration makes the settings' table too; all
        // under one lock.
        Ok(self
            .migrate_with(&[
                &MYSQL_APP_MIGRATIONS,
                &MySqlStore::migrator(),
                &crate::gateway::mysql_settings_migrator(),
            ])
            .await?)
    }

    async fn insert_payment(
        &self,
        conn: &mut MySqlConnection,
        p: &Payment,
    ) -> anyhow::Result<PaymentWrite> {
        // No RETURNING: the payment, then its ledger entry once it is written. A taken
        // reference waits for a transaction that holds it uncommitted, then is 1062.
        match bind_payment(sqlx::query(mysql_sql::INSERT_PAYMENT), p)
            .execute(&mut *conn)
            .await
        {
            Ok(_) => {}
            Err(e)
                if p.reference.is_some()
                    && idemkey_mysql::error_number(&e) == Some(idemkey_mysql::DUPLICATE_KEY) =>
            {
                let payment_id = sqlx::query_scalar(mysql_sql::PAYMENT_BY_REFERENCE)
                    .bind(&p.tenant)
                    .bind(&p.reference)
                    .fetch_one(conn)
                    .await?;
                return Ok(PaymentWrite::ReferenceUsed { payment_id });
            }
            Err(e) => return Err(e.into()),
        }
        sqlx::query(mysql_sql::INSERT_LEDGER_ENTRY)
            .bind(&p.id)
            .bind(&p.tenant)
            .bind(p.amount)
            .bind(&p.currency)
            .bind(&p.created_at)
            .execute(conn)
            .await?;
        Ok(PaymentWrite::Created)
    }

    async fn payment(&self, tenant: &str, id: &str) -> anyhow::Result<Option<Payment>> {
        Ok(sqlx::query_as(mysql_sql::PAYMENT)
            .bind(tenant)
            .bind(id)
            .fetch_optional(self.pool())
            .await?)
    }

    async fn payments(&self, tenant: &str, limit: i64) -> anyhow::Result<(Vec<Payment>, i64)> {
        let data = sqlx::query_as(mysql_sql::PAYMENTS)
            .bind(tenant)
            .bind(limit)
            .fetch_all(self.pool())
            .await?;
        let total = sqlx::query_scalar(mysql_sql::COUNT_PAYMENTS)
            .bind(tenant)
            .fetch_one(self.pool())
            .await?;
        Ok((data, total))
    }
}

/// A connection for the payments API's statements outside a claim's transaction. sqlx
/// sends a statement with parameters as two exchanges (parse, then execute); behind a
/// pooler in transaction mode ([`PgStore::through_pooler`]) only a transaction keeps both
/// on one server connection, so there the statements run in one of their own, not kept
/// prepared. Directly, a pooled connection, its statements kept prepared.
pub(crate) enum PgReader {
    Direct(sqlx::pool::PoolConnection<sqlx::Postgres>),
    Pooled(idemkey_postgres::PgTransaction),
}

impl PgReader {
    pub(crate) async fn new(store: &PgStore) -> anyhow::Result<Self> {
        Ok(if store.through_pooler() {
            Self::Pooled(store.begin().await?)
        } else {
            Self::Direct(store.pool().acquire().await?)
        })
    }

    /// Whether statements on it are kept prepared (directly, not behind the pooler).
    pub(crate) fn persistent(&self) -> bool {
        matches!(self, Self::Direct(_))
    }

    /// Commits the transaction, if there is one (the statements may have written).
    pub(crate) async fn finish(self, store: &PgStore) -> anyhow::Result<()> {
        if let Self::Pooled(tx) = self {
            store.commit(tx).await?;
        }
        Ok(())
    }
}

impl std::ops::Deref for PgReader {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pooled(tx) => tx,
        }
    }
}

impl std::ops::DerefMut for PgReader {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pooled(tx) => tx,
        }
    }
}

/// Binds a payment's columns, in the order of the `payments` table, as parameters 1–9.
fn bind_payment<'q, DB>(
    query: sqlx::query::Query<'q, DB, DB::Arguments>,
    p: &Payment,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: sqlx::Database,
    for<'t> &'t String: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t Option<String>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    query
        .bind(&p.id)
        .bind(&p.tenant)
        .bind(p.amount)
        .bind(&p.currency)
        .bind(&p.customer)
        .bind(&p.description)
        .bind(&p.status)
        .bind(&p.created_at)
        .bind(&p.reference)
}
