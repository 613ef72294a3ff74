//! `idemkey keys …` and `idemkey migrate`: operator commands on either store.

use std::io::Write;

use anyhow::Context;
use idemkey_core::protocol::Resolution;
use idemkey_core::{
    AuditEntry, IdempotencyKey, KeyHasher, ListFilter, Record, RecordId, RecordState, Scope,
    StoredResponse, Timestamp, protocol,
};

use crate::AppDb;
use crate::cli::{KeysCommand, StateArg};
use crate::serve::key_hasher;

fn state(s: StateArg) -> RecordState {
    match s {
        StateArg::Reserved => RecordState::Reserved,
        StateArg::Executing => RecordState::Executing,
        StateArg::Completed => RecordState::Completed,
        StateArg::Indeterminate => RecordState::Indeterminate,
    }
}

fn time(t: Timestamp) -> String {
    humantime::format_rfc3339_seconds(t.to_system_time()).to_string()
}

fn key(raw: &str) -> anyhow::Result<IdempotencyKey> {
    IdempotencyKey::parse(raw.as_bytes()).map_err(|e| anyhow::anyhow!("invalid key: {e}"))
}

fn json(r: &Record, now: Timestamp) -> serde_json::Value {
    serde_json::json!({
        "key_id": r.id.key_id(),
        "tenant": r.id.tenant,
        "route": r.id.route,
        "state": r.state.as_str(),
        "expired": r.is_expired(now),
        "token": r.token,
        "created_at": time(r.created_at),
        "updated_at": time(r.updated_at),
        "expires_at": time(r.expires_at),
        "lease_expires_at": r.lease_expires_at.map(time),
        "response_status": r.response.as_ref().map(|resp| resp.status),
        "response_bytes": r.response.as_ref().map(|resp| resp.body.len()),
    })
}

/// The record identity of `key` for `tenant` on `route` ("METHOD /route/template").
fn record_id(
    hasher: &KeyHasher,
    tenant: &str,
    route: &str,
    key: &IdempotencyKey,
) -> anyhow::Result<RecordId> {
    let (method, template) = route
        .split_once(' ')
        .context("--route must be METHOD and route template, e.g. \"POST /v1/payments\"")?;
    Ok(hasher.record_id(&Scope::new(tenant, method, template), key))
}

/// `post /v1/x` → `POST /v1/x`, as [`Scope::new`] writes routes.
fn normalize(route: &str) -> String {
    match route.split_once(' ') {
        Some((method, template)) => Scope::new("", method, template).route,
        None => route.to_owned(),
    }
}

fn audit_json(e: &AuditEntry) -> serde_json::Value {
    serde_json::json!({
        "at": time(e.at),
        "actor": e.actor,
        "action": e.action,
        "detail": e.detail,
    })
}

fn print_table(out: &mut impl Write, records: &[Record], now: Timestamp) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<16}  {:<12}  {:<22}  {:<13}  {:>6}  {:<20}  {:<20}",
        "KEY ID", "TENANT", "ROUTE", "STATE", "STATUS", "CREATED", "EXPIRES"
    )?;
    for r in records {
        let st = if r.is_expired(now) {
            format!("{} (expired)", r.state)
        } else {
            r.state.to_string()
        };
        writeln!(
            out,
            "{:<16}  {:<12}  {:<22}  {:<13}  {:>6}  {:<20}  {:<20}",
            r.id.key_id(),
            r.id.tenant,
            r.id.route,
            st,
            r.response
                .as_ref()
                .map_or("-".to_owned(), |resp| resp.status.to_string()),
            time(r.created_at),
            time(r.expires_at),
        )?;
    }
    writeln!(
        out,
        "({} record{})",
        records.len(),
        if records.len() == 1 { "" } else { "s" }
    )
}

