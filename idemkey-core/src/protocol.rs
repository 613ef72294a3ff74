//! The claim protocol, written once for every store.
//!
//! **Local mode** ([`claim`], [`complete`]): the claim is one `INSERT … ON CONFLICT DO
//! NOTHING` in a transaction the caller owns; the caller writes its effect on the same
//! transaction, then [`complete`] stores the response and the caller commits. A loser learns
//! it lost from the insert that inserted nothing, which also returns the record when the
//! store can read it in the same statement (else the loser reads it), and lets [`decide`]
//! say what to answer.
//!
//! **External mode** ([`reserve`] and [`Lease`]): the claim commits at once with a lease and
//! a fencing token; every later write carries the token and is refused when it is stale.
//! [`reserve_at_point_of_no_return`] is the same claim with the point of no return marked in
//! the reservation's write, for an owner that calls out at once.

use std::sync::Arc;
use std::time::Duration;

use crate::{
    AuditEntry, Begun, Clock, Decision, Fingerprint, Inserted, Mismatch, NewRecord, Record,
    RecordId, RecordState, Store, StoreAdmin, StoreError, StoredResponse, Timestamp, decide,
    fresh_token,
};

/// How many times the claim inserts again after the record it lost to vanished (released,
/// evicted or purged between the insert and the read) or was replaced by another taker,
/// before it gives up and answers "in flight". Each extra round needs another writer to win
/// yet another race in that short window.
const MAX_ROUNDS: usize = 4;

/// Protocol errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The write carried a stale fencing token: another owner holds the record now.
    #[error("the idempotency record is held by a newer owner; this owner's write was refused")]
    Fenced,
    /// An operator asked to resolve a record that is not indeterminate.
    #[error("the record is {0}, not indeterminate; only indeterminate records are resolved")]
    NotIndeterminate(RecordState),
    /// No such record.
    #[error("no such idempotency record")]
    NotFound,
}

/// A `Result` with the protocol [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A request to claim a key.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The record identity.
    pub id: RecordId,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The time of the attempt.
    pub now: Timestamp,
    /// How long the record is kept (and replayed) once claimed.
    pub retention: Duration,
    /// External mode: the raw key, sealed, for a reconciler (`None` in local mode).
    pub sealed_key: Option<Vec<u8>>,
    /// The first attempt's time the request states, stored with the record it claims and
    /// compared with the one a record holds.
    pub first_sent: Option<Timestamp>,
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// This attempt owns the key and must run the operation, writing with `token`.
    Owned {
        /// The fencing token of this ownership.
        token: i64,
        /// When the record expires.
        expires_at: Timestamp,
    },
    /// Answer with the stored response.
    Replay {
        /// The stored response.
        response: StoredResponse,
        /// When the record expires.
        expires_at: Timestamp,
        /// The first attempt's time the record holds (see [`Record::first_sent`]).
        first_sent: Option<Timestamp>,
    },
    /// The key was used with a different request.
    Mismatch {
        /// What differs.
        mismatch: Mismatch,
        /// When the record that holds the key expires.
        expires_at: Timestamp,
    },
    /// Another attempt is running.
    InFlight {
        /// The owner's lease, when there is one.
        lease_expires_at: Option<Timestamp>,
        /// When the owner's record expires: `None` when no record was read (the store's
        /// lock was not granted in time, or the claim gave up after racing takers).
        expires_at: Option<Timestamp>,
    },
    /// The outcome of the first attempt is unknown; it is not re-executed.
    OutcomeUnknown {
        /// When the record expires.
        expires_at: Timestamp,
    },
}

/// Local mode: claims the key on `conn`, a transaction the caller owns.
///
/// On [`ClaimOutcome::Owned`] the caller writes its effect on the same transaction, calls
/// [`complete`], and commits. On any other outcome the caller has written nothing of its
/// own; committing keeps a possible `indeterminate` mark, rolling back is also safe.
///
/// A lock the store could not get in time ([`StoreError::Busy`]) answers
/// [`ClaimOutcome::InFlight`]: the owner still holds the key.
pub async fn claim<S: Store>(
    store: &S,
    conn: &mut S::Connection,
    claim: &Claim,
) -> Result<ClaimOutcome> {
    let record = new_record(claim, RecordState::Executing, None);
    claim_after(store, conn, &record, claim, None).await
}

