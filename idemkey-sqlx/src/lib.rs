//! # idemkey-sqlx
//!
//! What idemkey's sqlx-based stores (`idemkey-sqlite`, `idemkey-postgres`, `idemkey-mysql`)
//! share, kept out of `idemkey-core` so that the core carries no database driver and no
//! runtime:
//!
//! - [`RecordRow`], [`AuditRow`], [`MessageRow`], [`OutboxAuditRow`]: the tables' rows, and
//!   their conversion to the core's types;
//! - [`classify_error`], [`is_connection_lost`] (and their `_by` forms, for a dialect whose
//!   telling code is not the SQLSTATE): sqlx errors as
//!   [`StoreError`](idemkey_core::StoreError)s, by kind and by the [`Code`] a store's
//!   dialect reads from the database's error code;
//! - [`group`]: group commit of external-mode writes;
//! - [`impl_outbox_store!`]: the outbox's Rust, around a store's own SQL.

mod error;
pub mod group;
mod outbox;
mod rows;

pub use self::error::{
    Code, classify_error, classify_error_by, is_connection_lost, is_connection_lost_by,
};
pub use self::rows::{AuditRow, MessageRow, OutboxAuditRow, RecordRow};

/// What [`impl_outbox_store!`] names in the store's crate.
#[doc(hidden)]
pub mod __private {
    pub use idemkey_core::{StoreError, Timestamp, outbox};
    pub use sqlx;
}
