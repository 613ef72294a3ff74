//! The retry loop shared by [`IdempotentClient`](crate::IdempotentClient) and
//! [`IdempotencyMiddleware`](crate::IdempotencyMiddleware).

use std::future::Future;
use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{Request, Response, StatusCode};

use crate::problem::{problem_type, types};
use idemkey_core::problem;

use crate::{
    Clock, Error, Failure, IdempotencyInfo, IdempotentResponse, Operation, Problem, RetryPolicy,
    header,
};

/// Sends one attempt.
pub(crate) trait Transport {
    /// Sends `request` once.
    fn send(
        &mut self,
        request: Request,
    ) -> impl Future<Output = Result<Response, SendError>> + Send;
}

/// Why an attempt got no response.
pub(crate) enum SendError {
    /// reqwest failed: a transport error.
    Reqwest(reqwest::Error),
    /// Another middleware further down failed: passed on untouched.
    Other(reqwest_middleware::Error),
}

/// Why the loop stopped without a final answer.
pub(crate) enum Stop {
    /// Our own error.
    Error(Error),
    /// Another middleware's error, passed on untouched.
    Other(reqwest_middleware::Error),
}

impl From<Error> for Stop {
    fn from(error: Error) -> Self {
        Stop::Error(error)
    }
}

/// Whether final answers are read in full or handed over unread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Read every body; a body that fails to arrive is retried.
    Buffer,
    /// Read a body only when needed to classify the answer.
    Stream,
}

/// The final answer.
pub(crate) enum Delivered {
    /// Read in full.
    Read(IdempotentResponse),
    /// Handed over unread (only in [`Mode::Stream`]).
    Unread(Response, IdempotencyInfo),
}

enum Answer {
    Final(Delivered),
    Refused(Problem),
    Retry(Failure, Option<Duration>),
}

/// Sends `request` (which already carries the key) until the server gives a final answer, a
/// refusal, or the policy says stop. Every reading of the time and every wait goes through
/// `clock`.
pub(crate) async fn run<T: Transport>(
    policy: &RetryPolicy,
    clock: &dyn Clock,
    op: &Operation,
    mut request: Request,
    transport: &mut T,
    mode: Mode,
) -> Result<Delivered, Stop> {
    if request.try_clone().is_none() {
        return Err(Error::NotCloneable.into());
    }
    if let Some(timeout) = policy.attempt_timeout()
        && request.timeout().is_none()
    {
        *request.timeout_mut() = Some(timeout);
    }
    let started = clock.now().to_system_time();
    let first_attempt_at = op.begin(started);
    // Every attempt states when the first one was sent: a server that no longer keeps a
    // record of the operation refuses a late attempt instead of running it again.
    if let Ok(sent) = HeaderValue::from_str(&httpdate::fmt_http_date(first_attempt_at)) {
        request
            .headers_mut()
            .insert(header::REPEATABILITY_FIRST_SENT, sent);
    }
    // A clock set back reads as no time spent.
    let elapsed = || {
        clock
            .now()
            .to_system_time()
            .duration_since(started)
            .unwrap_or_default()
    };
    let mut attempts = 0u32;
    let mut last: Option<Failure> = None;
    loop {
        if let Some(horizon) = horizon(policy, op, first_attempt_at)
            && !clear_of(
                clock.now().to_system_time(),
                horizon,
                policy.expiry_margin(),
            )
        {
            return Err(Error::RetentionHorizon {
                attempts,
                horizon,
                last: last.map(Box::new),
            }
            .into());
        }
        let Some(attempt) = request.try_clone() else {
            return Err(Error::NotCloneable.into());
        };
        attempts += 1;
        let (failure, retry_after) = match transport.send(attempt).await {
            Err(SendError::Other(e)) => return Err(Stop::Other(e)),
            Err(SendError::Reqwest(e)) if !retryable_transport(&e) => {
                return Err(Error::Transport {
                    source: e,
                    attempts,
                }
                .into());
            }
            Err(SendError::Reqwest(e)) => (Failure::Transport(e), None),
            Ok(response) => match answer(clock, op, response, mode, attempts).await {
                Answer::Final(delivered) => return Ok(delivered),
                Answer::Refused(problem) if problem.is(types::FIRST_SENT_EXPIRED) => {
                    return Err(Error::FirstSentExpired {
                        problem: Box::new(problem),
                        first_attempt_at,
                        attempts,
                    }
                    .into());
                }
                Answer::Refused(problem) => {
                    return Err(Error::Problem {
                        problem: Box::new(problem),
                        attempts,
                    }
                    .into());
                }
                Answer::Retry(failure, retry_after) => (failure, retry_after),
            },
        };

        let give_up = |failure| Error::GaveUp {
            last: Box::new(failure),
            attempts,
            elapsed: elapsed(),
        };
        if attempts >= policy.max_attempts() {
            return Err(give_up(failure).into());
        }
        let delay = retry_after.unwrap_or_else(|| policy.backoff(attempts));
        if let Some(horizon) = horizon(policy, op, first_attempt_at) {
            let next = clock.now().to_system_time().checked_add(delay);
            if !next.is_some_and(|next| clear_of(next, horizon, policy.expiry_margin())) {
                return Err(Error::RetentionHorizon {
                    attempts,
                    horizon,
                    last: Some(Box::new(failure)),
                }
                .into());
            }
        }
        if elapsed().saturating_add(delay) > policy.max_elapsed() {
            return Err(give_up(failure).into());
        }
        last = Some(failure);
        clock.sleep(delay).await;
    }
}

