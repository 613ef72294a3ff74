//! Load from the real client for the chaos scenarios, and the audit of what the database
//! holds afterwards.
//!
//! [`payments`] runs `ops` logical payments, each one [`Operation`] (one key) sent with
//! [`IdempotentClient`] and retried by it, `concurrency` at a time, round-robin over the
//! servers; each payment's `description` is `op-<index>`, so the audit can tell every
//! logical operation's rows apart. [`Progress`] lets a test start its fault once a number of
//! operations are done, without sleeping. [`Audit`] reads payments, ledger entries and
//! idempotency records back and counts duplicates and orphans; [`row`] prints the one line
//! per scenario that `scripts/chaos.sh` collects.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use idemkey_client::{IdempotentClient, Operation, RetryPolicy};
use serde_json::{Value, json};

/// How many operations a scenario runs: `default` in CI, `$CHAOS_OPS` when set (the script).
pub(crate) fn scaled(default: usize) -> usize {
    env_number("CHAOS_OPS").unwrap_or(default)
}

/// How many times a scenario repeats its fault: `default`, or `$CHAOS_ITERATIONS`.
pub(crate) fn iterations(default: usize) -> usize {
    env_number("CHAOS_ITERATIONS").unwrap_or(default).max(1)
}

fn env_number(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// The client's policy in these scenarios: patient enough to ride out a database restart
/// (up to 60 s and 100 attempts per call), `Retry-After` honoured.
pub(crate) fn patient_policy() -> RetryPolicy {
    RetryPolicy::new()
        .with_initial_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(1))
        .with_max_attempts(100)
        .with_max_elapsed(Duration::from_secs(60))
        .with_attempt_timeout(Duration::from_secs(15))
}

/// A client on that policy.
pub(crate) fn client(policy: RetryPolicy) -> IdempotentClient {
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("an HTTP client");
    IdempotentClient::with_policy(http, policy)
}

/// Operations finished so far; a fault task waits for a count.
#[derive(Debug, Clone)]
pub(crate) struct Progress(Arc<tokio::sync::watch::Sender<usize>>);

impl Default for Progress {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::channel(0).0))
    }
}

impl Progress {
    fn bump(&self) {
        self.0.send_modify(|n| *n += 1);
    }

