//! `idemkey keys …`: operator commands on either store. They open an existing database
//! ([`open_existing`](crate::open_existing)) and an existing key secret, and create neither.
//! They need only idemkey's tables ([`GatewayDb`]): the database may be an application's own
//! that ran idemkey's migrations and nothing of the reference server's.

use std::io::Write;

use anyhow::Context;
use idemkey_core::protocol::Resolution;
use idemkey_core::{
    AuditEntry, IdempotencyKey, KeyHasher, ListFilter, Record, RecordId, RecordState, Scope,
    StoredResponse, Timestamp, protocol,
};

use crate::gateway::GatewayDb;
use crate::secret::{KeySecretSource, KeySecrets, SecretUse, key_secrets};

/// An operator's command on the idempotency records (`idemkey keys …`).
#[derive(Debug, Clone)]
pub enum KeysAction {
    /// List records, newest first.
    List {
        /// Only this tenant's.
        tenant: Option<String>,
        /// Only records in this state.
        state: Option<RecordState>,
        /// Only records created longer ago than this.
        older_than: Option<std::time::Duration>,
        /// At most this many.
        limit: u32,
        /// JSON lines instead of a table.
        json: bool,
    },
    /// Show a tenant's records for one key, with their audit trails.
    Show {
        /// The tenant.
        tenant: String,
        /// Also show this route's audit trail when its record is gone (e.g. released).
        route: Option<String>,
        /// The Idempotency-Key, as the client sent it.
        key: String,
    },
    /// Delete a record whatever its state (the key is free again).
    Evict {
        /// The tenant.
        tenant: String,
        /// Method and route template, e.g. "POST /v1/payments".
        route: String,
        /// The Idempotency-Key, as the client sent it.
        key: String,
    },
    /// Settle an operation whose outcome is unknown (indeterminate), and audit it.
    Resolve {
        /// The tenant.
        tenant: String,
        /// Method and route, e.g. "POST /v1/transfers" (the gateway's: "POST *").
        route: String,
        /// The effect happened: store `status` and `body`, which retries replay; else the
        /// effect did not happen and the key is freed.
        completed: bool,
        /// The stored status (when completed; required then).
        status: Option<u16>,
        /// The stored body (when completed).
        body: String,
        /// The stored Content-Type (when completed with a body).
        content_type: String,
        /// Why: kept in the audit trail.
        note: Option<String>,
        /// The Idempotency-Key, as the client sent it.
        key: String,
    },
    /// Delete every expired record now, in batches of this many rows.
    Purge {
        /// Rows per batch.
        batch: u32,
    },
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

/// The hashers to look a key up with: the current secret's, then the previous one's.
fn hashers(secrets: &KeySecrets) -> Vec<KeyHasher> {
    std::iter::once(secrets.hasher())
        .chain(secrets.previous_hasher())
        .collect()
}

/// Runs one `keys` command against `db` (an existing database, opened with
/// [`open_existing`](crate::open_existing), at `url`), writing to `out`.
///
/// Every command needs the key secret the server uses, given (`secret`) or kept in the
/// database; a missing one is an error, never a new secret.
pub async fn run<S: GatewayDb>(
    db: S,
    url: &str,
    secret: &KeySecretSource,
    action: KeysAction,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let secrets = key_secrets(&db, url, secret, SecretUse::Open).await?;
    let now = Timestamp::now();
    match action {
        KeysAction::List {
            tenant,
            state,
            older_than,
            limit,
            json: as_json,
        } => {
            let filter = ListFilter {
                tenant,
                state,
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
        KeysAction::Show {
            tenant,
            route,
            key: raw,
        } => {
            let key = key(&raw)?;
            let mut conn = db.acquire().await?;
            let mut records: Vec<Record> = Vec::new();
            for hasher in hashers(&secrets) {
                let key_hash = hasher.key_hash(&tenant, &key);
                records.extend(db.find_by_key(&mut conn, &tenant, &key_hash).await?);
            }
            // The audit trail of a route outlives its record (a released key).
            let gone = match &route {
                Some(route) if !records.iter().any(|r| r.id.route == normalize(route)) => {
                    let mut found = None;
                    for hasher in hashers(&secrets) {
                        let id = record_id(&hasher, &tenant, route, &key)?;
                        let trail = db.audit(&mut conn, &id).await?;
                        if !trail.is_empty() {
                            found = Some((id, trail));
                            break;
                        }
                    }
                    found
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
        KeysAction::Evict {
            tenant,
            route,
            key: raw,
        } => {
            let key = key(&raw)?;
            // The delete and its notice commit together: every instance that caches replays
            // (and follows the store's notices) drops the record, and none hears of a delete
            // that rolled back.
            let mut tx = db.begin().await?;
            let mut evicted = None;
            for hasher in hashers(&secrets) {
                let id = record_id(&hasher, &tenant, &route, &key)?;
                if db.evict(&mut tx, &id).await? {
                    db.notify_evicted(&mut tx, &id).await?;
                    evicted = Some(id);
                    break;
                }
            }
            db.commit(tx).await?;
            match evicted {
                Some(id) => writeln!(out, "evicted {} ({})", id.key_id(), id.route)?,
                None => anyhow::bail!("no record for this key on {}", normalize(&route)),
            }
        }
        KeysAction::Resolve {
            tenant,
            route,
            completed,
            status,
            body,
            content_type,
            note,
            key: raw,
        } => {
            let key = key(&raw)?;
            // The record under the current secret, else under the previous one.
            let mut id = record_id(&secrets.hasher(), &tenant, &route, &key)?;
            if let Some(previous) = secrets.previous_hasher() {
                let previous_id = record_id(&previous, &tenant, &route, &key)?;
                let mut conn = db.acquire().await?;
                if db.fetch(&mut conn, &id).await?.is_none()
                    && db.fetch(&mut conn, &previous_id).await?.is_some()
                {
                    id = previous_id;
                }
            }
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
            let resolved = protocol::resolve(
                &db,
                &id,
                &resolution,
                &actor,
                note.as_deref(),
                Timestamp::now(),
            );
            match resolved.await {
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
        KeysAction::Purge { batch } => {
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