/// When the server may forget the key: its last advertised expiry, else the first attempt plus
/// the configured retention (`None`: too far to represent).
fn horizon(
    policy: &RetryPolicy,
    op: &Operation,
    first_attempt_at: SystemTime,
) -> Option<SystemTime> {
    op.expires_at()
        .or_else(|| first_attempt_at.checked_add(policy.retention()))
}

/// Whether an attempt starting at `at` is clear of the horizon by the margin.
fn clear_of(at: SystemTime, horizon: SystemTime, margin: Duration) -> bool {
    at.checked_add(margin).is_some_and(|end| end < horizon)
}

/// Transport errors that another attempt cannot fix.
fn retryable_transport(error: &reqwest::Error) -> bool {
    !(error.is_builder() || error.is_redirect())
}

/// Statuses that are final whatever the body says.
fn final_by_status(status: StatusCode) -> bool {
    !matches!(status.as_u16(), 400 | 409 | 412 | 422 | 429 | 500..=599)
}

/// Whether an answer is final before its body is read: its status says so, or it is a replay.
/// A replay is the stored outcome, whatever its status: another attempt gets it again.
fn final_unread(status: StatusCode, replayed: bool) -> bool {
    replayed || final_by_status(status)
}

/// What to do with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// The server's final word: returned.
    Final,
    /// Must not be retried with this key: [`Error::Problem`].
    Refuse,
    /// Retried with the same key.
    Retry,
}

/// The verdict on an answer that is not a replay and whose status needs a look at the body
/// (400, 409, 422, 429, 5xx), given the problem `type` of its body (`kind`).
///
/// A problem type of the registry decides by its [`retry`](problem::ProblemType::retry); an
/// unknown or missing type falls back to the status.
fn verdict(status: StatusCode, kind: Option<&str>) -> Verdict {
    match kind.and_then(problem::lookup) {
        Some(known) if known.retry => Verdict::Retry,
        Some(_) => Verdict::Refuse,
        None => match status.as_u16() {
            400 | 422 => Verdict::Refuse,
            429 | 500..=599 => Verdict::Retry,
            // A 409 of the application's own (a business conflict), or a 412 (a failed
            // precondition of its own), is its answer.
            _ => Verdict::Final,
        },
    }
}

async fn answer(
    clock: &dyn Clock,
    op: &Operation,
    mut response: Response,
    mode: Mode,
    attempts: u32,
) -> Answer {
    let status = response.status();
    if let Some(expires_at) = expires(response.headers()) {
        op.advertise(expires_at);
    }
    let info = IdempotencyInfo {
        key: op.key().to_owned(),
        attempts,
        replayed: replayed(response.headers()),
        expires_at: op.expires_at(),
    };
    let final_unread = final_unread(status, info.replayed);
    if mode == Mode::Stream && final_unread {
        return Answer::Final(Delivered::Unread(response, info));
    }

    let version = response.version();
    let url = response.url().clone();
    let headers = std::mem::take(response.headers_mut());
    let extensions = std::mem::take(response.extensions_mut());
    let body = match response.bytes().await {
        Ok(body) => body,
        // The answer was lost on the way: another attempt with the same key gets it again.
        Err(e) => return Answer::Retry(Failure::Transport(e), None),
    };
    let verdict = if final_unread {
        Verdict::Final
    } else {
        verdict(status, problem_type(&headers, &body).as_deref())
    };
    match verdict {
        Verdict::Refuse => Answer::Refused(Problem::parse(status, headers, body)),
        Verdict::Final | Verdict::Retry => {
            let retry_after = retry_after(&headers, clock.now().to_system_time());
            let read = IdempotentResponse {
                status,
                version,
                url,
                headers,
                body,
                extensions,
                info,
            };
            if verdict == Verdict::Final {
                Answer::Final(Delivered::Read(read))
            } else {
                Answer::Retry(Failure::Response(Box::new(read)), retry_after)
            }
        }
    }
}

