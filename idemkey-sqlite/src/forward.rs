//! The trait methods that both SQLite stores forward, unchanged, to the logic written once
//! over a [`Driver`](crate::driver::Driver) (`statements.rs`, `outbox.rs`, `group.rs`),
//! written out once here: `store_statements!` inside each store's `impl Store`, beside the
//! methods that differ (the writer's turn, the connections, sqlx's one-message claim and
//! completion), and the `StoreAdmin`, `OutboxStore` and `GroupWriter` impls whole, for both.
//!
//! Macros, not one generic impl. These traits are other crates' (`idemkey-core`,
//! `idemkey-sqlx`), so the orphan rule refuses an impl for every type of a trait of this
//! crate's (`impl<S: Sqlite> Store for S`). A generic store type (`Sqlite<D>` over a driver
//! `D`) would be allowed, but it would turn the public `SqliteStore` and `RusqliteStore` into
//! aliases of it, and its one `impl Store` could not call `Store`'s provided `begin_claim`
//! and `complete_and_commit` (which `RusqliteStore` runs and `SqliteStore` replaces) without
//! writing them again. The macros write signatures only: each body is the one call a
//! hand-written method makes, on the store's own connection type, with no boxing and no
//! `dyn`.

use idemkey_core::outbox::{
    Message, MessageFilter, NewMessage, OutboxAuditEntry, OutboxStats, OutboxStore,
};
use idemkey_core::{
    AuditEntry, Inserted, ListFilter, NewRecord, Purged, Record, RecordId, StoreAdmin, StoreError,
    Timestamp,
};
use idemkey_sqlx::group::{Completion, GroupWriter};

use crate::{RusqliteStore, SqliteStore, group, outbox, statements};

/// The [`Store`](idemkey_core::Store) methods that are one call to `statements.rs` (or to the
/// store's [`GroupedWrites`](idemkey_sqlx::group::GroupedWrites)), for inside an
/// `impl Store` whose `Connection` is a [`Driver`](crate::driver::Driver) and which is
/// [`WritesGroups`](crate::group::WritesGroups).
macro_rules! store_statements {
    () => {
        /// Concurrent reservations are written in groups, each in one turn of the writer,
        /// each answered once its group committed, as
        /// [`insert`](idemkey_core::Store::insert) would have answered it alone (a key found
        /// taken is [`Inserted::Conflict`](idemkey_core::Inserted::Conflict)); one that finds
        /// nothing being written goes at once, alone (`idemkey_sqlx::group`).
        async fn insert_autocommit(
            &self,
            record: &idemkey_core::NewRecord,
        ) -> Result<idemkey_core::Inserted, idemkey_core::StoreError> {
            $crate::group::WritesGroups::grouped(self)
                .insert(self, record)
                .await
        }

        /// Concurrent completions are written in groups, as reservations are, each answered
        /// as [`complete`](idemkey_core::Store::complete) would have answered it alone.
        async fn complete_autocommit(
            &self,
            id: &idemkey_core::RecordId,
            token: i64,
            response: &idemkey_core::StoredResponse,
            now: idemkey_core::Timestamp,
        ) -> Result<bool, idemkey_core::StoreError> {
            $crate::group::WritesGroups::grouped(self)
                .complete(self, id, token, response, now)
                .await
        }

        async fn insert(
            &self,
            conn: &mut Self::Connection,
            r: &idemkey_core::NewRecord,
        ) -> Result<idemkey_core::Inserted, idemkey_core::StoreError> {
            $crate::statements::insert(conn, r).await
        }

        async fn fetch(
            &self,
            conn: &mut Self::Connection,
            id: &idemkey_core::RecordId,
        ) -> Result<Option<idemkey_core::Record>, idemkey_core::StoreError> {
            $crate::statements::fetch(conn, id).await
        }

        async fn replace(
            &self,
            conn: &mut Self::Connection,
            r: &idemkey_core::NewRecord,
            token: i64,
        ) -> Result<Option<i64>, idemkey_core::StoreError> {
            $crate::statements::replace(conn, r, token).await
        }

        async fn complete(
            &self,
            conn: &mut Self::Connection,
            id: &idemkey_core::RecordId,
            token: i64,
            response: &idemkey_core::StoredResponse,
            now: idemkey_core::Timestamp,
        ) -> Result<bool, idemkey_core::StoreError> {
            $crate::statements::complete(conn, id, token, response, now).await
        }

        async fn renew(
            &self,
            conn: &mut Self::Connection,
            id: &idemkey_core::RecordId,
            token: i64,
            lease_until: idemkey_core::Timestamp,
            now: idemkey_core::Timestamp,
        ) -> Result<bool, idemkey_core::StoreError> {
            $crate::statements::renew(conn, id, token, lease_until, now).await
        }

        async fn mark_executing(
            &self,
            conn: &mut Self::Connection,
            id: &idemkey_core::RecordId,
            token: i64,
            lease_until: idemkey_core::Timestamp,
            now: idemkey_core::Timestamp,
        ) -> Result<bool, idemkey_core::StoreError> {
            $crate::statements::mark_executing(conn, id, token, lease_until, now).await
        }

        async fn mark_indeterminate(
            &self,
            conn: &mut Self::Connection,
            id: &idemkey_core::RecordId,
            token: i64,
            now: idemkey_core::Timestamp,
        ) -> Result<bool, idemkey_core::StoreError> {
            $crate::statements::mark_indeterminate(conn, id, token, now).await
        }

        async fn release(
            &self,
            conn: &mut Self::Connection,
            id: &idemkey_core::RecordId,
            token: i64,
        ) -> Result<bool, idemkey_core::StoreError> {
            $crate::statements::release(conn, id, token).await
        }
    };
}
pub(crate) use store_statements;

