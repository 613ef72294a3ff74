//! End-to-end scenarios of the `idemkey` binary, shared by the SQLite and the PostgreSQL test
//! files.
//!
//! A [`Backend`] is one test's database and the factory of the servers on it: every server a
//! scenario starts (`idemkey serve --listen 127.0.0.1:0 …` as a child process) uses the same
//! database, so a restarted server, or three servers at once, see the same records and the
//! same key-hashing secret. [`e2e_scenarios!`] expands every scenario into a `#[tokio::test]`
//! for one backend.
//!
//! Scenarios assert exact counts: payments through the API (`total`), and, read directly from
//! the database, idempotency records, payments and ledger entries, and that every completed
//! `201` record names a payment that exists.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime};

use futures::future::join_all;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

pub(crate) mod cluster;
pub(crate) mod gateway;
pub(crate) mod load;
pub(crate) mod pgbouncer;

/// Tenant `t1`'s token.
pub(crate) const TOKEN1: &str = "tok1";
/// Tenant `t2`'s token.
pub(crate) const TOKEN2: &str = "tok2";

/// The route every keyed request here goes to.
const PAYMENTS: &str = "/v1/payments";
/// How long the client waits for one answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to print its address.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounded retry loops: attempts and pause.
const RETRY_ATTEMPTS: usize = 50;
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Reads a [`Snapshot`] on a pool of either kind (the SQL is the same on both).
macro_rules! read_snapshot {
    ($pool:expr) => {{
        let records: Vec<(String, Option<i32>, Option<Vec<u8>>)> =
            sqlx::query_as("SELECT state, response_status, response_body FROM idemkey_records")
                .fetch_all($pool)
                .await
                .expect("read idemkey_records");
        let payments: Vec<String> = sqlx::query_scalar("SELECT id FROM payments")
            .fetch_all($pool)
            .await
            .expect("read payments");
        let ledger: Vec<String> = sqlx::query_scalar("SELECT payment_id FROM ledger_entries")
            .fetch_all($pool)
            .await
            .expect("read ledger_entries");
        Snapshot {
            records,
            payments,
            ledger,
        }
    }};
}

/// Which database the servers run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `sqlite:<tempdir>/idemkey.db`.
    Sqlite,
    /// A fresh database on the test PostgreSQL server.
    Postgres,
}

/// One test's database, and the factory of `idemkey serve` processes on it.
#[derive(Debug)]
pub(crate) struct Backend {
    kind: Kind,
    url: String,
    /// The same database, never through a pooler: what the test itself reads.
    direct: String,
    /// The SQLite file and the servers' logs.
    dir: tempfile::TempDir,
    started: AtomicUsize,
}

impl Backend {
    /// A new SQLite database in a temporary directory.
    pub(crate) async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!("sqlite:{}", dir.path().join("idemkey.db").display());
        Self {
            kind: Kind::Sqlite,
            direct: url.clone(),
            url,
            dir,
            started: AtomicUsize::new(0),
        }
    }

    /// A fresh database on the test PostgreSQL server.
    pub(crate) async fn postgres() -> Self {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Self {
            kind: Kind::Postgres,
            direct: url.clone(),
            url,
            dir: tempfile::tempdir().expect("temporary directory"),
            started: AtomicUsize::new(0),
        }
    }

    /// The kind of database.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// The database URL the servers get.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Starts `idemkey serve` on this database with tenants `t1`/`tok1` and `t2`/`tok2` and
    /// `extra` flags; returns once it has printed its address.
    pub(crate) async fn start(&self, extra: &[&str]) -> Server {
        let n = self.started.fetch_add(1, Ordering::SeqCst);
        let log = self.dir.path().join(format!("server-{n}.log"));
        let url = self.url.clone();
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        tokio::task::spawn_blocking(move || Server::spawn(&url, &extra, log))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// What the database holds, read directly with sqlx.
    pub(crate) async fn snapshot(&self) -> Snapshot {
        match self.kind {
            Kind::Sqlite => {
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect(&self.direct)
                    .await
                    .expect("open the SQLite database");
                let snapshot = read_snapshot!(&pool);
                pool.close().await;
                snapshot
            }
            Kind::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&self.direct)
                    .await
                    .expect("connect to PostgreSQL");
                let snapshot = read_snapshot!(&pool);
                pool.close().await;
                snapshot
            }
        }
    }

    /// PostgreSQL: how many sessions on this database are inside an open transaction
    /// (the handlers sleeping in `--simulate-latency`). `None` on SQLite.
    pub(crate) async fn open_transactions(&self) -> Option<i64> {
        if self.kind != Kind::Postgres {
            return None;
        }
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.direct)
            .await
            .expect("connect to PostgreSQL");
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND state = 'idle in transaction'",
        )
        .fetch_one(&pool)
        .await
        .expect("read pg_stat_activity");
        pool.close().await;
        Some(n)
    }
}

/// The rows that matter, read directly from the database.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// `(state, response_status, response_body)` of every idempotency record.
    pub(crate) records: Vec<(String, Option<i32>, Option<Vec<u8>>)>,
    /// Every payment id.
    pub(crate) payments: Vec<String>,
    /// The payment id of every ledger entry.
    pub(crate) ledger: Vec<String>,
}

impl Snapshot {
    /// Records in state `completed`.
    pub(crate) fn completed(&self) -> usize {
        self.records.iter().filter(|r| r.0 == "completed").count()
    }

    /// Asserts `n` completed `201` records, `n` payments, `n` ledger entries, no record in
    /// another state, and that the payments are exactly the ones the stored bodies name.
    pub(crate) fn assert_consistent(&self, n: usize) {
        let states: BTreeMap<&str, usize> =
            self.records.iter().fold(BTreeMap::new(), |mut m, r| {
                *m.entry(r.0.as_str()).or_default() += 1;
                m
            });
        assert_eq!(self.records.len(), n, "idempotency records: {states:?}");
        assert_eq!(self.completed(), n, "completed records: {states:?}");
        assert_eq!(self.payments.len(), n, "payments");
        assert_eq!(self.ledger.len(), n, "ledger entries");
        let payments: BTreeSet<&str> = self.payments.iter().map(String::as_str).collect();
        let ledger: BTreeSet<&str> = self.ledger.iter().map(String::as_str).collect();
        assert_eq!(payments, ledger, "one ledger entry per payment");
        let stored: BTreeSet<String> = self
            .records
            .iter()
            .map(|(_, status, body)| {
                assert_eq!(*status, Some(201), "stored status");
                let body: Value =
                    serde_json::from_slice(body.as_deref().expect("stored body")).expect("json");
                body["id"].as_str().expect("stored payment id").to_owned()
            })
            .collect();
        let stored: BTreeSet<&str> = stored.iter().map(String::as_str).collect();
        assert_eq!(
            stored, payments,
            "every record's stored payment exists, and every payment has its record"
        );
    }
}

/// Reads a child's `stdout` to its end on a thread of its own (a process that prints again
/// when it stops must not meet a closed pipe), keeping its lines. The channel gets what
/// follows `announce` on the first line that starts with it: the address a server listens on.
pub(crate) fn read_stdout(
    stdout: ChildStdout,
    announce: &'static str,
) -> (mpsc::Receiver<String>, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    let kept = lines.clone();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(base) = line.strip_prefix(announce)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(base.trim().to_owned());
            }
            kept.lock().unwrap().push(line);
        }
    });
    (rx, lines)
}