    /// Waits until `n` operations have finished (bounded: 120 s).
    pub(crate) async fn until(&self, n: usize) {
        let mut rx = self.0.subscribe();
        tokio::time::timeout(Duration::from_secs(120), rx.wait_for(|done| *done >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} operations did not finish within 120 s"))
            .expect("the progress sender lives");
    }
}

/// What one logical operation ended with.
#[derive(Debug)]
pub(crate) struct OpResult {
    /// Its index (`op-<index>` in the payment's description).
    pub(crate) index: usize,
    /// The operation: its key, to retry it later with the same key.
    pub(crate) op: Operation,
    /// `Ok((status, replayed, attempts, payment id))` or the client's error, as text.
    pub(crate) outcome: Result<(u16, bool, u32, String), String>,
    /// When the client returned.
    pub(crate) done_at: Instant,
}

impl OpResult {
    /// Whether the client reported a created payment.
    pub(crate) fn succeeded(&self) -> bool {
        matches!(self.outcome, Ok((201, ..)))
    }
}

/// The body of logical payment `index`.
pub(crate) fn body(index: usize) -> Value {
    json!({
        "amount": 100 + index as i64,
        "currency": "EUR",
        "customer": "chaos",
        "description": format!("op-{index}"),
    })
}

/// Sends logical payment `index` as `op` to `base` with `token`; waits for the client's
/// final word.
pub(crate) async fn pay(
    client: &IdempotentClient,
    base: &str,
    token: &str,
    index: usize,
    op: Operation,
) -> OpResult {
    let request = client
        .inner()
        .post(format!("{base}/v1/payments"))
        .bearer_auth(token)
        .json(&body(index));
    let outcome = match client.send(&op, request).await {
        Ok(response) => {
            let id = response
                .json::<Value>()
                .ok()
                .and_then(|v| v["id"].as_str().map(str::to_owned))
                .unwrap_or_default();
            Ok((
                response.status().as_u16(),
                response.is_replayed(),
                response.attempts(),
                id,
            ))
        }
        Err(e) => Err(format!("{e} ({} attempts)", e.attempts())),
    };
    OpResult {
        index,
        op,
        outcome,
        done_at: Instant::now(),
    }
}

/// Runs logical payments `range`, `concurrency` at a time, round-robin over `bases`.
pub(crate) async fn payments(
    client: &IdempotentClient,
    bases: &[String],
    token: &str,
    range: std::ops::Range<usize>,
    concurrency: usize,
    progress: &Progress,
) -> Vec<OpResult> {
    futures::stream::iter(range)
        .map(|index| {
            let base = bases[index % bases.len()].clone();
            async move {
                let result = pay(client, &base, token, index, Operation::new()).await;
                progress.bump();
                result
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await
}

/// Retries every operation that did not succeed, with its own key, one at a time; returns
/// how many of them succeeded now.
pub(crate) async fn retry_failed(
    client: &IdempotentClient,
    base: &str,
    token: &str,
    results: &mut [OpResult],
) -> usize {
    let mut fixed = 0;
    for result in results.iter_mut().filter(|r| !r.succeeded()) {
        let again = pay(client, base, token, result.index, result.op.clone()).await;
        if again.succeeded() {
            fixed += 1;
        }
        *result = again;
    }
    fixed
}

/// The longest time after `fault` during which no operation succeeded: how long the service
/// was out, as its clients saw it.
pub(crate) fn longest_stall(results: &[OpResult], fault: Instant) -> Duration {
    let mut done: Vec<Instant> = results
        .iter()
        .filter(|r| r.succeeded())
        .map(|r| r.done_at)
        .collect();
    done.sort();
    let mut previous = fault;
    let mut longest = Duration::ZERO;
    for at in done.into_iter().filter(|at| *at >= fault) {
        longest = longest.max(at - previous);
        previous = at;
    }
    longest
}

/// Reads the audit's rows on a pool of either kind (the SQL is the same on both).
macro_rules! audit_rows {
    ($pool:expr) => {{
        let records: Vec<(String, Option<i32>, Option<Vec<u8>>)> =
            sqlx::query_as("SELECT state, response_status, response_body FROM idemkey_records")
                .fetch_all($pool)
                .await
                .expect("read idemkey_records");
        let payments: Vec<(String, Option<String>)> =
            sqlx::query_as("SELECT id, description FROM payments")
                .fetch_all($pool)
                .await
                .expect("read payments");
        let ledger: Vec<String> = sqlx::query_scalar("SELECT payment_id FROM ledger_entries")
            .fetch_all($pool)
            .await
            .expect("read ledger_entries");
        Audit::from_rows(records, payments, ledger)
    }};
}

/// What the database holds, read back after a scenario.
#[derive(Debug, Default)]
pub(crate) struct Audit {
    /// Idempotency records, by state.
    pub(crate) states: BTreeMap<String, usize>,
    /// Payment rows.
    pub(crate) payments: usize,
    /// Ledger rows.
    pub(crate) ledger: usize,
    /// Rows beyond the first for one logical operation (same `op-N`), plus ledger rows
    /// beyond the first for one payment.
    pub(crate) duplicates: usize,
    /// Completed records whose stored payment does not exist.
    pub(crate) records_without_effect: usize,
    /// Payments no completed record names, and ledger rows without their payment (or
    /// payments without their ledger row).
    pub(crate) effects_without_record: usize,
    /// Payments per logical operation (`op-N` → ids).
    pub(crate) by_op: BTreeMap<String, Vec<String>>,
}

impl Audit {
    /// Reads a PostgreSQL database.
    pub(crate) async fn postgres(url: &str) -> Self {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .expect("connect to PostgreSQL for the audit");
        let audit = audit_rows!(&pool);
        pool.close().await;
        audit
    }

    /// Reads a SQLite database.
    pub(crate) async fn sqlite(url: &str) -> Self {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .expect("open SQLite for the audit");
        let audit = audit_rows!(&pool);
        pool.close().await;
        audit
    }

    fn from_rows(
        records: Vec<(String, Option<i32>, Option<Vec<u8>>)>,
        payments: Vec<(String, Option<String>)>,
        ledger: Vec<String>,
    ) -> Self {
        let mut audit = Audit {
            payments: payments.len(),
            ledger: ledger.len(),
            ..Audit::default()
        };
        let mut stored = BTreeSet::new();
        for (state, status, body) in &records {
            *audit.states.entry(state.clone()).or_default() += 1;
            if state == "completed" && *status == Some(201) {
                let id = body
                    .as_deref()
                    .and_then(|b| serde_json::from_slice::<Value>(b).ok())
                    .and_then(|v| v["id"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                stored.insert(id);
            }
        }
        let ids: BTreeSet<String> = payments.iter().map(|(id, _)| id.clone()).collect();
        for (id, description) in payments {
            audit
                .by_op
                .entry(description.unwrap_or_default())
                .or_default()
                .push(id);
        }
        audit.duplicates = audit
            .by_op
            .values()
            .map(|ids| ids.len().saturating_sub(1))
            .sum();
        let mut per_payment: BTreeMap<&str, usize> = BTreeMap::new();
        for id in &ledger {
            *per_payment.entry(id.as_str()).or_default() += 1;
        }
        audit.duplicates += per_payment
            .values()
            .map(|n| n.saturating_sub(1))
            .sum::<usize>();
        audit.records_without_effect = stored.iter().filter(|id| !ids.contains(*id)).count();
        audit.effects_without_record = ids.iter().filter(|id| !stored.contains(*id)).count()
            + per_payment.keys().filter(|id| !ids.contains(**id)).count()
            + ids
                .iter()
                .filter(|id| !per_payment.contains_key(id.as_str()))
                .count();
        audit
    }

    /// Records in any state.
    pub(crate) fn records(&self) -> usize {
        self.states.values().sum()
    }

    /// Asserts that nothing is duplicated or orphaned, and that every operation the client
    /// reported successful has exactly one payment, the one its answer named.
    #[track_caller]
    pub(crate) fn assert_exactly_once(&self, results: &[OpResult]) {
        assert_eq!(self.duplicates, 0, "duplicates: {self:?}");
        assert_eq!(self.records_without_effect, 0, "records without effect");
        assert_eq!(self.effects_without_record, 0, "effects without record");
        for r in results.iter().filter(|r| r.succeeded()) {
            let Ok((_, _, _, id)) = &r.outcome else {
                unreachable!()
            };
            let found = self.by_op.get(&format!("op-{}", r.index));
            assert_eq!(
                found.map(Vec::as_slice),
                Some(std::slice::from_ref(id)),
                "op-{}: the client was told {id}",
                r.index
            );
        }
    }

    /// Asserts records = payments = ledger rows = `n`, every record completed.
    #[track_caller]
    pub(crate) fn assert_all(&self, n: usize) {
        assert_eq!(self.states.get("completed").copied(), Some(n), "{self:?}");
        assert_eq!(self.records(), n, "records: {:?}", self.states);
        assert_eq!(self.payments, n, "payments");
        assert_eq!(self.ledger, n, "ledger rows");
        assert_eq!(self.by_op.len(), n, "logical operations with a payment");
    }
}

/// One scenario's figures, as `scripts/chaos.sh` collects them.
#[derive(Debug, Default)]
pub(crate) struct Row<'a> {
    pub(crate) scenario: &'a str,
    pub(crate) ops: usize,
    pub(crate) failed: usize,
    pub(crate) duplicates: usize,
    pub(crate) records_without_effect: usize,
    pub(crate) effects_without_record: usize,
    pub(crate) recovery: Option<Duration>,
    pub(crate) notes: String,
}

/// Prints `row` as one `CHAOS-ROW|…` line (stderr; the test harness shows it with
/// `--nocapture`, and `scripts/chaos.sh` turns these lines into a table).
pub(crate) fn row(row: &Row<'_>) {
    let recovery = row
        .recovery
        .map_or_else(|| "-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()));
    eprintln!(
        "CHAOS-ROW|{}|{}|{}|{}|{}|{}|{}|{}",
        row.scenario,
        row.ops,
        row.failed,
        row.duplicates,
        row.records_without_effect,
        row.effects_without_record,
        recovery,
        row.notes
    );
}

/// Figures of a load run and its audit, as a [`Row`].
pub(crate) fn row_of<'a>(
    scenario: &'a str,
    results: &[OpResult],
    failed_before_retry: usize,
    audit: &Audit,
    recovery: Option<Duration>,
    notes: String,
) -> Row<'a> {
    Row {
        scenario,
        ops: results.len(),
        failed: failed_before_retry,
        duplicates: audit.duplicates,
        records_without_effect: audit.records_without_effect,
        effects_without_record: audit.effects_without_record,
        recovery,
        notes,
    }
}

/// Transport attempts the successful operations took, and how many needed more than one.
pub(crate) fn attempts(results: &[OpResult]) -> (u64, usize) {
    let mut total = 0u64;
    let mut retried = 0;
    for r in results {
        if let Ok((_, _, attempts, _)) = &r.outcome {
            total += u64::from(*attempts);
            if *attempts > 1 {
                retried += 1;
            }
        }
    }
    (total, retried)
}
