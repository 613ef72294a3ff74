//! What runs the migrations of [`PgStore::migrate_with`](crate::PgStore::migrate_with):
//! sqlx's [`Migrator`](sqlx::migrate::Migrator) decides (which migrations are applied,
//! their checksums, a database left dirty), and [`Unprepared`] sends what it decides, each
//! statement one simple-query message with its values written in (`crate::literal`).
//!
//! sqlx's own runner on a `PgConnection` keeps its statements prepared, named `sqlx_s_1`,
//! `sqlx_s_2`, … in the order a connection prepares them. Behind a pooler in transaction
//! mode the server connection a migration lands on may hold another client's statement of
//! the same name (`prepared statement "sqlx_s_1" already exists`), and a name prepared
//! there stays for the next client. A simple query prepares nothing: nothing meets, nothing
//! stays. The tracking table is sqlx's, written as sqlx writes it, so a database migrated
//! by either runner is migrated for the other, and `sqlx migrate info` reads it.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sqlx::migrate::{AppliedMigration, Migrate, MigrateError, Migration};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{AssertSqlSafe, Row};

use crate::literal::{Args, Bind, Sql};

/// A connection inside the transaction that runs the migrations, with sqlx's [`Migrate`]
/// spoken in simple queries only.
///
/// Its lock is a transaction's advisory lock, held until the `COMMIT`: a run that waited
/// for it sees all that the run before it created. Its key is the one sqlx's runner takes
/// as a session's lock ([`lock_id`]), so this runner and sqlx's wait for each other too.
pub(crate) struct Unprepared<'c>(pub(crate) &'c mut PgConnection);

impl Unprepared<'_> {
    async fn execute(&mut self, sql: String) -> Result<(), MigrateError> {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    /// Runs a migration's (or its reversal's) SQL, its failure named by its version.
    async fn run(&mut self, migration: &Migration) -> Result<(), MigrateError> {
        sqlx::raw_sql(migration.sql.clone())
            .execute(&mut *self.0)
            .await
            .map_err(|e| MigrateError::ExecuteMigration(e, migration.version))?;
        Ok(())
    }

    async fn fetch_all(&mut self, sql: String) -> Result<Vec<PgRow>, MigrateError> {
        Ok(sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut *self.0)
            .await?)
    }
}

impl Migrate for Unprepared<'_> {
    fn create_schema_if_not_exists<'e>(
        &'e mut self,
        schema_name: &'e str,
    ) -> BoxFuture<'e, Result<(), MigrateError>> {
        Box::pin(self.execute(format!("CREATE SCHEMA IF NOT EXISTS {schema_name}")))
    }

    fn ensure_migrations_table<'e>(
        &'e mut self,
        table_name: &'e str,
    ) -> BoxFuture<'e, Result<(), MigrateError>> {
        // sqlx's table, column for column.
        Box::pin(self.execute(format!(
            "CREATE TABLE IF NOT EXISTS {table_name} (
                 version BIGINT PRIMARY KEY,
                 description TEXT NOT NULL,
                 installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
                 success BOOLEAN NOT NULL,
                 checksum BYTEA NOT NULL,
                 execution_time BIGINT NOT NULL
             )"
        )))
    }

    fn dirty_version<'e>(
        &'e mut self,
        table_name: &'e str,
    ) -> BoxFuture<'e, Result<Option<i64>, MigrateError>> {
        Box::pin(async move {
            let rows = self
                .fetch_all(format!(
                    "SELECT version FROM {table_name} WHERE success = false ORDER BY version \
                     LIMIT 1"
                ))
                .await?;
            Ok(rows.first().map(|row| row.try_get(0)).transpose()?)
        })
    }

    fn list_applied_migrations<'e>(
        &'e mut self,
        table_name: &'e str,
    ) -> BoxFuture<'e, Result<Vec<AppliedMigration>, MigrateError>> {
        Box::pin(async move {
            let rows = self
                .fetch_all(format!(
                    "SELECT version, checksum FROM {table_name} ORDER BY version"
                ))
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(AppliedMigration {
                        version: row.try_get(0)?,
                        checksum: row.try_get::<Vec<u8>, _>(1)?.into(),
                    })
                })
                .collect()
        })
    }

    fn lock(&mut self) -> BoxFuture<'_, Result<(), MigrateError>> {
        Box::pin(async move {
            let rows = self.fetch_all("SELECT current_database()".into()).await?;
            let database: String = match rows.first() {
                Some(row) => row.try_get(0)?,
                None => return Err(sqlx::Error::RowNotFound.into()),
            };
            self.execute(format!(
                "SELECT pg_advisory_xact_lock({})",
                lock_id(&database)
            ))
            .await
        })
    }

    /// Nothing: the `COMMIT` releases the transaction's lock, once what the run created is
    /// there for the next.
    fn unlock(&mut self) -> BoxFuture<'_, Result<(), MigrateError>> {
        Box::pin(async { Ok(()) })
    }

    /// Runs the migration and records it, in the transaction of the whole run (so a
    /// migration marked `-- no-transaction` runs in it too): one that fails leaves nothing,
    /// neither its effects nor its row.
    fn apply<'e>(
        &'e mut self,
        table_name: &'e str,
        migration: &'e Migration,
    ) -> BoxFuture<'e, Result<Duration, MigrateError>> {
        Box::pin(async move {
            let start = Instant::now();
            self.run(migration).await?;
            let elapsed = start.elapsed();
            // The row sqlx writes, with the time taken at once (sqlx writes -1 first, then
            // the time in a statement of its own).
            let row = Sql::new(&format!(
                "INSERT INTO {table_name} (version, description, checksum, execution_time, \
                 success) VALUES ("
            ));
            let mut row = Args::after(row)
                .bind(migration.version)
                .bind(&*migration.description)
                .bind(&*migration.checksum)
                .bind(i64::try_from(elapsed.as_nanos()).unwrap_or(i64::MAX))
                .finish()
                .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
            row.push(", TRUE)");
            self.execute(row.finish()).await?;
            Ok(elapsed)
        })
    }

    fn revert<'e>(
        &'e mut self,
        table_name: &'e str,
        migration: &'e Migration,
    ) -> BoxFuture<'e, Result<Duration, MigrateError>> {
        Box::pin(async move {
            let start = Instant::now();
            self.run(migration).await?;
            let mut delete = Sql::new(&format!("DELETE FROM {table_name} WHERE version = "));
            delete.int(migration.version);
            self.execute(delete.finish()).await?;
            Ok(start.elapsed())
        })
    }
}

/// The key of the advisory lock sqlx's runner takes on the database named `database`: the
/// name's CRC-32 (IEEE) times `0x3d32ad9e`, as sqlx-postgres's `generate_lock_id` makes it.
pub(crate) fn lock_id(database: &str) -> i64 {
    0x3d32_ad9e * i64::from(crc32(database.as_bytes()))
}

/// CRC-32 (IEEE 802.3, the one of zlib and PNG), bit by bit: it reads a database's name once
/// per run.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

#[cfg(test)]
mod tests;
