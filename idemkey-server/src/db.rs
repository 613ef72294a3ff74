//! The payments API's own SQL, per backend. The idempotency records are the store's; these
//! are the effects the layer protects.

use std::future::Future;
use std::path::Path;

use idemkey_core::outbox::OutboxStore;
use idemkey_core::{Store, StoreAdmin};
use idemkey_postgres::PgStore;
use idemkey_sqlite::rusqlite::{self, OptionalExtension};
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use serde::Serialize;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;

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

/// A store that also holds the payments tables.
pub trait AppDb: StoreAdmin + OutboxStore {
    /// Whether the database is embedded in the server (SQLite), where keeping the key secret
    /// in the database is the default for convenience.
    const EMBEDDED: bool;

    /// The tables a database needs before an operator command may use it (idemkey's and
    /// the payments API's), which are missing here: none once `idemkey migrate` (or `serve`)
    /// ran.
    fn missing_tables(&self) -> impl Future<Output = anyhow::Result<Vec<&'static str>>> + Send;

    /// Reads the setting `name`, if it is set; never writes.
    fn setting(&self, name: &str) -> impl Future<Output = anyhow::Result<Option<Vec<u8>>>> + Send;

    /// One round trip to the database (`SELECT 1`), for the health check. On PostgreSQL a
    /// pooled connection the server dropped meanwhile is skipped, as `begin` does.
    fn ping(&self) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Runs idemkey's migrations and the payments API's.
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

    /// Reads the setting `name`, first storing `value` if it has none. Every instance on
    /// the database gets the same answer.
    fn setting_or_init(
        &self,
        name: &str,
        value: &[u8],
    ) -> impl Future<Output = anyhow::Result<Vec<u8>>> + Send;
}

/// The tables [`AppDb::missing_tables`] looks for.
const REQUIRED_TABLES: [&str; 4] = [
    "idemkey_records",
    "idemkey_audit",
    "idemkey_outbox",
    "server_settings",
];

static SQLITE_APP_MIGRATIONS: Migrator = sqlx::migrate!("./migrations/sqlite");
static PG_APP_MIGRATIONS: Migrator = sqlx::migrate!("./migrations/postgres");

/// The payments API's SQL on SQLite, run through sqlx by [`SqliteStore`] and through
/// rusqlite by [`RusqliteStore`], with the same `?N` parameters.
mod sqlite_sql {
    pub(super) const TABLE_EXISTS: &str =
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1";
    pub(super) const SETTING: &str = "SELECT value FROM server_settings WHERE name = ?1";
    pub(super) const INIT_SETTING: &str =
        "INSERT INTO server_settings (name, value) VALUES (?1, ?2) ON CONFLICT DO NOTHING";
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
    const EMBEDDED: bool = true;

