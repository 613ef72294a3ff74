//! External mode's grouped writes: [`GroupWriter`] for [`SqliteStore`].

use std::collections::HashSet;

use idemkey_core::{Inserted, Members, NewRecord, RecordId, Store, StoreError, Timestamp};
use idemkey_sqlx::group::{self, Completion, GroupWriter};
use sqlx::AssertSqlSafe;
use sqlx::Sqlite;
use sqlx::sqlite::SqliteArguments;

use crate::SqliteStore;
use crate::store::error;

/// External mode's grouped writes: one group of each kind at a time. The writer takes them
/// in turns anyway, and a second group only splits the waiting writes (the gateway's fresh
/// requests were slower with two: docs/decisions.md, "Concurrent external-mode writes are
/// committed in groups").
pub(crate) const GROUP_WRITERS: usize = 1;

/// `values` rows of `width` parameters each: `(?, ?), (?, ?)` for 2 and 2, bound in order.
/// Anonymous: sqlx asks SQLite the name of every parameter it binds, and SQLite finds a
/// numbered one by walking the statement's list of names, which a group's hundreds of
/// `?NNN` made quadratic in the group's size.
fn value_rows(values: usize, width: usize) -> String {
    let row = format!("({})", vec!["?"; width].join(", "));
    vec![row; values].join(", ")
}

/// A grouped statement that SQLite refused as busy wrote nothing (another process held
/// the write lock past the busy time-out): each of its writers gets that answer, as it
/// would alone, rather than each waiting again in turn.
pub(crate) fn busy_for_each(e: &StoreError, writes: usize) -> Option<StoreError> {
    let StoreError::Busy(source) = e else {
        return None;
    };
    Some(StoreError::Busy(Box::new(std::io::Error::other(format!(
        "a group of {writes} writes: {source}"
    )))))
}

impl SqliteStore {
    /// `statement` on the writer, in one turn (autocommit: one statement, one transaction).
    async fn write_group<'q>(
        &self,
        statement: sqlx::query::QueryAs<'q, Sqlite, (String, Vec<u8>, String), SqliteArguments>,
    ) -> Result<HashSet<RecordId>, StoreError> {
        let mut conn = self.acquire_for_write().await?;
        let rows = statement.fetch_all(&mut *conn).await.map_err(error)?;
        Ok(group::returned(rows))
    }
}

impl GroupWriter for SqliteStore {
    /// One multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING` in one turn of the writer
    /// (one hand-off to sqlx's worker thread for the group), answered
    /// [`Inserted::Owned`] for the rows it inserted and [`Inserted::Conflict`] for the keys
    /// it found taken (the protocol reads those records). Busy: each gets busy. Any other
    /// failure wrote nothing (one statement is one transaction here): each is made again
    /// alone.
    async fn insert_group(&self, records: Vec<NewRecord>) -> Vec<Result<Inserted, StoreError>> {
        let (rows, in_group) = group::plan(&records, |r| &r.id);
        let sql = format!(
            "INSERT INTO idemkey_records
                 (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token,
                  lease_expires_at, created_at, updated_at, expires_at, sealed_key,
                  fingerprint_members, first_sent)
             VALUES {}
             ON CONFLICT (tenant, key_hash, route) DO NOTHING
             RETURNING tenant, key_hash, route",
            value_rows(rows.len(), 14)
        );
        let mut statement = sqlx::query_as(AssertSqlSafe(sql));
        for r in &rows {
            statement = statement
                .bind(&r.id.tenant)
                .bind(&r.id.key_hash[..])
                .bind(&r.id.route)
                .bind(&r.fingerprint.digest[..])
                .bind(r.fingerprint.parts.to_bytes().to_vec())
                .bind(r.state.as_str())
                .bind(1_i64)
                .bind(r.lease_expires_at.map(Timestamp::as_millis))
                .bind(r.now.as_millis())
                .bind(r.now.as_millis())
                .bind(r.expires_at.as_millis())
                .bind(r.sealed_key.as_deref())
                .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
                .bind(r.first_sent.map(Timestamp::as_millis));
        }
        let inserted = self.write_group(statement).await;
        let from_group = |record: &NewRecord| match &inserted {
            Ok(inserted) => Some(Ok(if inserted.contains(&record.id) {
                Inserted::Owned
            } else {
                Inserted::Conflict
            })),
            Err(e) => busy_for_each(e, rows.len()).map(Err),
        };
        group::answer_each(&records, &in_group, from_group, |r| self.insert_alone(r)).await
    }

    /// One `UPDATE … FROM (VALUES …) RETURNING` in one turn of the writer, each answered as
    /// [`complete`](Store::complete) would be: `true` where the row still carried the
    /// owner's token. Busy: each gets busy; any other failure wrote nothing: each is
    /// written again alone.
    async fn complete_group(&self, group: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        let (rows, in_group) = group::plan(&group, |c| &c.id);
        // The `VALUES` columns are `column1` … `column8`: tenant, key_hash, route, token,
        // status, headers, body, now.
        let sql = format!(
            "UPDATE idemkey_records
                SET state = 'completed', token = token + 1, lease_expires_at = NULL,
                    response_status = c.column5, response_headers = c.column6,
                    response_body = c.column7, updated_at = c.column8
               FROM (VALUES {}) AS c
              WHERE tenant = c.column1 AND key_hash = c.column2 AND route = c.column3
                AND token = c.column4
             RETURNING tenant, key_hash, route",
            value_rows(rows.len(), 8)
        );
        let mut statement = sqlx::query_as(AssertSqlSafe(sql));
        for c in &rows {
            statement = statement
                .bind(&c.id.tenant)
                .bind(&c.id.key_hash[..])
                .bind(&c.id.route)
                .bind(c.token)
                .bind(i32::from(c.response.status))
                .bind(c.response.encode_headers())
                .bind(&c.response.body[..])
                .bind(c.now.as_millis());
        }
        let completed = self.write_group(statement).await;
        let from_group = |c: &Completion| match &completed {
            Ok(completed) => Some(Ok(completed.contains(&c.id))),
            Err(e) => busy_for_each(e, rows.len()).map(Err),
        };
        group::answer_each(&group, &in_group, from_group, |c| self.complete_alone(c)).await
    }
}
