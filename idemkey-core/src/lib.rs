//! # idemkey-core
//!
//! The storage-independent heart of idemkey: it makes retried HTTP writes safe by giving
//! every logical operation an identity (`tenant`, `route`, `Idempotency-Key`), claiming
//! that identity atomically, and replaying the stored outcome to every retry.
//!
//! - [`IdempotencyKey`]: parsing and validation of the header;
//! - [`Scope`], [`KeyHasher`], [`RecordId`]: identity, with the raw key replaced by a keyed hash;
//! - [`fingerprint()`]: the canonical request fingerprint (RFC 8785 for JSON);
//! - [`Record`], [`RecordState`], [`StoredResponse`]: what is stored;
//! - [`FirstSentPolicy`]: the first attempt's time a request states, and when it is too late
//!   for its record to be trusted to exist;
//! - [`decide`]: the one pure function that says execute / replay / mismatch / in-flight /
//!   outcome-unknown;
//! - [`after_effect`] and [`AnswerRule`]: the one pure function that says what becomes of an
//!   external-mode record once its owner is done (complete / release / indeterminate), with
//!   [`owner_progress`], [`answer_not_captured`], [`local_after_effect`] (local mode) and
//!   [`reconciled`] (the gateway's reconciler) beside it;
//! - [`Store`]: the SQL primitives of the claim protocol a backend provides, and
//!   [`StoreAdmin`] the operator's (list, look up, evict, purge, audit);
//! - [`protocol`]: the claim protocol on top of them, written once for every store;
//! - [`outbox`]: the SQL primitives of the transactional outbox ([`outbox::OutboxStore`]).
//!
//! - [`Clock`]: where the current time comes from and how to wait for it to pass.
//! - `hop` (feature `http`): the hop-by-hop headers a proxy must not forward, for the
//!   gateway and the fault proxy.
//!
//! No I/O happens here, and no runtime is needed: the stores (`idemkey-sqlite`,
//! `idemkey-postgres`) speak SQL, and what the sqlx ones share lives in `idemkey-sqlx`.

mod decision;
mod eviction;
mod fingerprint;
mod first_sent;
#[cfg(feature = "http")]
pub mod hop;
mod jcs;
mod key;
pub mod outbox;
pub mod problem;
pub mod protocol;
mod record;
mod redact;
mod scope;
mod store;
mod time;

pub use self::decision::{
    AfterEffect, AnswerRule, AnswerRuleError, Decision, Mismatch, Progress, REFUSALS, after_effect,
    answer_not_captured, decide, local_after_effect, owner_progress, reconciled,
};
pub use self::eviction::{EvictionNotice, EvictionNotices};
pub use self::fingerprint::*;
pub use self::first_sent::{
    FIRST_SENT_HEADER, FirstSentError, FirstSentPolicy, FirstSentRequirement,
    REPEATABILITY_RESULT_HEADER, http_date,
};
pub use self::key::{HEADER_NAME, IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use self::record::{AuditEntry, NewRecord, Record, RecordState, StoredResponse, fresh_token};
pub use self::redact::{CREDENTIAL_PARAMETERS, redact_url};
pub use self::scope::{KeyHasher, RecordId, Scope};
pub use self::store::{
    Begun, BoxError, CommitError, Inserted, ListFilter, Purged, Store, StoreAdmin, StoreError,
};
pub use self::time::{Clock, Sleep, Timestamp};
