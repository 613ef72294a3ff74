//! End-to-end tests of `idemkey gateway`: gateway processes (children of the `idemkey`
//! binary; one test runs the gateway's `app` in process) in front of a real HTTP upstream
//! that counts its effects.
//!
//! The upstream is an axum server on 127.0.0.1:0 running in its own thread and runtime, so
//! it keeps serving while a test's own runtime waits. It counts one effect per request, per
//! `Idempotency-Key`, *before* it answers (the effect happens even when its answer is lost),
//! and can be told, per key, to answer late, to close the connection after the effect, or
//! to close it before any effect. `GET /v1/transfers?idempotency_key=K` answers 200 with the
//! transfer when it exists and 404 otherwise (503 for keys starting `unsettled-`, which it
//! never knows): what the reconciler asks. `GET /v1/tenants/T/transfers?idempotency_key=K`
//! answers the same for tenant `T` only (as the authenticating proxy's header named it when
//! the transfer was made, and as `Idemkey-Tenant` names it now).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::future::join_all;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use clap::Parser;
use common::gateway::{Gateway, serve_on_own_thread};
use idemkey_server::cli::{Cli, Command};
use idemkey_server::gateway::GatewayOptions;
use idemkey_server::{AppDb, KeySecrets};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::Metrics;

const TOKEN: &str = "tok1";
const TENANT: &str = "t1";
const TRANSFERS: &str = "/v1/transfers";
/// The header the authenticating proxy in front of a `--tenant-header` gateway sets.
const TENANT_HEADER: &str = "x-authenticated-tenant";

// ---------------------------------------------------------------------------------------
// The upstream.

/// What the upstream does with one key's next request.
#[derive(Debug, Clone, Copy)]
enum Behaviour {
    /// The effect, then the answer after this long.
    Delay(Duration),
    /// The effect, then the connection closes without a complete answer.
    DropAfterEffect,
    /// The connection closes without an answer and without an effect.
    DropBeforeEffect,
    /// This status, without an effect.
    Fail(u16),
    /// The effect, then this status.
    EffectThenFail(u16),
}

/// Rings on every change of the ledger, so a test waits for what it needs to see instead of
/// sleeping.
#[derive(Debug)]
struct Bell(tokio::sync::watch::Sender<u64>);

impl Default for Bell {
    fn default() -> Self {
        Self(tokio::sync::watch::channel(0).0)
    }
}

impl Bell {
    fn ring(&self) {
        self.0.send_modify(|n| *n += 1);
    }
}

#[derive(Debug, Default)]
struct Ledger {
    /// Effects per key.
    effects: HashMap<String, u32>,
    /// The transfer made for each key.
    transfers: HashMap<String, Value>,
    /// The tenant header of the request that made each key's transfer, when it had one.
    tenants: HashMap<String, String>,
    /// Per key: what to do with its next request (used once).
    next: HashMap<String, Behaviour>,
    /// Requests that reached the upstream, by method and path.
    requests: Vec<String>,
    /// Answers per key whose handler ran to its end (sent or not, the client gone or not).
    answered: HashMap<String, u32>,
    bell: Bell,
}

#[derive(Debug, Clone, Default)]
struct Upstream {
    ledger: Arc<Mutex<Ledger>>,
    base: String,
}

impl Upstream {
    /// Starts the upstream in its own thread and runtime.
    fn start() -> Self {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let addr = serve_on_own_thread(
            Router::new()
                .route(TRANSFERS, post(create).get(lookup))
                .route("/v1/tenants/{tenant}/transfers", get(tenant_lookup))
                .fallback(other)
                .with_state(ledger.clone()),
        );
        Self {
            ledger,
            base: format!("http://{addr}"),
        }
    }

    /// Waits (at most 10 s) until `done` holds of the ledger.
    async fn until(&self, what: &str, done: impl Fn(&Ledger) -> bool) {
        let mut bell = self.ledger.lock().unwrap().bell.0.subscribe();
        let waiting = async {
            loop {
                if done(&self.ledger.lock().unwrap()) {
                    return;
                }
                bell.changed().await.expect("the upstream is alive");
            }
        };
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .unwrap_or_else(|_| panic!("the upstream never showed: {what}"));
    }

    /// Waits until the upstream has seen `n` effects of `key`.
    async fn until_effects(&self, key: &str, n: u32) {
        self.until(&format!("{n} effects of {key}"), |l| {
            l.effects.get(key).copied().unwrap_or(0) >= n
        })
        .await;
    }

    /// Waits until the upstream's handler for `key` has finished `n` times.
    async fn until_answered(&self, key: &str, n: u32) {
        self.until(&format!("{n} answers for {key}"), |l| {
            l.answered.get(key).copied().unwrap_or(0) >= n
        })
        .await;
    }

    fn effects(&self, key: &str) -> u32 {
        let ledger = self.ledger.lock().unwrap();
        ledger.effects.get(key).copied().unwrap_or(0)
    }

    fn total_effects(&self) -> u32 {
        self.ledger.lock().unwrap().effects.values().sum()
    }

    fn keys_with_effects(&self) -> usize {
        self.ledger.lock().unwrap().effects.len()
    }

    fn max_effects_per_key(&self) -> u32 {
        let ledger = self.ledger.lock().unwrap();
        ledger.effects.values().copied().max().unwrap_or(0)
    }

    fn on_next(&self, key: &str, behaviour: Behaviour) {
        let mut ledger = self.ledger.lock().unwrap();
        ledger.next.insert(key.to_owned(), behaviour);
    }

    fn requests(&self) -> Vec<String> {
        self.ledger.lock().unwrap().requests.clone()
    }

    fn reconcile_url(&self) -> String {
        format!("{}{TRANSFERS}?idempotency_key={{key}}", self.base)
    }

    /// The reconciler's URL template that names the tenant.
    fn tenant_reconcile_url(&self) -> String {
        format!(
            "{}/v1/tenants/{{tenant}}/transfers?idempotency_key={{key}}",
            self.base
        )
    }
}

type Shared = Arc<Mutex<Ledger>>;

/// A body that fails at once: the server closes the connection without a complete answer.
fn broken_body() -> Response {
    let failing = futures::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("the upstream drops this answer"))
    });
    (StatusCode::CREATED, Body::from_stream(failing)).into_response()
}

async fn create(State(ledger): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let authorized = headers.get("authorization").and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TOKEN}"));
    let (behaviour, transfer) = {
        let mut ledger = ledger.lock().unwrap();
        ledger.requests.push(format!("POST {TRANSFERS}"));
        let behaviour = ledger.next.remove(&key);
        match behaviour {
            Some(Behaviour::DropBeforeEffect) => return broken_body(),
            Some(Behaviour::Fail(status)) => {
                let status = StatusCode::from_u16(status).expect("status");
                return (status, "upstream failed before any effect").into_response();
            }
            _ => {}
        }
        // The effect, before any answer.
        let n = ledger.effects.values().sum::<u32>() + 1;
        *ledger.effects.entry(key.clone()).or_default() += 1;
        ledger.bell.ring();
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let transfer = json!({
            "id": format!("tr_{n}"),
            "key_seen": !key.is_empty(),
            "authorized": authorized,
            "request": request,
        });
        ledger.transfers.insert(key.clone(), transfer.clone());
        if let Some(tenant) = headers.get(TENANT_HEADER).and_then(|v| v.to_str().ok()) {
            ledger.tenants.insert(key.clone(), tenant.to_owned());
        }
        (behaviour, transfer)
    };
    // The upstream finishes its work even when the caller hangs up (its own task).
    let finishing = {
        let (ledger, key) = (ledger.clone(), key.clone());
        tokio::spawn(async move {
            if let Some(Behaviour::Delay(d)) = behaviour {
                tokio::time::sleep(d).await; // the upstream's own slowness
            }
            let mut ledger = ledger.lock().unwrap();
            *ledger.answered.entry(key).or_default() += 1;
            ledger.bell.ring();
        })
    };
    finishing.await.expect("the upstream's work");
    match behaviour {
        Some(Behaviour::DropAfterEffect) => return broken_body(),
        Some(Behaviour::EffectThenFail(status)) => {
            let status = StatusCode::from_u16(status).expect("status");
            return (status, "upstream failed after its effect").into_response();
        }
        _ => {}
    }
    let location = format!(
        "{TRANSFERS}/{}",
        transfer["id"].as_str().unwrap_or_default()
    );
    (
        StatusCode::CREATED,
        [("location", location), ("x-upstream", "yes".to_owned())],
        axum::Json(transfer),
    )
        .into_response()
}

