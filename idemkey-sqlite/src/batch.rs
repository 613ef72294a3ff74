//! The claim and the completion sent as one string each: their SQL, with values written
//! as literals or bound by number, and how the completion's guard refuses.

use idemkey_core::NewRecord;

use crate::params::{self, Value};
use crate::sql;

/// What [`SqliteStore::begin_claim`] sends: `BEGIN IMMEDIATE` and the claim's `INSERT`, in
/// one string run by `sqlite3_exec`, which takes no bound parameters, so the values are
/// written out as SQL literals (text quoted, bytes in hex). A plain `INSERT` (no
/// `ON CONFLICT`): a taken key fails it with a constraint error, which ends that statement
/// only, not the transaction. `None` for text with a NUL, which a C string cannot carry: such
/// a claim goes step by step, with bound parameters.
///
/// [`SqliteStore::begin_claim`]: idemkey_core::Store::begin_claim
pub(crate) fn claim_statement(r: &NewRecord) -> Option<String> {
    let row = params::inserted_row(r);
    // The column `fingerprint_members`, the one value that can be long.
    let members = match &row[12] {
        Value::Owned(members) => members.len(),
        _ => 0,
    };
    let mut sql = Literals(String::with_capacity(640 + 2 * members));
    sql.push(
        "BEGIN IMMEDIATE; \
         INSERT INTO idemkey_records \
             (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token, \
              lease_expires_at, created_at, updated_at, expires_at, sealed_key, \
              fingerprint_members, first_sent) \
         VALUES (",
    );
    for (i, value) in row.iter().enumerate() {
        if i > 0 {
            sql.push(", ");
        }
        sql.value(value)?;
    }
    sql.push(")");
    Some(sql.0)
}

/// SQL text with values written into it as literals.
struct Literals(String);

impl Literals {
    /// `value` as a literal; `None` for text with a NUL.
    fn value(&mut self, value: &Value<'_>) -> Option<&mut Self> {
        Some(match value {
            Value::Null => self.push("NULL"),
            Value::Int(n) => self.int(*n),
            Value::Text(text) => self.text(text)?,
            Value::Bytes(bytes) => self.bytes(bytes),
            Value::Owned(bytes) => self.bytes(bytes),
            Value::Parts(parts) => self.bytes(parts),
        })
    }

    fn push(&mut self, sql: &str) -> &mut Self {
        self.0.push_str(sql);
        self
    }

    /// A quoted string (`'` doubled; SQLite has no other escapes); `None` if it holds a NUL.
    fn text(&mut self, text: &str) -> Option<&mut Self> {
        if text.contains('\0') {
            return None;
        }
        self.0.push('\'');
        for (i, part) in text.split('\'').enumerate() {
            if i > 0 {
                self.0.push_str("''");
            }
            self.0.push_str(part);
        }
        self.0.push('\'');
        Some(self)
    }

    /// A blob literal, `X'…'`.
    fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.0.reserve(bytes.len() * 2 + 3);
        self.0.push_str("X'");
        for b in bytes {
            self.0.push(char::from(HEX[usize::from(b >> 4)]));
            self.0.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        self.0.push('\'');
        self
    }

    fn int(&mut self, n: i64) -> &mut Self {
        use std::fmt::Write as _;
        let _ = write!(self.0, "{n}");
        self
    }
}

/// What [`SqliteStore::complete_and_commit`] sends, in one call with bound parameters (sqlx
/// binds `?N` by number across the statements of one string): the completion, a guard, then
/// `COMMIT; BEGIN` (see `SqliteTransaction::commit_batch`). The guard refuses, with a
/// constraint error, a row in a one-column TEMP table whenever the completion changed no row
/// (`changes()`: the rows of the last `INSERT`, `UPDATE` or `DELETE` that completed): the
/// error stops the string there, before the `COMMIT`, and leaves the transaction open to be
/// rolled back. When the completion did change its row, the guard inserts nothing. The table
/// is created, empty, on each connection's first completion, in its transaction.
///
/// [`SqliteStore::complete_and_commit`]: idemkey_core::Store::complete_and_commit
pub(crate) const COMPLETE_AND_COMMIT: &str = concat!(
    "CREATE TEMP TABLE IF NOT EXISTS idemkey_fence (
    matched INTEGER, CONSTRAINT idemkey_fenced CHECK (matched = 1));
",
    sql::complete_sql!(),
    ";
INSERT INTO temp.idemkey_fence (matched) SELECT changes() WHERE changes() <> 1;
COMMIT;
BEGIN"
);

/// The statements of [`COMPLETE_AND_COMMIT`] before its `COMMIT`.
pub(crate) const BEFORE_COMMIT: usize = 3;

/// Where the completion and its guard are among the statements of [`COMPLETE_AND_COMMIT`].
const COMPLETION: usize = 1;
const GUARD: usize = 2;

/// SQLITE_CONSTRAINT_CHECK, what the guard's refusal is.
const CONSTRAINT_CHECK: &str = "275";

/// Whether [`COMPLETE_AND_COMMIT`] was stopped by its guard, from the rows each statement
/// that completed changed (`changed`) and the error that stopped it: the completion ran and
/// changed no row, and the next statement, the guard, failed its check. Told by the
/// completion's own count and the error's code, never by a message.
pub(crate) fn is_fenced(changed: &[u64], e: &sqlx::Error) -> bool {
    changed.len() == GUARD
        && changed[COMPLETION] == 0
        && matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(CONSTRAINT_CHECK))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rusqlite::Connection;
    use rusqlite::types::Value as Read;

    use super::Literals;
    use crate::params::Value;

    /// What SQLite reads `literal` as.
    fn read(literal: &str) -> Read {
        let conn = Connection::open_in_memory().unwrap();
        conn.query_row(&format!("SELECT {literal}"), [], |r| r.get(0))
            .unwrap()
    }

    fn literal(write: impl FnOnce(&mut Literals) -> Option<&mut Literals>) -> Option<String> {
        let mut sql = Literals(String::new());
        write(&mut sql)?;
        Some(sql.0)
    }

    #[test]
    fn extreme_integers_are_read_back_as_written() {
        for n in [i64::MIN, -1, 0, i64::MAX] {
            let literal = literal(|sql| Some(sql.int(n))).unwrap();
            assert_eq!(read(&literal), Read::Integer(n), "{literal}");
        }
    }

    proptest! {
        /// Any text without a NUL, quotes and all, is read back as written; text with a
        /// NUL is refused rather than cut short.
        #[test]
        fn text_is_read_back_as_written(text in any::<String>()) {
            match literal(|sql| sql.value(&Value::Text(&text))) {
                Some(literal) => prop_assert_eq!(read(&literal), Read::Text(text)),
                None => prop_assert!(text.contains('\0')),
            }
        }

        /// Text made of quotes and the characters around them, which the escaping is about.
        #[test]
        fn quoted_text_is_read_back_as_written(text in "[\'\"; a\\-]{0,40}") {
            let literal = literal(|sql| sql.value(&Value::Text(&text))).unwrap();
            prop_assert_eq!(read(&literal), Read::Text(text));
        }

        #[test]
        fn bytes_are_read_back_as_written(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let literal = literal(|sql| sql.value(&Value::Bytes(&bytes))).unwrap();
            prop_assert_eq!(read(&literal), Read::Blob(bytes));
        }

        #[test]
        fn integers_are_read_back_as_written(n in any::<Option<i64>>()) {
            let literal = literal(|sql| sql.value(&n.map_or(Value::Null, Value::Int))).unwrap();
            prop_assert_eq!(read(&literal), n.map_or(Read::Null, Read::Integer));
        }
    }
}
