//! The problem types of the contract, declared once.
//!
//! Every error answer of idemkey is `application/problem+json` (RFC 9457) with a stable
//! `type`: `urn:idemkey:problem:` followed by a name. Each type is one [`ProblemType`] constant
//! here, with its HTTP status, its title and whether a client may retry it with the same key.
//! The layer and the gateway (`idemkey-tower`), the reference payments API (`idemkey-server`)
//! and the client (`idemkey-client`) all read these constants, and a test checks the tables of
//! `docs/guide/contract.md` against [`ALL`].
//!
//! ```
//! use idemkey_core::problem;
//!
//! let p = problem::lookup("urn:idemkey:problem:request-in-flight").unwrap();
//! assert_eq!(p, &problem::REQUEST_IN_FLIGHT);
//! assert_eq!((p.name, p.status, p.retry), ("request-in-flight", 409, true));
//! assert!(problem::lookup("urn:example:problem:already-shipped").is_none());
//! ```

/// The media type of every error answer.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The prefix as a literal, so that `concat!` can build each [`ProblemType::uri`].
macro_rules! prefix {
    () => {
        "urn:idemkey:problem:"
    };
}

/// The prefix of every problem `type` URI; the name follows it.
pub const PROBLEM_TYPE_PREFIX: &str = prefix!();

/// One problem type of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ProblemType {
    /// The name, e.g. `key-reused`.
    pub name: &'static str,
    /// The `type` member: [`PROBLEM_TYPE_PREFIX`] followed by the name.
    pub uri: &'static str,
    /// The HTTP status it is answered with (and the `status` member).
    pub status: u16,
    /// The `title` member.
    pub title: &'static str,
    /// Whether retrying with the same key is safe **and** can change the answer: nothing was
    /// executed, or the attempt is still running, so a later attempt may get another answer.
    ///
    /// `false` when the same request would get the same answer (the request must be fixed, or
    /// the answer is final), or when retrying is not safe (the outcome is unknown until it is
    /// resolved; a request without a key is not protected).
    pub retry: bool,
}

