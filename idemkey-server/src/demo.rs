//! `idemkey demo`: what idemkey is for, in one command.
//!
//! It starts the payments API on a temporary SQLite file (or the database given), puts a
//! proxy in front that loses responses after the server has answered, and sends logical
//! payments through it with the idempotency client, which retries with the same key. Then it
//! counts: every logical payment should exist exactly once.
//!
//! The key secret is a throwaway one made for the run and kept in memory only, on either
//! database: the demo's records need no look-up after it ends, and nothing secret is left in
//! the database (a PostgreSQL one especially).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use idemkey_client::{IdempotentClient, Operation, RetryPolicy};
use idemkey_fault_proxy::{FaultConfig, FaultProxy};
use idemkey_tower::{InFlightPolicy, Metrics};
use indicatif::{ProgressBar, ProgressStyle};
use rand::RngCore;
use serde::Serialize;

use crate::{ApiKeys, AppConfig, AppDb, KeySecrets, app, connect, with_store};

const TOKEN: &str = "sk_demo_lossy_network";

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Logical payments to make.
    pub operations: usize,
    /// Share of responses the proxy loses after the server answered (0.0–1.0).
    pub loss: f64,
    /// Payments in flight at once.
    pub concurrency: usize,
    /// The database; `None`: a temporary SQLite file.
    pub database_url: Option<String>,
    /// Seed of the proxy's losses, for a reproducible run.
    pub seed: Option<u64>,
    /// Hide the progress bar.
    pub quiet: bool,
}

/// What the demo saw.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// Logical payments attempted.
    pub operations: u64,
    /// Logical payments that ended in a 201.
    pub succeeded: u64,
    /// HTTP requests sent by the client, retries included.
    pub transport_attempts: u64,
    /// Responses the proxy dropped after the server had answered.
    pub lost_responses: u64,
    /// Final answers that were replays of a stored outcome.
    pub replays: u64,
    /// Payments that exist, read back from the API.
    pub payments_created: i64,
    /// The first few failures, if any.
    pub failures: Vec<String>,
}

impl DemoReport {
    /// Every logical payment succeeded and exists exactly once.
    pub fn is_exact(&self) -> bool {
        self.succeeded == self.operations && self.payments_created == self.operations as i64
    }

    /// The table and the verdict line.
    pub fn render(&self) -> String {
        let rows = [
            ("logical operations", self.operations.to_string()),
            ("transport attempts", self.transport_attempts.to_string()),
            ("lost responses", self.lost_responses.to_string()),
            ("replayed answers", self.replays.to_string()),
            ("operations succeeded", self.succeeded.to_string()),
            ("payments created", self.payments_created.to_string()),
        ];
        let mut out = String::new();
        for (name, value) in rows {
            out.push_str(&format!("  {name:<22} {value:>8}\n"));
        }
        for failure in &self.failures {
            out.push_str(&format!("  failure: {failure}\n"));
        }
        if self.is_exact() {
            out.push_str(&format!(
                "VERDICT: OK: {} logical payments, {} created, none twice, despite {} lost responses\n",
                self.operations, self.payments_created, self.lost_responses
            ));
        } else {
            out.push_str(&format!(
                "VERDICT: FAILED: {} logical payments, {} succeeded, {} created\n",
                self.operations, self.succeeded, self.payments_created
            ));
        }
        out
    }
}

async fn start_server<S: AppDb>(db: S) -> anyhow::Result<SocketAddr> {
    db.migrate_all().await.context("migrations failed")?;
    // A throwaway key secret: see the module documentation.
    let mut secret = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut secret);
    let secrets = KeySecrets::new(secret.to_vec(), None);
    let config = AppConfig {
        api_keys: ApiKeys::new([("demo".to_owned(), TOKEN.to_owned())]),
        simulate_latency: Duration::ZERO,
        retention: Duration::from_secs(24 * 3600),
        in_flight: InFlightPolicy::default(),
        first_sent: Default::default(),
        outbox: None,
    };
    let router = app(db, &secrets, Metrics::new(), &config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(addr)
}

async fn payments_total(http: &reqwest::Client, server: SocketAddr) -> anyhow::Result<i64> {
    let response: serde_json::Value = http
        .get(format!("http://{server}/v1/payments?limit=1"))
        .bearer_auth(TOKEN)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    response["total"]
        .as_i64()
        .context("the payments list has no total")
}

/// Runs the demo. The server and the proxy stop with the returned future's runtime.
pub async fn run(options: DemoOptions) -> anyhow::Result<DemoReport> {
    let dir = tempfile::tempdir()?;
    let url = match &options.database_url {
        Some(url) => url.clone(),
        None => format!("sqlite:{}", dir.path().join("demo.db").display()),
    };
    let db = connect(&url, 32, InFlightPolicy::DEFAULT_WAIT).await?;
    let server = with_store!(db, store => start_server(store).await)?;
    let proxy = FaultProxy::start(
        server,
        FaultConfig {
            lose_response: options.loss.clamp(0.0, 1.0),
            seed: options.seed,
            ..FaultConfig::default()
        },
    )
    .await?;

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let before = payments_total(&http, server).await?;
    let client = IdempotentClient::with_policy(
        http.clone(),
        RetryPolicy::new()
            .with_initial_delay(Duration::from_millis(10))
            .with_max_delay(Duration::from_millis(250))
            .with_max_attempts(100)
            .with_max_elapsed(Duration::from_secs(120)),
    );
    let bar = if options.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(options.operations as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("payments [{bar:40}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let attempts = Arc::new(AtomicU64::new(0));
    let url = format!("{}/v1/payments", proxy.url());
    let results: Vec<Result<bool, String>> = futures::stream::iter(0..options.operations)
        .map(|i| {
            let (client, url, attempts, bar) =
                (client.clone(), url.clone(), attempts.clone(), bar.clone());
            async move {
                // One logical payment = one key, made before the first attempt.
                let op = Operation::new();
                let body = serde_json::json!({
                    "amount": 100 + i,
                    "currency": "EUR",
                    "customer": format!("customer-{}", i % 50),
                    "description": format!("demo payment {i}"),
                });
                let request = client.inner().post(&url).bearer_auth(TOKEN).json(&body);
                let result = match client.send(&op, request).await {
                    Ok(response) => {
                        attempts.fetch_add(u64::from(response.attempts()), Ordering::Relaxed);
                        if response.status() == reqwest::StatusCode::CREATED {
                            Ok(response.is_replayed())
                        } else {
                            Err(format!("payment {i}: status {}", response.status()))
                        }
                    }
                    Err(e) => {
                        attempts.fetch_add(u64::from(e.attempts()), Ordering::Relaxed);
                        Err(format!("payment {i}: {e}"))
                    }
                };
                bar.inc(1);
                result
            }
        })
        .buffer_unordered(options.concurrency.max(1))
        .collect()
        .await;
    bar.finish_and_clear();

    let after = payments_total(&http, server).await?;
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().cloned())
        .collect();
    Ok(DemoReport {
        operations: options.operations as u64,
        succeeded: results.iter().filter(|r| r.is_ok()).count() as u64,
        transport_attempts: attempts.load(Ordering::Relaxed),
        lost_responses: proxy.stats().responses_lost,
        replays: results.iter().filter(|r| matches!(r, Ok(true))).count() as u64,
        payments_created: after - before,
        failures: failures.into_iter().take(5).collect(),
    })
}
