//! # idemkey-postgres
//!
//! The PostgreSQL store for idemkey. It holds the SQL only; the claim protocol and every
//! decision live in [`idemkey_core`].
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idemkey_postgres::PgStore;
//! let store = PgStore::connect("postgres://localhost/app", 16).await?;
//! store.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! A concurrent claim of the same key blocks on the owner's uncommitted row until the owner
//! commits (then it replays) or rolls back (then it owns the key). Claims of different keys
//! never wait for each other.

mod admin;
mod connect;
mod group;
mod kept;
mod listen;
mod literal;
mod migrate;
mod outbox;
mod sqlstate;
mod statements;
mod store;
mod transaction;

pub use self::connect::PgStore;
pub use self::listen::EVICTION_CHANNEL;
pub use self::sqlstate::{is_connection_lost, is_database_unavailable};
pub use self::transaction::PgTransaction;
