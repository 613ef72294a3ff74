//! The decision function: what to do with a request, given the record the store holds.
//!
//! This is the only place that interprets a record. Stores fetch and write rows; the claim
//! protocol ([`crate::protocol`]) calls [`decide`] and carries out its answer.

use crate::{Fingerprint, Record, RecordState, StoredResponse, Timestamp};

/// What to do with a keyed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<'r> {
    /// No record: claim the key and run the operation.
    Execute,
    /// A record exists but may be replaced: it expired, or its owner's lease lapsed before
    /// the point of no return. Replace it only if it still carries `token`.
    TakeOver {
        /// The fencing token the record must still carry.
        token: i64,
    },
    /// Completed with the same fingerprint: answer with the stored response.
    Replay(&'r StoredResponse),
    /// The key was used for a different request.
    Mismatch(Mismatch),
    /// The first attempt is still running.
    InFlight {
        /// The owner's lease, when there is one (external mode).
        lease_expires_at: Option<Timestamp>,
    },
    /// The effect may have happened and nobody knows its outcome. Never re-executed.
    OutcomeUnknown {
        /// `Some(token)` when the record is still `executing` with a lapsed lease and must
        /// first be marked `indeterminate` (only if it still carries `token`).
        settle: Option<i64>,
    },
}

/// Which parts of the request differ from the one that claimed the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mismatch {
    /// Path parameters differ.
    pub params: bool,
    /// The query string differs.
    pub query: bool,
    /// The body (or its media type) differs.
    pub body: bool,
}

impl Mismatch {
    /// The names of the differing parts, e.g. `["body"]`.
    pub fn parts(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.params {
            v.push("path parameters");
        }
        if self.query {
            v.push("query");
        }
        if self.body {
            v.push("body");
        }
        v
    }
}

/// Decides what a request with `fingerprint` does, given the `existing` record at `now`.
///
/// The order matters: an expired record is as good as absent (retention is the documented
/// limit of the contract); a different fingerprint is refused whatever the state, since it
/// is never a retry; only then does the state speak.
pub fn decide<'r>(
    existing: Option<&'r Record>,
    fingerprint: &Fingerprint,
    now: Timestamp,
) -> Decision<'r> {
    let Some(record) = existing else {
        return Decision::Execute;
    };
    if record.is_expired(now) {
        return Decision::TakeOver {
            token: record.token,
        };
    }
    if record.fingerprint.digest != fingerprint.digest {
        let (a, b) = (record.fingerprint.parts, fingerprint.parts);
        let mut m = Mismatch {
            params: a.params != b.params,
            query: a.query != b.query,
            body: a.body != b.body,
        };
        if m == Mismatch::default() {
            // Digests differ while the parts agree (a different encoding version, say):
            // the body is the part a client can change, so name it.
            m.body = true;
        }
        return Decision::Mismatch(m);
    }
    let lease_lapsed = record.lease_expires_at.is_some_and(|t| t <= now);
    match record.state {
        RecordState::Completed => match &record.response {
            Some(response) => Decision::Replay(response),
            // A completed record without a response cannot be replayed honestly.
            None => Decision::OutcomeUnknown { settle: None },
        },
        RecordState::Indeterminate => Decision::OutcomeUnknown { settle: None },
        RecordState::Reserved if lease_lapsed => Decision::TakeOver {
            token: record.token,
        },
        RecordState::Executing if lease_lapsed => Decision::OutcomeUnknown {
            settle: Some(record.token),
        },
        RecordState::Reserved | RecordState::Executing => Decision::InFlight {
            lease_expires_at: record.lease_expires_at,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FingerprintParts, RecordId};

    fn fp(n: u8) -> Fingerprint {
        Fingerprint {
            digest: [n; 32],
            parts: FingerprintParts {
                params: [0; 8],
                query: [0; 8],
                body: [n; 8],
            },
        }
    }

    fn record(state: RecordState, lease: Option<i64>) -> Record {
        Record {
            id: RecordId {
                tenant: "t".into(),
                key_hash: [0; 32],
                route: "POST /p".into(),
            },
            fingerprint: fp(1),
            state,
            token: 7,
            lease_expires_at: lease.map(Timestamp),
            response: (state == RecordState::Completed).then(|| StoredResponse {
                status: 201,
                headers: vec![],
                body: b"ok".to_vec(),
            }),
            created_at: Timestamp(0),
            updated_at: Timestamp(0),
            expires_at: Timestamp(1_000),
            sealed_key: None,
        }
    }

    const NOW: Timestamp = Timestamp(500);

    #[test]
    fn executes_when_no_record() {
        assert_eq!(decide(None, &fp(1), NOW), Decision::Execute);
    }

    #[test]
    fn replays_completed_record_with_same_fingerprint() {
        let r = record(RecordState::Completed, None);
        assert!(
            matches!(decide(Some(&r), &fp(1), NOW), Decision::Replay(resp) if resp.body == b"ok")
        );
    }

    #[test]
    fn rejects_mismatched_fingerprint_naming_the_part() {
        let r = record(RecordState::Completed, None);
        assert_eq!(
            decide(Some(&r), &fp(2), NOW),
            Decision::Mismatch(Mismatch {
                body: true,
                ..Mismatch::default()
            })
        );
    }

    #[test]
    fn mismatch_wins_over_in_flight() {
        let r = record(RecordState::Reserved, Some(900));
        assert!(matches!(
            decide(Some(&r), &fp(2), NOW),
            Decision::Mismatch(_)
        ));
    }

    #[test]
    fn expired_record_is_taken_over_never_replayed() {
        let r = record(RecordState::Completed, None);
        assert_eq!(
            decide(Some(&r), &fp(2), Timestamp(1_000)),
            Decision::TakeOver { token: 7 }
        );
    }

    #[test]
    fn live_lease_is_in_flight() {
        for state in [RecordState::Reserved, RecordState::Executing] {
            let r = record(state, Some(900));
            assert_eq!(
                decide(Some(&r), &fp(1), NOW),
                Decision::InFlight {
                    lease_expires_at: Some(Timestamp(900))
                }
            );
        }
    }

    #[test]
    fn lapsed_lease_before_point_of_no_return_is_taken_over() {
        let r = record(RecordState::Reserved, Some(400));
        assert_eq!(
            decide(Some(&r), &fp(1), NOW),
            Decision::TakeOver { token: 7 }
        );
    }

    #[test]
    fn lapsed_lease_after_point_of_no_return_turns_indeterminate() {
        let r = record(RecordState::Executing, Some(400));
        assert_eq!(
            decide(Some(&r), &fp(1), NOW),
            Decision::OutcomeUnknown { settle: Some(7) }
        );
    }

    #[test]
    fn indeterminate_is_never_executed() {
        let r = record(RecordState::Indeterminate, None);
        assert_eq!(
            decide(Some(&r), &fp(1), Timestamp(999)),
            Decision::OutcomeUnknown { settle: None }
        );
    }
}
