//! The store's rules, as the stores' SQL makes them (`idemkey-sqlite/src/sql.rs`,
//! `idemkey-postgres/src/statements.rs`, `idemkey-mysql/src/sql.rs`), stated once. The model
//! cannot call SQL; each rule names the conformance test (`idemkey-testkit/src/conformance/`,
//! run against SQLite, PostgreSQL and MariaDB) that holds the real stores to it.

use idemkey_core::RecordState;

use crate::state::{Body, Rec, State};
use crate::{InsertToken, Resolver};

/// Whom a deletion of the record is by, for `no_release_after_send_without_truth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Releaser {
    /// An owner whose own request was answered with a status the rule releases.
    OwnerAfterRefusal,
    /// An owner for any other reason (nothing sent, or a decision that releases).
    Owner,
    /// The reconciler or an operator, after the look-up said "not found".
    Truth(Resolver),
    /// The reconciler or an operator, for any other reason.
    Resolver(Resolver),
}

impl State {
    /// The claim: `INSERT … ON CONFLICT DO NOTHING`. One claim wins: it inserts only where
    /// there is no row (held to it by
    /// `conformance::races::one_of_64_concurrent_claims_owns_the_key`). Its token is one no
    /// earlier claim of the key held ([`InsertToken::Fresh`], as every store writes it,
    /// whether the key is new or its record was deleted: held to it by
    /// `conformance::external::claim_anew_after_release_fences_the_earlier_owner` and
    /// `idemkey-sqlite/tests/token_rules.rs`), or always 1 ([`InsertToken::One`], the rule
    /// shown to let a stale owner write on a claim anew).
    pub(crate) fn insert(
        &mut self,
        body: Body,
        state: RecordState,
        tokens: InsertToken,
    ) -> Option<(u8, i64)> {
        if self.record.is_some() {
            return None;
        }
        let generation = self.next_generation();
        // A fresh token stands for a random one: far from every token an earlier claim held,
        // or reached by raising one.
        let token = match tokens {
            InsertToken::Fresh => i64::from(generation) * 1_000 + 1,
            InsertToken::One => 1,
        };
        self.record = Some(fresh(body, state, token, generation));
        Some((generation, token))
    }

    /// The takeover: `UPDATE … SET token = token + 1 … WHERE token = ?`. Held to it by
    /// `conformance::external::takeover_before_point_of_no_return_fences_the_stale_owner`.
    pub(crate) fn replace(
        &mut self,
        token: i64,
        body: Body,
        state: RecordState,
    ) -> Option<(u8, i64)> {
        if self.record.as_ref()?.token != token {
            return None;
        }
        let generation = self.next_generation();
        self.record = Some(fresh(body, state, token + 1, generation));
        Some((generation, token + 1))
    }

    /// Every write an owner makes carries its token and changes nothing unless the record
    /// still carries it (`… WHERE token = ?`): renew, mark executing, complete (which raises
    /// the token), mark indeterminate (which keeps it), release (`DELETE`). Held to it by
    /// `conformance::external::takeover_before_point_of_no_return_fences_the_stale_owner`
    /// and `conformance::failed_owners::stale_token_cannot_complete`.
    ///
    /// Returns whether the write matched. A write that matched a record another claim made
    /// (`generation` is not the record's) is a breach of `stale_owner_inert`.
    pub(crate) fn owned_write(
        &mut self,
        token: i64,
        generation: u8,
        write: impl FnOnce(&mut Rec),
    ) -> bool {
        let Some(rec) = self.record.as_mut().filter(|r| r.token == token) else {
            return false;
        };
        if rec.generation != generation {
            self.breaches.stale_write = true;
        }
        write(rec);
        true
    }

    /// Complete: state `completed`, the answer stored, the lease cleared, the token raised.
    pub(crate) fn complete(rec: &mut Rec, response: (u16, Option<u8>)) {
        rec.state = RecordState::Completed;
        rec.response = Some(response);
        rec.token += 1;
        rec.lease_live = false;
    }

    /// Mark indeterminate: state `indeterminate`, the lease cleared, the token kept.
    pub(crate) fn mark_indeterminate(rec: &mut Rec) {
        rec.state = RecordState::Indeterminate;
        rec.lease_live = false;
    }

    /// Deletes the record (a release, matched by token by the caller, or a resolution),
    /// noting a breach when its request left and `by` does not know that nothing was done.
    pub(crate) fn delete(&mut self, by: Releaser, generation: Option<u8>) {
        if let Some(rec) = self.record.take() {
            let knows = match by {
                Releaser::Truth(_) => true,
                Releaser::OwnerAfterRefusal => generation == Some(rec.generation),
                Releaser::Owner | Releaser::Resolver(_) => false,
            };
            if rec.sent && !knows {
                self.breaches.release_without_truth = true;
            }
        }
    }

    fn next_generation(&mut self) -> u8 {
        self.generations += 1;
        self.generations
    }
}

fn fresh(body: Body, state: RecordState, token: i64, generation: u8) -> Rec {
    Rec {
        body,
        state,
        token,
        generation,
        lease_live: true,
        expired: false,
        response: None,
        sent: false,
    }
}