    async fn missing_tables(&self) -> anyhow::Result<Vec<&'static str>> {
        let mut missing = Vec::new();
        for table in REQUIRED_TABLES {
            let found: i64 = sqlx::query_scalar(sqlite_sql::TABLE_EXISTS)
                .bind(table)
                .fetch_one(self.pool())
                .await?;
            if found == 0 {
                missing.push(table);
            }
        }
        Ok(missing)
    }

    async fn setting(&self, name: &str) -> anyhow::Result<Option<Vec<u8>>> {
        Ok(sqlx::query_scalar(sqlite_sql::SETTING)
            .bind(name)
            .fetch_optional(self.pool())
            .await?)
    }

    async fn ping(&self) -> anyhow::Result<()> {
        sqlx::query("SELECT 1").execute(self.pool()).await?;
        Ok(())
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        SQLITE_APP_MIGRATIONS.run(self.pool()).await?;
        Ok(())
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

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> anyhow::Result<Vec<u8>> {
        sqlx::query(sqlite_sql::INIT_SETTING)
            .bind(name)
            .bind(value)
            .execute(self.pool())
            .await?;
        Ok(sqlx::query_scalar(sqlite_sql::SETTING)
            .bind(name)
            .fetch_one(self.pool())
            .await?)
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

impl AppDb for RusqliteStore {
    const EMBEDDED: bool = true;

    async fn missing_tables(&self) -> anyhow::Result<Vec<&'static str>> {
        Ok(self.with_connection(|c| {
            let mut exists = c.prepare_cached(sqlite_sql::TABLE_EXISTS)?;
            let mut missing = Vec::new();
            for table in REQUIRED_TABLES {
                if exists.query_row([table], |r| r.get::<_, i64>(0))? == 0 {
                    missing.push(table);
                }
            }
            Ok(missing)
        })?)
    }

    async fn setting(&self, name: &str) -> anyhow::Result<Option<Vec<u8>>> {
        Ok(self.with_connection(|c| {
            c.query_row(sqlite_sql::SETTING, [name], |r| r.get(0))
                .optional()
        })?)
    }

    async fn ping(&self) -> anyhow::Result<()> {
        Ok(self.with_connection(|c| c.query_row("SELECT 1", [], |_| Ok(())))?)
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        // The payments API's migrations are sqlx's, as on `SqliteStore`, through a
        // short-lived sqlx connection to the same file.
        let url = format!("sqlite:{}", self.path().display());
        let sqlx = SqliteStore::connect(&url).await?;
        let migrated = SQLITE_APP_MIGRATIONS.run(sqlx.pool()).await;
        sqlx.pool().close().await;
        Ok(migrated?)
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

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> anyhow::Result<Vec<u8>> {
        Ok(self.with_connection(|c| {
            c.execute(sqlite_sql::INIT_SETTING, rusqlite::params![name, value])?;
            c.query_row(sqlite_sql::SETTING, [name], |r| r.get(0))
        })?)
    }
}

impl AppDb for PgStore {
    const EMBEDDED: bool = false;

    async fn missing_tables(&self) -> anyhow::Result<Vec<&'static str>> {
        let mut missing = Vec::new();
        let mut conn = PgReader::new(self).await?;
        for table in REQUIRED_TABLES {
            let found: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(table)
                .persistent(conn.persistent())
                .fetch_one(&mut *conn)
                .await?;
            if !found {
                missing.push(table);
            }
        }
        conn.finish(self).await?;
        Ok(missing)
    }

    async fn setting(&self, name: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let mut conn = PgReader::new(self).await?;
        let value = sqlx::query_scalar("SELECT value FROM server_settings WHERE name = $1")
            .bind(name)
            .persistent(conn.persistent())
            .fetch_optional(&mut *conn)
            .await?;
        conn.finish(self).await?;
        Ok(value)
    }

    async fn ping(&self) -> anyhow::Result<()> {
        // Connections are not pinged when handed out: after a restart the idle ones are
        // dead, and each failed try closes one (bounded by the pool size, plus a new one).
        // Without parameters, sqlx sends it as a simple query: one message, safe behind a
        // pooler too.
        let attempts = self.pool().options().get_max_connections() + 1;
        let mut attempt = 1;
        loop {
            match sqlx::query("SELECT 1").execute(self.pool()).await {
                Ok(_) => return Ok(()),
                Err(e) if attempt < attempts && idemkey_postgres::is_connection_lost(&e) => {
                    attempt += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        self.migrate_with(&PG_APP_MIGRATIONS).await?;
        Ok(())
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

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> anyhow::Result<Vec<u8>> {
        let mut conn = PgReader::new(self).await?;
        sqlx::query(
            "INSERT INTO server_settings (name, value) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(name)
        .bind(value)
        .persistent(conn.persistent())
        .execute(&mut *conn)
        .await?;
        let value = sqlx::query_scalar("SELECT value FROM server_settings WHERE name = $1")
            .bind(name)
            .persistent(conn.persistent())
            .fetch_one(&mut *conn)
            .await?;
        conn.finish(self).await?;
        Ok(value)
    }
}

/// A connection for the payments API's statements outside a claim's transaction. sqlx
/// sends a statement with parameters as two exchanges (parse, then execute); behind a
/// pooler in transaction mode ([`PgStore::through_pooler`]) only a transaction keeps both
/// on one server connection, so there the statements run in one of their own, not kept
/// prepared. Directly, a pooled connection, its statements kept prepared.
enum PgReader {
    Direct(sqlx::pool::PoolConnection<sqlx::Postgres>),
    Pooled(idemkey_postgres::PgTransaction),
}

impl PgReader {
    async fn new(store: &PgStore) -> anyhow::Result<Self> {
        Ok(if store.through_pooler() {
            Self::Pooled(store.begin().await?)
        } else {
            Self::Direct(store.pool().acquire().await?)
        })
    }

    /// Whether statements on it are kept prepared (directly, not behind the pooler).
    fn persistent(&self) -> bool {
        matches!(self, Self::Direct(_))
    }

    /// Commits the transaction, if there is one (the statements may have written).
    async fn finish(self, store: &PgStore) -> anyhow::Result<()> {
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
