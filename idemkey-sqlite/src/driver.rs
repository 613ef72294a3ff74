//! What the SQLite stores' statements need of a driver, and its two adapters: sqlx's
//! [`SqliteConnection`] (for [`SqliteStore`](crate::SqliteStore)) and rusqlite's
//! [`Connection`] (for [`RusqliteStore`](crate::RusqliteStore)). The statements' logic is
//! written once over it (`statements.rs`, `outbox.rs`); an adapter only runs a statement
//! with its values and reads its rows, and maps its driver's errors.

use std::future::Future;

use idemkey_core::StoreError;
use idemkey_sqlx::{AuditRow, MessageRow, OutboxAuditRow, RecordRow};
use rusqlite::{Connection, OptionalExtension, ToSql};
use sqlx::Arguments;
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqliteRow};

use crate::params::Value;

/// A connection the statements run on.
pub(crate) trait Driver: Send {
    /// Runs `sql` with `params`: how many rows it changed.
    fn execute<const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Runs `sql` with `params`: its first row, if any.
    fn fetch_optional<R: Row, const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> impl Future<Output = Result<Option<R>, StoreError>> + Send;

    /// Runs `sql` with `params`: all its rows.
    fn fetch_all<R: Row, const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> impl Future<Output = Result<Vec<R>, StoreError>> + Send;
}

/// A row as both drivers read it: sqlx through `FromRow`, rusqlite through [`Row::read`].
pub(crate) trait Row: for<'r> sqlx::FromRow<'r, SqliteRow> + Send + Unpin {
    /// The row rusqlite read.
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self>;
}

/// sqlx's arguments for `params`, in order, what was made for the statement moved in.
pub(crate) fn arguments<'q>(
    params: impl IntoIterator<Item = Value<'q>>,
    args: &mut SqliteArguments,
) -> Result<(), sqlx::Error> {
    for value in params {
        match value {
            Value::Null => args.add(None::<i64>),
            Value::Int(n) => args.add(n),
            Value::Text(text) => args.add(text),
            Value::Bytes(bytes) => args.add(bytes),
            Value::Owned(bytes) => args.add(bytes),
            Value::Parts(parts) => args.add(parts.to_vec()),
        }
        .map_err(sqlx::Error::Encode)?;
    }
    Ok(())
}

/// [`arguments`] for one statement's `params`.
fn args<const N: usize>(params: [Value<'_>; N]) -> Result<SqliteArguments, StoreError> {
    let mut args = SqliteArguments::default();
    args.reserve(N, 0);
    arguments(params, &mut args).map_err(crate::store::error)?;
    Ok(args)
}

impl Driver for SqliteConnection {
    async fn execute<const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> Result<u64, StoreError> {
        let done = sqlx::query_with(sql, args(params)?)
            .execute(self)
            .await
            .map_err(crate::store::error)?;
        Ok(done.rows_affected())
    }

    async fn fetch_optional<R: Row, const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> Result<Option<R>, StoreError> {
        sqlx::query_as_with(sql, args(params)?)
            .fetch_optional(self)
            .await
            .map_err(crate::store::error)
    }

    async fn fetch_all<R: Row, const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> Result<Vec<R>, StoreError> {
        sqlx::query_as_with(sql, args(params)?)
            .fetch_all(self)
            .await
            .map_err(crate::store::error)
    }
}

impl ToSql for Value<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Null => ValueRef::Null,
            Value::Int(n) => ValueRef::Integer(*n),
            Value::Text(text) => ValueRef::Text(text.as_bytes()),
            Value::Bytes(bytes) => ValueRef::Blob(bytes),
            Value::Owned(bytes) => ValueRef::Blob(bytes),
            Value::Parts(parts) => ValueRef::Blob(parts),
        }))
    }
}

impl Driver for Connection {
    async fn execute<const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> Result<u64, StoreError> {
        let changed = self
            .prepare_cached(sql)
            .and_then(|mut s| s.execute(rusqlite::params_from_iter(params)))
            .map_err(crate::rusqlite_store::error)?;
        Ok(changed as u64)
    }

    async fn fetch_optional<R: Row, const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> Result<Option<R>, StoreError> {
        self.prepare_cached(sql)
            .and_then(|mut s| {
                s.query_row(rusqlite::params_from_iter(params), R::read)
                    .optional()
            })
            .map_err(crate::rusqlite_store::error)
    }

    async fn fetch_all<R: Row, const N: usize>(
        &mut self,
        sql: &'static str,
        params: [Value<'_>; N],
    ) -> Result<Vec<R>, StoreError> {
        self.prepare_cached(sql)
            .and_then(|mut s| {
                s.query_map(rusqlite::params_from_iter(params), R::read)?
                    .collect()
            })
            .map_err(crate::rusqlite_store::error)
    }
}

impl Row for (i64,) {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((row.get(0)?,))
    }
}

impl Row for (i64, Vec<u8>) {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((row.get(0)?, row.get(1)?))
    }
}

impl Row for (i64, i64, Option<i64>) {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((row.get(0)?, row.get(1)?, row.get(2)?))
    }
}

impl Row for RecordRow {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(RecordRow {
            tenant: row.get("tenant")?,
            key_hash: row.get("key_hash")?,
            route: row.get("route")?,
            fingerprint: row.get("fingerprint")?,
            fingerprint_parts: row.get("fingerprint_parts")?,
            state: row.get("state")?,
            token: row.get("token")?,
            lease_expires_at: row.get("lease_expires_at")?,
            response_status: row.get("response_status")?,
            response_headers: row.get("response_headers")?,
            response_body: row.get("response_body")?,
            created_at: row.get("created_at")?,
            updated_at: row.get("updated_at")?,
            expires_at: row.get("expires_at")?,
            sealed_key: row.get("sealed_key")?,
            fingerprint_members: row.get("fingerprint_members")?,
            first_sent: row.get("first_sent")?,
        })
    }
}

impl Row for AuditRow {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(AuditRow {
            tenant: row.get(0)?,
            key_hash: row.get(1)?,
            route: row.get(2)?,
            at: row.get(3)?,
            actor: row.get(4)?,
            action: row.get(5)?,
            detail: row.get(6)?,
        })
    }
}

impl Row for MessageRow {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(MessageRow {
            seq: row.get("seq")?,
            id: row.get("id")?,
            grp: row.get("grp")?,
            kind: row.get("kind")?,
            data: row.get("data")?,
            created_at: row.get("created_at")?,
            state: row.get("state")?,
            attempts: row.get("attempts")?,
            next_attempt_at: row.get("next_attempt_at")?,
            claimed_by: row.get("claimed_by")?,
            claimed_until: row.get("claimed_until")?,
            last_error: row.get("last_error")?,
            sent_at: row.get("sent_at")?,
        })
    }
}

impl Row for OutboxAuditRow {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(OutboxAuditRow {
            message_id: row.get(0)?,
            at: row.get(1)?,
            actor: row.get(2)?,
            action: row.get(3)?,
            detail: row.get(4)?,
        })
    }
}
