//! The store traits: the SQL primitives a backend provides.
//!
//! A store holds only SQL and row mapping. Every decision about a record is made by
//! [`decide`](crate::decide) and carried out by the protocol in [`crate::protocol`]; each
//! primitive here is one statement (the claim's [`Store::insert`] may be two on a store
//! that cannot read the existing row in the inserting statement).
//!
//! [`Store`] holds what the claim protocol, the layer's modes and its replay cache need: the
//! protocol's statements as required methods, and its fast paths as provided methods over
//! them that a store overrides where it can do better ([`Store::begin_claim`]: begin, then
//! claim; [`Store::complete_and_commit`]: complete, then commit; the autocommit writes of
//! external mode). [`StoreAdmin`] adds the operator's statements: listing, looking up by
//! key, eviction, the purge and the audit trail.
//!
//! Writes that follow a claim carry the owner's fencing token and are refused (they return
//! `false`) when the record no longer carries it.

use std::future::Future;
use std::ops::DerefMut;
use std::time::Duration;

use crate::{
    AuditEntry, EvictionNotices, NewRecord, Record, RecordId, RecordState, StoredResponse,
    Timestamp,
};

/// A boxed error kept as the source of a [`StoreError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error from a store, classified by kind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not be reached (connect, pool time-out, I/O). Fail closed.
    #[error("the idempotency store is unavailable")]
    Unavailable(#[source] BoxError),
    /// A lock was not granted in time: another attempt holds the key.
    #[error("the idempotency store is busy: a lock was not granted in time")]
    Busy(#[source] BoxError),
    /// A stored row could not be read back as a record.
    #[error("a stored idempotency record is malformed: {0}")]
    Corrupt(String),
    /// Any other database error.
    #[error("idempotency store error")]
    Database(#[source] BoxError),
}

/// What the claim's insert ([`Store::insert`]) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inserted {
    /// The row was inserted: the caller owns the key, with the token of the record it
    /// inserted ([`NewRecord::token`]).
    Owned,
    /// The identity was taken; this is its record as the insert saw it (committed before
    /// the statement began), read by the same statement where the dialect allows.
    Existing(Box<Record>),
    /// The identity was taken, but the insert saw no committed row for it: it was committed
    /// while the insert waited on it (PostgreSQL), or deleted since. Read it with
    /// [`Store::fetch`].
    Conflict,
}

/// How [`Store::complete_and_commit`] failed, by what it means for the transaction.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// The record no longer carries the owner's token; nothing was committed.
    #[error("the idempotency record is held by a newer owner; nothing was committed")]
    Fenced,
    /// The database refused the outcome or the commit and said so; nothing was committed.
    #[error("storing the outcome failed; nothing was committed")]
    NotCommitted(#[source] StoreError),
    /// The commit was sent and its answer never came (the connection failed): it may or may
    /// not have happened.
    #[error("the commit's outcome is unknown")]
    Unknown(#[source] StoreError),
}

/// What [`Store::begin_claim`] did.
#[derive(Debug)]
pub enum Begun<T> {
    /// The transaction began and the claim's insert ran in it.
    Claimed(T, Inserted),
    /// The claim's insert was not granted the lock on the key in time: another attempt
    /// holds it. No transaction is left open.
    Held,
}

/// What one [`StoreAdmin::purge_batch`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// How many records it deleted.
    pub deleted: u64,
    /// The latest expiry among them (`None` when it deleted none): where the round's next
    /// batch starts. Inclusive, since other records may share that millisecond.
    pub through: Option<Timestamp>,
}

/// Filters for [`StoreAdmin::list`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only this tenant's records.
    pub tenant: Option<String>,
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only records created before this time.
    pub created_before: Option<Timestamp>,
    /// At most this many, newest first (0 means the default of 100).
    pub limit: u32,
}

impl ListFilter {
    /// The effective row limit.
    pub fn effective_limit(&self) -> i64 {
        if self.limit == 0 {
            100
        } else {
            i64::from(self.limit)
        }
    }
}

