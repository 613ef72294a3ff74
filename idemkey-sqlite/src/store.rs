use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::{
    AuditEntry, Begun, CommitError, EvictionNotices, Inserted, ListFilter, Members, NewRecord,
    Purged, Record, RecordId, Store, StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlx::group::{self, Completion, GroupWriter, GroupedWrites};
use idemkey_sqlx::{AuditRow, Code, RecordRow, bind_completion, classify_error};
use sqlx::Sqlite;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use crate::evictions::{self, EVICTION_KEPT, Evictions};
use crate::sql;
use crate::writer::{SqlitePooledConnection, SqliteTransaction, Writer};

/// External mode's grouped writes: one group of each kind at a time. The writer takes them
/// in turns anyway, and a second group only splits the waiting writes (the gateway's fresh
/// requests were slower with two: docs/decisions.md, "Concurrent external-mode writes are
/// committed in groups").
pub(crate) const GROUP_WRITERS: usize = 1;

/// An idempotency store in a SQLite database.
///
/// Its write transactions ([`Store::begin`]) take turns in a first-come, first-served queue
/// in memory, shared by the store's clones: clone the store rather than make two on one
/// database, or the two queues meet in SQLite's busy handler again.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    writer: Arc<Writer>,
    /// External mode's reservations and completions, written in groups, each group in one
    /// turn of the writer (`idemkey_sqlx::group`).
    grouped: GroupedWrites,
}

impl SqliteStore {
    /// The name of this crate's migration tracking table.
    pub const MIGRATIONS_TABLE: &'static str = "idemkey_migrations";

    /// A store on an existing pool. The pool should use WAL and a busy time-out, as
    /// [`connect`](Self::connect) sets up; the busy time-out its connections report
    /// (`PRAGMA busy_timeout`, read once) also bounds the wait in the writer queue. Each
    /// write transaction takes its connection from the pool, in turn (so the pool's
    /// `before_acquire` hooks run for it), where [`connect`](Self::connect)'s store keeps
    /// one writer connection of its own.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            writer: Arc::new(Writer::new(None, false)),
            grouped: GroupedWrites::new(GROUP_WRITERS),
        }
    }

    /// The busy time-out of [`connect`](Self::connect): how long a claim waits for the write
    /// lock before it fails with [`StoreError::Busy`] (503 `store-busy`).
    pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

    /// Opens (creating if missing) the database at `url` (`sqlite:path.db`), in WAL mode with
    /// a 5 s busy time-out. Write transactions take turns on one connection the store keeps
    /// for them; the pool of eight serves the rest.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_busy_timeout(url, Self::DEFAULT_BUSY_TIMEOUT).await
    }

    /// Like [`connect`](Self::connect), with another busy time-out. SQLite serializes writers,
    /// so this bounds how long any claim waits, whichever key holds the lock: it is the
    /// SQLite form of the in-flight wait bound. It bounds the wait in the store's writer
    /// queue, and then SQLite's own wait for writers outside the queue.
    pub async fn connect_with_busy_timeout(
        url: &str,
        busy_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(error)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(busy_timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .map_err(error)?;
        Ok(Self {
            pool,
            writer: Arc::new(Writer::new(Some(busy_timeout), true)),
            grouped: GroupedWrites::new(GROUP_WRITERS),
        })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
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
        Self::migrator().run(&self.pool).await
    }
}

/// What a SQLite result code says: SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their
/// extended codes, are busy. SQLite has no code for a lost connection (there is none to
/// lose: an I/O error is SQLITE_IOERR, a refused statement).
fn result_code(code: &str) -> Code {
    match code.parse::<i32>() {
        Ok(c) if matches!(c & 0xff, 5 | 6) => Code::Busy,
        _ => Code::Other,
    }
}

impl Evictions for SqlitePool {
    async fn newest(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar(evictions::NEWEST)
            .fetch_one(self)
            .await
            .map_err(error)
    }