/// Runs one `keys` command against `db`, writing to `out`.
pub async fn run<S: AppDb>(
    db: S,
    command: KeysCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    db.migrate_all().await.context("migrations failed")?;
    let now = Timestamp::now();
    match command {
        KeysCommand::List {
            tenant,
            state: st,
            older_than,
            limit,
            json: as_json,
            ..
        } => {
            let filter = ListFilter {
                tenant,
                state: st.map(state),
                created_before: older_than.map(|d| now.minus(d)),
                limit,
            };
            let mut conn = db.acquire().await?;
            let records = db.list(&mut conn, &filter).await?;
            if as_json {
                for r in &records {
                    writeln!(out, "{}", json(r, now))?;
                }
            } else {
                print_table(out, &records, now)?;
            }
        }
        KeysCommand::Show {
            key_secret,
            tenant,
            route,
            key: raw,
            ..
        } => {
            let hasher = key_hasher(&db, key_secret.as_deref()).await?;
            let key = key(&raw)?;
            let key_hash = hasher.key_hash(&tenant, &key);
            let mut conn = db.acquire().await?;
            let records = db.find_by_key(&mut conn, &tenant, &key_hash).await?;
            // The audit trail of a route outlives its record (a released key).
            let gone = match &route {
                Some(route) if !records.iter().any(|r| r.id.route == normalize(route)) => {
                    let id = record_id(&hasher, &tenant, route, &key)?;
                    let trail = db.audit(&mut conn, &id).await?;
                    (!trail.is_empty()).then_some((id, trail))
                }
                _ => None,
            };
            if records.is_empty() && gone.is_none() {
                anyhow::bail!("no record for this key in tenant {tenant:?}");
            }
            for r in &records {
                let mut view = json(r, now);
                let trail = db.audit(&mut conn, &r.id).await?;
                view["audit"] = trail.iter().map(audit_json).collect();
                writeln!(out, "{}", serde_json::to_string_pretty(&view)?)?;
            }
            if let Some((id, trail)) = gone {
                let view = serde_json::json!({
                    "key_id": id.key_id(),
                    "tenant": id.tenant,
                    "route": id.route,
                    "state": "none (no record: released, evicted or purged)",
                    "audit": trail.iter().map(audit_json).collect::<Vec<_>>(),
                });
                writeln!(out, "{}", serde_json::to_string_pretty(&view)?)?;
            }
        }
        KeysCommand::Evict {
            key_secret,
            tenant,
            route,
            key: raw,
            ..
        } => {
            let hasher = key_hasher(&db, key_secret.as_deref()).await?;
            let id = record_id(&hasher, &tenant, &route, &key(&raw)?)?;
            let mut conn = db.acquire().await?;
            if db.evict(&mut conn, &id).await? {
                writeln!(out, "evicted {} ({})", id.key_id(), id.route)?;
            } else {
                anyhow::bail!("no record for this key on {}", id.route);
            }
        }
        KeysCommand::Resolve {
            key_secret,
            tenant,
            route,
            completed,
            status,
            body,
            content_type,
            note,
            key: raw,
            ..
        } => {
            let hasher = key_hasher(&db, key_secret.as_deref()).await?;
            let id = record_id(&hasher, &tenant, &route, &key(&raw)?)?;
            let resolution = if completed {
                let status = status.context("--completed needs --status")?;
                if !(100..=599).contains(&status) {
                    anyhow::bail!("--status {status} is not an HTTP status");
                }
                let headers = if body.is_empty() {
                    Vec::new()
                } else {
                    vec![("content-type".to_owned(), content_type.into_bytes())]
                };
                Resolution::Completed(StoredResponse {
                    status,
                    headers,
                    body: body.into_bytes(),
                })
            } else {
                Resolution::Released
            };
            let actor = format!(
                "operator:{}",
                std::env::var("USER")
                    .ok()
                    .filter(|u| !u.is_empty())
                    .unwrap_or_else(|| "unknown".to_owned())
            );
            match protocol::resolve(&db, &id, &resolution, &actor, note.as_deref()).await {
                Ok(before) => match resolution {
                    Resolution::Completed(r) => writeln!(
                        out,
                        "resolved {} ({}): was {}, now completed with status {}; retries replay it",
                        id.key_id(),
                        id.route,
                        before.state,
                        r.status
                    )?,
                    Resolution::Released => writeln!(
                        out,
                        "resolved {} ({}): was {}, now released; the next retry executes",
                        id.key_id(),
                        id.route,
                        before.state
                    )?,
                },
                Err(protocol::Error::NotFound) => {
                    anyhow::bail!(
                        "no record for this key on {} in tenant {:?}",
                        id.route,
                        id.tenant
                    )
                }
                Err(e @ protocol::Error::NotIndeterminate(_)) => {
                    anyhow::bail!("cannot resolve {} ({}): {e}", id.key_id(), id.route)
                }
                Err(protocol::Error::Fenced) => anyhow::bail!(
                    "the record changed while it was being resolved (its owner or the reconciler resolved it); look again with `idemkey keys show`"
                ),
                Err(e) => return Err(e.into()),
            }
        }
        KeysCommand::Purge { batch, .. } => {
            let n = protocol::purge_expired(&db, now, batch).await?;
            writeln!(
                out,
                "purged {n} expired record{}",
                if n == 1 { "" } else { "s" }
            )?;
        }
    }
    Ok(())
}
