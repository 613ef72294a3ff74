//! The two decisions: what to do with a request, given the record the store holds
//! ([`decide`]), and what becomes of a record once its owner is done ([`after_effect`], with
//! [`owner_progress`], [`answer_not_captured`], [`local_after_effect`] and, for the gateway's
//! reconciler, [`reconciled`]).
//!
//! This is the only place that interprets a record or an owner's result. Stores fetch and
//! write rows; the claim protocol ([`crate::protocol`]), the layer and the gateway call these
//! functions and carry out their answers.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;

use crate::{Fingerprint, Members, Record, RecordState, StoredResponse, Timestamp};

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
        mark_indeterminate: Option<i64>,
    },
}

/// Which parts of the request differ from the one that claimed the key, and, for a JSON
/// body, the first member that differs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mismatch {
    /// Path parameters differ.
    pub params: bool,
    /// The query string differs.
    pub query: bool,
    /// The body (or its media type) differs.
    pub body: bool,
    /// The first attempt's time (`Repeatability-First-Sent`) differs from the one the
    /// record was claimed with.
    pub first_sent: bool,
    /// The JSON Pointer, in the **new** request's body, of the first member that differs
    /// (`docs/fingerprint.md`, "Naming the member that differs"); `None` when it cannot be
    /// told (not JSON, a record without member digests, past the bound).
    pub pointer: Option<String>,
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
        if self.first_sent {
            v.push("first-sent");
        }
        v
    }
}

/// `body` or `path parameters, body`, then `; first difference at "/amount"` when known.
impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.parts().join(", "))?;
        if let Some(pointer) = &self.pointer {
            write!(f, "; first difference at \"{pointer}\"")?;
        }
        Ok(())
    }
}

/// The first member of the new request's body that differs from the stored one, walking the
/// new request's values in canonical order (containers before their members):
///
/// - a value whose pointer the record does not know (an added member or element, or a
///   selected field that was missing before) is the difference;
/// - a scalar (or a missing selected field) whose value digest differs is the difference;
/// - an object or an array whose digest differs has other member names or another length:
///   its members are walked first, and if none of them differs (so one was removed), the
///   container itself is the difference, reported where its members end.
///
/// Only pointers of the new request are ever reported; the record holds none in clear.
fn first_differing_member(stored: &Members, new: &Members) -> Option<String> {
    if stored.digests().is_empty() || new.pointers().len() != new.digests().len() {
        return None;
    }
    let known: HashMap<[u8; 8], [u8; 8]> = stored
        .digests()
        .iter()
        .map(|d| (d.pointer, d.value))
        .collect();
    let inside = |pointer: &str, container: &str| {
        pointer
            .strip_prefix(container)
            .is_some_and(|rest| rest.starts_with('/'))
    };
    // Containers whose member names or length differ, innermost last.
    let mut open: Vec<&str> = Vec::new();
    for (digest, member) in new.digests().iter().zip(new.pointers()) {
        if let Some(&container) = open.last()
            && !inside(&member.pointer, container)
        {
            // Walked all of it, and no member differed: one was removed.
            return Some(container.to_owned());
        }
        match known.get(&digest.pointer) {
            None => return Some(member.pointer.clone()),
            Some(value) if *value == digest.value => {}
            Some(_) if member.container => open.push(&member.pointer),
            Some(_) => return Some(member.pointer.clone()),
        }
    }
    open.last().map(|&c| c.to_owned())
}

