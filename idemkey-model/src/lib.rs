//! # idemkey-model
//!
//! A model check of idemkey's claim protocol with [stateright]: every interleaving of
//! clients retrying one key, two owner processes, the upstream, the reconciler, an operator,
//! the purge and the clock, within bounds, explored breadth first, so that a broken property
//! comes with its shortest trace.
//!
//! The model decides nothing itself. Each transition that decides something calls
//! idemkey-core's own functions, held in a [`Decisions`] (the real ones by default, a test
//! may hand in a wrong one): [`decide`] for every claim, look-up, takeover and the
//! reconciler's listing, [`owner_progress`] and [`after_effect`] for an external owner's end,
//! [`answer_not_captured`] for an answer too large to store, [`reconciled`] for the
//! reconciler's and the operator's look-up, [`local_after_effect`] for a local owner's end,
//! and [`FirstSentPolicy::is_late`] for a late retry.
//!
//! What the stores' SQL does is stated once, in `src/store.rs`; each rule names the test
//! that holds the real stores to it.
//!
//! The properties ([`ClaimModel::properties`]): `at_most_once`, `one_answer`,
//! `stale_owner_inert`, `no_release_after_send_without_truth` (always), and `settles`
//! (eventually). `docs/reliability.md` ("What is proven") says what they mean for users, under
//! which bounds and assumptions.
//!
//! [stateright]: https://docs.rs/stateright

mod state;
mod step;
mod store;

use std::time::Duration;

use idemkey_core::{
    AfterEffect, AnswerRule, Decision, Fingerprint, FingerprintParts, FirstSentPolicy, Progress,
    Record, RecordId, RecordState, StoredResponse, Timestamp, after_effect, answer_not_captured,
    decide, local_after_effect, owner_progress, reconciled,
};
use stateright::{Model, Property};

pub use self::state::{Answer, Body, Breaches, Client, Owner, Rec, Reply, Request, State};

/// Which mode the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// External mode (the layer's `.external(lease)`, `idemkey gateway`): the claim commits
    /// at once with a lease; the effect is a request to the upstream.
    External {
        /// The reservation marks the point of no return (the gateway's default); `false`:
        /// a write marks it just before the request leaves (`--point-of-no-return separate`).
        point_of_no_return_at_reservation: bool,
    },
    /// Local mode: claim, effect and completion in one transaction.
    Local,
}

/// What the upstream (local mode: the handler) does with a request it receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Upstream {
    /// Executes and answers 201.
    Done,
    /// Refuses before any effect, 422.
    Refused,
    /// Executes, then fails: 500 (local mode: rolled back with the transaction).
    Failed,
}

impl Upstream {
    /// The status it answers.
    pub fn status(self) -> u16 {
        match self {
            Self::Done => 201,
            Self::Refused => 422,
            Self::Failed => 500,
        }
    }

    /// Whether its effect happens.
    pub fn executes(self) -> bool {
        !matches!(self, Self::Refused)
    }
}

/// What the upstream's look-up ("did the operation with this key happen?") answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Truthful for the past and the future: "not found" only when the operation did not
    /// happen and no request of it is still on its way (an upstream that, say, refuses a
    /// request whose key it once answered "not found" for). While one is on its way it
    /// answers that it does not know yet. This is the assumption under which the properties
    /// are proven.
    Settled,
    /// Truthful at the moment it answers only: a request still on its way may arrive after
    /// a "not found". Shown to break `at_most_once`.
    AtArrival,
}

/// Which token a fresh claim's insert gives a record (a store rule, stated in
/// `src/store.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InsertToken {
    /// A token no earlier claim of the key held, as every store's `INSERT` writes it (the
    /// claim's `NewRecord::token`, from `idemkey_core::fresh_token`).
    Fresh,
    /// Always 1: a record deleted and claimed anew starts again at the token its previous
    /// claim began with. Shown to break `stale_owner_inert` and `at_most_once`.
    One,
}