async fn lookup(
    State(ledger): State<Shared>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let key = q.get("idempotency_key").cloned().unwrap_or_default();
    if key.starts_with("unsettled-") {
        return (StatusCode::SERVICE_UNAVAILABLE, "not known yet").into_response();
    }
    let ledger = ledger.lock().unwrap();
    match ledger.transfers.get(&key) {
        // The headers of the answer that made it: one the gateway stores, one it does not.
        Some(transfer) => {
            let location = format!(
                "{TRANSFERS}/{}",
                transfer["id"].as_str().unwrap_or_default()
            );
            (
                StatusCode::OK,
                [("location", location), ("x-upstream", "yes".to_owned())],
                axum::Json(transfer.clone()),
            )
                .into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The lookup of one tenant's transfer: 200 only when `tenant` made it, asked as that
/// tenant (`Idemkey-Tenant`); 404 otherwise.
async fn tenant_lookup(
    State(ledger): State<Shared>,
    axum::extract::Path(tenant): axum::extract::Path<String>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let key = q.get("idempotency_key").cloned().unwrap_or_default();
    let asked_as = headers.get("idemkey-tenant").and_then(|v| v.to_str().ok());
    let ledger = ledger.lock().unwrap();
    match ledger.transfers.get(&key) {
        Some(transfer)
            if ledger.tenants.get(&key) == Some(&tenant) && asked_as == Some(&tenant) =>
        {
            (StatusCode::OK, axum::Json(transfer.clone())).into_response()
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn other(State(ledger): State<Shared>, req: axum::extract::Request) -> Response {
    let line = format!("{} {}", req.method(), req.uri().path());
    ledger.lock().unwrap().requests.push(line.clone());
    (StatusCode::OK, format!("upstream saw {line}")).into_response()
}

// ---------------------------------------------------------------------------------------
// Gateway processes.

/// A database the gateways of one test share.
struct Db {
    url: String,
    dir: tempfile::TempDir,
}

impl Db {
    fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
        Self { url, dir }
    }

    async fn postgres() -> Self {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        let dir = tempfile::tempdir().expect("temporary directory");
        Self { url, dir }
    }

    /// A fresh PostgreSQL database the gateways reach through PgBouncer in transaction
    /// mode.
    async fn postgres_through_pgbouncer() -> Self {
        let db = Self::postgres().await;
        let direct = db.url.clone();
        let url = tokio::task::spawn_blocking(move || idemkey_testkit::pgbouncer_url(&direct))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Self {
            url: common::pgbouncer::pooled(&url),
            ..db
        }
    }

    /// Starts `idemkey gateway` on this database in front of `upstream`, with tenant `t1`.
    async fn gateway(&self, upstream: &str, extra: &[&str]) -> Gateway {
        Gateway::start(&self.url, upstream, self.dir.path(), extra).await
    }

    /// Starts `idemkey gateway` on this database in front of `upstream`, its tenants from
    /// the authenticating proxy's header, with `extra` flags.
    async fn gateway_behind_proxy(&self, upstream: &str, extra: &[&str]) -> Gateway {
        let flags = [&["--tenant-header", TENANT_HEADER][..], extra].concat();
        Gateway::start_with(&self.url, upstream, self.dir.path(), &flags).await
    }

    /// The gateway in this process (its [`app`](idemkey_server::gateway::app), not the
    /// binary) on this SQLite database in front of `upstream`, with tenant `t1` and `extra`
    /// flags, served on loopback; answers its base URL.
    async fn gateway_in_process(&self, upstream: &str, extra: &[&str]) -> String {
        let tenant = format!("{TENANT}={TOKEN}");
        let line = [
            &["idemkey", "gateway", "--database-url", &self.url][..],
            &["--upstream", upstream, "--api-key", &tenant],
            extra,
        ]
        .concat();
        let cli = Cli::try_parse_from(line).expect("a gateway command line");
        let Command::Gateway(args) = cli.command else {
            panic!("not a gateway command line");
        };
        let options = GatewayOptions::try_from(&args).expect("gateway options");
        let db = SqliteStore::connect(&self.url).await.expect("SQLite");
        db.migrate_all().await.expect("migrations");
        let secrets = KeySecrets::new(&b"in-process gateway test secret, 32 bytes"[..], None);
        let app = idemkey_server::gateway::app(db, &secrets, Metrics::new(), &options);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the gateway");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move { axum::serve(listener, app).await.expect("gateway") });
        base
    }

    /// Runs `idemkey keys …` on this database; returns (success, stdout, stderr).
    async fn keys(&self, args: &[&str]) -> (bool, String, String) {
        common::gateway::keys(&self.url, args).await
    }
}

/// A client of `gateway`.
fn client_of(gateway: &Gateway) -> Client {
    Client::new(&gateway.base)
}

// ---------------------------------------------------------------------------------------
// A client.

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }

    #[track_caller]
    fn assert_problem(&self, status: u16, name: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(
            self.json()["type"],
            format!("urn:idemkey:problem:{name}"),
            "{}",
            self.text()
        );
    }
}

#[derive(Debug, Clone)]
struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    fn new(base: &str) -> Self {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client");
        Self {
            http,
            base: base.to_owned(),
        }
    }

    async fn try_transfer(&self, key: &str, amount: i64) -> Result<Answer, reqwest::Error> {
        let response = self
            .http
            .post(format!("{}{TRANSFERS}", self.base))
            .bearer_auth(TOKEN)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(json!({ "amount": amount, "to": "acct-9" }).to_string())
            .send()
            .await?;
        read(response).await
    }

    /// A transfer as the authenticating proxy passes it on: with each of `tenants` as the
    /// tenant header (none, one, or several).
    async fn transfer_in(&self, tenants: &[&str], key: &str, amount: i64) -> Answer {
        let mut request = self
            .http
            .post(format!("{}{TRANSFERS}", self.base))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(json!({ "amount": amount, "to": "acct-9" }).to_string());
        for tenant in tenants {
            request = request.header(TENANT_HEADER, *tenant);
        }
        read(request.send().await.expect("POST"))
            .await
            .expect("body")
    }

    /// A GET as the authenticating proxy passes it on for `tenant` (none: without the header).
    async fn get_in(&self, tenant: Option<&str>, path: &str) -> Answer {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(tenant) = tenant {
            request = request.header(TENANT_HEADER, tenant);
        }
        read(request.send().await.expect("GET"))
            .await
            .expect("body")
    }

    async fn transfer(&self, key: &str, amount: i64) -> Answer {
        self.try_transfer(key, amount)
            .await
            .unwrap_or_else(|e| panic!("POST {TRANSFERS} {key}: {e:?}"))
    }

    async fn get(&self, path: &str) -> Answer {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET");
        read(response).await.expect("body")
    }

    async fn metric(&self, series: &str) -> u64 {
        let text = self.get("/metrics").await.text();
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series}:\n{text}"))
            .trim()
            .parse()
            .expect("counter")
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

/// Retries (bounded) until the answer is not a 409 in-flight / 503; returns it.
async fn until_final(client: &Client, key: &str, amount: i64) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let answer = client.transfer(key, amount).await;
        if !matches!(answer.status, 409 | 503) || Instant::now() > deadline {
            return answer;
        }
        if answer.json()["type"] == "urn:idemkey:problem:outcome-unknown" {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the status resource of `key` (another process's record) until it exists, and
/// checks that its state is `state`.
async fn until_reserved_as(client: &Client, key: &str, state: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = client.get(&format!("/idempotency/v1/keys/{key}")).await;
        if status.status == 200 {
            assert_eq!(status.json()["records"][0]["state"], state);
            return;
        }
        assert!(Instant::now() < deadline, "{key}: never reserved");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A gateway whose reconciler asks the upstream every 200 ms.
async fn reconciling_gateway(db: &Db, upstream: &Upstream) -> Gateway {
    let url = upstream.reconcile_url();
    let args = ["--reconcile-url", &url, "--reconcile-interval", "200ms"];
    db.gateway(&upstream.base, &args).await
}

/// Retries `key` (bounded) until the answer is no longer a 409: polled, because the
/// reconciler that settles it is another process's timer.
async fn until_reconciled(client: &Client, key: &str, amount: i64) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = client.transfer(key, amount).await;
        if answer.status != 409 || Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The point of no return in a write of its own: the record is `reserved` until then.
const SEPARATE: [&str; 2] = ["--point-of-no-return", "separate"];

// ---------------------------------------------------------------------------------------
// Races.

/// 200 keys × 16 identical concurrent requests spread over `gateways`: exactly 200 upstream
/// effects, one per key, and per key exactly one executed 201 and identical replays.
async fn race(upstream: &Upstream, gateways: &[&Gateway]) {
    const KEYS: usize = 200;
    const COPIES: usize = 16;
    let clients: Vec<Client> = gateways.iter().map(|g| client_of(g)).collect();
    let limit = Arc::new(Semaphore::new(64));
    let tasks = (0..KEYS * COPIES).map(|i| {
        let (k, client, limit) = (
            i / COPIES,
            clients[i % clients.len()].clone(),
            limit.clone(),
        );
        async move {
            let _permit = limit.acquire().await.expect("semaphore");
            let key = format!("race-{k}");
            (k, client.try_transfer(&key, k as i64).await)
        }
    });
    let results = join_all(tasks).await;
    let mut by_key: Vec<Vec<Answer>> = vec![Vec::new(); KEYS];
    for (k, result) in results {
        by_key[k].push(result.unwrap_or_else(|e| panic!("key {k}: {e:?}")));
    }
    let mut in_flight = 0;
    for (k, answers) in by_key.iter().enumerate() {
        let mut fresh = Vec::new();
        let mut replays = Vec::new();
        for a in answers {
            match a.status {
                201 if a.replayed() => replays.push(a),
                201 => fresh.push(a),
                409 => {
                    a.assert_problem(409, "request-in-flight");
                    in_flight += 1;
                }
                503 => {
                    a.assert_problem(503, "store-busy");
                    in_flight += 1;
                }
                other => panic!("key {k}: unexpected {other} {}", a.text()),
            }
        }
        assert_eq!(fresh.len(), 1, "key {k}: exactly one executed 201");
        assert!(fresh[0].header("idempotency-key-expires").is_some());
        for r in &replays {
            assert_eq!(r.body, fresh[0].body, "key {k}: replays are byte for byte");
            assert_eq!(r.header("location"), fresh[0].header("location"));
            assert_eq!(
                r.header("x-upstream"),
                None,
                "only allowlisted headers replay"
            );
        }
    }
    assert_eq!(upstream.total_effects(), KEYS as u32, "upstream effects");
    assert_eq!(upstream.keys_with_effects(), KEYS);
    assert_eq!(upstream.max_effects_per_key(), 1);
    eprintln!(
        "race over {} gateway(s): {KEYS} keys x {COPIES}: {} effects, {in_flight} in-flight answers",
        gateways.len(),
        upstream.total_effects()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_200_keys_16_copies_sqlite() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    race(&upstream, &[&gw]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_200_keys_16_copies_postgres() {
    let upstream = Upstream::start();
    let db = Db::postgres().await;
    let gw = db.gateway(&upstream.base, &[]).await;
    race(&upstream, &[&gw]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_across_two_gateways_postgres() {
    let upstream = Upstream::start();
    let db = Db::postgres().await;
    let a = db.gateway(&upstream.base, &[]).await;
    let b = db.gateway(&upstream.base, &[]).await;
    race(&upstream, &[&a, &b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_across_two_gateways_through_pgbouncer() {
    let upstream = Upstream::start();
    let db = Db::postgres_through_pgbouncer().await;
    let a = db.gateway(&upstream.base, &[]).await;
    let b = db.gateway(&upstream.base, &[]).await;
    race(&upstream, &[&a, &b]).await;
}

// ---------------------------------------------------------------------------------------
// Crashes, time-outs, refused connections.

/// With the point of no return in a write of its own: killed after the reservation, before
/// anything was sent. Once the lease lapses, a retry through a new gateway takes over and
/// the upstream sees exactly one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_forwarding_is_taken_over() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let mut first = db
        .gateway(
            &upstream.base,
            &[
                &SEPARATE[..],
                &["--lease", "1s", "--simulate-delay-before-forward", "2000"],
            ]
            .concat(),
        )
        .await;
    let client = client_of(&first);
    let pending = tokio::spawn(async move { client.try_transfer("crash-before", 7).await });
    until_reserved_as(&client_of(&first), "crash-before", "reserved").await;
    first.kill9();
    assert!(
        pending.await.expect("task").is_err(),
        "the first attempt lost its answer"
    );
    assert_eq!(upstream.effects("crash-before"), 0, "nothing was sent");

    let second = db.gateway(&upstream.base, &["--lease", "1s"]).await;
    let started = Instant::now();
    let answer = until_final(&client_of(&second), "crash-before", 7).await;
    assert_eq!(answer.status, 201, "{}", answer.text());
    assert!(!answer.replayed(), "the retry executed");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(upstream.effects("crash-before"), 1);
    let again = client_of(&second).transfer("crash-before", 7).await;
    assert!(again.replayed());
    assert_eq!(again.body, answer.body);
    assert_eq!(upstream.effects("crash-before"), 1);
}

/// With the point of no return in the reservation's write (the default): killed after the
/// reservation, before anything was sent. The record says the request may have left, so
/// once the lease lapses a retry gets 409 outcome-unknown, never an execution; the
/// reconciler then learns from the upstream that nothing arrived and releases the key, and
/// the next retry executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_a_marked_reservation_and_sending_is_reconciled() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let mut first = db
        .gateway(
            &upstream.base,
            &["--lease", "1s", "--simulate-delay-before-forward", "60000"],
        )
        .await;
    let client = client_of(&first);
    let pending = tokio::spawn(async move { client.try_transfer("crash-marked", 3).await });
    until_reserved_as(&client_of(&first), "crash-marked", "executing").await;
    first.kill9();
    assert!(pending.await.expect("task").is_err());
    assert_eq!(upstream.effects("crash-marked"), 0, "nothing was sent");

    // The retry waits (--in-flight wait) until the lease lapses, then gets the unknown.
    let second = db.gateway(&upstream.base, &["--lease", "1s"]).await;
    let answer = client_of(&second).transfer("crash-marked", 3).await;
    answer.assert_problem(409, "outcome-unknown");
    assert_eq!(upstream.effects("crash-marked"), 0, "not taken over");
    drop(second);

    let reconciling = reconciling_gateway(&db, &upstream).await;
    let answer = until_reconciled(&client_of(&reconciling), "crash-marked", 3).await;
    assert_eq!(answer.status, 201, "{}", answer.text());
    assert!(!answer.replayed(), "executed after the release");
    assert_eq!(upstream.effects("crash-marked"), 1);
    assert_eq!(
        client_of(&reconciling)
            .metric("idemkey_reconciled_total{result=\"resolved_released\"}")
            .await,
        1
    );
}

/// With the point of no return in the reservation's write: an owner stopped past its lease
/// finds, when it resumes, that it may no longer send. The retry that found the lease lapsed
/// got 409 outcome-unknown; the owner, which knows that nothing left, then releases the key,
/// and the next retry executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_past_its_marked_lease_does_not_send() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let stale = db
        .gateway(
            &upstream.base,
            &["--lease", "1s", "--simulate-delay-before-forward", "1500"],
        )
        .await;
    let client = client_of(&stale);
    let pending = tokio::spawn(async move { client.transfer("stale-marked", 6).await });
    until_reserved_as(&client_of(&stale), "stale-marked", "executing").await;
    stale.signal("-STOP");
    let other = db.gateway(&upstream.base, &["--lease", "1s"]).await;
    let answer = client_of(&other).transfer("stale-marked", 6).await;
    answer.assert_problem(409, "outcome-unknown");
    stale.signal("-CONT");
    let late = pending.await.expect("task");
    late.assert_problem(409, "request-in-flight");
    assert_eq!(upstream.effects("stale-marked"), 0, "never sent");
    let again = client_of(&other).transfer("stale-marked", 6).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert!(!again.replayed(), "released by its owner, then executed");
    assert_eq!(upstream.effects("stale-marked"), 1);
}

/// Killed after forwarding: once the lease lapses, retries get 409 outcome-unknown and never
/// reach the upstream again; the reconciler resolves the operation from the upstream's own
/// record, retries then replay that, and `keys show` has the audit entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_forwarding_is_unknown_until_reconciled() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    upstream.on_next("crash-after", Behaviour::Delay(Duration::from_secs(2)));
    let mut first = db.gateway(&upstream.base, &["--lease", "1s"]).await;
    let client = client_of(&first);
    let pending = tokio::spawn(async move { client.try_transfer("crash-after", 9).await });
    upstream.until_effects("crash-after", 1).await;
    first.kill9(); // the upstream is still working on its answer
    assert!(pending.await.expect("task").is_err());
    assert_eq!(upstream.effects("crash-after"), 1, "the request was sent");

    let second = db.gateway(&upstream.base, &["--lease", "1s"]).await;
    // The killed owner's lease lapses on the gateway's clock, in another process: polled.
    let lapsed = until_final(&client_of(&second), "crash-after", 9).await;
    lapsed.assert_problem(409, "outcome-unknown");
    for _ in 0..3 {
        let answer = client_of(&second).transfer("crash-after", 9).await;
        answer.assert_problem(409, "outcome-unknown");
        assert_eq!(
            answer.json()["status_url"],
            "/idempotency/v1/keys/crash-after"
        );
        assert!(answer.header("link").is_some());
    }
    let status = client_of(&second)
        .get("/idempotency/v1/keys/crash-after")
        .await;
    assert_eq!(status.status, 200, "{}", status.text());
    assert_eq!(status.json()["records"][0]["state"], "indeterminate");
    upstream.until_answered("crash-after", 1).await; // the late answer went nowhere
    assert_eq!(upstream.effects("crash-after"), 1, "never re-executed");
    drop(second);

    let reconciling = reconciling_gateway(&db, &upstream).await;
    let answer = until_reconciled(&client_of(&reconciling), "crash-after", 9).await;
    assert_eq!(
        answer.status,
        200,
        "the reconciler's answer: {}",
        answer.text()
    );
    assert!(answer.replayed());
    assert_eq!(answer.json()["id"], "tr_1");
    assert_eq!(upstream.effects("crash-after"), 1);
    assert_eq!(
        client_of(&reconciling)
            .metric("idemkey_reconciled_total{result=\"resolved_completed\"}")
            .await,
        1
    );
    let (ok, out, err) = db.keys(&["show", "--tenant", TENANT, "crash-after"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("\"actor\": \"reconciler\""), "{out}");
    assert!(out.contains("\"action\": \"resolved-completed\""), "{out}");
    assert!(out.contains("\"state\": \"completed\""), "{out}");
}

/// An operator releases an unknown outcome whose effect did not happen; the next retry
/// executes. Resolving a record that is not indeterminate is refused, readably.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_releases_an_unknown_outcome() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    upstream.on_next("dropped", Behaviour::DropBeforeEffect);
    let first = client_of(&gw).transfer("dropped", 5).await;
    first.assert_problem(504, "upstream-outcome-unknown");
    let retry = client_of(&gw).transfer("dropped", 5).await;
    retry.assert_problem(409, "outcome-unknown");
    assert_eq!(upstream.effects("dropped"), 0);
    assert_eq!(
        client_of(&gw)
            .metric("idemkey_marked_indeterminate_total")
            .await,
        1
    );

    let (ok, out, err) = db
        .keys(&[
            "resolve",
            "--tenant",
            TENANT,
            "--route",
            "POST *",
            "dropped",
            "--released",
            "--note",
            "no transfer in the bank's ledger",
        ])
        .await;
    assert!(ok, "{err}");
    assert!(out.contains("now released"), "{out}");
    let (ok, out, _) = db
        .keys(&["show", "--tenant", TENANT, "--route", "POST *", "dropped"])
        .await;
    assert!(ok);
    assert!(out.contains("\"actor\": \"operator:alice\""), "{out}");
    assert!(
        out.contains("key released; no transfer in the bank's ledger"),
        "{out}"
    );

    let executed = client_of(&gw).transfer("dropped", 5).await;
    assert_eq!(executed.status, 201, "{}", executed.text());
    assert!(!executed.replayed());
    assert_eq!(upstream.effects("dropped"), 1);

    let (ok, _, err) = db
        .keys(&[
            "resolve",
            "--tenant",
            TENANT,
            "--route",
            "POST *",
            "dropped",
            "--completed",
            "--status",
            "201",
            "--body",
            "{}",
        ])
        .await;
    assert!(!ok);
    assert!(
        err.contains("the record is completed, not indeterminate"),
        "{err}"
    );
    let (ok, out, _) = db.keys(&["show", "--tenant", TENANT, "dropped"]).await;
    assert!(ok);
    assert_eq!(out.matches("\"action\"").count(), 1, "{out}");
}

/// An upstream that answers after the time-out: 504, then 409 outcome-unknown; the request
/// is never sent again. An upstream that closes the connection after its effect: the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_resets_are_unknown_not_re_executed() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db
        .gateway(&upstream.base, &["--upstream-timeout", "500ms"])
        .await;
    upstream.on_next("slow", Behaviour::Delay(Duration::from_millis(1200)));
    upstream.on_next("reset", Behaviour::DropAfterEffect);
    for key in ["slow", "reset"] {
        let first = client_of(&gw).transfer(key, 1).await;
        first.assert_problem(504, "upstream-outcome-unknown");
        assert_eq!(
            first.json()["status_url"],
            format!("/idempotency/v1/keys/{key}")
        );
        for _ in 0..2 {
            client_of(&gw)
                .transfer(key, 1)
                .await
                .assert_problem(409, "outcome-unknown");
        }
    }
    upstream.until_answered("slow", 1).await;
    assert_eq!(upstream.effects("slow"), 1);
    assert_eq!(upstream.effects("reset"), 1);
    assert_eq!(
        upstream.requests().len(),
        2,
        "retries never reached the upstream"
    );
    assert_eq!(
        client_of(&gw)
            .metric("idemkey_marked_indeterminate_total")
            .await,
        2
    );
}

/// A refused connection means nothing was sent: 503 upstream-unavailable with Retry-After,
/// the key is released, and a retry through a gateway whose upstream is up executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connection_releases_the_key() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("addr"))
    }; // the listener is closed here: connections are refused
    let down = db.gateway(&closed, &[]).await;
    let answer = client_of(&down).transfer("refused", 3).await;
    answer.assert_problem(503, "upstream-unavailable");
    assert_eq!(answer.header("retry-after"), Some("1"));
    let status = client_of(&down).get("/idempotency/v1/keys/refused").await;
    assert_eq!(status.status, 404, "released: {}", status.text());

    let up = db.gateway(&upstream.base, &[]).await;
    let answer = client_of(&up).transfer("refused", 3).await;
    assert_eq!(answer.status, 201, "{}", answer.text());
    assert!(!answer.replayed());
    assert_eq!(upstream.effects("refused"), 1);
    let body = answer.json();
    assert_eq!(body["key_seen"], true, "Idempotency-Key is forwarded");
    assert_eq!(body["authorized"], true, "Authorization is forwarded");
}

/// A stale owner — a gateway frozen (SIGSTOP) after its reservation until its lease lapsed
/// and another gateway took over and completed — cannot overwrite the newer outcome, and
/// never sends the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_cannot_overwrite_the_newer_outcome() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let stale = db
        .gateway(
            &upstream.base,
            &[
                &SEPARATE[..],
                &["--lease", "1s", "--simulate-delay-before-forward", "1500"],
            ]
            .concat(),
        )
        .await;
    let client = client_of(&stale);
    let pending = tokio::spawn(async move { client.transfer("stale", 4).await });
    until_reserved_as(&client_of(&stale), "stale", "reserved").await;
    stale.signal("-STOP");
    let fresh = db.gateway(&upstream.base, &["--lease", "1s"]).await;
    let answer = until_final(&client_of(&fresh), "stale", 4).await;
    assert_eq!(answer.status, 201, "{}", answer.text());
    assert!(!answer.replayed());
    stale.signal("-CONT");
    let late = pending.await.expect("task");
    late.assert_problem(409, "request-in-flight");
    assert_eq!(
        upstream.effects("stale"),
        1,
        "the stale owner never forwarded"
    );
    let replay = client_of(&stale).transfer("stale", 4).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, answer.body, "the newer outcome stands");
}

/// Requests that are not keyed pass through untouched; keyed routes refuse a missing key.
/// The gateway runs in this process (its `app`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_requests_pass_through() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let base = db
        .gateway_in_process(
            &upstream.base,
            &["--route", "POST /v1/*", "--optional-route", "PUT /v1/*"],
        )
        .await;
    let c = Client::new(&base);
    let got = c.get("/v1/anything?x=1").await;
    assert_eq!(got.status, 200);
    assert_eq!(got.text(), "upstream saw GET /v1/anything");
    let put = c
        .http
        .put(format!("{}/v1/things/1", c.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200);
    let post = c
        .http
        .post(format!("{}/other", c.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("POST");
    assert_eq!(post.status(), 200, "outside the keyed routes");
    let missing = c
        .http
        .post(format!("{}{TRANSFERS}", c.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("POST");
    read(missing)
        .await
        .expect("body")
        .assert_problem(400, "key-missing");
    let unauthorized = c
        .http
        .post(format!("{}{TRANSFERS}", c.base))
        .header("idempotency-key", "k")
        .send()
        .await
        .expect("POST");
    assert_eq!(unauthorized.status(), 401);
    assert_eq!(
        upstream.requests(),
        vec!["GET /v1/anything", "PUT /v1/things/1", "POST /other"]
    );
    assert_eq!(c.get("/healthz").await.status, 200);
}

/// Runs `idemkey ARGS` until it exits (it must); returns (success, stderr).
fn run_idemkey(args: &[&str]) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(args)
        .env_remove("IDEMKEY_API_KEYS")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run idemkey");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Without a tenant source the gateway does not start, and says how to name one; so it
/// does with two sources, or with a header that carries credentials. Nothing is created.
#[test]
fn refuses_to_start_without_one_tenant_source() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let db = dir.path().join("gateway.db");
    let url = format!("sqlite:{}", db.display());
    let base = [
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
        "--database-url",
        &url,
    ];
    let (ok, err) = run_idemkey(&base);
    assert!(!ok, "started without a tenant source");
    for way in [
        "--api-key",
        "IDEMKEY_API_KEYS",
        "--tenant-header",
        "--single-tenant",
    ] {
        assert!(err.contains(way), "{way}: {err}");
    }
    let (ok, err) = run_idemkey(
        &[
            &base[..],
            &["--api-key", "t1=tok1", "--single-tenant", "all"],
        ]
        .concat(),
    );
    assert!(!ok);
    assert!(err.contains("one tenant source only"), "{err}");
    let (ok, err) = run_idemkey(&[&base[..], &["--tenant-header", "Authorization"]].concat());
    assert!(!ok);
    assert!(err.contains("carries a credential"), "{err}");
    let (ok, err) = run_idemkey(&[&base[..], &["--single-tenant", " "]].concat());
    assert!(!ok);
    assert!(err.contains("--single-tenant"), "{err}");
    assert!(!db.exists(), "a refused start creates no database");
}

/// Behind an authenticating proxy (`--tenant-header`): two tenants sending the same key get
/// their own operations and outcomes; one cannot read the other's status resource, nor learn
/// from a 422 where the other's request differs; a request without the header (or with two)
/// is refused with 401 and forwarded nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_from_the_proxy_header() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway_behind_proxy(&upstream.base, &[]).await;
    let c = client_of(&gw);
    let alice = c.transfer_in(&["alice"], "shared", 1).await;
    let bob = c.transfer_in(&["bob"], "shared", 1).await;
    for answer in [&alice, &bob] {
        assert_eq!(answer.status, 201, "{}", answer.text());
        assert!(!answer.replayed());
    }
    assert_ne!(alice.json()["id"], bob.json()["id"], "two operations");
    let alice_again = c.transfer_in(&["alice"], "shared", 1).await;
    let bob_again = c.transfer_in(&["bob"], "shared", 1).await;
    assert!(alice_again.replayed() && bob_again.replayed());
    assert_eq!(alice_again.body, alice.body, "alice gets her own outcome");
    assert_eq!(bob_again.body, bob.body, "bob gets his own outcome");
    assert_eq!(upstream.effects("shared"), 2);

    // Alice's key, reused by bob with another body: bob's own operation, not alice's 422.
    c.transfer_in(&["alice"], "alice-only", 1).await;
    let mismatched = c.transfer_in(&["alice"], "alice-only", 2).await;
    mismatched.assert_problem(422, "key-reused");
    let bobs = c.transfer_in(&["bob"], "alice-only", 2).await;
    assert_eq!(bobs.status, 201, "{}", bobs.text());
    assert!(!bobs.replayed());
    assert!(!bobs.text().contains("pointer"), "{}", bobs.text());

    c.transfer_in(&["alice"], "alice-private", 1).await;
    let status = "/idempotency/v1/keys/alice-private";
    assert_eq!(c.get_in(Some("alice"), status).await.status, 200);
    let foreign = c.get_in(Some("bob"), status).await;
    assert_eq!(foreign.status, 404, "{}", foreign.text());

    let before = upstream.requests().len();
    c.transfer_in(&[], "shared", 1)
        .await
        .assert_problem(401, "unauthorized");
    c.transfer_in(&["alice", "bob"], "shared", 1)
        .await
        .assert_problem(401, "unauthorized");
    c.transfer_in(&[""], "shared", 1)
        .await
        .assert_problem(401, "unauthorized");
    c.get_in(None, status)
        .await
        .assert_problem(401, "unauthorized");
    assert_eq!(upstream.requests().len(), before, "nothing was forwarded");
    assert_eq!(upstream.effects("shared"), 2);
}

/// The reconciler names the record's tenant (`{tenant}` in the URL, `Idemkey-Tenant`), so
/// an upstream answers for that tenant's operation only: the same key left unknown under two
/// tenants settles as each tenant's own, never as the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_asks_for_the_records_tenant() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway_behind_proxy(&upstream.base, &[]).await;
    upstream.on_next("both", Behaviour::DropAfterEffect);
    client_of(&gw)
        .transfer_in(&["alice"], "both", 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    upstream.on_next("both", Behaviour::DropBeforeEffect);
    client_of(&gw)
        .transfer_in(&["bob"], "both", 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    assert_eq!(upstream.effects("both"), 1, "alice's effect only");
    drop(gw);

    let url = upstream.tenant_reconcile_url();
    let args = ["--reconcile-url", &url, "--reconcile-interval", "200ms"];
    let reconciling = db.gateway_behind_proxy(&upstream.base, &args).await;
    let c = client_of(&reconciling);
    let deadline = Instant::now() + Duration::from_secs(10);
    // Each tenant's first answer that is not a 409.
    let (mut alice, mut bob) = (None, None);
    while alice.is_none() || bob.is_none() {
        assert!(
            Instant::now() < deadline,
            "never reconciled: {alice:?} {bob:?}"
        );
        for (tenant, settled) in [("alice", &mut alice), ("bob", &mut bob)] {
            if settled.is_none() {
                let answer = c.transfer_in(&[tenant], "both", 1).await;
                *settled = (answer.status != 409).then_some(answer);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (alice, bob) = (alice.expect("alice"), bob.expect("bob"));
    assert_eq!(
        alice.status,
        200,
        "alice's operation happened: {}",
        alice.text()
    );
    assert!(alice.replayed());
    assert_eq!(alice.json()["id"], "tr_1");
    assert_eq!(
        bob.status,
        201,
        "bob's did not: released, then executed: {}",
        bob.text()
    );
    assert!(!bob.replayed());
    assert_ne!(bob.json()["id"], "tr_1", "never alice's outcome");
    assert_eq!(upstream.effects("both"), 2);
}

/// More than a round's worth of newer records the upstream cannot settle do not starve an
/// older one: the reconciler works oldest first and puts off what it could not settle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_unknown_outcome_is_settled_behind_many_newer_ones() {
    const NEWER: usize = 120;
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    upstream.on_next("old", Behaviour::DropAfterEffect);
    client_of(&gw)
        .transfer("old", 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    let limit = Arc::new(Semaphore::new(8));
    let newer = (0..NEWER).map(|i| {
        let (client, limit, upstream) = (client_of(&gw), limit.clone(), upstream.clone());
        async move {
            let _permit = limit.acquire().await.expect("semaphore");
            let key = format!("unsettled-{i}");
            upstream.on_next(&key, Behaviour::Fail(500));
            client.transfer(&key, 1).await
        }
    });
    for answer in join_all(newer).await {
        assert_eq!(answer.status, 500, "{}", answer.text());
    }
    drop(gw);

    let reconciling = reconciling_gateway(&db, &upstream).await;
    let c = client_of(&reconciling);
    let answer = until_reconciled(&c, "old", 1).await;
    assert_eq!(
        answer.status,
        200,
        "the old record was settled: {}",
        answer.text()
    );
    assert!(answer.replayed());
    assert_eq!(upstream.effects("old"), 1);
    c.transfer("unsettled-0", 1)
        .await
        .assert_problem(409, "outcome-unknown");
}

/// The reconciler stores an answer with the headers the record's route stores on a normal
/// completion: `Location` (allowlisted) replays, `X-Upstream` (not allowlisted) does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_stores_the_routes_allowlisted_headers_only() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = reconciling_gateway(&db, &upstream).await;
    upstream.on_next("reset-headers", Behaviour::DropAfterEffect);
    client_of(&gw)
        .transfer("reset-headers", 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    let answer = until_reconciled(&client_of(&gw), "reset-headers", 1).await;
    assert_eq!(answer.status, 200, "reconciled: {}", answer.text());
    assert!(answer.replayed());
    assert_eq!(answer.header("location"), Some("/v1/transfers/tr_1"));
    assert_eq!(
        answer.header("x-upstream"),
        None,
        "only the route's allowlisted headers are stored"
    );
    assert_eq!(upstream.effects("reset-headers"), 1);
}

/// What the reconciler logs names a record by its key id: not the raw key, not the reconcile
/// URL that holds it (an upstream that does not answer puts the URL in its error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_logs_no_raw_key() {
    const KEY: &str = "raw-key-7f3a9c-must-not-be-logged";
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    upstream.on_next(KEY, Behaviour::DropBeforeEffect);
    client_of(&gw)
        .transfer(KEY, 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("addr"))
    }; // closed here: the reconciler's connections are refused
    let url = format!("{closed}/v1/lookup?idempotency_key={{key}}");
    let args = ["--reconcile-url", &url, "--reconcile-interval", "200ms"];
    let reconciling = db.gateway(&upstream.base, &args).await;
    let c = client_of(&reconciling);
    let series = "idemkey_reconciled_total{result=\"still_unknown\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.metric(series).await == 0 {
        assert!(Instant::now() < deadline, "the reconciler never asked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = reconciling.log_text();
    assert!(log.contains("the upstream did not answer"), "{log}");
    for log in [log, gw.log_text()] {
        assert!(!log.contains(KEY), "the raw key is logged:\n{log}");
    }
}

/// The reconciler reads no more of an answer than it may store: a reconcile URL that
/// answers 200 with an endless body leaves the record unknown, and the reconciler stops
/// reading (the upstream sees its body dropped) instead of reading until the time-out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_reads_no_more_than_it_may_store() {
    /// Sets its flag when dropped: the endless body was let go.
    struct Dropped(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    upstream.on_next("endless", Behaviour::DropBeforeEffect);
    client_of(&gw)
        .transfer("endless", 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    drop(gw);

    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = dropped.clone();
    let endless = serve_on_own_thread(Router::new().route(
        "/lookup",
        get(move || {
            let guard = Dropped(flag.clone());
            async move {
                let chunks = futures::stream::unfold(guard, |guard| async move {
                    Some((
                        Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 16 * 1024])),
                        guard,
                    ))
                });
                (StatusCode::OK, Body::from_stream(chunks))
            }
        }),
    ));
    let url = format!("http://{endless}/lookup?idempotency_key={{key}}");
    let args = [
        "--reconcile-url",
        &url,
        "--reconcile-interval",
        "200ms",
        "--max-stored-response",
        "64KiB",
        "--upstream-timeout",
        "120s",
    ];
    let reconciling = db.gateway(&upstream.base, &args).await;
    let c = client_of(&reconciling);
    let series = "idemkey_reconciled_total{result=\"still_unknown\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.metric(series).await == 0 || !dropped.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the reconciler is still reading the endless answer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.transfer("endless", 1)
        .await
        .assert_problem(409, "outcome-unknown");
    assert!(
        reconciling
            .log_text()
            .contains("over --max-stored-response"),
        "{}",
        reconciling.log_text()
    );
}

/// A retry while the first attempt runs: `wait` polls and replays, a short bound or `reject`
/// answers 409 with Retry-After; a different body under the key is 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_retries_wait_or_are_refused() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let waiting = db.gateway(&upstream.base, &[]).await;
    let rejecting = db.gateway(&upstream.base, &["--in-flight", "reject"]).await;
    let short = db
        .gateway(&upstream.base, &["--wait-timeout", "200ms"])
        .await;
    upstream.on_next("busy", Behaviour::Delay(Duration::from_millis(1200)));
    let client = client_of(&waiting);
    let first = tokio::spawn(async move { client.transfer("busy", 2).await });
    upstream.until_effects("busy", 1).await; // the first attempt is at the upstream
    for gw in [&rejecting, &short] {
        let answer = client_of(gw).transfer("busy", 2).await;
        answer.assert_problem(409, "request-in-flight");
        let retry_after: u64 = answer
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("seconds");
        assert!(retry_after >= 1);
    }
    client_of(&waiting)
        .transfer("busy", 3)
        .await
        .assert_problem(422, "key-reused");
    let replay = client_of(&waiting).transfer("busy", 2).await;
    let first = first.await.expect("first");
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    assert_eq!(
        replay.status,
        201,
        "waited, then replayed: {}",
        replay.text()
    );
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.effects("busy"), 1);
}

/// The after-effect table through the gateway. An upstream 5xx came after the request left:
/// by default the outcome is unknown (409 `outcome-unknown` after, never sent again), even
/// when this upstream did nothing; a route whose owner knows better says so
/// (`502=release`, `--answers 5xx=store`). An answer too large to store is an unknown
/// outcome too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_and_oversized_answers() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    upstream.on_next("flaky", Behaviour::Fail(502));
    let failed = client_of(&gw).transfer("flaky", 1).await;
    assert_eq!(failed.status, 502);
    assert_eq!(failed.text(), "upstream failed before any effect");
    client_of(&gw)
        .transfer("flaky", 1)
        .await
        .assert_problem(409, "outcome-unknown");
    assert_eq!(upstream.requests().len(), 1, "never sent again");

    let releasing = db
        .gateway(&upstream.base, &["--route", "POST * 502=release"])
        .await;
    upstream.on_next("released", Behaviour::Fail(502));
    assert_eq!(
        client_of(&releasing).transfer("released", 1).await.status,
        502
    );
    let executed = client_of(&releasing).transfer("released", 1).await;
    assert_eq!(executed.status, 201, "{}", executed.text());
    assert!(!executed.replayed());
    assert_eq!(upstream.effects("released"), 1);

    let storing = db
        .gateway(&upstream.base, &["--answers", "5xx=store"])
        .await;
    upstream.on_next("broken", Behaviour::Fail(503));
    assert_eq!(client_of(&storing).transfer("broken", 1).await.status, 503);
    let replay = client_of(&storing).transfer("broken", 1).await;
    assert_eq!(replay.status, 503);
    assert!(replay.replayed());
    assert_eq!(upstream.requests().len(), 4);

    let small = db
        .gateway(&upstream.base, &["--max-stored-response", "16"])
        .await;
    client_of(&small)
        .transfer("big", 1)
        .await
        .assert_problem(500, "response-too-large");
    client_of(&small)
        .transfer("big", 1)
        .await
        .assert_problem(409, "outcome-unknown");
    assert_eq!(upstream.effects("big"), 1);
}

/// A failure after the request left is never re-executed, through the gateway: an upstream
/// that recorded its effect and then answered 500, or reset the connection after its effect,
/// is never sent the request again;
/// the retry gets the stored 500 or 409 `outcome-unknown`, and the upstream counts one
/// effect. So does an owner whose client hung up mid-flight: the gateway finishes its work
/// and the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_after_the_effect_are_never_re_executed() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    let gw = db.gateway(&upstream.base, &[]).await;
    upstream.on_next("failed-after", Behaviour::EffectThenFail(500));
    upstream.on_next("reset-after", Behaviour::DropAfterEffect);
    let first = client_of(&gw).transfer("failed-after", 1).await;
    assert_eq!(first.status, 500, "{}", first.text());
    client_of(&gw)
        .transfer("reset-after", 1)
        .await
        .assert_problem(504, "upstream-outcome-unknown");
    for key in ["failed-after", "reset-after"] {
        for _ in 0..3 {
            client_of(&gw)
                .transfer(key, 1)
                .await
                .assert_problem(409, "outcome-unknown");
        }
        assert_eq!(upstream.effects(key), 1, "{key}: one effect");
    }

    // With a stored 500 the retry gets that 500, replayed.
    let storing = db
        .gateway(&upstream.base, &["--answers", "500=store"])
        .await;
    upstream.on_next("stored-500", Behaviour::EffectThenFail(500));
    assert_eq!(
        client_of(&storing).transfer("stored-500", 1).await.status,
        500
    );
    let replay = client_of(&storing).transfer("stored-500", 1).await;
    assert_eq!(replay.status, 500);
    assert!(replay.replayed());
    assert_eq!(upstream.effects("stored-500"), 1);

    // The client hangs up while the upstream works: the owner goes on and stores the answer.
    upstream.on_next("hang-up", Behaviour::Delay(Duration::from_millis(800)));
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let gone = impatient
        .post(format!("{}{TRANSFERS}", client_of(&gw).base))
        .bearer_auth(TOKEN)
        .header("idempotency-key", "hang-up")
        .json(&json!({ "amount": 1, "to": "acct-9" }))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up");
    upstream.until_answered("hang-up", 1).await;
    let retry = client_of(&gw).transfer("hang-up", 1).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.replayed(), "the owner finished without its client");
    assert_eq!(upstream.effects("hang-up"), 1);
}

/// A raw TCP upstream that takes each request and then, without answering, closes the
/// connection after reading it whole (FIN) or resets it with the request unread (RST).
/// Returns its URL and the number of requests that reached it.
fn raw_upstream(reset: bool) -> (String, Arc<AtomicUsize>) {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut buf = [0u8; 4096];
            let mut request = Vec::new();
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf[..if reset { 1 } else { 4096 }]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
                if reset {
                    break; // close with unread bytes: the kernel answers with RST
                }
            }
            if !request.is_empty() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
            drop(stream);
        }
    });
    (url, seen)
}

