//! The relay: claims due messages, delivers them, records the outcome.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use idemkey_core::outbox::{Message, OutboxStore};
use idemkey_core::{Clock, StoreError, Timestamp};
use idemkey_tower::SystemClock;
use rand::Rng;
use tokio::sync::{Notify, watch};

use crate::metrics::Delivery;
use crate::{OutboxMetrics, Sink};

/// Exponential backoff between attempts, with jitter: attempt `n` (from 1) that failed waits
/// a random time between half and all of `min(first × 2ⁿ⁻¹, max)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failure, before jitter.
    pub first: Duration,
    /// The longest wait, before jitter.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max: Duration::from_secs(600),
        }
    }
}

impl Backoff {
    /// The wait after `attempts` failed attempts, before jitter.
    pub fn ceiling(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// The wait after `attempts` failed attempts, jittered.
    pub fn delay(&self, attempts: u32) -> Duration {
        let ceiling = self.ceiling(attempts);
        ceiling.mul_f64(rand::thread_rng().gen_range(0.5..=1.0))
    }
}

/// How a relay works.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// Names this relay in claims (`claimed_by`); unique per relay.
    pub name: String,
    /// Messages claimed per round.
    pub batch: u32,
    /// Deliveries in progress at once (each holds a database connection while it writes its
    /// outcome).
    pub concurrency: usize,
    /// How long a claim holds; a relay that dies mid-delivery leaves its messages to others
    /// after this. Must exceed `delivery_timeout`.
    pub claim: Duration,
    /// How long one delivery may take before it counts as failed.
    pub delivery_timeout: Duration,
    /// Attempts before a message is dead.
    pub max_attempts: u32,
    /// Waits between attempts.
    pub backoff: Backoff,
    /// How long the relay sleeps when nothing is due (a [`RelayTask::wake`] cuts it short).
    pub poll: Duration,
    /// How long sent messages are kept before they are deleted.
    pub keep_sent: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        let mut suffix = [0u8; 4];
        rand::thread_rng().fill(&mut suffix);
        Self {
            name: format!("relay-{}-{}", std::process::id(), hex::encode(suffix)),
            batch: 64,
            concurrency: 16,
            claim: Duration::from_secs(60),
            delivery_timeout: Duration::from_secs(15),
            max_attempts: 12,
            backoff: Backoff::default(),
            poll: Duration::from_millis(250),
            keep_sent: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

impl RelayConfig {
    /// The longest time from a message's first delivery attempt to the end of its last one,
    /// while relays and the database are up: between attempts `k` and `k + 1`, the longer of
    /// a delivery time-out plus the backoff ceiling after attempt `k` and a claim (a relay that
    /// died mid-delivery), plus a poll; then the last attempt's delivery time-out. A
    /// destination that drops redeliveries only within a window (JetStream's duplicate
    /// window) drops all of them when its window is at least this long.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemkey_outbox::{Backoff, RelayConfig};
    /// let config = RelayConfig {
    ///     max_attempts: 3,
    ///     claim: Duration::from_secs(6),
    ///     delivery_timeout: Duration::from_secs(2),
    ///     backoff: Backoff { first: Duration::from_secs(1), max: Duration::from_secs(8) },
    ///     poll: Duration::ZERO,
    ///     ..RelayConfig::default()
    /// };
    /// // max(2 + 1, 6) + max(2 + 2, 6) + 2
    /// assert_eq!(config.redelivery_horizon(), Duration::from_secs(14));
    /// ```
    pub fn redelivery_horizon(&self) -> Duration {
        (1..self.max_attempts)
            .map(|k| (self.delivery_timeout + self.backoff.ceiling(k)).max(self.claim) + self.poll)
            .fold(self.delivery_timeout, Duration::saturating_add)
    }
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// Messages claimed.
    pub claimed: usize,
    /// Acknowledged by the sink and marked sent.
    pub sent: usize,
    /// Failed; due again later.
    pub failed: usize,
    /// Failed for the last time.
    pub dead: usize,
    /// Delivered, but the claim had passed to another relay before the outcome was written
    /// (the delivery took longer than the claim).
    pub lost_claims: usize,
}

/// Delivers an outbox's messages to a [`Sink`], at least once each.
///
/// ```no_run
/// # async fn run(store: idemkey_sqlite::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// use idemkey_outbox::{Relay, WebhookSink};
/// let relay = Relay::new(store, WebhookSink::new("http://127.0.0.1:9000/hooks")?);
/// let task = relay.spawn(); // delivers until `task` is dropped
/// # drop(task); Ok(()) }
/// ```
#[derive(Debug)]
pub struct Relay<S, K> {
    store: S,
    sink: Arc<K>,
    config: RelayConfig,
    metrics: OutboxMetrics,
    clock: Arc<dyn Clock>,
}

impl<S: OutboxStore, K: Sink> Relay<S, K> {
    /// A relay of `store`'s outbox to `sink`, with the default [`RelayConfig`].
    pub fn new(store: S, sink: K) -> Self {
        Self {
            store,
            sink: Arc::new(sink),
            config: RelayConfig::default(),
            metrics: OutboxMetrics::new(),
            clock: Arc::new(SystemClock),
        }
    }

    /// Replaces the configuration.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Counts into `metrics` (shared with the server's `/metrics`).
    pub fn metrics(mut self, metrics: OutboxMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Reads the time from `clock`.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// One round: claims up to a batch of due messages, delivers them, up to
    /// [`RelayConfig::concurrency`] at once (each group's first pending message only, so a
    /// group's order holds), and writes each outcome.
    pub async fn run_once(&self) -> Result<Round, StoreError> {
        let now = self.clock.now();
        let claimed = {
            let mut conn = self.store.acquire().await?;
            self.store
                .claim_due(
                    &mut conn,
                    &self.config.name,
                    now,
                    now.plus(self.config.claim),
                    self.config.batch,
                )
                .await?
        };
        let mut round = Round {
            claimed: claimed.len(),
            ..Round::default()
        };
        let deliveries = claimed.into_iter().map(|message| async move {
            let outcome =
                tokio::time::timeout(self.config.delivery_timeout, self.sink.deliver(&message))
                    .await
                    .unwrap_or_else(|_| {
                        Err(crate::DeliveryError(format!(
                            "no acknowledgement within {:?}",
                            self.config.delivery_timeout
                        )))
                    });
            let written = self.write_outcome(&message, outcome).await;
            (message, written)
        });
        let finished: Vec<_> = futures::stream::iter(deliveries)
            .buffer_unordered(self.config.concurrency.max(1))
            .collect()
            .await;
        for (message, written) in finished {
            match written {
                Ok((delivery, true)) => {
                    self.metrics.delivery(delivery);
                    match delivery {
                        Delivery::Acknowledged => round.sent += 1,
                        Delivery::Failed => round.failed += 1,
                        Delivery::Dead => round.dead += 1,
                    }
                }
                Ok((_, false)) => {
                    round.lost_claims += 1;
                    tracing::warn!(
                        message = %message.id,
                        "the claim on a message passed to another relay during its delivery"
                    );
                }
                Err(e) => {
                    // The claim runs out and the message is delivered again: at least once.
                    tracing::warn!(message = %message.id, error = %e, "recording a delivery failed");
                }
            }
        }
        Ok(round)
    }

    /// Writes what became of a delivery; `false` when the claim was no longer ours.
    async fn write_outcome(
        &self,
        message: &Message,
        outcome: Result<(), crate::DeliveryError>,
    ) -> Result<(Delivery, bool), StoreError> {
        let now = self.clock.now();
        let mut conn = self.store.acquire().await?;
        let name = &self.config.name;
        match outcome {
            Ok(()) => {
                let mine = self
                    .store
                    .mark_sent(&mut conn, &message.id, name, now)
                    .await?;
                Ok((Delivery::Acknowledged, mine))
            }
            Err(e) => {
                let (delivery, next) = if message.attempts >= self.config.max_attempts {
                    (Delivery::Dead, None)
                } else {
                    let wait = self.config.backoff.delay(message.attempts);
                    (Delivery::Failed, Some(now.plus(wait)))
                };
                tracing::info!(
                    message = %message.id,
                    attempts = message.attempts,
                    dead = next.is_none(),
                    error = %e,
                    "outbox delivery failed"
                );
                let mine = self
                    .store
                    .mark_failed(&mut conn, &message.id, name, next, &e.0)
                    .await?;
                Ok((delivery, mine))
            }
        }
    }

    /// Reads the outbox's sizes into the metrics, and deletes sent messages older than
    /// [`RelayConfig::keep_sent`] (one batch).
    pub async fn housekeeping(&self) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut conn = self.store.acquire().await?;
        let stats = self.store.outbox_stats(&mut conn).await?;
        self.metrics.observe(stats, now);
        self.store
            .purge_sent(&mut conn, now.minus(self.config.keep_sent), 1000)
            .await?;
        Ok(())
    }

    /// Runs rounds until the returned task is dropped or shut down: at once while rounds
    /// find a full batch, otherwise after [`RelayConfig::poll`] or a
    /// [`wake`](RelayTask::wake). A failing store is retried after the poll interval.
    pub fn spawn(self) -> RelayTask {
        if self.config.claim <= self.config.delivery_timeout {
            tracing::warn!(
                claim = ?self.config.claim,
                delivery_timeout = ?self.config.delivery_timeout,
                "the relay's claim does not outlast a delivery: another relay may deliver the same message at the same time"
            );
        }
        let wake = Arc::new(Notify::new());
        let (report, rounds) = watch::channel(Round::default());
        let (stop_tx, mut stop) = watch::channel(false);
        let woken = wake.clone();
        let task = tokio::spawn(async move {
            let mut last_housekeeping: Option<Timestamp> = None;
            loop {
                let now = self.clock.now();
                if last_housekeeping.is_none_or(|t| t.until(now) >= Duration::from_secs(5)) {
                    last_housekeeping = Some(now);
                    if let Err(e) = self.housekeeping().await {
                        tracing::warn!(error = %e, "outbox housekeeping failed");
                    }
                }
                let full = match self.run_once().await {
                    Ok(round) => {
                        let full = round.claimed as u32 >= self.config.batch;
                        report.send_modify(|total| {
                            total.claimed += round.claimed;
                            total.sent += round.sent;
                            total.failed += round.failed;
                            total.dead += round.dead;
                            total.lost_claims += round.lost_claims;
                        });
                        full
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox relay round failed; will try again");
                        false
                    }
                };
                if *stop.borrow() {
                    break;
                }
                if !full {
                    tokio::select! {
                        () = woken.notified() => {}
                        () = tokio::time::sleep(self.config.poll) => {}
                        _ = stop.changed() => break,
                    }
                }
            }
        });
        RelayTask {
            task: Some(task),
            wake,
            rounds,
            stop: stop_tx,
        }
    }
}

/// A running [`Relay`]; it stops when dropped.
#[derive(Debug)]
#[must_use = "the relay stops when its handle is dropped"]
pub struct RelayTask {
    task: Option<tokio::task::JoinHandle<()>>,
    wake: Arc<Notify>,
    rounds: watch::Receiver<Round>,
    stop: watch::Sender<bool>,
}

impl RelayTask {
    /// Starts the next round now (after an enqueue, say) instead of after the poll interval.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// The totals of every round so far; `changed()` waits for the next round.
    pub fn rounds(&self) -> watch::Receiver<Round> {
        self.rounds.clone()
    }

    /// Finishes the round in progress (its deliveries and their outcomes), then stops.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for RelayTask {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