/// The bounds and the world of one model check.
#[derive(Clone, Debug)]
pub struct Config {
    /// The mode.
    pub mode: Mode,
    /// One entry per client: the body it sends with the key.
    pub clients: Vec<Body>,
    /// How many attempts each client makes at most.
    pub attempts: u8,
    /// Owner processes.
    pub owners: u8,
    /// Owner crashes, at any step, in all.
    pub crashes: u8,
    /// Lost messages in all: a request to the upstream, its answer, an answer to a client,
    /// a commit's answer.
    pub losses: u8,
    /// The gateway's reconciler runs.
    pub reconciler: bool,
    /// An operator resolves records in doubt (`idemkey keys resolve`), after checking the
    /// upstream as truthfully as the reconciler's look-up.
    pub operator: bool,
    /// Every attempt states its first attempt's time (`Repeatability-First-Sent`).
    pub first_sent: bool,
    /// The clock may end a record's retention (then the purge deletes it).
    pub retention_ends: bool,
    /// What the upstream may do with each request.
    pub upstream: Vec<Upstream>,
    /// An answer to store may be too large to read whole.
    pub answers_too_large: bool,
    /// What the look-up answers.
    pub lookup: Lookup,
    /// The token of a fresh claim.
    pub insert_token: InsertToken,
    /// The route's answer rule.
    pub rule: AnswerRule,
}

impl Config {
    /// The bounded configuration `cargo test` explores: 2 owners, 3 clients (two with the
    /// operation, one with another body under the same key), 2 attempts each, 1 crash,
    /// 1 lost message, the reconciler and an operator, first-sent on, retention and purge.
    pub fn external() -> Self {
        Self {
            mode: Mode::External {
                point_of_no_return_at_reservation: true,
            },
            clients: vec![Body::A, Body::A, Body::B],
            attempts: 2,
            owners: 2,
            crashes: 1,
            losses: 1,
            reconciler: true,
            operator: true,
            first_sent: true,
            retention_ends: true,
            upstream: vec![Upstream::Done, Upstream::Refused, Upstream::Failed],
            answers_too_large: true,
            lookup: Lookup::Settled,
            insert_token: InsertToken::Fresh,
            rule: AnswerRule::default(),
        }
    }

    /// The same bounds in local mode (no upstream, reconciler or operator: nothing is ever
    /// in doubt there).
    pub fn local() -> Self {
        Self {
            mode: Mode::Local,
            reconciler: false,
            operator: false,
            ..Self::external()
        }
    }
}

/// The decision functions the model calls, idemkey-core's by default.
#[derive(Clone, Copy)]
pub struct Decisions {
    /// What a request does given the record ([`decide`]).
    pub decide:
        for<'r> fn(Option<&'r Record>, &Fingerprint, Option<Timestamp>, Timestamp) -> Decision<'r>,
    /// How far an external owner got ([`owner_progress`]).
    pub owner_progress: fn(bool, bool, Option<u16>) -> Progress,
    /// What an external owner writes ([`after_effect`]).
    pub after_effect: fn(Progress, &AnswerRule) -> AfterEffect,
    /// What an answer to store that cannot be read whole makes of the record
    /// ([`answer_not_captured`]).
    pub answer_not_captured: fn(Progress) -> AfterEffect,
    /// What the look-up's status makes of a record in doubt ([`reconciled`]).
    pub reconciled: fn(u16) -> AfterEffect,
    /// What a local owner does with its transaction ([`local_after_effect`]).
    pub local_after_effect: fn(u16, bool, &AnswerRule) -> AfterEffect,
    /// Whether a first attempt is too old for its record to be trusted
    /// ([`FirstSentPolicy::is_late`]).
    pub is_late: fn(&FirstSentPolicy, Timestamp, Timestamp, Duration) -> bool,
}

impl Default for Decisions {
    fn default() -> Self {
        Self {
            decide,
            owner_progress,
            after_effect,
            answer_not_captured,
            reconciled,
            local_after_effect,
            is_late: FirstSentPolicy::is_late,
        }
    }
}

