//! sqlx errors as [`StoreError`]s. What an error's kind says is the same for every dialect;
//! what its code says is the store's to tell (a [`Code`] for each code, from its dialect),
//! never its message.

use idemkey_core::{BoxError, StoreError};
use sqlx::error::DatabaseError;

/// What a database's own error code says, as a store's dialect reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// A lock was not granted in time (or a transaction lost a conflict): the statement may
    /// be tried again. [`StoreError::Busy`].
    Busy,
    /// The server ended the session: the connection is gone. [`StoreError::Unavailable`].
    ConnectionLost,
    /// Anything else: the statement was refused. [`StoreError::Database`].
    Other,
}

/// Classifies a sqlx error. `code` reads the database's own error code (its SQLSTATE).
pub fn classify_error(error: sqlx::Error, code: impl Fn(&str) -> Code) -> StoreError {
    classify_error_by(error, by_sqlstate(code))
}

/// Classifies a sqlx error, `code` reading the database's error itself: for a dialect whose
/// telling code is not the SQLSTATE (MySQL's error numbers, which the driver's own error
/// type carries).
pub fn classify_error_by(
    error: sqlx::Error,
    code: impl Fn(&dyn DatabaseError) -> Code,
) -> StoreError {
    use sqlx::Error as E;
    match error {
        E::Database(db) => match code(&*db) {
            Code::Busy => StoreError::Busy(Box::new(E::Database(db))),
            Code::ConnectionLost => StoreError::Unavailable(Box::new(E::Database(db))),
            Code::Other => StoreError::Database(Box::new(E::Database(db))),
        },
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
/// ended the session: [`Code::ConnectionLost`], as `code` reads the database's error code),
/// as opposed to a refused statement, a pool time-out or a closed pool. Classified by kind
/// and code, never by message. A store may retry a statement that has no effect of its own
/// (`BEGIN`) on another connection after such an error.
pub fn is_connection_lost(error: &sqlx::Error, code: impl Fn(&str) -> Code) -> bool {
    is_connection_lost_by(error, by_sqlstate(code))
}

/// [`is_connection_lost`], `code` reading the database's error itself, as for
/// [`classify_error_by`].
pub fn is_connection_lost_by(
    error: &sqlx::Error,
    code: impl Fn(&dyn DatabaseError) -> Code,
) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => code(&**db) == Code::ConnectionLost,
        _ => false,
    }
}

/// A reader of a database error's SQLSTATE by `code`; no SQLSTATE is [`Code::Other`].
fn by_sqlstate(code: impl Fn(&str) -> Code) -> impl Fn(&dyn DatabaseError) -> Code {
    move |db| db.code().map_or(Code::Other, |c| code(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy_if_b(code: &str) -> Code {
        match code {
            "b" => Code::Busy,
            "l" => Code::ConnectionLost,
            _ => Code::Other,
        }
    }

    /// Errors without a code are classified by their kind alone.
    #[test]
    fn kinds_without_a_code() {
        assert!(matches!(
            classify_error(sqlx::Error::PoolTimedOut, busy_if_b),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            classify_error(sqlx::Error::RowNotFound, busy_if_b),
            StoreError::Database(_)
        ));
        let io = || sqlx::Error::Io(std::io::Error::other("reset"));
        assert!(is_connection_lost(&io(), busy_if_b));
        assert!(!is_connection_lost(&sqlx::Error::PoolTimedOut, busy_if_b));
    }
}
