//! A SQLite store whose statements run on the calling thread, through rusqlite.
//!
//! sqlx's SQLite driver runs each connection on a thread of its own and hands every
//! statement there and back. Inside the writer's turn, those hand-offs cost a fresh request
//! more than SQLite's own work does (docs/decisions.md, "SQLite's writer without sqlx's
//! worker thread"). [`RusqliteStore`] calls SQLite directly instead, on the task's thread, while it
//! holds the turn: a statement is not a hand-off, and the turn is as long as the work.
//!
//! The application's effect runs on the same connection, so it is written with rusqlite
//! too: [`RusqliteTransaction`] dereferences to [`rusqlite::Connection`]. Statements are
//! synchronous and must stay short. A connection is not `Sync`, so a handler cannot hold a
//! statement across an `.await`.
//!
//! The SQL is the one [`SqliteStore`](crate::SqliteStore) runs (`sql.rs`), and the two
//! share a database file and its migrations.

use std::collections::HashSet;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use idemkey_core::{
    AuditEntry, EvictionNotices, Inserted, ListFilter, Members, NewRecord, Purged, Record,
    RecordId, Store, StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlx::group::{self, Completion, GroupWriter, GroupedWrites};
use idemkey_sqlx::{AuditRow, RecordRow};
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::SqliteStore;
use crate::checkpoint::Checkpoints;
use crate::evictions::{self, EVICTION_KEPT, Evictions};
use crate::group::{GROUP_WRITERS, busy_for_each};
use crate::sql;
use crate::writer::WriterTimedOut;

/// How many idle read connections a store keeps for [`Store::acquire`].
const IDLE_READERS: usize = 8;

/// A SQLite store on rusqlite: write transactions take turns, first come first served, on
/// one connection the store keeps, and run their statements on the calling thread.
///
/// The store keeps one thread of its own, which checkpoints the WAL out of the writer's
/// turn (see `checkpoint.rs`); it ends once the store and its clones are dropped.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idemkey_sqlite::RusqliteStore;
/// let store = RusqliteStore::open("idemkey.db")?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RusqliteStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    path: PathBuf,
    busy_timeout: Duration,
    /// Whether connections create the file and set WAL mode (not for an operator's
    /// command on an existing file).
    create: bool,
    /// The writer turn, with the writer connection (`None` until first used, and after a
    /// statement that ends a transaction failed).
    turn: Arc<Mutex<Option<Connection>>>,
    /// Idle connections for reads and autocommit statements.
    idle: StdMutex<Vec<Connection>>,
    /// External mode's reservations and completions, committed in groups (as
    /// `SqliteStore`'s): one transaction in one turn of the writer for each group.
    grouped: GroupedWrites,
    /// The WAL's checkpoints, out of the writer's turn (`checkpoint.rs`).
    checkpoints: Checkpoints,
}

