//! The problem types of the contract, declared once.
//!
//! Every error answer of idemkey is `application/problem+json` (RFC 9457) with a stable
//! `type`: `urn:idemkey:problem:` followed by a name. Each type is one [`ProblemType`]
//! constant, with its HTTP status, its title and whether a client may retry it with the same
//! key, declared with [`problem_types!`](crate::problem_types) by the component that answers
//! it, in a list of that component's:
//!
//! - [`CONTRACT`]: the layer's, the status resource's and the server's connection limit,
//!   which any server built on idemkey answers;
//! - [`GATEWAY`]: what `idemkey gateway` answers of its own, about its upstream and its
//!   tenants (its rejections live with the gateway, in `idemkey-server`).
//!
//! Both are what a client must understand whatever idemkey server it talks to: [`ALL`] is
//! their union, and [`lookup`] (which `idemkey-client` reads to decide a retry) searches it.
//! An application declares its own types the same way in its own crate (the reference
//! payments API: `idemkey_server::problem::PAYMENTS`), and a test checks the tables of
//! `docs/guide/contract.md` against every list.
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

/// The prefix of every problem `type` URI; the name follows it.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:idemkey:problem:";

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

impl ProblemType {
    /// A problem type, as [`problem_types!`](crate::problem_types) declares it (`uri` is
    /// [`PROBLEM_TYPE_PREFIX`] and `name`).
    #[doc(hidden)]
    pub const fn declared(
        name: &'static str,
        uri: &'static str,
        status: u16,
        title: &'static str,
        retry: bool,
    ) -> Self {
        Self {
            name,
            uri,
            status,
            title,
            retry,
        }
    }
}

