//! One logical operation and its idempotency key.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use reqwest::header::HeaderValue;

/// One logical write, named by one idempotency key.
///
/// The key is chosen once, before the first attempt, and sent on every attempt of the
/// operation: a key generated per HTTP call is not an idempotency key, it is a request id.
///
/// An `Operation` also remembers what the client learnt about the key's retention: when its
/// first attempt was made and the last `Idempotency-Key-Expires` the server advertised. The
/// client never sends the key after that horizon.
///
/// Clones name the **same** operation: they share the key and that state. To survive a restart
/// of the caller, persist [`key`](Self::key) and [`first_attempt_at`](Self::first_attempt_at)
/// before the first attempt completes and rebuild the operation with
/// [`resume`](Self::resume).
#[derive(Clone)]
pub struct Operation {
    inner: Arc<Inner>,
}

struct Inner {
    key: String,
    header: HeaderValue,
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone, Copy)]
struct State {
    first_attempt_at: Option<SystemTime>,
    expires_at: Option<SystemTime>,
}

impl Operation {
    /// A new operation with a fresh random key (a UUID v4).
    ///
    /// ```
    /// use idemkey_client::Operation;
    ///
    /// let op = Operation::new();
    /// assert_eq!(op.key().len(), 36); // a UUID v4
    /// assert!(op.first_attempt_at().is_none()); // not sent yet
    /// ```
    pub fn new() -> Self {
        let key = uuid::Uuid::new_v4().to_string();
        Self::from_parts(key, None)
    }

    /// An operation with a key the caller chose (and may have persisted).
    ///
    /// The key must be 1 to 255 characters of visible ASCII without space, `"`, `\` or `,`,
    /// as the contract requires.
    ///
    /// A key derived from the caller's own record names one operation across calls; its
    /// retention clock starts at its first attempt. A caller resuming after a restart uses
    /// [`resume`](Self::resume) instead, which keeps the first attempt's time.
    ///
    /// ```
    /// use idemkey_client::Operation;
    ///
    /// let order_id = "ord_1042";
    /// let op = Operation::with_key(format!("refund-{order_id}"))?;
    /// assert_eq!(op.key(), "refund-ord_1042");
    /// assert!(Operation::with_key("two words").is_err());
    /// # Ok::<(), idemkey_client::InvalidKey>(())
    /// ```
    pub fn with_key(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let key = key.into();
        validate(&key)?;
        Ok(Self::from_parts(key, None))
    }

    /// An operation resumed after a restart: its key and the time of its first attempt, as
    /// persisted by the caller. The configured retention is measured from that time.
    ///
    /// ```no_run
    /// use std::time::SystemTime;
    /// use idemkey_client::{Error, IdempotentClient, Operation};
    ///
    /// # async fn run(client: IdempotentClient, request: reqwest::RequestBuilder) -> Result<(), Box<dyn std::error::Error>> {
    /// // Before the first attempt: persist the key and the time (here, in memory).
    /// let op = Operation::new();
    /// let saved = (op.key().to_owned(), SystemTime::now());
    ///
    /// // After a restart: the same key, and retention still measured from the first attempt.
    /// let op = Operation::resume(saved.0, saved.1)?;
    /// match client.send(&op, request).await {
    ///     Ok(response) => println!("{}", response.status()), // replayed if it had completed
    ///     Err(Error::RetentionHorizon { .. }) => println!("too late to retry safely: look it up"),
    ///     Err(e) => return Err(e.into()),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn resume(
        key: impl Into<String>,
        first_attempt_at: SystemTime,
    ) -> Result<Self, InvalidKey> {
        let key = key.into();
        validate(&key)?;
        Ok(Self::from_parts(key, Some(first_attempt_at)))
    }

    /// An operation for a key found in a request's `Idempotency-Key` header, sent unchanged.
    pub(crate) fn from_header(header: HeaderValue) -> Self {
        let key = String::from_utf8_lossy(header.as_bytes()).into_owned();
        Self {
            inner: Arc::new(Inner {
                key,
                header,
                state: Mutex::new(State::default()),
            }),
        }
    }

    fn from_parts(key: String, first_attempt_at: Option<SystemTime>) -> Self {
        // Validated keys (and UUIDs) are visible ASCII, always a valid header value.
        let header = HeaderValue::from_str(&key).expect("a validated key is a valid header value");
        Self {
            inner: Arc::new(Inner {
                key,
                header,
                state: Mutex::new(State {
                    first_attempt_at,
                    expires_at: None,
                }),
            }),
        }
    }

    /// The idempotency key sent on every attempt.
    pub fn key(&self) -> &str {
        &self.inner.key
    }

    /// When the first attempt of this operation was made, if one was.
    pub fn first_attempt_at(&self) -> Option<SystemTime> {
        self.state().first_attempt_at
    }

    /// The last `Idempotency-Key-Expires` the server advertised for this key, if any.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.state().expires_at
    }

    pub(crate) fn header_value(&self) -> &HeaderValue {
        &self.inner.header
    }

    /// Records the first attempt (once) and returns its time.
    pub(crate) fn begin(&self, now: SystemTime) -> SystemTime {
        let mut state = self.lock();
        *state.first_attempt_at.get_or_insert(now)
    }

    /// Records an advertised expiry.
    pub(crate) fn advertise(&self, expires_at: SystemTime) {
        self.lock().expires_at = Some(expires_at);
    }

    fn state(&self) -> State {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is two plain values: a panic elsewhere cannot leave it half-written.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for Operation {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("Operation")
            .field("key", &self.inner.key)
            .field("first_attempt_at", &state.first_attempt_at)
            .field("expires_at", &state.expires_at)
            .finish()
    }
}

/// A key the contract does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid idempotency key: {reason}")]
pub struct InvalidKey {
    reason: &'static str,
}

impl InvalidKey {
    /// Why the key was refused.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

fn validate(key: &str) -> Result<(), InvalidKey> {
    let refuse = |reason| Err(InvalidKey { reason });
    if key.is_empty() {
        return refuse("it is empty");
    }
    if key.len() > 255 {
        return refuse("it is longer than 255 characters");
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b','))
    {
        return refuse("only visible ASCII without space, '\"', '\\' or ',' is allowed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_keys_are_uuids_and_differ() {
        let a = Operation::new();
        let b = Operation::new();
        assert_ne!(a.key(), b.key());
        let parsed = uuid::Uuid::parse_str(a.key()).unwrap();
        assert_eq!(parsed.get_version_num(), 4);
    }

    #[test]
    fn caller_keys_are_validated() {
        assert!(Operation::with_key("order-42").is_ok());
        assert!(Operation::with_key("").is_err());
        assert!(Operation::with_key("a b").is_err());
        assert!(Operation::with_key("a,b").is_err());
        assert!(Operation::with_key("\"ab\"").is_err());
        assert!(Operation::with_key("é").is_err());
        assert!(Operation::with_key("x".repeat(255)).is_ok());
        assert!(Operation::with_key("x".repeat(256)).is_err());
    }

    #[test]
    fn clones_share_the_state() {
        let a = Operation::new();
        let b = a.clone();
        let t = SystemTime::UNIX_EPOCH;
        assert_eq!(a.begin(t), t);
        assert_eq!(b.begin(SystemTime::now()), t);
        b.advertise(t);
        assert_eq!(a.expires_at(), Some(t));
    }
}
