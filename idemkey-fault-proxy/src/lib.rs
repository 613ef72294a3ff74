//! # idemkey-fault-proxy
//!
//! HTTP proxy helpers, and a fault-injecting proxy for the `idemkey demo` command and for
//! tests.
//!
//! - [`FaultProxy`]: an HTTP/1.1 proxy on loopback that loses responses, resets connections
//!   and adds latency as its [`FaultConfig`] says, counting what it did ([`ProxyStats`]);
//!   the demo puts it in front of the payments API, and tests use it to show that retries
//!   with the same key are safe.
//! - [`accept_loop`]: the accept loop of a proxy on loopback, which [`FaultProxy`] and
//!   `idemkey-testkit`'s PostgreSQL fault proxy run.
//!
//! ```
//! use idemkey_fault_proxy::{FaultConfig, FaultProxy};
//!
//! # async fn example(upstream: std::net::SocketAddr) -> std::io::Result<()> {
//! // Lose a third of the responses after the upstream has produced them.
//! let config = FaultConfig {
//!     lose_response: 0.3,
//!     seed: Some(7),
//!     ..FaultConfig::default()
//! };
//! let proxy = FaultProxy::start(upstream, config).await?;
//! // Send the requests to `proxy.url()` instead of the upstream, then:
//! let lost = proxy.stats().responses_lost;
//! # let _ = lost;
//! # Ok(())
//! # }
//! ```
//!
//! It is a crate of its own, not part of `idemkey-testkit`, so that the release binary,
//! which runs the demo, does not link the test kit; what only tests use (the PostgreSQL
//! fault proxy) is in the test kit.

mod listen;
mod proxy;

pub use self::listen::accept_loop;
pub use self::proxy::{FaultConfig, FaultProxy, ProxyStats};