/// Declares one `pub const` [`ProblemType`](crate::problem::ProblemType) per problem type.
///
/// Each type is `IDENT = "name", status, "title", retry: bool;` after its doc comment; its
/// `type` URI is [`PROBLEM_TYPE_PREFIX`](crate::problem::PROBLEM_TYPE_PREFIX) followed by the
/// name. A crate declares the types it answers with it, beside the code that answers them,
/// lists them in a `&[ProblemType]` of its own, and checks its documentation against that
/// list.
///
/// ```
/// use idemkey_core::problem::{self, ProblemType};
///
/// idemkey_core::problem_types! {
///     /// The order was shipped already: it is the outcome.
///     ALREADY_SHIPPED = "already-shipped", 409, "Already shipped", retry: false;
/// }
///
/// /// Every problem type of this service.
/// pub const SHOP: &[ProblemType] = &[ALREADY_SHIPPED];
///
/// assert_eq!(SHOP[0].uri, "urn:idemkey:problem:already-shipped");
/// assert!(problem::lookup(ALREADY_SHIPPED.uri).is_none(), "not one of the contract's");
/// ```
#[macro_export]
macro_rules! problem_types {
    ($(
        $(#[$doc:meta])*
        $ident:ident = $name:literal, $status:literal, $title:literal, retry: $retry:literal;
    )*) => {$(
        $(#[$doc])*
        pub const $ident: $crate::problem::ProblemType = $crate::problem::ProblemType::declared(
            $name,
            concat!("urn:idemkey:problem:", $name),
            $status,
            $title,
            $retry,
        );
    )*};
}

crate::problem_types! {
    /// The route requires an `Idempotency-Key` and the request had none.
    KEY_MISSING = "key-missing", 400, "Idempotency-Key missing", retry: false;
    /// The `Idempotency-Key` is malformed, or the header appears more than once.
    KEY_INVALID = "key-invalid", 400, "Idempotency-Key invalid", retry: false;
    /// The body is over the route's limit.
    REQUEST_TOO_LARGE = "request-too-large", 413, "Request body too large", retry: false;
    /// The body could not be read; nothing was executed.
    REQUEST_UNREADABLE = "request-unreadable", 400, "Request body unreadable", retry: true;
    /// The body is in a content coding the server does not decode; the answer's
    /// `Accept-Encoding` names those it does. Nothing was executed.
    ENCODING_UNSUPPORTED = "encoding-unsupported", 415, "Content-Encoding unsupported",
        retry: false;
    /// The body does not decode as its `Content-Encoding` says; nothing was executed.
    REQUEST_UNDECODABLE = "request-undecodable", 400, "Request body does not decode",
        retry: false;
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
    /// `serve` and `gateway`: the server holds as many client connections as it is allowed;
    /// the request was answered without being run. Answered with `Retry-After`.
    SERVER_OVERLOADED = "server-overloaded", 503, "Server overloaded", retry: true;
}

crate::problem_types! {
    /// Gateway: the upstream could not be reached; nothing was sent, the key is free again.
    UPSTREAM_UNAVAILABLE = "upstream-unavailable", 503, "Upstream unavailable", retry: true;
    /// Gateway: the request was sent upstream and no complete answer came back; the operation
    /// may have happened and is not re-executed until it is resolved.
    UPSTREAM_OUTCOME_UNKNOWN = "upstream-outcome-unknown", 504, "Upstream outcome unknown",
        retry: false;
    /// Gateway, request without a key: the upstream gave no complete answer; nothing protects
    /// a retry.
    UPSTREAM_FAILED = "upstream-failed", 502, "Upstream failed", retry: false;
    /// Gateway: no or an unknown bearer token, or no tenant header from the authenticating
    /// proxy; not stored. The reference payments API answers it too.
    UNAUTHORIZED = "unauthorized", 401, "Unauthorized", retry: false;
}

/// The types of the contract that any server built on idemkey answers: the layer's, the
/// status resource's ([`KEY_NOT_FOUND`]) and the connection limit's ([`SERVER_OVERLOADED`]).
pub const CONTRACT: &[ProblemType] = &[
    KEY_MISSING,
    KEY_INVALID,
    REQUEST_TOO_LARGE,
    REQUEST_UNREADABLE,
    ENCODING_UNSUPPORTED,
    REQUEST_UNDECODABLE,
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
    SERVER_OVERLOADED,
];

/// The types `idemkey gateway` answers of its own, about its upstream and its tenants; it
/// answers the contract's too.
pub const GATEWAY: &[ProblemType] = &[
    UPSTREAM_UNAVAILABLE,
    UPSTREAM_OUTCOME_UNKNOWN,
    UPSTREAM_FAILED,
    UNAUTHORIZED,
];

/// The lists a client must understand whatever idemkey server it talks to.
pub const REGISTRY: &[&[ProblemType]] = &[CONTRACT, GATEWAY];

/// `a` then `b`, as one array of `N` (`a.len() + b.len()`) types.
const fn concat<const N: usize>(a: &[ProblemType], b: &[ProblemType]) -> [ProblemType; N] {
    assert!(a.len() + b.len() == N);
    let mut all = [KEY_MISSING; N];
    let mut i = 0;
    while i < N {
        all[i] = if i < a.len() { a[i] } else { b[i - a.len()] };
        i += 1;
    }
    all
}

/// Every type of the [`REGISTRY`]: [`CONTRACT`], then [`GATEWAY`]. An application's own
/// types (the reference payments API's) are not among them.
pub const ALL: &[ProblemType] = &concat::<{ CONTRACT.len() + GATEWAY.len() }>(CONTRACT, GATEWAY);

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
    fn all_is_every_list_of_the_registry_in_order() {
        let lists: Vec<ProblemType> = REGISTRY.iter().flat_map(|l| l.iter().copied()).collect();
        assert_eq!(ALL, &lists[..]);
    }

    #[test]
    fn unknown_uris_are_not_found() {
        assert_eq!(lookup("key-reused"), None);
        assert_eq!(lookup("urn:idemkey:problem:"), None);
        assert_eq!(lookup("about:blank"), None);
    }
}
