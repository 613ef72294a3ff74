//! The replay cache: completed records kept in memory, so a retry is answered without the
//! database.
//!
//! A completed record does not change until it expires; the only way it goes away early is
//! an operator's eviction. So an entry is checked exactly like a stored record, by core's
//! [`decide`] on a [`Record`] built from it (same fingerprint and not expired: replay; a
//! different fingerprint: the same 422), and it is trusted:
//!
//! - until the record expires, while the store's eviction notices flow
//!   ([`Store::eviction_notices`]: PostgreSQL's `LISTEN`, SQLite's poll of
//!   `idemkey_evictions`); a notice drops the entry, a lost channel drops every entry;
//! - at most [`UNNOTIFIED_BOUND`] otherwise (before notices flow, while the channel is down,
//!   or on a store without one): then the store is asked again.
//!
//! Bounded in entries and bytes; when full, the oldest entry of a shard goes first.
//!
//! A fill races an eviction: the record may be read, then evicted and its notice applied,
//! then cached. Every request therefore takes a ticket (the count of invalidations so far)
//! before it reads the store, and a fill whose ticket is older than the last invalidation is
//! dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures::StreamExt;
use idemkey_core::protocol::ClaimOutcome;
use idemkey_core::{
    Decision, EvictionNotice, Fingerprint, Members, Record, RecordId, RecordState, Store,
    StoredResponse, Timestamp, decide,
};
use tokio::sync::watch;

/// How long an entry is trusted when the store announces no evictions (SQLite, or a
/// PostgreSQL listener that is not connected): an operator's `idemkey keys evict` stops
/// replays from memory after at most this long.
pub const UNNOTIFIED_BOUND: Duration = Duration::from_secs(5);

/// What a request notes before it reads the store, so that its fill can be judged: the
/// count of invalidations so far, and whether eviction notices were flowing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Ticket {
    generation: u64,
    notified: bool,
}

/// The replay cache's bound on entries unless
/// [`IdempotencyLayer::replay_cache`](crate::IdempotencyLayer::replay_cache) sets another:
/// 100 000.
pub const DEFAULT_ENTRIES: usize = 100_000;

/// The replay cache's bound on bytes (bodies, headers and bookkeeping), whatever its entries:
/// 64 MiB.
pub const DEFAULT_BYTES: usize = 64 * 1024 * 1024;

/// What an entry costs beyond its variable parts (the map slots, the record's fixed fields).
const ENTRY_OVERHEAD: usize = 256;

/// The most shards; fewer for small capacities, so the bounds stay close to what was asked.
const MAX_SHARDS: usize = 16;

/// A completed record as cached.
#[derive(Debug)]
struct Entry {
    record: Record,
    /// After this the entry is not trusted (the record's expiry, or the unnotified bound).
    trusted_until: Timestamp,
}

#[derive(Debug)]
struct Slot {
    seq: u64,
    bytes: usize,
    entry: Arc<Entry>,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<[u8; 32], Slot>,
    /// Insertion order: the oldest first.
    order: BTreeMap<u64, [u8; 32]>,
    bytes: usize,
}

impl Shard {
    fn remove(&mut self, digest: &[u8; 32]) -> Option<Slot> {
        let slot = self.map.remove(digest)?;
        self.order.remove(&slot.seq);
        self.bytes -= slot.bytes;
        Some(slot)
    }

    fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
        self.bytes = 0;
    }
}

/// A bounded, sharded, in-process cache of completed records.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    shards: Box<[Mutex<Shard>]>,
    entries_per_shard: usize,
    bytes_per_shard: usize,
    seq: AtomicU64,
    /// Invalidations applied so far; a fill carries the value it read before the store.
    generation: AtomicU64,
    /// Told after each invalidation is applied (for tests and health checks).
    changed: watch::Sender<u64>,
    /// Whether the store's eviction notices are flowing right now.
    notified: AtomicBool,
    /// Whether the store's notices are followed (or known not to exist).
    following: AtomicBool,
}

