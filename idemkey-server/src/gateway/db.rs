//! What the gateway needs of its database: the idempotency store, idemkey's tables and the
//! server's settings (the key secret), and nothing of the payments API's. The operator
//! commands need the same, so they work on any database with idemkey's tables.

use std::future::Future;

use idemkey_core::StoreAdmin;
use idemkey_mysql::MySqlStore;
use idemkey_postgres::PgStore;
use idemkey_sqlite::rusqlite::OptionalExtension;
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use sqlx::migrate::Migrator;

use crate::db::{PgReader, sqlx_store};

/// A store with what `idemkey gateway` and the operator commands use besides it: a health
/// ping, the server's settings (the key secret kept in the database), and the migrations of
/// idemkey's tables and of the settings' table, without the payments API's.
pub trait GatewayDb: StoreAdmin {
    /// Whether the database is embedded in the server (SQLite), where keeping the key secret
    /// in the database is the default for convenience.
    const EMBEDDED: bool;

    /// The tables of idemkey's own migrations that an operator command needs, which are
    /// missing here: none once idemkey's migrations ran (`idemkey migrate`, `serve`,
    /// `gateway`, or an application's own `migrate()` of its store).
    fn missing_tables(&self) -> impl Future<Output = anyhow::Result<Vec<&'static str>>> + Send;

    /// Reads the setting `name`, if it is set; never writes. A database without the settings'
    /// table (one only idemkey's migrations ran on) has none.
    fn setting(&self, name: &str) -> impl Future<Output = anyhow::Result<Option<Vec<u8>>>> + Send;

    /// Reads the setting `name`, first storing `value` if it has none. Every instance on
    /// the database gets the same answer. The settings' table must exist
    /// ([`migrate_gateway`](Self::migrate_gateway)).
    fn setting_or_init(
        &self,
        name: &str,
        value: &[u8],
    ) -> impl Future<Output = anyhow::Result<Vec<u8>>> + Send;

    /// One round trip to the database (`SELECT 1`), for the health check. On PostgreSQL a
    /// pooled connection the server dropped meanwhile is skipped, as `begin` does.
    fn ping(&self) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Runs idemkey's migrations and the settings' (tracked in
    /// `idemkey_server_migrations`); creates none of the payments API's tables.
    fn migrate_gateway(&self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// The tables [`GatewayDb::missing_tables`] looks for: idemkey's own.
const REQUIRED_TABLES: [&str; 3] = ["idemkey_records", "idemkey_audit", "idemkey_outbox"];

/// The settings' table, which `setting` looks for before it reads.
const SETTINGS_TABLE: &str = "server_settings";

/// Where the settings' migrations are tracked, apart from idemkey's and the payments API's.
const SETTINGS_MIGRATIONS_TABLE: &str = "idemkey_server_migrations";

fn sqlite_settings_migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations/settings/sqlite");
    migrator.dangerous_set_table_name(SETTINGS_MIGRATIONS_TABLE);
    migrator
}

fn pg_settings_migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations/settings/postgres");
    migrator.dangerous_set_table_name(SETTINGS_MIGRATIONS_TABLE);
    migrator
}

pub(crate) fn mysql_settings_migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations/settings/mysql");
    migrator.dangerous_set_table_name(SETTINGS_MIGRATIONS_TABLE);
    migrator
}

/// The settings' SQL on SQLite, run through sqlx by [`SqliteStore`] and through rusqlite by
/// [`RusqliteStore`], with the same `?N` parameters.
mod sqlite_sql {
    pub(super) const TABLE_EXISTS: &str =
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1";
    pub(super) const SETTING: &str = "SELECT value FROM server_settings WHERE name = ?1";
    pub(super) const INIT_SETTING: &str =
        "INSERT INTO server_settings (name, value) VALUES (?1, ?2) ON CONFLICT DO NOTHING";
}

impl GatewayDb for SqliteStore {
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
        let table: i64 = sqlx::query_scalar(sqlite_sql::TABLE_EXISTS)
            .bind(SETTINGS_TABLE)
            .fetch_one(self.pool())
            .await?;
        if table == 0 {
            return Ok(None);
        }
        Ok(sqlx::query_scalar(sqlite_sql::SETTING)
            .bind(name)
            .fetch_optional(self.pool())
            .await?)
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

    async fn ping(&self) -> anyhow::Result<()> {
        sqlx::query("SELECT 1").execute(self.pool()).await?;
        Ok(())
    }

    async fn migrate_gateway(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        sqlite_settings_migrator().run(self.pool()).await?;
        Ok(())
    }
}

impl GatewayDb for RusqliteStore {
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
            let table: i64 =
                c.query_row(sqlite_sql::TABLE_EXISTS, [SETTINGS_TABLE], |r| r.get(0))?;
            if table == 0 {
                return Ok(None);
            }
            c.query_row(sqlite_sql::SETTING, [name], |r| r.get(0))
                .optional()
        })?)
    }

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> anyhow::Result<Vec<u8>> {
        Ok(self.with_connection(|c| {
            c.execute(
                sqlite_sql::INIT_SETTING,
                idemkey_sqlite::rusqlite::params![name, value],
            )?;
            c.query_row(sqlite_sql::SETTING, [name], |r| r.get(0))
        })?)
    }

    async fn ping(&self) -> anyhow::Result<()> {
        Ok(self.with_connection(|c| c.query_row("SELECT 1", [], |_| Ok(())))?)
    }

    async fn migrate_gateway(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        // The settings' migrations are sqlx's, as on `SqliteStore`, through a short-lived
        // sqlx connection to the same file.
        let sqlx = sqlx_store(self).await?;
        let migrated = sqlite_settings_migrator().run(sqlx.pool()).await;
        sqlx.pool().close().await;
        Ok(migrated?)
    }
}