    async fn after(&self, seq: i64) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        sqlx::query_as(evictions::AFTER)
            .bind(seq)
            .fetch_all(self)
            .await
            .map_err(error)
    }
}

pub(crate) fn error(e: sqlx::Error) -> StoreError {
    classify_error(e, result_code)
}

fn record(row: RecordRow) -> Result<Record, StoreError> {
    Record::try_from(row)
}

/// The extended result codes of a claim's `INSERT` refused because the key is taken:
/// SQLITE_CONSTRAINT_PRIMARYKEY (the records' key is their primary key), and
/// SQLITE_CONSTRAINT_UNIQUE.
const TAKEN: [&str; 2] = ["1555", "2067"];

/// The SQLite extended result code of `e`, if it is a database error.
fn code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// What [`SqliteStore::begin_claim`] sends: `BEGIN IMMEDIATE` and the claim's `INSERT`, in
/// one string run by `sqlite3_exec`, which takes no bound parameters, so the values are
/// written out as SQL literals (text quoted, bytes in hex). A plain `INSERT` (no
/// `ON CONFLICT`): a taken key fails it with a constraint error, which ends that statement
/// only, not the transaction. `None` for text with a NUL, which a C string cannot carry: such
/// a claim goes step by step, with bound parameters.
fn claim_statement(r: &NewRecord) -> Option<String> {
    let members = r.fingerprint.members.as_ref().map(Members::to_bytes);
    let mut sql = Literals(String::with_capacity(
        640 + 2 * members.as_ref().map_or(0, Vec::len),
    ));
    sql.push(
        "BEGIN IMMEDIATE; \
         INSERT INTO idemkey_records \
             (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token, \
              lease_expires_at, created_at, updated_at, expires_at, sealed_key, \
              fingerprint_members, first_sent) \
         VALUES (",
    );
    sql.text(&r.id.tenant)?.push(", ");
    sql.bytes(&r.id.key_hash).push(", ");
    sql.text(&r.id.route)?.push(", ");
    sql.bytes(&r.fingerprint.digest).push(", ");
    sql.bytes(&r.fingerprint.parts.to_bytes()).push(", ");
    sql.text(r.state.as_str())?.push(", 1, ");
    sql.opt_int(r.lease_expires_at.map(Timestamp::as_millis))
        .push(", ");
    sql.int(r.now.as_millis()).push(", ");
    sql.int(r.now.as_millis()).push(", ");
    sql.int(r.expires_at.as_millis()).push(", ");
    sql.opt_bytes(r.sealed_key.as_deref()).push(", ");
    sql.opt_bytes(members.as_deref()).push(", ");
    sql.opt_int(r.first_sent.map(Timestamp::as_millis))
        .push(")");
    Some(sql.0)
}

/// SQL text with values written into it as literals.
struct Literals(String);

impl Literals {
    fn push(&mut self, sql: &str) -> &mut Self {
        self.0.push_str(sql);
        self
    }

    /// A quoted string (`'` doubled; SQLite has no other escapes); `None` if it holds a NUL.
    fn text(&mut self, text: &str) -> Option<&mut Self> {
        if text.contains('\0') {
            return None;
        }
        self.0.push('\'');
        for (i, part) in text.split('\'').enumerate() {
            if i > 0 {
                self.0.push_str("''");
            }
            self.0.push_str(part);
        }
        self.0.push('\'');
        Some(self)
    }

    /// A blob literal, `X'…'`.
    fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.0.reserve(bytes.len() * 2 + 3);
        self.0.push_str("X'");
        for b in bytes {
            self.0.push(char::from(HEX[usize::from(b >> 4)]));
            self.0.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        self.0.push('\'');
        self
    }

    fn opt_bytes(&mut self, bytes: Option<&[u8]>) -> &mut Self {
        match bytes {
            Some(bytes) => self.bytes(bytes),
            None => self.push("NULL"),
        }
    }

    fn int(&mut self, n: i64) -> &mut Self {
        use std::fmt::Write as _;
        let _ = write!(self.0, "{n}");
        self
    }