/// Declares one `pub const` per problem type.
macro_rules! problem_types {
    ($(
        $(#[$doc:meta])*
        $ident:ident = $name:literal, $status:literal, $title:literal, retry: $retry:literal;
    )*) => {$(
        $(#[$doc])*
        pub const $ident: ProblemType = ProblemType {
            name: $name,
            uri: concat!(prefix!(), $name),
            status: $status,
            title: $title,
            retry: $retry,
        };
    )*};
}

problem_types! {
    /// The route requires an `Idempotency-Key` and the request had none.
    KEY_MISSING = "key-missing", 400, "Idempotency-Key missing", retry: false;
    /// The `Idempotency-Key` is malformed, or the header appears more than once.
    KEY_INVALID = "key-invalid", 400, "Idempotency-Key invalid", retry: false;
    /// The body is over the route's limit.
    REQUEST_TOO_LARGE = "request-too-large", 413, "Request body too large", retry: false;
    /// The body could not be read; nothing was executed.
    REQUEST_UNREADABLE = "request-unreadable", 400, "Request body unreadable", retry: true;
    /// The route requires a `Repeatability-First-Sent` header and the request had none.
    FIRST_SENT_MISSING = "first-sent-missing", 400, "Repeatability-First-Sent missing",
        retry: false;
    /// The `Repeatability-First-Sent` header is not one HTTP date, or is further ahead of the
    /// server's clock than the clock-skew allowance.
    FIRST_SENT_INVALID = "first-sent-invalid", 400, "Repeatability-First-Sent invalid",
        retry: false;
    /// The first attempt was sent longer ago than the retention (less the clock-skew margin)
    /// and no live record answers it: its record may have been purged, so it is not run. Not
    /// retried: the answer only gets more final.
    FIRST_SENT_EXPIRED = "first-sent-expired", 412, "First attempt outside the retention window",
        retry: false;
    /// The key was used with a different request.
    KEY_REUSED = "key-reused", 422, "Idempotency-Key reused with a different request",
        retry: false;
    /// The first attempt with this key is still running.
    REQUEST_IN_FLIGHT = "request-in-flight", 409, "Request in flight", retry: true;
    /// The outcome of the first attempt is unknown; it is not re-executed until it is resolved.
    OUTCOME_UNKNOWN = "outcome-unknown", 409, "Outcome unknown", retry: false;
    /// The idempotency store could not be reached; nothing was executed.
    STORE_UNAVAILABLE = "store-unavailable", 503, "Idempotency store unavailable", retry: true;
    /// The store did not grant its lock in time; nothing was executed.
    STORE_BUSY = "store-busy", 503, "Idempotency store busy", retry: true;
    /// The response was too large to store. In one local transaction its effect was rolled
    /// back; after a call out (external mode, the gateway) it may have happened, and the
    /// operation is left indeterminate, with `status_url` linking its status resource. Not
    /// retried: the same response would be too large again.
    RESPONSE_TOO_LARGE = "response-too-large", 500, "Response too large to store", retry: false;
    /// The handler failed; its effect was rolled back.
    INTERNAL_ERROR = "internal-error", 500, "Internal error", retry: true;
    /// Server misconfiguration: a handler asked for the idempotency transaction where the
    /// layer gives none.
    TRANSACTION_UNAVAILABLE = "transaction-unavailable", 500, "Transaction unavailable",
        retry: false;
    /// Status resource: no record of this key for the caller.
    KEY_NOT_FOUND = "key-not-found", 404, "Idempotency-Key not found", retry: false;
    /// Gateway: the upstream could not be reached; nothing was sent, the key is free again.
    UPSTREAM_UNAVAILABLE = "upstream-unavailable", 503, "Upstream unavailable", retry: true;
    /// Gateway: the request was sent upstream and no complete answer came back; the operation
    /// may have happened and is not re-executed until it is resolved.
    UPSTREAM_OUTCOME_UNKNOWN = "upstream-outcome-unknown", 504, "Upstream outcome unknown",
        retry: false;
    /// Gateway, request without a key: the upstream gave no complete answer; nothing protects
    /// a retry.
    UPSTREAM_FAILED = "upstream-failed", 502, "Upstream failed", retry: false;
    /// `serve` and `gateway`: the server holds as many client connections as it is allowed;
    /// the request was answered without being run. Answered with `Retry-After`.
    SERVER_OVERLOADED = "server-overloaded", 503, "Server overloaded", retry: true;

    /// Payments API: no or an unknown bearer token.
    UNAUTHORIZED = "unauthorized", 401, "Unauthorized", retry: false;
    /// Payments API: the body or query is invalid; nothing was done.
    INVALID_REQUEST = "invalid-request", 400, "Invalid request", retry: false;
    /// Payments API: the payment was declined (stored and replayed like any outcome).
    PAYMENT_DECLINED = "payment-declined", 402, "Payment declined", retry: false;
    /// Payments API: no such payment for this tenant.
    NOT_FOUND = "not-found", 404, "Not found", retry: false;
    /// Payments API: the tenant already made a payment with this `reference` (whatever its
    /// idempotency key); the answer names it (stored and replayed like any outcome).
    PAYMENT_REFERENCE_USED = "payment-reference-used", 409, "Payment reference already used",
        retry: false;
}

/// Every problem type: the layer's and the gateway's, then the reference payments API's own
/// ([`UNAUTHORIZED`], [`INVALID_REQUEST`], [`PAYMENT_DECLINED`], [`NOT_FOUND`],
/// [`PAYMENT_REFERENCE_USED`]; it answers
/// [`INTERNAL_ERROR`] too).
pub const ALL: &[ProblemType] = &[
    KEY_MISSING,
    KEY_INVALID,
    REQUEST_TOO_LARGE,
    REQUEST_UNREADABLE,
    FIRST_SENT_MISSING,
    FIRST_SENT_INVALID,
    FIRST_SENT_EXPIRED,
    KEY_REUSED,
    REQUEST_IN_FLIGHT,
    OUTCOME_UNKNOWN,
    STORE_UNAVAILABLE,
    STORE_BUSY,
    RESPONSE_TOO_LARGE,
    INTERNAL_ERROR,
    TRANSACTION_UNAVAILABLE,
    KEY_NOT_FOUND,
    UPSTREAM_UNAVAILABLE,
    UPSTREAM_OUTCOME_UNKNOWN,
    UPSTREAM_FAILED,
    SERVER_OVERLOADED,
    UNAUTHORIZED,
    INVALID_REQUEST,
    PAYMENT_DECLINED,
    NOT_FOUND,
    PAYMENT_REFERENCE_USED,
];

/// The problem type whose [`uri`](ProblemType::uri) is `uri` (compared exactly), if it is one
/// of [`ALL`].
pub fn lookup(uri: &str) -> Option<&'static ProblemType> {
    ALL.iter().find(|p| p.uri == uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_uri_is_the_prefix_and_the_name() {
        for p in ALL {
            assert_eq!(p.uri, format!("{PROBLEM_TYPE_PREFIX}{}", p.name));
            assert_eq!(lookup(p.uri), Some(p), "{}", p.name);
        }
    }

    #[test]
    fn names_are_unique() {
        for (i, p) in ALL.iter().enumerate() {
            assert!(
                ALL[i + 1..].iter().all(|q| q.name != p.name),
                "{} is declared twice",
                p.name
            );
        }
    }

    #[test]
    fn unknown_uris_are_not_found() {
        assert_eq!(lookup("key-reused"), None);
        assert_eq!(lookup("urn:idemkey:problem:"), None);
        assert_eq!(lookup("about:blank"), None);
    }
}
