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
use crate::cli::{MessageStateArg, OutboxArgs, OutboxCommand};
use crate::http_server::{self, HttpLimits};
use crate::secret::SecretUrl;

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
    /// The sink the arguments name, if any.
    pub fn from_args(args: &OutboxArgs) -> anyhow::Result<Option<Self>> {
        if let Some(url) = &args.outbox_webhook {
            let sink = WebhookSink::with_timeout(url.expose(), args.outbox_delivery_timeout)
                .map_err(|e| anyhow::anyhow!("--outbox-webhook: {e}"))?;
            return Ok(Some(Self::Webhook(sink)));
        }
        let (Some(url), Some(subject)) = (&args.outbox_nats, &args.outbox_subject) else {
            return Ok(None);
        };
        let mut config = NatsConfig::new(subject.clone());
        config.ack_timeout = args.outbox_delivery_timeout.mul_f64(0.8);
        NatsSink::check_subject(subject).map_err(|e| anyhow::anyhow!("--outbox-subject: {e}"))?;
        NatsSink::check_servers(url).map_err(|e| anyhow::anyhow!("--outbox-nats: {e}"))?;
        Ok(Some(Self::Nats(Arc::new(LazyNats {
            url: url.clone(),
            config,
            sink: OnceCell::new(),
        }))))
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

/// The relay's configuration from the arguments.
pub fn relay_config(args: &OutboxArgs) -> RelayConfig {
    RelayConfig {
        max_attempts: args.outbox_max_attempts,
        backoff: Backoff {
            first: Duration::from_secs(1).min(args.outbox_max_backoff),
            max: args.outbox_max_backoff,
        },
        keep_sent: args.outbox_keep_sent,
        delivery_timeout: args.outbox_delivery_timeout,
        claim: args.outbox_delivery_timeout.saturating_mul(3),
        ..RelayConfig::default()
    }
}

/// Starts a relay of `db`'s outbox to `sink`, counting into `metrics`.
pub fn spawn_relay<S: AppDb>(
    db: S,
    sink: OutboxSink,
    args: &OutboxArgs,
    metrics: OutboxMetrics,
) -> RelayTask {
    Relay::new(db, sink)
        .config(relay_config(args))
        .metrics(metrics)
        .spawn()
}

/// `idemkey relay`: delivers until SIGTERM or Ctrl-C, then finishes the round in progress;
/// meanwhile serves its metrics at `GET /metrics` on `listen`.
pub async fn relay<S: AppDb>(db: S, args: &OutboxArgs, listen: SocketAddr) -> anyhow::Result<()> {
    let sink =
        OutboxSink::from_args(args)?.context("nowhere to deliver: pass --outbox-webhook URL, or --outbox-nats URL --outbox-subject SUBJECT")?;
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
    let task = spawn_relay(db, sink, args, metrics);
    http_server::run(listener, app, limits, crate::serve::shutdown_signal()).await;
    task.shutdown().await;
    println!("idemkey relay stopped");
    Ok(())
}

fn time(t: Timestamp) -> String {
    humantime::format_rfc3339_millis(t.to_system_time()).to_string()
}

fn state(arg: MessageStateArg) -> MessageState {
    match arg {
        MessageStateArg::Pending => MessageState::Pending,
        MessageStateArg::Sent => MessageState::Sent,
        MessageStateArg::Dead => MessageState::Dead,
    }
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

/// Runs an `idemkey outbox …` command, writing what it has to say to `out`.
pub async fn run<S: AppDb>(
    db: S,
    command: OutboxCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut conn = db.acquire().await?;
    match command {
        OutboxCommand::List {
            state: wanted,
            limit,
            json: as_json,
            ..
        } => {
            let filter = MessageFilter {
                state: wanted.map(state),
                limit,
            };
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
        OutboxCommand::Show { id, .. } => {
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
        OutboxCommand::Retry { id, note, .. } => {
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
        OutboxCommand::Drop { id, note, .. } => {
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
