//! SQL literals: every statement the store sends goes as one simple-query message, its
//! values written into the text.
//!
//! - The extended protocol that carries bound parameters answers each statement before the
//!   next is sent, so it cannot put two in one round trip.
//! - sqlx parses a bound statement and executes it in two exchanges, each ended by its own
//!   `Sync`. Behind a pooler in transaction mode (PgBouncer's `pool_mode = transaction`), a
//!   statement outside a transaction may be parsed on one server connection and executed on
//!   another, where the name (or the unnamed statement) means another client's statement; a
//!   named statement sqlx keeps for the next call is, after the transaction, on a server
//!   connection this client no longer holds. One message is one exchange on one server
//!   connection, in a transaction or not.
//!
//! Only values this crate builds go through here, and each is written so that nothing in it
//! can end the literal: text as an escape string (`E'…'`, with `\` and `'` doubled, which
//! reads the same whatever `standard_conforming_strings` says), bytes as hex digits in one
//! (`E'\\x…'::bytea`), numbers as digits (a negative one in parentheses).

use std::fmt::Write;
use std::marker::PhantomData;
use std::time::Duration;

use idemkey_core::{NewRecord, RecordId, StoreError, StoredResponse, Timestamp};
use sqlx::postgres::{PgQueryResult, PgRow};
use sqlx::{AssertSqlSafe, Executor, FromRow, Postgres, Row};

use crate::statements::{bind_completion, bind_new_record};

/// A statement being written, value by value.
#[derive(Debug, Default)]
pub(crate) struct Sql(String);

impl Sql {
    pub(crate) fn new(start: &str) -> Self {
        Self(start.to_owned())
    }

    /// Appends SQL text of this crate's own (never a value).
    pub(crate) fn push(&mut self, sql: &str) -> &mut Self {
        self.0.push_str(sql);
        self
    }

    /// A text value. PostgreSQL text cannot hold NUL, so a value with one is refused, as the
    /// server would refuse it bound.
    pub(crate) fn text(&mut self, value: &str) -> Result<&mut Self, StoreError> {
        if value.contains('\0') {
            return Err(StoreError::Database(
                "a text value contains a NUL character, which PostgreSQL cannot store".into(),
            ));
        }
        self.0.reserve(value.len() + 3);
        self.0.push_str("E'");
        for c in value.chars() {
            match c {
                '\'' => self.0.push_str("''"),
                '\\' => self.0.push_str("\\\\"),
                c => self.0.push(c),
            }
        }
        self.0.push('\'');
        Ok(self)
    }

    /// A `bytea` value, in the type's hex input format.
    pub(crate) fn bytes(&mut self, value: &[u8]) -> &mut Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        self.0.reserve(value.len() * 2 + 16);
        self.0.push_str("E'\\\\x");
        for &b in value {
            self.0.push(char::from(DIGITS[usize::from(b >> 4)]));
            self.0.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
        self.0.push_str("'::bytea");
        self
    }

    /// An integer.
    pub(crate) fn int(&mut self, value: i64) -> &mut Self {
        let _ = write!(self.0, "{value}");
        self
    }

    pub(crate) fn finish(self) -> String {
        self.0
    }
}

/// `SET LOCAL lock_timeout` to `wait`, and `; ` (nothing for `None`): sent first in a
/// message outside a transaction, it holds for the rest of the message.
pub(crate) fn lock_wait(wait: Option<Duration>) -> String {
    wait.map_or_else(String::new, |wait| {
        format!("SET LOCAL lock_timeout = '{}ms'; ", wait.as_millis().max(1))
    })
}

/// The claim's message: `start` (`BEGIN` and the transaction's lock wait), then `record`'s
/// claim, the prepared `idemkey_claim_v3` (`PREPARE` in `statements.rs`), in the
/// transaction it began.
pub(crate) fn claim(mut start: Sql, record: &NewRecord) -> Result<String, StoreError> {
    start.push("; EXECUTE idemkey_claim_v3(");
    let mut sql = bind_new_record(Args::after(start), record).finish()?;
    sql.push(")");
    Ok(sql.finish())
}

