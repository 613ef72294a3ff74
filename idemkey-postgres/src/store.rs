use std::str::FromStr;
use std::time::Duration;

use idemkey_core::{
    AuditEntry, Begun, CommitError, EvictionNotice, EvictionNotices, Inserted, ListFilter, Members,
    NewRecord, Purged, Record, RecordId, Store, StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlx::group::{self, Completion, GroupWriter, GroupedWrites};
use idemkey_sqlx::{AuditRow, RecordRow};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, FromRow, Postgres, Row};

use crate::kept::Kept;
use crate::literal::{self, Array, Sql};
use crate::sqlstate::is_connection_lost;
use crate::transaction::{PgTransaction, abandon};

/// An idempotency store in a PostgreSQL database.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    /// External mode's reservations and completions, committed in groups
    /// (`idemkey_sqlx::group`).
    grouped: GroupedWrites,
    /// Connections the store's own `COMMIT`s ended, kept for its next transactions without
    /// the pool's test on release (`crate::kept`).
    kept: Kept,
    /// How long the store's transactions wait for a lock, set in each of them (`None`: the
    /// connections' own setting): through a pooler in transaction mode.
    lock_wait: Option<Duration>,
    /// The URL names a pooler in transaction mode ([`PgStore::POOLER_PARAMETER`]).
    pooled: bool,
}

impl PgStore {
    /// The name of this crate's migration tracking table.
    pub const MIGRATIONS_TABLE: &'static str = "idemkey_migrations";

    /// A store on an existing pool (for example the application's own).
    ///
    /// Between its own transactions the store keeps up to half of the pool's connections,
    /// out of the pool, so that a connection its `COMMIT` ended needs no test by the pool
    /// before the next transaction (docs/decisions.md, "No round trip to test a PostgreSQL
    /// connection"): a kept connection goes back to the pool after 50 ms unused, so
    /// the application's own queries on a pool the store has exhausted wait at most about
    /// that long for one.
    pub fn new(pool: PgPool) -> Self {
        Self {
            kept: Kept::new(&pool),
            pool,
            // Two groups of each kind at a time, each on a pooled connection: the writes wait
            // on round trips and commits rather than on CPU, so a second group in flight
            // overlaps that wait (docs/decisions.md, "Concurrent external-mode writes are
            // committed in groups").
            grouped: GroupedWrites::new(2),
            lock_wait: None,
            pooled: false,
        }
    }

    /// How long a statement waits for a lock on connections made by
    /// [`connect`](Self::connect): a claim waits this long for another attempt holding the
    /// same key, then answers "in flight". Pools made elsewhere keep their own setting.
    pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(5);

    /// Connects to `url` (`postgres://…`) with a pool of `max_connections`; the store's
    /// transactions and grouped writes wait [`DEFAULT_LOCK_WAIT`](Self::DEFAULT_LOCK_WAIT) for
    /// a lock.
    ///
    /// The store sends no statement that outlives its transaction, so `url` may name a
    /// pooler in transaction mode (PgBouncer's `pool_mode = transaction`) as well as the
    /// server: see docs/guide/operating.md, "Behind a pooler". Directly, the wait is each
    /// connection's `lock_timeout`, set when it connects; through such a pooler, which
    /// refuses that startup setting, it is set in each transaction (`SET LOCAL`).
    ///
    /// The pool hands out connections without pinging them first (a round trip per request
    /// saved). A connection the server has dropped meanwhile shows at its first statement:
    /// [`begin`](Store::begin) then starts the transaction again on another connection (a
    /// `BEGIN` has no effect of its own); any other first statement fails as
    /// [`StoreError::Unavailable`].
    ///
    /// A URL through a pooler in transaction mode says so with
    /// [`POOLER_PARAMETER`](Self::POOLER_PARAMETER) (`?idemkey-pooler=transaction`): the
    /// store then follows no eviction notices (`LISTEN` needs a session of its own), and an
    /// in-process cache of answers trusts each entry for a bounded time only.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let (url, pooled) = pooler_parameter(url)?;
        let mut options = PgConnectOptions::from_str(&url).map_err(error)?;
        // Set once per connection where a connection is a session: one statement less in
        // every transaction's first message (a measured cost on the database's CPU).
        let wait = format!("{}ms", Self::DEFAULT_LOCK_WAIT.as_millis());
        if !pooled {
            options = options.options([("lock_timeout", wait)]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(error)?;
        Ok(Self {
            lock_wait: pooled.then_some(Self::DEFAULT_LOCK_WAIT),
            pooled,
            ..Self::new(pool)
        })
    }

    /// The parameter of a [`connect`](Self::connect) URL that says it names a pooler in
    /// transaction mode (PgBouncer's `pool_mode = transaction`); its one value is
    /// `transaction`. It is idemkey's, not sent to the pooler.
    pub const POOLER_PARAMETER: &'static str = "idemkey-pooler";

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether the store was connected through a pooler in transaction mode
    /// ([`POOLER_PARAMETER`](Self::POOLER_PARAMETER)). The application's own statements
    /// with parameters must then not be kept prepared (sqlx's
    /// [`persistent(false)`](sqlx::query::Query::persistent)) and must run inside a
    /// transaction: sqlx parses and executes such a statement in two exchanges, which only
    /// a transaction keeps on one server connection. See docs/guide/operating.md, "Behind a
    /// pooler".
    pub fn through_pooler(&self) -> bool {
        self.pooled
    }

    /// This store's migrations, tracked in [`MIGRATIONS_TABLE`](Self::MIGRATIONS_TABLE) so
    /// they share a database with the application's own.
    pub fn migrator() -> Migrator {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.dangerous_set_table_name(Self::MIGRATIONS_TABLE);
        migrator
    }

    /// Runs the pending migrations.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        self.migrate_with(&Self::migrator()).await
    }

    /// Runs the pending migrations of `migrator` (this crate's or the application's own),
    /// all in one transaction on a connection of their own.
    ///
    /// sqlx's migrator takes a session's advisory lock and keeps its statements prepared
    /// on the connection; in one transaction both stay on one server connection behind a
    /// pooler in transaction mode. Before the `COMMIT` the lock is released (by the
    /// migrator) and the statements closed, so the server connection goes back to the
    /// pooler as it came; if anything fails the connection is closed unfinished, and the
    /// server (or the pooler, which drops a server connection its client left inside a
    /// transaction) rolls back and releases everything. Concurrent runs on one database
    /// wait for each other on a transaction's advisory lock, which only the `COMMIT`
    /// releases: the migrator's own is released before it, while the next run could not
    /// see yet what this one created.
    pub async fn migrate_with(&self, migrator: &Migrator) -> Result<(), MigrateError> {
        let mut conn = PgConnection::connect_with(&self.pool.connect_options()).await?;
        let migrated = async {
            let mut tx = conn.begin().await?;
            sqlx::raw_sql(
                "SELECT pg_advisory_xact_lock(hashtextextended('idemkey migrations', 0))",
            )
            .execute(&mut *tx)
            .await?;
            // What `run` does once it has a connection; `run` itself, generic over
            // `Acquire`, makes a future the compiler cannot prove `Send` here.
            migrator.run_direct(None, &mut *tx, false).await?;
            tx.clear_cached_statements().await?;
            tx.commit().await?;
            Ok::<_, MigrateError>(())
        }
        .await;
        match migrated {
            Ok(()) => {
                // Closing only says goodbye: everything is committed.
                let _ = conn.close().await;
                Ok(())
            }
            Err(e) => {
                drop(conn);
                Err(e)
            }
        }
    }
}