impl std::fmt::Debug for Decisions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Decisions")
    }
}

/// The model: a [`Config`] and the [`Decisions`] it calls.
#[derive(Clone, Debug)]
pub struct ClaimModel {
    /// The bounds and the world.
    pub config: Config,
    /// The decision functions.
    pub decisions: Decisions,
}

impl ClaimModel {
    /// The model of `config` with idemkey-core's decisions.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            decisions: Decisions::default(),
        }
    }

    /// The same model calling `decisions` instead.
    pub fn with_decisions(mut self, decisions: Decisions) -> Self {
        self.decisions = decisions;
        self
    }

    /// A trace as readable steps, one line each, numbered.
    pub fn explain(&self, path: stateright::Path<State, Action>) -> String {
        let mut out = String::new();
        let mut n = 0;
        for (state, action) in path.into_vec() {
            let Some(action) = action else { continue };
            n += 1;
            let note = self
                .step(&state, action)
                .map_or_else(|| format!("{action:?}"), |(_, note)| note);
            out.push_str(&format!("{n:>2}. {note}\n"));
        }
        out
    }
}

/// One step of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A client sends an attempt; an idle owner claims (or looks up) the key for it.
    Attempt {
        /// The client.
        client: u8,
        /// The owner serving it.
        owner: u8,
    },
    /// External owner: the point of no return, then the request leaves, in one step.
    Send(u8),
    /// External owner: the upstream refused the connection; nothing was sent.
    ConnectRefused(u8),
    /// External owner: renews its lease.
    Renew(u8),
    /// The upstream receives a request and does `outcome`.
    Deliver {
        /// The request (an index into [`State::requests`]).
        request: usize,
        /// What the upstream does.
        outcome: Upstream,
    },
    /// A request to the upstream is lost.
    LoseRequest(usize),
    /// An owner receives the upstream's answer; `captured`: read whole.
    Receive {
        /// The answer (an index into [`State::replies`]).
        reply: usize,
        /// Whether it could be read whole.
        captured: bool,
    },
    /// The upstream's answer is lost.
    LoseReply(usize),
    /// External owner: its wait for the answer times out.
    TimeOut(u8),
    /// External owner: writes its decision with its token and answers its client.
    Write {
        /// The owner.
        owner: u8,
        /// The answer to the client is lost.
        answer_lost: bool,
    },
    /// Local owner: the handler runs in the transaction; the owner commits or rolls back.
    Handle {
        /// The owner.
        owner: u8,
        /// What the handler does.
        outcome: Upstream,
        /// Whether its answer could be read whole.
        captured: bool,
        /// What becomes of a commit.
        commit: Commit,
    },
    /// An owner process crashes (a new one starts, idle).
    Crash(u8),
    /// The record's lease lapses.
    LeaseLapses,
    /// An owner's own reservation lease passes on its clock, after a renewal.
    BoundPasses(u8),
    /// The first attempts' time becomes late.
    Late,
    /// The record's retention ends.
    RetentionEnds,
    /// The purge deletes the expired record.
    Purge,
    /// The reconciler or an operator looks the operation up and resolves the record.
    Resolve {
        /// Who.
        by: Resolver,
        /// Whether the look-up's answer could be read whole.
        captured: bool,
    },
}

/// What becomes of a local commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Commit {
    /// Committed and answered.
    Answered,
    /// Committed, its answer lost.
    LostAfter,
    /// Not committed, the connection lost before it.
    LostBefore,
}

/// Who resolves a record in doubt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resolver {
    /// The gateway's reconciler.
    Reconciler,
    /// An operator (`idemkey keys resolve`).
    Operator,
}

