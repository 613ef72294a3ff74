//! Evictions announced by other processes on the same file (an operator's `idemkey keys
//! evict`), followed by polling `idemkey_evictions`: SQLite has no `LISTEN`. Both SQLite
//! stores write the announcement on the eviction's transaction and follow the table with
//! [`follow`], each reading it through its own driver's adapter ([`Evictions`]).

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use idemkey_core::{EvictionNotice, EvictionNotices, StoreError};

use crate::driver::Driver;
use crate::params::Value;

/// How often a process looks for evictions another process announced (an operator's
/// `idemkey keys evict`): an evicted answer stops being replayed from memory within about
/// this long.
pub const EVICTION_POLL: Duration = Duration::from_millis(500);

/// How long announced evictions are kept for processes to read.
pub(crate) const EVICTION_KEPT: Duration = Duration::from_secs(24 * 3600);

/// The newest announced eviction's sequence number.
pub(crate) const NEWEST: &str = "SELECT COALESCE(MAX(seq), 0) FROM idemkey_evictions";

/// The announcements after `?1`, oldest first.
pub(crate) const AFTER: &str = "SELECT seq, record_digest FROM idemkey_evictions WHERE seq > ?1
  ORDER BY seq LIMIT 1000";

/// The newest sequence number (0 when there is none), read on `conn`.
pub(crate) async fn newest(conn: &mut impl Driver) -> Result<i64, StoreError> {
    let row: Option<(i64,)> = conn.fetch_optional(NEWEST, []).await?;
    Ok(row.map_or(0, |(seq,)| seq))
}

/// The sequence numbers and record digests after `seq`, oldest first, read on `conn`.
pub(crate) async fn after(
    conn: &mut impl Driver,
    seq: i64,
) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
    conn.fetch_all(AFTER, [Value::Int(seq)]).await
}

/// How a store lends a connection to read `idemkey_evictions` ([`newest`], [`after`]).
pub(crate) trait Evictions: Send + 'static {
    /// The newest sequence number (0 when there is none).
    fn newest(&self) -> impl Future<Output = Result<i64, StoreError>> + Send;
    /// The sequence numbers and record digests after `seq`, oldest first.
    fn after(
        &self,
        seq: i64,
    ) -> impl Future<Output = Result<Vec<(i64, Vec<u8>)>, StoreError>> + Send;
}

/// The notices for [`Store::eviction_notices`](idemkey_core::Store::eviction_notices):
/// `Listening` once the table has been read, then each eviction announced after that; `Lost`
/// when a read fails (the layer then empties its cache), and `Listening` again once a read
/// works.
pub(crate) fn follow(source: impl Evictions) -> EvictionNotices {
    let poll = Poll {
        source,
        last: None,
        pending: VecDeque::new(),
    };
    Box::pin(futures::stream::unfold(poll, |poll| async {
        Some(poll.next().await)
    }))
}

/// The newest sequence number seen, and the notices read but not handed out yet.
struct Poll<E> {
    source: E,
    /// `None` until the table has been read (and after a failed read).
    last: Option<i64>,
    pending: VecDeque<[u8; 32]>,
}

impl<E: Evictions> Poll<E> {
    async fn next(mut self) -> (EvictionNotice, Self) {
        loop {
            if let Some(digest) = self.pending.pop_front() {
                return (EvictionNotice::Evicted(digest), self);
            }
            let Some(last) = self.last else {
                match self.source.newest().await {
                    Ok(seq) => {
                        self.last = Some(seq);
                        return (EvictionNotice::Listening, self);
                    }
                    Err(_) => {
                        tokio::time::sleep(EVICTION_POLL).await;
                        continue;
                    }
                }
            };
            tokio::time::sleep(EVICTION_POLL).await;
            match self.source.after(last).await {
                Ok(rows) => {
                    for (seq, digest) in rows {
                        self.last = Some(seq);
                        if let Ok(digest) = <[u8; 32]>::try_from(digest.as_slice()) {
                            self.pending.push_back(digest);
                        }
                    }
                }
                Err(_) => {
                    self.last = None;
                    return (EvictionNotice::Lost, self);
                }
            }
        }
    }
}
