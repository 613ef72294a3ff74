//! Eviction notices: the `LISTEN` on [`EVICTION_CHANNEL`], its probe, and its reconnects.

use std::time::Duration;

use idemkey_core::{EvictionNotice, EvictionNotices};
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};

use crate::literal;

/// The `LISTEN` channel of eviction notices; the payload is the hex of the evicted
/// record's [`RecordId::digest`](idemkey_core::RecordId::digest).
pub const EVICTION_CHANNEL: &str = "idemkey_evict";

/// The longest pause between two attempts to (re)connect the eviction listener.
const MAX_LISTEN_BACKOFF: Duration = Duration::from_secs(5);

/// How long a new listener waits for its own probe notice before it concludes that
/// notices do not reach it.
const PROBE_WAIT: Duration = Duration::from_secs(2);

/// The pause before a listener that missed its probe tries again.
const PROBE_RETRY: Duration = Duration::from_secs(60);

/// The eviction listener's state: its own one-connection pool (the listener holds its
/// connection for good, so it never takes one of the application's), the store's pool (for
/// the probe), the listener once connected, how many connects failed in a row, and whether
/// the last listener missed its probe.
struct Follow {
    pool: PgPool,
    probe: PgPool,
    listener: Option<PgListener>,
    failures: u32,
    missed_probe: bool,
}

/// The eviction notices of the database `pool` connects to, from a listener of their own
/// (on a one-connection pool with `pool`'s options) that `pool` probes.
pub(crate) fn follow(pool: &PgPool) -> EvictionNotices {
    let options = pool.connect_options().as_ref().clone();
    let follow = Follow {
        pool: PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .connect_lazy_with(options),
        probe: pool.clone(),
        listener: None,
        failures: 0,
        missed_probe: false,
    };
    Box::pin(futures::stream::unfold(follow, |follow| async {
        Some(follow.next().await)
    }))
}

/// Why a listener was not started.
pub(crate) enum NotListening {
    Failed,
    /// `LISTEN` went through but the probe notice never came: the connection does not keep
    /// its session between statements (a pooler in transaction mode).
    MissedProbe,
}

impl From<sqlx::Error> for NotListening {
    fn from(_: sqlx::Error) -> Self {
        Self::Failed
    }
}

impl Follow {
    async fn next(mut self) -> (EvictionNotice, Self) {
        loop {
            let Some(listener) = self.listener.as_mut() else {
                if self.missed_probe {
                    tokio::time::sleep(PROBE_RETRY).await;
                } else if self.failures > 0 {
                    let pause = Duration::from_millis(100) * 2u32.pow(self.failures.min(6));
                    tokio::time::sleep(pause.min(MAX_LISTEN_BACKOFF)).await;
                }
                match listen(&self.pool, &self.probe).await {
                    Ok(listener) => {
                        self.listener = Some(listener);
                        self.failures = 0;
                        self.missed_probe = false;
                        return (EvictionNotice::Listening, self);
                    }
                    Err(NotListening::MissedProbe) => {
                        self.missed_probe = true;
                        continue;
                    }
                    Err(NotListening::Failed) => {
                        self.failures += 1;
                        continue;
                    }
                }
            };
            match listener.try_recv().await {
                Ok(Some(notice)) => {
                    let mut digest = [0u8; 32];
                    if hex::decode_to_slice(notice.payload(), &mut digest).is_ok() {
                        return (EvictionNotice::Evicted(digest), self);
                    }
                    // Not ours (someone else's payload on the channel): nothing to drop.
                }
                // The connection was lost (None) or failed: notices may have been missed.
                Ok(None) | Err(_) => {
                    self.listener = None;
                    self.failures = 1;
                    return (EvictionNotice::Lost, self);
                }
            }
        }
    }
}

/// A listener on [`EVICTION_CHANNEL`] that has received its own probe: a notice sent on
/// `probe` (another connection) after the `LISTEN`. Behind a pooler in transaction mode the
/// `LISTEN` holds on a server connection the listener no longer has once the statement is
/// done, so the probe never comes; the listener is then refused rather than reported
/// listening, and the cache keeps bounding its entries as without notices.
pub(crate) async fn listen(pool: &PgPool, probe: &PgPool) -> Result<PgListener, NotListening> {
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut listener = PgListener::connect_with(pool).await?;
    // A lost connection is reported at once; the next round connects afresh.
    listener.eager_reconnect(false);
    listener.listen(EVICTION_CHANNEL).await?;
    // Not hex: every other listener ignores it.
    let payload = format!(
        "probe {} {}",
        std::process::id(),
        PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    // From here on a failure may mean that the `LISTEN` went to a pooler's server
    // connection (its notices then reach whichever client holds it, the probe's sender
    // among them): retried only after a long pause.
    let sent = literal::query("SELECT pg_notify($1, $2)")
        .bind(EVICTION_CHANNEL)
        .bind(&payload)
        .execute(probe)
        .await;
    if sent.is_err() {
        return Err(NotListening::MissedProbe);
    }
    let probed = tokio::time::timeout(PROBE_WAIT, async {
        // Evictions announced before the probe are not passed on: the cache trusts
        // nothing it cached before it hears `Listening`.
        while let Some(notice) = listener.try_recv().await? {
            if notice.payload() == payload {
                return Ok(true);
            }
        }
        Ok::<_, sqlx::Error>(false)
    })
    .await;

    match probed {
        Ok(Ok(true)) => Ok(listener),
        // The connection was lost: connect again soon.
        Ok(Ok(false) | Err(_)) => Err(NotListening::Failed),
        Err(_) => {
            tracing::warn!(
                "eviction notices do not reach this connection (a pooler in transaction \
                 mode?): cached answers are trusted for a bounded time only"
            );
            Err(NotListening::MissedProbe)
        }
    }
}