impl RusqliteStore {
    /// Opens (creating if missing) the database file at `path`, in WAL mode with a 5 s busy
    /// time-out ([`SqliteStore::DEFAULT_BUSY_TIMEOUT`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with_busy_timeout(path, SqliteStore::DEFAULT_BUSY_TIMEOUT)
    }

    /// Like [`open`](Self::open), with another busy time-out. It bounds the wait for the
    /// writer's turn, and then SQLite's own wait for writers outside this store.
    pub fn open_with_busy_timeout(
        path: impl AsRef<Path>,
        busy_timeout: Duration,
    ) -> Result<Self, StoreError> {
        Self::open_as(path, busy_timeout, true)
    }

    /// Opens the database file at `path`, which must exist, for an operator's command:
    /// nothing is created, and the journal mode is left as the file says (WAL once a
    /// store opened with [`open`](Self::open) made it).
    pub fn open_existing(
        path: impl AsRef<Path>,
        busy_timeout: Duration,
    ) -> Result<Self, StoreError> {
        Self::open_as(path, busy_timeout, false)
    }

    fn open_as(
        path: impl AsRef<Path>,
        busy_timeout: Duration,
        create: bool,
    ) -> Result<Self, StoreError> {
        let path = path.as_ref().to_owned();
        // Opened now, so a path that cannot be opened fails here, and WAL is set up before
        // any other connection opens the file (the checkpointer's among them).
        let writer = writer_connection(&path, busy_timeout, create)?;
        let checkpoints = {
            let path = path.clone();
            Checkpoints::start(move || connection(&path, busy_timeout, false))?
        };
        let shared = Shared {
            path,
            busy_timeout,
            create,
            turn: Arc::new(Mutex::new(None)),
            idle: StdMutex::new(Vec::new()),
            grouped: GroupedWrites::new(GROUP_WRITERS),
            checkpoints,
        };
        *shared
            .turn
            .try_lock()
            .expect("nobody else has the turn yet") = Some(writer);
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Runs the pending migrations: [`SqliteStore::migrator`]'s, tracked in the same table,
    /// through a short-lived sqlx connection to the same file.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let url = format!("sqlite:{}", self.shared.path.display());
        let store = SqliteStore::connect_with_busy_timeout(&url, self.shared.busy_timeout).await?;
        let migrated = store.migrate().await;
        store.pool().close().await;
        migrated.map_err(|e| StoreError::Database(Box::new(e)))
    }

    /// Runs `f` on a connection of its own (from the store's idle ones), outside the
    /// writer's turn: for reads, and for writes that do not share a transaction with the
    /// store's.
    pub fn with_connection<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let mut conn = self.shared.idle_connection()?;
        let result = f(&mut conn).map_err(error);
        self.shared.give_back(conn);
        result
    }
}

/// A connection to `path`, set up as `SqliteStore::connect` sets up its own; `create`: the
/// file is created when missing and put in WAL mode.
fn connection(path: &Path, busy_timeout: Duration, create: bool) -> Result<Connection, StoreError> {
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
    conn.busy_timeout(busy_timeout).map_err(error)?;
    // As `SqliteStore::connect` sets up its connections (sqlx enables foreign keys).
    if create {
        conn.execute_batch("PRAGMA journal_mode = WAL")
            .map_err(error)?;
    }
    conn.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON")
        .map_err(error)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// The writer connection: [`connection`], without SQLite's automatic checkpoint, which the
/// store's checkpointer does instead (`checkpoint.rs`).
fn writer_connection(
    path: &Path,
    busy_timeout: Duration,
    create: bool,
) -> Result<Connection, StoreError> {
    let conn = connection(path, busy_timeout, create)?;
    conn.execute_batch("PRAGMA wal_autocheckpoint = 0")
        .map_err(error)?;
    Ok(conn)
}

impl Shared {
    fn connection(&self) -> Result<Connection, StoreError> {
        connection(&self.path, self.busy_timeout, self.create)
    }

    fn writer_connection(&self) -> Result<Connection, StoreError> {
        writer_connection(&self.path, self.busy_timeout, self.create)
    }

    fn idle_connection(&self) -> Result<Connection, StoreError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            Some(conn) => Ok(conn),
            None => self.connection(),
        }
    }

    fn give_back(&self, conn: Connection) {
        if !conn.is_autocommit() {
            // Left in a transaction: closing it rolls back what is open on it.
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < IDLE_READERS {
            idle.push(conn);
        }
    }

    /// Waits for the writer's turn (first come, first served, bounded by the busy time-out)
    /// and opens the writer connection if it is not open.
    async fn turn(self: &Arc<Self>) -> Result<OwnedMutexGuard<Option<Connection>>, StoreError> {
        let mut turn = match self.turn.clone().try_lock_owned() {
            Ok(turn) => turn,
            Err(_) => tokio::time::timeout(self.busy_timeout, self.turn.clone().lock_owned())
                .await
                .map_err(|_| StoreError::Busy(Box::new(WriterTimedOut(self.busy_timeout))))?,
        };
        if turn.is_none() {
            *turn = Some(self.writer_connection()?);
        }
        Ok(turn)
    }
}

pub(crate) fn error(e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
    match e.sqlite_error_code() {
        Some(DatabaseBusy | DatabaseLocked) => StoreError::Busy(Box::new(e)),
        _ => StoreError::Database(Box::new(e)),
    }
}

