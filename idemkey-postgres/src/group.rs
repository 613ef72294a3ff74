//! External mode's grouped writes: [`GroupWriter`] for [`PgStore`].

use std::collections::HashSet;

use futures::TryStreamExt;
use idemkey_core::{Inserted, NewRecord, RecordId, StoreError};
use idemkey_sqlx::group::{self, Completion, GroupAnswers, GroupWriter};
use sqlx::postgres::{PgConnection, PgQueryResult, PgRow};
use sqlx::{AssertSqlSafe, Either, FromRow};

use crate::PgStore;
use crate::literal::{self, Args, Columns, Sql};
use crate::sqlstate::is_connection_lost;
use crate::statements::{
    DUPLICATE_PREPARED, PREPARE_GROUP, UNDEFINED_PREPARED, bind_completion, bind_new_record, code,
};

/// The grouped reservation: the prepared `idemkey_reserve_group_v2` (`PREPARE_GROUP` in
/// `statements.rs`) with its rows as literal arrays, a column each.
pub(crate) fn reservation_rows(rows: &[&NewRecord]) -> Result<String, StoreError> {
    let execute = literal::query(
        "EXECUTE idemkey_reserve_group_v2($1::text[], $2::bytea[], $3::text[], $4::bytea[],
                 $5::bytea[], $6::text[], $7::bigint[], $8::bigint[], $9::bigint[],
                 $10::bytea[], $11::bytea[], $12::bigint[], $13::bigint[])",
    );
    let columns = rows.iter().fold(Columns::default(), |columns, r| {
        bind_new_record(columns.row(), r)
    });
    columns
        .bind_to(execute)?
        .text()
        .map_err(|e| StoreError::Database(Box::new(e)))
}

/// The grouped completion: the prepared `idemkey_complete_row_v1` (`PREPARE_GROUP` in
/// `statements.rs`) once a row, each its own statement, each looking its row up by its
/// primary key.
pub(crate) fn completion_rows(rows: &[&Completion]) -> Result<Vec<String>, StoreError> {
    rows.iter()
        .map(|c| {
            let start = Sql::new("EXECUTE idemkey_complete_row_v1(");
            let mut sql =
                bind_completion(Args::after(start), &c.id, c.token, &c.response, c.now).finish()?;
            sql.push(")");
            Ok(sql.finish())
        })
        .collect()
}

/// Sends `message` (one or more statements) and collects what each answered.
async fn send(
    conn: &mut PgConnection,
    message: String,
) -> Result<Vec<Either<PgQueryResult, PgRow>>, sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(message))
        .fetch_many(conn)
        .try_collect()
        .await
}

/// Whether `results` is the failure with `sqlstate`.
fn failed_with<T>(results: &Result<T, sqlx::Error>, sqlstate: &str) -> bool {
    results.as_ref().err().and_then(code).as_deref() == Some(sqlstate)
}

impl PgStore {
    /// Sends `kinds` of statements (each returning the keys it wrote) in one message, after
    /// the lock wait: one implicit transaction, autocommitted. The keys each kind's
    /// statements returned.
    async fn write_statements(
        &self,
        kinds: &[Vec<String>],
    ) -> Result<Vec<HashSet<RecordId>>, sqlx::Error> {
        let lock_wait = literal::lock_wait(self.lock_wait);
        // The `SET LOCAL` of the lock wait, and any `PREPARE`s, answer without rows first.
        let mut skip = usize::from(!lock_wait.is_empty());
        let statements: Vec<&str> = kinds.iter().flatten().map(String::as_str).collect();
        let message = lock_wait + &statements.join("; ");
        let kind_of: Vec<usize> = kinds
            .iter()
            .enumerate()
            .flat_map(|(k, statements)| std::iter::repeat_n(k, statements.len()))
            .collect();
        let mut conn = self.pool.acquire().await?;
        // A connection that has not prepared the group's statements (a new one, or one a
        // pooler reset) fails the message before anything commits: it is sent again after
        // the `PREPARE`s. Behind a pooler in transaction mode that may reach a server
        // connection that has them, whose `PREPARE` fails: the message then goes once more.
        // A connection that still lacks one (it has the other: someone deallocated it) is
        // closed, for the pool to open another.
        let mut results = send(&mut conn, message.clone()).await;
        if failed_with(&results, UNDEFINED_PREPARED) {
            let prepare = PREPARE_GROUP.join("; ");
            results = send(&mut conn, format!("{prepare}; {message}")).await;
            if failed_with(&results, DUPLICATE_PREPARED) {
                results = send(&mut conn, message).await;
                if failed_with(&results, UNDEFINED_PREPARED) {
                    conn.close_on_drop();
                }
            } else {
                skip += PREPARE_GROUP.len();
            }
        }
        let results = results?;
        let mut written = vec![Vec::new(); kinds.len()];
        let mut statement: usize = 0;
        for result in results {
            match result {
                Either::Left(_) => statement += 1,
                Either::Right(row) => match statement.checked_sub(skip) {
                    Some(i) if i < kind_of.len() => {
                        written[kind_of[i]].push(FromRow::from_row(&row)?);
                    }
                    _ => {
                        return Err(sqlx::Error::Protocol(
                            "a row from a statement that returns none".into(),
                        ));
                    }
                },
            }
        }
        Ok(written.into_iter().map(group::returned).collect())
    }

