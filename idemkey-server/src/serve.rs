//! `idemkey serve`: the payments API on a socket, with migrations, the purge and graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::response::IntoResponse;
use idemkey_core::{FirstSentPolicy, StoreError};
use idemkey_outbox::OutboxMetrics;
use idemkey_tower::{InFlightPolicy, Metrics, PurgeTask, SystemClock};
use rand::RngCore;
use tower::ServiceExt;

use crate::db::{Backend, DatabaseOptions, unavailable};
use crate::http_server::{self, HttpLimits};
use crate::outbox::{OutboxOptions, spawn_relay};
use crate::problem::ApiError;
use crate::secret::{KeySecretSource, KeySecrets, SecretUrl, migrate_for_start};
use crate::{ApiKeys, AppConfig, AppDb, app};

/// Options of `idemkey serve`.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Token → tenant; when empty, two demo tenants are made up and printed.
    pub api_keys: ApiKeys,
    /// The database URL, as messages name it.
    pub database_url: SecretUrl,
    /// The key secret (and the previous one); without one, see `key_secret_in_database`.
    pub secret: KeySecretSource,
    /// Keep a secret in the database when none is given (SQLite does so by default).
    pub key_secret_in_database: bool,
    /// Wait inside the payment transaction.
    pub simulate_latency: Duration,
    /// How long outcomes are kept.
    pub retention: Duration,
    /// What a retry gets while the first attempt runs.
    pub in_flight: InFlightPolicy,
    /// How keyed requests' first-attempt times are read and judged.
    pub first_sent: FirstSentPolicy,
    /// How often expired records are purged.
    pub purge_interval: Duration,
    /// Where outbox messages go (without a sink, payments emit none), and how the relay
    /// delivers them.
    pub outbox: OutboxOptions,
    /// Timeouts and the connection limit of the HTTP server.
    pub limits: HttpLimits,
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
    ApiKeys::new(pairs).expect("two random tokens differ")
}

/// Serves the payments API on `db` until SIGTERM or Ctrl-C (see [`serve_with`]).
pub async fn serve<S: AppDb>(db: S, options: ServeOptions) -> anyhow::Result<()> {
    serve_with(
        move || {
            let db = db.clone();
            async move { Ok(db) }
        },
        options,
    )
    .await
}

/// Serves the payments API on the database `database` names, its store `S` as
/// [`with_database`](crate::with_database) picks it: an embedded database (SQLite) is opened
/// before the server listens, as [`serve`] takes it; a database server (PostgreSQL) is
/// reached in the background, as [`serve_with`] does, so the server may start before it.
pub async fn serve_on<S: Backend>(
    database: DatabaseOptions,
    options: ServeOptions,
) -> anyhow::Result<()> {
    if S::EMBEDDED {
        let db = S::connect(&database).await?;
        return serve(db, options).await;
    }
    serve_with(
        move || {
            let database = database.clone();
            async move { S::connect(&database).await }
        },
        options,
    )
    .await
}

/// The longest pause between two attempts to reach the database at start.
const MAX_START_BACKOFF: Duration = Duration::from_secs(2);