/// `Retry-After`, in seconds or as an HTTP-date (a date in the past means now).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// `Idempotency-Key-Expires`.
fn expires(headers: &HeaderMap) -> Option<SystemTime> {
    let value = headers
        .get(header::IDEMPOTENCY_KEY_EXPIRES)?
        .to_str()
        .ok()?;
    httpdate::parse_http_date(value.trim()).ok()
}

/// `Idempotent-Replayed: true`.
fn replayed(headers: &HeaderMap) -> bool {
    headers
        .get(header::IDEMPOTENT_REPLAYED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::types;
    use reqwest::header::HeaderValue;

    fn with(name: &'static str, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn retry_after_in_seconds_or_as_a_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            retry_after(&with("retry-after", " 7 "), now),
            Some(Duration::from_secs(7))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            retry_after(&with("retry-after", &later), now),
            Some(Duration::from_secs(30))
        );
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(
            retry_after(&with("retry-after", &earlier), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&with("retry-after", "soon"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn expiry_and_replay_headers() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let h = with("idempotency-key-expires", &httpdate::fmt_http_date(at));
        assert_eq!(expires(&h), Some(at));
        assert!(replayed(&with("idempotent-replayed", "true")));
        assert!(replayed(&with("idempotent-replayed", "TRUE")));
        assert!(!replayed(&with("idempotent-replayed", "false")));
        assert!(!replayed(&HeaderMap::new()));
    }

    #[test]
    fn the_margin_keeps_attempts_clear_of_the_horizon() {
        let h = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let at = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        assert!(clear_of(at(98), h, Duration::from_secs(1)));
        assert!(!clear_of(at(99), h, Duration::from_secs(1)));
        assert!(!clear_of(at(100), h, Duration::ZERO));
    }

    #[test]
    fn a_registered_problem_type_decides_by_its_retry_flag() {
        let v =
            |status: u16, kind: &str| verdict(StatusCode::from_u16(status).unwrap(), Some(kind));
        let needs_body =
            |p: &&problem::ProblemType| !final_by_status(StatusCode::from_u16(p.status).unwrap());
        for p in problem::ALL.iter().filter(needs_body) {
            let expected = if p.retry {
                Verdict::Retry
            } else {
                Verdict::Refuse
            };
            assert_eq!(v(p.status, p.uri), expected, "{}", p.name);
        }
        assert_eq!(v(504, types::UPSTREAM_OUTCOME_UNKNOWN), Verdict::Refuse);
        assert_eq!(v(500, types::RESPONSE_TOO_LARGE), Verdict::Refuse);
        assert_eq!(v(400, types::REQUEST_UNREADABLE), Verdict::Retry);
        assert_eq!(v(409, types::REQUEST_IN_FLIGHT), Verdict::Retry);
    }

    #[test]
    fn without_a_registered_type_the_status_decides() {
        for kind in [None, Some("urn:example:problem:already-shipped")] {
            let v = |status: u16| verdict(StatusCode::from_u16(status).unwrap(), kind);
            assert_eq!(v(400), Verdict::Refuse);
            assert_eq!(v(422), Verdict::Refuse);
            assert_eq!(v(409), Verdict::Final);
            assert_eq!(v(429), Verdict::Retry);
            assert_eq!(v(500), Verdict::Retry);
            assert_eq!(v(503), Verdict::Retry);
        }
    }

    #[test]
    fn a_replay_is_final_whatever_its_status() {
        for s in [200, 400, 409, 422, 429, 500, 503] {
            assert!(final_unread(StatusCode::from_u16(s).unwrap(), true), "{s}");
        }
        assert!(!final_unread(StatusCode::INTERNAL_SERVER_ERROR, false));
    }

    #[test]
    fn which_statuses_need_a_look_at_the_body() {
        for s in [200, 201, 302, 401, 402, 404, 413] {
            assert!(final_by_status(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [400, 409, 422, 429, 500, 503, 599] {
            assert!(!final_by_status(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }
}