/// The completion sent with `COMMIT`: the prepared `idemkey_complete_v1` (`PREPARE` in
/// `statements.rs`), which fails, and so skips the `COMMIT` after it, unless it matched the
/// owner's row.
pub(crate) fn completion(
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> Result<String, StoreError> {
    let start = Sql::new("EXECUTE idemkey_complete_v1(");
    let mut sql = bind_completion(Args::after(start), id, token, response, now).finish()?;
    sql.push(")");
    Ok(sql.finish())
}

/// Where values go, one after the other: a statement's `$1`, `$2`, … ([`Statement`]), a
/// list of arguments ([`Args`]), or a group's columns ([`Columns`]). The values of a record
/// and of a completion are bound in one place each (`statements.rs`), whatever the shape.
pub(crate) trait Bind: Sized {
    /// Binds the next value.
    fn bind(self, value: impl Literal) -> Self;

    /// Binds a record's identity: tenant, key hash, route.
    fn bind_id(self, id: &RecordId) -> Self {
        self.bind(id.tenant.as_str())
            .bind(&id.key_hash[..])
            .bind(id.route.as_str())
    }
}

/// Values written after a statement's text, `, ` between them: a prepared statement's
/// arguments, or a row of `VALUES`.
pub(crate) struct Args {
    sql: Sql,
    first: bool,
    refused: Option<StoreError>,
}

impl Args {
    /// Values appended to `sql`, which ends where the first goes.
    pub(crate) fn after(sql: Sql) -> Self {
        Self {
            sql,
            first: true,
            refused: None,
        }
    }

    /// The statement with its values, or why one of them could not be written.
    pub(crate) fn finish(self) -> Result<Sql, StoreError> {
        match self.refused {
            Some(refused) => Err(refused),
            None => Ok(self.sql),
        }
    }
}

impl Bind for Args {
    fn bind(mut self, value: impl Literal) -> Self {
        if !self.first {
            self.sql.push(", ");
        }
        self.first = false;
        if let Err(e) = value.write(&mut self.sql) {
            self.refused.get_or_insert(e);
        }
        self
    }
}

/// Rows bound value by value and sent column by column, each column an array, for a
/// statement that takes its rows so (`unnest($1::text[], …)`).
#[derive(Default)]
pub(crate) struct Columns {
    columns: Vec<Array<Written>>,
    at: usize,
    refused: Option<StoreError>,
}

impl Columns {
    /// Starts the next row: its first value goes to the first column.
    pub(crate) fn row(mut self) -> Self {
        self.at = 0;
        self
    }

    /// Binds each column, in order, to `statement`; or says why a value could not be
    /// written (nothing is then sent).
    pub(crate) fn bind_to<B: Bind>(self, statement: B) -> Result<B, StoreError> {
        if let Some(refused) = self.refused {
            return Err(refused);
        }
        Ok(self
            .columns
            .into_iter()
            .fold(statement, |s, column| s.bind(column)))
    }
}

impl Bind for Columns {
    fn bind(mut self, value: impl Literal) -> Self {
        let mut sql = Sql::default();
        if let Err(e) = value.write(&mut sql) {
            self.refused.get_or_insert(e);
        }
        if self.columns.len() == self.at {
            self.columns.push(Array(Vec::new()));
        }
        self.columns[self.at].0.push(Written(sql.finish()));
        self.at += 1;
        self
    }
}

/// A value already written as a literal (by its own [`Literal`] impl).
pub(crate) struct Written(String);

impl Literal for Written {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.push(&self.0);
        Ok(())
    }
}

/// A value written into a statement by [`Statement::bind`].
pub(crate) trait Literal {
    /// Appends the value to `sql`.
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError>;
}

impl Literal for str {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.text(self).map(drop)
    }
}

impl Literal for String {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.text(self).map(drop)
    }
}

impl Literal for [u8] {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.bytes(self);
        Ok(())
    }
}

impl<const N: usize> Literal for [u8; N] {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.bytes(self);
        Ok(())
    }
}

impl Literal for Vec<u8> {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.bytes(self);
        Ok(())
    }
}

impl Literal for i64 {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        match *self {
            // Not `-9223372036854775808`: that is the numeric 9223372036854775808 negated, and
            // a comparison of a `bigint` column with a numeric cannot use the column's index.
            i64::MIN => sql.push("(-9223372036854775807 - 1)"),
            v if v < 0 => sql.push("(").int(v).push(")"),
            v => sql.int(v),
        };
        Ok(())
    }
}

impl Literal for i32 {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        i64::from(*self).write(sql)
    }
}

impl<T: Literal + ?Sized> Literal for &T {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        (**self).write(sql)
    }
}

impl<T: Literal> Literal for Option<T> {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        match self {
            Some(value) => value.write(sql),
            None => {
                sql.push("NULL");
                Ok(())
            }
        }
    }
}

/// An array of values, `ARRAY[…]`; the statement casts it to its type (`$1::text[]`).
pub(crate) struct Array<T>(pub(crate) Vec<T>);

impl<T: Literal> Literal for Array<T> {
    fn write(&self, sql: &mut Sql) -> Result<(), StoreError> {
        sql.push("ARRAY[");
        for (i, value) in self.0.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            value.write(sql)?;
        }
        sql.push("]");
        Ok(())
    }
}

/// A statement of this crate's own with `$1`, `$2`, … where its values go, as sqlx's
/// `query` takes it, sent as one simple-query message with the values written in
/// ([`Literal`]). The rows come back in text format, which sqlx decodes as it does binary.
pub(crate) struct Statement {
    sql: &'static str,
    values: Vec<String>,
    refused: Option<StoreError>,
}

