//! The reconciler: resolves operations whose outcome is unknown by asking the upstream.
//!
//! Every interval it lists the records whose outcome is unknown (indeterminate, or past the
//! point of no return with a lapsed lease, as [`decide`] says), oldest first, unseals each
//! key and GETs the `--reconcile-url` template with `{key}` and `{tenant}` replaced by the
//! percent-encoded key and tenant; the key is also sent as `Idempotency-Key` and the tenant
//! as `Idemkey-Tenant`, so the upstream answers for that tenant's operation only:
//!
//! - 2xx: the operation happened; that answer (status, the headers the record's route stores
//!   on a normal completion, body up to `--max-stored-response`) becomes the stored outcome,
//!   replayed to every retry;
//! - 404: it did not happen; the key is released and the next retry executes;
//! - anything else, a larger body, or no answer: still unknown, asked again later.
//!
//! That rule is [`reconciled`] (a larger body: [`answer_not_captured`]), beside the layer's
//! own decision after the effect.
//!
//! A record still unknown waits before it is asked again: the interval, doubled after each
//! answer that settles nothing, up to ten minutes. A round asks about at most [`BATCH`]
//! records, the oldest due first, so records the upstream cannot settle neither starve an
//! older one nor fill every round.
//!
//! Each resolution goes through [`protocol::resolve`], which raises the fencing token and
//! writes an audit entry with actor `reconciler`. Several gateways may reconcile at once:
//! the token lets only one resolve each record. Logs name a record by its key id, never by
//! its raw key (nor by the reconcile URL, which holds it).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::protocol::{self, Resolution};
use idemkey_core::{
    AfterEffect, Clock, Decision, ListFilter, Progress, Record, RecordState, StoredResponse,
    Timestamp, answer_not_captured, decide, reconciled,
};

use super::Gateway;
use super::GatewayDb;
use super::metrics::Reconciled;

/// Records asked about per round, at most.
const BATCH: usize = 100;

/// Records read per page of the listing.
const PAGE: u32 = 100;

/// The longest wait before a record still unknown is asked about again.
const MAX_BACKOFF: Duration = Duration::from_secs(600);

/// The header that tells the upstream whose operation the reconciler asks about.
const TENANT_HEADER: &str = "idemkey-tenant";

/// When each record still unknown is asked about next.
#[derive(Debug, Default)]
struct Backoff {
    /// Record digest → (next time it is due, the wait that led there).
    next: HashMap<[u8; 32], (Timestamp, Duration)>,
}

impl Backoff {
    /// Whether `record` may be asked about at `now`.
    fn due(&self, record: &[u8; 32], now: Timestamp) -> bool {
        self.next.get(record).is_none_or(|(at, _)| *at <= now)
    }

    /// `record` is still unknown after an answer at `now`: it waits `first`, then twice as
    /// long each time, up to [`MAX_BACKOFF`].
    fn unsettled(&mut self, record: [u8; 32], now: Timestamp, first: Duration) {
        let wait = self
            .next
            .get(&record)
            .map_or(first, |(_, wait)| wait.saturating_mul(2))
            .min(MAX_BACKOFF);
        self.next.insert(record, (now.plus(wait), wait));
    }

    /// Forgets every record but `unknown` (settled, expired or gone).
    fn keep_only(&mut self, unknown: &HashSet<[u8; 32]>) {
        self.next.retain(|record, _| unknown.contains(record));
    }
}

/// The reconciler of one gateway.
struct Reconciler<S> {
    gw: Gateway<S>,
    client: reqwest::Client,
    template: String,
    every: Duration,
    clock: Arc<dyn Clock>,
    backoff: Backoff,
}

/// Runs a round every `every`, forever, on `clock`'s time.
pub(super) async fn run<S: GatewayDb>(
    gw: Gateway<S>,
    template: String,
    every: Duration,
    clock: Arc<dyn Clock>,
) {
    let client = match reqwest::Client::builder()
        .no_proxy()
        // A connection of its own per question: an extra answer on a kept one would be
        // taken for the next question's, another tenant's maybe, and settle it.
        .pool_max_idle_per_host(0)
        .timeout(gw.options().upstream_timeout)
        .connect_timeout(gw.options().connect_timeout)
        .build()
    {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the reconciler's HTTP client");
            return;
        }
    };
    let every = every.max(Duration::from_millis(100));
    let mut reconciler = Reconciler {
        gw,
        client,
        template,
        every,
        clock,
        backoff: Backoff::default(),
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = reconciler.round().await {
            tracing::warn!(error = %e, "reconciliation round failed; will try again");
        }
    }
}