/// Local mode: starts a transaction and claims the key in it ([`Store::begin_claim`], one
/// round trip where the store can), then goes on as [`claim`] does.
///
/// Returns the transaction with the outcome; `None` instead of a transaction when the claim
/// was not granted the lock on the key in time (then the outcome is
/// [`ClaimOutcome::InFlight`]). A store that could not begin at all (SQLite's write lock not
/// granted in time: [`StoreError::Busy`]) is an error, not "in flight".
pub async fn begin_claim<S: Store>(
    store: &S,
    claim: &Claim,
    lock_wait: Option<Duration>,
) -> Result<(Option<S::Transaction>, ClaimOutcome)> {
    let record = new_record(claim, RecordState::Executing, None);
    let (mut tx, first) = match store.begin_claim(&record, lock_wait).await? {
        Begun::Claimed(tx, inserted) => (tx, inserted),
        Begun::Held => return Ok((None, in_flight())),
    };
    let outcome = claim_after(store, &mut tx, &record, claim, Some(first)).await?;
    Ok((Some(tx), outcome))
}

/// Local mode: stores the owner's response on the same transaction as its effect, as
/// completed at `now`.
pub async fn complete<S: Store>(
    store: &S,
    conn: &mut S::Connection,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> Result<()> {
    if store.complete(conn, id, token, response, now).await? {
        Ok(())
    } else {
        Err(Error::Fenced)
    }
}

/// External mode: reserves the key with a lease; the reservation commits at once.
///
/// On [`ClaimOutcome::Owned`], build a [`Lease`] from the token and carry every later write
/// through it.
pub async fn reserve<S: Store>(store: &S, claim: &Claim, lease: Duration) -> Result<ClaimOutcome> {
    reserve_as(store, claim, lease, RecordState::Reserved).await
}

/// External mode, for an owner that calls out as soon as it holds the key: reserves the key
/// with the point of no return already marked (`executing`), one write instead of two.
///
/// Build the [`Lease`] with [`Lease::marked_at_reservation`]: its
/// [`point_of_no_return`](Lease::point_of_no_return) then writes nothing. The cost is in the
/// crash window: an owner that vanishes after this write and before its request left leaves
/// the operation indeterminate (resolved by a reconciler or an operator) instead of free for
/// a retry to take over once the lease lapses. A failure the owner sees itself (the other
/// service refused the connection) still releases the key.
pub async fn reserve_at_point_of_no_return<S: Store>(
    store: &S,
    claim: &Claim,
    lease: Duration,
) -> Result<ClaimOutcome> {
    reserve_as(store, claim, lease, RecordState::Executing).await
}

async fn reserve_as<S: Store>(
    store: &S,
    claim: &Claim,
    lease: Duration,
    state: RecordState,
) -> Result<ClaimOutcome> {
    let record = new_record(claim, state, Some(claim.now.plus(lease)));
    // A fresh key ends with this one write, which the store may commit together with
    // other reservations; a taken key goes on on a connection of its own.
    let first = match store.insert_autocommit(&record).await {
        Ok(Inserted::Owned) => {
            return Ok(ClaimOutcome::Owned {
                token: record.token,
                expires_at: record.expires_at,
            });
        }
        Ok(inserted) => inserted,
        Err(StoreError::Busy(_)) => return Ok(in_flight()),
        Err(e) => return Err(e.into()),
    };
    let mut conn = store.acquire_for_write().await?;
    claim_after(store, &mut conn, &record, claim, Some(first)).await
}

fn new_record(claim: &Claim, state: RecordState, lease: Option<Timestamp>) -> NewRecord {
    NewRecord {
        id: claim.id.clone(),
        fingerprint: claim.fingerprint.clone(),
        state,
        token: fresh_token(),
        lease_expires_at: lease,
        now: claim.now,
        expires_at: claim.now.plus(claim.retention),
        sealed_key: claim.sealed_key.clone(),
        first_sent: claim.first_sent,
    }
}

/// The claim from its insert on: `first` is what an insert already sent found (by
/// [`Store::begin_claim`]); without it, the first round inserts.
async fn claim_after<S: Store>(
    store: &S,
    conn: &mut S::Connection,
    record: &NewRecord,
    claim: &Claim,
    mut first: Option<Inserted>,
) -> Result<ClaimOutcome> {
    let owned = |token| ClaimOutcome::Owned {
        token,
        expires_at: record.expires_at,
    };
    for _ in 0..MAX_ROUNDS {
        // The claim. Fresh keys end here, with one statement; so do replays of records
        // committed before it, which the same statement returns.
        let inserted = match first.take() {
            Some(inserted) => Ok(inserted),
            None => store.insert(conn, record).await,
        };
        let existing = match inserted {
            Ok(Inserted::Owned) => return Ok(owned(record.token)),
            Ok(Inserted::Existing(existing)) => Some(*existing),
            // Lost to a record the insert could not see (committed while it waited on it):
            // read what the owner left.
            Ok(Inserted::Conflict) => match store.fetch(conn, &record.id).await {
                Ok(existing) => existing,
                Err(StoreError::Busy(_)) => return Ok(in_flight()),
                Err(e) => return Err(e.into()),
            },
            Err(StoreError::Busy(_)) => return Ok(in_flight()),
            Err(e) => return Err(e.into()),
        };
        match decide(
            existing.as_ref(),
            &claim.fingerprint,
            claim.first_sent,
            claim.now,
        ) {
            // Deleted between our insert and our read (released, evicted, purged): again.
            Decision::Execute => continue,
            Decision::TakeOver { token } => match store.replace(conn, record, token).await {
                Ok(Some(token)) => return Ok(owned(token)),
                Ok(None) => continue,
                Err(StoreError::Busy(_)) => return Ok(in_flight()),
                Err(e) => return Err(e.into()),
            },
            decision => {
                if let Some(answer) = answer_from(
                    store,
                    conn,
                    &record.id,
                    decision,
                    existing.as_ref(),
                    claim.now,
                )
                .await?
                {
                    return Ok(answer);
                }
            }
        }
    }
    Ok(in_flight())
}

/// The answer a request gets from a record it cannot claim (a replay, a mismatch, in flight,
/// outcome unknown), each carrying the expiry of `existing`, the record it was decided from;
/// `None` when the record can be
/// claimed (`Execute`, `TakeOver`). A lapsed executing record is marked indeterminate first,
/// so operators and metrics see it; if its token moved, someone else marked or resolved it
/// first: same answer.
async fn answer_from<S: Store>(
    store: &S,
    conn: &mut S::Connection,
    id: &RecordId,
    decision: Decision<'_>,
    existing: Option<&Record>,
    now: Timestamp,
) -> Result<Option<ClaimOutcome>> {
    // Every answer below is given because this record exists: it carries its expiry.
    let expires_at = existing.map_or(now, |r| r.expires_at);
    Ok(Some(match decision {
        Decision::Execute | Decision::TakeOver { .. } => return Ok(None),
        Decision::Replay(response) => ClaimOutcome::Replay {
            response: response.clone(),
            expires_at,
            first_sent: existing.and_then(|r| r.first_sent),
        },
        Decision::Mismatch(mismatch) => ClaimOutcome::Mismatch {
            mismatch,
            expires_at,
        },
        Decision::InFlight { lease_expires_at } => ClaimOutcome::InFlight {
            lease_expires_at,
            expires_at: Some(expires_at),
        },
        Decision::OutcomeUnknown { mark_indeterminate } => {
            if let Some(token) = mark_indeterminate {
                store.mark_indeterminate(conn, id, token, now).await?;
            }
            ClaimOutcome::OutcomeUnknown { expires_at }
        }
    }))
}

/// What the record `id` answers a request, read without claiming anything: what a claim
/// that lost to the record would get, by the same [`decide`], from the request's
/// `fingerprint` and first-sent time. `None` when there is nothing to answer from (no
/// record, an expired one, or a reservation whose owner stopped before the point of no
/// return). The record is read on a pooled connection of its own, outside any transaction of
/// the caller's; the only write is marking a lapsed executing record indeterminate.
///
/// Two callers: key-secret rotation reads the record kept under the previous secret's
/// identity before a claim under the current one (`None`: claim); a request whose first
/// attempt is too old for its record to be trusted to exist
/// ([`FirstSentPolicy::is_late`](crate::FirstSentPolicy::is_late)) is answered by a live
/// record or refused (`None`: refuse), so that no attempt of it claims the key.
pub async fn lookup<S: Store>(
    store: &S,
    id: &RecordId,
    fingerprint: &Fingerprint,
    first_sent: Option<Timestamp>,
    now: Timestamp,
) -> Result<Option<ClaimOutcome>> {
    let mut conn = store.acquire().await?;
    let existing = match store.fetch(&mut conn, id).await {
        Ok(existing) => existing,
        Err(StoreError::Busy(_)) => return Ok(Some(in_flight())),
        Err(e) => return Err(e.into()),
    };
    let decision = decide(existing.as_ref(), fingerprint, first_sent, now);
    answer_from(store, &mut conn, id, decision, existing.as_ref(), now).await
}

/// Local mode's [`lookup`] for a request whose first attempt is too old for its record to be
/// trusted to exist ([`FirstSentPolicy::is_late`](crate::FirstSentPolicy::is_late)): the
/// claim [`begin_claim`] makes, waiting at most a millisecond for another attempt's lock, and
/// rolled back when it would own the key, so that nothing of it lasts. `None`: nothing
/// answers (no record, an expired one), refuse the request.
///
/// A local claim commits with its effect, so a record read sees no attempt still running;
/// this claim meets its uncommitted row (PostgreSQL) and answers
/// [`ClaimOutcome::InFlight`], as [`lookup`] does for an external reservation. On SQLite the
/// write lock, which any write may hold, is waited for as long as the store's busy time-out,
/// as any claim does there.
pub async fn probe<S: Store>(store: &S, claim: &Claim) -> Result<Option<ClaimOutcome>> {
    match begin_claim(store, claim, Some(Duration::from_millis(1))).await? {
        (tx, ClaimOutcome::Owned { .. }) => {
            drop(tx); // rolled back: the key stays free
            Ok(None)
        }
        (tx, outcome) => {
            // Nothing was written but a possible `indeterminate` mark, which is kept.
            if let Some(tx) = tx {
                store.commit(tx).await?;
            }
            Ok(Some(outcome))
        }
    }
}

/// "In flight" without a record in hand: no lease and no expiry to tell.
fn in_flight() -> ClaimOutcome {
    ClaimOutcome::InFlight {
        lease_expires_at: None,
        expires_at: None,
    }
}

/// External mode: the owner's handle on a reserved record. Every write carries the fencing
/// token and fails with [`Error::Fenced`] once a newer owner took over.
#[derive(Debug, Clone)]
pub struct Lease<S> {
    store: S,
    id: RecordId,
    token: i64,
    duration: Duration,
    /// `None`: the system clock.
    clock: Option<Arc<dyn Clock>>,
    /// `Some(until)`: the reservation marked the point of no return, and its lease lapses at
    /// `until` unless renewed.
    marked: Option<Timestamp>,
}

impl<S: Store> Lease<S> {
    /// The handle for an [`ClaimOutcome::Owned`] reservation.
    pub fn new(store: S, id: RecordId, token: i64, duration: Duration) -> Self {
        Self {
            store,
            id,
            token,
            duration,
            clock: None,
            marked: None,
        }
    }

    /// For a reservation from [`reserve_at_point_of_no_return`] made at `reserved_at` (the
    /// claim's `now`): the point of no return is already marked, and
    /// [`point_of_no_return`](Self::point_of_no_return) only checks that the reservation's
    /// own lease has not lapsed.
    pub fn marked_at_reservation(mut self, reserved_at: Timestamp) -> Self {
        self.marked = Some(reserved_at.plus(self.duration));
        self
    }

    /// Reads the time from `clock` instead of the system clock.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    fn now(&self) -> Timestamp {
        self.clock
            .as_ref()
            .map_or_else(Timestamp::now, |clock| clock.now())
    }

    /// The fencing token.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// How long the lease lasts from each renewal.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// The record identity.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// Extends the lease by its duration from now.
    pub async fn renew(&self) -> Result<()> {
        let now = self.now();
        let until = now.plus(self.duration);
        let mut conn = self.store.acquire_for_write().await?;
        let ok = self
            .store
            .renew(&mut conn, &self.id, self.token, until, now)
            .await?;
        fenced_unless(ok)
    }

    /// Marks the point of no return, just before the request leaves for the other service.
    /// From here on, an owner that vanishes leaves the operation indeterminate.
    ///
    /// When the reservation marked it already ([`marked_at_reservation`](Self::marked_at_reservation)),
    /// this writes nothing, and fails with [`Error::Fenced`] once the reservation's own lease
    /// has passed, renewed or not: past it, another attempt may have found the record lapsed
    /// and marked it indeterminate (which a renewal does not undo), and a request sent then
    /// could be released by a reconciler that asked before it arrived. An owner that calls
    /// out at once is far inside that bound.
    pub async fn point_of_no_return(&self) -> Result<()> {
        let now = self.now();
        if let Some(until) = self.marked {
            return fenced_unless(now < until);
        }
        let mut conn = self.store.acquire_for_write().await?;
        let ok = self
            .store
            .mark_executing(
                &mut conn,
                &self.id,
                self.token,
                now.plus(self.duration),
                now,
            )
            .await?;
        fenced_unless(ok)
    }

    /// Stores the outcome.
    pub async fn complete(&self, response: &StoredResponse) -> Result<()> {
        let ok = self
            .store
            .complete_autocommit(&self.id, self.token, response, self.now())
            .await?;
        fenced_unless(ok)
    }

    /// Frees the key: nothing was sent, a retry may execute.
    pub async fn release(&self) -> Result<()> {
        let mut conn = self.store.acquire_for_write().await?;
        let ok = self.store.release(&mut conn, &self.id, self.token).await?;
        fenced_unless(ok)
    }

    /// Marks the outcome unknown (a time-out or reset after the request was sent).
    pub async fn mark_indeterminate(&self) -> Result<()> {
        let mut conn = self.store.acquire_for_write().await?;
        let ok = self
            .store
            .mark_indeterminate(&mut conn, &self.id, self.token, self.now())
            .await?;
        fenced_unless(ok)
    }
}

