//! What the sqlx-based stores share: the row type and the error classification.
//!
//! Both dialects store the same columns with the same Rust types (`TEXT`, `BLOB`/`BYTEA`,
//! 64-bit integers), so one `FromRow` type reads a record from either.

use crate::outbox::{Message, MessageState, OutboxAuditEntry};
use crate::{
    AuditEntry, BoxError, Fingerprint, FingerprintParts, Members, Record, RecordId, RecordState,
    StoreError, StoredResponse, Timestamp,
};

/// One row of `idemkey_records`, as the stores select it (`SELECT *`), column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct RecordRow {
    pub tenant: String,
    pub key_hash: Vec<u8>,
    pub route: String,
    pub fingerprint: Vec<u8>,
    pub fingerprint_parts: Vec<u8>,
    pub state: String,
    pub token: i64,
    pub lease_expires_at: Option<i64>,
    pub response_status: Option<i32>,
    pub response_headers: Option<Vec<u8>>,
    pub response_body: Option<Vec<u8>>,
    pub created_at: i64,
    pub updated_at: i64,
    pub expires_at: i64,
    pub sealed_key: Option<Vec<u8>>,
    pub fingerprint_members: Option<Vec<u8>>,
    pub first_sent: Option<i64>,
}

impl TryFrom<RecordRow> for Record {
    type Error = StoreError;

    fn try_from(row: RecordRow) -> Result<Self, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("{what} in idemkey_records"));
        let state = RecordState::parse(&row.state).ok_or_else(|| corrupt("unknown state"))?;
        let response = match (row.response_status, row.response_headers, row.response_body) {
            (Some(status), Some(headers), Some(body)) => Some(StoredResponse {
                status: u16::try_from(status).map_err(|_| corrupt("bad status"))?,
                headers: StoredResponse::decode_headers(&headers)
                    .ok_or_else(|| corrupt("bad response headers"))?,
                body,
            }),
            (None, None, None) => None,
            _ => return Err(corrupt("partial response")),
        };
        Ok(Record {
            id: RecordId {
                tenant: row.tenant,
                key_hash: row
                    .key_hash
                    .try_into()
                    .map_err(|_| corrupt("bad key hash"))?,
                route: row.route,
            },
            fingerprint: Fingerprint {
                digest: row
                    .fingerprint
                    .try_into()
                    .map_err(|_| corrupt("bad fingerprint"))?,
                parts: FingerprintParts::from_bytes(&row.fingerprint_parts)
                    .ok_or_else(|| corrupt("bad fingerprint parts"))?,
                // Only ever used to name a member in a 422: a value this version cannot read
                // (another encoding version) names none rather than make the record unusable.
                members: row
                    .fingerprint_members
                    .as_deref()
                    .and_then(Members::from_bytes),
            },
            state,
            token: row.token,
            lease_expires_at: row.lease_expires_at.map(Timestamp),
            response,
            created_at: Timestamp(row.created_at),
            updated_at: Timestamp(row.updated_at),
            expires_at: Timestamp(row.expires_at),
            sealed_key: row.sealed_key,
            first_sent: row.first_sent.map(Timestamp),
        })
    }
}

/// One row of `idemkey_audit`, as the stores select it, column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct AuditRow {
    pub tenant: String,
    pub key_hash: Vec<u8>,
    pub route: String,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub detail: String,
}

impl TryFrom<AuditRow> for AuditEntry {
    type Error = StoreError;

    fn try_from(row: AuditRow) -> Result<Self, StoreError> {
        Ok(AuditEntry {
            id: RecordId {
                tenant: row.tenant,
                key_hash: row
                    .key_hash
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("bad key hash in idemkey_audit".into()))?,
                route: row.route,
            },
            at: Timestamp(row.at),
            actor: row.actor,
            action: row.action,
            detail: row.detail,
        })
    }
}

/// One row of `idemkey_outbox`, as the stores select it, column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct MessageRow {
    pub seq: i64,
    pub id: String,
    pub grp: String,
    pub kind: String,
    pub data: String,
    pub created_at: i64,
    pub state: String,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub claimed_by: Option<String>,
    pub claimed_until: Option<i64>,
    pub last_error: Option<String>,
    pub sent_at: Option<i64>,
}

impl TryFrom<MessageRow> for Message {
    type Error = StoreError;

    fn try_from(row: MessageRow) -> Result<Self, StoreError> {
        Ok(Message {
            seq: row.seq,
            id: row.id,
            group: row.grp,
            kind: row.kind,
            data: row.data,
            created_at: Timestamp(row.created_at),
            state: MessageState::parse(&row.state)
                .ok_or_else(|| StoreError::Corrupt("unknown state in idemkey_outbox".into()))?,
            attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
            next_attempt_at: Timestamp(row.next_attempt_at),
            claimed_by: row.claimed_by,
            claimed_until: row.claimed_until.map(Timestamp),
            last_error: row.last_error,
            sent_at: row.sent_at.map(Timestamp),
        })
    }
}

