//! A SQLite store whose statements run on the calling thread, through rusqlite.
//!
//! sqlx's SQLite driver runs each connection on a thread of its own and hands every
//! statement there and back. Inside the writer's turn, those hand-offs cost a fresh request
//! more than SQLite's own work does (docs/decisions.md, "SQLite's writer without sqlx's
//! worker thread"). [`RusqliteStore`] calls SQLite directly instead, on the task's thread, while it
//! holds the turn: a statement is not a hand-off, and the turn is as long as the work.
//!
//! The application's effect runs on the same connection, so it is written with rusqlite
//! too: [`RusqliteTransaction`] dereferences to [`rusqlite::Connection`]. Statements are
//! synchronous and must stay short. A connection is not `Sync`, so a handler cannot hold a
//! statement across an `.await`.
//!
//! The SQL is the one [`SqliteStore`](crate::SqliteStore) runs (`sql.rs`), and the two
//! share a database file and its migrations.

use idemkey_core::{
    AuditEntry, EvictionNotices, Inserted, ListFilter, Members, NewRecord, Purged, Record,
    RecordId, Store, StoreAdmin, StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlx::{AuditRow, RecordRow};
use rusqlite::{Connection, OptionalExtension, params};

use crate::evictions::{self, EVICTION_KEPT, Evictions};
use crate::rusqlite_connection::Autocommit;
use crate::sql;
use crate::{RusqliteConnection, RusqliteStore, RusqliteTransaction};

pub(crate) fn error(e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
    match e.sqlite_error_code() {
        Some(DatabaseBusy | DatabaseLocked) => StoreError::Busy(Box::new(e)),
        _ => StoreError::Database(Box::new(e)),
    }
}

fn record(row: &rusqlite::Row<'_>) -> rusqlite::Result<RecordRow> {
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

fn records(rows: Vec<RecordRow>) -> Result<Vec<Record>, StoreError> {
    rows.into_iter().map(Record::try_from).collect()
}

/// Runs `statement` with `params` and answers how many rows it changed.
pub(crate) fn changed(
    conn: &Connection,
    statement: &str,
    params: impl rusqlite::Params,
) -> Result<usize, StoreError> {
    conn.prepare_cached(statement)
        .and_then(|mut s| s.execute(params))
        .map_err(error)
}

/// Runs `statement` with `params` and answers whether it changed exactly one row.
fn changed_one(
    conn: &Connection,
    statement: &str,
    params: impl rusqlite::Params,
) -> Result<bool, StoreError> {
    Ok(changed(conn, statement, params)? == 1)
}

/// The claim's `INSERT … ON CONFLICT DO NOTHING RETURNING token`: `Some` when it inserted.
pub(crate) fn insert_row(conn: &Connection, r: &NewRecord) -> Result<Option<i64>, StoreError> {
    conn.prepare_cached(sql::INSERT)
        .and_then(|mut s| {
            s.query_row(
                params![
                    r.id.tenant,
                    &r.id.key_hash[..],
                    r.id.route,
                    &r.fingerprint.digest[..],
                    r.fingerprint.parts.to_bytes(),
                    r.state.as_str(),
                    r.lease_expires_at.map(Timestamp::as_millis),
                    r.now.as_millis(),
                    r.expires_at.as_millis(),
                    r.sealed_key.as_deref(),
                    r.fingerprint.members.as_ref().map(Members::to_bytes),
                    r.first_sent.map(Timestamp::as_millis),
                ],
                |row| row.get(0),
            )
            .optional()
        })
        .map_err(error)
}

/// The completion's `UPDATE`, guarded by the token: whether it matched its row.
pub(crate) fn complete_row(
    conn: &Connection,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> Result<bool, StoreError> {
    changed_one(
        conn,
        sql::COMPLETE,
        params![
            id.tenant,
            &id.key_hash[..],
            id.route,
            token,
            i32::from(response.status),
            response.encode_headers(),
            &response.body[..],
            now.as_millis(),
        ],
    )
}

impl Store for RusqliteStore {
    type Connection = Connection;
    type Transaction = RusqliteTransaction;
    type PooledConnection = RusqliteConnection;

    async fn begin(&self) -> Result<RusqliteTransaction, StoreError> {
        let mut turn = self.shared.turn().await?;
        let conn = turn.as_mut().expect("the turn opened the writer");
        if !conn.is_autocommit() {
            // Not left so by this store; closing it rolls back whatever is open on it.
            *turn = Some(self.shared.writer_connection()?);
        }
        turn.as_ref()
            .expect("the writer is open")
            .execute_batch("BEGIN IMMEDIATE")
            .map_err(error)?;
        Ok(RusqliteTransaction {
            turn,
            shared: self.shared.clone(),
        })
    }

    async fn commit(&self, tx: RusqliteTransaction) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn acquire(&self) -> Result<RusqliteConnection, StoreError> {
        let conn = self.shared.idle_connection()?;
        Ok(RusqliteConnection(Autocommit::Idle(
            Some(conn),
            self.shared.clone(),
        )))
    }

    /// Concurrent reservations are written in groups, in one transaction in one turn of the
    /// writer each, each answered once its group committed, as [`insert`](Store::insert)
    /// would have answered it alone (`idemkey_sqlx::group`).
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.shared.grouped.insert(self, record).await
    }

    /// Concurrent completions are written in groups, as reservations are.
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.shared
            .grouped
            .complete(self, id, token, response, now)
            .await
    }

    async fn acquire_for_write(&self) -> Result<RusqliteConnection, StoreError> {
        let turn = self.shared.turn().await?;
        Ok(RusqliteConnection(Autocommit::Writer(
            turn,
            self.shared.clone(),
        )))
    }

    async fn insert(&self, conn: &mut Connection, r: &NewRecord) -> Result<Inserted, StoreError> {
        // As `SqliteStore::insert`: in the claim's `BEGIN IMMEDIATE` transaction the row
        // the insert conflicted with is committed, and the read finds it.
        if insert_row(conn, r)?.is_some() {
            return Ok(Inserted::Owned);
        }
        Ok(match self.fetch(conn, &r.id).await? {
            Some(existing) => Inserted::Existing(Box::new(existing)),
            None => Inserted::Conflict,
        })
    }

    async fn fetch(
        &self,
        conn: &mut Connection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        conn.prepare_cached(sql::FETCH)
            .and_then(|mut s| {
                s.query_row(params![id.tenant, &id.key_hash[..], id.route], record)
                    .optional()
            })
            .map_err(error)?
            .map(Record::try_from)
            .transpose()
    }

    async fn replace(
        &self,
        conn: &mut Connection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        conn.prepare_cached(sql::REPLACE)
            .and_then(|mut s| {
                s.query_row(
                    params![
                        r.id.tenant,
                        &r.id.key_hash[..],
                        r.id.route,
                        &r.fingerprint.digest[..],
                        r.fingerprint.parts.to_bytes(),
                        r.state.as_str(),
                        r.lease_expires_at.map(Timestamp::as_millis),
                        r.now.as_millis(),
                        r.expires_at.as_millis(),
                        token,
                        r.sealed_key.as_deref(),
                        r.fingerprint.members.as_ref().map(Members::to_bytes),
                        r.first_sent.map(Timestamp::as_millis),
                    ],
                    |row| row.get(0),
                )
                .optional()
            })
            .map_err(error)
    }

    async fn complete(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        complete_row(conn, id, token, response, now)
    }

    async fn renew(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::RENEW,
            params![
                id.tenant,
                &id.key_hash[..],
                id.route,
                token,
                lease_until.as_millis(),
                now.as_millis()
            ],
        )
    }

    async fn mark_executing(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::MARK_EXECUTING,
            params![
                id.tenant,
                &id.key_hash[..],
                id.route,
                token,
                lease_until.as_millis(),
                now.as_millis()
            ],
        )
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::MARK_INDETERMINATE,
            params![
                id.tenant,
                &id.key_hash[..],
                id.route,
                token,
                now.as_millis()
            ],
        )
    }

    async fn release(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::RELEASE,
            params![id.tenant, &id.key_hash[..], id.route, token],
        )
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.clone()))
    }
}

