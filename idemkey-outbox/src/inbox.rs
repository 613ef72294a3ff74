//! The inbox: a consumer handles each message once, by its id, in one transaction with its
//! idempotency record.

use std::time::Duration;

use futures::future::BoxFuture;
use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    Clock, Fingerprint, FingerprintSpec, IdempotencyKey, KeyError, KeyHasher, RecordId,
    RequestParts, Scope, Store, StoreError, StoredResponse, fingerprint,
};
use idemkey_tower::SystemClock;
use std::sync::Arc;

/// What became of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled<T> {
    /// The handler ran, and its effect committed with the message's record.
    Ran(T),
    /// The message's record was already completed: nothing ran.
    Duplicate,
}

impl<T> Handled<T> {
    /// Whether the handler ran.
    pub fn ran(&self) -> bool {
        matches!(self, Self::Ran(_))
    }
}

/// Why a message was not handled. Nothing of the handler's committed; the source should
/// deliver the message again (for JetStream: no acknowledgement, or a negative one).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError<E = std::convert::Infallible> {
    /// The message id cannot serve as an idempotency key (1–255 visible ASCII characters
    /// without space, `"`, `\` or `,`).
    #[error("the message id {id:?} cannot be an idempotency key")]
    InvalidId {
        /// The message id.
        id: String,
        /// What is wrong with it.
        #[source]
        source: KeyError,
    },
    /// The store failed (the transaction, the claim, the completion or the commit). When the
    /// commit itself failed, the message may have been handled; its redelivery then finds
    /// the completed record and runs nothing.
    #[error("the inbox store failed")]
    Store(#[source] StoreError),
    /// Another consumer is handling the same message right now (the store's lock was not
    /// granted in time).
    #[error("the message {0:?} is being handled by another consumer")]
    InFlight(String),
    /// The message's record is not one this inbox can complete (another writer used the
    /// same identity): nothing ran.
    #[error("the record of message {id:?} cannot be used by the inbox: {reason}")]
    Unusable {
        /// The message id.
        id: String,
        /// What the claim found.
        reason: &'static str,
    },
    /// The handler failed; its effect and the record were rolled back.
    #[error("the message handler failed")]
    Handler(#[source] E),
}

impl<E> From<StoreError> for InboxError<E> {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// Runs a consumer's handler for each message at most once to completion, with the message's
/// id as the idempotency key.
///
/// For each message, in one transaction of the store: the inbox claims the record
/// `(tenant = consumer, route = "INBOX <source>", key = message id)` with idemkey's claim
/// protocol, runs the handler on that transaction (the handler writes its effect on the
/// connection it is given), completes the record, and commits. So the effect and the record
/// commit together, or neither does. A message whose record is completed runs nothing and
/// answers [`Handled::Duplicate`]. Concurrent deliveries of one message wait for each other
/// (PostgreSQL blocks the second claim on the first's row, SQLite serializes writers), and
/// all but one answer `Duplicate`.
///
/// The receiver's part: acknowledge the message to its source only after [`run`](Self::run)
/// returned `Ok` (ran or duplicate); on an error, let the source deliver it again. A consumer
/// that crashes between the commit and the acknowledgement gets the message again, and the
/// inbox runs nothing for it. The record is kept for [`retention`](Self::retention) (7 days
/// by default); a message redelivered after that runs again, so keep it longer than the
/// source may redeliver (JetStream: the stream's `max_age`).
///
/// The message id alone names the message: any source that gives a stable, unique id per
/// message works (`Nats-Msg-Id`, a webhook's `Idempotency-Key`, a Kafka topic-partition-
/// offset). The ids are stored as keyed hashes under `hasher`, like request keys.
///
/// ```no_run
/// # async fn run(store: idemkey_postgres::PgStore) -> Result<(), Box<dyn std::error::Error>> {
/// use idemkey_core::KeyHasher;
/// use idemkey_outbox::{Handled, Inbox};
///
/// let inbox = Inbox::new(store, KeyHasher::new(b"32 random bytes from a secret..."), "billing", "payments");
/// let handled = inbox
///     .run("msg_0123", |conn| {
///         Box::pin(async move {
///             // Without parameters, a simple query: nothing is left prepared on the
///             // server connection, which a pooler in transaction mode may hand to others.
///             sqlx::raw_sql("INSERT INTO invoices (payment) VALUES ('p_1')")
///                 .execute(&mut *conn)
///                 .await
///                 .map(|_| ())
///         })
///     })
///     .await?;
/// // Committed: now acknowledge the message to its source.
/// assert!(matches!(handled, Handled::Ran(()) | Handled::Duplicate));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Inbox<S> {
    store: S,
    hasher: KeyHasher,
    scope: Scope,
    fingerprint: Fingerprint,
    retention: Duration,
    clock: Arc<dyn Clock>,
}

/// A claimed message's transaction: write the effect on it (it dereferences to the store's
/// connection), then [`commit`](Self::commit). Dropped without a commit, it rolls back: no
/// effect, no record.
pub struct Claimed<S: Store> {
    store: S,
    tx: S::Transaction,
    id: RecordId,
    token: i64,
    clock: Arc<dyn Clock>,
}

impl<S: Store> std::fmt::Debug for Claimed<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed")
            .field("key_id", &self.id.key_id())
            .field("route", &self.id.route)
            .finish_non_exhaustive()
    }
}

