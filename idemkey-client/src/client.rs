//! The client entry point.

use std::future::Future;
use std::sync::Arc;

use reqwest::header::HeaderName;
use reqwest::{IntoUrl, Request, RequestBuilder, Response};
use serde::Serialize;

use crate::retry::{self, Delivered, Mode, SendError, Stop, Transport};
use crate::{Clock, Error, IdempotentResponse, Operation, RetryPolicy, SystemClock, header};

/// A `reqwest::Client` that executes writes as idempotent operations.
///
/// Every attempt of an operation carries the operation's `Idempotency-Key` and the same body
/// bytes. Connection failures, timeouts, and answers that another attempt can change (5xx,
/// 429, 409 `request-in-flight`…) are retried (honouring `Retry-After`, else with jittered
/// exponential backoff); answers that must not be retried with this key (400, 422, 409
/// `outcome-unknown`, 504 `upstream-outcome-unknown`…) are returned as [`Error::Problem`]; any
/// other answer, and any replayed one, is the server's final word and is returned as an
/// [`IdempotentResponse`]. The crate documentation has the full table; see [`RetryPolicy`] for
/// the bounds.
#[derive(Debug, Clone)]
pub struct IdempotentClient {
    client: reqwest::Client,
    policy: RetryPolicy,
    clock: Arc<dyn Clock>,
}

impl IdempotentClient {
    /// Wraps `client` with the default [`RetryPolicy`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemkey_client::IdempotentClient;
    ///
    /// let http = reqwest::Client::builder()
    ///     .connect_timeout(Duration::from_secs(2))
    ///     .build()?;
    /// let client = IdempotentClient::new(http);
    /// # Ok::<(), reqwest::Error>(())
    /// ```
    pub fn new(client: reqwest::Client) -> Self {
        Self::with_policy(client, RetryPolicy::default())
    }

    /// Wraps `client` with `policy`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemkey_client::{IdempotentClient, RetryPolicy};
    ///
    /// let policy = RetryPolicy::new().with_max_attempts(5).with_max_elapsed(Duration::from_secs(20));
    /// let client = IdempotentClient::with_policy(reqwest::Client::new(), policy);
    /// ```
    pub fn with_policy(client: reqwest::Client, policy: RetryPolicy) -> Self {
        Self {
            client,
            policy,
            clock: Arc::new(SystemClock),
        }
    }

    /// Reads the time and waits between attempts with `clock` instead of the [`SystemClock`]
    /// (a test's clock, say, that records the waits instead of sleeping).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idemkey_client::{IdempotentClient, SystemClock};
    ///
    /// let client = IdempotentClient::new(reqwest::Client::new()).with_clock(Arc::new(SystemClock));
    /// # let _ = client;
    /// ```
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The wrapped client (to build requests with).
    pub fn inner(&self) -> &reqwest::Client {
        &self.client
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Executes `request` as (one call of) the operation `op`.
    ///
    /// The operation's key replaces any `Idempotency-Key` the request carries. The body must
    /// be bytes, not a stream ([`Error::NotCloneable`]). Executing the same operation again,
    /// after a restart or a returned error, sends the same key again: the server answers with
    /// the stored outcome if there is one.
    ///
    /// ```no_run
    /// # use idemkey_client::{IdempotentClient, Operation};
    /// # async fn run() -> Result<(), idemkey_client::Error> {
    /// let client = IdempotentClient::new(reqwest::Client::new());
    /// let op = Operation::new();
    /// let request = client
    ///     .inner()
    ///     .post("http://127.0.0.1:8080/v1/payments")
    ///     .body(r#"{"amount":500,"currency":"EUR","customer":"c1"}"#)
    ///     .build()
    ///     .expect("a valid request");
    /// let response = client.execute(&op, request).await?;
    /// println!("{}", response.status());
    /// # Ok(()) }
    /// ```
    pub async fn execute(
        &self,
        op: &Operation,
        mut request: Request,
    ) -> Result<IdempotentResponse, Error> {
        request.headers_mut().insert(
            HeaderName::from_static(header::IDEMPOTENCY_KEY),
            op.header_value().clone(),
        );
        let mut transport = ClientTransport {
            client: &self.client,
        };
        let clock = &*self.clock;
        match retry::run(
            &self.policy,
            clock,
            op,
            request,
            &mut transport,
            Mode::Buffer,
        )
        .await
        {
            Ok(Delivered::Read(response)) => Ok(response),
            Ok(Delivered::Unread(..)) => unreachable!("Mode::Buffer reads every answer"),
            Err(Stop::Error(e)) => Err(e),
            Err(Stop::Other(_)) => unreachable!("the client transport has no middleware"),
        }
    }

    /// Builds `request` and [`execute`](Self::execute)s it with this client (the builder's own
    /// client is not used).
    ///
    /// ```no_run
    /// use idemkey_client::{IdempotentClient, Operation};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = IdempotentClient::new(reqwest::Client::new());
    /// let op = Operation::new(); // before the first attempt: one key for this one payment
    /// let request = client
    ///     .inner()
    ///     .post("http://127.0.0.1:8080/v1/payments")
    ///     .bearer_auth("tok_acme")
    ///     .json(&serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c1"}));
    /// let response = client.send(&op, request).await?;
    /// let payment: serde_json::Value = response.json()?;
    /// println!("{} {} (replayed: {})", response.status(), payment["id"], response.is_replayed());
    /// # Ok(()) }
    /// ```
    pub async fn send(
        &self,
        op: &Operation,
        request: RequestBuilder,
    ) -> Result<IdempotentResponse, Error> {
        let request = request.build().map_err(Error::Build)?;
        self.execute(op, request).await
    }

    /// `POST`s `body` as JSON to `url` as the operation `op`.
    ///
    /// ```no_run
    /// use idemkey_client::{Error, IdempotentClient, Operation};
    ///
    /// # async fn run() -> Result<(), Error> {
    /// let client = IdempotentClient::new(reqwest::Client::new());
    /// let payment = serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c1"});
    /// let response = client
    ///     .post_json(&Operation::new(), "http://127.0.0.1:8080/v1/payments", &payment)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn post_json<T: Serialize + ?Sized>(
        &self,
        op: &Operation,
        url: impl IntoUrl,
        body: &T,
    ) -> Result<IdempotentResponse, Error> {
        self.send(op, self.client.post(url).json(body)).await
    }
}

struct ClientTransport<'c> {
    client: &'c reqwest::Client,
}

impl Transport for ClientTransport<'_> {
    fn send(
        &mut self,
        request: Request,
    ) -> impl Future<Output = Result<Response, SendError>> + Send {
        let pending = self.client.execute(request);
        async move { pending.await.map_err(SendError::Reqwest) }
    }
}