/// Every record whose outcome is unknown at `now`, oldest first.
async fn unknown_records<S: GatewayDb>(
    gw: &Gateway<S>,
    now: Timestamp,
) -> anyhow::Result<Vec<Record>> {
    let mut conn = gw.store.acquire().await?;
    let mut seen = HashSet::new();
    let mut records = Vec::new();
    for state in [RecordState::Indeterminate, RecordState::Executing] {
        // Newest first, page by page: each page starts at the oldest creation time of the
        // one before, included (others may share that millisecond), its records already
        // seen skipped; a page that brings nothing new moves past that millisecond.
        let mut before: Option<Timestamp> = None;
        loop {
            let filter = ListFilter {
                state: Some(state),
                created_before: before,
                limit: PAGE,
                ..ListFilter::default()
            };
            let page = gw.store.list(&mut conn, &filter).await?;
            let Some(oldest) = page.last().map(|r| r.created_at) else {
                break;
            };
            let full = page.len() == PAGE as usize;
            let mut fresh = false;
            for record in page {
                if seen.insert(record.id.digest()) {
                    fresh = true;
                    records.push(record);
                }
            }
            if !full {
                break;
            }
            let inclusive = Some(oldest.plus(Duration::from_millis(1)));
            before = if fresh && inclusive != before {
                inclusive
            } else {
                Some(oldest)
            };
        }
    }
    records.retain(|r| {
        matches!(
            decide(Some(r), &r.fingerprint, r.first_sent, now),
            Decision::OutcomeUnknown { .. }
        )
    });
    records.sort_by_key(|r| (r.created_at, r.id.digest()));
    Ok(records)
}