/// Decides what a request with `fingerprint`, stating its first attempt's time
/// `first_sent`, does, given the `existing` record at `now`.
///
/// The order matters: an expired record is as good as absent (retention is the documented
/// limit of the contract); a different fingerprint or first-sent time is refused whatever the
/// state, since it is never a retry; only then does the state speak. A first-sent time counts
/// only where both the record and the request have one: a request that does not state it (or
/// a record claimed without it) asserts nothing to compare.
pub fn decide<'r>(
    existing: Option<&'r Record>,
    fingerprint: &Fingerprint,
    first_sent: Option<Timestamp>,
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
    let first_sent_differs =
        matches!((record.first_sent, first_sent), (Some(a), Some(b)) if a != b);
    if record.fingerprint.digest != fingerprint.digest || first_sent_differs {
        let (a, b) = (record.fingerprint.parts, fingerprint.parts);
        let mut m = Mismatch {
            params: a.params != b.params,
            query: a.query != b.query,
            body: a.body != b.body,
            first_sent: first_sent_differs,
            pointer: None,
        };
        if m.body
            && let (Some(stored), Some(new)) = (&record.fingerprint.members, &fingerprint.members)
        {
            m.pointer = first_differing_member(stored, new);
        }
        if record.fingerprint.digest != fingerprint.digest && !(m.params || m.query || m.body) {
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
            None => Decision::OutcomeUnknown {
                mark_indeterminate: None,
            },
        },
        RecordState::Indeterminate => Decision::OutcomeUnknown {
            mark_indeterminate: None,
        },
        RecordState::Reserved if lease_lapsed => Decision::TakeOver {
            token: record.token,
        },
        RecordState::Executing if lease_lapsed => Decision::OutcomeUnknown {
            mark_indeterminate: Some(record.token),
        },
        RecordState::Reserved | RecordState::Executing => Decision::InFlight {
            lease_expires_at: record.lease_expires_at,
        },
    }
}

// ---------------------------------------------------------------------------------------
// After the effect.

/// How far the owner of an external-mode reservation got before it stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Nothing left for the other service: the owner stopped before the point of no return,
    /// whatever it answered (a refused connection, a store error, a validation error, a
    /// panic before calling out).
    NotSent,
    /// The request left and no complete answer came back: a time-out, a reset, a panic after
    /// the point of no return, or a handler that reported the outcome unknown.
    SentNoAnswer,
    /// The request left and this answer came back.
    Answered(u16),
}

/// What becomes of the record once its owner is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AfterEffect {
    /// Store the answer; every retry replays it.
    Complete,
    /// Free the key (delete the record): nothing was done, a retry runs afresh.
    Release,
    /// The effect may have happened: the record turns `indeterminate`, never re-executed on
    /// its own; a reconciler or an operator resolves it.
    Indeterminate,
}

impl AfterEffect {
    fn as_str(self) -> &'static str {
        match self {
            Self::Complete => "store",
            Self::Release => "release",
            Self::Indeterminate => "indeterminate",
        }
    }
}

impl fmt::Display for AfterEffect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AfterEffect {
    type Err = AnswerRuleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "store" | "complete" => Ok(Self::Complete),
            "release" => Ok(Self::Release),
            "indeterminate" | "unknown" => Ok(Self::Indeterminate),
            other => Err(AnswerRuleError(format!(
                "unknown action {other:?}: expected store, release or indeterminate"
            ))),
        }
    }
}

/// Which answers a route stores, which say that nothing was done (release), and which leave
/// the outcome unknown (indeterminate). A route's owner reads it with `Display` and changes
/// it per status or per class.
///
/// The default:
///
/// | answer | after the request left | in one local transaction |
/// |---|---|---|
/// | 400 401 403 405 406 408 411 413 414 415 422 429: the request was refused before any effect | release | roll back |
/// | 5xx: the server failed, perhaps half-way | indeterminate | roll back |
/// | every other status: an outcome (a success, a decline, a business 409, a 404) | store | store and commit |
///
/// ```
/// use idemkey_core::{AfterEffect, AnswerRule};
///
/// // An upstream whose 503 guarantees that nothing was done, and whose 500 is an outcome.
/// let rule: AnswerRule = "503=release 500=store".parse().unwrap();
/// assert_eq!(rule.classify(503), AfterEffect::Release);
/// assert_eq!(rule.classify(500), AfterEffect::Complete);
/// assert_eq!(rule.classify(502), AfterEffect::Indeterminate);
/// assert_eq!(rule.classify(422), AfterEffect::Release);
/// assert_eq!(rule.classify(201), AfterEffect::Complete);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnswerRule {
    /// Per-class overrides, indexed by the status's first digit (1–5).
    by_class: [Option<AfterEffect>; 6],
    /// Per-status overrides; they beat the class ones.
    by_status: BTreeMap<u16, AfterEffect>,
}

