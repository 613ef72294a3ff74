//! External mode's grouped writes: [`GroupWriter`] for [`PgStore`].

use idemkey_core::{Inserted, NewRecord, StoreError};
use idemkey_sqlx::group::{self, Completion, GroupWriter};
use sqlx::{AssertSqlSafe, FromRow};

use crate::PgStore;
use crate::literal::{self, Args, Columns, Sql};
use crate::sqlstate::is_connection_lost;
use crate::statements::{bind_completion, bind_record};

/// The grouped completion's `UPDATE`, its rows as literals (see
/// [`GroupWriter::complete_group`]).
pub(crate) fn completion_rows(rows: &[&Completion]) -> Result<String, StoreError> {
    let mut sql = Sql::new(
        "UPDATE idemkey_records AS r
            SET state = 'completed', token = r.token + 1, lease_expires_at = NULL,
                response_status = c.status, response_headers = c.headers,
                response_body = c.body, updated_at = c.now
           FROM (VALUES ",
    );
    for (i, c) in rows.iter().enumerate() {
        sql.push(if i == 0 { "(" } else { ", (" });
        sql = bind_completion(Args::after(sql), &c.id, c.token, &c.response, c.now).finish()?;
        sql.push(")");
    }
    sql.push(
        ") AS c (tenant, key_hash, route, token, status, headers, body, now)
          WHERE r.tenant = c.tenant AND r.key_hash = c.key_hash AND r.route = c.route
            AND r.token = c.token
         RETURNING r.tenant, r.key_hash, r.route",
    );
    Ok(sql.finish())
}

impl GroupWriter for PgStore {
    /// One `INSERT` of every row (autocommit), answered [`Inserted::Owned`] for the rows it
    /// inserted and [`Inserted::Conflict`] for the keys it found taken (the protocol reads
    /// those records). If the statement fails, nobody can tell whose row failed it: each
    /// reservation is made again alone, which is safe whether or not the group committed (a
    /// reservation that finds its own row is answered as any claim that finds a record in
    /// flight).
    async fn insert_group(&self, records: Vec<NewRecord>) -> Vec<Result<Inserted, StoreError>> {
        let (rows, in_group) = group::plan(&records, |r| &r.id);
        let insert = literal::query_as::<(String, Vec<u8>, String)>(
            "INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint,
                    fingerprint_parts, state, token, lease_expires_at, created_at, updated_at,
                    expires_at, sealed_key, fingerprint_members, first_sent)
             SELECT tenant, key_hash, route, fingerprint, parts, state, 1, lease, created,
                    created, expires, sealed, members, first_sent
               FROM unnest($1::text[], $2::bytea[], $3::text[], $4::bytea[], $5::bytea[],
                           $6::text[], $7::bigint[], $8::bigint[], $9::bigint[],
                           $10::bytea[], $11::bytea[], $12::bigint[])
                    WITH ORDINALITY AS r (tenant, key_hash, route, fingerprint, parts, state,
                                          lease, created, expires, sealed, members,
                                          first_sent, n)
              ORDER BY n
             ON CONFLICT (tenant, key_hash, route) DO NOTHING
             RETURNING tenant, key_hash, route",
        )
        .lock_wait(self.lock_wait);
        let columns = rows.iter().fold(Columns::default(), |columns, r| {
            bind_record(columns.row(), r)
        });
        // A value PostgreSQL cannot take (a NUL in a text) sends nothing: each alone says whose.
        let inserted = match columns.bind_to(insert) {
            Ok(insert) => insert.fetch_all(&self.pool).await.ok().map(group::returned),
            Err(_) => None,
        };
        let from_group = |record: &NewRecord| {
            let inserted = inserted.as_ref()?;
            Some(Ok(if inserted.contains(&record.id) {
                Inserted::Owned
            } else {
                Inserted::Conflict
            }))
        };
        group::answer_each(&records, &in_group, from_group, |r| self.insert_alone(r)).await
    }

    /// One `UPDATE` of every row (autocommit), each answered as
    /// [`complete`](idemkey_core::Store::complete) would be: `true` where the row still carried the
    /// owner's token. If the statement failed with an answer from the server (nothing was
    /// committed), each is written again alone, so that each gets its own answer; if the
    /// connection was lost, the group may or may not have committed, and each gets that
    /// error, as a completion alone would.
    ///
    /// The rows go as literal `VALUES` in a simple query, not as bound arrays to a
    /// prepared statement: the `UPDATE` joins them to `idemkey_records`, and a prepared
    /// statement's generic plan, made while the table was still small, joins by scanning
    /// the whole table (a hash join) and stays cached on its connection until the table is
    /// analyzed, each group then reading every record. Planned with the rows and the table
    /// as they are, the join looks each row up by its primary key.
    async fn complete_group(&self, group: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        let (rows, in_group) = group::plan(&group, |c| &c.id);
        let alone = |c| self.complete_alone(c);
        let Ok(sql) = completion_rows(&rows) else {
            // A value PostgreSQL cannot take (a NUL in a text): each alone says whose.
            return group::answer_each(&group, &in_group, |_| None, alone).await;
        };
        let sql = literal::lock_wait(self.lock_wait) + &sql;
        let completed = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .and_then(|rows| rows.iter().map(FromRow::from_row).collect())
            .map(group::returned);
        let written = rows.len();
        let from_group = |c: &Completion| match &completed {
            Ok(completed) => Some(Ok(completed.contains(&c.id))),
            Err(e) if is_connection_lost(e) => Some(Err(StoreError::Unavailable(Box::new(
                std::io::Error::other(format!(
                    "the connection was lost while {written} completions were committed together: {e}"
                )),
            )))),
            Err(_) => None,
        };
        group::answer_each(&group, &in_group, from_group, alone).await
    }
}