/// An upstream that closes the connection without an answer, or resets it: 504 and then 409
/// outcome-unknown; the request never reaches it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_and_reset_connections_are_unknown() {
    let db = Db::sqlite();
    for (reset, key) in [(false, "closed"), (true, "reset")] {
        let (url, seen) = raw_upstream(reset);
        let gw = db.gateway(&url, &[]).await;
        client_of(&gw)
            .transfer(key, 1)
            .await
            .assert_problem(504, "upstream-outcome-unknown");
        for _ in 0..2 {
            client_of(&gw)
                .transfer(key, 1)
                .await
                .assert_problem(409, "outcome-unknown");
        }
        assert_eq!(seen.load(Ordering::SeqCst), 1, "{key}: sent once");
    }
}

/// A raw TCP upstream that answers every request 201 with its number, on connections it
/// keeps open for more (HTTP/1.1 keep-alive). With `closing`, it closes a connection once it
/// has answered on it and is told to (as an upstream's keep-alive time-out ends an idle
/// connection, without `Connection: close`), and reports each close. Returns its URL and the
/// connections and requests it took.
fn counting_upstream(
    closing: Option<(Receiver<()>, Sender<()>)>,
) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (accepted, answered) = (connections.clone(), requests.clone());
    let closing = closing.map(|c| Arc::new(Mutex::new(c)));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            accepted.fetch_add(1, Ordering::SeqCst);
            let (answered, closing) = (answered.clone(), closing.clone());
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut stream = stream;
                loop {
                    let mut length = 0;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        match reader.read_line(&mut line) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => break,
                            Ok(_) => {
                                let lower = line.to_ascii_lowercase();
                                if let Some(v) = lower.strip_prefix("content-length:") {
                                    length = v.trim().parse().expect("content-length");
                                }
                            }
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let n = answered.fetch_add(1, Ordering::SeqCst) + 1;
                    let answer = format!("{{\"n\":{n}}}");
                    let head = format!(
                        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n",
                        answer.len()
                    );
                    if stream.write_all((head + &answer).as_bytes()).is_err() {
                        return;
                    }
                    if let Some(closing) = &closing {
                        let closing = closing.lock().unwrap();
                        if closing.0.recv().is_ok() {
                            drop(stream.shutdown(std::net::Shutdown::Both));
                            drop((stream, reader));
                            let _ = closing.1.send(());
                        }
                        return;
                    }
                }
            });
        }
    });
    (url, connections, requests)
}

