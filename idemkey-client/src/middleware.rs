//! The `reqwest-middleware` entry point.

use std::future::Future;
use std::sync::Arc;

use http::Extensions;
use reqwest::header::HeaderName;
use reqwest::{Request, Response, ResponseBuilderExt};
use reqwest_middleware::{Middleware, Next};

use crate::retry::{self, Delivered, Mode, SendError, Stop, Transport};
use crate::{Clock, IdempotentResponse, Operation, RetryPolicy, SystemClock, header};

/// A [`reqwest_middleware::Middleware`] that makes each unsafe request one idempotent
/// operation, with the same retry rules as [`IdempotentClient`](crate::IdempotentClient).
///
/// The key of a request is, in order: the `Idempotency-Key` header it already carries
/// (sent unchanged), the [`Operation`] put in its extensions
/// (`.with_extension(operation)`), or a fresh random key. It is added once and sent on every
/// attempt. `GET`, `HEAD`, `OPTIONS` and `TRACE` are passed on untouched: they are never keyed.
/// A keyed request must have a body of bytes, not a stream: it is refused with
/// [`Error::NotCloneable`](crate::Error::NotCloneable) before it is sent.
///
/// A final answer is returned as the response, with an [`IdempotencyInfo`](crate::IdempotencyInfo)
/// in its extensions. Everything [`IdempotentClient`](crate::IdempotentClient) returns as an
/// [`Error`](crate::Error) (a refusal such as 422 `key-reused`, the retention horizon, giving
/// up…) is returned as `reqwest_middleware::Error::Middleware`; recover it with
/// [`Error::from_middleware`](crate::Error::from_middleware). Errors of middleware further
/// down the chain are passed on untouched, not retried.
///
/// ```no_run
/// use idemkey_client::{Error, IdempotencyInfo, IdempotencyMiddleware, Operation, RetryPolicy};
///
/// # async fn run() -> Result<(), reqwest_middleware::Error> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::with_policy(RetryPolicy::new().with_max_attempts(5)))
///     .build();
/// // A key persisted by the caller goes in as the request's Operation.
/// let op = Operation::with_key("refund-ord_1042").expect("a valid key");
/// let sent = client
///     .post("http://127.0.0.1:8080/v1/payments")
///     .bearer_auth("tok_acme")
///     .json(&serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c1"}))
///     .with_extension(op)
///     .send()
///     .await;
/// match sent {
///     Ok(response) => {
///         let info = response.extensions().get::<IdempotencyInfo>().expect("set by the middleware");
///         println!("{} after {} attempt(s)", response.status(), info.attempts());
///     }
///     Err(e) => match Error::from_middleware(&e) {
///         Some(refused) => eprintln!("not retried: {refused}"),
///         None => return Err(e),
///     },
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyMiddleware {
    policy: RetryPolicy,
    clock: Arc<dyn Clock>,
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self::with_policy(RetryPolicy::default())
    }
}

impl IdempotencyMiddleware {
    /// The middleware with the default [`RetryPolicy`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The middleware with `policy`.
    pub fn with_policy(policy: RetryPolicy) -> Self {
        Self {
            policy,
            clock: Arc::new(SystemClock),
        }
    }

    /// Reads the time and waits between attempts with `clock` instead of the [`SystemClock`].
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        if request.method().is_safe() {
            return next.run(request, extensions).await;
        }
        let name = HeaderName::from_static(header::IDEMPOTENCY_KEY);
        let op = match request.headers().get(&name) {
            Some(value) => Operation::from_header(value.clone()),
            None => {
                let op = extensions.get::<Operation>().cloned().unwrap_or_default();
                request
                    .headers_mut()
                    .insert(name, op.header_value().clone());
                op
            }
        };
        let mut transport = MiddlewareTransport { next, extensions };
        let clock = &*self.clock;
        match retry::run(
            &self.policy,
            clock,
            &op,
            request,
            &mut transport,
            Mode::Stream,
        )
        .await
        {
            Ok(Delivered::Unread(mut response, info)) => {
                response.extensions_mut().insert(info);
                Ok(response)
            }
            Ok(Delivered::Read(read)) => Ok(rebuild(read)),
            Err(Stop::Error(e)) => Err(reqwest_middleware::Error::middleware(e)),
            Err(Stop::Other(e)) => Err(e),
        }
    }
}

struct MiddlewareTransport<'a, 'e> {
    next: Next<'a>,
    extensions: &'e mut Extensions,
}

impl Transport for MiddlewareTransport<'_, '_> {
    fn send(
        &mut self,
        request: Request,
    ) -> impl Future<Output = Result<Response, SendError>> + Send {
        let pending = self.next.clone().run(request, self.extensions);
        async move {
            pending.await.map_err(|e| match e {
                reqwest_middleware::Error::Reqwest(e) => SendError::Reqwest(e),
                other => SendError::Other(other),
            })
        }
    }
}

/// A response whose body was read to classify it, made a `reqwest::Response` again.
fn rebuild(read: IdempotentResponse) -> Response {
    let IdempotentResponse {
        status,
        version,
        url,
        headers,
        body,
        mut extensions,
        info,
    } = read;
    extensions.insert(info);
    let mut builder = http::Response::builder().status(status).version(version);
    if let Some(slot) = builder.extensions_mut() {
        *slot = extensions;
    }
    if let Some(slot) = builder.headers_mut() {
        *slot = headers;
    }
    let response = builder
        .url(url)
        .body(body)
        .expect("the parts came from a valid response");
    Response::from(response)
}
