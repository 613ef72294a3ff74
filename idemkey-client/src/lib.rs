//! An HTTP client that retries writes safely under the idemkey contract.
//!
//! One logical operation is one [`Operation`], named by one `Idempotency-Key` chosen once,
//! before the first attempt (a fresh UUID v4, or a key the caller persisted so that it
//! survives a restart). Every attempt of that operation sends the same key and the same body
//! bytes: a key generated per HTTP call is not an idempotency key, it is a request id.
//!
//! What the client does with each answer (`docs/guide/contract.md` states the server's side):
//!
//! | answer | what happens |
//! |---|---|
//! | connection failure, timeout, other transport error | retried, same key |
//! | `Idempotent-Replayed: true`, whatever its status | the stored outcome, final: [`IdempotentResponse`] |
//! | 400, 409, 422, 429, 5xx with a problem `type` of the contract | as [`idemkey_core::problem`] says: retried, same key, when retrying can change the answer (`request-in-flight`, `store-unavailable`, `request-unreadable`…); else [`Error::Problem`] (`key-reused`, `outcome-unknown`, `upstream-outcome-unknown`, `response-too-large`…) |
//! | 429, 5xx of another or no `type` | retried, same key |
//! | 400, 422 of another or no `type` | [`Error::Problem`], never retried |
//! | anything else (2xx, 3xx, 401, 402, 404, 413, a business 409…) | the final answer: [`IdempotentResponse`] |
//!
//! A retry waits for `Retry-After` when the answer gives one, else for a jittered backoff.
//!
//! Retries are bounded by a [`RetryPolicy`] (attempts, total time) and never scheduled past the
//! key's retention horizon: the `Idempotency-Key-Expires` the server advertises, or the first
//! attempt plus the configured retention (24 h). After that horizon the server would treat the
//! key as new and run the operation again, so the client returns
//! [`Error::RetentionHorizon`] instead.
//!
//! Two entry points share one retry loop: [`IdempotentClient`], and [`IdempotencyMiddleware`]
//! for a `reqwest_middleware` client.
//!
//! The loop reads the time and waits through a [`Clock`]: the [`SystemClock`] unless
//! `with_clock` on either entry point gives another. The horizon, `Retry-After` dates and the
//! time spent are all measured on it, so a test clock whose waits take no time makes a retry
//! test instant and lets it check each wait (see [`SystemClock`]). [`Clock`] is
//! `idemkey_core`'s, the one the server-side layer reads and waits on too.
//!
//! ```no_run
//! use idemkey_client::{Error, IdempotentClient, Operation, problem};
//!
//! # async fn run() -> Result<(), Error> {
//! let client = IdempotentClient::new(reqwest::Client::new());
//! let payment = serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c1"});
//!
//! // One key for this one payment, chosen before the first attempt.
//! let op = Operation::new();
//! let request = client
//!     .inner()
//!     .post("http://127.0.0.1:8080/v1/payments")
//!     .bearer_auth("tok_acme")
//!     .json(&payment);
//! match client.send(&op, request).await {
//!     Ok(response) => {
//!         println!(
//!             "{} after {} attempt(s), replayed: {}",
//!             response.status(),
//!             response.attempts(),
//!             response.is_replayed()
//!         );
//!     }
//!     Err(Error::Problem { problem, .. }) if problem.is(problem::types::KEY_REUSED) => {
//!         eprintln!("this key was already used for another payment: {problem}");
//!     }
//!     Err(e) => return Err(e),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! With `reqwest_middleware`:
//!
//! ```no_run
//! use idemkey_client::{IdempotencyInfo, IdempotencyMiddleware};
//!
//! # async fn run() -> Result<(), reqwest_middleware::Error> {
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::default())
//!     .build();
//! let response = client
//!     .post("http://127.0.0.1:8080/v1/payments")
//!     .bearer_auth("tok_acme")
//!     .json(&serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c1"}))
//!     .send()
//!     .await?;
//! let info = response.extensions().get::<IdempotencyInfo>().unwrap();
//! println!("key {} used {} time(s)", info.key(), info.attempts());
//! # Ok(())
//! # }
//! ```

mod client;
mod clock;
mod error;
mod middleware;
mod operation;
mod policy;
pub mod problem;
mod response;
mod retry;

pub use client::IdempotentClient;
pub use clock::{Clock, Sleep, SystemClock, Timestamp};
pub use error::{Error, Failure};
pub use middleware::IdempotencyMiddleware;
pub use operation::{InvalidKey, Operation};
pub use policy::RetryPolicy;
pub use problem::Problem;
pub use response::{IdempotencyInfo, IdempotentResponse};

/// The header names of the contract (lower case, usable with `HeaderMap::get`).
pub mod header {
    /// The key of the operation, sent on every attempt.
    pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
    /// When the server will forget the key (an HTTP-date); never retry after it.
    pub const IDEMPOTENCY_KEY_EXPIRES: &str = "idempotency-key-expires";
    /// `true` on an answer replayed from the stored outcome.
    pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
    /// When the operation's first attempt was sent (an HTTP-date), sent on every attempt:
    /// the server refuses an attempt older than its retention instead of running it again.
    pub const REPEATABILITY_FIRST_SENT: &str = idemkey_core::FIRST_SENT_HEADER;
    /// `accepted` or `rejected`, on an answer to a request that stated its first attempt's
    /// time.
    pub const REPEATABILITY_RESULT: &str = idemkey_core::REPEATABILITY_RESULT_HEADER;
}