/// `s` percent-encoded for a path segment or a query value.
fn encode(s: &str) -> String {
    // `byte_serialize` writes a space as `+`, which a path reads as itself.
    form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

/// What the upstream said about one record.
enum Answer {
    /// A 2xx within the size bound.
    Happened(StoredResponse),
    /// A 404.
    DidNotHappen,
    /// Anything else: why it settles nothing.
    Unsettled(String),
}

/// Reads `response`'s body, stopping past `max` bytes (`None` then).
async fn read_bounded(
    mut response: reqwest::Response,
    max: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if response.content_length().is_some_and(|n| n > max as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > max {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

impl<S: GatewayDb> Reconciler<S> {
    /// One round: asks the upstream about the oldest records whose outcome is unknown and
    /// that are due.
    async fn round(&mut self) -> anyhow::Result<()> {
        let now = self.clock.now();
        let records = unknown_records(&self.gw, now).await?;
        let unknown: HashSet<[u8; 32]> = records.iter().map(|r| r.id.digest()).collect();
        self.backoff.keep_only(&unknown);
        let due: Vec<Record> = records
            .into_iter()
            .filter(|r| self.backoff.due(&r.id.digest(), now))
            .take(BATCH)
            .collect();
        for record in due {
            self.reconcile(&record).await?;
        }
        Ok(())
    }

    /// Asks the upstream about `record` and resolves it when the answer settles it.
    async fn reconcile(&mut self, record: &Record) -> anyhow::Result<()> {
        let gw = &self.gw;
        let key_id = record.id.key_id();
        // Sealed under the current secret, or (during a rotation) under the previous one.
        let Some(key) = record.sealed_key.as_deref().and_then(|sealed| {
            std::iter::once(&gw.sealer)
                .chain(&gw.previous_sealer)
                .find_map(|sealer| sealer.unseal(sealed, &record.id.key_hash))
        }) else {
            tracing::warn!(%key_id, "no sealed key (or sealed under another secret): only an operator can resolve it");
            self.unsettled(record);
            return Ok(());
        };
        let (resolution, what) = match self.ask(record, &key).await {
            Answer::Happened(stored) => (Resolution::Completed(stored), Reconciled::Completed),
            Answer::DidNotHappen => (Resolution::Released, Reconciled::Released),
            Answer::Unsettled(why) => {
                tracing::info!(%key_id, route = %record.id.route, "{why}; still unknown");
                self.unsettled(record);
                return Ok(());
            }
        };
        let note = match &resolution {
            Resolution::Completed(r) => {
                format!("upstream answered {} to the reconcile URL", r.status)
            }
            Resolution::Released => "upstream answered 404 to the reconcile URL".to_owned(),
        };
        match protocol::resolve(
            &gw.store,
            &record.id,
            &resolution,
            "reconciler",
            Some(&note),
            self.clock.now(),
        )
        .await
        {
            Ok(_) => {
                tracing::info!(%key_id, route = %record.id.route, ?what, "resolved an unknown outcome");
                gw.metrics.reconciled(what);
            }
            Err(
                protocol::Error::Fenced
                | protocol::Error::NotIndeterminate(_)
                | protocol::Error::NotFound,
            ) => {
                // Someone else (the owner, another gateway, an operator) resolved it first.
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Asks the reconcile URL about `key` of `record`'s tenant.
    async fn ask(&self, record: &Record, key: &str) -> Answer {
        let tenant = &record.id.tenant;
        let Ok(tenant_value) = http::HeaderValue::from_str(tenant) else {
            return Answer::Unsettled("the tenant cannot be sent as a header".to_owned());
        };
        let url = self
            .template
            .replace("{tenant}", &encode(tenant))
            .replace("{key}", &encode(key));
        let max = self.gw.options().max_stored_response;
        let answer = async {
            let response = self
                .client
                .get(&url)
                .header(idemkey_core::HEADER_NAME, key)
                .header(TENANT_HEADER, tenant_value)
                .send()
                .await?;
            let status = response.status();
            let headers = response.headers().clone();
            let effect = reconciled(status.as_u16());
            let body = if effect == AfterEffect::Complete {
                read_bounded(response, max).await?
            } else {
                None
            };
            Ok::<_, reqwest::Error>((status, effect, headers, body))
        }
        .await;
        match answer {
            Ok((status, AfterEffect::Complete, headers, Some(body))) => {
                Answer::Happened(StoredResponse {
                    status: status.as_u16(),
                    headers: self.gw.stored_headers(&record.id.route, &headers),
                    body,
                })
            }
            Ok((status, AfterEffect::Complete, _, None)) => {
                match answer_not_captured(Progress::Answered(status.as_u16())) {
                    AfterEffect::Release => Answer::DidNotHappen,
                    AfterEffect::Complete | AfterEffect::Indeterminate => {
                        Answer::Unsettled(format!(
                            "the upstream answered {status} with a body over \
                             --max-stored-response"
                        ))
                    }
                }
            }
            Ok((_, AfterEffect::Release, _, _)) => Answer::DidNotHappen,
            Ok((status, AfterEffect::Indeterminate, _, _)) => Answer::Unsettled(format!(
                "the upstream answered {status}, so it does not know yet"
            )),
            // The error's URL holds the raw key: it is left out.
            Err(e) => {
                Answer::Unsettled(format!("the upstream did not answer ({})", e.without_url()))
            }
        }
    }

    /// Counts `record` as still unknown and puts off its next question.
    fn unsettled(&mut self, record: &Record) {
        self.gw.metrics.reconciled(Reconciled::StillUnknown);
        self.backoff
            .unsettled(record.id.digest(), self.clock.now(), self.every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsettled_records_wait_longer_each_time_up_to_the_bound() {
        let mut backoff = Backoff::default();
        let (a, b) = ([1; 32], [2; 32]);
        let start = Timestamp(1_000_000);
        let every = Duration::from_secs(5);
        assert!(backoff.due(&a, start), "asked at once the first time");
        backoff.unsettled(a, start, every);
        assert!(!backoff.due(&a, start.plus(Duration::from_millis(4_999))));
        assert!(backoff.due(&a, start.plus(every)));
        assert!(backoff.due(&b, start), "each record has its own wait");
        let mut now = start.plus(every);
        let mut waits = Vec::new();
        for _ in 0..10 {
            backoff.unsettled(a, now, every);
            let (at, wait) = backoff.next[&a];
            assert_eq!(at, now.plus(wait));
            waits.push(wait.as_secs());
            now = at;
        }
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 600, 600, 600, 600]);
        backoff.keep_only(&HashSet::from([b]));
        assert!(backoff.due(&a, start), "a settled record is forgotten");
    }

    #[test]
    fn keys_and_tenants_are_encoded_for_paths_and_queries() {
        assert_eq!(encode("a b+c/d?e&f"), "a%20b%2Bc%2Fd%3Fe%26f");
        assert_eq!(encode("{tenant}"), "%7Btenant%7D");
    }
}