/// One row of `idemkey_outbox_audit`, as the stores select it, column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct OutboxAuditRow {
    pub message_id: String,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub detail: String,
}

impl From<OutboxAuditRow> for OutboxAuditEntry {
    fn from(row: OutboxAuditRow) -> Self {
        OutboxAuditEntry {
            message_id: row.message_id,
            at: Timestamp(row.at),
            actor: row.actor,
            action: row.action,
            detail: row.detail,
        }
    }
}

/// Binds a completion's values as parameters 1–8, in the order both stores' completing
/// `UPDATE` numbers them: tenant, key hash, route, the owner's token, then the response's
/// status, encoded headers and body, and the time.
pub fn bind_completion<'q, DB>(
    query: sqlx::query::Query<'q, DB, DB::Arguments>,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: sqlx::Database,
    for<'t> &'t String: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t [u8]: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Vec<u8>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> i32: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    query
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .bind(token)
        .bind(i32::from(response.status))
        .bind(response.encode_headers())
        .bind(&response.body[..])
        .bind(now.as_millis())
}

/// Classifies a sqlx error. `is_busy` tells, from the database's own error code (never its
/// message), whether a lock was not granted in time.
pub fn classify_error(error: sqlx::Error, is_busy: impl Fn(&str) -> bool) -> StoreError {
    use sqlx::Error as E;
    match error {
        E::Database(db) => {
            if db.code().is_some_and(|c| is_busy(&c)) {
                StoreError::Busy(Box::new(E::Database(db)))
            } else if db.code().is_some_and(|c| is_connection_sqlstate(&c)) {
                StoreError::Unavailable(Box::new(E::Database(db)))
            } else {
                StoreError::Database(Box::new(E::Database(db)))
            }
        }
        E::Io(_)
        | E::Tls(_)
        | E::PoolTimedOut
        | E::PoolClosed
        | E::WorkerCrashed
        | E::Protocol(_) => StoreError::Unavailable(Box::new(error)),
        other => StoreError::Database(Box::new(other) as BoxError),
    }
}

/// Whether `error` says the connection itself is gone (the socket failed, or the server
/// ended the session: see `is_connection_sqlstate`), as opposed to a refused statement, a
/// pool time-out or a closed pool. Classified by kind and code, never by message. A store
/// may retry a statement that has no effect of its own (`BEGIN`) on another connection
/// after such an error.
pub fn is_connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| is_connection_sqlstate(&c)),
        _ => false,
    }
}

/// Whether `error` says the database cannot be used now for want of a connection: the
/// connection is lost ([`is_connection_lost`]), or the server refuses new ones while it
/// starts up or shuts down (SQLSTATE 57P03 cannot_connect_now). A store does not retry on
/// 57P03 (there is no other server to begin on); a server answers 503 and waits at start.
pub fn is_database_unavailable(error: &sqlx::Error) -> bool {
    is_connection_lost(error)
        || matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|c| c == "57P03"))
}

/// The SQLSTATEs with which the server ends a session: class 08 (connection exception),
/// 57P01 admin_shutdown (the backend was terminated), 57P02 crash_shutdown, 57P05
/// idle_session_timeout, 25P03 idle_in_transaction_session_timeout and 25P04
/// transaction_timeout. A connection that sat idle in a transaction past the server's
/// time-out answers its next message with 25P03.
fn is_connection_sqlstate(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P05" | "25P03" | "25P04")
}

