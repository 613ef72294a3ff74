//! External mode's grouped writes on a [`RusqliteStore`]: [`GroupWriter`], one transaction
//! per group.

use std::collections::HashSet;

use idemkey_core::{Inserted, NewRecord, Store, StoreError};
use idemkey_sqlx::group::{self, Completion, GroupWriter};
use rusqlite::Connection;

use crate::RusqliteStore;
use crate::group::busy_for_each;
use crate::rusqlite_store::{complete_row, insert_row};

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
