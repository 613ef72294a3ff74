//! A real store behind a wrapper that tells a test what it does, for the files that watch
//! (or hold) a store's claims (`#[path]`-included where used): every [`Store`] method is
//! the inner store's, with [`Watch`]'s hooks around the calls a test watches.

use std::future::Future;
use std::time::Duration;

use idemkey_core::{
    Begun, CommitError, EvictionNotices, Inserted, NewRecord, Record, RecordId, Store, StoreError,
    StoredResponse, Timestamp,
};

/// A call of the store that a [`Watch`] is told of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// External mode's reservation, committed by itself.
    InsertAutocommit,
    /// The claim's insert on a connection or transaction.
    Insert,
    /// A local-mode claim in its new transaction.
    BeginClaim,
    /// A record's read.
    Fetch,
    /// External mode's completion, committed by itself.
    CompleteAutocommit,
}

/// What a test does around the watched calls; both hooks do nothing by default.
pub(crate) trait Watch: Clone + Send + Sync + 'static {
    /// Before `call` reaches the inner store.
    fn before(&self, call: Call) {
        let _ = call;
    }

    /// After `call` answered, before its caller gets the answer: it may hold it there.
    fn after(&self, call: Call) -> impl Future<Output = ()> + Send {
        let _ = call;
        async {}
    }
}

/// `inner`, watched by `watch`.
#[derive(Debug, Clone)]
pub(crate) struct Watched<S, W> {
    pub(crate) inner: S,
    pub(crate) watch: W,
}

impl<S, W: Watch> Watched<S, W> {
    /// `answer` of `call`, made by the inner store, given back once the watch is done.
    async fn watched<T>(&self, call: Call, answer: impl Future<Output = T>) -> T {
        self.watch.before(call);
        let answer = answer.await;
        self.watch.after(call).await;
        answer
    }
}

impl<S: Store, W: Watch> Store for Watched<S, W> {
    type Connection = S::Connection;
    type Transaction = S::Transaction;
    type PooledConnection = S::PooledConnection;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        self.inner.begin().await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }

    async fn limit_lock_wait(
        &self,
        conn: &mut Self::Connection,
        wait: Duration,
    ) -> Result<(), StoreError> {
        self.inner.limit_lock_wait(conn, wait).await
    }

    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        self.inner.acquire().await
    }

    async fn acquire_for_write(&self) -> Result<Self::PooledConnection, StoreError> {
        self.inner.acquire_for_write().await
    }

    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        let answer = self.inner.insert_autocommit(record);
        self.watched(Call::InsertAutocommit, answer).await
    }

    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let answer = self.inner.complete_autocommit(id, token, response, now);
        self.watched(Call::CompleteAutocommit, answer).await
    }

    async fn insert(
        &self,
        conn: &mut Self::Connection,
        record: &NewRecord,
    ) -> Result<Inserted, StoreError> {
        let answer = self.inner.insert(conn, record);
        self.watched(Call::Insert, answer).await
    }

    async fn begin_claim(
        &self,
        record: &NewRecord,
        lock_wait: Option<Duration>,
    ) -> Result<Begun<Self::Transaction>, StoreError> {
        let answer = self.inner.begin_claim(record, lock_wait);
        self.watched(Call::BeginClaim, answer).await
    }

    async fn complete_and_commit(
        &self,
        tx: Self::Transaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        self.inner
            .complete_and_commit(tx, id, token, response, now)
            .await
    }

    async fn fetch(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        let answer = self.inner.fetch(conn, id);
        self.watched(Call::Fetch, answer).await
    }

    async fn replace(
        &self,
        conn: &mut Self::Connection,
        record: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        self.inner.replace(conn, record, token).await
    }

    async fn complete(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.complete(conn, id, token, response, now).await
    }

    async fn renew(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.renew(conn, id, token, lease_until, now).await
    }

    async fn mark_executing(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner
            .mark_executing(conn, id, token, lease_until, now)
            .await
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.mark_indeterminate(conn, id, token, now).await
    }

    async fn release(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        self.inner.release(conn, id, token).await
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        self.inner.eviction_notices()
    }
}
