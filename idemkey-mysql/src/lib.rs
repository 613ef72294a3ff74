//! # idemkey-mysql
//!
//! The MySQL and MariaDB store for idemkey, on InnoDB. It holds the SQL, the error numbers
//! and the row mapping only; the claim protocol and every decision live in
//! [`idemkey_core`], and what every sqlx store shares (rows, error classes) in
//! `idemkey_sqlx`.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idemkey_mysql::MySqlStore;
//! let store = MySqlStore::connect("mysql://app:secret@localhost/app", 16).await?;
//! store.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! A concurrent claim of the same key waits on the owner's uncommitted row until the owner
//! commits (then it replays) or rolls back (then it, or one of the others waiting, owns the
//! key). Targets: MySQL 8.0 and MariaDB 10.6 or later (the purge's `SKIP LOCKED`).

mod admin;
mod codes;
mod connect;
mod outbox;
mod sql;
mod store;

pub use self::codes::{DUPLICATE_KEY, error_number, is_connection_lost};
pub use self::connect::{MigrationError, MySqlStore};
