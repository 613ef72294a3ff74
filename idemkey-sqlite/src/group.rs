//! External mode's grouped writes, [`GroupWriter`] for both SQLite stores (their impls, in
//! `forward.rs`, call this): which rows go in a group and who gets which answer are written
//! once here ([`insert_group`], [`complete_group`]); each store only keeps its queue and
//! writes a group ([`WritesGroups`]): [`SqliteStore`] as
//! one multi-row statement (one hand-off to sqlx's worker thread),
//! [`RusqliteStore`](crate::RusqliteStore) as the rows one by one in one transaction
//! (`rusqlite_group.rs`).

use std::collections::HashSet;
use std::future::Future;

use idemkey_core::{Inserted, NewRecord, RecordId, Store, StoreError};
use idemkey_sqlx::group::{self, Completion, GroupWriter, GroupedWrites};
use sqlx::AssertSqlSafe;
use sqlx::sqlite::SqliteArguments;

use crate::SqliteStore;
use crate::driver::arguments;
use crate::params;
use crate::store::error;

/// How a store writes a group of two or more, in one turn of the writer, all or nothing.
pub(crate) trait WritesGroups: GroupWriter {
    /// The store's queue of external-mode writes, shared by its clones.
    fn grouped(&self) -> &GroupedWrites;

    /// Inserts `rows` (`INSERT … ON CONFLICT DO NOTHING`): the keys it inserted.
    fn write_inserts(
        &self,
        rows: &[&NewRecord],
    ) -> impl Future<Output = Result<HashSet<RecordId>, StoreError>> + Send;

    /// Completes `rows` where they still carry the owner's token: the keys it completed.
    fn write_completions(
        &self,
        rows: &[&Completion],
    ) -> impl Future<Output = Result<HashSet<RecordId>, StoreError>> + Send;
}

/// [`GroupWriter::insert_group`]: answered [`Inserted::Owned`] for the rows the group
/// inserted and [`Inserted::Conflict`] for the keys it found taken (the protocol reads those
/// records). Busy: each gets busy. Any other failure wrote nothing: each is made again
/// alone.
pub(crate) async fn insert_group<S: WritesGroups>(
    store: &S,
    records: Vec<NewRecord>,
) -> Vec<Result<Inserted, StoreError>> {
    let (rows, in_group) = group::plan(&records, |r| &r.id);
    let inserted = store.write_inserts(&rows).await;
    let from_group = |r: &NewRecord| {
        answer(&inserted, &r.id, rows.len(), |owned| {
            if owned {
                Inserted::Owned
            } else {
                Inserted::Conflict
            }
        })
    };
    group::answer_each(&records, &in_group, from_group, |r| store.insert_alone(r)).await
}

/// [`GroupWriter::complete_group`]: each answered as [`complete`](Store::complete) would
/// be, `true` where the row still carried the owner's token. Busy: each gets busy; any
/// other failure wrote nothing: each is written again alone.
pub(crate) async fn complete_group<S: WritesGroups>(
    store: &S,
    completions: Vec<Completion>,
) -> Vec<Result<bool, StoreError>> {
    let (rows, in_group) = group::plan(&completions, |c| &c.id);
    let completed = store.write_completions(&rows).await;
    let from_group = |c: &Completion| answer(&completed, &c.id, rows.len(), |done| done);
    group::answer_each(&completions, &in_group, from_group, |c| {
        store.complete_alone(c)
    })
    .await
}

/// One write's answer from its group's: `written` says whether the group wrote `id`'s row.
/// `None`: the write is made again alone.
fn answer<T>(
    written: &Result<HashSet<RecordId>, StoreError>,
    id: &RecordId,
    writes: usize,
    answer: impl FnOnce(bool) -> T,
) -> Option<Result<T, StoreError>> {
    match written {
        Ok(written) => Some(Ok(answer(written.contains(id)))),
        Err(e) => busy_for_each(e, writes).map(Err),
    }
}

/// A grouped statement that SQLite refused as busy wrote nothing (another process held
/// the write lock past the busy time-out): each of its writers gets that answer, as it
/// would alone, rather than each waiting again in turn.
fn busy_for_each(e: &StoreError, writes: usize) -> Option<StoreError> {
    let StoreError::Busy(source) = e else {
        return None;
    };
    Some(StoreError::Busy(Box::new(std::io::Error::other(format!(
        "a group of {writes} writes: {source}"
    )))))
}

/// `values` rows of `width` parameters each: `(?, ?), (?, ?)` for 2 and 2, bound in order.
/// Anonymous: sqlx asks SQLite the name of every parameter it binds, and SQLite finds a
/// numbered one by walking the statement's list of names, which a group's hundreds of
/// `?NNN` made quadratic in the group's size.
fn value_rows(values: usize, width: usize) -> String {
    let row = format!("({})", vec!["?"; width].join(", "));
    vec![row; values].join(", ")
}

impl SqliteStore {
    /// `sql` with `args` on the writer, in one turn (autocommit: one statement, one
    /// transaction): the keys it returned.
    async fn write_group(
        &self,
        sql: String,
        args: Result<SqliteArguments, sqlx::Error>,
    ) -> Result<HashSet<RecordId>, StoreError> {
        let statement = sqlx::query_as_with(AssertSqlSafe(sql), args.map_err(error)?);
        let mut conn = self.acquire_for_write().await?;
        let rows = statement.fetch_all(&mut *conn).await.map_err(error)?;
        Ok(group::returned(rows))
    }
}

/// One statement per group, in one turn of the writer.
impl WritesGroups for SqliteStore {
    fn grouped(&self) -> &GroupedWrites {
        &self.grouped
    }

    /// One multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING`.
    async fn write_inserts(&self, rows: &[&NewRecord]) -> Result<HashSet<RecordId>, StoreError> {
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
        let args = (|| {
            let mut args = SqliteArguments::default();
            for r in rows {
                arguments(params::inserted_row(r), &mut args)?;
            }
            Ok(args)
        })();
        self.write_group(sql, args).await
    }

    /// One `UPDATE … FROM (VALUES …) RETURNING`.
    async fn write_completions(
        &self,
        rows: &[&Completion],
    ) -> Result<HashSet<RecordId>, StoreError> {
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
        let args = (|| {
            let mut args = SqliteArguments::default();
            for c in rows {
                arguments(
                    params::completion(&c.id, c.token, &c.response, c.now),
                    &mut args,
                )?;
            }
            Ok(args)
        })();
        self.write_group(sql, args).await
    }
}
