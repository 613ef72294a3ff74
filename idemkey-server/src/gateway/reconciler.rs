//! The reconciler: resolves operations whose outcome is unknown by asking the upstream.
//!
//! Every interval it lists the records whose outcome is unknown (indeterminate, or past the
//! point of no return with a lapsed lease, as [`decide`] says), unseals each key and GETs
//! the `--reconcile-url` template with `{key}` replaced by the percent-encoded key (the key
//! is also sent as `Idempotency-Key`):
//!
//! - 2xx: the operation happened; that answer (status, allowlisted headers, body) becomes the
//!   stored outcome, replayed to every retry;
//! - 404: it did not happen; the key is released and the next retry executes;
//! - anything else, or no answer: still unknown, asked again next time.
//!
//! Each resolution goes through [`protocol::resolve`], which raises the fencing token and
//! writes an audit entry with actor `reconciler`. Several gateways may reconcile at once:
//! the token lets only one resolve each record.

use std::time::Duration;

use idemkey_core::protocol::{self, Resolution};
use idemkey_core::{Decision, ListFilter, Record, RecordState, StoredResponse, Timestamp, decide};
use idemkey_tower::{Reconciled, stored_headers};

use super::Gateway;
use crate::AppDb;

/// Records looked at per state and round.
const BATCH: u32 = 100;

/// Runs [`reconcile_once`] every `every`, forever.
pub(super) async fn run<S: AppDb>(gw: Gateway<S>, template: String, every: Duration) {
    let client = match reqwest::Client::builder()
        .no_proxy()
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
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = reconcile_once(&gw, &client, &template).await {
            tracing::warn!(error = %e, "reconciliation round failed; will try again");
        }
    }
}

/// The records whose outcome is unknown now.
async fn unknown_records<S: AppDb>(gw: &Gateway<S>) -> anyhow::Result<Vec<Record>> {
    let now = Timestamp::now();
    let mut conn = gw.store.acquire().await?;
    let mut records = Vec::new();
    for state in [RecordState::Indeterminate, RecordState::Executing] {
        let filter = ListFilter {
            state: Some(state),
            limit: BATCH,
            ..ListFilter::default()
        };
        records.extend(gw.store.list(&mut conn, &filter).await?);
    }
    records.retain(|r| {
        matches!(
            decide(Some(r), &r.fingerprint, r.first_sent, now),
            Decision::OutcomeUnknown { .. }
        )
    });
    Ok(records)
}

fn encode(key: &str) -> String {
    form_urlencoded::byte_serialize(key.as_bytes()).collect()
}

/// One round: asks the upstream about every record whose outcome is unknown.
async fn reconcile_once<S: AppDb>(
    gw: &Gateway<S>,
    client: &reqwest::Client,
    template: &str,
) -> anyhow::Result<()> {
    for record in unknown_records(gw).await? {
        let key_id = record.id.key_id();
        // Sealed under the current secret, or (during a rotation) under the previous one.
        let Some(key) = record.sealed_key.as_deref().and_then(|sealed| {
            std::iter::once(&gw.sealer)
                .chain(&gw.previous_sealer)
                .find_map(|sealer| sealer.unseal(sealed, &record.id.key_hash))
        }) else {
            tracing::warn!(%key_id, "no sealed key (or sealed under another secret): only an operator can resolve it");
            gw.metrics.reconciled(Reconciled::StillUnknown);
            continue;
        };
        let url = template.replace("{key}", &encode(&key));
        let answer = async {
            let response = client
                .get(&url)
                .header(idemkey_core::HEADER_NAME, &key)
                .send()
                .await?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = response.bytes().await?;
            Ok::<_, reqwest::Error>((status, headers, body))
        }
        .await;
        let (resolution, what) = match answer {
            Ok((status, headers, body))
                if status.is_success() && body.len() <= gw.options().max_stored_response =>
            {
                let stored = StoredResponse {
                    status: status.as_u16(),
                    headers: stored_headers(&headers, &[]),
                    body: body.to_vec(),
                };
                (Resolution::Completed(stored), Reconciled::Completed)
            }
            Ok((status, _, _)) if status == http::StatusCode::NOT_FOUND => {
                (Resolution::Released, Reconciled::Released)
            }
            Ok((status, _, _)) => {
                tracing::info!(%key_id, %status, "the upstream does not know yet; still unknown");
                gw.metrics.reconciled(Reconciled::StillUnknown);
                continue;
            }
            Err(e) => {
                tracing::info!(%key_id, error = %e, "the upstream did not answer; still unknown");
                gw.metrics.reconciled(Reconciled::StillUnknown);
                continue;
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
    }
    Ok(())
}