/// Keyed requests one after another travel on one kept upstream connection; with
/// `--upstream-idle-timeout 0s`, each on a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_upstream_connections_carry_the_next_requests() {
    let db = Db::sqlite();
    for (extra, expected) in [(&[][..], 1), (&["--upstream-idle-timeout", "0s"][..], 5)] {
        let (url, connections, requests) = counting_upstream(None);
        let gw = db.gateway(&url, extra).await;
        let client = client_of(&gw);
        for i in 1..=5 {
            let answer = client.transfer(&format!("kept-{expected}-{i}"), i).await;
            assert_eq!(answer.status, 201, "{}", answer.text());
            assert_eq!(answer.json()["n"], i, "{extra:?}");
        }
        assert_eq!(requests.load(Ordering::SeqCst), 5, "{extra:?}");
        assert_eq!(connections.load(Ordering::SeqCst), expected, "{extra:?}");
    }
}

/// An upstream that closes a kept connection while it sits idle, after the gateway has
/// kept it (as one whose keep-alive time-out ran out would): the gateway does not turn the
/// next request into an unknown outcome, nor lose it; each request is sent once, on a new
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_the_upstream_closed_is_not_used_again() {
    let db = Db::sqlite();
    let (close, told) = std::sync::mpsc::channel();
    let (closed, until_closed) = std::sync::mpsc::channel();
    let (url, connections, requests) = counting_upstream(Some((told, closed)));
    let gw = db.gateway(&url, &[]).await;
    let client = client_of(&gw);
    let until_closed = Arc::new(Mutex::new(until_closed));
    for i in 1..=5 {
        let answer = client.transfer(&format!("closed-{i}"), i).await;
        assert_eq!(answer.status, 201, "{}", answer.text());
        assert_eq!(answer.json()["n"], i);
        // The gateway has the answer, so it has kept the connection: now the upstream
        // closes it.
        close.send(()).expect("the upstream is alive");
        let until_closed = until_closed.clone();
        tokio::task::spawn_blocking(move || {
            until_closed
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10))
                .expect("the upstream closed the connection")
        })
        .await
        .unwrap();
    }
    assert_eq!(requests.load(Ordering::SeqCst), 5, "each sent once");
    assert_eq!(connections.load(Ordering::SeqCst), 5);
}