/// `url` without [`PgStore::POOLER_PARAMETER`], and whether it said `transaction`. Any
/// other value is refused.
fn pooler_parameter(url: &str) -> Result<(String, bool), StoreError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), false));
    };
    let mut pooled = false;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some((PgStore::POOLER_PARAMETER, "transaction")) => pooled = true,
            Some((PgStore::POOLER_PARAMETER, value)) => {
                return Err(error(sqlx::Error::Configuration(
                    format!(
                        "{}={value} is not a pooler mode idemkey knows: the one it takes is \
                         `transaction` (a pooler in session mode needs no parameter)",
                        PgStore::POOLER_PARAMETER
                    )
                    .into(),
                )));
            }
            _ => kept.push(pair),
        }
    }
    Ok(match kept.is_empty() {
        true => (base.to_owned(), pooled),
        false => (format!("{base}?{}", kept.join("&")), pooled),
    })
}

/// The `LISTEN` channel of eviction notices; the payload is the hex of the evicted
/// record's [`RecordId::digest`].
pub const EVICTION_CHANNEL: &str = "idemkey_evict";

/// The longest pause between two attempts to (re)connect the eviction listener.
const MAX_LISTEN_BACKOFF: Duration = Duration::from_secs(5);

/// How long a new listener waits for its own probe notice before it concludes that
/// notices do not reach it.
const PROBE_WAIT: Duration = Duration::from_secs(2);

/// The pause before a listener that missed its probe tries again.
const PROBE_RETRY: Duration = Duration::from_secs(60);

/// The eviction listener's state: its own one-connection pool (the listener holds its
/// connection for good, so it never takes one of the application's), the store's pool (for
/// the probe), the listener once connected, how many connects failed in a row, and whether
/// the last listener missed its probe.
struct Follow {
    pool: PgPool,
    probe: PgPool,
    listener: Option<PgListener>,
    failures: u32,
    missed_probe: bool,
}

/// Why a listener was not started.
enum NotListening {
    Failed,
    /// `LISTEN` went through but the probe notice never came: the connection does not keep
    /// its session between statements (a pooler in transaction mode).
    MissedProbe,
}

impl From<sqlx::Error> for NotListening {
    fn from(_: sqlx::Error) -> Self {
        Self::Failed
    }
}

impl Follow {
    async fn next(mut self) -> (EvictionNotice, Self) {
        loop {
            let Some(listener) = self.listener.as_mut() else {
                if self.missed_probe {
                    tokio::time::sleep(PROBE_RETRY).await;
                } else if self.failures > 0 {
                    let pause = Duration::from_millis(100) * 2u32.pow(self.failures.min(6));
                    tokio::time::sleep(pause.min(MAX_LISTEN_BACKOFF)).await;
                }
                match listen(&self.pool, &self.probe).await {
                    Ok(listener) => {
                        self.listener = Some(listener);
                        self.failures = 0;
                        self.missed_probe = false;
                        return (EvictionNotice::Listening, self);
                    }
                    Err(NotListening::MissedProbe) => {
                        self.missed_probe = true;
                        continue;
                    }
                    Err(NotListening::Failed) => {
                        self.failures += 1;
                        continue;
                    }
                }
            };
            match listener.try_recv().await {
                Ok(Some(notice)) => {
                    let mut digest = [0u8; 32];
                    if hex::decode_to_slice(notice.payload(), &mut digest).is_ok() {
                        return (EvictionNotice::Evicted(digest), self);
                    }
                    // Not ours (someone else's payload on the channel): nothing to drop.
                }
                // The connection was lost (None) or failed: notices may have been missed.
                Ok(None) | Err(_) => {
                    self.listener = None;
                    self.failures = 1;
                    return (EvictionNotice::Lost, self);
                }
            }
        }
    }
}

/// A listener on [`EVICTION_CHANNEL`] that has received its own probe: a notice sent on
/// `probe` (another connection) after the `LISTEN`. Behind a pooler in transaction mode the
/// `LISTEN` holds on a server connection the listener no longer has once the statement is
/// done, so the probe never comes; the listener is then refused rather than reported
/// listening, and the cache keeps bounding its entries as without notices.
async fn listen(pool: &PgPool, probe: &PgPool) -> Result<PgListener, NotListening> {
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut listener = PgListener::connect_with(pool).await?;
    // A lost connection is reported at once; the next round connects afresh.
    listener.eager_reconnect(false);
    listener.listen(EVICTION_CHANNEL).await?;
    // Not hex: every other listener ignores it.
    let payload = format!(
        "probe {} {}",
        std::process::id(),
        PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    // From here on a failure may mean that the `LISTEN` went to a pooler's server
    // connection (its notices then reach whichever client holds it, the probe's sender
    // among them): retried only after a long pause.
    let sent = literal::query("SELECT pg_notify($1, $2)")
        .bind(EVICTION_CHANNEL)
        .bind(&payload)
        .execute(probe)
        .await;
    if sent.is_err() {
        return Err(NotListening::MissedProbe);
    }
    let probed = tokio::time::timeout(PROBE_WAIT, async {
        // Evictions announced before the probe are not passed on: the cache trusts
        // nothing it cached before it hears `Listening`.
        while let Some(notice) = listener.try_recv().await? {
            if notice.payload() == payload {
                return Ok(true);
            }
        }
        Ok::<_, sqlx::Error>(false)
    })
    .await;

    match probed {
        Ok(Ok(true)) => Ok(listener),
        // The connection was lost: connect again soon.
        Ok(Ok(false) | Err(_)) => Err(NotListening::Failed),
        Err(_) => {
            tracing::warn!(
                "eviction notices do not reach this connection (a pooler in transaction \
                 mode?): cached answers are trusted for a bounded time only"
            );
            Err(NotListening::MissedProbe)
        }
    }
}

pub(crate) use crate::sqlstate::error;

fn record(row: RecordRow) -> Result<Record, StoreError> {
    Record::try_from(row)
}

/// SQLSTATE `idemkey_expect_owned` raises (migration 0005): the completion matched no row
/// carrying the owner's token.
const NOT_OWNED: &str = "IK001";

/// SQLSTATE 23505 unique_violation.
const UNIQUE_VIOLATION: &str = "23505";

/// SQLSTATE 26000 invalid_sql_statement_name: the connection has not prepared the
/// statement (yet).
const UNDEFINED_PREPARED: &str = "26000";

/// The two statements [`PgStore::begin_claim`] and [`PgStore::complete_and_commit`] send with
/// `BEGIN` and `COMMIT`, prepared once per connection (in the message of its first claim),
/// so the server plans them once, not on every call. The completion is guarded by
/// `idemkey_expect_owned` (migration 0005): it fails, and so skips the `COMMIT` sent after it,
/// unless it matched the owner's row.
const PREPARE: &str = "\
PREPARE idemkey_claim_v2 (text, bytea, text, bytea, bytea, text, bigint, bigint, bigint, bytea, \
                          bytea, bigint) AS
    INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint, fingerprint_parts, state,
                                 token, lease_expires_at, created_at, updated_at, expires_at,
                                 sealed_key, fingerprint_members, first_sent)
    VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8, $8, $9, $10, $11, $12);