/// [`StoreAdmin`] over `statements.rs`, [`OutboxStore`] over `outbox.rs`, and [`GroupWriter`]
/// over `group.rs`, for each store named.
macro_rules! impl_shared {
    ($($store:ty),+) => {$(
        impl StoreAdmin for $store {
            async fn list(
                &self,
                conn: &mut Self::Connection,
                filter: &ListFilter,
            ) -> Result<Vec<Record>, StoreError> {
                statements::list(conn, filter).await
            }

            async fn find_by_key(
                &self,
                conn: &mut Self::Connection,
                tenant: &str,
                key_hash: &[u8; 32],
            ) -> Result<Vec<Record>, StoreError> {
                statements::find_by_key(conn, tenant, key_hash).await
            }

            async fn evict(
                &self,
                conn: &mut Self::Connection,
                id: &RecordId,
            ) -> Result<bool, StoreError> {
                statements::evict(conn, id).await
            }

            async fn purge_batch(
                &self,
                conn: &mut Self::Connection,
                now: Timestamp,
                from: Option<Timestamp>,
                batch: u32,
            ) -> Result<Purged, StoreError> {
                statements::purge_batch(conn, now, from, batch).await
            }

            async fn append_audit(
                &self,
                conn: &mut Self::Connection,
                entry: &AuditEntry,
            ) -> Result<(), StoreError> {
                statements::append_audit(conn, entry).await
            }

            async fn audit(
                &self,
                conn: &mut Self::Connection,
                id: &RecordId,
            ) -> Result<Vec<AuditEntry>, StoreError> {
                statements::audit(conn, id).await
            }

            async fn notify_evicted(
                &self,
                conn: &mut Self::Connection,
                id: &RecordId,
            ) -> Result<(), StoreError> {
                statements::notify_evicted(conn, id).await
            }
        }

        impl OutboxStore for $store {
            async fn enqueue(
                conn: &mut Self::Connection,
                m: &NewMessage,
            ) -> Result<(), StoreError> {
                outbox::enqueue(conn, m).await
            }

            async fn claim_due(
                &self,
                conn: &mut Self::Connection,
                relay: &str,
                now: Timestamp,
                until: Timestamp,
                limit: u32,
            ) -> Result<Vec<Message>, StoreError> {
                outbox::claim_due(conn, relay, now, until, limit).await
            }

            async fn mark_sent(
                &self,
                conn: &mut Self::Connection,
                id: &str,
                relay: &str,
                now: Timestamp,
            ) -> Result<bool, StoreError> {
                outbox::mark_sent(conn, id, relay, now).await
            }

            async fn mark_failed(
                &self,
                conn: &mut Self::Connection,
                id: &str,
                relay: &str,
                next_attempt_at: Option<Timestamp>,
                failure: &str,
            ) -> Result<bool, StoreError> {
                outbox::mark_failed(conn, id, relay, next_attempt_at, failure).await
            }

            async fn messages(
                &self,
                conn: &mut Self::Connection,
                filter: &MessageFilter,
            ) -> Result<Vec<Message>, StoreError> {
                outbox::messages(conn, filter).await
            }

            async fn message(
                &self,
                conn: &mut Self::Connection,
                id: &str,
            ) -> Result<Option<Message>, StoreError> {
                outbox::message(conn, id).await
            }

            async fn requeue(
                &self,
                conn: &mut Self::Connection,
                id: &str,
                now: Timestamp,
            ) -> Result<bool, StoreError> {
                outbox::requeue(conn, id, now).await
            }

            async fn remove_dead(
                &self,
                conn: &mut Self::Connection,
                id: &str,
            ) -> Result<bool, StoreError> {
                outbox::remove_dead(conn, id).await
            }

            async fn purge_sent(
                &self,
                conn: &mut Self::Connection,
                before: Timestamp,
                batch: u32,
            ) -> Result<u64, StoreError> {
                outbox::purge_sent(conn, before, batch).await
            }

            async fn outbox_stats(
                &self,
                conn: &mut Self::Connection,
            ) -> Result<OutboxStats, StoreError> {
                outbox::outbox_stats(conn).await
            }

            async fn append_outbox_audit(
                &self,
                conn: &mut Self::Connection,
                e: &OutboxAuditEntry,
            ) -> Result<(), StoreError> {
                outbox::append_outbox_audit(conn, e).await
            }

            async fn outbox_audit(
                &self,
                conn: &mut Self::Connection,
                id: &str,
            ) -> Result<Vec<OutboxAuditEntry>, StoreError>
            {
                outbox::outbox_audit(conn, id).await
            }
        }

        impl GroupWriter for $store {
            async fn insert_group(
                &self,
                records: Vec<NewRecord>,
            ) -> Vec<Result<Inserted, StoreError>> {
                group::insert_group(self, records).await
            }

            async fn complete_group(
                &self,
                group: Vec<Completion>,
            ) -> Vec<Result<bool, StoreError>> {
                group::complete_group(self, group).await
            }
        }
    )+};
}

impl_shared!(SqliteStore, RusqliteStore);
