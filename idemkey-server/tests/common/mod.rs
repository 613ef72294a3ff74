//! End-to-end scenarios of the `idemkey` binary, shared by the SQLite and the PostgreSQL test
//! files.
//!
//! A [`Backend`] is one test's database and the factory of the servers on it: every server a
//! scenario starts (`idemkey serve --listen 127.0.0.1:0 …` as a child process) uses the same
//! database, so a restarted server, or three servers at once, see the same records and the
//! same key-hashing secret. [`e2e_scenarios!`] expands every scenario into a `#[tokio::test]`
//! for one backend.
//!
//! Scenarios assert exact counts: payments through the API (`total`), and, read directly from
//! the database, idempotency records, payments and ledger entries, and that every completed
//! `201` record names a payment that exists.

#![allow(dead_code)]

use std::time::Duration;

mod api;
mod backend;
pub(crate) mod cluster;
mod contract;
mod crash;
pub(crate) mod flawed;
pub(crate) mod gateway;
pub(crate) mod load;
mod operator;
pub(crate) mod pgbouncer;
mod race;
mod server;

// Each test file uses a different part of these.
#[allow(unused_imports)]
pub(crate) use self::{api::*, backend::*, contract::*, crash::*, operator::*, race::*, server::*};

/// Tenant `t1`'s token.
pub(crate) const TOKEN1: &str = "tok1";
/// Tenant `t2`'s token.
pub(crate) const TOKEN2: &str = "tok2";

/// The route every keyed request here goes to.
const PAYMENTS: &str = "/v1/payments";
/// How long the client waits for one answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to print its address.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounded retry loops: attempts and pause.
const RETRY_ATTEMPTS: usize = 50;
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Expands every scenario shared by the stores into a `#[tokio::test]` on the backend that
/// `$backend` (an async expression giving a [`Backend`]) makes.
#[allow(unused_macros)] // not every test file runs the scenarios
macro_rules! e2e_scenarios {
    ($backend:expr) => {
        e2e_scenarios!(@tests $backend;
            race_200_keys_16_concurrent,
            race_reject_policy,
            crash_kill9_then_retry,
            graceful_shutdown_sigterm,
            contract_key_reuse_and_invalid_keys,
            contract_tenants_are_separate,
            contract_declined_is_stored_and_replayed,
            contract_retention_expiry,
            contract_equivalent_bodies_replay,
            contract_refused_bodies_leave_the_key_free,
            contract_auth_status_and_metrics,
            operator_keys_commands,
            lock_wait_behind_another_key,
        );
    };
    (@tests $backend:expr; $($name:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::common::$name($backend.await).await;
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use e2e_scenarios;
