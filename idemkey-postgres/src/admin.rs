//! The [`StoreAdmin`] impl of [`PgStore`]: the operator's statements.

use idemkey_core::{
    AuditEntry, ListFilter, Purged, Record, RecordId, StoreAdmin, StoreError, Timestamp,
};
use idemkey_sqlx::{AuditRow, RecordRow};
use sqlx::postgres::PgConnection;

use crate::PgStore;
use crate::listen::EVICTION_CHANNEL;
use crate::literal::{self, Bind};
use crate::sqlstate::error;

impl StoreAdmin for PgStore {
    async fn list(
        &self,
        conn: &mut PgConnection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = literal::query_as::<RecordRow>(
            "SELECT * FROM idemkey_records
              WHERE ($1::TEXT IS NULL OR tenant = $1)
                AND ($2::TEXT IS NULL OR state = $2)
                AND ($3::BIGINT IS NULL OR created_at < $3)
              ORDER BY created_at DESC
              LIMIT $4",
        )
        .bind(filter.tenant.as_deref())
        .bind(filter.state.map(|s| s.as_str()))
        .bind(filter.created_before.map(Timestamp::as_millis))
        .bind(filter.effective_limit())
        .fetch_all(conn)
        .await
        .map_err(error)?;
        rows.into_iter().map(Record::try_from).collect()
    }

    async fn find_by_key(
        &self,
        conn: &mut PgConnection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let rows = literal::query_as::<RecordRow>(
            "SELECT * FROM idemkey_records WHERE tenant = $1 AND key_hash = $2
              ORDER BY created_at",
        )
        .bind(tenant)
        .bind(&key_hash[..])
        .fetch_all(conn)
        .await
        .map_err(error)?;
        rows.into_iter().map(Record::try_from).collect()
    }

    async fn evict(&self, conn: &mut PgConnection, id: &RecordId) -> Result<bool, StoreError> {
        let done = literal::query(
            "DELETE FROM idemkey_records WHERE tenant = $1 AND key_hash = $2 AND route = $3",
        )
        .bind_id(id)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_batch(
        &self,
        conn: &mut PgConnection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        // In `expires_at` order, so the index is read from `from` on: without the order the
        // planner may pick a sequential scan, expecting expired rows all over the table,
        // and read gigabytes of live and deleted rows before finding a batch. SKIP LOCKED:
        // rows that live traffic holds (a takeover in progress) are left for the next round
        // instead of blocking it. The rows are deleted by `ctid`, not looked up again by
        // primary key: this statement holds their locks, so no other can move them first.
        let (deleted, through): (i64, Option<i64>) = literal::query_as(
            "WITH gone AS (
                 DELETE FROM idemkey_records
                  WHERE ctid = ANY (ARRAY(
                            SELECT ctid FROM idemkey_records
                             WHERE expires_at <= $1 AND expires_at >= $2
                             ORDER BY expires_at
                             LIMIT $3
                               FOR UPDATE SKIP LOCKED))
                    AND expires_at <= $1
                 RETURNING expires_at
             )
             SELECT count(*), max(expires_at) FROM gone",
        )
        .bind(now.as_millis())
        .bind(from.map_or(i64::MIN, Timestamp::as_millis))
        .bind(i64::from(batch))
        .fetch_one(conn)
        .await
        .map_err(error)?;
        Ok(Purged {
            deleted: u64::try_from(deleted).unwrap_or(0),
            through: through.map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut PgConnection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        literal::query(
            "INSERT INTO idemkey_audit (tenant, key_hash, route, at, actor, action, detail)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind_id(&entry.id)
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
        conn: &mut PgConnection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = literal::query_as::<AuditRow>(
            "SELECT tenant, key_hash, route, at, actor, action, detail FROM idemkey_audit
              WHERE tenant = $1 AND key_hash = $2 AND route = $3
              ORDER BY id",
        )
        .bind_id(id)
        .fetch_all(conn)
        .await
        .map_err(error)?;
        rows.into_iter().map(AuditEntry::try_from).collect()
    }

    async fn notify_evicted(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
    ) -> Result<(), StoreError> {
        // Inside a transaction, PostgreSQL delivers the notice when it commits.
        literal::query("SELECT pg_notify($1, $2)")
            .bind(EVICTION_CHANNEL)
            .bind(hex::encode(id.digest()))
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(())
    }
}
