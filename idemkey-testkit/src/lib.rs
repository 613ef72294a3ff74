//! # idemkey-testkit
//!
//! - [`conformance`]: the behaviours every idemkey store must show, run against each store
//!   with [`conformance_tests!`];
//! - a throwaway PostgreSQL server for tests ([`postgres_url`], [`fresh_database_url`]),
//!   started from the installed binaries when `DATABASE_URL` is not set;
//! - a PgBouncer in transaction pooling mode in front of that server ([`pgbouncer_url`],
//!   [`PgBouncer`]), started from the installed `pgbouncer`;
//! - a throwaway NATS server with JetStream ([`NatsServer`]), started from the installed
//!   `nats-server`, that a test can stop and start again on the same port and store;
//! - a throwaway three-node JetStream cluster ([`NatsCluster`]), whose nodes a test can kill
//!   and start again one by one;
//! - a throwaway MariaDB server ([`MariaDb`]) and a throwaway MariaDB Galera cluster
//!   ([`GaleraCluster`]) on loopback, from the installed Debian packages, whose servers a
//!   test can kill (`SIGKILL`) and start again;
//! - [`PgFaultProxy`]: a TCP proxy in front of a PostgreSQL server that cuts a connection
//!   right around a `COMMIT` ([`CommitCut`]), so the client cannot know whether its
//!   transaction committed, or cuts every connection at once; tests use it to show that a
//!   retry with the same key settles such an unknown commit exactly once;
//! - [`FaultProxy`], re-exported from `idemkey-fault-proxy` (where it lives so that the
//!   `idemkey demo` command can use it without the release binary linking this crate).

pub mod conformance;
mod mariadb;
mod nats;
mod nats_cluster;
mod pg_fault;
mod pgbouncer;
mod postgres;
mod process;

pub use self::conformance::Harness;
pub use self::mariadb::{GaleraCluster, MariaDb};
pub use self::nats::{NATS_SERVER_ENV, NatsServer, nats_server_binary};
pub use self::nats_cluster::{CLUSTER_SIZE, NatsCluster};
pub use self::pg_fault::{CommitCut, PgFaultProxy, PgProxyStats};
pub use self::pgbouncer::{PGBOUNCER_ENV, PgBouncer, pgbouncer_binary, pgbouncer_url};
pub use self::postgres::*;
pub use self::process::Stop;
pub use idemkey_fault_proxy::{FaultConfig, FaultProxy, ProxyStats};