/// A write transaction on a [`RusqliteStore`] (`BEGIN IMMEDIATE`): it holds SQLite's write
/// lock and the store's writer turn until it commits or is dropped, which rolls it back.
/// It dereferences to [`rusqlite::Connection`], for the application's effect; a nested
/// transaction on it is a savepoint (`Connection::savepoint`).
#[derive(Debug)]
pub struct RusqliteTransaction {
    turn: OwnedMutexGuard<Option<Connection>>,
    shared: Arc<Shared>,
}

impl RusqliteTransaction {
    /// Commits, then lets the next transaction in. When the `COMMIT` fails and leaves the
    /// transaction open, dropping `self` rolls it back.
    pub fn commit(self) -> Result<(), StoreError> {
        self.execute_batch("COMMIT").map_err(error)?;
        self.shared.checkpoints.after_commit(&self);
        Ok(())
    }
}

impl Deref for RusqliteTransaction {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.turn
            .as_ref()
            .expect("the writer is there while a transaction is")
    }
}

impl DerefMut for RusqliteTransaction {
    fn deref_mut(&mut self) -> &mut Connection {
        self.turn
            .as_mut()
            .expect("the writer is there while a transaction is")
    }
}

impl Drop for RusqliteTransaction {
    fn drop(&mut self) {
        roll_back_what_is_open(&mut self.turn);
    }
}

/// Rolls back a transaction left open on the writer; a writer that cannot is closed (which
/// rolls it back), and the next turn opens another.
fn roll_back_what_is_open(turn: &mut Option<Connection>) {
    if let Some(conn) = turn.as_ref()
        && !conn.is_autocommit()
        && conn.execute_batch("ROLLBACK").is_err()
    {
        *turn = None;
    }
}

/// A connection for statements that commit on their own, from [`Store::acquire`] (an idle
/// one of the store's) or [`Store::acquire_for_write`] (the writer, in its turn). It
/// dereferences to [`rusqlite::Connection`].
#[derive(Debug)]
pub struct RusqliteConnection(Autocommit);

#[derive(Debug)]
enum Autocommit {
    Idle(Option<Connection>, Arc<Shared>),
    /// The writer, with the store whose checkpointer counts what it committed.
    Writer(OwnedMutexGuard<Option<Connection>>, Arc<Shared>),
}

impl Deref for RusqliteConnection {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        match &self.0 {
            Autocommit::Idle(conn, _) => conn.as_ref(),
            Autocommit::Writer(turn, _) => turn.as_ref(),
        }
        .expect("the connection is there until dropped")
    }
}

impl DerefMut for RusqliteConnection {
    fn deref_mut(&mut self) -> &mut Connection {
        match &mut self.0 {
            Autocommit::Idle(conn, _) => conn.as_mut(),
            Autocommit::Writer(turn, _) => turn.as_mut(),
        }
        .expect("the connection is there until dropped")
    }
}

impl Drop for RusqliteConnection {
    fn drop(&mut self) {
        match &mut self.0 {
            Autocommit::Idle(conn, shared) => {
                if let Some(conn) = conn.take() {
                    shared.give_back(conn);
                }
            }
            Autocommit::Writer(turn, shared) => {
                roll_back_what_is_open(turn);
                // Its statements committed one by one; counted as one commit.
                if let Some(writer) = turn.as_ref() {
                    shared.checkpoints.after_commit(writer);
                }
            }
        }
    }
}

fn record(row: &rusqlite::Row<'_>) -> rusqlite::Result<RecordRow> {
    Ok(RecordRow {
        tenant: row.get("tenant")?,
        key_hash: row.get("key_hash")?,
        route: row.get("route")?,
        fingerprint: row.get("fingerprint")?,
        fingerprint_parts: row.get("fingerprint_parts")?,
        state: row.get("state")?,
        token: row.get("token")?,
        lease_expires_at: row.get("lease_expires_at")?,
        response_status: row.get("response_status")?,
        response_headers: row.get("response_headers")?,
        response_body: row.get("response_body")?,
        created_at: row.get("created_at")?,
        updated_at: row.get("updated_at")?,
        expires_at: row.get("expires_at")?,
        sealed_key: row.get("sealed_key")?,
        fingerprint_members: row.get("fingerprint_members")?,
        first_sent: row.get("first_sent")?,
    })
}