PREPARE idemkey_complete_v1 (text, bytea, text, bigint, integer, bytea, bytea, bigint) AS
    WITH done AS (
        UPDATE idemkey_records
           SET state = 'completed', token = token + 1, lease_expires_at = NULL,
               response_status = $5, response_headers = $6, response_body = $7,
               updated_at = $8
         WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4
        RETURNING 1
    )
    SELECT idemkey_expect_owned(count(*)) FROM done";

/// The SQLSTATE of a database error.
fn code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

impl PgStore {
    /// Begins a transaction with `statement` (`None`: `BEGIN`) on a kept connection
    /// (`crate::kept`), else a pooled one.
    ///
    /// Neither kept nor pooled connections are pinged before use, so a connection the server
    /// dropped while it sat idle (a restart, a terminated backend, an idle time-out) fails
    /// here, at its first message. Nothing of a transaction that did not commit survives its
    /// connection, so beginning again on another connection is safe. The failed connection
    /// is closed, not returned; after a restart every idle one is dead, so the attempts are
    /// bounded by the pool size (plus one new connection), not one: the first request
    /// drains them rather than each of them failing a request. Any other error is returned
    /// with its connection, which may be in the aborted transaction the message began.
    async fn begin_on_pool(
        &self,
        statement: Option<String>,
    ) -> Result<PgTransaction, (sqlx::Error, Option<PoolConnection<Postgres>>)> {
        let attempts = self.pool.options().get_max_connections() + 1;
        let mut attempt = 1;
        loop {
            let conn = (self.kept.take_or_acquire(&self.pool).await).map_err(|e| (e, None))?;
            match PgTransaction::begin(conn, statement.clone()).await {
                Ok(tx) => return Ok(tx),
                Err((e, mut conn)) if attempt < attempts && is_connection_lost(&e) => {
                    conn.close_on_drop();
                    attempt += 1;
                }
                Err((e, conn)) => return Err((e, Some(conn))),
            }
        }
    }
}

/// Appends to a message that begins a transaction the statement that makes the
/// transaction's statements wait at most `wait` for a lock (then fail with SQLSTATE 55P03,
/// read as "busy"). Transaction-local, so it holds behind a pooler in transaction mode; a
/// `SET`, not a `SELECT set_config(…)`, so the server plans nothing and sends no row.
fn set_lock_wait(sql: &mut Sql, wait: Duration) {
    sql.push("; SET LOCAL lock_timeout = '")
        .int(wait.as_millis().max(1).try_into().unwrap_or(i64::MAX))
        .push("ms'");
}

/// The grouped completion's `UPDATE`, its rows as literals (see
/// [`GroupWriter::complete_group`]).
fn completion_rows(rows: &[&Completion]) -> Result<String, StoreError> {
    let mut sql = Sql::new(
        "UPDATE idemkey_records AS r
            SET state = 'completed', token = r.token + 1, lease_expires_at = NULL,
                response_status = c.status, response_headers = c.headers,
                response_body = c.body, updated_at = c.now
           FROM (VALUES ",
    );
    for (i, c) in rows.iter().enumerate() {
        sql.push(if i == 0 { "(" } else { ", (" });
        sql.completion(&c.id, c.token, &c.response, c.now)?
            .push(")");
    }
    sql.push(
        ") AS c (tenant, key_hash, route, token, status, headers, body, now)
          WHERE r.tenant = c.tenant AND r.key_hash = c.key_hash AND r.route = c.route
            AND r.token = c.token
         RETURNING r.tenant, r.key_hash, r.route",
    );
    Ok(sql.finish())
}

/// One column of a grouped statement: `f` of every row, in the rows' order.
fn column<'a, T, U>(rows: &[&'a T], f: impl Fn(&'a T) -> U) -> Array<U> {
    Array(rows.iter().map(|&row| f(row)).collect())
}

impl GroupWriter for PgStore {
    /// One `INSERT` of every row (autocommit), answered [`Inserted::Owned`] for the rows it
    /// inserted and [`Inserted::Conflict`] for the keys it found taken (the protocol reads
    /// those records). If the statement fails, nobody can tell whose row failed it: each
    /// reservation is made again alone, which is safe whether or not the group committed (a
    /// reservation that finds its own row is answered as any claim that finds a record in
    /// flight).
    async fn insert_group(&self, records: Vec<NewRecord>) -> Vec<Result<Inserted, StoreError>> {
        let (rows, in_group) = group::plan(&records, |r| &r.id);
        let inserted = literal::query_as::<(String, Vec<u8>, String)>(
            "INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint,
                    fingerprint_parts, state, token, lease_expires_at, created_at, updated_at,
                    expires_at, sealed_key, fingerprint_members, first_sent)
             SELECT tenant, key_hash, route, fingerprint, parts, state, 1, lease, created,
                    created, expires, sealed, members, first_sent
               FROM unnest($1::text[], $2::bytea[], $3::text[], $4::bytea[], $5::bytea[],
                           $6::text[], $7::bigint[], $8::bigint[], $9::bigint[],
                           $10::bytea[], $11::bytea[], $12::bigint[])
                    WITH ORDINALITY AS r (tenant, key_hash, route, fingerprint, parts, state,
                                          lease, created, expires, sealed, members,
                                          first_sent, n)
              ORDER BY n
             ON CONFLICT (tenant, key_hash, route) DO NOTHING
             RETURNING tenant, key_hash, route",
        )
        .lock_wait(self.lock_wait)
        .bind(column(&rows, |r| r.id.tenant.as_str()))
        .bind(column(&rows, |r| &r.id.key_hash[..]))
        .bind(column(&rows, |r| r.id.route.as_str()))
        .bind(column(&rows, |r| &r.fingerprint.digest[..]))
        .bind(column(&rows, |r| r.fingerprint.parts.to_bytes()))
        .bind(column(&rows, |r| r.state.as_str()))
        .bind(column(&rows, |r| {
            r.lease_expires_at.map(Timestamp::as_millis)
        }))
        .bind(column(&rows, |r| r.now.as_millis()))
        .bind(column(&rows, |r| r.expires_at.as_millis()))
        .bind(column(&rows, |r| r.sealed_key.as_deref()))
        .bind(column(&rows, |r| {
            r.fingerprint.members.as_ref().map(Members::to_bytes)
        }))
        .bind(column(&rows, |r| r.first_sent.map(Timestamp::as_millis)))
        .fetch_all(&self.pool)
        .await
        .map(group::returned);
        let from_group = |record: &NewRecord| {
            let inserted = inserted.as_ref().ok()?;
            Some(Ok(if inserted.contains(&record.id) {
                Inserted::Owned
            } else {
                Inserted::Conflict
            }))
        };
        group::answer_each(&records, &in_group, from_group, |r| self.insert_alone(r)).await
    }

    /// One `UPDATE` of every row (autocommit), each answered as
    /// [`complete`](Store::complete) would be: `true` where the row still carried the
    /// owner's token. If the statement failed with an answer from the server (nothing was
    /// committed), each is written again alone, so that each gets its own answer; if the
    /// connection was lost, the group may or may not have committed, and each gets that
    /// error, as a completion alone would.
    ///
    /// The rows go as literal `VALUES` in a simple query, not as bound arrays to a
    /// prepared statement: the `UPDATE` joins them to `idemkey_records`, and a prepared
    /// statement's generic plan, made while the table was still small, joins by scanning
    /// the whole table (a hash join) and stays cached on its connection until the table is
    /// analyzed, each group then reading every record. Planned with the rows and the table
    /// as they are, the join looks each row up by its primary key.
    async fn complete_group(&self, group: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        let (rows, in_group) = group::plan(&group, |c| &c.id);
        let alone = |c| self.complete_alone(c);
        let Ok(sql) = completion_rows(&rows) else {
            // A value PostgreSQL cannot take (a NUL in a text): each alone says whose.
            return group::answer_each(&group, &in_group, |_| None, alone).await;
        };
        let sql = literal::lock_wait(self.lock_wait) + &sql;
        let completed = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .and_then(|rows| rows.iter().map(FromRow::from_row).collect())
            .map(group::returned);
        let written = rows.len();
        let from_group = |c: &Completion| match &completed {
            Ok(completed) => Some(Ok(completed.contains(&c.id))),
            Err(e) if is_connection_lost(e) => Some(Err(StoreError::Unavailable(Box::new(
                std::io::Error::other(format!(
                    "the connection was lost while {written} completions were committed together: {e}"
                )),
            )))),
            Err(_) => None,
        };
        group::answer_each(&group, &in_group, from_group, alone).await
    }
}