/// The statuses that say the request was refused before any effect could happen.
pub const REFUSALS: [u16; 12] = [400, 401, 403, 405, 406, 408, 411, 413, 414, 415, 422, 429];

impl AnswerRule {
    /// The default rule (see the type's documentation).
    pub fn new() -> Self {
        Self::default()
    }

    /// What an answer with `status` means under this rule.
    pub fn classify(&self, status: u16) -> AfterEffect {
        if let Some(effect) = self.by_status.get(&status) {
            return *effect;
        }
        if let Some(effect) = self.by_class[usize::from(status / 100).min(5)] {
            return effect;
        }
        if status >= 500 {
            AfterEffect::Indeterminate
        } else if REFUSALS.contains(&status) {
            AfterEffect::Release
        } else {
            AfterEffect::Complete
        }
    }

    /// `status` means `effect`, whatever its class says.
    pub fn status(mut self, status: u16, effect: AfterEffect) -> Self {
        self.by_status.insert(status, effect);
        self
    }

    /// Every status of `class` (1–5: `5` for 5xx) means `effect`, unless a per-status entry
    /// says otherwise.
    pub fn class(mut self, class: u8, effect: AfterEffect) -> Self {
        if let Some(slot) = self
            .by_class
            .get_mut(usize::from(class))
            .filter(|_| class >= 1)
        {
            *slot = Some(effect);
        }
        self
    }
}

impl fmt::Display for AnswerRule {
    /// The rule as a route's owner reads it, e.g.
    /// `store; release 400 401 403 405 406 408 411 413 414 415 422 429; indeterminate 5xx; 503=release`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("store; release")?;
        for s in REFUSALS {
            write!(f, " {s}")?;
        }
        f.write_str("; indeterminate 5xx")?;
        for (class, effect) in self.by_class.iter().enumerate() {
            if let Some(effect) = effect {
                write!(f, "; {class}xx={effect}")?;
            }
        }
        for (status, effect) in &self.by_status {
            write!(f, "; {status}={effect}")?;
        }
        Ok(())
    }
}

/// A malformed [`AnswerRule`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AnswerRuleError(String);

impl FromStr for AnswerRule {
    type Err = AnswerRuleError;

    /// Overrides of the default rule, separated by spaces, commas or semicolons:
    /// `STATUS=ACTION` or `Nxx=ACTION`, ACTION one of `store`, `release`, `indeterminate`.
    /// An empty string is the default rule.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut rule = Self::default();
        for item in s
            .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
            .filter(|t| !t.is_empty())
        {
            let (status, action) = item.split_once('=').ok_or_else(|| {
                AnswerRuleError(format!(
                    "{item:?}: expected STATUS=ACTION, e.g. 503=release or 5xx=store"
                ))
            })?;
            let effect: AfterEffect = action
                .parse()
                .map_err(|e: AnswerRuleError| AnswerRuleError(format!("{item:?}: {}", e.0)))?;
            let status = status.trim().to_ascii_lowercase();
            let bad = || {
                AnswerRuleError(format!(
                    "{item:?}: the status must be 100-599 or a class 1xx-5xx"
                ))
            };
            if let Some(digit) = status.strip_suffix("xx") {
                let class: u8 = digit.parse().map_err(|_| bad())?;
                if !(1..=5).contains(&class) {
                    return Err(bad());
                }
                rule = rule.class(class, effect);
            } else {
                let code: u16 = status.parse().map_err(|_| bad())?;
                if !(100..=599).contains(&code) {
                    return Err(bad());
                }
                rule = rule.status(code, effect);
            }
        }
        Ok(rule)
    }
}

