//! `idemkey demo`: what idemkey is for, in one command.
//!
//! It starts the payments API on a temporary SQLite file (or the database given), puts a
//! proxy in front that loses responses after the server has answered, and sends logical
//! payments through it with the idempotency client, which retries with the same key. Then it
//! counts: every logical payment should exist exactly once.
//!
//! With `late`, the retries come a day late: each payment carries a reference of its own
//! and is sent once; a lost answer is retried only after the server's clock has moved past
//! the retention and the purge has deleted the records. Half of those retries state their
//! first attempt's time (the client does): the server refuses them (412); the other half do
//! not (a client of its own): their handler runs and finds the reference (409 with the
//! payment). None is created twice.
//!
//! The key secret is a throwaway one made for the run and kept in memory only, on either
//! database: the demo's records need no look-up after it ends, and nothing secret is left in
//! the database (a PostgreSQL one especially).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use idemkey_client::{Error, IdempotentClient, Operation, RetryPolicy};
use idemkey_core::problem::FIRST_SENT_EXPIRED;
use idemkey_core::{Clock, Sleep, Timestamp, protocol};
use idemkey_fault_proxy::{FaultConfig, FaultProxy};
use idemkey_tower::{InFlightPolicy, Metrics};
use indicatif::{ProgressBar, ProgressStyle};
use rand::RngCore;
use serde::Serialize;

use crate::problem::PAYMENT_REFERENCE_USED;
use crate::{
    ApiKeys, AppConfig, AppDb, Backend, DatabaseOptions, KeySecrets, OnDatabase, app, with_database,
};

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
    pub database_url: Option<crate::secret::SecretUrl>,
    /// Seed of the proxy's losses, for a reproducible run.
    pub seed: Option<u64>,
    /// Hide the progress bar.
    pub quiet: bool,
    /// Retry lost answers only after the retention has passed and the records are purged.
    pub late: bool,
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
    /// With `late`: what became of the retries after the purge.
    pub late: Option<LateReport>,
}

/// What became of the payments retried after the retention (`idemkey demo --late`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct LateReport {
    /// Payments whose answer was lost, retried after the purge.
    pub retried: u64,
    /// Retries that stated their first attempt's time: refused with 412.
    pub refused: u64,
    /// Retries that did not: their handler found the reference (409 with the payment).
    pub settled_by_reference: u64,
}