/// A running `idemkey serve`; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub(crate) struct Server {
    child: Option<Child>,
    pid: u32,
    base: String,
    log: PathBuf,
    stdout: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn spawn(url: &str, extra: &[String], log: PathBuf) -> Self {
        let stderr = std::fs::File::create(&log).expect("server log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url", url])
            .args(["--api-key", "t1=tok1", "--api-key", "t2=tok2"])
            .args(extra)
            .env_remove("IDEMKEY_API_KEYS")
            .env_remove("IDEMKEY_KEY_SECRET")
            .envs(postgres_secret([url]))
            .env_remove("IDEMKEY_DATABASE_URL")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start idemkey serve");
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        let (rx, lines) = read_stdout(stdout, "idemkey listening on ");
        let mut server = Self {
            child: Some(child),
            pid,
            base: String::new(),
            log,
            stdout: lines,
        };
        match rx.recv_timeout(STARTUP_TIMEOUT) {
            Ok(base) => {
                assert!(
                    base.starts_with("http://127.0.0.1:"),
                    "unexpected address {base}"
                );
                server.base = base;
                server
            }
            Err(e) => {
                server.kill9();
                panic!(
                    "idemkey serve did not print its address ({e}); log:\n{}",
                    server.log_tail()
                );
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// A client for this server.
    pub(crate) fn api(&self) -> Api {
        Api::new(&self.base)
    }

    /// SIGKILL, then reap.
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM (graceful shutdown), via `kill -TERM <pid>`.
    pub(crate) fn sigterm(&self) {
        assert!(self.child.is_some(), "the server has already exited");
        let status = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {} failed", self.pid);
    }

    /// Waits (bounded) for the process to exit by itself.
    pub(crate) async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self
                .child
                .as_mut()
                .expect("the server has already been reaped");
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            if Instant::now() >= deadline {
                self.kill9();
                panic!(
                    "the server did not exit within {timeout:?}; log:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Everything the server printed on stdout so far.
    pub(crate) fn stdout(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// The server's whole log (stderr) so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The end of the server's log (stderr).
    pub(crate) fn log_tail(&self) -> String {
        tail(&self.log, 40)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// An answer, read whole.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// The body as JSON.
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "answer {} is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header's value as text.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Whether `idempotent-replayed: true` is present.
    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The problem `type` of a problem+json answer.
    pub(crate) fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "status {}: {}",
            self.status,
            self.text()
        );
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }

    /// The body as text, for messages.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts a problem answer with this status and type name.
    #[track_caller]
    pub(crate) fn assert_problem(&self, status: u16, name: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.problem_type(), format!("urn:idemkey:problem:{name}"));
    }

    /// Asserts a `409 request-in-flight` with a `Retry-After` of at least one second.
    #[track_caller]
    pub(crate) fn assert_in_flight(&self) {
        self.assert_problem(409, "request-in-flight");
        let retry_after: u64 = self
            .header("retry-after")
            .expect("409 carries Retry-After")
            .parse()
            .expect("Retry-After in seconds");
        assert!(retry_after >= 1, "Retry-After {retry_after}");
    }
}

/// A client of one server.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    /// A client of the server at `base`.
    pub(crate) fn new(base: &str) -> Self {
        Self::with(base, reqwest::Client::builder())
    }

    /// A client that opens a new connection for every request.
    pub(crate) fn without_keep_alive(base: &str) -> Self {
        Self::with(base, reqwest::Client::builder().pool_max_idle_per_host(0))
    }

    fn with(base: &str, builder: reqwest::ClientBuilder) -> Self {
        let client = builder
            .no_proxy()
            .timeout(CLIENT_TIMEOUT)
            .build()
            .expect("http client");
        Self {
            client,
            base: base.to_owned(),
        }
    }

    /// `POST /v1/payments` with a JSON `body`, `Authorization: Bearer token` (if any) and
    /// one `Idempotency-Key` field per item of `keys`, each sent as is.
    pub(crate) async fn post_raw(
        &self,
        token: Option<&str>,
        keys: &[&[u8]],
        body: impl Into<reqwest::Body>,
    ) -> Result<Answer, reqwest::Error> {
        self.post(PAYMENTS, "application/json", token, keys, body)
            .await
    }

    /// `POST path` with `Content-Type: content_type`, `Authorization: Bearer token` (if
    /// any) and one `Idempotency-Key` field per item of `keys`, each sent as is.
    pub(crate) async fn post(
        &self,
        path: &str,
        content_type: &'static str,
        token: Option<&str>,
        keys: &[&[u8]],
        body: impl Into<reqwest::Body>,
    ) -> Result<Answer, reqwest::Error> {
        let mut headers = HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static(content_type),
        );
        if let Some(token) = token {
            headers.insert(
                reqwest::header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {token}")).expect("token"),
            );
        }
        for key in keys {
            headers.append(
                HeaderName::from_static("idempotency-key"),
                HeaderValue::from_bytes(key).expect("a sendable header value"),
            );
        }
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .headers(headers)
            .body(body)
            .send()
            .await?;
        read(response).await
    }

    /// `POST /v1/payments` as `token` with key `key`.
    pub(crate) async fn pay(
        &self,
        token: &str,
        key: &str,
        body: &str,
    ) -> Result<Answer, reqwest::Error> {
        self.post_raw(Some(token), &[key.as_bytes()], body.to_owned())
            .await
    }

    /// Like [`pay`](Self::pay), panicking on a transport error.
    pub(crate) async fn pay_ok(&self, token: &str, key: &str, body: &str) -> Answer {
        self.pay(token, key, body)
            .await
            .unwrap_or_else(|e| panic!("POST {PAYMENTS} with key {key:?}: {e:?}"))
    }

    /// Like [`pay`](Self::pay), retrying (bounded) only when the connection fails before an
    /// answer arrives. The layer answers 413 to a declared over-limit body without reading
    /// it and the connection is then closed with unread data, so the client may see a TCP
    /// reset instead of the 413 (see [`contract_refused_bodies_leave_the_key_free`]).
    pub(crate) async fn pay_answered(&self, token: &str, key: &str, body: &str) -> Answer {
        let mut errors = Vec::new();
        for _ in 0..10 {
            match self.pay(token, key, body).await {
                Ok(answer) => {
                    if !errors.is_empty() {
                        eprintln!(
                            "key {key}: answered after {} lost answers: {errors:?}",
                            errors.len()
                        );
                    }
                    return answer;
                }
                Err(e) => errors.push(format!("{e:?}")),
            }
        }
        panic!("key {key}: no answer in 10 attempts: {errors:?}");
    }

    /// `GET path` with an optional bearer token.
    pub(crate) async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        let mut request = self.client.get(format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        read(response)
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// The tenant's payment count (`total` of `GET /v1/payments?limit=1`).
    pub(crate) async fn total(&self, token: &str) -> i64 {
        let answer = self.get("/v1/payments?limit=1", Some(token)).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        answer.json()["total"].as_i64().expect("total")
    }

    /// A counter of `/metrics`, by its full series name (e.g.
    /// `idemkey_requests_total{outcome="replayed"}`).
    pub(crate) async fn metric(&self, series: &str) -> u64 {
        let answer = self.get("/metrics", None).await;
        assert_eq!(answer.status, 200);
        let text = answer.text();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
            .trim()
            .parse()
            .expect("a counter")
    }

    /// Retries `POST /v1/payments` (bounded) until it answers 201; 409, 503 and transport
    /// errors are retried, anything else fails the test.
    pub(crate) async fn pay_until_created(&self, token: &str, key: &str, body: &str) -> Answer {
        let mut last = String::new();
        for _ in 0..RETRY_ATTEMPTS {
            match self.pay(token, key, body).await {
                Ok(answer) if answer.status == 201 => return answer,
                Ok(answer) if matches!(answer.status, 409 | 503) => {
                    last = format!("{} {}", answer.status, answer.text());
                }
                Ok(answer) => panic!("key {key}: unexpected {} {}", answer.status, answer.text()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        panic!("key {key}: no 201 after {RETRY_ATTEMPTS} attempts; last: {last}");
    }
}

async fn read(response: reqwest::Response) -> Result<Answer, reqwest::Error> {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// Asserts that `idempotency-key-expires` is an HTTP date `retention` from now (give or
/// take the header's one-second precision and the test's own delays).
#[track_caller]
pub(crate) fn assert_expires_in(answer: &Answer, retention: Duration) {
    let now = SystemTime::now();
    assert_expiry(answer, now - Duration::from_secs(5), now, retention);
}

/// Asserts that `idempotency-key-expires` is `retention` after a claim made between `from`
/// and `to` (to the header's one-second precision).
#[track_caller]
pub(crate) fn assert_expiry(
    answer: &Answer,
    from: SystemTime,
    to: SystemTime,
    retention: Duration,
) {
    let value = answer
        .header("idempotency-key-expires")
        .expect("idempotency-key-expires");
    let at = httpdate::parse_http_date(value).expect("an HTTP date");
    let second = Duration::from_secs(1);
    assert!(
        at + second >= from + retention && at <= to + retention + second,
        "idempotency-key-expires {value} is not {retention:?} after a claim between {} and {}",
        httpdate::fmt_http_date(from),
        httpdate::fmt_http_date(to),
    );
}

/// The key secret the tests give `serve`, `gateway` and `keys` on PostgreSQL, where one is
/// required (SQLite tests use the database-kept default): as `IDEMKEY_KEY_SECRET`.
pub(crate) fn postgres_secret<'a>(
    args: impl IntoIterator<Item = &'a str>,
) -> Vec<(&'static str, &'static str)> {
    if args.into_iter().any(|a| a.starts_with("postgres")) {
        vec![(
            "IDEMKEY_KEY_SECRET",
            "a test secret, apart from the database",
        )]
    } else {
        Vec::new()
    }
}

/// Runs the `idemkey` binary with `args` to completion; returns its stdout (panics on
/// failure).
pub(crate) async fn idemkey_cli(args: Vec<String>) -> String {
    tokio::task::spawn_blocking(move || {
        let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(&args)
            .env_remove("IDEMKEY_API_KEYS")
            .env_remove("IDEMKEY_KEY_SECRET")
            .envs(postgres_secret(args.iter().map(String::as_str)))
            .env_remove("IDEMKEY_DATABASE_URL")
            .stdin(Stdio::null())
            .output()
            .expect("run idemkey");
        assert!(
            output.status.success(),
            "idemkey {args:?}: {:?}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).expect("UTF-8 output")
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// A payment request body.
pub(crate) fn payment(amount: i64, description: &str) -> String {
    json!({
        "amount": amount,
        "currency": "EUR",
        "customer": "c1",
        "description": description,
    })
    .to_string()
}

/// The per-key result of a race.
#[derive(Debug, Default)]
struct RaceCounts {
    created: usize,
    in_flight: usize,
}

/// Checks the answers of a race, grouped by key: every answer is a 201 (or, when
/// `allow_in_flight`, a 409 request-in-flight with Retry-After); per key, exactly one 201
/// executed (no `idempotent-replayed: true`) and every 201 has the same body and Location.
/// Returns the executed answer of each key.
fn check_race(
    results: Vec<(usize, Result<Answer, reqwest::Error>)>,
    keys: usize,
    allow_in_flight: bool,
    window: (SystemTime, SystemTime),
) -> (RaceCounts, Vec<Answer>) {
    let mut by_key: Vec<Vec<Answer>> = vec![Vec::new(); keys];
    let mut errors = Vec::new();
    for (k, result) in results {
        match result {
            Ok(answer) => by_key[k].push(answer),
            Err(e) => errors.push(format!("key {k}: {e}")),
        }
    }
    assert!(
        errors.is_empty(),
        "{} transport errors, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
    let mut counts = RaceCounts::default();
    let mut executed = Vec::with_capacity(keys);
    for (k, answers) in by_key.iter().enumerate() {
        let mut created = Vec::new();
        for answer in answers {
            match answer.status {
                201 => created.push(answer),
                409 if allow_in_flight => {
                    answer.assert_in_flight();
                    counts.in_flight += 1;
                }
                // SQLite's single write lock not granted in time: nothing ran.
                503 if allow_in_flight => {
                    answer.assert_problem(503, "store-busy");
                    assert!(answer.header("retry-after").is_some(), "key {k}");
                    counts.in_flight += 1;
                }
                other => panic!("key {k}: unexpected {other}: {}", answer.text()),
            }
        }
        counts.created += created.len();
        let fresh: Vec<&&Answer> = created.iter().filter(|a| !a.replayed()).collect();
        assert_eq!(
            fresh.len(),
            1,
            "key {k}: exactly one 201 must lack `idempotent-replayed: true` ({} answers, {} created)",
            answers.len(),
            created.len()
        );
        let first = fresh[0];
        assert!(first.header("idempotent-replayed").is_none());
        assert_expiry(first, window.0, window.1, Duration::from_secs(24 * 3600));
        for answer in &created {
            assert_eq!(
                answer.body, first.body,
                "key {k}: every 201 has the same body"
            );
            assert_eq!(
                answer.header("location"),
                first.header("location"),
                "key {k}: Location is replayed"
            );
            assert_eq!(answer.header("content-type"), Some("application/json"));
            assert_eq!(
                answer.header("idempotency-key-expires"),
                first.header("idempotency-key-expires"),
                "key {k}: one record, one expiry"
            );
        }
        executed.push((*first).clone());
    }
    (counts, executed)
}

/// Runs `copies` concurrent identical requests for each of `keys` keys, at most `limit` at
/// once, spread round-robin over `apis`; returns `(key index, answer)` and when it ran.
async fn race(
    apis: &[Api],
    keys: usize,
    copies: usize,
    limit: usize,
    key: impl Fn(usize) -> String,
    body: impl Fn(usize) -> String,
) -> (
    Vec<(usize, Result<Answer, reqwest::Error>)>,
    (SystemTime, SystemTime),
) {
    let semaphore = Arc::new(Semaphore::new(limit));
    let requests = (0..keys)
        .flat_map(|k| (0..copies).map(move |c| (k, c)))
        .map(|(k, c)| {
            let api = apis[(k * copies + c) % apis.len()].clone();
            let semaphore = semaphore.clone();
            let key = key(k);
            let body = body(k);
            async move {
                let _permit = semaphore.acquire().await.expect("semaphore");
                (k, api.pay(TOKEN1, &key, &body).await)
            }
        });
    let from = SystemTime::now();
    let results = join_all(requests).await;
    (results, (from, SystemTime::now()))
}

// ---------------------------------------------------------------------------------------
// Scenarios.
// ---------------------------------------------------------------------------------------

/// 200 keys × 16 concurrent identical requests on one server (`--simulate-latency 20`):
/// exactly 200 payments, one execution per key, identical bodies. PostgreSQL: no 409 under
/// the default `wait` policy. SQLite serializes writers, so a loser may time out on the
/// write lock and, past its busy time-out, answer 503 store-busy: counted, allowed.
pub(crate) async fn race_200_keys_16_concurrent(backend: Backend) {
    const KEYS: usize = 200;
    const COPIES: usize = 16;
    let server = backend.start(&["--simulate-latency", "20"]).await;
    let api = server.api();
    let started = Instant::now();
    let (results, window) = race(
        std::slice::from_ref(&api),
        KEYS,
        COPIES,
        256,
        |k| format!("race-{k}"),
        |k| payment(100 + k as i64, &format!("race {k}")),
    )
    .await;
    let elapsed = started.elapsed();
    let allow_in_flight = backend.kind() == Kind::Sqlite;
    let (counts, _) = check_race(results, KEYS, allow_in_flight, window);
    eprintln!(
        "race {KEYS}x{COPIES} on {:?}: {} created, {} x 409 in {elapsed:?}",
        backend.kind(),
        counts.created,
        counts.in_flight
    );
    assert_eq!(counts.created + counts.in_flight, KEYS * COPIES);
    assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"executed\"}")
            .await,
        KEYS as u64
    );
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"replayed\"}")
            .await,
        (counts.created - KEYS) as u64
    );
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"in_flight\"}")
            .await,
        counts.in_flight as u64
    );
    assert_eq!(
        api.metric("idemkey_attempts_total").await,
        (KEYS * COPIES) as u64
    );
    backend.snapshot().await.assert_consistent(KEYS);
}

/// `--in-flight reject --simulate-latency 200`, 20 keys × 8 concurrent: exactly 20 payments;
/// every other answer is a replay or a 409 request-in-flight with Retry-After; afterwards
/// every key replays its 201.
///
/// On SQLite, `reject` cannot answer at once: the claim waits for SQLite's single write lock
/// (`BEGIN IMMEDIATE`, up to the 5 s busy time-out), so a loser usually replays after the
/// owner commits. Only correctness is required there.
pub(crate) async fn race_reject_policy(backend: Backend) {
    const KEYS: usize = 20;
    const COPIES: usize = 8;
    let server = backend
        .start(&["--in-flight", "reject", "--simulate-latency", "200"])
        .await;
    let api = server.api();
    let key = |k: usize| format!("reject-{k}");
    let body = |k: usize| payment(1000 + k as i64, &format!("reject {k}"));
    let (results, window) = race(
        std::slice::from_ref(&api),
        KEYS,
        COPIES,
        KEYS * COPIES,
        key,
        body,
    )
    .await;
    let (counts, executed) = check_race(results, KEYS, true, window);
    eprintln!(
        "reject {KEYS}x{COPIES} on {:?}: {} created, {} x 409",
        backend.kind(),
        counts.created,
        counts.in_flight
    );
    assert_eq!(counts.created + counts.in_flight, KEYS * COPIES);
    if backend.kind() == Kind::Postgres {
        assert!(
            counts.in_flight > 0,
            "PostgreSQL under `reject`: concurrent copies answer 409 at once"
        );
    }
    assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    for (k, first) in executed.iter().enumerate() {
        let again = api.pay_until_created(TOKEN1, &key(k), &body(k)).await;
        assert!(again.replayed(), "key {k}: the retry replays");
        assert_eq!(
            again.body, first.body,
            "key {k}: the retry replays the body"
        );
    }
    assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    backend.snapshot().await.assert_consistent(KEYS);
}

/// PostgreSQL: three `idemkey serve` processes on one database (started together, so their
/// migrations and the shared key-hashing secret race too), 200 keys × 16 requests spread
/// round-robin over them: exactly 200 payments, identical bodies per key, no 409.
pub(crate) async fn race_across_three_processes(backend: Backend) {
    const KEYS: usize = 200;
    const COPIES: usize = 16;
    let args = ["--simulate-latency", "20"];
    let (a, b, c) = futures::join!(
        backend.start(&args),
        backend.start(&args),
        backend.start(&args)
    );
    let apis = [a.api(), b.api(), c.api()];
    let started = Instant::now();
    let (results, window) = race(
        &apis,
        KEYS,
        COPIES,
        256,
        |k| format!("multi-{k}"),
        |k| payment(100 + k as i64, &format!("multi {k}")),
    )
    .await;
    let elapsed = started.elapsed();
    let (counts, _) = check_race(results, KEYS, false, window);
    eprintln!(
        "race {KEYS}x{COPIES} over 3 processes: {} created in {elapsed:?}",
        counts.created
    );
    assert_eq!(counts.created, KEYS * COPIES);
    for api in &apis {
        assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    }
    let mut executed = 0;
    for api in &apis {
        executed += api
            .metric("idemkey_requests_total{outcome=\"executed\"}")
            .await;
    }
    assert_eq!(executed, KEYS as u64, "executions over the three processes");
    backend.snapshot().await.assert_consistent(KEYS);
}

/// 50 requests with distinct keys inside their transactions (`--simulate-latency 1500`), then
/// `kill -9`: every request fails, nothing is committed; a restarted server executes every
/// retry once, and a second retry replays it.
pub(crate) async fn crash_kill9_then_retry(backend: Backend) {
    const N: usize = 50;
    let mut server = backend.start(&["--simulate-latency", "1500"]).await;
    let api = server.api();
    let key = |k: usize| format!("crash-{k}");
    let body = |k: usize| payment(500 + k as i64, &format!("crash {k}"));
    let started = Instant::now();
    let tasks: Vec<_> = (0..N)
        .map(|k| {
            let api = api.clone();
            let (key, body) = (key(k), body(k));
            tokio::spawn(async move { api.pay(TOKEN1, &key, &body).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    if backend.kind() == Kind::Postgres {
        // Kill only once requests sit inside their transactions (the handler sleeps 1.5 s
        // there before its commit); the check below that every request failed confirms
        // that none had committed.
        let mut open = 0;
        while open == 0 && started.elapsed() < Duration::from_millis(1400) {
            open = backend.open_transactions().await.unwrap_or(0);
            if open == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert!(
            open > 0,
            "no request reached its transaction before the kill"
        );
        eprintln!("kill -9 with {open} open transactions");
    }
    server.kill9();
    let killed_at = started.elapsed();
    let mut failed = 0;
    for task in tasks {
        match task.await.expect("request task") {
            Err(_) => failed += 1,
            Ok(answer) => panic!(
                "answered {} before the kill at {killed_at:?}: {}",
                answer.status,
                answer.text()
            ),
        }
    }
    assert_eq!(failed, N, "every request in flight fails with the server");

    // Nothing of the interrupted transactions survives: no record, no payment.
    backend.snapshot().await.assert_consistent(0);

    let server = backend.start(&[]).await;
    let api = server.api();
    let mut first = Vec::with_capacity(N);
    for k in 0..N {
        let answer = api.pay_until_created(TOKEN1, &key(k), &body(k)).await;
        assert!(
            !answer.replayed(),
            "key {k}: nothing was committed, so the retry executes"
        );
        first.push(answer);
    }
    for (k, first) in first.iter().enumerate() {
        let again = api.pay_ok(TOKEN1, &key(k), &body(k)).await;
        assert_eq!(again.status, 201, "key {k}: {}", again.text());
        assert!(again.replayed(), "key {k}: the second retry replays");
        assert_eq!(again.body, first.body, "key {k}: the same payment");
    }
    assert_eq!(api.total(TOKEN1).await, N as i64, "payments");
    backend.snapshot().await.assert_consistent(N);
}

/// `--simulate-latency 1000`, 10 requests, SIGTERM once they have reached the server: every
/// request gets its answer (201; on SQLite, whose writers queue behind one lock, possibly
/// 409 request-in-flight), the process exits 0, the payments are exactly the 201s, and
/// retries of the 10 keys end with exactly 10 payments.
pub(crate) async fn graceful_shutdown_sigterm(backend: Backend) {
    const N: usize = 10;
    let mut server = backend.start(&["--simulate-latency", "1000"]).await;
    let api = server.api();
    let key = |k: usize| format!("term-{k}");
    let body = |k: usize| payment(700 + k as i64, &format!("term {k}"));
    let tasks: Vec<_> = (0..N)
        .map(|k| {
            let api = api.clone();
            let (key, body) = (key(k), body(k));
            tokio::spawn(async move { api.pay(TOKEN1, &key, &body).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Every request must be in the server (its attempt counted) before the signal.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let attempts = api.metric("idemkey_attempts_total").await;
        if attempts >= N as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {attempts} requests reached the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.sigterm();
    let mut answers = Vec::with_capacity(N);
    for (k, task) in tasks.into_iter().enumerate() {
        let answer = task
            .await
            .expect("request task")
            .unwrap_or_else(|e| panic!("key {k}: the request in flight was dropped: {e}"));
        answers.push(answer);
    }
    let status = server.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(
        status.code(),
        Some(0),
        "exit status {status:?}; log:\n{}",
        server.log_tail()
    );
    let stdout = server.stdout();
    assert!(
        stdout.iter().any(|l| l == "idemkey stopped"),
        "stdout: {stdout:?}"
    );
    let mut created = 0;
    for (k, answer) in answers.iter().enumerate() {
        match answer.status {
            201 => {
                assert!(!answer.replayed(), "key {k}");
                created += 1;
            }
            // SQLite serializes the writers; those that waited past its busy time-out
            // were told so and ran nothing.
            503 if backend.kind() == Kind::Sqlite => {
                answer.assert_problem(503, "store-busy");
                assert!(answer.header("retry-after").is_some(), "key {k}");
            }
            other => panic!("key {k}: unexpected {other}: {}", answer.text()),
        }
    }
    eprintln!("SIGTERM on {:?}: {created} of {N} created", backend.kind());
    if backend.kind() == Kind::Postgres {
        assert_eq!(created, N, "every request in flight completes");
    } else {
        assert!(created >= 1, "the request in flight completes");
    }
    backend.snapshot().await.assert_consistent(created);

    let server = backend.start(&[]).await;
    let api = server.api();
    assert_eq!(api.total(TOKEN1).await, created as i64, "payments == 201s");
    for (k, before) in answers.iter().enumerate() {
        let again = api.pay_until_created(TOKEN1, &key(k), &body(k)).await;
        if before.status == 201 {
            assert!(again.replayed(), "key {k}: replays");
            assert_eq!(again.body, before.body, "key {k}: the same payment");
        } else {
            assert!(!again.replayed(), "key {k}: executes now");
        }
    }
    assert_eq!(api.total(TOKEN1).await, N as i64, "payments");
    backend.snapshot().await.assert_consistent(N);
}

/// Mismatch → 422 key-reused naming `body`; no key → 400 key-missing; malformed keys
/// (empty, quoted empty, 256 characters, a comma, two fields) → 400 key-invalid; none of
/// them creates a payment, and a 255-character key is accepted.
pub(crate) async fn contract_key_reuse_and_invalid_keys(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let first = api.pay_ok(TOKEN1, "k-reuse", &payment(500, "a")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    // The structured-field spelling of the same key is the same key.
    let quoted = api
        .post_raw(
            Some(TOKEN1),
            &[b"\"k-reuse\"".as_slice()],
            payment(500, "a"),
        )
        .await
        .expect("request");
    assert_eq!(quoted.status, 201, "{}", quoted.text());
    assert!(quoted.replayed(), "\"k-reuse\" is k-reuse");
    assert_eq!(quoted.body, first.body);
    for (other, pointer) in [
        (payment(501, "a"), "/amount"),
        (payment(500, "b"), "/description"),
    ] {
        let reused = api.pay_ok(TOKEN1, "k-reuse", &other).await;
        reused.assert_problem(422, "key-reused");
        let differs = reused.json()["differs"].clone();
        assert!(
            differs
                .as_array()
                .is_some_and(|d| d.iter().any(|p| p == "body")),
            "differs: {differs}"
        );
        assert_eq!(reused.json()["pointer"], pointer, "{}", reused.text());
        assert_eq!(
            reused.header("idempotency-key-expires"),
            first.header("idempotency-key-expires"),
            "the 422 tells the record's expiry"
        );
    }

    // The query is part of the request too.
    let query = api
        .post(
            "/v1/payments?note=1",
            "application/json",
            Some(TOKEN1),
            &[b"k-reuse".as_slice()],
            payment(500, "a"),
        )
        .await
        .expect("request");
    query.assert_problem(422, "key-reused");
    assert_eq!(
        query.json()["differs"],
        json!(["query"]),
        "{}",
        query.text()
    );

    let missing = api
        .post_raw(Some(TOKEN1), &[], payment(500, "no key"))
        .await
        .expect("request");
    missing.assert_problem(400, "key-missing");

    let long = "a".repeat(256);
    let invalid: [(&str, Vec<&[u8]>); 7] = [
        ("empty value", vec![b"".as_slice()]),
        ("empty quoted string", vec![b"\"\"".as_slice()]),
        ("only spaces", vec![b"   ".as_slice()]),
        (
            "an unterminated quoted string",
            vec![b"\"k-open".as_slice()],
        ),
        ("256 characters", vec![long.as_bytes()]),
        ("a comma", vec![b"a,b".as_slice()]),
        ("two fields", vec![b"k-one".as_slice(), b"k-two".as_slice()]),
    ];
    for (what, keys) in invalid {
        let answer = api
            .post_raw(Some(TOKEN1), &keys, payment(500, what))
            .await
            .expect("request");
        assert_eq!(answer.status, 400, "{what}: {}", answer.text());
        assert_eq!(
            answer.problem_type(),
            "urn:idemkey:problem:key-invalid",
            "{what}"
        );
    }
    assert_eq!(
        api.total(TOKEN1).await,
        1,
        "no refused request made a payment"
    );
    // The two keys of the two-field request were not claimed either.
    for key in ["k-one", "k-two", "a"] {
        let answer = api.get(&status_path(key), Some(TOKEN1)).await;
        answer.assert_problem(404, "key-not-found");
    }

    let longest = "b".repeat(255);
    let ok = api.pay_ok(TOKEN1, &longest, &payment(500, "longest")).await;
    assert_eq!(ok.status, 201, "a 255-character key: {}", ok.text());
    assert_eq!(api.total(TOKEN1).await, 2);
    assert_eq!(api.total(TOKEN2).await, 0);
    let outcome = |name: &str| format!("idemkey_requests_total{{outcome=\"{name}\"}}");
    assert_eq!(api.metric(&outcome("executed")).await, 2);
    assert_eq!(api.metric(&outcome("replayed")).await, 1);
    assert_eq!(api.metric(&outcome("mismatched")).await, 3);
    assert_eq!(api.metric(&outcome("rejected")).await, 8);
    assert_eq!(api.metric("idemkey_attempts_total").await, 14);
    backend.snapshot().await.assert_consistent(2);
}

/// The same key from tenants t1 and t2 makes two payments, one each.
pub(crate) async fn contract_tenants_are_separate(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "shared");
    let one = api.pay_ok(TOKEN1, "k-shared", &body).await;
    let two = api.pay_ok(TOKEN2, "k-shared", &body).await;
    assert_eq!(one.status, 201, "{}", one.text());
    assert_eq!(two.status, 201, "{}", two.text());
    assert!(!one.replayed() && !two.replayed(), "each tenant executes");
    assert_ne!(one.json()["id"], two.json()["id"]);
    assert_eq!(api.total(TOKEN1).await, 1);
    assert_eq!(api.total(TOKEN2).await, 1);
    // Each tenant sees only its own payment.
    let id1 = one.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        api.get(&format!("/v1/payments/{id1}"), Some(TOKEN1))
            .await
            .status,
        200
    );
    assert_eq!(
        api.get(&format!("/v1/payments/{id1}"), Some(TOKEN2))
            .await
            .status,
        404
    );
    // And each replays its own.
    let again = api.pay_ok(TOKEN2, "k-shared", &body).await;
    assert!(again.replayed());
    assert_eq!(again.body, two.body);
    backend.snapshot().await.assert_consistent(2);
}

/// A declined payment (402) is stored and replayed byte for byte; no payment exists.
pub(crate) async fn contract_declined_is_stored_and_replayed(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(2_000_000, "too much");
    let declined = api.pay_ok(TOKEN1, "k-declined", &body).await;
    declined.assert_problem(402, "payment-declined");
    assert!(!declined.replayed());
    assert_expires_in(&declined, Duration::from_secs(24 * 3600));
    let again = api.pay_ok(TOKEN1, "k-declined", &body).await;
    assert_eq!(again.status, 402);
    assert!(again.replayed(), "the decline is replayed");
    assert_eq!(again.body, declined.body, "byte for byte");
    assert_eq!(
        again.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(api.total(TOKEN1).await, 0, "no payment");
    let status = api.get(&status_path("k-declined"), Some(TOKEN1)).await;
    assert_eq!(status.status, 200, "{}", status.text());
    let record = &status.json()["records"][0];
    assert_eq!(record["state"], "completed");
    assert_eq!(record["response_status"], 402);
    let snapshot = backend.snapshot().await;
    assert_eq!(snapshot.completed(), 1);
    assert_eq!(snapshot.records.len(), 1);
    assert_eq!(snapshot.payments.len(), 0);
    assert_eq!(snapshot.ledger.len(), 0);
}

/// `--retention 2s`: replayed at once, executed again after 3 s; the purge deletes an
/// expired record nobody retried.
pub(crate) async fn contract_retention_expiry(backend: Backend) {
    let server = backend
        .start(&["--retention", "2s", "--purge-interval", "1s"])
        .await;
    let api = server.api();
    let body = payment(500, "short-lived");
    let first = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_expires_in(&first, Duration::from_secs(2));
    // Never retried: the purge deletes it once expired.
    let forgotten = api
        .pay_ok(TOKEN1, "k-forgotten", &payment(600, "forgotten"))
        .await;
    assert_eq!(forgotten.status, 201, "{}", forgotten.text());
    let replay = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert!(replay.replayed(), "within retention: replayed");
    assert_eq!(replay.body, first.body);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let expired = api.get(&status_path("k-retention"), Some(TOKEN1)).await;
    expired.assert_problem(404, "key-not-found");
    let second = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert_eq!(second.status, 201, "{}", second.text());
    assert!(!second.replayed(), "after retention: executed again");
    assert_ne!(second.json()["id"], first.json()["id"]);
    assert_eq!(api.total(TOKEN1).await, 3, "payments");
    let again = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert!(again.replayed());
    assert_eq!(again.body, second.body, "the new outcome is replayed");
    assert_eq!(api.total(TOKEN1).await, 3, "payments");

    // The purge (every second) deletes the expired record of k-forgotten; the record of
    // k-retention was taken over and lives on.
    let mut records = usize::MAX;
    for _ in 0..RETRY_ATTEMPTS {
        records = backend.snapshot().await.records.len();
        if records == 1 {
            break;
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
    assert_eq!(records, 1, "the expired record is purged");
    assert!(api.metric("idemkey_purged_total").await >= 1);
    assert_eq!(api.total(TOKEN1).await, 3, "purging keeps the payments");
}

/// Bodies that differ only in member order, whitespace, number spelling or string escapes
/// are the same request: replayed, one payment.
pub(crate) async fn contract_equivalent_bodies_replay(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let key = "k-equivalent";
    let first = api
        .pay_ok(
            TOKEN1,
            key,
            r#"{"amount":500,"currency":"EUR","customer":"c1","description":"eq"}"#,
        )
        .await;
    assert_eq!(first.status, 201, "{}", first.text());
    let variants = [
        r#"{"description":"eq","customer":"c1","currency":"EUR","amount":500}"#,
        "{\n  \"amount\" : 500 ,\n\t\"currency\": \"EUR\",  \"customer\":\"c1\",\r\n \"description\":\"eq\"\n}\n",
        r#"{"amount":500.0,"currency":"EUR","customer":"c1","description":"eq"}"#,
        r#"{"amount":5e2,"currency":"EUR","customer":"c1","description":"eq"}"#,
        r#"{"amount":5E+2,"currency":"EUR","customer":"c1","description":"eq"}"#,
        r#"{"amount":500,"currency":"\u0045UR","customer":"c\u0031","description":"eq"}"#,
    ];
    for body in variants {
        let answer = api.pay_ok(TOKEN1, key, body).await;
        assert_eq!(answer.status, 201, "{body}: {}", answer.text());
        assert!(answer.replayed(), "{body}: replayed");
        assert_eq!(answer.body, first.body, "{body}");
    }
    let charset = api
        .post(
            PAYMENTS,
            "application/json; charset=utf-8",
            Some(TOKEN1),
            &[key.as_bytes()],
            variants[0],
        )
        .await
        .expect("request");
    assert!(
        charset.replayed(),
        "a media type parameter: {}",
        charset.text()
    );
    assert_eq!(charset.body, first.body);
    // The media type is part of the request.
    let text = api
        .post(
            PAYMENTS,
            "text/plain",
            Some(TOKEN1),
            &[key.as_bytes()],
            r#"{"amount":500,"currency":"EUR","customer":"c1","description":"eq"}"#,
        )
        .await
        .expect("request");
    text.assert_problem(422, "key-reused");
    // A real difference is still one.
    let different = api
        .pay_ok(
            TOKEN1,
            key,
            r#"{"amount":501,"currency":"EUR","customer":"c1","description":"eq"}"#,
        )
        .await;
    different.assert_problem(422, "key-reused");
    assert_eq!(api.total(TOKEN1).await, 1, "payments");
}

/// A body over 1 MiB → 413, and a body the handler refuses (400) → rolled back: in both
/// cases the key stays free and the corrected request executes.
///
/// The 413 is answered before the body is read, and the connection is then closed with the
/// rest of the body unread: the kernel resets it, and now and then the client gets
/// `IncompleteMessage` instead of the 413 (often with bodies of several MiB, seldom with
/// 1.2 MB under load). Such lost answers are retried ([`Api::pay_answered`]); the
/// connection itself is checked by [`oversized_body_connection`].
pub(crate) async fn contract_refused_bodies_leave_the_key_free(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    // Over-limit requests on connections of their own: see `oversized_body_connection`.
    let big = Api::without_keep_alive(server.base());

    let huge = payment(500, &"x".repeat(1_200_000));
    let too_large = big.pay_answered(TOKEN1, "k-large", &huge).await;
    too_large.assert_problem(413, "request-too-large");
    // The limit is 1 MiB exactly: one byte more is refused by the layer, 1 MiB reaches the
    // handler (which refuses a 1 MiB description with 400, not stored).
    const MIB: usize = 1024 * 1024;
    let padding = MIB - payment(500, "").len();
    let at_limit = payment(500, &"y".repeat(padding));
    assert_eq!(at_limit.len(), MIB);
    let answer = big.pay_ok(TOKEN1, "k-large", &at_limit).await;
    answer.assert_problem(400, "invalid-request");
    let over = payment(500, &"y".repeat(padding + 1));
    let answer = big.pay_answered(TOKEN1, "k-large", &over).await;
    answer.assert_problem(413, "request-too-large");
    let ok = api.pay_ok(TOKEN1, "k-large", &payment(500, "small")).await;
    assert_eq!(ok.status, 201, "the key is free: {}", ok.text());
    assert!(!ok.replayed());

    let invalid = r#"{"amount":"x","currency":"EUR","customer":"c1"}"#;
    let refused = api.pay_ok(TOKEN1, "k-invalid", invalid).await;
    refused.assert_problem(400, "invalid-request");
    let refused_again = api.pay_ok(TOKEN1, "k-invalid", invalid).await;
    refused_again.assert_problem(400, "invalid-request");
    assert!(!refused_again.replayed(), "a 400 is not stored");
    let fixed = api
        .pay_ok(TOKEN1, "k-invalid", &payment(500, "fixed"))
        .await;
    assert_eq!(fixed.status, 201, "the key is free: {}", fixed.text());
    assert!(!fixed.replayed());

    assert_eq!(api.total(TOKEN1).await, 2, "payments");
    backend.snapshot().await.assert_consistent(2);
}

/// 401 without (or with an unknown) token, and the key stays free; the status resource
/// shows a used key as completed and answers 404 for an unknown key (and for another
/// tenant's key); `/metrics` counts the replay.
pub(crate) async fn contract_auth_status_and_metrics(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "auth");

    for token in [None, Some("nope")] {
        let answer = api
            .post_raw(token, &[b"k-auth".as_slice()], body.clone())
            .await
            .expect("request");
        answer.assert_problem(401, "unauthorized");
        api.get("/v1/payments", token)
            .await
            .assert_problem(401, "unauthorized");
        api.get(&status_path("k-auth"), token)
            .await
            .assert_problem(401, "unauthorized");
    }
    // `/healthz` gives the database a second; a loaded machine (a pooler opening its first
    // server connection for this database) may need a second try.
    let mut health = api.get("/healthz", None).await;
    for _ in 0..10 {
        if health.status == 200 {
            break;
        }
        health = api.get("/healthz", None).await;
    }
    assert_eq!(health.status, 200, "{}", health.text());

    let first = api.pay_ok(TOKEN1, "k-auth", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed(), "the 401s did not use the key");
    let location = first.header("location").expect("Location").to_owned();
    let fetched = api.get(&location, Some(TOKEN1)).await;
    assert_eq!(fetched.status, 200);
    assert_eq!(fetched.json(), first.json(), "Location names the payment");

    let status = api.get(&status_path("k-auth"), Some(TOKEN1)).await;
    assert_eq!(status.status, 200, "{}", status.text());
    let records = status.json()["records"].clone();
    assert_eq!(records.as_array().map(Vec::len), Some(1), "{records}");
    assert_eq!(records[0]["state"], "completed");
    assert_eq!(records[0]["route"], "POST /v1/payments");
    assert_eq!(records[0]["response_status"], 201);
    api.get(&status_path("k-unknown"), Some(TOKEN1))
        .await
        .assert_problem(404, "key-not-found");
    // Any key character survives the status resource's URL.
    let odd = "a/b?c#d%e&f=g+h:i";
    let created = api.pay_ok(TOKEN1, odd, &payment(700, "odd")).await;
    assert_eq!(created.status, 201, "{}", created.text());
    let status = api.get(&status_path(odd), Some(TOKEN1)).await;
    assert_eq!(status.status, 200, "{}", status.text());
    assert_eq!(status.json()["records"][0]["state"], "completed");
    api.get(&status_path("k-auth"), Some(TOKEN2))
        .await
        .assert_problem(404, "key-not-found");

    let replay = api.pay_ok(TOKEN1, "k-auth", &body).await;
    assert!(replay.replayed());
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"replayed\"}")
            .await,
        1
    );
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"executed\"}")
            .await,
        2
    );
    assert_eq!(api.metric("idemkey_attempts_total").await, 3);
    assert_eq!(api.total(TOKEN1).await, 2);
}

/// How late past the replay cache's bound an eviction may still be replayed (the time to
/// send one request).
const BOUND_MARGIN: Duration = Duration::from_secs(2);

/// The operator commands on the servers' database, while a server runs: `migrate`, `keys
/// list`, `keys show` (which needs the key-hashing secret the server keeps in the database)
/// and `keys evict`, after which the key executes again.
pub(crate) async fn operator_keys_commands(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "operator");
    let first = api.pay_ok(TOKEN1, "k-operator", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let declined = api
        .pay_ok(TOKEN2, "k-operator", &payment(5_000_000, "declined"))
        .await;
    assert_eq!(declined.status, 402, "{}", declined.text());

    let db = |args: &[&str]| -> Vec<String> {
        args.iter()
            .copied()
            .chain(["--database-url", backend.url()])
            .map(str::to_owned)
            .collect()
    };

    let out = idemkey_cli(db(&["migrate"])).await;
    assert!(out.contains("migrations are up to date"), "{out}");

    let out = idemkey_cli(db(&["keys", "list", "--json"])).await;
    let listed: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(listed.len(), 2, "{out}");
    let mut seen: Vec<(String, String, u64)> = listed
        .iter()
        .map(|r| {
            (
                r["tenant"].as_str().unwrap_or_default().to_owned(),
                r["state"].as_str().unwrap_or_default().to_owned(),
                r["response_status"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("t1".to_owned(), "completed".to_owned(), 201),
            ("t2".to_owned(), "completed".to_owned(), 402),
        ]
    );
    let out = idemkey_cli(db(&["keys", "list", "--json", "--tenant", "t2"])).await;
    assert_eq!(out.lines().count(), 1, "{out}");

    let out = idemkey_cli(db(&["keys", "show", "--tenant", "t1", "k-operator"])).await;
    let shown: Value = serde_json::from_str(&out).expect("keys show prints JSON");
    assert_eq!(shown["state"], "completed", "{out}");
    assert_eq!(shown["response_status"], 201, "{out}");
    assert_eq!(shown["route"], "POST /v1/payments", "{out}");

    let out = idemkey_cli(db(&[
        "keys",
        "evict",
        "--tenant",
        "t1",
        "--route",
        "POST /v1/payments",
        "k-operator",
    ]))
    .await;
    assert!(out.starts_with("evicted "), "{out}");
    api.get(&status_path("k-operator"), Some(TOKEN1))
        .await
        .assert_problem(404, "key-not-found");
    // The server may answer the key from its replay cache until the eviction reaches it: on
    // PostgreSQL its notice comes within milliseconds, on SQLite the cache's bound (5 s)
    // passes. Past the bound plus a margin, a replay is a failure.
    let deadline = Instant::now() + idemkey_tower::REPLAY_CACHE_UNNOTIFIED_BOUND + BOUND_MARGIN;
    let again = loop {
        let again = api.pay_ok(TOKEN1, "k-operator", &body).await;
        assert_eq!(again.status, 201, "{}", again.text());
        if !again.replayed() {
            break again;
        }
        assert_eq!(
            again.body, first.body,
            "a replay from memory is the evicted answer"
        );
        assert!(
            Instant::now() < deadline,
            "an evicted key executes again within the replay cache's bound"
        );
    };
    assert_ne!(again.json()["id"], first.json()["id"]);
    assert_eq!(api.total(TOKEN1).await, 2, "payments");
    // Tenant t2's record was left alone.
    let replay = api
        .pay_ok(TOKEN2, "k-operator", &payment(5_000_000, "declined"))
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, declined.body);
}

/// A request whose key nobody else uses, sent while a request with another key sits in its
/// transaction longer than the store's lock wait (5 s): whatever it gets, it must not be told
/// that *its* key is in flight (`409 request-in-flight`, "a request with this
/// Idempotency-Key is still being processed"). PostgreSQL claims distinct keys
/// independently (201). SQLite has one write lock for the whole database: the honest
/// answers are a 201 after the wait, or `503 store-busy` with Retry-After.
pub(crate) async fn lock_wait_behind_another_key(backend: Backend) {
    let server = backend.start(&["--simulate-latency", "5600"]).await;
    let api = server.api();
    let holder = {
        let api = api.clone();
        tokio::spawn(async move { api.pay(TOKEN1, "k-holder", &payment(500, "holder")).await })
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    while api.metric("idemkey_attempts_total").await < 1 {
        assert!(Instant::now() < deadline, "the holder never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bystander = api
        .pay_ok(TOKEN1, "k-bystander", &payment(600, "bystander"))
        .await;
    let holder = holder.await.expect("task").expect("the holder's answer");
    assert_eq!(holder.status, 201, "{}", holder.text());
    match bystander.status {
        201 => assert!(!bystander.replayed()),
        503 => {
            bystander.assert_problem(503, "store-busy");
            assert!(bystander.header("retry-after").is_some());
        }
        _ => panic!(
            "k-bystander was never in flight, yet the answer was {} {}",
            bystander.status,
            bystander.text()
        ),
    }
}

/// An over-limit body (declared `Content-Length` > 1 MiB) is answered 413 before it is read.
/// The server must then either keep the connection usable (read and discard the rest) or
/// say `Connection: close` (RFC 9112 §9.3, §9.6): a client that gets a 413 without it keeps
/// the connection in its pool, and its next request on it fails with "connection closed
/// before message completed" (reqwest/hyper: `IncompleteMessage`). Checked on a raw socket:
/// the 413 must arrive, and the next request on the same connection must be answered unless
/// the 413 said `Connection: close`.
pub(crate) async fn oversized_body_connection(backend: Backend) {
    let server = backend.start(&[]).await;
    let address = server
        .base()
        .strip_prefix("http://")
        .expect("an http URL")
        .to_owned();
    let body = payment(500, &"x".repeat(1_200_000));
    let outcome = tokio::task::spawn_blocking(move || raw_oversized_then_next(&address, &body))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    match outcome {
        Ok(()) => {}
        Err(problem) => panic!("{problem}"),
    }
    // Nothing was claimed.
    let api = server.api();
    let ok = api.pay_ok(TOKEN1, "k-raw", &payment(500, "small")).await;
    assert_eq!(ok.status, 201, "{}", ok.text());
    assert!(!ok.replayed());
}

/// On one TCP connection: an over-limit POST, its answer, then `GET /healthz`.
fn raw_oversized_then_next(address: &str, body: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let head = format!(
        "POST {PAYMENTS} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {TOKEN1}\r\n\
         Idempotency-Key: k-raw\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    // The server may stop reading at any point: write from another thread, ignore errors.
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    let request = [head.into_bytes(), body.as_bytes().to_vec()].concat();
    let sender = std::thread::spawn(move || writer.write_all(&request).map_err(|e| e.to_string()));
    let first = read_response(&mut stream)
        .map_err(|e| format!("the 413 was lost ({e}): the connection was reset"))?;
    let sent = sender.join().expect("writer thread");
    if !first.starts_with("HTTP/1.1 413") {
        return Err(format!("expected a 413, got: {first}"));
    }
    if first
        .to_ascii_lowercase()
        .lines()
        .any(|l| l.trim() == "connection: close")
    {
        return Ok(());
    }
    let next = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n");
    let reused = stream
        .write_all(next.as_bytes())
        .map_err(|e| e.to_string())
        .and_then(|()| read_response(&mut stream));
    match reused {
        Ok(second) if second.starts_with("HTTP/1.1 200") => Ok(()),
        Ok(second) => Err(format!("the next request on the connection got: {second}")),
        Err(e) => {
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest);
            Err(format!(
                "the 413 did not say `Connection: close`, yet the server closed the \
                 connection: the next request on it failed ({e}); body upload: {sent:?}; \
                 413 head:\n{first}"
            ))
        }
    }
}

/// Reads one HTTP/1.1 response (head and `Content-Length` body) as text.
fn read_response(stream: &mut std::net::TcpStream) -> Result<String, String> {
    use std::io::Read;
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&data[..end]).into_owned();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if data.len() >= end + 4 + length {
                return Ok(String::from_utf8_lossy(&data[..end + 4 + length]).into_owned());
            }
        }
        match stream.read(&mut buf) {
            Ok(0) => return Err(format!("end of stream after {} bytes", data.len())),
            Ok(n) => data.extend_from_slice(&buf[..n]),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The status resource of `key` (percent-encoded).
fn status_path(key: &str) -> String {
    let mut path = String::from("/idempotency/v1/keys/");
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            path.push(b as char);
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    path
}

/// Expands every scenario shared by the stores into a `#[tokio::test]` on the backend that
/// `$backend` (an async expression giving a [`Backend`]) makes.
#[allow(unused_macros)] // not every test file runs the scenarios
macro_rules! e2e_scenarios {
    ($backend:expr) => {
        e2e_scenarios!(@tests $backend;
            race_200_keys_16_concurrent,
            race_reject_policy,
            crash_kill9_then_retry,
            graceful_shutdown_sigterm,
            contract_key_reuse_and_invalid_keys,
            contract_tenants_are_separate,
            contract_declined_is_stored_and_replayed,
            contract_retention_expiry,
            contract_equivalent_bodies_replay,
            contract_refused_bodies_leave_the_key_free,
            contract_auth_status_and_metrics,
            operator_keys_commands,
            lock_wait_behind_another_key,
        );
    };
    (@tests $backend:expr; $($name:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::common::$name($backend.await).await;
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use e2e_scenarios;