/// What becomes of an external-mode record once its owner is done: the one rule for the
/// layer's external mode and for `idemkey gateway`.
///
/// | what was sent | decision |
/// |---|---|
/// | nothing (stopped before the point of no return, whatever it answered) | release |
/// | the request left, no complete answer came back | indeterminate |
/// | the request left, an answer came back | what `rule` says of its status |
///
/// Before the point of no return nothing can have happened elsewhere, so a retry may run
/// again. Once the request has left, a failure is never released unless the rule says that
/// this answer means nothing was done.
pub fn after_effect(progress: Progress, rule: &AnswerRule) -> AfterEffect {
    match progress {
        Progress::NotSent => AfterEffect::Release,
        Progress::SentNoAnswer => AfterEffect::Indeterminate,
        Progress::Answered(status) => rule.classify(status),
    }
}

/// How far an external-mode owner got, from what its handler reported: whether the request
/// left (`sent`, the point of no return), whether the handler said the outcome is unknown
/// (`unknown`), and the status of its answer (`None`: it panicked).
///
/// | sent | unknown | answer | progress |
/// |---|---|---|---|
/// | no | either | either | not sent |
/// | yes | no | a status | answered with it |
/// | yes | yes, or no answer (a panic) | | sent, no answer |
pub fn owner_progress(sent: bool, unknown: bool, status: Option<u16>) -> Progress {
    match status {
        Some(status) if sent && !unknown => Progress::Answered(status),
        _ if sent => Progress::SentNoAnswer,
        _ => Progress::NotSent,
    }
}

/// What becomes of a record whose answer [`after_effect`] said to store when that answer
/// cannot be read whole (larger than the route's bound, a body that fails half-way): the
/// answer is known to this attempt only. Before the point of no return the key is released;
/// after it the effect may have happened, so the record turns indeterminate (for the
/// reconciler: still unknown, asked again later).
pub fn answer_not_captured(progress: Progress) -> AfterEffect {
    match progress {
        Progress::NotSent => AfterEffect::Release,
        Progress::SentNoAnswer | Progress::Answered(_) => AfterEffect::Indeterminate,
    }
}

/// Local mode: what becomes of the claim, given the handler's `status` and whether its
/// transaction can commit (`committable`: the handler gave it back, and the answer to store
/// was read whole). The effect is in the same transaction as the record, so nothing can be
/// half done: the answer is stored and committed ([`AfterEffect::Complete`]) only when
/// `rule` says to store it and the transaction can commit; anything else rolls back, effect
/// and claim together ([`AfterEffect::Release`]). It is never indeterminate.
pub fn local_after_effect(status: u16, committable: bool, rule: &AnswerRule) -> AfterEffect {
    match rule.classify(status) {
        AfterEffect::Complete if committable => AfterEffect::Complete,
        _ => AfterEffect::Release,
    }
}