impl DemoReport {
    /// Every logical payment succeeded and exists exactly once; late, every retry was
    /// refused or settled by its reference instead of creating the payment again.
    pub fn is_exact(&self) -> bool {
        let settled = match &self.late {
            None => 0,
            Some(l) if l.refused + l.settled_by_reference == l.retried => l.retried,
            Some(_) => return false,
        };
        self.failures.is_empty()
            && self.succeeded.saturating_add(settled) == self.operations
            && self.payments_created == self.operations as i64
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
        let late = self.late.iter().flat_map(|l| {
            [
                ("retried a day late", l.retried.to_string()),
                ("refused (412)", l.refused.to_string()),
                ("settled by reference", l.settled_by_reference.to_string()),
            ]
        });
        let rows: Vec<_> = rows.into_iter().chain(late).collect();
        let mut out = String::new();
        for (name, value) in rows {
            out.push_str(&format!("  {name:<22} {value:>8}\n"));
        }
        for failure in &self.failures {
            out.push_str(&format!("  failure: {failure}\n"));
        }
        if let Some(l) = self.late.as_ref().filter(|_| self.is_exact()) {
            out.push_str(&format!(
                "VERDICT: OK: {} logical payments, {} created, none twice; {} retried after the purge: {} refused (412), {} settled by reference (409)\n",
                self.operations, self.payments_created, l.retried, l.refused, l.settled_by_reference
            ));
        } else if self.is_exact() {
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

/// The late demo's server clock: the system clock, moved forward by hand.
#[derive(Debug, Default)]
struct SkippedClock(AtomicI64);

impl SkippedClock {
    fn skip(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for SkippedClock {
    fn now(&self) -> Timestamp {
        Timestamp(
            Timestamp::now()
                .as_millis()
                .saturating_add(self.0.load(Ordering::SeqCst)),
        )
    }

    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// The demo server's retention.
const RETENTION: Duration = Duration::from_secs(24 * 3600);

async fn start_server<S: AppDb>(db: S, clock: Arc<dyn Clock>) -> anyhow::Result<SocketAddr> {
    db.migrate_all().await.context("migrations failed")?;
    // A throwaway key secret: see the module documentation.
    let mut secret = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut secret);
    let secrets = KeySecrets::new(secret.to_vec(), None);
    let config = AppConfig {
        api_keys: ApiKeys::new([("demo".to_owned(), TOKEN.to_owned())])?,
        simulate_latency: Duration::ZERO,
        retention: RETENTION,
        in_flight: InFlightPolicy::default(),
        first_sent: Default::default(),
        clock,
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

/// A payment whose answer was lost, as a client that kept it would remember it.
struct Lost {
    i: usize,
    key: String,
    first_attempt_at: std::time::SystemTime,
}

/// The body of payment `i`; its reference is unique per payment.
fn payment_body(i: usize) -> serde_json::Value {
    serde_json::json!({
        "amount": 100 + i,
        "currency": "EUR",
        "customer": format!("customer-{}", i % 50),
        "description": format!("demo payment {i}"),
        "reference": format!("invoice-{i}"),
    })
}

/// Runs the demo. The server and the proxy stop with the returned future's runtime.
pub async fn run(options: DemoOptions) -> anyhow::Result<DemoReport> {
    let dir = tempfile::tempdir()?;
    let url = match &options.database_url {
        Some(url) => url.to_string(),
        None => format!("sqlite:{}", dir.path().join("demo.db").display()),
    };
    let mut database = DatabaseOptions::new(url.clone(), 32);
    database.lock_wait = InFlightPolicy::DEFAULT_WAIT;
    with_database(&url, Demo { database, options }).await
}

/// The demo on the database `database` names.
struct Demo {
    database: DatabaseOptions,
    options: DemoOptions,
}

impl OnDatabase for Demo {
    type Output = DemoReport;

    async fn run<S: Backend>(self) -> anyhow::Result<DemoReport> {
        let db = S::connect(&self.database).await?;
        run_on(db, self.options).await
    }
}

/// Runs the demo on `db`.
async fn run_on<S: AppDb>(db: S, options: DemoOptions) -> anyhow::Result<DemoReport> {
    let clock = Arc::new(SkippedClock::default());
    let server = start_server(db.clone(), clock.clone()).await?;
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
    let policy = RetryPolicy::new()
        .with_initial_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(250))
        .with_max_attempts(100)
        .with_max_elapsed(Duration::from_secs(120));
    // Late, a lost answer ends the first pass (the client stopped, keeping the operation).
    let first_pass = if options.late {
        policy.clone().with_max_attempts(1)
    } else {
        policy.clone()
    };
    let client = IdempotentClient::with_policy(http.clone(), first_pass);
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
    let late = options.late;
    type Sent = Result<bool, Result<Lost, String>>;
    let results: Vec<Sent> = futures::stream::iter(0..options.operations)
        .map(|i| {
            let (client, url, attempts, bar) =
                (client.clone(), url.clone(), attempts.clone(), bar.clone());
            async move {
                // One logical payment = one key, made before the first attempt.
                let op = Operation::new();
                let request = client
                    .inner()
                    .post(&url)
                    .bearer_auth(TOKEN)
                    .json(&payment_body(i));
                let result = match client.send(&op, request).await {
                    Ok(response) => {
                        attempts.fetch_add(u64::from(response.attempts()), Ordering::Relaxed);
                        if response.status() == reqwest::StatusCode::CREATED {
                            Ok(response.is_replayed())
                        } else {
                            Err(Err(format!("payment {i}: status {}", response.status())))
                        }
                    }
                    Err(e @ Error::GaveUp { .. }) if late => {
                        attempts.fetch_add(u64::from(e.attempts()), Ordering::Relaxed);
                        Err(Ok(Lost {
                            i,
                            key: op.key().to_owned(),
                            first_attempt_at: op
                                .first_attempt_at()
                                .unwrap_or_else(std::time::SystemTime::now),
                        }))
                    }
                    Err(e) => {
                        attempts.fetch_add(u64::from(e.attempts()), Ordering::Relaxed);
                        Err(Err(format!("payment {i}: {e}")))
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

    let mut failures: Vec<String> = Vec::new();
    let mut lost = Vec::new();
    for result in &results {
        match result {
            Err(Err(failure)) => failures.push(failure.clone()),
            Err(Ok(l)) => lost.push(l),
            Ok(_) => {}
        }
    }
    let late = if options.late {
        // A day passes on the server's clock, and the purge deletes every record.
        clock.skip(RETENTION + Duration::from_secs(3600));
        let now = clock.now();
        protocol::purge_expired(&db, now, 1000).await?;
        let mut report = LateReport::default();
        let direct = format!("http://{server}/v1/payments");
        let client = IdempotentClient::with_policy(http.clone(), policy);
        for l in lost {
            report.retried += 1;
            if l.i % 2 == 0 {
                // The client, resuming the operation: it states the first attempt's time.
                let op = Operation::resume(l.key.clone(), l.first_attempt_at)?;
                let request = client
                    .inner()
                    .post(&direct)
                    .bearer_auth(TOKEN)
                    .json(&payment_body(l.i));
                match client.send(&op, request).await {
                    Err(Error::FirstSentExpired { problem, .. })
                        if problem.is(FIRST_SENT_EXPIRED.uri) =>
                    {
                        report.refused += 1;
                    }
                    other => failures.push(format!(
                        "late payment {}: {:?}",
                        l.i,
                        other.map(|r| r.status())
                    )),
                }
            } else {
                // A client of its own: the same key, without the first attempt's time.
                let response = http
                    .post(&direct)
                    .bearer_auth(TOKEN)
                    .header("idempotency-key", &l.key)
                    .json(&payment_body(l.i))
                    .send()
                    .await?;
                let status = response.status();
                let problem: serde_json::Value = response.json().await.unwrap_or_default();
                if status == reqwest::StatusCode::CONFLICT
                    && problem["type"] == PAYMENT_REFERENCE_USED.uri
                    && problem["payment_id"].is_string()
                {
                    report.settled_by_reference += 1;
                } else {
                    failures.push(format!("late payment {}: status {status}: {problem}", l.i));
                }
            }
        }
        Some(report)
    } else {
        None
    };

    let after = payments_total(&http, server).await?;
    Ok(DemoReport {
        operations: options.operations as u64,
        succeeded: results.iter().filter(|r| r.is_ok()).count() as u64,
        transport_attempts: attempts.load(Ordering::Relaxed),
        lost_responses: proxy.stats().responses_lost,
        replays: results.iter().filter(|r| matches!(r, Ok(true))).count() as u64,
        payments_created: after - before,
        failures: failures.into_iter().take(5).collect(),
        late,
    })
}
