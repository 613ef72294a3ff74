//! The outbox in the server: the sink named on the command line, the relay `serve` and
//! `idemkey relay` run, and `idemkey outbox …`, the operator's view of the messages.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use idemkey_core::Timestamp;
use idemkey_outbox::{
    Backoff, DeliveryError, Message, MessageFilter, MessageState, NatsConfig, NatsSink,
    OutboxAuditEntry, OutboxMetrics, Relay, RelayConfig, RelayTask, Sink, WebhookSink, envelope,
    redact_sink_urls,
};
use prometheus_client::registry::Registry;
use tokio::sync::OnceCell;

use crate::AppDb;
use crate::http_server::{self, HttpLimits};
use crate::secret::SecretUrl;

/// Where outbox messages go, and how hard the relay tries (`serve`, `idemkey relay`).
#[derive(Debug, Clone, Default)]
pub struct OutboxOptions {
    /// Where messages go. Without a sink, `serve`'s payments emit no messages, and `relay`
    /// has nowhere to deliver.
    pub sink: Option<OutboxSink>,
    /// The relay's attempts, back-off, claim and how long sent messages are kept.
    pub relay: RelayConfig,
}

impl OutboxOptions {
    /// The relay's configuration for deliveries bounded by `delivery_timeout`: at most
    /// `max_attempts` attempts, waits doubling from 1 s up to `max_backoff`, sent messages
    /// kept for `keep_sent`, and a claim of three delivery time-outs, after which a relay that
    /// died leaves its messages to the next one.
    pub fn relay_config(
        delivery_timeout: Duration,
        max_attempts: u32,
        max_backoff: Duration,
        keep_sent: Duration,
    ) -> RelayConfig {
        RelayConfig {
            max_attempts,
            backoff: Backoff {
                first: Duration::from_secs(1).min(max_backoff),
                max: max_backoff,
            },
            keep_sent,
            delivery_timeout,
            claim: delivery_timeout.saturating_mul(3),
            ..RelayConfig::default()
        }
    }
}

/// Where messages go.
#[derive(Debug, Clone)]
pub enum OutboxSink {
    /// `POST` to a URL.
    Webhook(WebhookSink),
    /// Publish to NATS JetStream. Connected at the first delivery, and again after a failed
    /// connection: the server starts while NATS is down, and the relay retries.
    Nats(Arc<LazyNats>),
}

/// A JetStream sink connected on first use.
#[derive(Debug)]
pub struct LazyNats {
    url: SecretUrl,
    config: NatsConfig,
    sink: OnceCell<NatsSink>,
}

impl OutboxSink {
    /// Publishes to NATS JetStream at `url` (one or more servers, separated by commas) with
    /// `config`, connecting at the first delivery. Check the subject and the servers first
    /// ([`NatsSink::check_subject`], [`NatsSink::check_servers`]): a bad one fails every
    /// delivery.
    pub fn nats(url: SecretUrl, config: NatsConfig) -> Self {
        Self::Nats(Arc::new(LazyNats {
            url,
            config,
            sink: OnceCell::new(),
        }))
    }

    /// Where messages go, for the start-up line.
    pub fn describe(&self) -> String {
        match self {
            Self::Webhook(sink) => format!("webhook POST {}", sink.redacted_url()),
            Self::Nats(nats) => format!(
                "NATS JetStream {} subject {}",
                crate::secret::redacted(&nats.url),
                nats.config.subject
            ),
        }
    }
}

impl Sink for OutboxSink {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        match self {
            Self::Webhook(sink) => sink.deliver(message).await,
            Self::Nats(nats) => {
                let sink = nats
                    .sink
                    .get_or_try_init(|| NatsSink::connect_with(&nats.url, nats.config.clone()))
                    .await?;
                sink.deliver(message).await
            }
        }
    }
}

/// Starts a relay of `db`'s outbox to `sink` under `config`, counting into `metrics`.
pub fn spawn_relay<S: AppDb>(
    db: S,
    sink: OutboxSink,
    config: RelayConfig,
    metrics: OutboxMetrics,
) -> RelayTask {
    Relay::new(db, sink).config(config).metrics(metrics).spawn()
}

/// `idemkey relay`: delivers to `options`' sink until SIGTERM or Ctrl-C, then finishes the
/// round in progress; meanwhile serves its metrics at `GET /metrics` on `listen`.
pub async fn relay<S: AppDb>(
    db: S,
    options: OutboxOptions,
    listen: SocketAddr,
) -> anyhow::Result<()> {
    let sink = options.sink.context(
        "nowhere to deliver: pass --outbox-webhook URL, or --outbox-nats URL --outbox-subject SUBJECT",
    )?;
    let limits = HttpLimits::default();
    let listener = http_server::bind(listen, &limits, 1).await?;
    let metrics = OutboxMetrics::new();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let app = crate::problem::route_not_found(
        Router::new().route("/metrics", crate::metrics::route(registry)),
    );
    println!("idemkey relay delivering to {}", sink.describe());
    println!(
        "idemkey relay serving its metrics on http://{}/metrics",
        listener.local_addr()?
    );
    let task = spawn_relay(db, sink, options.relay, metrics);
    http_server::run(listener, app, limits, crate::serve::shutdown_signal()).await;
    task.shutdown().await;
    println!("idemkey relay stopped");
    Ok(())
}

