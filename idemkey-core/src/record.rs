//! The idempotency record, its states and the stored response.

use crate::{Fingerprint, RecordId, Timestamp};

/// Where an operation stands.
///
/// ```text
/// reserved ──► executing ──► completed
///                  │
///                  └──────► indeterminate ──(reconcile / operator)──► completed | released
/// ```
///
/// In local mode the claim, the effect and the completion share one transaction, so other
/// requests only ever see `completed` records from it. `reserved` and `executing` are
/// visible in external mode, where the claim commits on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed, leased, and the effect has certainly not started: a lapsed lease may be
    /// taken over.
    Reserved,
    /// Past the point of no return: the effect may have happened.
    Executing,
    /// The outcome is stored and is replayed to every retry.
    Completed,
    /// The effect may or may not have happened; never re-executed on its own.
    Indeterminate,
}

impl RecordState {
    /// The name stored in the `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Executing => "executing",
            Self::Completed => "completed",
            Self::Indeterminate => "indeterminate",
        }
    }

    /// Parses a stored state name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "reserved" => Self::Reserved,
            "executing" => Self::Executing,
            "completed" => Self::Completed,
            "indeterminate" => Self::Indeterminate,
            _ => return None,
        })
    }
}

impl std::fmt::Display for RecordState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A response as stored for replay: status, allowlisted headers, body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Allowlisted headers (lower-case names), in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// Encodes the headers for the `response_headers` column:
    /// per header `u16 name length ‖ name ‖ u32 value length ‖ value`, big-endian.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
        out
    }

    /// Decodes [`encode_headers`](Self::encode_headers); `None` if the bytes are malformed.
    pub fn decode_headers(mut bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
        fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            if bytes.len() < n {
                return None;
            }
            let (head, tail) = bytes.split_at(n);
            *bytes = tail;
            Some(head)
        }
        let mut headers = Vec::new();
        while !bytes.is_empty() {
            let n = u16::from_be_bytes(take(&mut bytes, 2)?.try_into().ok()?) as usize;
            let name = String::from_utf8(take(&mut bytes, n)?.to_vec()).ok()?;
            let n = u32::from_be_bytes(take(&mut bytes, 4)?.try_into().ok()?) as usize;
            let value = take(&mut bytes, n)?.to_vec();
            headers.push((name, value));
        }
        Some(headers)
    }
}

/// A stored idempotency record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Identity: tenant, keyed hash of the key, route.
    pub id: RecordId,
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// Where the operation stands.
    pub state: RecordState,
    /// Fencing token: raised by every takeover and operator resolution. A write that
    /// carries an older token is refused.
    pub token: i64,
    /// Until when the current owner holds the record (external mode).
    pub lease_expires_at: Option<Timestamp>,
    /// The stored outcome, once completed.
    pub response: Option<StoredResponse>,
    /// When the key was first claimed.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
    /// After this the record is never replayed and the key is free again.
    pub expires_at: Timestamp,
    /// External mode only: the raw key sealed with an AEAD keyed from the key secret, so a
    /// reconciler can ask the other service about the operation. `None` in local mode.
    pub sealed_key: Option<Vec<u8>>,
    /// The time of the operation's first attempt, as the claiming request stated it
    /// (`Repeatability-First-Sent`); `None` when it did not.
    pub first_sent: Option<Timestamp>,
}

impl Record {
    /// Whether the retention window has passed at `now`.
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.expires_at <= now
    }
}

/// What a claim writes: a fresh record owned by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRecord {
    /// Identity.
    pub id: RecordId,
    /// The claiming request's fingerprint.
    pub fingerprint: Fingerprint,
    /// `Executing` in local mode, `Reserved` in external mode.
    pub state: RecordState,
    /// The fencing token the claim starts with: [`fresh_token`], so that it is one no
    /// earlier claim of this identity held.
    pub token: i64,
    /// The lease, in external mode.
    pub lease_expires_at: Option<Timestamp>,
    /// The time of the claim.
    pub now: Timestamp,
    /// End of retention.
    pub expires_at: Timestamp,
    /// External mode only: the sealed raw key (see [`Record::sealed_key`]).
    pub sealed_key: Option<Vec<u8>>,
    /// The first attempt's time the claiming request stated (see [`Record::first_sent`]).
    pub first_sent: Option<Timestamp>,
}

/// A fencing token for a new claim: a random integer from 0 to 2^62 - 1, drawn afresh on
/// every call.
///
/// A key may be claimed anew once its record is gone (released, resolved as released,
/// evicted, purged), while an owner of the earlier claim may still be about to write with
/// its token. The token of that stale owner is the earlier claim's start plus the few raises
/// of its takeovers and resolutions, so it equals the new claim's token only by chance, with
/// a probability of about 2^-60: its write matches no row and changes nothing. Starting
/// every claim at the same value would let it match. Below 2^62 leaves room for the raises
/// (`token + 1`) without overflow.
///
/// The randomness is the standard library's, no dependency of its own: every
/// [`RandomState::new`] keys SipHash with the thread's random keys, the first of them
/// raised by one on every call, and the hash of nothing under those keys is 64 bits no one
/// without the keys can predict.
///
/// [`RandomState::new`]: std::hash::RandomState::new
pub fn fresh_token() -> i64 {
    use std::hash::{BuildHasher, Hasher};
    let bits = std::hash::RandomState::new().build_hasher().finish();
    // Two bits shifted out: the rest fits an i64 and is never negative.
    (bits >> 2) as i64
}

/// One entry of a record's audit trail: who resolved an operation, when, and how.
///
/// Entries are kept by identity, not by row, so they outlive a released record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    /// The record the entry is about.
    pub id: RecordId,
    /// When it happened.
    pub at: Timestamp,
    /// Who did it: `reconciler`, `operator:<user>`.
    pub actor: String,
    /// What was done, e.g. `resolved-completed`, `resolved-released`.
    pub action: String,
    /// Free text: the stored status, the operator's note.
    pub detail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_tokens_are_below_2_62_not_negative_and_differ() {
        let tokens: std::collections::HashSet<i64> = (0..1000).map(|_| fresh_token()).collect();
        assert_eq!(tokens.len(), 1000, "each draw is fresh");
        assert!(
            tokens.iter().all(|t| (0..1 << 62).contains(t)),
            "{tokens:?}"
        );
    }

    #[test]
    fn headers_round_trip() {
        let r = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("location".into(), vec![0xff, 0x00]),
            ],
            body: vec![],
        };
        assert_eq!(
            StoredResponse::decode_headers(&r.encode_headers()),
            Some(r.headers)
        );
        assert_eq!(StoredResponse::decode_headers(&[0, 5, b'a']), None);
    }

    #[test]
    fn state_names_round_trip() {
        for s in [
            RecordState::Reserved,
            RecordState::Executing,
            RecordState::Completed,
            RecordState::Indeterminate,
        ] {
            assert_eq!(RecordState::parse(s.as_str()), Some(s));
        }
        assert_eq!(RecordState::parse("bogus"), None);
    }
}