    fn opt_int(&mut self, n: Option<i64>) -> &mut Self {
        match n {
            Some(n) => self.int(n),
            None => self.push("NULL"),
        }
    }
}

/// What [`SqliteStore::complete_and_commit`] sends, in one call with bound parameters (sqlx
/// binds `?N` by number across the statements of one string): the completion, a guard, then
/// `COMMIT; BEGIN` (see `SqliteTransaction::commit_batch`). The guard refuses, with a
/// constraint error, a row in a one-column TEMP table whenever the completion changed no row
/// (`changes()`: the rows of the last `INSERT`, `UPDATE` or `DELETE` that completed): the
/// error stops the string there, before the `COMMIT`, and leaves the transaction open to be
/// rolled back. When the completion did change its row, the guard inserts nothing. The table
/// is created, empty, on each connection's first completion, in its transaction.
const COMPLETE_AND_COMMIT: &str = concat!(
    "CREATE TEMP TABLE IF NOT EXISTS idemkey_fence (
    matched INTEGER, CONSTRAINT idemkey_fenced CHECK (matched = 1));
",
    sql::complete_sql!(),
    ";
INSERT INTO temp.idemkey_fence (matched) SELECT changes() WHERE changes() <> 1;
COMMIT;
BEGIN"
);

/// The statements of [`COMPLETE_AND_COMMIT`] before its `COMMIT`.
const BEFORE_COMMIT: usize = 3;

/// Where the completion and its guard are among the statements of [`COMPLETE_AND_COMMIT`].
const COMPLETION: usize = 1;
const GUARD: usize = 2;

/// SQLITE_CONSTRAINT_CHECK, what the guard's refusal is.
const CONSTRAINT_CHECK: &str = "275";

/// Whether [`COMPLETE_AND_COMMIT`] was stopped by its guard, from the rows each statement
/// that completed changed (`changed`) and the error that stopped it: the completion ran and
/// changed no row, and the next statement, the guard, failed its check. Told by the
/// completion's own count and the error's code, never by a message.
fn is_fenced(changed: &[u64], e: &sqlx::Error) -> bool {
    changed.len() == GUARD
        && changed[COMPLETION] == 0
        && matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(CONSTRAINT_CHECK))
}

/// `values` rows of `width` parameters each: `(?, ?), (?, ?)` for 2 and 2, bound in order.
/// Anonymous: sqlx asks SQLite the name of every parameter it binds, and SQLite finds a
/// numbered one by walking the statement's list of names, which a group's hundreds of
/// `?NNN` made quadratic in the group's size.
fn value_rows(values: usize, width: usize) -> String {
    let row = format!("({})", vec!["?"; width].join(", "));
    vec![row; values].join(", ")
}

/// A grouped statement that SQLite refused as busy wrote nothing (another process held
/// the write lock past the busy time-out): each of its writers gets that answer, as it
/// would alone, rather than each waiting again in turn.
pub(crate) fn busy_for_each(e: &StoreError, writes: usize) -> Option<StoreError> {
    let StoreError::Busy(source) = e else {
        return None;
    };
    Some(StoreError::Busy(Box::new(std::io::Error::other(format!(
        "a group of {writes} writes: {source}"
    )))))
}

impl SqliteStore {
    /// `statement` on the writer, in one turn (autocommit: one statement, one transaction).
    async fn write_group<'q>(
        &self,
        statement: sqlx::query::QueryAs<'q, Sqlite, (String, Vec<u8>, String), SqliteArguments>,
    ) -> Result<HashSet<RecordId>, StoreError> {
        let mut conn = self.acquire_for_write().await?;
        let rows = statement.fetch_all(&mut *conn).await.map_err(error)?;
        Ok(group::returned(rows))
    }
}