fn time(t: Timestamp) -> String {
    humantime::format_rfc3339_millis(t.to_system_time()).to_string()
}

fn json(m: &Message) -> serde_json::Value {
    serde_json::json!({
        "id": m.id,
        "type": m.kind,
        "state": m.state.as_str(),
        "attempts": m.attempts,
        "created_at": time(m.created_at),
        "next_attempt_at": (m.state == MessageState::Pending).then(|| time(m.next_attempt_at)),
        "claimed_by": m.claimed_by,
        "last_error": m.last_error.as_deref().map(redact_sink_urls),
        "sent_at": m.sent_at.map(time),
        "group": m.group,
    })
}

fn audit_json(e: &OutboxAuditEntry) -> serde_json::Value {
    serde_json::json!({
        "at": time(e.at),
        "actor": e.actor,
        "action": e.action,
        "detail": e.detail,
    })
}

fn actor() -> String {
    format!(
        "operator:{}",
        std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "unknown".to_owned())
    )
}

/// An operator's command on the outbox (`idemkey outbox …`).
#[derive(Debug, Clone)]
pub enum OutboxAction {
    /// List messages, newest first.
    List {
        /// Only messages in this state.
        state: Option<MessageState>,
        /// At most this many.
        limit: u32,
        /// JSON lines instead of a table.
        json: bool,
    },
    /// Show one message: its state, attempts, last error, the bytes it is delivered as, and
    /// the operators' actions on it.
    Show {
        /// The message id (`msg_…`).
        id: String,
    },
    /// Make a dead message pending again, its attempts reset (audited).
    Retry {
        /// The message id.
        id: String,
        /// Why, for the audit trail.
        note: Option<String>,
    },
    /// Delete a dead message: it will never be delivered (audited).
    Drop {
        /// The message id.
        id: String,
        /// Why, for the audit trail.
        note: Option<String>,
    },
}

/// Runs an `idemkey outbox …` command, writing what it has to say to `out`.
pub async fn run<S: AppDb>(
    db: S,
    action: OutboxAction,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut conn = db.acquire().await?;
    match action {
        OutboxAction::List {
            state,
            limit,
            json: as_json,
        } => {
            let filter = MessageFilter { state, limit };
            let messages = db.messages(&mut conn, &filter).await?;
            if as_json {
                for m in &messages {
                    writeln!(out, "{}", json(m))?;
                }
                return Ok(());
            }
            writeln!(
                out,
                "{:<36}  {:<20}  {:<7}  {:>8}  {:<24}  LAST ERROR",
                "ID", "TYPE", "STATE", "ATTEMPTS", "CREATED"
            )?;
            for m in &messages {
                writeln!(
                    out,
                    "{:<36}  {:<20}  {:<7}  {:>8}  {:<24}  {}",
                    m.id,
                    m.kind,
                    m.state.as_str(),
                    m.attempts,
                    time(m.created_at),
                    m.last_error.as_deref().map_or("-".into(), redact_sink_urls),
                )?;
            }
            let n = messages.len();
            writeln!(out, "({n} message{})", if n == 1 { "" } else { "s" })?;
        }
        OutboxAction::Show { id } => {
            let message = db
                .message(&mut conn, &id)
                .await?
                .with_context(|| format!("no outbox message {id}"))?;
            let audit = db.outbox_audit(&mut conn, &id).await?;
            let mut shown = json(&message);
            shown["delivered_as"] =
                serde_json::from_slice(&envelope(&message)).unwrap_or(serde_json::Value::Null);
            shown["audit"] = audit.iter().map(audit_json).collect();
            writeln!(out, "{}", serde_json::to_string_pretty(&shown)?)?;
        }
        OutboxAction::Retry { id, note } => {
            let now = Timestamp::now();
            let mut tx = db.begin().await?;
            if !db.requeue(&mut tx, &id, now).await? {
                anyhow::bail!("{}", not_dead(&db, &mut tx, &id).await?);
            }
            db.append_outbox_audit(&mut tx, &entry(&id, now, "retried", note))
                .await?;
            db.commit(tx).await?;
            writeln!(
                out,
                "{id} is pending again with its attempts reset; the relay delivers it next"
            )?;
        }
        OutboxAction::Drop { id, note } => {
            let now = Timestamp::now();
            let mut tx = db.begin().await?;
            if !db.remove_dead(&mut tx, &id).await? {
                anyhow::bail!("{}", not_dead(&db, &mut tx, &id).await?);
            }
            db.append_outbox_audit(&mut tx, &entry(&id, now, "dropped", note))
                .await?;
            db.commit(tx).await?;
            writeln!(out, "{id} dropped: it will not be delivered")?;
        }
    }
    Ok(())
}

fn entry(id: &str, at: Timestamp, action: &str, note: Option<String>) -> OutboxAuditEntry {
    OutboxAuditEntry {
        message_id: id.to_owned(),
        at,
        actor: actor(),
        action: action.to_owned(),
        detail: note.unwrap_or_default(),
    }
}

/// Why `retry` or `drop` refused: only dead messages are the operator's to act on.
async fn not_dead<S: AppDb>(db: &S, conn: &mut S::Connection, id: &str) -> anyhow::Result<String> {
    Ok(match db.message(conn, id).await? {
        None => format!("no outbox message {id}"),
        Some(m) => format!(
            "{id} is {}, not dead: only dead messages can be retried or dropped",
            m.state.as_str()
        ),
    })
}
