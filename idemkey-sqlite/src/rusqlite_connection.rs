//! The connections a [`RusqliteStore`](crate::RusqliteStore) hands out: a write transaction in the writer's turn,
//! and a connection for statements that commit on their own.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use idemkey_core::StoreError;
use rusqlite::Connection;
use tokio::sync::OwnedMutexGuard;

use crate::rusqlite_open::Shared;
use crate::rusqlite_store::error;

/// A write transaction on a [`RusqliteStore`] (`BEGIN IMMEDIATE`): it holds SQLite's write
/// lock and the store's writer turn until it commits or is dropped, which rolls it back.
/// It dereferences to [`rusqlite::Connection`], for the application's effect; a nested
/// transaction on it is a savepoint (`Connection::savepoint`).
///
/// [`RusqliteStore`]: crate::RusqliteStore
#[derive(Debug)]
pub struct RusqliteTransaction {
    pub(crate) turn: OwnedMutexGuard<Option<Connection>>,
    pub(crate) shared: Arc<Shared>,
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
pub(crate) fn roll_back_what_is_open(turn: &mut Option<Connection>) {
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
///
/// [`Store::acquire`]: idemkey_core::Store::acquire
/// [`Store::acquire_for_write`]: idemkey_core::Store::acquire_for_write
#[derive(Debug)]
pub struct RusqliteConnection(pub(crate) IdleOrWriter);

#[derive(Debug)]
pub(crate) enum IdleOrWriter {
    Idle(Option<Connection>, Arc<Shared>),
    /// The writer, with the store whose checkpointer counts what it committed.
    Writer(OwnedMutexGuard<Option<Connection>>, Arc<Shared>),
}

impl Deref for RusqliteConnection {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        match &self.0 {
            IdleOrWriter::Idle(conn, _) => conn.as_ref(),
            IdleOrWriter::Writer(turn, _) => turn.as_ref(),
        }
        .expect("the connection is there until dropped")
    }
}

impl DerefMut for RusqliteConnection {
    fn deref_mut(&mut self) -> &mut Connection {
        match &mut self.0 {
            IdleOrWriter::Idle(conn, _) => conn.as_mut(),
            IdleOrWriter::Writer(turn, _) => turn.as_mut(),
        }
        .expect("the connection is there until dropped")
    }
}

impl Drop for RusqliteConnection {
    fn drop(&mut self) {
        match &mut self.0 {
            IdleOrWriter::Idle(conn, shared) => {
                if let Some(conn) = conn.take() {
                    shared.give_back(conn);
                }
            }
            IdleOrWriter::Writer(turn, shared) => {
                roll_back_what_is_open(turn);
                // Its statements committed one by one; counted as one commit.
                if let Some(writer) = turn.as_ref() {
                    shared.checkpoints.after_commit(writer);
                }
            }
        }
    }
}