fn records(rows: Vec<RecordRow>) -> Result<Vec<Record>, StoreError> {
    rows.into_iter().map(Record::try_from).collect()
}

/// Runs `statement` with `params` and answers how many rows it changed.
pub(crate) fn changed(
    conn: &Connection,
    statement: &str,
    params: impl rusqlite::Params,
) -> Result<usize, StoreError> {
    conn.prepare_cached(statement)
        .and_then(|mut s| s.execute(params))
        .map_err(error)
}

/// Runs `statement` with `params` and answers whether it changed exactly one row.
fn changed_one(
    conn: &Connection,
    statement: &str,
    params: impl rusqlite::Params,
) -> Result<bool, StoreError> {
    Ok(changed(conn, statement, params)? == 1)
}

/// The claim's `INSERT … ON CONFLICT DO NOTHING RETURNING token`: `Some` when it inserted.
fn insert_row(conn: &Connection, r: &NewRecord) -> Result<Option<i64>, StoreError> {
    conn.prepare_cached(sql::INSERT)
        .and_then(|mut s| {
            s.query_row(
                params![
                    r.id.tenant,
                    &r.id.key_hash[..],
                    r.id.route,
                    &r.fingerprint.digest[..],
                    r.fingerprint.parts.to_bytes(),
                    r.state.as_str(),
                    r.lease_expires_at.map(Timestamp::as_millis),
                    r.now.as_millis(),
                    r.expires_at.as_millis(),
                    r.sealed_key.as_deref(),
                    r.fingerprint.members.as_ref().map(Members::to_bytes),
                    r.first_sent.map(Timestamp::as_millis),
                ],
                |row| row.get(0),
            )
            .optional()
        })
        .map_err(error)
}

