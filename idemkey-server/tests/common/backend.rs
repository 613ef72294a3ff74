//! The test's database: a [`Backend`] of either [`Kind`], and the [`Snapshot`] of its rows.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;

use super::*;

/// Reads a [`Snapshot`] on a pool of either kind (the SQL is the same on both).
macro_rules! read_snapshot {
    ($pool:expr) => {{
        let records: Vec<(String, Option<i32>, Option<Vec<u8>>)> =
            sqlx::query_as("SELECT state, response_status, response_body FROM idemkey_records")
                .fetch_all($pool)
                .await
                .expect("read idemkey_records");
        let payments: Vec<String> = sqlx::query_scalar("SELECT id FROM payments")
            .fetch_all($pool)
            .await
            .expect("read payments");
        let ledger: Vec<String> = sqlx::query_scalar("SELECT payment_id FROM ledger_entries")
            .fetch_all($pool)
            .await
            .expect("read ledger_entries");
        Snapshot {
            records,
            payments,
            ledger,
        }
    }};
}

/// Which database the servers run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `sqlite:<tempdir>/idemkey.db`.
    Sqlite,
    /// A fresh database on the test PostgreSQL server.
    Postgres,
    /// A fresh database on a throwaway MariaDB server (`mysql://`).
    MySql,
}

/// One test's database, and the factory of `idemkey serve` processes on it.
#[derive(Debug)]
pub(crate) struct Backend {
    pub(super) kind: Kind,
    pub(super) url: String,
    /// The same database, never through a pooler: what the test itself reads.
    pub(super) direct: String,
    /// The SQLite file and the servers' logs.
    pub(super) dir: tempfile::TempDir,
    pub(super) started: AtomicUsize,
    /// The same database on each node of a cluster: the n-th server started runs on node
    /// n mod their count (none: every server on `url`).
    pub(super) nodes: Vec<String>,
}

impl Backend {
    /// A new SQLite database in a temporary directory.
    pub(crate) async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!("sqlite:{}", dir.path().join("idemkey.db").display());
        Self {
            kind: Kind::Sqlite,
            direct: url.clone(),
            url,
            dir,
            started: AtomicUsize::new(0),
            nodes: Vec::new(),
        }
    }

    /// A fresh database on the test PostgreSQL server.
    pub(crate) async fn postgres() -> Self {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Self {
            kind: Kind::Postgres,
            direct: url.clone(),
            url,
            dir: tempfile::tempdir().expect("temporary directory"),
            started: AtomicUsize::new(0),
            nodes: Vec::new(),
        }
    }

    /// A fresh database on the throwaway MariaDB server of this test binary (started by the
    /// first test that needs it), named by a `mysql://` URL.
    pub(crate) async fn mysql() -> Self {
        static SERVER: std::sync::OnceLock<idemkey_testkit::MariaDb> = std::sync::OnceLock::new();
        let url = tokio::task::spawn_blocking(|| {
            SERVER
                .get_or_init(idemkey_testkit::MariaDb::start)
                .fresh_database()
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Self::mysql_at(url)
    }

    /// The MySQL database `url` names (a server of the test's own).
    pub(crate) fn mysql_at(url: String) -> Self {
        Self {
            kind: Kind::MySql,
            direct: url.clone(),
            url,
            dir: tempfile::tempdir().expect("temporary directory"),
            started: AtomicUsize::new(0),
            nodes: Vec::new(),
        }
    }

    /// The MySQL database that `nodes` name, one URL per node of a Galera cluster: the n-th
    /// server started runs on node n mod their count; the test reads on the first.
    pub(crate) fn galera(nodes: Vec<String>) -> Self {
        let first = nodes.first().expect("at least one node").clone();
        Self {
            nodes,
            ..Self::mysql_at(first)
        }
    }

    /// The kind of database.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// The database URL the servers get.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Starts `idemkey serve` on this database with tenants `t1`/`tok1` and `t2`/`tok2` and
    /// `extra` flags; returns once it has printed its address.
    pub(crate) async fn start(&self, extra: &[&str]) -> Server {
        let n = self.started.fetch_add(1, Ordering::SeqCst);
        let log = self.dir.path().join(format!("server-{n}.log"));
        let url = match self.nodes.len() {
            0 => self.url.clone(),
            count => self.nodes[n % count].clone(),
        };
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        tokio::task::spawn_blocking(move || Server::spawn(&url, &extra, log))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// A one-connection pool to the PostgreSQL database, past the server.
    async fn direct_pool(&self) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.direct)
            .await
            .expect("connect to PostgreSQL")
    }

    /// A one-connection pool to the MySQL database, its reads causal on a Galera node (they
    /// wait for every write the cluster committed before them), as the store's are.
    async fn mysql_pool(&self) -> sqlx::MySqlPool {
        idemkey_mysql::MySqlStore::connect(&self.direct, 1)
            .await
            .expect("connect to MySQL")
            .pool()
            .clone()
    }

    /// What the database holds, read directly with sqlx.
    pub(crate) async fn snapshot(&self) -> Snapshot {
        match self.kind {
            Kind::Sqlite => {
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect(&self.direct)
                    .await
                    .expect("open the SQLite database");
                let snapshot = read_snapshot!(&pool);
                pool.close().await;
                snapshot
            }
            Kind::Postgres => {
                let pool = self.direct_pool().await;
                let snapshot = read_snapshot!(&pool);
                pool.close().await;
                snapshot
            }
            Kind::MySql => {
                let pool = self.mysql_pool().await;
                let snapshot = read_snapshot!(&pool);
                pool.close().await;
                snapshot
            }
        }
    }

    /// How many transactions on this database are open now (the handlers sleeping in
    /// `--simulate-latency` inside theirs). PostgreSQL: the sessions idle in a transaction.
    /// MySQL: the claims not yet committed, the records a dirty read sees beyond those a
    /// committed read sees.
    /// SQLite, whose writers take one lock: 1 while a writer holds it, told by a
    /// `BEGIN IMMEDIATE` that is refused at once, else 0.
    pub(crate) async fn open_transactions(&self) -> i64 {
        match self.kind {
            Kind::Sqlite => {
                use sqlx::ConnectOptions;
                let mut conn = self
                    .direct
                    .parse::<sqlx::sqlite::SqliteConnectOptions>()
                    .expect("a SQLite URL")
                    .busy_timeout(Duration::ZERO)
                    .connect()
                    .await
                    .expect("open the SQLite database");
                let held = match sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut conn).await {
                    Ok(_) => {
                        sqlx::raw_sql("ROLLBACK")
                            .execute(&mut conn)
                            .await
                            .expect("roll the probe back");
                        0
                    }
                    // SQLITE_BUSY (5), or one of its extended codes.
                    Err(sqlx::Error::Database(e))
                        if e.code()
                            .and_then(|c| c.parse::<i32>().ok())
                            .map(|c| c & 0xff)
                            == Some(5) =>
                    {
                        1
                    }
                    Err(e) => panic!("probe the SQLite write lock: {e}"),
                };
                sqlx::Connection::close(conn).await.ok();
                held
            }
            Kind::Postgres => {
                let pool = self.direct_pool().await;
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND state = 'idle in transaction'",
                )
                .fetch_one(&pool)
                .await
                .expect("read pg_stat_activity");
                pool.close().await;
                n
            }
            Kind::MySql => {
                // Not InnoDB's list of transactions (`information_schema.innodb_trx`): it is
                // a snapshot that InnoDB refreshes only when nobody has read it for 0.1 s,
                // so a probe asking more often than that reads its first answer forever.
                // Every handler's transaction begins with its claim, so its open
                // transactions are the records not yet committed. The dirty read comes
                // first: a commit between the two reads makes the count smaller, never
                // larger.
                let pool = self.mysql_pool().await;
                let mut conn = pool.acquire().await.expect("a MySQL connection");
                let mut records = [0i64; 2];
                for (n, level) in records.iter_mut().zip([
                    "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
                    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
                ]) {
                    sqlx::raw_sql(level)
                        .execute(&mut *conn)
                        .await
                        .expect("set the isolation level");
                    *n = sqlx::query_scalar("SELECT count(*) FROM idemkey_records")
                        .fetch_one(&mut *conn)
                        .await
                        .expect("count idemkey_records");
                }
                drop(conn);
                pool.close().await;
                (records[0] - records[1]).max(0)
            }
        }
    }
}

