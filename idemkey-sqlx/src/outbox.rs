//! The outbox's Rust for a sqlx store ([`impl_outbox_store!`](crate::impl_outbox_store)):
//! binds, row mapping and errors are the same for every dialect; the SQL is the store's own.

/// Implements [`OutboxStore`](idemkey_core::outbox::OutboxStore) for a sqlx store: the Rust
/// side is the same for every dialect (binds, row mapping, errors); the SQL is the store's
/// own, given as associated constants of `$sql` (`ENQUEUE`, `CLAIM_DUE`, `MARK_SENT`,
/// `MARK_FAILED`, `MESSAGES`, `MESSAGE`, `REQUEUE`, `REMOVE_DEAD`, `PURGE_SENT`, `STATS`,
/// `APPEND_AUDIT`, `AUDIT`). `$error` maps a `sqlx::Error` to a
/// [`StoreError`](idemkey_core::StoreError). Two more arguments, `$query` and `$query_as`,
/// replace `sqlx::query` and `sqlx::query_as` with functions of the store's that take the
/// same calls (`bind`, `execute`, `fetch_*`).
///
/// Each statement's values are bound in one order, the order in which they appear in an
/// `UPDATE`'s text (the new values, then the message's id and relay), so a dialect of
/// positional parameters (`?`, each bound once) writes them in that order; a dialect of
/// numbered ones may reuse one:
///
/// | statement | values, in order |
/// |---|---|
/// | `ENQUEUE` | id, group, kind, data, created at (also the first due time) |
/// | `CLAIM_DUE` | relay, now, claimed until, limit |
/// | `MARK_SENT` | now, id, relay |
/// | `MARK_FAILED` | next attempt (`NULL`: dead), next attempt again, the failure, id, relay |
/// | `MESSAGES` | state (`NULL`: any), limit |
/// | `MESSAGE`, `REMOVE_DEAD`, `AUDIT` | id |
/// | `REQUEUE` | now, id |
/// | `PURGE_SENT` | sent before, batch |
/// | `APPEND_AUDIT` | message id, at, actor, action, detail |
///
/// A dialect without `UPDATE … RETURNING` gives the claim as a hook instead of `CLAIM_DUE`
/// (`claim = path`, after `$error`): an `async fn(&mut $conn, relay: &str, now: Timestamp,
/// until: Timestamp, limit: u32) -> Result<Vec<MessageRow>, StoreError>` that claims and
/// returns the claimed rows, each with its `attempts` raised; their order, and their
/// mapping to messages, are the macro's.
#[macro_export]
macro_rules! impl_outbox_store {
    ($store:ty, $conn:ty, $sql:ty, $error:path, claim = $claim:path) => {
        $crate::impl_outbox_store!(
            @impl $store,
            $conn,
            $sql,
            $error,
            $crate::__private::sqlx::query,
            $crate::__private::sqlx::query_as,
            (hook $claim)
        );
    };
    ($store:ty, $conn:ty, $sql:ty, $error:path) => {
        $crate::impl_outbox_store!(
            $store,
            $conn,
            $sql,
            $error,
            $crate::__private::sqlx::query,
            $crate::__private::sqlx::query_as
        );
    };
    ($store:ty, $conn:ty, $sql:ty, $error:path, $query:path, $query_as:path) => {
        $crate::impl_outbox_store!(
            @impl $store,
            $conn,
            $sql,
            $error,
            $query,
            $query_as,
            (statement)
        );
    };
    // The claim's rows: one statement, `CLAIM_DUE`.
    (@claim (statement), $sql:ty, $error:path, $query_as:path,
        $conn:ident, $relay:ident, $now:ident, $until:ident, $limit:ident) => {
        $query_as(<$sql>::CLAIM_DUE)
            .bind($relay)
            .bind($now.as_millis())
            .bind($until.as_millis())
            .bind(i64::from($limit))
            .fetch_all($conn)
            .await
            .map_err($error)?
    };
    // The claim's rows: the dialect's hook.
    (@claim (hook $claim:path), $sql:ty, $error:path, $query_as:path,
        $conn:ident, $relay:ident, $now:ident, $until:ident, $limit:ident) => {
        $claim($conn, $relay, $now, $until, $limit).await?
    };
    (@impl $store:ty, $conn:ty, $sql:ty, $error:path, $query:path, $query_as:path,
        $claim:tt) => {
        impl $crate::__private::outbox::OutboxStore for $store {
            async fn enqueue(
                conn: &mut $conn,
                message: &$crate::__private::outbox::NewMessage,
            ) -> Result<(), $crate::__private::StoreError> {
                $query(<$sql>::ENQUEUE)
                    .bind(&message.id)
                    .bind(&message.group)
                    .bind(&message.kind)
                    .bind(&message.data)
                    .bind(message.created_at.as_millis())
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(())
            }

            async fn claim_due(
                &self,
                conn: &mut $conn,
                relay: &str,
                now: $crate::__private::Timestamp,
                until: $crate::__private::Timestamp,
                limit: u32,
            ) -> Result<Vec<$crate::__private::outbox::Message>, $crate::__private::StoreError>
            {
                let rows: Vec<$crate::MessageRow> = $crate::impl_outbox_store!(
                    @claim $claim, $sql, $error, $query_as, conn, relay, now, until, limit
                );
                let mut claimed = rows
                    .into_iter()
                    .map($crate::__private::outbox::Message::try_from)
                    .collect::<Result<Vec<_>, _>>()?;
                claimed.sort_by_key(|m| m.seq);
                Ok(claimed)
            }

            async fn mark_sent(
                &self,
                conn: &mut $conn,
                id: &str,
                relay: &str,
                now: $crate::__private::Timestamp,
            ) -> Result<bool, $crate::__private::StoreError> {
                let done = $query(<$sql>::MARK_SENT)
                    .bind(now.as_millis())
                    .bind(id)
                    .bind(relay)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn mark_failed(
                &self,
                conn: &mut $conn,
                id: &str,
                relay: &str,
                next_attempt_at: Option<$crate::__private::Timestamp>,
                failure: &str,
            ) -> Result<bool, $crate::__private::StoreError> {
                let next = next_attempt_at.map($crate::__private::Timestamp::as_millis);
                let done = $query(<$sql>::MARK_FAILED)
                    .bind(next)
                    .bind(next)
                    .bind(failure)
                    .bind(id)
                    .bind(relay)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn messages(
                &self,
                conn: &mut $conn,
                filter: &$crate::__private::outbox::MessageFilter,
            ) -> Result<Vec<$crate::__private::outbox::Message>, $crate::__private::StoreError>
            {
                let rows: Vec<$crate::MessageRow> = $query_as(<$sql>::MESSAGES)
                    .bind(filter.state.map(|s| s.as_str()))
                    .bind(filter.effective_limit())
                    .fetch_all(conn)
                    .await
                    .map_err($error)?;
                rows.into_iter()
                    .map($crate::__private::outbox::Message::try_from)
                    .collect()
            }

            async fn message(
                &self,
                conn: &mut $conn,
                id: &str,
            ) -> Result<Option<$crate::__private::outbox::Message>, $crate::__private::StoreError>
            {
                let row: Option<$crate::MessageRow> = $query_as(<$sql>::MESSAGE)
                    .bind(id)
                    .fetch_optional(conn)
                    .await
                    .map_err($error)?;
                row.map($crate::__private::outbox::Message::try_from)
                    .transpose()
            }

            async fn requeue(
                &self,
                conn: &mut $conn,
                id: &str,
                now: $crate::__private::Timestamp,
            ) -> Result<bool, $crate::__private::StoreError> {
                let done = $query(<$sql>::REQUEUE)
                    .bind(now.as_millis())
                    .bind(id)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn remove_dead(
                &self,
                conn: &mut $conn,
                id: &str,
            ) -> Result<bool, $crate::__private::StoreError> {
                let done = $query(<$sql>::REMOVE_DEAD)
                    .bind(id)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected() == 1)
            }

            async fn purge_sent(
                &self,
                conn: &mut $conn,
                before: $crate::__private::Timestamp,
                batch: u32,
            ) -> Result<u64, $crate::__private::StoreError> {
                let done = $query(<$sql>::PURGE_SENT)
                    .bind(before.as_millis())
                    .bind(i64::from(batch))
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(done.rows_affected())
            }

            async fn outbox_stats(
                &self,
                conn: &mut $conn,
            ) -> Result<$crate::__private::outbox::OutboxStats, $crate::__private::StoreError> {
                let (pending, dead, oldest): (i64, i64, Option<i64>) = $query_as(<$sql>::STATS)
                    .fetch_one(conn)
                    .await
                    .map_err($error)?;
                Ok($crate::__private::outbox::OutboxStats {
                    pending: pending.max(0) as u64,
                    dead: dead.max(0) as u64,
                    oldest_pending: oldest.map($crate::__private::Timestamp),
                })
            }

            async fn append_outbox_audit(
                &self,
                conn: &mut $conn,
                entry: &$crate::__private::outbox::OutboxAuditEntry,
            ) -> Result<(), $crate::__private::StoreError> {
                $query(<$sql>::APPEND_AUDIT)
                    .bind(&entry.message_id)
                    .bind(entry.at.as_millis())
                    .bind(&entry.actor)
                    .bind(&entry.action)
                    .bind(&entry.detail)
                    .execute(conn)
                    .await
                    .map_err($error)?;
                Ok(())
            }

            async fn outbox_audit(
                &self,
                conn: &mut $conn,
                id: &str,
            ) -> Result<
                Vec<$crate::__private::outbox::OutboxAuditEntry>,
                $crate::__private::StoreError,
            > {
                let rows: Vec<$crate::OutboxAuditRow> = $query_as(<$sql>::AUDIT)
                    .bind(id)
                    .fetch_all(conn)
                    .await
                    .map_err($error)?;
                Ok(rows
                    .into_iter()
                    .map($crate::__private::outbox::OutboxAuditEntry::from)
                    .collect())
            }
        }
    };
}