impl Store for PgStore {
    type Connection = PgConnection;
    type Transaction = PgTransaction;
    type PooledConnection = PoolConnection<Postgres>;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        let statement = self.lock_wait.map(|wait| {
            let mut begin = Sql::new("BEGIN");
            set_lock_wait(&mut begin, wait);
            begin.finish()
        });
        match self.begin_on_pool(statement).await {
            Ok(tx) => Ok(tx),
            Err((e, conn)) => {
                if let Some(conn) = conn {
                    abandon(conn, &e).await;
                }
                Err(error(e))
            }
        }
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.kept.keep(tx.commit_keeping().await?);
        Ok(())
    }

    /// One round trip for a fresh key: `BEGIN` and a plain `INSERT` of the record (the
    /// prepared `idemkey_claim_v2`, see `PREPARE` in this file) go in one message. A taken
    /// key fails that `INSERT` (unique violation); then the transaction begins again
    /// (`ROLLBACK; BEGIN`, one message) and [`insert`](Store::insert) claims the usual way,
    /// reading the record that took the key. Such a replay costs one message more than the
    /// usual way, and the server logs the violation as an error; the replay cache answers
    /// most replays before they reach the store.
    async fn begin_claim(
        &self,
        record: &NewRecord,
        lock_wait: Option<Duration>,
    ) -> Result<Begun<PgTransaction>, StoreError> {
        let lock_wait = lock_wait.or(self.lock_wait);
        let lock_timeout = |sql: &mut Sql| {
            if let Some(wait) = lock_wait {
                set_lock_wait(sql, wait);
            }
        };
        let mut claim = Sql::new("BEGIN");
        lock_timeout(&mut claim);
        claim
            .push("; EXECUTE idemkey_claim_v2(")
            .id(&record.id)?
            .push(", ");
        claim.bytes(&record.fingerprint.digest).push(", ");
        claim.bytes(&record.fingerprint.parts.to_bytes()).push(", ");
        claim.text(record.state.as_str())?.push(", ");
        claim
            .opt_int(record.lease_expires_at.map(Timestamp::as_millis))
            .push(", ");
        claim.int(record.now.as_millis()).push(", ");
        claim.int(record.expires_at.as_millis()).push(", ");
        claim.opt_bytes(record.sealed_key.as_deref()).push(", ");
        let members = record.fingerprint.members.as_ref().map(Members::to_bytes);
        claim.opt_bytes(members.as_deref()).push(", ");
        claim
            .opt_int(record.first_sent.map(Timestamp::as_millis))
            .push(")");
        let claim = claim.finish();
        let (e, conn) = match self.begin_on_pool(Some(claim.clone())).await {
            Ok(tx) => return Ok(Begun::Claimed(tx, Inserted::Owned)),
            Err(failed) => failed,
        };
        // A connection that has not prepared the two statements yet (a new one, or one a
        // pooler reset): prepare them and claim again, in one message.
        let (e, conn) = match conn {
            Some(conn) if code(&e).as_deref() == Some(UNDEFINED_PREPARED) => {
                let again = format!("ROLLBACK; {PREPARE}; {claim}");
                match PgTransaction::begin(conn, Some(again)).await {
                    Ok(tx) => return Ok(Begun::Claimed(tx, Inserted::Owned)),
                    Err((e, conn)) => (e, Some(conn)),
                }
            }
            conn => (e, conn),
        };
        let taken = code(&e).as_deref() == Some(UNIQUE_VIOLATION);
        let conn = match conn {
            Some(conn) if taken => conn,
            Some(conn) => {
                abandon(conn, &e).await;
                // Only the claim's insert waits on a lock in that message.
                return match error(e) {
                    StoreError::Busy(_) => Ok(Begun::Held),
                    e => Err(e),
                };
            }
            None => return Err(error(e)),
        };
        let mut again = Sql::new("ROLLBACK; BEGIN");
        lock_timeout(&mut again);
        let mut tx = match PgTransaction::begin(conn, Some(again.finish())).await {
            Ok(tx) => tx,
            Err((e, conn)) => {
                abandon(conn, &e).await;
                return Err(error(e));
            }
        };
        match self.insert(&mut tx, record).await {
            Ok(inserted) => Ok(Begun::Claimed(tx, inserted)),
            Err(StoreError::Busy(_)) => Ok(Begun::Held),
            Err(e) => Err(e),
        }
    }

    /// One round trip: the completion (the prepared `idemkey_complete_v1`, see `PREPARE` in
    /// this file: guarded, it fails, and so skips the `COMMIT`, unless it matched the owner's
    /// row) and `COMMIT` go in one message.
    async fn complete_and_commit(
        &self,
        tx: PgTransaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        let mut sql = Sql::new("EXECUTE idemkey_complete_v1(");
        sql.completion(id, token, response, now)
            .map_err(CommitError::NotCommitted)?
            .push(")");
        let statements = sql.finish();
        let conn = tx
            .commit_after(statements, |code| code == NOT_OWNED)
            .await?;
        self.kept.keep(conn);
        Ok(())
    }

    async fn limit_lock_wait(
        &self,
        conn: &mut PgConnection,
        wait: Duration,
    ) -> Result<(), StoreError> {
        // Transaction-local: the next statements of this transaction (the claim among them)
        // give up waiting for a lock after `wait` with SQLSTATE 55P03, read as "busy".
        literal::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", wait.as_millis().max(1)))
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(())
    }

    /// A kept connection when there is one (so the store's reads do not wait on what its
    /// transactions keep), else one from the pool. Either goes back to the pool when dropped.
    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        self.kept.take_or_acquire(&self.pool).await.map_err(error)
    }

    /// Concurrent reservations are committed in groups, one `INSERT` of up to 64 rows each,
    /// each answered once its group committed, as [`insert`](Store::insert) would have
    /// answered it alone (a key found taken is [`Inserted::Conflict`]); one that finds
    /// nothing being written goes at once, alone. (`idemkey_sqlx::group`,
    /// `PgStore::insert_group`.)
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.grouped.insert(self, record).await
    }

    /// Concurrent completions are committed in groups, one `UPDATE` of up to 64 rows each,
    /// each answered once its group committed, as [`complete`](Store::complete) would have
    /// answered it alone. (`idemkey_sqlx::group`, `PgStore::complete_group`.)
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.grouped.complete(self, id, token, response, now).await
    }

    async fn insert(&self, conn: &mut PgConnection, r: &NewRecord) -> Result<Inserted, StoreError> {
        // One statement for the claim and, when the key is taken, the record. Every part of
        // it runs on the statement's one snapshot: the join sees a row committed before the
        // statement began, never the row `ins` inserted, nor one committed while the insert
        // waited on it (an owner finishing); then no record comes back and the caller reads
        // it with a statement of its own. `NOT EXISTS` keeps a row deleted after the
        // snapshot from being returned beside a successful insert.
        let row = literal::query(
            "WITH ins AS (
                 INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint,
                        fingerprint_parts, state, token, lease_expires_at, created_at,
                        updated_at, expires_at, sealed_key, fingerprint_members, first_sent)
                 VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8, $8, $9, $10, $11, $12)
                 ON CONFLICT (tenant, key_hash, route) DO NOTHING
                 RETURNING token
             )
             SELECT EXISTS (SELECT 1 FROM ins) AS inserted, r.*
               FROM (VALUES (1)) AS one (n)
               LEFT JOIN idemkey_records AS r
                 ON r.tenant = $1 AND r.key_hash = $2 AND r.route = $3
                AND NOT EXISTS (SELECT 1 FROM ins)",
        )
        .bind(&r.id.tenant)
        .bind(&r.id.key_hash[..])
        .bind(&r.id.route)
        .bind(&r.fingerprint.digest[..])
        .bind(&r.fingerprint.parts.to_bytes()[..])
        .bind(r.state.as_str())
        .bind(r.lease_expires_at.map(Timestamp::as_millis))
        .bind(r.now.as_millis())
        .bind(r.expires_at.as_millis())
        .bind(r.sealed_key.as_deref())
        .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
        .bind(r.first_sent.map(Timestamp::as_millis))
        .fetch_one(conn)
        .await
        .map_err(error)?;
        if row.try_get::<bool, _>("inserted").map_err(error)? {
            return Ok(Inserted::Owned);
        }
        if row
            .try_get::<Option<String>, _>("tenant")
            .map_err(error)?
            .is_none()
        {
            return Ok(Inserted::Conflict);
        }
        let existing = RecordRow::from_row(&row).map_err(error)?;
        Ok(Inserted::Existing(Box::new(record(existing)?)))
    }

    async fn fetch(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        literal::query_as::<RecordRow>(
            "SELECT * FROM idemkey_records WHERE tenant = $1 AND key_hash = $2 AND route = $3",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .fetch_optional(conn)
        .await
        .map_err(error)?
        .map(record)
        .transpose()
    }

    async fn replace(
        &self,
        conn: &mut PgConnection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        literal::query_scalar(
            "UPDATE idemkey_records
                SET fingerprint = $4, fingerprint_parts = $5, state = $6, token = token + 1,
                    lease_expires_at = $7, response_status = NULL, response_headers = NULL,
                    response_body = NULL, created_at = $8, updated_at = $8, expires_at = $9,
                    sealed_key = $11, fingerprint_members = $12, first_sent = $13
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $10
             RETURNING token",
        )
        .bind(&r.id.tenant)
        .bind(&r.id.key_hash[..])
        .bind(&r.id.route)
        .bind(&r.fingerprint.digest[..])
        .bind(&r.fingerprint.parts.to_bytes()[..])
        .bind(r.state.as_str())
        .bind(r.lease_expires_at.map(Timestamp::as_millis))
        .bind(r.now.as_millis())
        .bind(r.expires_at.as_millis())
        .bind(token)
        .bind(r.sealed_key.as_deref())
        .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
        .bind(r.first_sent.map(Timestamp::as_millis))
        .fetch_optional(conn)
        .await
        .map_err(error)
    }

    async fn complete(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let update = literal::query(
            "UPDATE idemkey_records
                SET state = 'completed', token = token + 1, lease_expires_at = NULL,
                    response_status = $5, response_headers = $6, response_body = $7,
                    updated_at = $8
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        );
        let done = update
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .bind(token)
            .bind(i32::from(response.status))
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(now.as_millis())
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "UPDATE idemkey_records SET lease_expires_at = $5, updated_at = $6
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .bind(token)
        .bind(lease_until.as_millis())
        .bind(now.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn mark_executing(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "UPDATE idemkey_records
                SET state = 'executing', lease_expires_at = $5, updated_at = $6
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .bind(token)
        .bind(lease_until.as_millis())
        .bind(now.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "UPDATE idemkey_records
                SET state = 'indeterminate', lease_expires_at = NULL, updated_at = $5
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .bind(token)
        .bind(now.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "DELETE FROM idemkey_records
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .bind(token)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn list(
        &self,
        conn: &mut PgConnection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = literal::query_as::<RecordRow>(
            "SELECT * FROM idemkey_records
              WHERE ($1::TEXT IS NULL OR tenant = $1)
                AND ($2::TEXT IS NULL OR state = $2)
                AND ($3::BIGINT IS NULL OR created_at < $3)
              ORDER BY created_at DESC
              LIMIT $4",
        )
        .bind(filter.tenant.as_deref())
        .bind(filter.state.map(|s| s.as_str()))
        .bind(filter.created_before.map(Timestamp::as_millis))
        .bind(filter.effective_limit())
        .fetch_all(conn)
        .await
        .map_err(error)?;
        rows.into_iter().map(record).collect()
    }

    async fn find_by_key(
        &self,
        conn: &mut PgConnection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let rows = literal::query_as::<RecordRow>(
            "SELECT * FROM idemkey_records WHERE tenant = $1 AND key_hash = $2
              ORDER BY created_at",
        )
        .bind(tenant)
        .bind(&key_hash[..])
        .fetch_all(conn)
        .await
        .map_err(error)?;
        rows.into_iter().map(record).collect()
    }

    async fn evict(&self, conn: &mut PgConnection, id: &RecordId) -> Result<bool, StoreError> {
        let done = literal::query(
            "DELETE FROM idemkey_records WHERE tenant = $1 AND key_hash = $2 AND route = $3",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_batch(
        &self,
        conn: &mut PgConnection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        // In `expires_at` order, so the index is read from `from` on: without the order the
        // planner may pick a sequential scan, expecting expired rows all over the table,
        // and read gigabytes of live and deleted rows before finding a batch. SKIP LOCKED:
        // rows that live traffic holds (a takeover in progress) are left for the next round
        // instead of blocking it. The rows are deleted by `ctid`, not looked up again by
        // primary key: this statement holds their locks, so no other can move them first.
        let (deleted, through): (i64, Option<i64>) = literal::query_as(
            "WITH gone AS (
                 DELETE FROM idemkey_records
                  WHERE ctid = ANY (ARRAY(
                            SELECT ctid FROM idemkey_records
                             WHERE expires_at <= $1 AND expires_at >= $2
                             ORDER BY expires_at
                             LIMIT $3
                               FOR UPDATE SKIP LOCKED))
                    AND expires_at <= $1
                 RETURNING expires_at
             )
             SELECT count(*), max(expires_at) FROM gone",
        )
        .bind(now.as_millis())
        .bind(from.map_or(i64::MIN, Timestamp::as_millis))
        .bind(i64::from(batch))
        .fetch_one(conn)
        .await
        .map_err(error)?;
        Ok(Purged {
            deleted: u64::try_from(deleted).unwrap_or(0),
            through: through.map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut PgConnection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        literal::query(
            "INSERT INTO idemkey_audit (tenant, key_hash, route, at, actor, action, detail)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&entry.id.tenant)
        .bind(&entry.id.key_hash[..])
        .bind(&entry.id.route)
        .bind(entry.at.as_millis())
        .bind(&entry.actor)
        .bind(&entry.action)
        .bind(&entry.detail)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn audit(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = literal::query_as::<AuditRow>(
            "SELECT tenant, key_hash, route, at, actor, action, detail FROM idemkey_audit
              WHERE tenant = $1 AND key_hash = $2 AND route = $3
              ORDER BY id",
        )
        .bind(&id.tenant)
        .bind(&id.key_hash[..])
        .bind(&id.route)
        .fetch_all(conn)
        .await
        .map_err(error)?;
        rows.into_iter().map(AuditEntry::try_from).collect()
    }

    async fn notify_evicted(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
    ) -> Result<(), StoreError> {
        // Inside a transaction, PostgreSQL delivers the notice when it commits.
        literal::query("SELECT pg_notify($1, $2)")
            .bind(EVICTION_CHANNEL)
            .bind(hex::encode(id.digest()))
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(())
    }

    /// `None` through a pooler in transaction mode ([`PgStore::POOLER_PARAMETER`]): a
    /// `LISTEN` there would hold on a server connection other clients get next. A listener
    /// that does not hear its own probe notice (the parameter forgotten) never reports
    /// [`EvictionNotice::Listening`] either.
    fn eviction_notices(&self) -> Option<EvictionNotices> {
        if self.pooled {
            return None;
        }
        let options = self.pool.connect_options().as_ref().clone();
        let follow = Follow {
            pool: PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .connect_lazy_with(options),
            probe: self.pool.clone(),
            listener: None,
            failures: 0,
            missed_probe: false,
        };
        Some(Box::pin(futures::stream::unfold(follow, |follow| async {
            Some(follow.next().await)
        })))
    }
}

#[cfg(test)]
mod tests {
    use idemkey_core::RecordState;
    use idemkey_core::protocol::{self, ClaimOutcome};
    use idemkey_testkit::conformance::{begin_owned, claim_at, record_id, response};

    use super::*;

    /// The claim of `key` on one route, made at `now`.
    fn claim(key: &str, now: Timestamp) -> protocol::Claim {
        claim_at(&record_id("t1", "/v1/transfers", key), 1, now)
    }

    /// An external-mode reservation of `key` (executing, a 30 s lease).
    fn reservation(key: &str, now: Timestamp) -> NewRecord {
        let claim = claim(key, now);
        NewRecord {
            id: claim.id,
            fingerprint: claim.fingerprint,
            state: RecordState::Executing,
            lease_expires_at: Some(now.plus(Duration::from_secs(30))),
            now,
            expires_at: now.plus(Duration::from_secs(3600)),
            sealed_key: None,
            first_sent: None,
        }
    }

    /// A migrated store of `max_connections` on a fresh database.
    async fn migrated_store(max_connections: u32) -> PgStore {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        let store = PgStore::connect(&url, max_connections)
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        store
    }

    /// A migrated store of four connections on a fresh database, each connection with the
    /// server setting `option`, and the database's URL.
    async fn migrated_store_with(option: (&str, &str)) -> (PgStore, String) {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        let options = PgConnectOptions::from_str(&url)
            .expect("url")
            .options([option]);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .expect("connect");
        let store = PgStore::new(pool);
        store.migrate().await.expect("migrate");
        (store, url)
    }

    /// The grouped completion is planned with the table as it is: on a table of thousands
    /// of records it looks each row up by its primary key (no scan of the table), and each
    /// completion gets its own answer, a stale token `false`, from the literal rows'
    /// `RETURNING`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completion_group_looks_its_rows_up_by_key() {
        let store = migrated_store(4).await;
        let now = Timestamp::now();
        let claim = |key: &str| claim(key, now);
        let reserve = |key: &str| reservation(key, now);
        let reserved = store
            .insert_group(vec![reserve("a"), reserve("b"), reserve("c")])
            .await;
        assert!(
            reserved.iter().all(|r| matches!(r, Ok(Inserted::Owned))),
            "{reserved:?}"
        );
        sqlx::query(
            "INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint,
                    fingerprint_parts, state, token, created_at, updated_at, expires_at)
             SELECT 'bulk', sha256(i::text::bytea), '/bulk', '\\x00', '\\x00', 'completed',
                    1, 0, 0, 0
               FROM generate_series(1, 5000) AS i",
        )
        .execute(store.pool())
        .await
        .expect("bulk records");
        let completion = |key: &str, token: i64| Completion {
            id: claim(key).id,
            token,
            response: StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), b"application/json".to_vec())],
                body: format!("{{\"key\":\"{key}\",\"quote\":\"it's\\\\\"}}").into_bytes(),
            },
            now,
        };
        let group = vec![
            completion("a", 1),
            completion("b", 2), // stale: b's owner holds token 1
            completion("c", 1),
        ];

        let rows: Vec<&Completion> = group.iter().collect();
        let sql = completion_rows(&rows).expect("statement");
        let plan: Vec<String> = sqlx::raw_sql(AssertSqlSafe(format!("EXPLAIN {sql}")))
            .fetch_all(store.pool())
            .await
            .expect("explain")
            .iter()
            .map(|row| row.try_get(0).expect("plan line"))
            .collect();
        let plan = plan.join("\n");
        assert!(
            plan.contains("Index Scan using idemkey_records_pkey"),
            "{plan}"
        );
        assert!(!plan.contains("Seq Scan on idemkey_records"), "{plan}");

        let answers = store.complete_group(group).await;
        assert!(
            matches!(answers[..], [Ok(true), Ok(false), Ok(true)]),
            "{answers:?}"
        );
        let mut conn = store.acquire().await.expect("connection");
        let mut fetch = async |key: &str| {
            store
                .fetch(&mut conn, &claim(key).id)
                .await
                .expect("fetch")
                .expect("record")
        };
        let a = fetch("a").await;
        assert_eq!(a.state, RecordState::Completed);
        assert_eq!(a.response, Some(completion("a", 1).response));
        let b = fetch("b").await;
        assert_eq!(
            b.state,
            RecordState::Executing,
            "a stale completion wrote nothing"
        );
    }

    /// A connection whose transaction the store committed is kept out of the pool, and the
    /// next transaction begins on it (the same backend), whole: what it writes commits with
    /// it, and dropped, it leaves nothing. Both ways of committing keep it: the completion
    /// sent with the `COMMIT` (a keyed request) and a plain commit (an unkeyed one).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_committed_connection_begins_the_next_transaction() {
        let mut store = migrated_store(4).await;
        // Kept for good, so that nothing here races the sweep.
        store.kept = Kept::with_idle(store.pool(), Duration::from_secs(3600));
        sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        let backend = async |tx: &mut PgTransaction| -> i32 {
            sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut **tx)
                .await
                .expect("backend")
        };
        let effect = async |tx: &mut PgTransaction, label: &str| {
            sqlx::query("INSERT INTO effects (label) VALUES ($1)")
                .bind(label)
                .execute(&mut **tx)
                .await
                .expect("effect");
        };
        let now = Timestamp::now();
        let response = response("{}");

        let first = claim("kept-first", now);
        let (mut tx, token) = begin_owned(&store, &first).await;
        let pid = backend(&mut tx).await;
        effect(&mut tx, "completed").await;
        store
            .complete_and_commit(tx, &first.id, token, &response, now)
            .await
            .expect("committed");
        assert_eq!(store.kept.len(), 1, "kept after the completion's COMMIT");

        let second = claim("kept-second", now);
        let (mut tx, _) = begin_owned(&store, &second).await;
        assert_eq!(store.kept.len(), 0);
        assert_eq!(backend(&mut tx).await, pid, "begun on the kept connection");
        effect(&mut tx, "dropped").await;
        drop(tx);

        let mut tx = store.begin().await.expect("begin");
        let pid = backend(&mut tx).await;
        effect(&mut tx, "plain").await;
        store.commit(tx).await.expect("commit");
        assert_eq!(store.kept.len(), 1, "kept after a plain COMMIT");
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(backend(&mut tx).await, pid, "begun on the kept connection");
        tx.rollback().await.expect("rollback");

        let labels: Vec<String> = sqlx::query_scalar("SELECT label FROM effects ORDER BY label")
            .fetch_all(store.pool())
            .await
            .expect("labels");
        assert_eq!(labels, ["completed", "plain"]);
        let mut conn = store.acquire().await.expect("connection");
        let first = store.fetch(&mut conn, &first.id).await.expect("fetch");
        assert_eq!(first.map(|r| r.state), Some(RecordState::Completed));
        let second = store.fetch(&mut conn, &second.id).await.expect("fetch");
        assert!(second.is_none(), "the dropped claim left no record");
    }

    /// A kept connection is the pool's again once unused for a moment: with a pool of one,
    /// the application's own `acquire` gets the connection the store kept, and closing the
    /// pool does not wait on it for good. (That it is kept at all is the test above; here
    /// the sweep may take it back at any moment.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_connection_goes_back_to_the_pool_unused() {
        let store = migrated_store(1).await;
        let commit_one = async || {
            let tx = store.begin().await.expect("begin");
            store.commit(tx).await.expect("commit");
        };

        commit_one().await;
        // Waits until the store gives it back; the pool's acquire time-out (5 s) would fail.
        let conn = store
            .pool()
            .acquire()
            .await
            .expect("the pool has its one connection back");
        assert_eq!(store.kept.len(), 0);
        drop(conn);

        commit_one().await;
        tokio::time::timeout(Duration::from_secs(30), store.pool().close())
            .await
            .expect("the pool closed");
        assert_eq!(store.kept.len(), 0);
        assert!(store.begin().await.is_err(), "a closed pool begins nothing");
    }

    /// Kept connections under a race: sixteen tasks committing transactions back to back and
    /// four using the pool directly, all on a pool of four (two of them kept at most), each
    /// task released by one barrier. Every transaction's effect is there exactly once, and
    /// no one times out waiting for a connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_connections_serve_racing_transactions_and_the_pools_own_queries() {
        const STORE_TASKS: usize = 16;
        const POOL_TASKS: usize = 4;
        const ROUNDS: usize = 25;
        let store = migrated_store(4).await;
        sqlx::query("CREATE TABLE effects (task INT NOT NULL, round INT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(STORE_TASKS + POOL_TASKS));
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..STORE_TASKS {
            let (store, start) = (store.clone(), start.clone());
            tasks.spawn(async move {
                start.wait().await;
                for round in 0..ROUNDS {
                    let mut tx = store.begin().await.expect("begin");
                    sqlx::query("INSERT INTO effects (task, round) VALUES ($1, $2)")
                        .bind(task as i32)
                        .bind(round as i32)
                        .execute(&mut *tx)
                        .await
                        .expect("effect");
                    store.commit(tx).await.expect("commit");
                }
            });
        }
        for _ in 0..POOL_TASKS {
            let (store, start) = (store.clone(), start.clone());
            tasks.spawn(async move {
                start.wait().await;
                for _ in 0..ROUNDS {
                    let mut conn = store.pool().acquire().await.expect("the pool's own query");
                    sqlx::query("SELECT 1")
                        .execute(&mut *conn)
                        .await
                        .expect("select");
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }

        let (effects, distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT (task, round)) FROM effects")
                .fetch_one(store.pool())
                .await
                .expect("count");
        assert_eq!(effects, (STORE_TASKS * ROUNDS) as i64);
        assert_eq!(distinct, effects, "each effect once");
    }

    /// A kept connection sits in the empty transaction `COMMIT; BEGIN` leaves; a server whose
    /// `idle_in_transaction_session_timeout` ends it meanwhile answers its next message with
    /// SQLSTATE 25P03. The next claim then begins on another connection, as after any lost
    /// one, and goes through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_connection_the_server_timed_out_is_replaced() {
        let (mut store, url) =
            migrated_store_with(("idle_in_transaction_session_timeout", "100ms")).await;
        // Kept for good, so that only the server can end it.
        store.kept = Kept::with_idle(store.pool(), Duration::from_secs(3600));
        let now = Timestamp::now();

        let first = claim("timed-out-first", now);
        let (mut tx, token) = begin_owned(&store, &first).await;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .expect("backend");
        store
            .complete_and_commit(tx, &first.id, token, &response("{}"), now)
            .await
            .expect("committed");
        assert_eq!(store.kept.len(), 1);
        // The server's timer is the only signal: watch for the backend to be gone.
        let mut admin = <PgConnection as sqlx::Connection>::connect(&url)
            .await
            .expect("admin");
        let gone = async {
            loop {
                let alive: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
                        .bind(pid)
                        .fetch_one(&mut admin)
                        .await
                        .expect("pg_stat_activity");
                if alive == 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), gone)
            .await
            .expect("the server ended the kept connection's session");

        let second = claim("timed-out-second", now);
        let (tx, token) = begin_owned(&store, &second).await;
        store
            .complete_and_commit(tx, &second.id, token, &response("{}"), now)
            .await
            .expect("committed on another connection");
    }

    /// The table does not check the record's state (migration 0006), so the read does: a
    /// state none of the store's statements writes is `Corrupt`, both when the record is
    /// read and when a retry's claim finds it, and nothing is replayed from it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_state_the_store_never_writes_is_refused_when_read() {
        let store = migrated_store(4).await;
        let now = Timestamp::now();
        let claim = claim("unknown-state", now);
        let (tx, token) = begin_owned(&store, &claim).await;
        let response = response("{}");
        store
            .complete_and_commit(tx, &claim.id, token, &response, now)
            .await
            .expect("completed");
        let changed = sqlx::query("UPDATE idemkey_records SET state = 'archived'")
            .execute(store.pool())
            .await
            .expect("the table takes any state")
            .rows_affected();
        assert_eq!(changed, 1);

        let mut conn = store.acquire().await.expect("connection");
        let read = store.fetch(&mut conn, &claim.id).await;
        assert!(
            matches!(&read, Err(StoreError::Corrupt(what)) if what.contains("unknown state")),
            "{read:?}"
        );
        let retried = protocol::begin_claim(&store, &claim, None).await;
        assert!(
            matches!(
                &retried,
                Err(protocol::Error::Store(StoreError::Corrupt(_)))
            ),
            "{:?}",
            retried.map(|(_, outcome)| outcome)
        );
    }

    /// A group whose `INSERT` fails (one of its keys is held by an uncommitted claim past
    /// the lock time-out) answers each reservation alone: the held key is busy, the others
    /// are owned, and when the holder rolls back the held key is free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_group_answers_each_reservation_alone() {
        let (store, _) = migrated_store_with(("lock_timeout", "200ms")).await;
        let now = Timestamp::now();
        let claim = |key: &str| claim(key, now);
        let new = |key: &str| reservation(key, now);
        let (holder, _) = begin_owned(&store, &claim("held")).await;

        let group = vec![new("free-1"), new("held"), new("free-2"), new("free-1")];
        let answers = store.insert_group(group).await;
        assert!(matches!(answers[0], Ok(Inserted::Owned)), "{answers:?}");
        assert!(
            matches!(answers[1], Err(StoreError::Busy(_))),
            "{answers:?}"
        );
        assert!(matches!(answers[2], Ok(Inserted::Owned)), "{answers:?}");
        // The second write of a record in one group is made alone after it: it finds the
        // first one's record.
        assert!(
            matches!(&answers[3], Ok(Inserted::Existing(r)) if r.id == claim("free-1").id),
            "{answers:?}"
        );

        holder.rollback().await.expect("rollback");
        let again = protocol::reserve_at_point_of_no_return(
            &store,
            &claim("held"),
            Duration::from_secs(30),
        )
        .await
        .expect("reserve");
        assert!(matches!(again, ClaimOutcome::Owned { .. }), "{again:?}");
    }

    #[test]
    fn the_pooler_parameter_is_read_and_removed() {
        let read = |url: &str| pooler_parameter(url).map_err(|e| e.to_string());
        assert_eq!(
            read("postgres://a@h:6432/db?idemkey-pooler=transaction"),
            Ok(("postgres://a@h:6432/db".to_owned(), true))
        );
        assert_eq!(
            read("postgres://a@h/db?sslmode=disable&idemkey-pooler=transaction&application_name=x"),
            Ok((
                "postgres://a@h/db?sslmode=disable&application_name=x".to_owned(),
                true
            ))
        );
        assert_eq!(
            read("postgres://a@h/db?sslmode=disable"),
            Ok(("postgres://a@h/db?sslmode=disable".to_owned(), false))
        );
        assert!(read("postgres://a@h/db?idemkey-pooler=statement").is_err());
    }

    /// A fresh database: its direct URL, and its URL through PgBouncer in transaction mode
    /// (without idemkey's parameter).
    async fn pooled_database() -> (String, String) {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        let direct = url.clone();
        let pooled = tokio::task::spawn_blocking(move || idemkey_testkit::pgbouncer_url(&direct))
            .await
            .expect("pgbouncer");
        (url, pooled)
    }

    /// A store through PgBouncer in transaction mode, on a fresh database, and the
    /// database's direct URL.
    async fn pooled_store() -> (PgStore, String) {
        let (url, pooled) = pooled_database().await;
        let pooled = format!("{pooled}?{}=transaction", PgStore::POOLER_PARAMETER);
        let store = PgStore::connect(&pooled, 4).await.expect("connect");
        assert!(store.through_pooler());
        (store, url)
    }

    /// Through PgBouncer without the parameter, `connect` is refused at once: the pooler
    /// refuses the `lock_timeout` the store then sets at connect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_through_pgbouncer_without_the_parameter_is_refused() {
        let (_, pooled) = pooled_database().await;
        let refused = PgStore::connect(&pooled, 4).await;
        assert!(refused.is_err(), "connected through the pooler unmarked");
    }

    /// Through the pooler, migrations run, and run again (each run on a server connection
    /// an earlier one may have used): nothing of a run is left on its server connection,
    /// neither the migrator's prepared statements nor its advisory lock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn migrations_run_again_and_again_through_pgbouncer() {
        let (store, _) = pooled_store().await;
        for _ in 0..3 {
            store.migrate().await.expect("migrate through the pooler");
        }
        let mut conn = store.acquire().await.expect("connection");
        let listed = store.list(&mut conn, &ListFilter::default()).await;
        assert!(
            matches!(listed, Ok(ref records) if records.is_empty()),
            "{listed:?}"
        );
    }

    /// Migrations run by several processes at once on a fresh database (as `serve`s started
    /// together do), directly and through the pooler: each run waits for the one before it
    /// to commit, so every one succeeds and the schema is made once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_migrations_wait_for_each_other() {
        let (url, pooled) = pooled_database().await;
        let pooled = format!("{pooled}?{}=transaction", PgStore::POOLER_PARAMETER);
        let mut stores = Vec::new();
        for url in [&url, &url, &pooled, &pooled] {
            stores.push(PgStore::connect(url, 2).await.expect("connect"));
        }
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(stores.len()));
        let mut runs = tokio::task::JoinSet::new();
        for store in stores {
            let start = start.clone();
            runs.spawn(async move {
                start.wait().await;
                store.migrate().await
            });
        }
        while let Some(run) = runs.join_next().await {
            run.expect("task").expect("every concurrent run succeeds");
        }
    }

    /// A listener connected directly hears its probe; one through the pooler in transaction
    /// mode never can, and says so rather than claiming to listen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listener_through_pgbouncer_is_refused_by_its_probe() {
        // An application's pool through the pooler, given to the store unmarked.
        let (url, pooled) = pooled_database().await;
        let pooled = PgStore::new(PgPool::connect(&pooled).await.expect("connect"));
        let direct = PgStore::connect(&url, 2).await.expect("connect");
        let listener_pool = |store: &PgStore| {
            PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy_with(store.pool().connect_options().as_ref().clone())
        };
        assert!(
            listen(&listener_pool(&direct), direct.pool()).await.is_ok(),
            "a direct listener hears its probe"
        );
        let refused = listen(&listener_pool(&pooled), pooled.pool()).await;
        assert!(
            matches!(refused, Err(NotListening::MissedProbe)),
            "a listener through the pooler is refused"
        );
    }
}
