//! `idemkey keys …` and `idemkey migrate`: operator commands on either store.

use std::io::Write;

use anyhow::Context;
use idemkey_core::{IdempotencyKey, ListFilter, Record, RecordState, Scope, Timestamp, protocol};

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
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(t.as_millis().max(0) as u64);
    humantime::format_rfc3339_seconds(at).to_string()
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
            key: raw,
            ..
        } => {
            let hasher = key_hasher(&db, key_secret.as_deref()).await?;
            let key_hash = hasher.key_hash(&tenant, &key(&raw)?);
            let mut conn = db.acquire().await?;
            let records = db.find_by_key(&mut conn, &tenant, &key_hash).await?;
            if records.is_empty() {
                anyhow::bail!("no record for this key in tenant {tenant:?}");
            }
            for r in &records {
                writeln!(out, "{}", serde_json::to_string_pretty(&json(r, now))?)?;
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
            let (method, template) = route
                .split_once(' ')
                .context("--route must be METHOD and route template, e.g. \"POST /v1/payments\"")?;
            let id = hasher.record_id(&Scope::new(tenant, method, template), &key(&raw)?);
            let mut conn = db.acquire().await?;
            if db.evict(&mut conn, &id).await? {
                writeln!(out, "evicted {} ({})", id.key_id(), id.route)?;
            } else {
                anyhow::bail!("no record for this key on {}", id.route);
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