impl GroupWriter for SqliteStore {
    /// One multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING` in one turn of the writer
    /// (one hand-off to sqlx's worker thread for the group), answered
    /// [`Inserted::Owned`] for the rows it inserted and [`Inserted::Conflict`] for the keys
    /// it found taken (the protocol reads those records). Busy: each gets busy. Any other
    /// failure wrote nothing (one statement is one transaction here): each is made again
    /// alone.
    async fn insert_group(&self, records: Vec<NewRecord>) -> Vec<Result<Inserted, StoreError>> {
        let (rows, in_group) = group::plan(&records, |r| &r.id);
        let sql = format!(
            "INSERT INTO idemkey_records
                 (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token,
                  lease_expires_at, created_at, updated_at, expires_at, sealed_key,
                  fingerprint_members, first_sent)
             VALUES {}
             ON CONFLICT (tenant, key_hash, route) DO NOTHING
             RETURNING tenant, key_hash, route",
            value_rows(rows.len(), 14)
        );
        let mut statement = sqlx::query_as(AssertSqlSafe(sql));
        for r in &rows {
            statement = statement
                .bind(&r.id.tenant)
                .bind(&r.id.key_hash[..])
                .bind(&r.id.route)
                .bind(&r.fingerprint.digest[..])
                .bind(r.fingerprint.parts.to_bytes().to_vec())
                .bind(r.state.as_str())
                .bind(1_i64)
                .bind(r.lease_expires_at.map(Timestamp::as_millis))
                .bind(r.now.as_millis())
                .bind(r.now.as_millis())
                .bind(r.expires_at.as_millis())
                .bind(r.sealed_key.as_deref())
                .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
                .bind(r.first_sent.map(Timestamp::as_millis));
        }
        let inserted = self.write_group(statement).await;
        let from_group = |record: &NewRecord| match &inserted {
            Ok(inserted) => Some(Ok(if inserted.contains(&record.id) {
                Inserted::Owned
            } else {
                Inserted::Conflict
            })),
            Err(e) => busy_for_each(e, rows.len()).map(Err),
        };
        group::answer_each(&records, &in_group, from_group, |r| self.insert_alone(r)).await
    }

    /// One `UPDATE … FROM (VALUES …) RETURNING` in one turn of the writer, each answered as
    /// [`complete`](Store::complete) would be: `true` where the row still carried the
    /// owner's token. Busy: each gets busy; any other failure wrote nothing: each is
    /// written again alone.
    async fn complete_group(&self, group: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        let (rows, in_group) = group::plan(&group, |c| &c.id);
        // The `VALUES` columns are `column1` … `column8`: tenant, key_hash, route, token,
        // status, headers, body, now.
        let sql = format!(
            "UPDATE idemkey_records
                SET state = 'completed', token = token + 1, lease_expires_at = NULL,
                    response_status = c.column5, response_headers = c.column6,
                    response_body = c.column7, updated_at = c.column8
               FROM (VALUES {}) AS c
              WHERE tenant = c.column1 AND key_hash = c.column2 AND route = c.column3
                AND token = c.column4
             RETURNING tenant, key_hash, route",
            value_rows(rows.len(), 8)
        );
        let mut statement = sqlx::query_as(AssertSqlSafe(sql));
        for c in &rows {
            statement = statement
                .bind(&c.id.tenant)
                .bind(&c.id.key_hash[..])
                .bind(&c.id.route)
                .bind(c.token)
                .bind(i32::from(c.response.status))
                .bind(c.response.encode_headers())
                .bind(&c.response.body[..])
                .bind(c.now.as_millis());
        }
        let completed = self.write_group(statement).await;
        let from_group = |c: &Completion| match &completed {
            Ok(completed) => Some(Ok(completed.contains(&c.id))),
            Err(e) => busy_for_each(e, rows.len()).map(Err),
        };
        group::answer_each(&group, &in_group, from_group, |c| self.complete_alone(c)).await
    }
}

