//! What can go wrong.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::{IdempotentResponse, Problem};

/// Why an operation did not get a final answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server refused the request in a way that must not be retried with this key: a
    /// problem type of the contract that retrying cannot change (422 `key-reused`, 409
    /// `outcome-unknown`, 504 `upstream-outcome-unknown`, 500 `response-too-large`…), or a 400
    /// or 422 of another type.
    #[error("the server refused the request: {problem}")]
    Problem {
        /// The problem details and the raw response.
        problem: Box<Problem>,
        /// Attempts made by this call.
        attempts: u32,
    },
    /// Every answer was retryable and the attempts or the time allowed are spent.
    #[error("gave up after {attempts} attempts in {elapsed:?}")]
    GaveUp {
        /// The last failure.
        #[source]
        last: Box<Failure>,
        /// Attempts made by this call.
        attempts: u32,
        /// Time spent by this call.
        elapsed: Duration,
    },
    /// The next attempt would start at or after the key's retention horizon, when the server
    /// may treat the key as new and run the operation again; it was not sent.
    #[error(
        "stopped after {attempts} attempts: the next one would pass the key's retention horizon ({})",
        httpdate::fmt_http_date(*.horizon)
    )]
    RetentionHorizon {
        /// Attempts made by this call (0 when the horizon had passed before it).
        attempts: u32,
        /// The horizon: the advertised expiry, or the first attempt plus the retention.
        horizon: SystemTime,
        /// The last failure, if an attempt was made.
        #[source]
        last: Option<Box<Failure>>,
    },
    /// The server refused the attempt because the operation's first attempt was sent longer
    /// ago than its retention (412 `first-sent-expired`) and it keeps no record of it: the
    /// operation may have happened, so it was not run again. Never retried; find out by other
    /// means (e.g. the resource's own reference) before starting a new operation.
    #[error(
        "the server refused the request: its first attempt ({}) is older than the server's retention, and the operation may already have happened",
        httpdate::fmt_http_date(*.first_attempt_at)
    )]
    FirstSentExpired {
        /// The problem details and the raw response.
        problem: Box<Problem>,
        /// The first attempt's time the request stated.
        first_attempt_at: SystemTime,
        /// Attempts made by this call.
        attempts: u32,
    },
    /// The request body is a stream: it cannot be sent again byte for byte.
    #[error("the request body is a stream and cannot be sent again")]
    NotCloneable,
    /// A transport failure that retrying cannot fix (e.g. a redirect loop).
    #[error("the request failed after {attempts} attempts")]
    Transport {
        /// The failure.
        #[source]
        source: reqwest::Error,
        /// Attempts made by this call.
        attempts: u32,
    },
    /// The request could not be built (bad URL, body that does not serialise…).
    #[error("the request could not be built")]
    Build(#[source] reqwest::Error),
}

impl Error {
    /// The problem details, for [`Error::Problem`].
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            Error::Problem { problem, .. } | Error::FirstSentExpired { problem, .. } => {
                Some(problem)
            }
            _ => None,
        }
    }

    /// Attempts made by the call that failed.
    pub fn attempts(&self) -> u32 {
        match self {
            Error::Problem { attempts, .. }
            | Error::GaveUp { attempts, .. }
            | Error::RetentionHorizon { attempts, .. }
            | Error::FirstSentExpired { attempts, .. }
            | Error::Transport { attempts, .. } => *attempts,
            Error::NotCloneable | Error::Build(_) => 0,
        }
    }

    /// The error [`IdempotencyMiddleware`](crate::IdempotencyMiddleware) returned inside a
    /// `reqwest_middleware::Error`, if it is one.
    pub fn from_middleware(error: &reqwest_middleware::Error) -> Option<&Error> {
        match error {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<Error>(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}

/// The last retryable failure before the client stopped.
#[derive(Debug)]
#[non_exhaustive]
pub enum Failure {
    /// A retryable answer (5xx, 429, 409 `request-in-flight`…), read in full.
    Response(Box<IdempotentResponse>),
    /// A connection failure, a timeout, or another transport error.
    Transport(reqwest::Error),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Response(r) => write!(f, "the server answered {}", r.status()),
            Failure::Transport(_) => f.write_str("the request failed in transit"),
        }
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Failure::Response(_) => None,
            Failure::Transport(e) => Some(e),
        }
    }
}