impl ReplayCache {
    /// A cache of at most `entries` entries and `bytes` bytes.
    pub(crate) fn new(entries: usize, bytes: usize) -> Self {
        let entries = entries.max(1);
        let shards = (entries / 256).clamp(1, MAX_SHARDS);
        Self {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            entries_per_shard: entries.div_ceil(shards),
            bytes_per_shard: bytes / shards,
            seq: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            changed: watch::Sender::new(0),
            notified: AtomicBool::new(false),
            following: AtomicBool::new(false),
        }
    }

    fn shard(&self, digest: &[u8; 32]) -> MutexGuard<'_, Shard> {
        let i = usize::from(digest[0]) % self.shards.len();
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts following `store`'s eviction notices, once per cache, on a task of its own
    /// that ends with the cache (at the next notice after it is dropped).
    pub(crate) fn follow<S: Store>(self: &Arc<Self>, store: &S) {
        if self.following.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(mut notices) = store.eviction_notices() else {
            return;
        };
        let cache: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(notice) = notices.next().await {
                let Some(cache) = cache.upgrade() else { return };
                cache.apply(notice);
            }
        });
    }

    /// Applies one eviction notice.
    pub(crate) fn apply(&self, notice: EvictionNotice) {
        match notice {
            EvictionNotice::Evicted(digest) => {
                // The generation moves before anything is removed: a fill that read the store
                // before this notice is refused, whether it comes before or after the removal.
                self.generation.fetch_add(1, Ordering::AcqRel);
                self.shard(&digest).remove(&digest);
            }
            // Notices flow from now on. What was cached before is bounded already (it was
            // filled on a ticket taken while not notified), so nothing is dropped.
            EvictionNotice::Listening => self.notified.store(true, Ordering::Release),
            EvictionNotice::Lost => {
                // Entries trusted past the bound may miss a notice from now on.
                self.notified.store(false, Ordering::Release);
                self.generation.fetch_add(1, Ordering::AcqRel);
                for shard in self.shards.iter() {
                    shard.lock().unwrap_or_else(|e| e.into_inner()).clear();
                }
            }
        }
        self.changed.send_modify(|n| *n += 1);
    }

    /// A receiver told after every invalidation the cache applied.
    #[cfg(feature = "test-util")]
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The ticket a request takes before it reads the store.
    ///
    /// (See [`Ticket`].)
    pub(crate) fn ticket(&self) -> Ticket {
        Ticket {
            generation: self.generation.load(Ordering::Acquire),
            notified: self.notified.load(Ordering::Acquire),
        }
    }

    /// The answer the cached record of `id` gives to a request with `fingerprint` and
    /// `first_sent` at `now`, by [`decide`]: a replay or a mismatch. `None`: ask the store (nothing cached, or the
    /// entry expired or is no longer trusted; it is dropped).
    pub(crate) fn answer(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        first_sent: Option<Timestamp>,
        now: Timestamp,
    ) -> Option<ClaimOutcome> {
        let digest = id.digest();
        let entry = {
            let shard = self.shard(&digest);
            let slot = shard.map.get(&digest)?;
            if slot.entry.record.id != *id {
                return None;
            }
            slot.entry.clone()
        };
        let expires_at = entry.record.expires_at;
        let answer = if entry.trusted_until <= now {
            None
        } else {
            match decide(Some(&entry.record), fingerprint, first_sent, now) {
                Decision::Replay(response) => Some(ClaimOutcome::Replay {
                    response: response.clone(),
                    expires_at,
                    first_sent: entry.record.first_sent,
                }),
                Decision::Mismatch(mismatch) => Some(ClaimOutcome::Mismatch {
                    mismatch,
                    expires_at,
                }),
                // Expired (or anything but a completed record's answers): the store decides.
                _ => None,
            }
        };
        if answer.is_none() {
            let mut shard = self.shard(&digest);
            if shard
                .map
                .get(&digest)
                .is_some_and(|slot| Arc::ptr_eq(&slot.entry, &entry))
            {
                shard.remove(&digest);
            }
        }
        answer
    }

    /// Caches the completed record `id`: claimed by `fingerprint` stating `first_sent`,
    /// answering `response`
    /// until `expires_at`. Dropped when an invalidation came after `ticket`, or when the
    /// entry alone is larger than a shard may hold.
    #[allow(clippy::too_many_arguments)] // the parts of the record it keeps, one by one
    pub(crate) fn insert(
        &self,
        ticket: Ticket,
        id: &RecordId,
        fingerprint: &Fingerprint,
        first_sent: Option<Timestamp>,
        response: &StoredResponse,
        expires_at: Timestamp,
        now: Timestamp,
    ) {
        let bytes = ENTRY_OVERHEAD
            + id.tenant.len()
            + id.route.len()
            + response.body.len()
            + response
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len() + 32)
                .sum::<usize>()
            + fingerprint
                .members
                .as_ref()
                .map_or(0, |m| 16 * m.digests().len());
        if bytes > self.bytes_per_shard || expires_at <= now {
            return;
        }
        // Trusted past the bound only if notices flowed since before the store was read.
        let trusted_until = if ticket.notified && self.notified.load(Ordering::Acquire) {
            expires_at
        } else {
            expires_at.min(now.plus(UNNOTIFIED_BOUND))
        };
        let record = Record {
            id: id.clone(),
            fingerprint: Fingerprint {
                digest: fingerprint.digest,
                parts: fingerprint.parts,
                // What a record keeps: the member digests, not the request's pointers.
                members: (fingerprint.members.as_ref())
                    .and_then(|m| Members::from_bytes(&m.to_bytes())),
            },
            state: RecordState::Completed,
            token: 0,
            lease_expires_at: None,
            response: Some(response.clone()),
            created_at: now,
            updated_at: now,
            expires_at,
            sealed_key: None,
            first_sent,
        };
        let digest = id.digest();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut shard = self.shard(&digest);
        // Checked under the shard's lock: an invalidation moves the generation before it
        // takes this lock, so it either refuses this fill or removes it afterwards.
        if self.generation.load(Ordering::Acquire) != ticket.generation {
            return;
        }
        shard.remove(&digest);
        while shard.map.len() >= self.entries_per_shard
            || shard.bytes + bytes > self.bytes_per_shard
        {
            let Some((_, oldest)) = shard.order.pop_first() else {
                break;
            };
            if let Some(slot) = shard.map.remove(&oldest) {
                shard.bytes -= slot.bytes;
            }
        }
        shard.order.insert(seq, digest);
        shard.bytes += bytes;
        shard.map.insert(
            digest,
            Slot {
                seq,
                bytes,
                entry: Arc::new(Entry {
                    record,
                    trusted_until,
                }),
            },
        );
    }

    /// How many entries are cached.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).map.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use idemkey_core::{FingerprintSpec, KeyHasher, RequestParts, Scope, fingerprint};

    use super::*;

    fn id(key: &str) -> RecordId {
        let key = idemkey_core::IdempotencyKey::parse(key.as_bytes()).unwrap();
        KeyHasher::new(b"s").record_id(&Scope::new("t", "POST", "/p"), &key)
    }

    fn fp(body: &str) -> Fingerprint {
        fingerprint(
            &RequestParts {
                method: "POST",
                route: "/p",
                path_params: &[],
                query: None,
                content_type: Some("application/json"),
                body: body.as_bytes(),
            },
            &FingerprintSpec::default(),
        )
    }

    fn response(body: &str) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: body.as_bytes().to_vec(),
        }
    }

    const T0: Timestamp = Timestamp(1_000_000);

    #[test]
    fn replays_until_the_bound_without_notices() {
        let cache = ReplayCache::new(10, 1 << 20);
        let expires = T0.plus(Duration::from_secs(3600));
        cache.insert(
            cache.ticket(),
            &id("a"),
            &fp("{\"x\":1}"),
            None,
            &response("ok"),
            expires,
            T0,
        );
        let hit = cache.answer(&id("a"), &fp("{\"x\":1.0}"), None, T0);
        assert!(
            matches!(hit, Some(ClaimOutcome::Replay { ref response, expires_at, .. }) if response.body == b"ok" && expires_at == expires)
        );
        assert!(matches!(
            cache.answer(&id("a"), &fp("{\"x\":2}"), None, T0),
            Some(ClaimOutcome::Mismatch { ref mismatch, .. }) if mismatch.pointer.as_deref() == Some("/x")
        ));
        assert!(cache.answer(&id("b"), &fp("{\"x\":1}"), None, T0).is_none());
        assert!(
            cache
                .answer(&id("a"), &fp("{\"x\":1}"), None, T0.plus(UNNOTIFIED_BOUND))
                .is_none()
        );
        assert_eq!(cache.len(), 0, "an untrusted entry is dropped");
    }

    #[test]
    fn notified_entries_live_until_expiry_and_notices_drop_them() {
        let cache = ReplayCache::new(10, 1 << 20);
        cache.apply(EvictionNotice::Listening);
        let expires = T0.plus(Duration::from_secs(3600));
        cache.insert(
            cache.ticket(),
            &id("a"),
            &fp("{}"),
            None,
            &response("ok"),
            expires,
            T0,
        );
        let later = T0.plus(Duration::from_secs(600));
        assert!(cache.answer(&id("a"), &fp("{}"), None, later).is_some());
        assert!(
            cache.answer(&id("a"), &fp("{}"), None, expires).is_none(),
            "expired"
        );
        cache.insert(
            cache.ticket(),
            &id("a"),
            &fp("{}"),
            None,
            &response("ok"),
            expires,
            T0,
        );
        cache.apply(EvictionNotice::Evicted(id("a").digest()));
        assert!(cache.answer(&id("a"), &fp("{}"), None, later).is_none());
    }

    #[test]
    fn a_fill_that_read_before_an_invalidation_is_dropped() {
        let cache = ReplayCache::new(10, 1 << 20);
        let ticket = cache.ticket();
        cache.apply(EvictionNotice::Evicted(id("a").digest()));
        let expires = T0.plus(Duration::from_secs(3600));
        cache.insert(
            ticket,
            &id("a"),
            &fp("{}"),
            None,
            &response("ok"),
            expires,
            T0,
        );
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn evicts_the_oldest_past_the_bounds() {
        let cache = ReplayCache::new(2, 1 << 20);
        let expires = T0.plus(Duration::from_secs(3600));
        for key in ["a", "b", "c"] {
            cache.insert(
                cache.ticket(),
                &id(key),
                &fp("{}"),
                None,
                &response("ok"),
                expires,
                T0,
            );
        }
        assert_eq!(cache.len(), 2);
        assert!(cache.answer(&id("a"), &fp("{}"), None, T0).is_none());
        assert!(cache.answer(&id("c"), &fp("{}"), None, T0).is_some());
        let small = ReplayCache::new(100, 2 * ENTRY_OVERHEAD + 64);
        for key in ["a", "b", "c"] {
            small.insert(
                small.ticket(),
                &id(key),
                &fp("{}"),
                None,
                &response("ok"),
                expires,
                T0,
            );
        }
        assert!(small.len() < 3, "the byte bound holds");
        small.insert(
            small.ticket(),
            &id("d"),
            &fp("{}"),
            None,
            &response(&"x".repeat(4096)),
            expires,
            T0,
        );
        assert!(
            small.answer(&id("d"), &fp("{}"), None, T0).is_none(),
            "too large to cache"
        );
    }
}
