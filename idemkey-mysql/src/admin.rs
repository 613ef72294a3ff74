//! The [`StoreAdmin`] impl of [`MySqlStore`]: the operator's statements.

use idemkey_core::{
    AuditEntry, ListFilter, Purged, Record, RecordId, StoreAdmin, StoreError, Timestamp,
};
use idemkey_sqlx::AuditRow;
use sqlx::mysql::MySqlConnection;
use sqlx::{Connection, FromRow, QueryBuilder};

use crate::MySqlStore;
use crate::codes::error;
use crate::sql;
use crate::store::{Statement, record, with_id};

/// A row a purge batch deletes: its identity as stored (bytes), and its expiry.
type Expired = (Vec<u8>, Vec<u8>, Vec<u8>, i64);

/// The rows of a purge batch deleted per `DELETE`: three parameters each, well inside
/// MySQL's 65,535 per statement.
const DELETE_CHUNK: usize = 1000;

async fn records(conn: &mut MySqlConnection, q: Statement) -> Result<Vec<Record>, StoreError> {
    let rows = q.fetch_all(conn).await.map_err(error)?;
    rows.iter().map(record).collect()
}

impl StoreAdmin for MySqlStore {
    async fn list(
        &self,
        conn: &mut MySqlConnection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let (tenant, state) = (filter.tenant.as_deref(), filter.state.map(|s| s.as_str()));
        let before = filter.created_before.map(Timestamp::as_millis);
        let list = sqlx::query(sql::LIST)
            .bind(tenant)
            .bind(tenant)
            .bind(state)
            .bind(state)
            .bind(before)
            .bind(before)
            .bind(filter.effective_limit());
        records(conn, list).await
    }

    async fn find_by_key(
        &self,
        conn: &mut MySqlConnection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let find = sqlx::query(sql::FIND_BY_KEY)
            .bind(tenant)
            .bind(&key_hash[..]);
        records(conn, find).await
    }

    async fn evict(&self, conn: &mut MySqlConnection, id: &RecordId) -> Result<bool, StoreError> {
        let done = with_id(sqlx::query(sql::EVICT), id)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    /// One transaction: the batch's rows, locked and skipping those already locked
    /// (`sql::PURGE_SELECT`), then deleted by primary key. MySQL's `DELETE` has no
    /// `RETURNING` to tell the latest expiry it deleted; the locking read does.
    async fn purge_batch(
        &self,
        conn: &mut MySqlConnection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        let mut tx = conn.begin().await.map_err(error)?;
        let rows: Vec<Expired> = sqlx::query_as(sql::PURGE_SELECT)
            .bind(now.as_millis())
            .bind(from.map_or(i64::MIN, Timestamp::as_millis))
            .bind(i64::from(batch))
            .fetch_all(&mut *tx)
            .await
            .map_err(error)?;
        let mut deleted = 0;
        for chunk in rows.chunks(DELETE_CHUNK) {
            let mut delete = QueryBuilder::new(sql::PURGE_DELETE);
            delete.push_tuples(chunk, |mut row, (tenant, key_hash, route, _)| {
                row.push_bind(tenant).push_bind(key_hash).push_bind(route);
            });
            let done = delete.build().execute(&mut *tx).await.map_err(error)?;
            deleted += done.rows_affected();
        }
        tx.commit().await.map_err(error)?;
        Ok(Purged {
            deleted,
            through: rows.iter().map(|row| row.3).max().map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut MySqlConnection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        with_id(sqlx::query(sql::APPEND_AUDIT), &entry.id)
            .bind(entry.at.as_millis())
            .bind(&entry.actor)
            .bind(&entry.action)
            .bind(&entry.detail)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(())
    }

    async fn audit(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = with_id(sqlx::query(sql::AUDIT), id)
            .fetch_all(conn)
            .await
            .map_err(error)?;
        rows.iter()
            .map(|row| AuditEntry::try_from(AuditRow::from_row(row).map_err(error)?))
            .collect()
    }
}
