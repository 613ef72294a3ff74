//! The payments API's own SQL, per backend. The idempotency records are the store's; these
//! are the effects the layer protects.

use std::future::Future;

use idemkey_core::Store;
use idemkey_core::outbox::OutboxStore;
use idemkey_postgres::PgStore;
use idemkey_sqlite::SqliteStore;
use serde::Serialize;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;

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
}

/// A store that also holds the payments tables.
pub trait AppDb: Store + OutboxStore {
    /// Whether the database is embedded in the server (SQLite), where keeping the key secret
    /// in the database is the default for convenience.
    const EMBEDDED: bool;

    /// The tables a database needs before an operator command may use it (idemkey's and
    /// the payments API's), which are missing here: none once `idemkey migrate` (or `serve`)
    /// ran.
    fn missing_tables(&self)
    -> impl Future<Output = Result<Vec<&'static str>, sqlx::Error>> + Send;

    /// Reads the setting `name`, if it is set; never writes.
    fn setting(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, sqlx::Error>> + Send;

    /// One round trip to the database (`SELECT 1`), for the health check. On PostgreSQL a
    /// pooled connection the server dropped meanwhile is skipped, as `begin` does.
    fn ping(&self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Runs idemkey's migrations and the payments API's.
    fn migrate_all(&self) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Writes a payment and its ledger entry on `conn` (the claim's transaction).
    fn insert_payment<'a>(
        conn: &'a mut Self::Connection,
        payment: &'a Payment,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// One of a tenant's payments.
    fn payment(
        &self,
        tenant: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<Payment>, sqlx::Error>> + Send;

    /// A tenant's newest payments, and how many it has in all.
    fn payments(
        &self,
        tenant: &str,
        limit: i64,
    ) -> impl Future<Output = Result<(Vec<Payment>, i64), sqlx::Error>> + Send;

    /// Reads the setting `name`, first storing `value` if it has none. Every instance on
    /// the database gets the same answer.
    fn setting_or_init(
        &self,
        name: &str,
        value: &[u8],
    ) -> impl Future<Output = Result<Vec<u8>, sqlx::Error>> + Send;
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

impl AppDb for SqliteStore {
    const EMBEDDED: bool = true;

    async fn missing_tables(&self) -> Result<Vec<&'static str>, sqlx::Error> {
        let mut missing = Vec::new();
        for table in REQUIRED_TABLES {
            let found: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            )
            .bind(table)
            .fetch_one(self.pool())
            .await?;
            if found == 0 {
                missing.push(table);
            }
        }
        Ok(missing)
    }

    async fn setting(&self, name: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar("SELECT value FROM server_settings WHERE name = ?1")
            .bind(name)
            .fetch_optional(self.pool())
            .await
    }

    async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT 1").execute(self.pool()).await?;
        Ok(())
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        SQLITE_APP_MIGRATIONS.run(self.pool()).await?;
        Ok(())
    }

    async fn insert_payment(conn: &mut SqliteConnection, p: &Payment) -> Result<(), sqlx::Error> {
        // Both rows in one call to SQLite (one hand-off to the connection's worker thread);
        // the statements share the numbered parameters.
        bind_payment(
            sqlx::query(
                "INSERT INTO payments
                 (id, tenant, amount, currency, customer, description, status, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8);
             INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
             VALUES (?1, ?2, ?3, ?4, ?8)",
            ),
            p,
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn payment(&self, tenant: &str, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        sqlx::query_as("SELECT * FROM payments WHERE tenant = ?1 AND id = ?2")
            .bind(tenant)
            .bind(id)
            .fetch_optional(self.pool())
            .await
    }

    async fn payments(&self, tenant: &str, limit: i64) -> Result<(Vec<Payment>, i64), sqlx::Error> {
        let data = sqlx::query_as(
            "SELECT * FROM payments WHERE tenant = ?1 ORDER BY created_at DESC, id LIMIT ?2",
        )
        .bind(tenant)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        let total = sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant = ?1")
            .bind(tenant)
            .fetch_one(self.pool())
            .await?;
        Ok((data, total))
    }

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> Result<Vec<u8>, sqlx::Error> {
        sqlx::query(
            "INSERT INTO server_settings (name, value) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )
        .bind(name)
        .bind(value)
        .execute(self.pool())
        .await?;
        sqlx::query_scalar("SELECT value FROM server_settings WHERE name = ?1")
            .bind(name)
            .fetch_one(self.pool())
            .await
    }
}

impl AppDb for PgStore {
    const EMBEDDED: bool = false;

    async fn missing_tables(&self) -> Result<Vec<&'static str>, sqlx::Error> {
        let mut missing = Vec::new();
        for table in REQUIRED_TABLES {
            let found: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(table)
                .fetch_one(self.pool())
                .await?;
            if !found {
                missing.push(table);
            }
        }
        Ok(missing)
    }

    async fn setting(&self, name: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar("SELECT value FROM server_settings WHERE name = $1")
            .bind(name)
            .fetch_optional(self.pool())
            .await
    }

    async fn ping(&self) -> Result<(), sqlx::Error> {
        // Connections are not pinged when handed out: after a restart the idle ones are
        // dead, and each failed try closes one (bounded by the pool size, plus a new one).
        let attempts = self.pool().options().get_max_connections() + 1;
        let mut attempt = 1;
        loop {
            match sqlx::query("SELECT 1").execute(self.pool()).await {
                Ok(_) => return Ok(()),
                Err(e) if attempt < attempts && idemkey_core::is_connection_lost(&e) => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn migrate_all(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        PG_APP_MIGRATIONS.run(self.pool()).await?;
        Ok(())
    }

    async fn insert_payment(conn: &mut PgConnection, p: &Payment) -> Result<(), sqlx::Error> {
        // Both rows in one statement (one round trip): the ledger entry is made from the
        // payment row the first insert returns.
        bind_payment(
            sqlx::query(
                "WITH payment AS (
                 INSERT INTO payments
                     (id, tenant, amount, currency, customer, description, status, created_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                 RETURNING id, tenant, amount, currency, created_at
             )
             INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
             SELECT id, tenant, amount, currency, created_at FROM payment",
            ),
            p,
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn payment(&self, tenant: &str, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        sqlx::query_as("SELECT * FROM payments WHERE tenant = $1 AND id = $2")
            .bind(tenant)
            .bind(id)
            .fetch_optional(self.pool())
            .await
    }

    async fn payments(&self, tenant: &str, limit: i64) -> Result<(Vec<Payment>, i64), sqlx::Error> {
        let data = sqlx::query_as(
            "SELECT * FROM payments WHERE tenant = $1 ORDER BY created_at DESC, id LIMIT $2",
        )
        .bind(tenant)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        let total = sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant = $1")
            .bind(tenant)
            .fetch_one(self.pool())
            .await?;
        Ok((data, total))
    }

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> Result<Vec<u8>, sqlx::Error> {
        sqlx::query(
            "INSERT INTO server_settings (name, value) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(name)
        .bind(value)
        .execute(self.pool())
        .await?;
        sqlx::query_scalar("SELECT value FROM server_settings WHERE name = $1")
            .bind(name)
            .fetch_one(self.pool())
            .await
    }
}

/// Binds a payment's columns, in the order of the `payments` table, as parameters 1–8.
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
}