/// A [`Statement`] whose rows are read as `T`.
pub(crate) struct StatementAs<T> {
    statement: Statement,
    row: PhantomData<fn() -> T>,
}

/// A [`Statement`] whose rows' first columns are read as `T`.
pub(crate) struct StatementScalar<T> {
    statement: Statement,
    value: PhantomData<fn() -> T>,
}

/// `sql` with its values to come ([`Statement::bind`]).
pub(crate) fn query(sql: &'static str) -> Statement {
    Statement {
        sql,
        values: Vec::new(),
        refused: None,
    }
}

/// `sql`, each row read as `T`.
pub(crate) fn query_as<T>(sql: &'static str) -> StatementAs<T> {
    StatementAs {
        statement: query(sql),
        row: PhantomData,
    }
}

/// `sql`, each row's first column read as `T`.
pub(crate) fn query_scalar<T>(sql: &'static str) -> StatementScalar<T> {
    StatementScalar {
        statement: query(sql),
        value: PhantomData,
    }
}

impl Statement {
    /// The next value (`$1` first). A value PostgreSQL cannot take (a NUL in a text) fails
    /// the statement before anything is sent.
    pub(crate) fn bind(mut self, value: impl Literal) -> Self {
        let mut sql = Sql::default();
        match value.write(&mut sql) {
            Ok(()) => self.values.push(sql.finish()),
            Err(e) => {
                self.refused.get_or_insert(e);
                self.values.push(String::new());
            }
        }
        self
    }

    /// The statement's text, each `$n` replaced by its value.
    pub(crate) fn text(self) -> Result<String, sqlx::Error> {
        if let Some(refused) = self.refused {
            return Err(sqlx::Error::Encode(Box::new(refused)));
        }
        let mut text = String::with_capacity(
            self.sql.len() + self.values.iter().map(String::len).sum::<usize>(),
        );
        let mut rest = self.sql;
        while let Some(at) = rest.find('$') {
            text.push_str(&rest[..at]);
            let digits = rest[at + 1..]
                .find(|c: char| !c.is_ascii_digit())
                .map_or(rest.len() - at - 1, |end| end);
            let n: usize = rest[at + 1..at + 1 + digits].parse().map_err(|_| {
                sqlx::Error::Protocol(format!("a `$` without a number in: {}", self.sql))
            })?;
            let value = n.checked_sub(1).and_then(|i| self.values.get(i));
            let value = value.ok_or_else(|| {
                sqlx::Error::Protocol(format!("no value for ${n} in: {}", self.sql))
            })?;
            text.push_str(value);
            rest = &rest[at + 1 + digits..];
        }
        text.push_str(rest);
        Ok(text)
    }

    pub(crate) async fn execute<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<PgQueryResult, sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(self.text()?))
            .execute(conn)
            .await
    }

    pub(crate) async fn fetch_all<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(self.text()?))
            .fetch_all(conn)
            .await
    }

    pub(crate) async fn fetch_optional<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(self.text()?))
            .fetch_optional(conn)
            .await
    }

    pub(crate) async fn fetch_one<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<PgRow, sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(self.text()?))
            .fetch_one(conn)
            .await
    }
}

impl<T: for<'r> FromRow<'r, PgRow>> StatementAs<T> {
    pub(crate) fn bind(mut self, value: impl Literal) -> Self {
        self.statement = self.statement.bind(value);
        self
    }

    pub(crate) async fn fetch_all<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<Vec<T>, sqlx::Error> {
        let rows = self.statement.fetch_all(conn).await?;
        rows.iter().map(T::from_row).collect()
    }

    pub(crate) async fn fetch_optional<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<Option<T>, sqlx::Error> {
        let row = self.statement.fetch_optional(conn).await?;
        row.as_ref().map(T::from_row).transpose()
    }

    pub(crate) async fn fetch_one<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<T, sqlx::Error> {
        T::from_row(&self.statement.fetch_one(conn).await?)
    }
}

impl<T> StatementScalar<T>
where
    T: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    pub(crate) fn bind(mut self, value: impl Literal) -> Self {
        self.statement = self.statement.bind(value);
        self
    }

    pub(crate) async fn fetch_optional<'c>(
        self,
        conn: impl Executor<'c, Database = Postgres>,
    ) -> Result<Option<T>, sqlx::Error> {
        let row = self.statement.fetch_optional(conn).await?;
        row.map(|row| row.try_get(0)).transpose()
    }
}

impl Bind for Statement {
    fn bind(self, value: impl Literal) -> Self {
        Statement::bind(self, value)
    }
}

impl<T: for<'r> FromRow<'r, PgRow>> Bind for StatementAs<T> {
    fn bind(self, value: impl Literal) -> Self {
        StatementAs::bind(self, value)
    }
}

impl<T> Bind for StatementScalar<T>
where
    T: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    fn bind(self, value: impl Literal) -> Self {
        StatementScalar::bind(self, value)
    }
}

#[cfg(test)]
mod tests;