// ---------------------------------------------------------------------------------------
// The first attempt's time.

impl Client {
    /// A transfer of `key` stating `Repeatability-First-Sent: sent`.
    async fn transfer_first_sent(&self, key: &str, sent: std::time::SystemTime) -> Answer {
        let response = self
            .http
            .post(format!("{}{TRANSFERS}", self.base))
            .bearer_auth(TOKEN)
            .header("idempotency-key", key)
            .header("repeatability-first-sent", httpdate::fmt_http_date(sent))
            .header("content-type", "application/json")
            .body("{\"amount\":1}")
            .send()
            .await
            .expect("POST");
        read(response).await.expect("body")
    }
}

/// Through the gateway: a retry whose record expired and was purged, stating a first attempt
/// older than the retention, is 412 and never reaches the upstream; many attempts of one late
/// key at once are all refused; a changed first-sent time is 422 and a future one 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_retries_are_refused_and_never_forwarded() {
    let upstream = Upstream::start();
    let db = Db::sqlite();
    // A 4 s retention: the margin is a quarter of it, 1 s.
    let gw = db.gateway(&upstream.base, &["--retention", "4s"]).await;
    let client = client_of(&gw);
    let now = std::time::SystemTime::now();

    let first = client.transfer_first_sent("late-1", now).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.header("repeatability-result"), Some("accepted"));
    let changed = client
        .transfer_first_sent("late-1", now - Duration::from_secs(1))
        .await;
    changed.assert_problem(422, "key-reused");
    assert_eq!(changed.json()["differs"], json!(["first-sent"]));
    let ahead = now + Duration::from_secs(600);
    let future = client.transfer_first_sent("late-future", ahead).await;
    future.assert_problem(400, "first-sent-invalid");
    assert_eq!(future.header("repeatability-result"), Some("rejected"));

    // A bounded poll of the gateway until the record has expired, then the purge.
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.get("/idempotency/v1/keys/late-1").await.status != 404 {
        assert!(Instant::now() < deadline, "the record never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ok, out, err) = db.keys(&["purge"]).await;
    assert!(ok, "{out}{err}");
    let retry = client.transfer_first_sent("late-1", now).await;
    retry.assert_problem(412, "first-sent-expired");
    assert_eq!(retry.header("repeatability-result"), Some("rejected"));
    assert_eq!(
        upstream.effects("late-1"),
        1,
        "the late retry was not forwarded"
    );

    let long_ago = now - Duration::from_secs(3600);
    let storm = join_all((0..16).map(|_| client.transfer_first_sent("late-storm", long_ago))).await;
    for answer in storm {
        answer.assert_problem(412, "first-sent-expired");
    }
    assert_eq!(upstream.effects("late-storm"), 0);
    assert_eq!(upstream.effects("late-future"), 0);
}