impl StoreAdmin for RusqliteStore {
    async fn list(
        &self,
        conn: &mut Connection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = conn
            .prepare_cached(sql::LIST)
            .and_then(|mut s| {
                s.query_map(
                    params![
                        filter.tenant.as_deref(),
                        filter.state.map(|s| s.as_str()),
                        filter.created_before.map(Timestamp::as_millis),
                        filter.effective_limit(),
                    ],
                    record,
                )?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        records(rows)
    }

    async fn find_by_key(
        &self,
        conn: &mut Connection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let rows = conn
            .prepare_cached(sql::FIND_BY_KEY)
            .and_then(|mut s| {
                s.query_map(params![tenant, &key_hash[..]], record)?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        records(rows)
    }

    async fn evict(&self, conn: &mut Connection, id: &RecordId) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::EVICT,
            params![id.tenant, &id.key_hash[..], id.route],
        )
    }

    async fn purge_batch(
        &self,
        conn: &mut Connection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        let gone = conn
            .prepare_cached(sql::PURGE_BATCH)
            .and_then(|mut s| {
                s.query_map(
                    params![
                        now.as_millis(),
                        from.map_or(i64::MIN, Timestamp::as_millis),
                        i64::from(batch)
                    ],
                    |row| row.get::<_, i64>(0),
                )?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        Ok(Purged {
            deleted: gone.len() as u64,
            through: gone.into_iter().max().map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut Connection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        conn.prepare_cached(sql::APPEND_AUDIT)
            .and_then(|mut s| {
                s.execute(params![
                    entry.id.tenant,
                    &entry.id.key_hash[..],
                    entry.id.route,
                    entry.at.as_millis(),
                    entry.actor,
                    entry.action,
                    entry.detail,
                ])
            })
            .map_err(error)?;
        Ok(())
    }

    async fn audit(
        &self,
        conn: &mut Connection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = conn
            .prepare_cached(sql::AUDIT)
            .and_then(|mut s| {
                s.query_map(params![id.tenant, &id.key_hash[..], id.route], |row| {
                    Ok(AuditRow {
                        tenant: row.get(0)?,
                        key_hash: row.get(1)?,
                        route: row.get(2)?,
                        at: row.get(3)?,
                        actor: row.get(4)?,
                        action: row.get(5)?,
                        detail: row.get(6)?,
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        rows.into_iter().map(AuditEntry::try_from).collect()
    }

    async fn notify_evicted(&self, conn: &mut Connection, id: &RecordId) -> Result<(), StoreError> {
        // As `SqliteStore::notify_evicted`, on the eviction's transaction: other processes
        // on the file read it once it commits.
        let now = Timestamp::now();
        conn.prepare_cached(sql::TRIM_EVICTIONS)
            .and_then(|mut s| s.execute(params![now.minus(EVICTION_KEPT).as_millis()]))
            .and_then(|_| conn.prepare_cached(sql::NOTE_EVICTION))
            .and_then(|mut s| s.execute(params![&id.digest()[..], now.as_millis()]))
            .map_err(error)?;
        Ok(())
    }
}

/// Reads through an idle connection of the store's, outside the writer's turn.
impl Evictions for RusqliteStore {
    async fn newest(&self) -> Result<i64, StoreError> {
        self.with_connection(|c| c.query_row(evictions::NEWEST, [], |r| r.get(0)))
    }

    async fn after(&self, seq: i64) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        self.with_connection(|c| {
            c.prepare_cached(evictions::AFTER)?
                .query_map(params![seq], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })
    }
}
