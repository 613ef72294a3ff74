//! MySQL's and MariaDB's error numbers, as the store classifies its errors: by kind and
//! number, never by message (`idemkey_sqlx::classify_error_by`). The SQLSTATE is too coarse
//! here: 1205 (lock wait time-out) and 1062 (duplicate key) share class `HY000`/`23000` with
//! errors that mean other things.

use idemkey_core::StoreError;
use idemkey_sqlx::Code;
use sqlx::error::DatabaseError;
use sqlx::mysql::MySqlDatabaseError;

/// ER_DUP_ENTRY: an `INSERT` met a unique key's row (for the claim: the key is taken).
pub const DUPLICATE_KEY: u16 = 1062;
/// ER_LOCK_DEADLOCK: InnoDB broke a deadlock by rolling back this WHOLE transaction.
pub(crate) const DEADLOCK: u16 = 1213;
/// ER_UNKNOWN_SYSTEM_VARIABLE: a `SET` of a variable the server does not have.
pub(crate) const UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;
/// ER_LOCK_WAIT_TIMEOUT: a lock was not granted within `innodb_lock_wait_timeout`; only
/// the statement was rolled back.
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// What an error number says. Busy: 1205 lock wait time-out, 1213 deadlock. Connection
/// lost, the numbers with which the server ends or refuses a session: 1040 too many
/// connections, 1053 server shutdown, 1152 and 1184 aborted connection, 1927 connection
/// killed (MariaDB), 4031 disconnected for inactivity (MySQL 8). The client's own 2006
/// and 2013 (server gone, lost) are I/O errors to sqlx, classified by kind.
pub(crate) fn code(number: u16) -> Code {
    match number {
        LOCK_WAIT_TIMEOUT | DEADLOCK => Code::Busy,
        1040 | 1053 | 1152 | 1184 | 1927 | 4031 => Code::ConnectionLost,
        _ => Code::Other,
    }
}

/// The MySQL error number of a database error (`None` for any other error).
pub fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => of(&**db),
        _ => None,
    }
}

fn of(db: &dyn DatabaseError) -> Option<u16> {
    db.try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

fn classify(db: &dyn DatabaseError) -> Code {
    of(db).map_or(Code::Other, code)
}

/// A sqlx error from MySQL as a [`StoreError`].
pub(crate) fn error(e: sqlx::Error) -> StoreError {
    idemkey_sqlx::classify_error_by(e, classify)
}

/// Whether `error` says the connection itself is gone (the socket failed, or the server
/// ended the session), as opposed to a refused statement, a pool time-out or a closed pool.
/// Classified by kind and error number, never by message.
pub fn is_connection_lost(error: &sqlx::Error) -> bool {
    idemkey_sqlx::is_connection_lost_by(error, classify)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        for busy in [1205, 1213] {
            assert_eq!(code(busy), Code::Busy, "{busy}");
        }
        for lost in [1040, 1053, 1152, 1184, 1927, 4031] {
            assert_eq!(code(lost), Code::ConnectionLost, "{lost}");
        }
        for other in [1062, 1406, 1048, 1153, 1064] {
            assert_eq!(code(other), Code::Other, "{other}");
        }
    }
}
