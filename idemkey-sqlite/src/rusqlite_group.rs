//! How a [`RusqliteStore`] writes a group ([`WritesGroups`]): the rows one at a time, in one
//! transaction. Without a hand-off to share, what the group saves is the commits.

use std::collections::HashSet;

use idemkey_core::{NewRecord, RecordId, Store, StoreError};
use idemkey_sqlx::group::{Completion, GroupedWrites};

use crate::group::WritesGroups;
use crate::{RusqliteStore, statements};

impl WritesGroups for RusqliteStore {
    fn grouped(&self) -> &GroupedWrites {
        &self.shared.grouped
    }

    async fn write_inserts(&self, rows: &[&NewRecord]) -> Result<HashSet<RecordId>, StoreError> {
        let mut tx = self.begin().await?;
        let mut owned = HashSet::new();
        for r in rows {
            if statements::insert_row(&mut *tx, r).await? {
                owned.insert(r.id.clone());
            }
        }
        tx.commit()?;
        Ok(owned)
    }

    async fn write_completions(
        &self,
        rows: &[&Completion],
    ) -> Result<HashSet<RecordId>, StoreError> {
        let mut tx = self.begin().await?;
        let mut completed = HashSet::new();
        for c in rows {
            if statements::complete(&mut *tx, &c.id, c.token, &c.response, c.now).await? {
                completed.insert(c.id.clone());
            }
        }
        tx.commit()?;
        Ok(completed)
    }
}