impl GatewayDb for PgStore {
    const EMBEDDED: bool = false;

    async fn missing_tables(&self) -> anyhow::Result<Vec<&'static str>> {
        let mut missing = Vec::new();
        let mut conn = PgReader::new(self).await?;
        for table in REQUIRED_TABLES {
            if !pg_table_exists(&mut conn, table).await? {
                missing.push(table);
            }
        }
        conn.finish(self).await?;
        Ok(missing)
    }

    async fn setting(&self, name: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let mut conn = PgReader::new(self).await?;
        let value = if pg_table_exists(&mut conn, SETTINGS_TABLE).await? {
            sqlx::query_scalar("SELECT value FROM server_settings WHERE name = $1")
                .bind(name)
                .persistent(conn.persistent())
                .fetch_optional(&mut *conn)
                .await?
        } else {
            None
        };
        conn.finish(self).await?;
        Ok(value)
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

    async fn ping(&self) -> anyhow::Result<()> {
        // A simple query, one message: `sqlx::query` would prepare it as a named statement
        // kept on the connection, which behind a pooler in transaction mode stays on a
        // server connection that other clients use next.
        ping_pool(self.pool(), idemkey_postgres::is_connection_lost).await
    }

    async fn migrate_gateway(&self) -> anyhow::Result<()> {
        self.migrate().await?;
        self.migrate_with(&pg_settings_migrator()).await?;
        Ok(())
    }
}

/// `SELECT 1` on a pooled connection, as a simple query. Connections are not pinged when
/// handed out: after a restart the idle ones are dead, and each failed try (`lost` says so)
/// closes one, so it is tried again, bounded by the pool size plus a new one.
async fn ping_pool<DB>(pool: &sqlx::Pool<DB>, lost: fn(&sqlx::Error) -> bool) -> anyhow::Result<()>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let attempts = pool.options().get_max_connections() + 1;
    let mut attempt = 1;
    loop {
        match sqlx::raw_sql("SELECT 1").execute(pool).await {
            Ok(_) => return Ok(()),
            Err(e) if attempt < attempts && lost(&e) => attempt += 1,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Whether `table` exists (in the connection's search path).
async fn pg_table_exists(conn: &mut PgReader, table: &str) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .persistent(conn.persistent())
        .fetch_one(&mut **conn)
        .await?)
}

/// The settings' SQL on MySQL and MariaDB.
mod mysql_sql {
    /// Whether a table of this name is in the connection's database.
    pub(super) const TABLE_EXISTS: &str = "SELECT count(*) FROM information_schema.tables
         WHERE table_schema = DATABASE() AND table_name = ?";
    pub(super) const SETTING: &str = "SELECT value FROM server_settings WHERE name = ?";
    /// Stores the value unless the name has one: a no-op update on a taken name (`INSERT
    /// IGNORE` would also turn every other error into a warning).
    pub(super) const INIT_SETTING: &str = "INSERT INTO server_settings (name, value)
         VALUES (?, ?) ON DUPLICATE KEY UPDATE name = name";
}

impl GatewayDb for MySqlStore {
    const EMBEDDED: bool = false;

    async fn missing_tables(&self) -> anyhow::Result<Vec<&'static str>> {
        let mut missing = Vec::new();
        for table in REQUIRED_TABLES {
            if !mysql_table_exists(self, table).await? {
                missing.push(table);
            }
        }
        Ok(missing)
    }

    async fn setting(&self, name: &str) -> anyhow::Result<Option<Vec<u8>>> {
        if !mysql_table_exists(self, SETTINGS_TABLE).await? {
            return Ok(None);
        }
        Ok(sqlx::query_scalar(mysql_sql::SETTING)
            .bind(name)
            .fetch_optional(self.pool())
            .await?)
    }

    async fn setting_or_init(&self, name: &str, value: &[u8]) -> anyhow::Result<Vec<u8>> {
        // Each statement on its own (autocommit): the read sees the row another instance
        // committed first.
        sqlx::query(mysql_sql::INIT_SETTING)
            .bind(name)
            .bind(value)
            .execute(self.pool())
            .await?;
        Ok(sqlx::query_scalar(mysql_sql::SETTING)
            .bind(name)
            .fetch_one(self.pool())
            .await?)
    }

    async fn ping(&self) -> anyhow::Result<()> {
        ping_pool(self.pool(), idemkey_mysql::is_connection_lost).await
    }

    async fn migrate_gateway(&self) -> anyhow::Result<()> {
        Ok(self
            .migrate_with(&[&MySqlStore::migrator(), &mysql_settings_migrator()])
            .await?)
    }
}

/// Whether `table` is in the database the store's connections use.
async fn mysql_table_exists(store: &MySqlStore, table: &str) -> anyhow::Result<bool> {
    let found: i64 = sqlx::query_scalar(mysql_sql::TABLE_EXISTS)
        .bind(table)
        .fetch_one(store.pool())
        .await?;
    Ok(found > 0)
}
