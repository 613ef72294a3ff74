//! [`RusqliteStore`]'s construction: opening the file, its writer and idle connections, and
//! the writer's turn.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use idemkey_core::StoreError;
use idemkey_sqlx::group::GroupedWrites;
use rusqlite::{Connection, OpenFlags};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::SqliteStore;
use crate::checkpoint::Checkpoints;
use crate::rusqlite_store::error;
use crate::writer::WriterTimedOut;

/// How many idle read connections a store keeps for [`Store::acquire`].
///
/// [`Store::acquire`]: idemkey_core::Store::acquire
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
    pub(crate) shared: Arc<Shared>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) path: PathBuf,
    pub(crate) busy_timeout: Duration,
    /// Whether connections create the file and set WAL mode (not for an operator's
    /// command on an existing file).
    pub(crate) create: bool,
    /// The writer turn, with the writer connection (`None` until first used, and after a
    /// statement that ends a transaction failed).
    pub(crate) turn: Arc<Mutex<Option<Connection>>>,
    /// Idle connections for reads and autocommit statements.
    pub(crate) idle: StdMutex<Vec<Connection>>,
    /// External mode's reservations and completions, committed in groups (as
    /// `SqliteStore`'s): one transaction in one turn of the writer for each group.
    pub(crate) grouped: GroupedWrites,
    /// The WAL's checkpoints, out of the writer's turn (`checkpoint.rs`).
    pub(crate) checkpoints: Checkpoints,
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
            grouped: GroupedWrites::default(),
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
        let store = SqliteStore::open_file(&self.shared.path, self.shared.busy_timeout).await?;
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
    pub(crate) fn connection(&self) -> Result<Connection, StoreError> {
        connection(&self.path, self.busy_timeout, self.create)
    }

    pub(crate) fn writer_connection(&self) -> Result<Connection, StoreError> {
        writer_connection(&self.path, self.busy_timeout, self.create)
    }

    pub(crate) fn idle_connection(&self) -> Result<Connection, StoreError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            Some(conn) => Ok(conn),
            None => self.connection(),
        }
    }

    pub(crate) fn give_back(&self, conn: Connection) {
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
    pub(crate) async fn turn(
        self: &Arc<Self>,
    ) -> Result<OwnedMutexGuard<Option<Connection>>, StoreError> {
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