/// The completion's `UPDATE`, guarded by the token: whether it matched its row.
fn complete_row(
    conn: &Connection,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> Result<bool, StoreError> {
    changed_one(
        conn,
        sql::COMPLETE,
        params![
            id.tenant,
            &id.key_hash[..],
            id.route,
            token,
            i32::from(response.status),
            response.encode_headers(),
            &response.body[..],
            now.as_millis(),
        ],
    )
}

impl Store for RusqliteStore {
    type Connection = Connection;
    type Transaction = RusqliteTransaction;
    type PooledConnection = RusqliteConnection;

    async fn begin(&self) -> Result<RusqliteTransaction, StoreError> {
        let mut turn = self.shared.turn().await?;
        let conn = turn.as_mut().expect("the turn opened the writer");
        if !conn.is_autocommit() {
            // Not left so by this store; closing it rolls back whatever is open on it.
            *turn = Some(self.shared.writer_connection()?);
        }
        turn.as_ref()
            .expect("the writer is open")
            .execute_batch("BEGIN IMMEDIATE")
            .map_err(error)?;
        Ok(RusqliteTransaction {
            turn,
            shared: self.shared.clone(),
        })
    }

    async fn commit(&self, tx: RusqliteTransaction) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn acquire(&self) -> Result<RusqliteConnection, StoreError> {
        let conn = self.shared.idle_connection()?;
        Ok(RusqliteConnection(Autocommit::Idle(
            Some(conn),
            self.shared.clone(),
        )))
    }

    /// Concurrent reservations are written in groups, in one transaction in one turn of the
    /// writer each, each answered once its group committed, as [`insert`](Store::insert)
    /// would have answered it alone (`idemkey_sqlx::group`).
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.shared.grouped.insert(self, record).await
    }

    /// Concurrent completions are written in groups, as reservations are.
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.shared
            .grouped
            .complete(self, id, token, response, now)
            .await
    }

    async fn acquire_for_write(&self) -> Result<RusqliteConnection, StoreError> {
        let turn = self.shared.turn().await?;
        Ok(RusqliteConnection(Autocommit::Writer(
            turn,
            self.shared.clone(),
        )))
    }

    async fn insert(&self, conn: &mut Connection, r: &NewRecord) -> Result<Inserted, StoreError> {
        // As `SqliteStore::insert`: in the claim's `BEGIN IMMEDIATE` transaction the row
        // the insert conflicted with is committed, and the read finds it.
        if insert_row(conn, r)?.is_some() {
            return Ok(Inserted::Owned);
        }
        Ok(match self.fetch(conn, &r.id).await? {
            Some(existing) => Inserted::Existing(Box::new(existing)),
            None => Inserted::Conflict,
        })
    }

    async fn fetch(
        &self,
        conn: &mut Connection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        conn.prepare_cached(sql::FETCH)
            .and_then(|mut s| {
                s.query_row(params![id.tenant, &id.key_hash[..], id.route], record)
                    .optional()
            })
            .map_err(error)?
            .map(Record::try_from)
            .transpose()
    }

    async fn replace(
        &self,
        conn: &mut Connection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        conn.prepare_cached(sql::REPLACE)
            .and_then(|mut s| {
                s.query_row(
                    params![
                        r.id.tenant,
                        &r.id.key_hash[..],
                        r.id.route,
                        &r.fingerprint.digest[..],
                        r.fingerprint.parts.to_bytes(),
                        r.state.as_str(),
                        r.lease_expires_at.map(Timestamp::as_millis),
                        r.now.as_millis(),
                        r.expires_at.as_millis(),
                        token,
                        r.sealed_key.as_deref(),
                        r.fingerprint.members.as_ref().map(Members::to_bytes),
                        r.first_sent.map(Timestamp::as_millis),
                    ],
                    |row| row.get(0),
                )
                .optional()
            })
            .map_err(error)
    }

    async fn complete(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        complete_row(conn, id, token, response, now)
    }

    async fn renew(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::RENEW,
            params![
                id.tenant,
                &id.key_hash[..],
                id.route,
                token,
                lease_until.as_millis(),
                now.as_millis()
            ],
        )
    }

    async fn mark_executing(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::MARK_EXECUTING,
            params![
                id.tenant,
                &id.key_hash[..],
                id.route,
                token,
                lease_until.as_millis(),
                now.as_millis()
            ],
        )
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::MARK_INDETERMINATE,
            params![
                id.tenant,
                &id.key_hash[..],
                id.route,
                token,
                now.as_millis()
            ],
        )
    }

    async fn release(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::RELEASE,
            params![id.tenant, &id.key_hash[..], id.route, token],
        )
    }

    async fn list(
        &self,
        conn: &mut Connection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = conn
            .prepare_cached(sql::LIST)
            .and_then(|mut s| {
                s.query_map(
                    params![
                        filter.tenant.as_deref(),
                        filter.state.map(|s| s.as_str()),
                        filter.created_before.map(Timestamp::as_millis),
                        filter.effective_limit(),
                    ],
                    record,
                )?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        records(rows)
    }

    async fn find_by_key(
        &self,
        conn: &mut Connection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let rows = conn
            .prepare_cached(sql::FIND_BY_KEY)
            .and_then(|mut s| {
                s.query_map(params![tenant, &key_hash[..]], record)?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        records(rows)
    }

    async fn evict(&self, conn: &mut Connection, id: &RecordId) -> Result<bool, StoreError> {
        changed_one(
            conn,
            sql::EVICT,
            params![id.tenant, &id.key_hash[..], id.route],
        )
    }

    async fn purge_batch(
        &self,
        conn: &mut Connection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        let gone = conn
            .prepare_cached(sql::PURGE_BATCH)
            .and_then(|mut s| {
                s.query_map(
                    params![
                        now.as_millis(),
                        from.map_or(i64::MIN, Timestamp::as_millis),
                        i64::from(batch)
                    ],
                    |row| row.get::<_, i64>(0),
                )?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        Ok(Purged {
            deleted: gone.len() as u64,
            through: gone.into_iter().max().map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut Connection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        conn.prepare_cached(sql::APPEND_AUDIT)
            .and_then(|mut s| {
                s.execute(params![
                    entry.id.tenant,
                    &entry.id.key_hash[..],
                    entry.id.route,
                    entry.at.as_millis(),
                    entry.actor,
                    entry.action,
                    entry.detail,
                ])
            })
            .map_err(error)?;
        Ok(())
    }

    async fn audit(
        &self,
        conn: &mut Connection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = conn
            .prepare_cached(sql::AUDIT)
            .and_then(|mut s| {
                s.query_map(params![id.tenant, &id.key_hash[..], id.route], |row| {
                    Ok(AuditRow {
                        tenant: row.get(0)?,
                        key_hash: row.get(1)?,
                        route: row.get(2)?,
                        at: row.get(3)?,
                        actor: row.get(4)?,
                        action: row.get(5)?,
                        detail: row.get(6)?,
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        rows.into_iter().map(AuditEntry::try_from).collect()
    }

    async fn notify_evicted(&self, conn: &mut Connection, id: &RecordId) -> Result<(), StoreError> {
        // As `SqliteStore::notify_evicted`, on the eviction's transaction: other processes
        // on the file read it once it commits.
        let now = Timestamp::now();
        conn.prepare_cached(sql::TRIM_EVICTIONS)
            .and_then(|mut s| s.execute(params![now.minus(EVICTION_KEPT).as_millis()]))
            .and_then(|_| conn.prepare_cached(sql::NOTE_EVICTION))
            .and_then(|mut s| s.execute(params![&id.digest()[..], now.as_millis()]))
            .map_err(error)?;
        Ok(())
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.clone()))
    }
}

/// Reads through an idle connection of the store's, outside the writer's turn.
impl Evictions for RusqliteStore {
    async fn newest(&self) -> Result<i64, StoreError> {
        self.with_connection(|c| c.query_row(evictions::NEWEST, [], |r| r.get(0)))
    }

    async fn after(&self, seq: i64) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        self.with_connection(|c| {
            c.prepare_cached(evictions::AFTER)?
                .query_map(params![seq], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })
    }
}

impl RusqliteStore {
    /// Runs `write` in one write transaction (one turn of the writer) and commits it; on an
    /// error nothing of it is committed.
    async fn in_one_transaction<T>(
        &self,
        write: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let tx = self.begin().await?;
        let written = write(&tx)?;
        tx.commit()?;
        Ok(written)
    }
}

/// A group is the writes one at a time, in one transaction: without a hand-off to share,
/// what the group saves is the commits.
impl GroupWriter for RusqliteStore {
    async fn insert_group(&self, records: Vec<NewRecord>) -> Vec<Result<Inserted, StoreError>> {
        let (rows, in_group) = group::plan(&records, |r| &r.id);
        let owned = self
            .in_one_transaction(|conn| {
                let mut owned = HashSet::new();
                for r in &rows {
                    if insert_row(conn, r)?.is_some() {
                        owned.insert(r.id.clone());
                    }
                }
                Ok(owned)
            })
            .await;
        let from_group = |r: &NewRecord| match &owned {
            Ok(owned) => Some(Ok(if owned.contains(&r.id) {
                Inserted::Owned
            } else {
                Inserted::Conflict
            })),
            Err(e) => busy_for_each(e, rows.len()).map(Err),
        };
        group::answer_each(&records, &in_group, from_group, |r| self.insert_alone(r)).await
    }

    async fn complete_group(&self, group: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        let (rows, in_group) = group::plan(&group, |c| &c.id);
        let completed = self
            .in_one_transaction(|conn| {
                let mut completed = HashSet::new();
                for c in &rows {
                    if complete_row(conn, &c.id, c.token, &c.response, c.now)? {
                        completed.insert(c.id.clone());
                    }
                }
                Ok(completed)
            })
            .await;
        let from_group = |c: &Completion| match &completed {
            Ok(completed) => Some(Ok(completed.contains(&c.id))),
            Err(e) => busy_for_each(e, rows.len()).map(Err),
        };
        group::answer_each(&group, &in_group, from_group, |c| self.complete_alone(c)).await
    }
}