/// The rows that matter, read directly from the database.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// `(state, response_status, response_body)` of every idempotency record.
    pub(crate) records: Vec<(String, Option<i32>, Option<Vec<u8>>)>,
    /// Every payment id.
    pub(crate) payments: Vec<String>,
    /// The payment id of every ledger entry.
    pub(crate) ledger: Vec<String>,
}

impl Snapshot {
    /// Records in state `completed`.
    pub(crate) fn completed(&self) -> usize {
        self.records.iter().filter(|r| r.0 == "completed").count()
    }

    /// Asserts `n` completed `201` records, `n` payments, `n` ledger entries, no record in
    /// another state, and that the payments are exactly the ones the stored bodies name.
    pub(crate) fn assert_consistent(&self, n: usize) {
        let states: BTreeMap<&str, usize> =
            self.records.iter().fold(BTreeMap::new(), |mut m, r| {
                *m.entry(r.0.as_str()).or_default() += 1;
                m
            });
        assert_eq!(self.records.len(), n, "idempotency records: {states:?}");
        assert_eq!(self.completed(), n, "completed records: {states:?}");
        assert_eq!(self.payments.len(), n, "payments");
        assert_eq!(self.ledger.len(), n, "ledger entries");
        let payments: BTreeSet<&str> = self.payments.iter().map(String::as_str).collect();
        let ledger: BTreeSet<&str> = self.ledger.iter().map(String::as_str).collect();
        assert_eq!(payments, ledger, "one ledger entry per payment");
        let stored: BTreeSet<String> = self
            .records
            .iter()
            .map(|(_, status, body)| {
                assert_eq!(*status, Some(201), "stored status");
                let body: Value =
                    serde_json::from_slice(body.as_deref().expect("stored body")).expect("json");
                body["id"].as_str().expect("stored payment id").to_owned()
            })
            .collect();
        let stored: BTreeSet<&str> = stored.iter().map(String::as_str).collect();
        assert_eq!(
            stored, payments,
            "every record's stored payment exists, and every payment has its record"
        );
    }
}

/// The key secret the tests give `serve`, `gateway` and `keys` on PostgreSQL and MySQL,
/// where one is required (SQLite tests use the database-kept default): as
/// `IDEMKEY_KEY_SECRET`.
pub(crate) fn postgres_secret<'a>(
    args: impl IntoIterator<Item = &'a str>,
) -> Vec<(&'static str, &'static str)> {
    if args
        .into_iter()
        .any(|a| a.starts_with("postgres") || a.starts_with("mysql:") || a.starts_with("mariadb:"))
    {
        vec![(
            "IDEMKEY_KEY_SECRET",
            "a test secret, apart from the database",
        )]
    } else {
        Vec::new()
    }
}
