//! The [`Store`](idemkey_core::Store) and [`StoreAdmin`](idemkey_core::StoreAdmin) methods
//! of both SQLite stores that are one statement (or two) each, written once over a
//! [`Driver`]: both stores' impls call them on their own connection types (`forward.rs`).

use idemkey_core::{AuditEntry, Inserted, ListFilter, NewRecord, Purged, Record, RecordId};
use idemkey_core::{StoreError, StoredResponse, Timestamp};
use idemkey_sqlx::{AuditRow, RecordRow};

use crate::driver::Driver;
use crate::evictions::EVICTION_KEPT;
use crate::params::{self, Value};
use crate::sql;

/// The claim's `INSERT … ON CONFLICT DO NOTHING RETURNING token`: whether it inserted.
pub(crate) async fn insert_row(conn: &mut impl Driver, r: &NewRecord) -> Result<bool, StoreError> {
    let row: Option<(i64,)> = conn.fetch_optional(sql::INSERT, params::insert(r)).await?;
    Ok(row.is_some())
}

/// Two statements. In the claim's `BEGIN IMMEDIATE` transaction this connection holds the
/// only write lock, so the row the insert conflicted with is committed and the read finds
/// it. On an autocommit connection (external mode) it may be gone by the read: then
/// `Conflict`, and the protocol reads again.
pub(crate) async fn insert(conn: &mut impl Driver, r: &NewRecord) -> Result<Inserted, StoreError> {
    if insert_row(conn, r).await? {
        return Ok(Inserted::Owned);
    }
    taken(conn, &r.id).await
}

/// What a claim of a taken key answers: the record that took it, read in the claim's
/// transaction, or [`Inserted::Conflict`] when it is gone already.
pub(crate) async fn taken(conn: &mut impl Driver, id: &RecordId) -> Result<Inserted, StoreError> {
    Ok(match fetch(conn, id).await? {
        Some(existing) => Inserted::Existing(Box::new(existing)),
        None => Inserted::Conflict,
    })
}

pub(crate) async fn fetch(
    conn: &mut impl Driver,
    id: &RecordId,
) -> Result<Option<Record>, StoreError> {
    let row: Option<RecordRow> = conn.fetch_optional(sql::FETCH, params::id(id)).await?;
    row.map(Record::try_from).transpose()
}

pub(crate) async fn replace(
    conn: &mut impl Driver,
    r: &NewRecord,
    token: i64,
) -> Result<Option<i64>, StoreError> {
    let row: Option<(i64,)> = conn
        .fetch_optional(sql::REPLACE, params::replace(r, token))
        .await?;
    Ok(row.map(|(token,)| token))
}

pub(crate) async fn complete(
    conn: &mut impl Driver,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let params = params::completion(id, token, response, now);
    Ok(conn.execute(sql::COMPLETE, params).await? == 1)
}

pub(crate) async fn renew(
    conn: &mut impl Driver,
    id: &RecordId,
    token: i64,
    lease_until: Timestamp,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let params: [_; 6] = params::owned(id, token, [lease_until.as_millis(), now.as_millis()]);
    Ok(conn.execute(sql::RENEW, params).await? == 1)
}

pub(crate) async fn mark_executing(
    conn: &mut impl Driver,
    id: &RecordId,
    token: i64,
    lease_until: Timestamp,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let params: [_; 6] = params::owned(id, token, [lease_until.as_millis(), now.as_millis()]);
    Ok(conn.execute(sql::MARK_EXECUTING, params).await? == 1)
}

pub(crate) async fn mark_indeterminate(
    conn: &mut impl Driver,
    id: &RecordId,
    token: i64,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let params: [_; 5] = params::owned(id, token, [now.as_millis()]);
    Ok(conn.execute(sql::MARK_INDETERMINATE, params).await? == 1)
}

pub(crate) async fn release(
    conn: &mut impl Driver,
    id: &RecordId,
    token: i64,
) -> Result<bool, StoreError> {
    let params: [_; 4] = params::owned(id, token, []);
    Ok(conn.execute(sql::RELEASE, params).await? == 1)
}

pub(crate) async fn list(
    conn: &mut impl Driver,
    filter: &ListFilter,
) -> Result<Vec<Record>, StoreError> {
    let params = [
        filter.tenant.as_deref().map_or(Value::Null, Value::Text),
        filter
            .state
            .map_or(Value::Null, |s| Value::Text(s.as_str())),
        filter
            .created_before
            .map_or(Value::Null, |t| Value::Int(t.as_millis())),
        Value::Int(filter.effective_limit()),
    ];
    records(conn.fetch_all(sql::LIST, params).await?)
}

pub(crate) async fn find_by_key(
    conn: &mut impl Driver,
    tenant: &str,
    key_hash: &[u8; 32],
) -> Result<Vec<Record>, StoreError> {
    let params = [Value::Text(tenant), Value::Bytes(key_hash)];
    records(conn.fetch_all(sql::FIND_BY_KEY, params).await?)
}

fn records(rows: Vec<RecordRow>) -> Result<Vec<Record>, StoreError> {
    rows.into_iter().map(Record::try_from).collect()
}

pub(crate) async fn evict(conn: &mut impl Driver, id: &RecordId) -> Result<bool, StoreError> {
    Ok(conn.execute(sql::EVICT, params::id(id)).await? == 1)
}

/// SQLite has one writer at a time, so there are no locked rows to skip; a small batch
/// keeps the write lock short.
pub(crate) async fn purge_batch(
    conn: &mut impl Driver,
    now: Timestamp,
    from: Option<Timestamp>,
    batch: u32,
) -> Result<Purged, StoreError> {
    let params = [
        Value::Int(now.as_millis()),
        Value::Int(from.map_or(i64::MIN, Timestamp::as_millis)),
        Value::Int(i64::from(batch)),
    ];
    let gone: Vec<(i64,)> = conn.fetch_all(sql::PURGE_BATCH, params).await?;
    Ok(Purged {
        deleted: gone.len() as u64,
        through: gone.into_iter().map(|(at,)| at).max().map(Timestamp),
    })
}

pub(crate) async fn append_audit(
    conn: &mut impl Driver,
    entry: &AuditEntry,
) -> Result<(), StoreError> {
    let [tenant, key, route] = params::id(&entry.id);
    let params = [
        tenant,
        key,
        route,
        Value::Int(entry.at.as_millis()),
        Value::Text(&entry.actor),
        Value::Text(&entry.action),
        Value::Text(&entry.detail),
    ];
    conn.execute(sql::APPEND_AUDIT, params).await?;
    Ok(())
}

pub(crate) async fn audit(
    conn: &mut impl Driver,
    id: &RecordId,
) -> Result<Vec<AuditEntry>, StoreError> {
    let rows: Vec<AuditRow> = conn.fetch_all(sql::AUDIT, params::id(id)).await?;
    rows.into_iter().map(AuditEntry::try_from).collect()
}

/// On the eviction's transaction: other processes on the file read it once it commits.
pub(crate) async fn notify_evicted(
    conn: &mut impl Driver,
    id: &RecordId,
) -> Result<(), StoreError> {
    let now = Timestamp::now();
    let kept_from = now.minus(EVICTION_KEPT).as_millis();
    conn.execute(sql::TRIM_EVICTIONS, [Value::Int(kept_from)])
        .await?;
    let digest = id.digest();
    conn.execute(
        sql::NOTE_EVICTION,
        [Value::Bytes(&digest), Value::Int(now.as_millis())],
    )
    .await?;
    Ok(())
}
