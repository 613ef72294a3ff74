//! The conformance suite on MariaDB: each test on a fresh database of one throwaway server.

mod common;

use common::MySqlHarness;

idemkey_testkit::conformance_tests!(MySqlHarness::new());