impl<S: Store> std::ops::Deref for Claimed<S> {
    type Target = S::Connection;
    fn deref(&self) -> &S::Connection {
        &self.tx
    }
}

impl<S: Store> std::ops::DerefMut for Claimed<S> {
    fn deref_mut(&mut self) -> &mut S::Connection {
        &mut self.tx
    }
}

impl<S: Store> Claimed<S> {
    /// Completes the message's record on the transaction and commits it with the effect.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        let done = StoredResponse {
            status: 200,
            headers: Vec::new(),
            body: Vec::new(),
        };
        let now = self.clock.now();
        let completed =
            protocol::complete(&self.store, &mut self.tx, &self.id, self.token, &done, now);
        match completed.await {
            Ok(()) => {}
            Err(protocol::Error::Store(e)) => return Err(e),
            // The record was claimed on this very transaction: nobody else can have
            // moved its token.
            Err(e) => return Err(StoreError::Corrupt(e.to_string())),
        }
        self.store.commit(self.tx).await
    }
}

impl<S: Store> Inbox<S> {
    /// How long a handled message's record is kept by default.
    pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

    /// The inbox of `consumer` (the record's tenant: two consumers of one message each
    /// handle it) for messages from `source` (the record's route is `INBOX <source>`), its
    /// ids hashed with `hasher`.
    pub fn new(
        store: S,
        hasher: KeyHasher,
        consumer: impl Into<String>,
        source: impl Into<String>,
    ) -> Self {
        let scope = Scope {
            tenant: consumer.into(),
            route: format!("INBOX {}", source.into()),
        };
        // Every message of one scope has the same fingerprint: the id alone names it.
        let fingerprint = fingerprint(
            &RequestParts {
                method: "INBOX",
                route: &scope.route,
                path_params: &[],
                query: None,
                content_type: None,
                body: &[],
            },
            &FingerprintSpec::default(),
        );
        Self {
            store,
            hasher,
            scope,
            fingerprint,
            retention: Self::DEFAULT_RETENTION,
            clock: Arc::new(SystemClock),
        }
    }

    /// Keeps each handled message's record for `retention` (see the type's docs).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Reads the time from `clock`.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The records' scope: tenant = consumer, route = `INBOX <source>`.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The record identity of `message_id`.
    pub fn record_id(&self, message_id: &str) -> Result<RecordId, KeyError> {
        let key = IdempotencyKey::parse(message_id.as_bytes())?;
        Ok(self.hasher.record_id(&self.scope, &key))
    }

    /// Claims `message_id` in a new transaction: `Ran(claimed)` when this caller must handle
    /// it (write the effect on `claimed`, then [`Claimed::commit`]), `Duplicate` when it was
    /// handled already. [`run`](Self::run) does all of it around a closure.
    pub async fn begin<E>(&self, message_id: &str) -> Result<Handled<Claimed<S>>, InboxError<E>> {
        let id = self
            .record_id(message_id)
            .map_err(|source| InboxError::InvalidId {
                id: message_id.to_owned(),
                source,
            })?;
        let claim = Claim {
            id,
            fingerprint: self.fingerprint.clone(),
            now: self.clock.now(),
            retention: self.retention,
            sealed_key: None,
            first_sent: None,
        };
        let mut tx = self.store.begin().await?;
        let outcome = match protocol::claim(&self.store, &mut tx, &claim).await {
            Ok(outcome) => outcome,
            Err(protocol::Error::Store(e)) => return Err(InboxError::Store(e)),
            Err(e) => return Err(InboxError::Store(StoreError::Database(Box::new(e)))),
        };
        let unusable = |reason| InboxError::Unusable {
            id: message_id.to_owned(),
            reason,
        };
        match outcome {
            ClaimOutcome::Owned { token, .. } => Ok(Handled::Ran(Claimed {
                store: self.store.clone(),
                tx,
                id: claim.id,
                token,
                clock: self.clock.clone(),
            })),
            ClaimOutcome::Replay { .. } => Ok(Handled::Duplicate),
            ClaimOutcome::InFlight { .. } => Err(InboxError::InFlight(message_id.to_owned())),
            ClaimOutcome::Mismatch { .. } => {
                Err(unusable("it was claimed with another fingerprint"))
            }
            ClaimOutcome::OutcomeUnknown { .. } => {
                // Keep the `indeterminate` mark the claim may have left, for operators.
                let _ = self.store.commit(tx).await;
                Err(unusable("its outcome is unknown"))
            }
        }
    }

    /// Handles `message_id` once: claims its record, runs `handler` on the claim's
    /// transaction, completes the record and commits (see the type's docs). A handler error
    /// rolls back its effect and the record, and is returned as [`InboxError::Handler`].
    ///
    /// The handler gets the transaction's connection for the lifetime of its future, so it
    /// owns what it uses (`move` it in).
    pub async fn run<T, E, F>(
        &self,
        message_id: &str,
        handler: F,
    ) -> Result<Handled<T>, InboxError<E>>
    where
        F: for<'c> FnOnce(&'c mut S::Connection) -> BoxFuture<'c, Result<T, E>>,
    {
        let mut claimed = match self.begin(message_id).await? {
            Handled::Ran(claimed) => claimed,
            Handled::Duplicate => return Ok(Handled::Duplicate),
        };
        // An error drops `claimed`: rolled back.
        let value = handler(&mut claimed).await.map_err(InboxError::Handler)?;
        claimed.commit().await?;
        Ok(Handled::Ran(value))
    }
}