/// The SQL primitives of the claim protocol.
///
/// `Connection` is the backend's connection type (`SqliteConnection`, `PgConnection`); a
/// `Transaction` dereferences to it, so the claim and the caller's own effect share it.
pub trait Store: Clone + Send + Sync + 'static {
    /// The backend's connection.
    type Connection: Send;
    /// A transaction that the caller owns and writes its effect on.
    type Transaction: DerefMut<Target = Self::Connection> + Send;
    /// A pooled connection, for statements that commit on their own.
    type PooledConnection: DerefMut<Target = Self::Connection> + Send;

    /// Starts a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;
    /// Commits a transaction.
    fn commit(&self, tx: Self::Transaction) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Bounds, for the rest of the transaction on `conn`, how long a claim waits for another
    /// attempt that holds the same key. The default does nothing: the store's own bound
    /// applies (SQLite's busy time-out).
    fn limit_lock_wait(
        &self,
        conn: &mut Self::Connection,
        wait: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (conn, wait);
        async { Ok(()) }
    }

    /// Takes a connection from the pool (autocommit).
    fn acquire(&self) -> impl Future<Output = Result<Self::PooledConnection, StoreError>> + Send;

    /// A connection for writes that commit on their own: external mode's reservation and its
    /// lease's writes. The default takes one from the pool ([`acquire`](Self::acquire)); a
    /// store that queues its writers (SQLite) hands out its writer in turn instead, so these
    /// writes wait in the same queue as its transactions rather than in the database's lock.
    /// Hold it for the statements of one step only.
    fn acquire_for_write(
        &self,
    ) -> impl Future<Output = Result<Self::PooledConnection, StoreError>> + Send {
        self.acquire()
    }

    /// External mode's reservation: [`insert`](Self::insert) on a connection of its own
    /// ([`acquire_for_write`](Self::acquire_for_write)), committed by itself. A store may
    /// commit concurrent reservations together (one transaction for several records, each
    /// answered only once that transaction committed); it must then answer exactly as
    /// [`insert`](Self::insert) would have for each, [`Inserted::Conflict`] where it did not
    /// read the record that took the key.
    fn insert_autocommit(
        &self,
        record: &NewRecord,
    ) -> impl Future<Output = Result<Inserted, StoreError>> + Send {
        insert_alone(self, record)
    }

    /// External mode's completion: [`complete`](Self::complete) on a connection of its own,
    /// committed by itself. A store may commit concurrent completions together, as for
    /// [`insert_autocommit`](Self::insert_autocommit); an error then still means what it
    /// means for [`complete`](Self::complete) alone.
    fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        complete_alone(self, id, token, response, now)
    }

    /// The claim: inserts `record` unless the identity exists; when it exists, returns the
    /// record committed before the claim began if the store can see it
    /// ([`Inserted::Existing`]), so a replay needs no second read. A store that can tell
    /// only that the identity was taken answers [`Inserted::Conflict`] and the protocol
    /// reads it with [`fetch`](Self::fetch).
    fn insert(
        &self,
        conn: &mut Self::Connection,
        record: &NewRecord,
    ) -> impl Future<Output = Result<Inserted, StoreError>> + Send;

    /// Starts a transaction and claims `record` in it: [`begin`](Self::begin),
    /// [`limit_lock_wait`](Self::limit_lock_wait) when `lock_wait` is set, then
    /// [`insert`](Self::insert), in one call so that a store able to send them together (in
    /// one round trip) can. A lock the insert was not granted in time is [`Begun::Held`];
    /// one the `BEGIN` was not granted (SQLite's write lock) stays a
    /// [`StoreError::Busy`]. On an error the transaction is gone (rolled back).
    fn begin_claim(
        &self,
        record: &NewRecord,
        lock_wait: Option<Duration>,
    ) -> impl Future<Output = Result<Begun<Self::Transaction>, StoreError>> + Send {
        async move {
            let mut tx = self.begin().await?;
            if let Some(wait) = lock_wait {
                self.limit_lock_wait(&mut tx, wait).await?;
            }
            match self.insert(&mut tx, record).await {
                Ok(inserted) => Ok(Begun::Claimed(tx, inserted)),
                Err(StoreError::Busy(_)) => Ok(Begun::Held),
                Err(e) => Err(e),
            }
        }
    }

    /// Stores the outcome on the claim's transaction ([`complete`](Self::complete)) and
    /// commits it, in one call so that a store able to send both together can. The error
    /// says whether anything may have been committed.
    fn complete_and_commit(
        &self,
        mut tx: Self::Transaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), CommitError>> + Send {
        async move {
            match self.complete(&mut tx, id, token, response, now).await {
                Ok(true) => {}
                Ok(false) => return Err(CommitError::Fenced),
                Err(e) => return Err(CommitError::NotCommitted(e)),
            }
            self.commit(tx).await.map_err(CommitError::Unknown)
        }
    }

    /// Reads one record.
    fn fetch(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Overwrites the record with `record` if it still carries `token`, raising the token.
    /// Returns the new token when it did.
    fn replace(
        &self,
        conn: &mut Self::Connection,
        record: &NewRecord,
        token: i64,
    ) -> impl Future<Output = Result<Option<i64>, StoreError>> + Send;

    /// Stores the outcome: state `completed`, lease cleared, token raised.
    fn complete(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends the lease.
    fn renew(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Marks the point of no return: state `executing`, lease extended.
    fn mark_executing(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Marks the outcome unknown: state `indeterminate`, lease cleared. The token is kept,
    /// so an owner that does learn the outcome may still complete the record.
    fn mark_indeterminate(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes the record if it still carries `token`: the key is free again.
    fn release(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The evictions other processes announce with [`StoreAdmin::notify_evicted`], for an
    /// in-process cache of completed records to follow. `None` (the default): this store
    /// announces none, so a cache must not trust an entry for long.
    fn eviction_notices(&self) -> Option<EvictionNotices> {
        None
    }
}

/// The operator's statements: what `idemkey keys`, the status resource, the purge and the
/// gateway's reconciler read and delete, beside the claim protocol's [`Store`].
pub trait StoreAdmin: Store {
    /// Records matching `filter`, newest first.
    fn list(
        &self,
        conn: &mut Self::Connection,
        filter: &ListFilter,
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send;

    /// A tenant's records for one key hash, on every route.
    fn find_by_key(
        &self,
        conn: &mut Self::Connection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send;

    /// Deletes the record whatever its state (operator eviction).
    fn evict(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes at most `batch` records expired at `now`, the earliest expiry first, skipping
    /// rows that live traffic has locked; with `from`, only records that expired at `from` or
    /// later. A round of batches passes each batch's [`Purged::through`] as the next one's
    /// `from`, so a batch seeks past what the batches before it deleted instead of reading it
    /// again (on PostgreSQL, deleted rows stay in the index until vacuumed).
    fn purge_batch(
        &self,
        conn: &mut Self::Connection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> impl Future<Output = Result<Purged, StoreError>> + Send;

    /// Appends an entry to the audit trail.
    fn append_audit(
        &self,
        conn: &mut Self::Connection,
        entry: &AuditEntry,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The audit trail of one record identity, oldest first.
    fn audit(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
    ) -> impl Future<Output = Result<Vec<AuditEntry>, StoreError>> + Send;

    /// Announces, to every process that follows [`eviction_notices`](Store::eviction_notices),
    /// that the record `id` was removed: on a transaction, when it commits. Called by an
    /// operator's eviction beside [`evict`](Self::evict). The default announces nothing (the
    /// store has no channel; caches bound their entries' life instead).
    fn notify_evicted(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (conn, id);
        async { Ok(()) }
    }
}

/// One reservation alone: [`Store::insert`] in the writer's turn
/// ([`Store::acquire_for_write`]), committed by itself.
pub(crate) async fn insert_alone<S: Store>(
    store: &S,
    record: &NewRecord,
) -> Result<Inserted, StoreError> {
    let mut conn = store.acquire_for_write().await?;
    store.insert(&mut conn, record).await
}

/// One completion alone: [`Store::complete`] in the writer's turn, committed by itself.
pub(crate) async fn complete_alone<S: Store>(
    store: &S,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let mut conn = store.acquire_for_write().await?;
    store.complete(&mut conn, id, token, response, now).await
}
