//! What the model's world holds: the store's one record, the owners, the clients, the
//! messages on their way, what the upstream executed, and the clock's flags.

use std::fmt;

use idemkey_core::{AfterEffect, RecordState};

/// The request a client sends with the one key: `A` is the operation, `B` another body
/// sent with the same key (a client that reused it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Body {
    /// The operation.
    A,
    /// Another request under the same key.
    B,
}

/// The one idempotency record, as the store's SQL makes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rec {
    /// The body that claimed the key (its fingerprint).
    pub body: Body,
    /// The `state` column.
    pub state: RecordState,
    /// The fencing token.
    pub token: i64,
    /// Which claim made this row (an insert or a takeover); the store does not hold it, the
    /// model does, to tell a stale owner from the current one.
    pub generation: u8,
    /// Whether the lease (`lease_expires_at`) is still ahead of the clock.
    pub lease_live: bool,
    /// Whether the retention ended (`expires_at <= now`).
    pub expired: bool,
    /// The stored answer: status and the execution it came from, if one did.
    pub response: Option<(u16, Option<u8>)>,
    /// Whether a request of this claim left for the upstream (model only).
    pub sent: bool,
}

/// Where an owner process stands with the attempt it serves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// Serving nothing.
    Idle,
    /// External mode: holds the key (reserved, or executing when the reservation marked the
    /// point of no return), nothing sent yet.
    Claimed {
        /// The client it serves.
        client: u8,
        /// The request's body.
        body: Body,
        /// The claim it made.
        generation: u8,
        /// Its fencing token.
        token: i64,
        /// Whether its own reservation's lease has passed on its clock (the reservation
        /// marked the point of no return: nothing may be sent after it).
        bound_passed: bool,
    },
    /// External mode: the request left; waiting for the upstream's answer.
    Sent {
        /// The client it serves.
        client: u8,
        /// The claim it made.
        generation: u8,
        /// Its fencing token.
        token: i64,
    },
    /// External mode: knows what to write with its token, and what to answer.
    Decided {
        /// The client it serves.
        client: u8,
        /// The claim it made.
        generation: u8,
        /// Its fencing token.
        token: i64,
        /// The write: complete, release or mark indeterminate.
        write: AfterEffect,
        /// The answer to store, on complete: status and execution.
        store: Option<(u16, Option<u8>)>,
        /// Whether the decision came from an answer whose rule releases (the upstream said
        /// nothing was done), for `no_release_after_send_without_truth`.
        released_by_answer: bool,
        /// What the client is answered.
        answer: Answer,
    },
    /// Local mode: the claim's transaction is open and holds the key's row lock.
    InTransaction {
        /// The client it serves.
        client: u8,
        /// The request's body.
        body: Body,
    },
}

/// What a client is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    /// An execution's answer, live or replayed: its status and which execution.
    Executed {
        /// The HTTP status.
        status: u16,
        /// The execution (an index into [`State::executions`]).
        execution: u8,
    },
    /// The upstream's (or the handler's) answer that no execution stands behind: a refusal
    /// the rule releases, a failure rolled back.
    NotExecuted(u16),
    /// 409 `request-in-flight`.
    InFlight,
    /// 409 `outcome-unknown` (a record in doubt), or 504 `upstream-outcome-unknown` / 500 for
    /// this attempt whose outcome its owner does not know.
    OutcomeUnknown,
    /// 422: the key was used with another request.
    Mismatch,
    /// 412 `first-sent-expired`: too late for the record to be trusted to exist.
    FirstSentExpired,
    /// 503: the upstream was not reached; nothing was sent.
    Unavailable,
    /// 500 `response-too-large`: an answer that could not be read whole.
    TooLarge,
}

/// A client's state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    /// Attempts it may still make.
    pub attempts_left: u8,
    /// The owner serving its current attempt, while it waits.
    pub waiting_on: Option<u8>,
}

/// A request on its way to the upstream.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    /// The owner waiting for its answer; `None` once it stopped waiting (time-out, crash).
    pub owner: Option<u8>,
    /// The body sent.
    pub body: Body,
}

/// The upstream's answer on its way back to an owner.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reply {
    /// The owner it goes to.
    pub owner: u8,
    /// The status.
    pub status: u16,
    /// The execution behind it, if any.
    pub execution: Option<u8>,
}

/// Breaches seen on a transition, kept so that the `always` properties can name them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Breaches {
    /// An owner's write changed a record another claim made.
    pub stale_write: bool,
    /// A record whose request left was deleted without the truth.
    pub release_without_truth: bool,
    /// A client got an execution's answer that is not its operation's one execution.
    pub other_answer: bool,
}

/// The whole world.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The committed record, if any.
    pub record: Option<Rec>,
    /// Local mode: the owner whose open transaction holds the key's row lock.
    pub lock: Option<u8>,
    /// The owner processes.
    pub owners: Vec<Owner>,
    /// The clients.
    pub clients: Vec<Client>,
    /// Requests on their way to the upstream, sorted.
    pub requests: Vec<Request>,
    /// Answers on their way back to owners, sorted.
    pub replies: Vec<Reply>,
    /// What the upstream executed (local mode: what committed), by execution.
    pub executions: Vec<Body>,
    /// The execution whose answer clients of each body got, `A` first.
    pub answered: [Option<u8>; 2],
    /// Owner crashes left.
    pub crashes_left: u8,
    /// Lost messages left.
    pub losses_left: u8,
    /// The first attempts' time is past the retention less the margin.
    pub late: bool,
    /// A record's retention ended once.
    pub retention_ended: bool,
    /// Claims made so far (the next generation).
    pub generations: u8,
    /// Breaches seen.
    pub breaches: Breaches,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Executed { status, execution } => {
                write!(f, "{status} from execution #{execution}")
            }
            Self::NotExecuted(status) => write!(f, "{status}, nothing executed"),
            Self::InFlight => f.write_str("409 request-in-flight"),
            Self::OutcomeUnknown => f.write_str("outcome unknown"),
            Self::Mismatch => f.write_str("422 key reused with another request"),
            Self::FirstSentExpired => f.write_str("412 first-sent-expired"),
            Self::Unavailable => f.write_str("503 upstream-unavailable"),
            Self::TooLarge => f.write_str("500 response-too-large"),
        }
    }
}