/// Listens at once, then reaches the database in the background: `connect`, the migrations
/// and the key secret, again and again (backing off up to 2 s) for as long as the database
/// is unreachable. Meanwhile every request, `GET /healthz` included, is answered 503
/// `store-unavailable` with `Retry-After`; once the database answers, the payments API
/// serves. An error that is not about reaching the database (a failed migration, a
/// refused secret) stops the server with that error, as before. Then serves until SIGTERM
/// or Ctrl-C; requests in flight finish (or roll back) before it returns.
///
/// `idemkey listening on http://…` is printed once the first attempt is over: when the
/// database was reachable, the API is ready then, as it always was; when it was not, the
/// server answers 503 until it is (`GET /healthz` says which).
pub async fn serve_with<S, C, F>(connect: C, options: ServeOptions) -> anyhow::Result<()>
where
    S: AppDb,
    C: Fn() -> F + Send + Sync + 'static,
    F: Future<Output = anyhow::Result<S>> + Send,
{
    let api_keys = if options.api_keys.is_empty() {
        demo_keys()
    } else {
        options.api_keys.clone()
    };
    let listener = http_server::bind(options.listen, &options.limits, 1).await?;
    let limits = options.limits;
    let address = listener.local_addr()?;

    let ready: Arc<OnceLock<Router>> = Arc::new(OnceLock::new());
    let front = {
        let ready = ready.clone();
        Router::new().fallback(move |req: Request| {
            let ready = ready.clone();
            async move {
                match ready.get() {
                    Some(app) => match app.clone().oneshot(req).await {
                        Ok(response) => response,
                        Err(never) => match never {},
                    },
                    None => ApiError::Unavailable(
                        "the server is starting and cannot reach its database yet".to_owned(),
                    )
                    .into_response(),
                }
            }
        })
    };
    let metrics = Metrics::new();
    let sink = options.outbox.sink.clone();
    let outbox_metrics = sink.as_ref().map(|_| OutboxMetrics::new());
    let config = AppConfig {
        api_keys,
        simulate_latency: options.simulate_latency,
        retention: options.retention,
        in_flight: options.in_flight,
        first_sent: options.first_sent,
        clock: Arc::new(SystemClock),
        outbox: outbox_metrics.clone(),
    };
    let purge_interval = options.purge_interval;
    let relay_config = options.outbox.relay.clone();
    let mut starting = tokio::spawn(async move {
        // "listening" is printed once the first attempt is over: at once ready, as before,
        // or known to wait for the database (a fatal first error prints nothing).
        let listening = || println!("idemkey listening on http://{address}");
        let mut announced = false;
        let mut pause = Duration::from_millis(100);
        let db = loop {
            match start(&connect, &options).await {
                Ok(started) => break started,
                Err(e) if start_up_refused(&e) => return Err(e.context(START_UP_REFUSED)),
                Err(e) if database_unreachable::<S>(&e) => {
                    if !announced {
                        listening();
                        announced = true;
                    }
                    tracing::warn!(
                        error = format!("{e:#}"),
                        retry_in = ?pause,
                        "the database is unreachable; answering 503 until it is"
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_START_BACKOFF);
                }
                Err(e) => return Err(e),
            }
        };
        let (db, secrets) = db;
        // A path or a method no route has is answered problem+json, as every error is.
        let router =
            crate::problem::route_not_found(app(db.clone(), &secrets, metrics.clone(), &config));
        let _ = ready.set(router);
        if announced {
            tracing::info!("the database is reachable and migrated; serving");
        } else {
            listening();
        }
        let relay = match (sink, outbox_metrics) {
            (Some(sink), Some(counters)) => {
                println!(
                    "outbox: each succeeded payment emits payment.succeeded, delivered to {}",
                    sink.describe()
                );
                Some(spawn_relay(db.clone(), sink, relay_config, counters))
            }
            _ => None,
        };
        let purge = PurgeTask::spawn(db, purge_interval, metrics, Arc::new(SystemClock));
        Ok((purge, relay))
    });

    let server = http_server::run(listener, front, limits, shutdown_signal());
    tokio::pin!(server);
    let (purge, relay) = tokio::select! {
        () = &mut server => {
            starting.abort();
            println!("idemkey stopped");
            return Ok(());
        }
        started = &mut starting => match started {
            Ok(Ok(background)) => background,
            Ok(Err(e)) => return Err(e),
            Err(e) => anyhow::bail!("the start-up task failed: {e}"),
        },
    };
    server.await;
    drop(purge);
    if let Some(relay) = relay {
        // The round in progress finishes: its deliveries' outcomes are written.
        relay.shutdown().await;
    }
    println!("idemkey stopped");
    Ok(())
}

/// One attempt at what `serve` needs from the database before it can serve.
async fn start<S, C, F>(connect: &C, options: &ServeOptions) -> anyhow::Result<(S, KeySecrets)>
where
    S: AppDb,
    C: Fn() -> F,
    F: Future<Output = anyhow::Result<S>>,
{
    let db = connect().await?;
    let secrets = migrate_for_start(
        &db,
        &options.database_url,
        &options.secret,
        options.key_secret_in_database,
    )
    .await?;
    Ok((db, secrets))
}

/// What a server that refuses the connection's start-up message is told: a pooler that
/// refuses the startup parameter `options` (PgBouncer does, for the `lock_timeout` idemkey
/// sets) is a pooler the URL does not name.
const START_UP_REFUSED: &str = "the database refused the connection's start-up message \
     (SQLSTATE 08P01); a pooler in transaction mode (PgBouncer) needs \
     ?idemkey-pooler=transaction in the database URL";

/// Whether `error` is the server refusing the connection's start-up message (SQLSTATE 08P01
/// protocol_violation, as PgBouncer answers an unsupported startup parameter): the server
/// answered, so waiting does not help. Classified by SQLSTATE.
fn start_up_refused(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::Database(db)) if db.code().is_some_and(|code| code == "08P01")
        )
    })
}

/// Whether `error`, from store `S`, says the database could not be reached (refused or lost
/// connection, pool time-out, a server starting up or shutting down), as opposed to one that
/// answered and refused: only the former is waited out at start. Classified by kind and the
/// dialect's codes ([`unavailable`]).
fn database_unreachable<S: AppDb>(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        if let Some(e) = cause.downcast_ref::<sqlx::Error>() {
            return unavailable::<S>(e).is_some_and(|u| u.unreachable);
        }
        matches!(
            cause.downcast_ref::<StoreError>(),
            Some(StoreError::Unavailable(_))
        )
    })
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
