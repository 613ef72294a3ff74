//! # idemkey-sqlite
//!
//! The SQLite store for idemkey, the embedded default. It holds the SQL only; the claim
//! protocol and every decision live in [`idemkey_core`].
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idemkey_sqlite::SqliteStore;
//! let store = SqliteStore::connect("sqlite:idemkey.db").await?;
//! store.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! SQLite serializes writers: a claim takes the database's write lock, and a concurrent
//! claim of any key waits for it, up to the busy time-out (5 s by default). A claim that
//! waits longer fails with [`StoreError::Busy`](idemkey_core::StoreError::Busy), which the
//! layer answers 503 `store-busy` with `Retry-After`: the lock may be held by any key's
//! writer, so the store cannot say that this key is in flight. The store's writers wait in
//! a first-come, first-served queue in memory, not in SQLite's sleeping busy handler. Each
//! claim transaction should still be short.

mod batch;
mod checkpoint;
mod connect;
mod driver;
mod evictions;
mod forward;
mod group;
mod outbox;
mod params;
mod rusqlite_connection;
mod rusqlite_group;
mod rusqlite_open;
mod rusqlite_store;
mod sql;
mod statements;
mod store;
mod writer;

pub use self::connect::SqliteStore;
pub use self::evictions::EVICTION_POLL;
pub use self::rusqlite_connection::{RusqliteConnection, RusqliteTransaction};
pub use self::rusqlite_open::RusqliteStore;
pub use self::writer::{SqlitePooledConnection, SqliteTransaction};
/// The rusqlite this crate's [`RusqliteStore`] is built on, for the application's effects.
pub use rusqlite;
