//! # idemkey-testkit
//!
//! - [`conformance`]: the behaviours every idemkey store must show, run against each store
//!   with [`conformance_tests!`];
//! - a throwaway PostgreSQL server for tests ([`postgres_url`], [`fresh_database_url`]),
//!   started from the installed binaries when `DATABASE_URL` is not set.

pub mod conformance;
mod postgres;
mod proxy;

pub use self::conformance::Harness;
pub use self::postgres::*;
pub use self::proxy::{FaultConfig, FaultProxy, ProxyStats};
