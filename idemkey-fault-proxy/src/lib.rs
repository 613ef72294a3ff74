//! # idemkey-fault-proxy
//!
//! HTTP proxy helpers, and a fault-injecting proxy for the `idemkey demo` command and for
//! tests.
//!
//! - [`strip_hop_by_hop`]: the headers a proxy must not forward, removed; the gateway and
//!   the fault proxy both use it.
//!
//! It lives apart from `idemkey-testkit` so the release binary, which runs the demo, does
//! not link the test kit.

mod hop;

pub use self::hop::strip_hop_by_hop;