impl Store for SqliteStore {
    type Connection = SqliteConnection;
    type Transaction = SqliteTransaction;
    type PooledConnection = SqlitePooledConnection;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        // In turn behind this store's other writers, then IMMEDIATE: take the write lock
        // now rather than fail later when a read transaction tries to upgrade.
        self.writer.begin(&self.pool).await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        tx.commit().await
    }

    /// One hand-off to the writer's worker thread for a fresh key: `BEGIN IMMEDIATE` and
    /// the claim's `INSERT` in one call (`claim_statement` in this file). A taken key fails
    /// that `INSERT` and leaves the transaction open, holding the write lock; sqlx is then
    /// told to count it, and the record that took the key is read in it: three hand-offs,
    /// as step by step. `lock_wait` does not apply: SQLite's bound is its busy time-out.
    async fn begin_claim(
        &self,
        record: &NewRecord,
        _lock_wait: Option<Duration>,
    ) -> Result<Begun<SqliteTransaction>, StoreError> {
        let Some(claim) = claim_statement(record) else {
            let mut tx = self.begin().await?;
            return match self.insert(&mut tx, record).await {
                Ok(inserted) => Ok(Begun::Claimed(tx, inserted)),
                Err(StoreError::Busy(_)) => Ok(Begun::Held),
                Err(e) => Err(e),
            };
        };
        let mut tx = self.writer.turn(&self.pool).await?;
        let refused = match tx
            .begin_with(AssertSqlSafe(claim).into_sql_str(), false)
            .await
        {
            Ok(()) => return Ok(Begun::Claimed(tx, Inserted::Owned)),
            Err(e) => e,
        };
        if !code(&refused).is_some_and(|c| TAKEN.contains(&c.as_str())) {
            let e = error(refused);
            if matches!(e, StoreError::Busy(_)) {
                // Only the `BEGIN IMMEDIATE` waits for a lock (the `INSERT` runs holding the
                // write lock), and `sqlite3_exec` stops at the first failing statement: no
                // transaction was begun.
                tx.begun_nothing();
            }
            return Err(e);
        }
        tx.adopt().await.map_err(error)?;
        // This transaction holds the write lock: the record that took the key is committed.
        let inserted = match self.fetch(&mut tx, &record.id).await? {
            Some(existing) => Inserted::Existing(Box::new(existing)),
            None => Inserted::Conflict,
        };
        Ok(Begun::Claimed(tx, inserted))
    }

    /// One hand-off to the writer's worker thread: the completion, guarded, and `COMMIT` in
    /// one call (`COMPLETE_AND_COMMIT` in this file). When the completion matches no row
    /// carrying `token`, the guard fails before the `COMMIT` and the transaction is rolled
    /// back: [`CommitError::Fenced`].
    async fn complete_and_commit(
        &self,
        tx: SqliteTransaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        let batch = bind_completion(sqlx::query(COMPLETE_AND_COMMIT), id, token, response, now);
        let Err((changed, e)) = tx.commit_batch(batch, BEFORE_COMMIT, is_fenced).await else {
            return Ok(());
        };
        Err(match changed.len() {
            // The completion matched no row, and the guard refused: the `COMMIT` did not run.
            _ if is_fenced(&changed, &e) => CommitError::Fenced,
            n if n < BEFORE_COMMIT && matches!(e, sqlx::Error::Database(_)) => {
                CommitError::NotCommitted(error(e))
            }
            // The `COMMIT` ran and answered; only the `BEGIN` after it failed.
            n if n > BEFORE_COMMIT => return Ok(()),
            // The `COMMIT` failed, or the call did (the worker thread gone): as a failed
            // `commit`, the outcome is not known.
            _ => CommitError::Unknown(error(e)),
        })
    }

    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        let conn = self.pool.acquire().await.map_err(error)?;
        Ok(SqlitePooledConnection::pooled(conn))
    }

    /// The writer, in its turn: external mode's autocommit writes queue with the
    /// transactions instead of meeting them in SQLite's busy handler, and pay no pool ping.
    async fn acquire_for_write(&self) -> Result<Self::PooledConnection, StoreError> {
        let turn = self.writer.turn(&self.pool).await?;
        Ok(SqlitePooledConnection::writer(turn))
    }

    /// Concurrent reservations are written in groups, one multi-row `INSERT` in one turn of
    /// the writer each, each answered once its group committed, as [`insert`](Store::insert)
    /// would have answered it alone (a key found taken is [`Inserted::Conflict`]); one that
    /// finds nothing being written goes at once, alone. (`idemkey_sqlx::group`,
    /// `SqliteStore::insert_group`.)
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.grouped.insert(self, record).await
    }

    /// Concurrent completions are written in groups, one `UPDATE` in one turn of the writer
    /// each, each answered once its group committed, as [`complete`](Store::complete) would
    /// have answered it alone. (`idemkey_sqlx::group`, `SqliteStore::complete_group`.)
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.grouped.complete(self, id, token, response, now).await
    }

    async fn insert(
        &self,
        conn: &mut SqliteConnection,
        r: &NewRecord,
    ) -> Result<Inserted, StoreError> {
        // Two statements. In the claim's `BEGIN IMMEDIATE` transaction this connection holds
        // the only write lock, so the row the insert conflicted with is committed and the
        // read finds it. On an autocommit connection (external mode) it may be gone by the
        // read: then `Conflict`, and the protocol reads again.
        let row: Option<i64> = sqlx::query_scalar(sql::INSERT)
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
            .fetch_optional(&mut *conn)
            .await
            .map_err(error)?;
        if row.is_some() {
            return Ok(Inserted::Owned);
        }
        Ok(match self.fetch(conn, &r.id).await? {
            Some(existing) => Inserted::Existing(Box::new(existing)),
            None => Inserted::Conflict,
        })
    }

    async fn fetch(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        sqlx::query_as::<_, RecordRow>(sql::FETCH)
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
        conn: &mut SqliteConnection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        sqlx::query_scalar(sql::REPLACE)
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
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = bind_completion(sqlx::query(sql::COMPLETE), id, token, response, now)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::RENEW)
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
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::MARK_EXECUTING)
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
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::MARK_INDETERMINATE)
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
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::RELEASE)
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
        conn: &mut SqliteConnection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query_as::<_, RecordRow>(sql::LIST)
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
        conn: &mut SqliteConnection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query_as::<_, RecordRow>(sql::FIND_BY_KEY)
            .bind(tenant)
            .bind(&key_hash[..])
            .fetch_all(conn)
            .await
            .map_err(error)?;
        rows.into_iter().map(record).collect()
    }

    async fn evict(&self, conn: &mut SqliteConnection, id: &RecordId) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::EVICT)
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
        conn: &mut SqliteConnection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        // SQLite has one writer at a time, so there are no locked rows to skip; a small
        // batch keeps the write lock short.
        let gone: Vec<i64> = sqlx::query_scalar(sql::PURGE_BATCH)
            .bind(now.as_millis())
            .bind(from.map_or(i64::MIN, Timestamp::as_millis))
            .bind(i64::from(batch))
            .fetch_all(conn)
            .await
            .map_err(error)?;
        Ok(Purged {
            deleted: gone.len() as u64,
            through: gone.into_iter().max().map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut SqliteConnection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        sqlx::query(sql::APPEND_AUDIT)
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
        conn: &mut SqliteConnection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = sqlx::query_as::<_, AuditRow>(sql::AUDIT)
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
        conn: &mut SqliteConnection,
        id: &RecordId,
    ) -> Result<(), StoreError> {
        // On the eviction's transaction: other processes read it once it commits.
        let now = Timestamp::now();
        sqlx::query(sql::TRIM_EVICTIONS)
            .bind(now.minus(EVICTION_KEPT).as_millis())
            .execute(&mut *conn)
            .await
            .map_err(error)?;
        sqlx::query(sql::NOTE_EVICTION)
            .bind(&id.digest()[..])
            .bind(now.as_millis())
            .execute(&mut *conn)
            .await
            .map_err(error)?;
        Ok(())
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.pool.clone()))
    }
}
