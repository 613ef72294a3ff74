//! PostgreSQL's error codes (SQLSTATEs), as the store classifies its errors: by kind and
//! code, never by message (`idemkey_sqlx::classify_error`).

use idemkey_core::StoreError;
use idemkey_sqlx::Code;

/// What a SQLSTATE says. Busy: 55P03 lock_not_available (lock_timeout), 40P01
/// deadlock_detected, 40001 serialization_failure. Connection lost: the codes with which the
/// server ends a session, class 08 (connection exception), 57P01 admin_shutdown (the backend
/// was terminated), 57P02 crash_shutdown, 57P05 idle_session_timeout, 25P03
/// idle_in_transaction_session_timeout and 25P04 transaction_timeout. A connection that sat
/// idle in a transaction past the server's time-out answers its next message with 25P03.
pub(crate) fn code(sqlstate: &str) -> Code {
    match sqlstate {
        "55P03" | "40P01" | "40001" => Code::Busy,
        "57P01" | "57P02" | "57P05" | "25P03" | "25P04" => Code::ConnectionLost,
        c if c.starts_with("08") => Code::ConnectionLost,
        _ => Code::Other,
    }
}

/// A sqlx error from PostgreSQL as a [`StoreError`].
pub(crate) fn error(e: sqlx::Error) -> StoreError {
    idemkey_sqlx::classify_error(e, code)
}

/// Whether `error` says the connection itself is gone (the socket failed, or the server
/// ended the session), as opposed to a refused statement, a pool time-out or a closed pool.
/// Classified by kind and SQLSTATE, never by message. A statement that has no effect of its
/// own (`BEGIN`, `SELECT 1`) may be retried on another connection after such an error.
pub fn is_connection_lost(error: &sqlx::Error) -> bool {
    idemkey_sqlx::is_connection_lost(error, code)
}

/// Whether `error` says the database cannot be used now for want of a connection: the
/// connection is lost ([`is_connection_lost`]), or the server refuses new ones while it
/// starts up or shuts down (SQLSTATE 57P03 cannot_connect_now). The store does not retry on
/// 57P03 (there is no other server to begin on); a server answers 503 and waits at start.
pub fn is_database_unavailable(error: &sqlx::Error) -> bool {
    is_connection_lost(error)
        || matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|c| c == "57P03"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates() {
        for busy in ["55P03", "40P01", "40001"] {
            assert_eq!(code(busy), Code::Busy, "{busy}");
        }
        for lost in [
            "08000", "08006", "57P01", "57P02", "57P05", "25P03", "25P04",
        ] {
            assert_eq!(code(lost), Code::ConnectionLost, "{lost}");
        }
        for other in ["23505", "57P03", "42P01", "5", "517"] {
            assert_eq!(code(other), Code::Other, "{other}");
        }
    }
}