/// The model's single `now` for records: leases and expiry are the record's flags, mapped to
/// times either side of it.
pub(crate) const NOW: Timestamp = Timestamp(1_000_000_000_000);
/// The retention the first-sent rule is judged by.
pub(crate) const RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The fingerprint of `body`.
pub(crate) fn fingerprint(body: Body) -> Fingerprint {
    let n = body as u8 + 1;
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

/// The first attempt's time each operation states (distinct: two operations).
pub(crate) fn first_sent_of(body: Body) -> Timestamp {
    NOW.minus(Duration::from_secs(60 + body as u64))
}

/// The model's record as idemkey-core's [`Record`], times mapped around [`NOW`].
pub(crate) fn to_record(rec: &Rec, first_sent: bool) -> Record {
    let lease = matches!(rec.state, RecordState::Reserved | RecordState::Executing).then(|| {
        if rec.lease_live {
            NOW.plus(Duration::from_secs(10))
        } else {
            NOW
        }
    });
    Record {
        id: RecordId {
            tenant: "t".into(),
            key_hash: [7; 32],
            route: "POST /v1/transfers".into(),
        },
        fingerprint: fingerprint(rec.body),
        state: rec.state,
        token: rec.token,
        lease_expires_at: lease,
        response: rec.response.map(|(status, execution)| StoredResponse {
            status,
            headers: vec![],
            body: execution.into_iter().collect(),
        }),
        created_at: NOW.minus(Duration::from_secs(1)),
        updated_at: NOW,
        expires_at: if rec.expired {
            NOW
        } else {
            NOW.plus(RETENTION)
        },
        sealed_key: Some(vec![1]),
        first_sent: first_sent.then(|| first_sent_of(rec.body)),
    }
}

impl Model for ClaimModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let c = &self.config;
        vec![State {
            record: None,
            lock: None,
            owners: vec![Owner::Idle; usize::from(c.owners)],
            clients: vec![
                Client {
                    attempts_left: c.attempts,
                    waiting_on: None,
                };
                c.clients.len()
            ],
            requests: vec![],
            replies: vec![],
            executions: vec![],
            answered: [None, None],
            crashes_left: c.crashes,
            losses_left: c.losses,
            late: false,
            retention_ended: false,
            generations: 0,
            breaches: Breaches::default(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.enabled(state, actions);
    }

    fn next_state(&self, state: &State, action: Action) -> Option<State> {
        self.step(state, action).map(|(next, _)| next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at_most_once", |m, s| m.at_most_once(s)),
            Property::always("one_answer", |_, s: &State| !s.breaches.other_answer),
            Property::always("stale_owner_inert", |_, s: &State| !s.breaches.stale_write),
            Property::always("no_release_after_send_without_truth", |_, s: &State| {
                !s.breaches.release_without_truth
            }),
            Property::eventually("settles", |m, s| m.settled(s)),
        ]
    }
}

impl ClaimModel {
    /// Whether executions may repeat: only once a retention ended, and only when attempts do
    /// not state their first attempt's time.
    pub(crate) fn repeats_allowed(&self, s: &State) -> bool {
        s.retention_ended && !self.config.first_sent
    }

    /// `at_most_once`: each operation (body) is executed at most once while its record
    /// lives, and with first-sent on, ever.
    fn at_most_once(&self, s: &State) -> bool {
        self.repeats_allowed(s)
            || [Body::A, Body::B]
                .iter()
                .all(|b| s.executions.iter().filter(|e| *e == b).count() <= 1)
    }

    /// `settles`: every client is done, every owner idle, and the record, if any, is not in
    /// doubt or in flight ([`decide`] on its own request says replay, take over or execute).
    fn settled(&self, s: &State) -> bool {
        let quiet = s.owners.iter().all(|o| *o == Owner::Idle)
            && s.clients
                .iter()
                .all(|c| c.attempts_left == 0 && c.waiting_on.is_none());
        quiet
            && s.record.as_ref().is_none_or(|rec| {
                let record = to_record(rec, self.config.first_sent);
                !matches!(
                    (self.decisions.decide)(
                        Some(&record),
                        &record.fingerprint,
                        record.first_sent,
                        NOW
                    ),
                    Decision::InFlight { .. } | Decision::OutcomeUnknown { .. }
                )
            })
    }
}