fn fenced_unless(ok: bool) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::Fenced) }
}

/// How an operator or a reconciler resolves a record whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The effect happened: store this outcome; retries replay it.
    Completed(StoredResponse),
    /// The effect did not happen: free the key; the next retry executes.
    Released,
}

/// Operator or reconciler: resolves a record whose outcome is unknown (indeterminate, or
/// past the point of no return with a lapsed lease). Raises the fencing token, so a stale
/// owner cannot overwrite the answer, and appends an entry to the audit trail (`actor`,
/// the action, the stored status and `note`) in the same transaction.
///
/// Returns the record as it was before it was resolved. `now` decides whether the outcome
/// is unknown (a lease lapsed) and dates the completion and the audit entry.
pub async fn resolve<S: StoreAdmin>(
    store: &S,
    id: &RecordId,
    resolution: &Resolution,
    actor: &str,
    note: Option<&str>,
    now: Timestamp,
) -> Result<Record> {
    let mut tx = store.begin().await?;
    let record = store.fetch(&mut tx, id).await?.ok_or(Error::NotFound)?;
    let unknown = matches!(
        decide(Some(&record), &record.fingerprint, None, now),
        Decision::OutcomeUnknown { .. }
    );
    if !unknown {
        return Err(Error::NotIndeterminate(record.state));
    }
    let (ok, action, mut detail) = match resolution {
        Resolution::Completed(response) => (
            store
                .complete(&mut tx, id, record.token, response, now)
                .await?,
            "resolved-completed",
            format!("status {}", response.status),
        ),
        Resolution::Released => (
            store.release(&mut tx, id, record.token).await?,
            "resolved-released",
            "key released".to_owned(),
        ),
    };
    fenced_unless(ok)?;
    if let Some(note) = note.filter(|n| !n.is_empty()) {
        detail.push_str("; ");
        detail.push_str(note);
    }
    let entry = AuditEntry {
        id: id.clone(),
        at: now,
        actor: actor.to_owned(),
        action: action.to_owned(),
        detail,
    };
    store.append_audit(&mut tx, &entry).await?;
    store.commit(tx).await?;
    Ok(record)
}

/// Deletes every record expired at `now`, `batch` rows per statement, the earliest expiry
/// first, each batch committed on its own so live traffic is never blocked for long. Returns
/// how many it deleted.
pub async fn purge_expired<S: StoreAdmin>(store: &S, now: Timestamp, batch: u32) -> Result<u64> {
    let batch = batch.max(1);
    let mut total = 0;
    let mut from = None;
    let mut conn = store.acquire().await?;
    loop {
        let purged = store.purge_batch(&mut conn, now, from, batch).await?;
        total += purged.deleted;
        if purged.deleted < u64::from(batch) {
            return Ok(total);
        }
        from = purged.through;
    }
}
