//! Eviction notices: how a store tells in-process caches that a record was removed by
//! another process (an operator's `idemkey keys evict`).
//!
//! A completed record does not change until it expires, so a layer may keep it in memory
//! and replay it without the database. The only way such a record goes away early is an
//! operator's eviction; a store that can announce evictions to every process (PostgreSQL's
//! `LISTEN`/`NOTIFY`) implements [`Store::eviction_notices`](crate::Store::eviction_notices)
//! and [`StoreAdmin::notify_evicted`](crate::StoreAdmin::notify_evicted). A store that cannot leaves
//! both at their defaults, and caches bound the life of their entries instead.

use std::pin::Pin;

use futures_core::Stream;

/// One notice on a store's eviction channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictionNotice {
    /// The record whose [`RecordId::digest`](crate::RecordId::digest) this is was removed.
    Evicted([u8; 32]),
    /// Notices flow from now on: every later eviction is announced. Anything cached before
    /// may have missed one.
    Listening,
    /// The channel was lost (connection closed); notices may be missed until the next
    /// [`Listening`](Self::Listening).
    Lost,
}

/// The stream of [`EvictionNotice`]s a store hands out. It never ends on its own while the
/// store is usable: after a [`Lost`](EvictionNotice::Lost) it reconnects and says
/// [`Listening`](EvictionNotice::Listening) again.
pub type EvictionNotices = Pin<Box<dyn Stream<Item = EvictionNotice> + Send + 'static>>;