    /// `records` answered from what their group's `INSERT` returned ([`Inserted::Owned`]
    /// for the rows it inserted, [`Inserted::Conflict`] for the keys it found taken: the
    /// protocol reads those records). `None`, the statement failed: nobody can tell whose
    /// row failed it, and each reservation is made again alone, which is safe whether or not
    /// the group committed (a reservation that finds its own row is answered as any claim
    /// that finds a record in flight).
    async fn reservations_answered(
        &self,
        records: &[NewRecord],
        in_group: &[bool],
        inserted: Option<&HashSet<RecordId>>,
    ) -> Vec<Result<Inserted, StoreError>> {
        let from_group = |record: &NewRecord| {
            Some(Ok(if inserted?.contains(&record.id) {
                Inserted::Owned
            } else {
                Inserted::Conflict
            }))
        };
        group::answer_each(records, in_group, from_group, |r| self.insert_alone(r)).await
    }

    /// `group` answered from what its `UPDATE` returned: `true` where the row still carried
    /// the owner's token. If the statement failed with an answer from the server (nothing
    /// was committed), each is written again alone, so that each gets its own answer; if
    /// the connection was lost, the group may or may not have committed, and each gets that
    /// error, as a completion alone would.
    async fn completions_answered(
        &self,
        group: &[Completion],
        in_group: &[bool],
        completed: Result<&HashSet<RecordId>, &sqlx::Error>,
    ) -> Vec<Result<bool, StoreError>> {
        let written = in_group.iter().filter(|&&in_group| in_group).count();
        let from_group = |c: &Completion| match completed {
            Ok(completed) => Some(Ok(completed.contains(&c.id))),
            Err(e) if is_connection_lost(e) => Some(Err(StoreError::Unavailable(Box::new(
                std::io::Error::other(format!(
                    "the connection was lost while {written} completions were committed together: {e}"
                )),
            )))),
            Err(_) => None,
        };
        group::answer_each(group, in_group, from_group, |c| self.complete_alone(c)).await
    }
}

impl GroupWriter for PgStore {
    /// One `INSERT` of every row (autocommit).
    async fn insert_group(&self, records: Vec<NewRecord>) -> Vec<Result<Inserted, StoreError>> {
        let (rows, in_group) = group::plan(&records, |r| &r.id);
        // A value PostgreSQL cannot take (a NUL in a text) sends nothing: each alone says whose.
        let inserted = match reservation_rows(&rows) {
            Ok(insert) => self.write_statements(&[vec![insert]]).await.ok(),
            Err(_) => None,
        };
        let inserted = inserted.as_ref().map(|written| &written[0]);
        self.reservations_answered(&records, &in_group, inserted)
            .await
    }

    /// One `UPDATE` a row, all in one message (autocommit).
    ///
    /// Not one `UPDATE` of every row joined to `idemkey_records`: a prepared join's generic
    /// plan, made while the table was still small, scans the whole table (a hash join) and
    /// stays cached on its connection until the table is analyzed, each group then reading
    /// every record; and planning a join with each group costs the database more than the
    /// rows' own statements. A row's own statement names its primary key, which any plan
    /// looks up in the key's index.
    async fn complete_group(&self, group: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        let (rows, in_group) = group::plan(&group, |c| &c.id);
        let Ok(update) = completion_rows(&rows) else {
            // A value PostgreSQL cannot take (a NUL in a text): each alone says whose.
            return group::answer_each(&group, &in_group, |_| None, |c| self.complete_alone(c))
                .await;
        };
        let completed = self.write_statements(&[update]).await;
        let completed = completed.as_ref().map(|written| &written[0]);
        self.completions_answered(&group, &in_group, completed)
            .await
    }

    /// Both kinds in one message: the `INSERT`, then the `UPDATE`s, in one implicit
    /// transaction, so one commit for the group. If it fails, each kind is answered as its
    /// own statement's failure would be (neither committed).
    async fn write_groups(
        &self,
        records: Vec<NewRecord>,
        completions: Vec<Completion>,
    ) -> GroupAnswers {
        if records.is_empty() || completions.is_empty() {
            return (
                group::reserve(self, records).await,
                group::complete(self, completions).await,
            );
        }
        let (reservations, reserved) = group::plan(&records, |r| &r.id);
        let (rows, completing) = group::plan(&completions, |c| &c.id);
        let (Ok(insert), Ok(update)) = (reservation_rows(&reservations), completion_rows(&rows))
        else {
            // A value PostgreSQL cannot take: each kind on its own says whose.
            return (
                self.insert_group(records).await,
                self.complete_group(completions).await,
            );
        };
        let written = self.write_statements(&[vec![insert], update]).await;
        let (inserted, completed) = match &written {
            Ok(written) => (Some(&written[0]), Ok(&written[1])),
            Err(e) => (None, Err(e)),
        };
        (
            self.reservations_answered(&records, &reserved, inserted)
                .await,
            self.completions_answered(&completions, &completing, completed)
                .await,
        )
    }
}
