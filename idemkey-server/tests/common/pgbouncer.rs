//! Servers of a test through PgBouncer in transaction pooling mode: they and the operator
//! commands get the pooler's URL (with `idemkey-pooler=transaction`), while what the test
//! reads itself goes to the database directly.

use idemkey_testkit::PgBouncer;

use super::{Backend, Kind};

/// `url` (through a pooler) marked as such for idemkey.
pub(crate) fn pooled(url: &str) -> String {
    format!(
        "{url}?{}=transaction",
        idemkey_postgres::PgStore::POOLER_PARAMETER
    )
}

impl Backend {
    /// A fresh database on the test PostgreSQL server, reached by the servers through the
    /// test process's PgBouncer in transaction mode.
    pub(crate) async fn postgres_through_pgbouncer() -> Self {
        let backend = Self::postgres().await;
        let direct = backend.direct.clone();
        let url = tokio::task::spawn_blocking(move || idemkey_testkit::pgbouncer_url(&direct))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Self {
            url: pooled(&url),
            ..backend
        }
    }

    /// A fresh database on the test PostgreSQL server, reached by the servers through
    /// `pgbouncer` (a test's own, which it may kill and restart).
    pub(crate) async fn postgres_through(pgbouncer: &PgBouncer) -> Self {
        let backend = Self::postgres().await;
        Self {
            url: pooled(&pgbouncer.url_for(&backend.direct)),
            ..backend
        }
    }

    /// The database's URL, never through a pooler, for the test's own reads.
    pub(crate) fn direct_url(&self) -> &str {
        debug_assert!(matches!(self.kind, Kind::Sqlite | Kind::Postgres));
        &self.direct
    }
}
