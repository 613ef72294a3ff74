//! `idemkey serve`: the payments API on a socket, with migrations, the purge and graceful
//! shutdown.

use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use idemkey_core::SystemClock;
use idemkey_outbox::OutboxMetrics;
use idemkey_postgres::PgStore;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{InFlightPolicy, Metrics, PurgeTask};
use rand::RngCore;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteSynchronous};

use crate::cli::{KeySecretArgs, OutboxArgs};
use crate::outbox::{OutboxSink, spawn_relay};
use crate::secret::{SecretUse, key_secrets, redacted};
use crate::{ApiKeys, AppConfig, AppDb, app};

/// A connected database of either kind.
#[derive(Debug, Clone)]
pub enum Database {
    /// `sqlite:…`
    Sqlite(SqliteStore),
    /// `postgres://…`
    Postgres(PgStore),
}

/// Connects to `url`: `sqlite:path` (created if missing) or `postgres://…`. For `serve`,
/// `gateway` and `migrate`, which create what is missing; the other commands use
/// [`open_existing`].
///
/// `lock_wait` bounds how long a SQLite claim waits for the database's single write lock
/// (its busy time-out); PostgreSQL claims are bounded per route by the layer.
pub async fn connect(
    url: &str,
    max_connections: u32,
    lock_wait: Duration,
) -> anyhow::Result<Database> {
    if url.starts_with("sqlite:") {
        let store = SqliteStore::connect_with_busy_timeout(url, lock_wait)
            .await
            .with_context(|| format!("cannot open the SQLite database {url}"))?;
        Ok(Database::Sqlite(store))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let store = PgStore::connect(url, max_connections)
            .await
            .with_context(|| format!("cannot connect to PostgreSQL at `{}`", redacted(url)))?;
        Ok(Database::Postgres(store))
    } else {
        anyhow::bail!("unsupported database URL {url:?}: expected sqlite:<path> or postgres://…")
    }
}

/// Opens the database `url` for an operator command: it must exist and carry idemkey's
/// tables (`idemkey serve`, `gateway` or `migrate` made them). Creates nothing: a missing
/// SQLite file or missing tables is an error naming the URL and how to fix it.
pub async fn open_existing(
    url: &str,
    max_connections: u32,
    lock_wait: Duration,
) -> anyhow::Result<Database> {
    let fix =
        "pass --database-url (or IDEMKEY_DATABASE_URL) naming the database `idemkey serve` uses";
    let shown = redacted(url);
    let db = if url.starts_with("sqlite:") {
        let options = SqliteConnectOptions::from_str(url)
            .with_context(|| format!("invalid SQLite URL `{url}`"))?;
        let file = options.get_filename();
        if file != Path::new(":memory:") && !file.exists() {
            anyhow::bail!("`{url}` does not exist; {fix}");
        }
        // The journal mode is left as the file says (WAL once `serve` made it): setting it
        // would write to a file that may not be ours.
        let options = options
            .create_if_missing(false)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(lock_wait);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .with_context(|| format!("cannot open the SQLite database `{url}`"))?;
        Database::Sqlite(SqliteStore::new(pool))
    } else {
        connect(url, max_connections, lock_wait).await?
    };
    let missing = crate::with_store!(&db, store => store.missing_tables().await)
        .with_context(|| format!("cannot read the tables of `{shown}`"))?;
    if !missing.is_empty() {
        anyhow::bail!(
            "`{shown}` has no idemkey tables ({} missing): it is not a database `idemkey serve` \
             ran on; {fix}, or run `idemkey migrate --database-url …` first",
            missing.join(", ")
        );
    }
    Ok(db)
}

/// Runs `$body` with `$store` bound to the concrete store of a [`Database`].
#[macro_export]
macro_rules! with_store {
    ($db:expr, $store:ident => $body:expr) => {
        match $db {
            $crate::Database::Sqlite($store) => $body,
            $crate::Database::Postgres($store) => $body,
        }
    };
}

/// Options of `idemkey serve`.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Token → tenant; when empty, two demo tenants are made up and printed.
    pub api_keys: ApiKeys,
    /// The database URL, as messages name it.
    pub database_url: String,
    /// The key secret (and the previous one); without one, see `key_secret_in_database`.
    pub secret: KeySecretArgs,
    /// Keep a secret in the database when none is given (SQLite does so by default).
    pub key_secret_in_database: bool,
    /// Wait inside the payment transaction.
    pub simulate_latency: Duration,
    /// How long outcomes are kept.
    pub retention: Duration,
    /// What a retry gets while the first attempt runs.
    pub in_flight: InFlightPolicy,
    /// How often expired records are purged.
    pub purge_interval: Duration,
    /// Where outbox messages go; without a sink, payments emit none.
    pub outbox: OutboxArgs,
}

fn demo_keys() -> ApiKeys {
    let token = || {
        let mut b = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut b);
        format!("sk_demo_{}", hex::encode(b))
    };
    let pairs = vec![
        ("demo-a".to_owned(), token()),
        ("demo-b".to_owned(), token()),
    ];
    println!("No API keys configured; made up two demo tenants for this run:");
    for (tenant, token) in &pairs {
        println!("  tenant {tenant:<7} Authorization: Bearer {token}");
    }
    ApiKeys::new(pairs)
}

/// Migrates, then serves the payments API until SIGTERM or Ctrl-C; requests in flight then
/// finish (or roll back) before it returns.
pub async fn serve<S: AppDb>(db: S, options: ServeOptions) -> anyhow::Result<()> {
    db.migrate_all().await.context("migrations failed")?;
    let secrets = key_secrets(
        &db,
        &options.database_url,
        &options.secret,
        SecretUse::Start {
            in_database: options.key_secret_in_database,
        },
    )
    .await?;
    let api_keys = if options.api_keys.is_empty() {
        demo_keys()
    } else {
        options.api_keys.clone()
    };
    let metrics = Metrics::new();
    let sink = OutboxSink::from_args(&options.outbox)?;
    let outbox_metrics = sink.as_ref().map(|_| OutboxMetrics::new());
    let config = AppConfig {
        api_keys,
        simulate_latency: options.simulate_latency,
        retention: options.retention,
        in_flight: options.in_flight,
        outbox: outbox_metrics.clone(),
    };
    let router = app(db.clone(), &secrets, metrics.clone(), &config);
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("cannot listen on {}", options.listen))?;
    println!("idemkey listening on http://{}", listener.local_addr()?);

    let relay = match (sink, outbox_metrics) {
        (Some(sink), Some(counters)) => {
            println!(
                "outbox: each succeeded payment emits payment.succeeded, delivered to {}",
                sink.describe()
            );
            Some(spawn_relay(db.clone(), sink, &options.outbox, counters))
        }
        _ => None,
    };
    let purge = PurgeTask::spawn(db, options.purge_interval, metrics, Arc::new(SystemClock));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("server failed")?;
    drop(purge);
    if let Some(relay) = relay {
        relay.shutdown().await;
    }
    println!("idemkey stopped");
    Ok(())
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    println!("shutting down: finishing requests in flight");
}
