//! `idemkey serve`: the payments API on a socket, with migrations, the purge and graceful
//! shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use idemkey_core::{KeyHasher, SystemClock};
use idemkey_postgres::PgStore;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{InFlightPolicy, Metrics, PurgeTask};
use rand::RngCore;

use crate::{ApiKeys, AppConfig, AppDb, app};

/// A connected database of either kind.
#[derive(Debug, Clone)]
pub enum Database {
    /// `sqlite:…`
    Sqlite(SqliteStore),
    /// `postgres://…`
    Postgres(PgStore),
}

/// Connects to `url`: `sqlite:path` (created if missing) or `postgres://…`.
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
            .context("cannot connect to PostgreSQL")?;
        Ok(Database::Postgres(store))
    } else {
        anyhow::bail!("unsupported database URL {url:?}: expected sqlite:<path> or postgres://…")
    }
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
    /// The key-hashing secret; when `None`, one is generated once and kept in the database.
    pub key_secret: Option<String>,
    /// Wait inside the payment transaction.
    pub simulate_latency: Duration,
    /// How long outcomes are kept.
    pub retention: Duration,
    /// What a retry gets while the first attempt runs.
    pub in_flight: InFlightPolicy,
    /// How often expired records are purged.
    pub purge_interval: Duration,
}

/// The key-hashing secret: the configured one, or the one kept in the database (made on
/// first use, the same for every instance sharing the database).
pub(crate) async fn key_hasher<S: AppDb>(
    db: &S,
    configured: Option<&str>,
) -> anyhow::Result<KeyHasher> {
    Ok(KeyHasher::new(&key_secret(db, configured).await?))
}

/// The raw key secret behind [`key_hasher`]: the configured one, or the one kept in the
/// database.
pub(crate) async fn key_secret<S: AppDb>(
    db: &S,
    configured: Option<&str>,
) -> anyhow::Result<Vec<u8>> {
    if let Some(secret) = configured {
        return Ok(secret.as_bytes().to_vec());
    }
    let mut fresh = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut fresh);
    db.setting_or_init("key_hash_secret", &fresh)
        .await
        .context("cannot read the key-hashing secret")
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
    let hasher = key_hasher(&db, options.key_secret.as_deref()).await?;
    let api_keys = if options.api_keys.is_empty() {
        demo_keys()
    } else {
        options.api_keys.clone()
    };
    let metrics = Metrics::new();
    let config = AppConfig {
        api_keys,
        simulate_latency: options.simulate_latency,
        retention: options.retention,
        in_flight: options.in_flight,
    };
    let router = app(db.clone(), hasher, metrics.clone(), &config);
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("cannot listen on {}", options.listen))?;
    println!("idemkey listening on http://{}", listener.local_addr()?);

    let purge = PurgeTask::spawn(db, options.purge_interval, metrics, Arc::new(SystemClock));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("server failed")?;
    drop(purge);
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