/// Implements [`OutboxStore`](crate::outbox::OutboxStore) for a sqlx store: the Rust side is
/// the same for every dialect (binds, row mapping, errors); the SQL is the store's own, given
/// as associated constants of `$sql` (`ENQUEUE`, `CLAIM_DUE`, `MARK_SENT`, `MARK_FAILED`,
/// `MESSAGES`, `MESSAGE`, `REQUEUE`, `REMOVE_DEAD`, `PURGE_SENT`, `STATS`, `APPEND_AUDIT`,
/// `AUDIT`), each binding its parameters in the order the calls here give them.
/// `$error` maps a `sqlx::Error` to a [`StoreError`](crate::StoreError). Two more arguments,
/// `$query` and `$query_as`, replace `sqlx::query` and `sqlx::query_as` with functions of
/// the store's that take the same calls (`bind`, `execute`, `fetch_*`).
#[macro_export]
macro_rules! impl_outbox_store {
    ($store:ty, $conn:ty, $sql:ty, $error:path) => {
        $crate::impl_outbox_store!($store, $conn, $sql, $error, sqlx::query, sqlx::query_as);
    };
    ($store:ty, $conn:ty, $sql:ty, $error:path, $query:path, $query_as:path) => {
        impl $crate::outbox::OutboxStore for $store {
            async fn enqueue(
                conn: &mut $conn,
                message: &$crate::outbox::NewMessage,
            ) -> Result<(), $crate::StoreError> {
                $query(<$sql>::ENQUEUE)
                    .bind(&message.id)
                    .bind(&message.group)
                    .bind(&message.kind)
                    .bind(&message.data)
                    .bind(message.created_at.as_millis())
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(())
            }

            async fn claim_due(
                &self,
                conn: &mut $conn,
                relay: &str,
                now: $crate::Timestamp,
                until: $crate::Timestamp,
                limit: u32,
            ) -> Result<Vec<$crate::outbox::Message>, $crate::StoreError> {
                let rows: Vec<$crate::MessageRow> = $query_as(<$sql>::CLAIM_DUE)
                    .bind(relay)
                    .bind(now.as_millis())
                    .bind(until.as_millis())
                    .bind(i64::from(limit))
                    .fetch_all(conn)
                    .await
                    .map_err($error)?;
                let mut claimed = rows
                    .into_iter()
                    .map($crate::outbox::Message::try_from)
                    .collect::<Result<Vec<_>, _>>()?;
                claimed.sort_by_key(|m| m.seq);
                Ok(claimed)
            }

            async fn mark_sent(
                &self,
                conn: &mut $conn,
                id: &str,
                relay: &str,
                now: $crate::Timestamp,
            ) -> Result<bool, $crate::StoreError> {
                let done = $query(<$sql>::MARK_SENT)
                    .bind(id)
                    .bind(relay)
                    .bind(now.as_millis())
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn mark_failed(
                &self,
                conn: &mut $conn,
                id: &str,
                relay: &str,
                next_attempt_at: Option<$crate::Timestamp>,
                failure: &str,
            ) -> Result<bool, $crate::StoreError> {
                let done = $query(<$sql>::MARK_FAILED)
                    .bind(id)
                    .bind(relay)
                    .bind(next_attempt_at.map($crate::Timestamp::as_millis))
                    .bind(failure)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn messages(
                &self,
                conn: &mut $conn,
                filter: &$crate::outbox::MessageFilter,
            ) -> Result<Vec<$crate::outbox::Message>, $crate::StoreError> {
                let rows: Vec<$crate::MessageRow> = $query_as(<$sql>::MESSAGES)
                    .bind(filter.state.map(|s| s.as_str()))
                    .bind(filter.effective_limit())
                    .fetch_all(conn)
                    .await
                    .map_err($error)?;
                rows.into_iter()
                    .map($crate::outbox::Message::try_from)
                    .collect()
            }

            async fn message(
                &self,
                conn: &mut $conn,
                id: &str,
            ) -> Result<Option<$crate::outbox::Message>, $crate::StoreError> {
                let row: Option<$crate::MessageRow> = $query_as(<$sql>::MESSAGE)
                    .bind(id)
                    .fetch_optional(conn)
                    .await
                    .map_err($error)?;
                row.map($crate::outbox::Message::try_from).transpose()
            }

            async fn requeue(
                &self,
                conn: &mut $conn,
                id: &str,
                now: $crate::Timestamp,
            ) -> Result<bool, $crate::StoreError> {
                let done = $query(<$sql>::REQUEUE)
                    .bind(id)
                    .bind(now.as_millis())
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn remove_dead(
                &self,
                conn: &mut $conn,
                id: &str,
            ) -> Result<bool, $crate::StoreError> {
                let done = $query(<$sql>::REMOVE_DEAD)
                    .bind(id)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn purge_sent(
                &self,
                conn: &mut $conn,
                before: $crate::Timestamp,
                batch: u32,
            ) -> Result<u64, $crate::StoreError> {
                let done = $query(<$sql>::PURGE_SENT)
                    .bind(before.as_millis())
                    .bind(i64::from(batch))
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected())
            }

            async fn outbox_stats(
                &self,
                conn: &mut $conn,
            ) -> Result<$crate::outbox::OutboxStats, $crate::StoreError> {
                let (pending, dead, oldest): (i64, i64, Option<i64>) = $query_as(<$sql>::STATS)
                    .fetch_one(conn)
                    .await
                    .map_err($error)?;
                Ok($crate::outbox::OutboxStats {
                    pending: pending.max(0) as u64,
                    dead: dead.max(0) as u64,
                    oldest_pending: oldest.map($crate::Timestamp),
                })
            }

            async fn append_outbox_audit(
                &self,
                conn: &mut $conn,
                entry: &$crate::outbox::OutboxAuditEntry,
            ) -> Result<(), $crate::StoreError> {
                $query(<$sql>::APPEND_AUDIT)
                    .bind(&entry.message_id)
                    .bind(entry.at.as_millis())
                    .bind(&entry.actor)
                    .bind(&entry.action)
                    .bind(&entry.detail)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(())
            }

            async fn outbox_audit(
                &self,
                conn: &mut $conn,
                id: &str,
            ) -> Result<Vec<$crate::outbox::OutboxAuditEntry>, $crate::StoreError> {
                let rows: Vec<$crate::OutboxAuditRow> = $query_as(<$sql>::AUDIT)
                    .bind(id)
                    .fetch_all(conn)
                    .await
                    .map_err($error)?;
                Ok(rows
                    .into_iter()
                    .map($crate::outbox::OutboxAuditEntry::from)
                    .collect())
            }
        }
    };
}