/// The reconciler: what the other service's answer (`status`) to "did this operation
/// happen?" makes of a record whose outcome is unknown.
///
/// | answer | decision |
/// |---|---|
/// | 2xx: found | complete, with that answer |
/// | 404: not found | release |
/// | anything else | still unknown (indeterminate), asked again later |
///
/// A 2xx whose body cannot be stored is decided by [`answer_not_captured`].
pub fn reconciled(status: u16) -> AfterEffect {
    match status {
        200..=299 => AfterEffect::Complete,
        404 => AfterEffect::Release,
        _ => AfterEffect::Indeterminate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FingerprintParts, MAX_MEMBERS, RecordId};

    fn fp(n: u8) -> Fingerprint {
        Fingerprint {
            digest: [n; 32],
            parts: FingerprintParts {
                params: [0; 8],
                query: [0; 8],
                body: [n; 8],
            },
            members: None,
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
            first_sent: None,
        }
    }

    const NOW: Timestamp = Timestamp(500);

    #[test]
    fn executes_when_no_record() {
        assert_eq!(decide(None, &fp(1), None, NOW), Decision::Execute);
    }

    #[test]
    fn replays_completed_record_with_same_fingerprint() {
        let r = record(RecordState::Completed, None);
        assert!(
            matches!(decide(Some(&r), &fp(1), None, NOW), Decision::Replay(resp) if resp.body == b"ok")
        );
    }

    /// The first differing member of `new` against a record claimed by `old`, with the
    /// record's members read back from their stored bytes (digests only, no pointers).
    fn pointer_between(fields: Option<&[&str]>, old: &str, new: &str) -> Option<String> {
        let spec = crate::FingerprintSpec {
            fields: fields.map(|f| f.iter().map(|p| p.to_string()).collect()),
        };
        let fp = |body: &str| {
            crate::fingerprint(
                &crate::RequestParts {
                    method: "POST",
                    route: "/p",
                    path_params: &[],
                    query: None,
                    content_type: Some("application/json"),
                    body: body.as_bytes(),
                },
                &spec,
            )
        };
        let mut r = record(RecordState::Completed, None);
        r.fingerprint = fp(old);
        let stored = r.fingerprint.members.as_ref().map(Members::to_bytes);
        r.fingerprint.members = stored.as_deref().and_then(Members::from_bytes);
        match decide(Some(&r), &fp(new), None, NOW) {
            Decision::Mismatch(m) => {
                assert!(m.body && !m.params && !m.query, "{m:?}");
                m.pointer
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }

    #[track_caller]
    fn assert_pointer(old: &str, new: &str, expected: &str) {
        assert_eq!(
            pointer_between(None, old, new).as_deref(),
            Some(expected),
            "{old} → {new}"
        );
    }

    #[test]
    fn names_the_first_differing_member() {
        let amounts = [
            r#"{"amount":500,"currency":"EUR"}"#,
            r#"{"currency":"EUR","amount":600}"#,
        ];
        assert_pointer(amounts[0], amounts[1], "/amount");
        // In canonical order: the first of two changed members.
        assert_pointer(r#"{"b":1,"a":1}"#, r#"{"a":2,"b":2}"#, "/a");
        // Number spelling is not a difference.
        assert_pointer(r#"{"n":1.0,"m":1}"#, r#"{"n":1,"m":2}"#, "/m");
        // Nested, in arrays; elements by index (10 after 2).
        let items = |q: u8| format!(r#"{{"items":[{{"qty":1}},{{"qty":1}},{{"qty":{q}}}]}}"#);
        assert_pointer(&items(1), &items(2), "/items/2/qty");
        let long = |x: u8| {
            format!(
                "[{}]",
                [1, 1, x, 1, 1, 1, 1, 1, 1, 1, x]
                    .map(|n| n.to_string())
                    .join(",")
            )
        };
        assert_pointer(&long(1), &long(2), "/2");
        // Names are escaped.
        assert_pointer(r#"{"a/b":{"m~n":1}}"#, r#"{"a/b":{"m~n":2}}"#, "/a~1b/m~0n");
        // A scalar became an object: its new member is what the record never had.
        assert_pointer(r#"{"a":1}"#, r#"{"a":{"b":1}}"#, "/a/b");
        // An object became a scalar.
        assert_pointer(r#"{"a":{"b":1}}"#, r#"{"a":1}"#, "/a");
    }

    #[test]
    fn names_an_added_member_and_the_parent_of_a_removed_one() {
        assert_pointer(r#"{"a":1}"#, r#"{"a":1,"note":"x"}"#, "/note");
        assert_pointer(r#"{"items":[1,2]}"#, r#"{"items":[1,2,3]}"#, "/items/2");
        // Removed: the new request does not have it, so its parent is named.
        assert_pointer(
            r#"{"a":1,"b":{"c":1,"d":2}}"#,
            r#"{"a":1,"b":{"c":1}}"#,
            "/b",
        );
        assert_pointer(r#"{"items":[1,2,3]}"#, r#"{"items":[1,2]}"#, "/items");
        assert_pointer(r#"{"a":1,"z":1}"#, r#"{"a":1}"#, "");
        // A removal is reported where its parent's members end: before a later change.
        assert_pointer(
            r#"{"x":{"p":1,"q":1},"y":1}"#,
            r#"{"x":{"p":1},"y":2}"#,
            "/x",
        );
        // ... and after an earlier one inside the same parent.
        assert_pointer(r#"{"x":{"p":1,"q":1}}"#, r#"{"x":{"p":2}}"#, "/x/p");
        // A renamed member is an added one.
        assert_pointer(r#"{"a":1,"b":1}"#, r#"{"a":1,"c":1}"#, "/c");
    }

    #[test]
    fn names_only_selected_fields() {
        let fields: &[&str] = &["/amount", "/items"];
        let pointer = |old, new| pointer_between(Some(fields), old, new);
        assert_eq!(
            pointer(r#"{"amount":1,"ts":1}"#, r#"{"amount":2,"ts":2}"#).as_deref(),
            Some("/amount")
        );
        assert_eq!(
            pointer(
                r#"{"items":[{"qty":1}],"ts":1}"#,
                r#"{"items":[{"qty":2}],"ts":2}"#
            )
            .as_deref(),
            Some("/items/0/qty")
        );
        // A selected field the new request lacks is named by the route's own pointer.
        assert_eq!(
            pointer(r#"{"amount":1}"#, r#"{}"#).as_deref(),
            Some("/amount")
        );
    }

    #[test]
    fn names_no_member_past_the_bound_or_without_digests() {
        let big = |x: u32| {
            let items: Vec<String> = (0..MAX_MEMBERS as u32)
                .map(|i| (i + x).to_string())
                .collect();
            format!("[{}]", items.join(","))
        };
        assert_eq!(pointer_between(None, &big(0), &big(1)), None);
        // Just under the bound (the array itself counts as one value) it is named.
        let under = |x: u32| {
            let items: Vec<String> = (0..MAX_MEMBERS as u32 - 1)
                .map(|i| (i + x).to_string())
                .collect();
            format!("[{}]", items.join(","))
        };
        assert_eq!(
            pointer_between(None, &under(0), &under(1)).as_deref(),
            Some("/0")
        );
        // Not JSON.
        let r = record(RecordState::Completed, None);
        let Decision::Mismatch(m) = decide(Some(&r), &fp(2), None, NOW) else {
            panic!("a mismatch")
        };
        assert_eq!(m.pointer, None);
    }

    #[test]
    fn rejects_mismatched_fingerprint_naming_the_part() {
        let r = record(RecordState::Completed, None);
        assert_eq!(
            decide(Some(&r), &fp(2), None, NOW),
            Decision::Mismatch(Mismatch {
                body: true,
                ..Mismatch::default()
            })
        );
    }

    #[test]
    fn rejects_changed_first_sent_naming_it() {
        let mut r = record(RecordState::Completed, None);
        r.first_sent = Some(Timestamp(100));
        assert_eq!(
            decide(Some(&r), &fp(1), Some(Timestamp(101)), NOW),
            Decision::Mismatch(Mismatch {
                first_sent: true,
                ..Mismatch::default()
            })
        );
        let Decision::Mismatch(m) = decide(Some(&r), &fp(2), Some(Timestamp(101)), NOW) else {
            panic!("a mismatch")
        };
        assert_eq!(m.parts(), ["body", "first-sent"]);
    }

    #[test]
    fn first_sent_stated_on_one_side_only_still_replays() {
        let mut r = record(RecordState::Completed, None);
        r.first_sent = Some(Timestamp(100));
        for (stored, stated) in [
            (Some(Timestamp(100)), Some(Timestamp(100))),
            (Some(Timestamp(100)), None),
            (None, Some(Timestamp(100))),
        ] {
            r.first_sent = stored;
            assert!(
                matches!(decide(Some(&r), &fp(1), stated, NOW), Decision::Replay(_)),
                "{stored:?} / {stated:?}"
            );
        }
    }

    #[test]
    fn mismatch_wins_over_in_flight() {
        let r = record(RecordState::Reserved, Some(900));
        assert!(matches!(
            decide(Some(&r), &fp(2), None, NOW),
            Decision::Mismatch(_)
        ));
    }

    #[test]
    fn expired_record_is_taken_over_never_replayed() {
        let r = record(RecordState::Completed, None);
        assert_eq!(
            decide(Some(&r), &fp(2), None, Timestamp(1_000)),
            Decision::TakeOver { token: 7 }
        );
    }

    #[test]
    fn live_lease_is_in_flight() {
        for state in [RecordState::Reserved, RecordState::Executing] {
            let r = record(state, Some(900));
            assert_eq!(
                decide(Some(&r), &fp(1), None, NOW),
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
            decide(Some(&r), &fp(1), None, NOW),
            Decision::TakeOver { token: 7 }
        );
    }

    #[test]
    fn lapsed_lease_after_point_of_no_return_turns_indeterminate() {
        let r = record(RecordState::Executing, Some(400));
        assert_eq!(
            decide(Some(&r), &fp(1), None, NOW),
            Decision::OutcomeUnknown {
                mark_indeterminate: Some(7)
            }
        );
    }

    #[test]
    fn indeterminate_is_never_executed() {
        let r = record(RecordState::Indeterminate, None);
        assert_eq!(
            decide(Some(&r), &fp(1), None, Timestamp(999)),
            Decision::OutcomeUnknown {
                mark_indeterminate: None,
            }
        );
    }

    /// Every row of the after-effect table, under the default rule.
    #[test]
    fn after_effect_table_default_rule() {
        use AfterEffect::{Complete, Indeterminate, Release};
        let rule = AnswerRule::default();
        let rows = [
            (Progress::NotSent, Release),
            (Progress::SentNoAnswer, Indeterminate),
            (Progress::Answered(200), Complete),
            (Progress::Answered(201), Complete),
            (Progress::Answered(302), Complete),
            (Progress::Answered(402), Complete),
            (Progress::Answered(404), Complete),
            (Progress::Answered(409), Complete),
            (Progress::Answered(500), Indeterminate),
            (Progress::Answered(502), Indeterminate),
            (Progress::Answered(503), Indeterminate),
            (Progress::Answered(504), Indeterminate),
        ];
        for (progress, expected) in rows {
            assert_eq!(after_effect(progress, &rule), expected, "{progress:?}");
        }
        for status in REFUSALS {
            assert_eq!(after_effect(Progress::Answered(status), &rule), Release);
        }
    }

    #[test]
    fn owner_progress_table() {
        use Progress::{Answered, NotSent, SentNoAnswer};
        let rows = [
            // (sent, unknown, status) → progress
            ((false, false, Some(201)), NotSent),
            ((false, true, Some(201)), NotSent),
            ((false, false, None), NotSent),
            ((false, true, None), NotSent),
            ((true, false, Some(201)), Answered(201)),
            ((true, false, Some(503)), Answered(503)),
            ((true, true, Some(201)), SentNoAnswer),
            ((true, false, None), SentNoAnswer),
            ((true, true, None), SentNoAnswer),
        ];
        for ((sent, unknown, status), expected) in rows {
            assert_eq!(
                owner_progress(sent, unknown, status),
                expected,
                "{sent} {unknown} {status:?}"
            );
        }
    }

    #[test]
    fn answer_not_captured_table() {
        use AfterEffect::{Indeterminate, Release};
        let rows = [
            (Progress::NotSent, Release),
            (Progress::SentNoAnswer, Indeterminate),
            (Progress::Answered(200), Indeterminate),
            (Progress::Answered(201), Indeterminate),
        ];
        for (progress, expected) in rows {
            assert_eq!(answer_not_captured(progress), expected, "{progress:?}");
        }
    }

    #[test]
    fn local_after_effect_table() {
        use AfterEffect::{Complete, Release};
        let default = AnswerRule::default();
        let custom: AnswerRule = "500=store 201=release".parse().unwrap();
        let rows = [
            // (status, committable, rule) → decision
            (200, true, &default, Complete),
            (201, true, &default, Complete),
            (404, true, &default, Complete),
            (409, true, &default, Complete),
            (200, false, &default, Release),
            (404, false, &default, Release),
            (422, true, &default, Release),
            (429, true, &default, Release),
            (500, true, &default, Release),
            (503, true, &default, Release),
            (500, true, &custom, Complete),
            (500, false, &custom, Release),
            (201, true, &custom, Release),
        ];
        for (status, committable, rule, expected) in rows {
            assert_eq!(
                local_after_effect(status, committable, rule),
                expected,
                "{status} {committable} {rule}"
            );
        }
        for status in REFUSALS {
            assert_eq!(local_after_effect(status, true, &default), Release);
        }
    }

    #[test]
    fn reconciled_table() {
        use AfterEffect::{Complete, Indeterminate, Release};
        let rows = [
            (200, Complete),
            (201, Complete),
            (204, Complete),
            (299, Complete),
            (404, Release),
            (100, Indeterminate),
            (302, Indeterminate),
            (304, Indeterminate),
            (400, Indeterminate),
            (409, Indeterminate),
            (410, Indeterminate),
            (429, Indeterminate),
            (500, Indeterminate),
            (503, Indeterminate),
        ];
        for (status, expected) in rows {
            assert_eq!(reconciled(status), expected, "{status}");
        }
    }

    #[test]
    fn a_route_changes_the_rule_per_status_and_class() {
        let rule: AnswerRule = "503=release, 5xx=store; 404=indeterminate".parse().unwrap();
        assert_eq!(rule.classify(503), AfterEffect::Release);
        assert_eq!(rule.classify(500), AfterEffect::Complete);
        assert_eq!(rule.classify(404), AfterEffect::Indeterminate);
        assert_eq!(rule.classify(400), AfterEffect::Release);
        assert_eq!(
            after_effect(Progress::Answered(502), &rule),
            AfterEffect::Complete
        );
        // The rule speaks of answers only.
        assert_eq!(after_effect(Progress::NotSent, &rule), AfterEffect::Release);
        assert_eq!(
            after_effect(Progress::SentNoAnswer, &rule),
            AfterEffect::Indeterminate
        );
    }

    #[test]
    fn the_rule_reads_back() {
        let rule: AnswerRule = "5xx=store 503=release".parse().unwrap();
        assert_eq!(
            rule.to_string(),
            "store; release 400 401 403 405 406 408 411 413 414 415 422 429; \
             indeterminate 5xx; 5xx=store; 503=release"
        );
        assert_eq!(rule.to_string().split("; ").count(), 5);
        assert_eq!("".parse::<AnswerRule>().unwrap(), AnswerRule::default());
    }

    #[test]
    fn malformed_rules_are_refused_readably() {
        for bad in [
            "503",
            "503=maybe",
            "6xx=store",
            "0xx=store",
            "99=store",
            "abc=store",
        ] {
            let e = bad.parse::<AnswerRule>().unwrap_err();
            assert!(
                e.to_string().contains(bad.split('=').next().unwrap()),
                "{bad}: {e}"
            );
        }
    }
}
