//! `idemkey gateway` processes and a counting upstream, for the gateway chaos scenarios.
//!
//! The upstream runs on its own thread and runtime, so it keeps serving while a test waits.
//! `POST /v1/…` counts one effect per `Idempotency-Key` and answers 201 with a transfer;
//! a test may [`hold`](Upstream::hold) a key's next request (with or without its effect)
//! until it releases it, and wait on what the upstream saw ([`Upstream::until`]) instead of
//! sleeping. `GET /v1/lookup?idempotency_key=K` answers the transfer (200) or 404: what the
//! reconciler asks. Any other request is answered 201 `{"ok":true}` and counted.

use std::collections::HashMap;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::Notify;

use super::{postgres_secret, read_stdout};

/// A held request: answered once released; with `effect`, the effect happens before the
/// hold, otherwise the connection is closed without an answer or an effect on release.
#[derive(Debug, Clone)]
struct Hold {
    release: Arc<Notify>,
    effect: bool,
}

/// What the upstream saw.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// Effects per key.
    pub(crate) effects: HashMap<String, u32>,
    /// Requests per key that reached the upstream.
    pub(crate) received: HashMap<String, u32>,
    /// Answers per key whose handler ran to its end (sent or not).
    pub(crate) answered: HashMap<String, u32>,
    /// The transfer made for each key.
    pub(crate) transfers: HashMap<String, Value>,
    /// Requests on other paths (the fuzz upstream).
    pub(crate) other: u64,
    holds: HashMap<String, Hold>,
}

type Shared = (Arc<Mutex<Ledger>>, Arc<tokio::sync::watch::Sender<u64>>);

/// The counting upstream.
#[derive(Debug, Clone)]
pub(crate) struct Upstream {
    ledger: Arc<Mutex<Ledger>>,
    bell: Arc<tokio::sync::watch::Sender<u64>>,
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
}

/// Serves `app` on loopback from a thread and runtime of its own (so that it keeps
/// answering whatever the test's runtime does), and answers its address.
pub(crate) fn serve_on_own_thread(app: Router) -> std::net::SocketAddr {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("upstream runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind the upstream");
            tx.send(listener.local_addr().expect("address")).ok();
            axum::serve(listener, app).await.expect("upstream");
        });
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("upstream address")
}

impl Upstream {
    /// Starts it on its own thread and runtime.
    pub(crate) fn start() -> Self {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let bell = Arc::new(tokio::sync::watch::channel(0).0);
        let state: Shared = (ledger.clone(), bell.clone());
        let addr = serve_on_own_thread(
            Router::new()
                .route("/v1/lookup", get(lookup))
                .fallback(create)
                .with_state(state),
        );
        Self {
            ledger,
            bell,
            base: format!("http://{addr}"),
        }
    }

    /// The reconciler's URL template.
    pub(crate) fn reconcile_url(&self) -> String {
        format!("{}/v1/lookup?idempotency_key={{key}}", self.base)
    }

    /// Holds `key`'s next request until the returned handle is notified; with `effect`, the
    /// effect happens first.
    pub(crate) fn hold(&self, key: &str, effect: bool) -> Arc<Notify> {
        let release = Arc::new(Notify::new());
        self.ledger.lock().unwrap().holds.insert(
            key.to_owned(),
            Hold {
                release: release.clone(),
                effect,
            },
        );
        release
    }

    /// Waits (at most 30 s) until `done` holds of the ledger.
    pub(crate) async fn until(&self, what: &str, done: impl Fn(&Ledger) -> bool) {
        let mut bell = self.bell.subscribe();
        let waiting = async {
            loop {
                if done(&self.ledger.lock().unwrap()) {
                    return;
                }
                bell.changed().await.expect("the upstream is alive");
            }
        };
        tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .unwrap_or_else(|_| panic!("the upstream never showed: {what}"));
    }

    /// Effects of `key`.
    pub(crate) fn effects(&self, key: &str) -> u32 {
        self.ledger
            .lock()
            .unwrap()
            .effects
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// Requests of `key` that reached the upstream.
    pub(crate) fn received(&self, key: &str) -> u32 {
        self.ledger
            .lock()
            .unwrap()
            .received
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// The transfer made for `key`, if any.
    pub(crate) fn transfer(&self, key: &str) -> Option<Value> {
        self.ledger.lock().unwrap().transfers.get(key).cloned()
    }

    /// The largest number of effects of any one key, and the number of keys with effects.
    pub(crate) fn effect_counts(&self) -> (u32, usize) {
        let ledger = self.ledger.lock().unwrap();
        (
            ledger.effects.values().copied().max().unwrap_or(0),
            ledger.effects.len(),
        )
    }
}

fn ring(bell: &tokio::sync::watch::Sender<u64>) {
    bell.send_modify(|n| *n += 1);
}

/// A body that fails at once: the connection closes without a complete answer.
fn broken_body() -> Response {
    let failing = futures::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("the upstream drops this answer"))
    });
    (StatusCode::CREATED, Body::from_stream(failing)).into_response()
}

async fn create(
    State((ledger, bell)): State<Shared>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let Some(key) = key.filter(|_| uri.path().starts_with("/v1/")) else {
        ledger.lock().unwrap().other += 1;
        ring(&bell);
        return (StatusCode::CREATED, "{\"ok\":true}").into_response();
    };
    let effect = |ledger: &mut Ledger| {
        let n = ledger.effects.values().sum::<u32>() + 1;
        *ledger.effects.entry(key.clone()).or_default() += 1;
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let transfer = json!({ "id": format!("tr_{n}"), "request": request });
        ledger.transfers.insert(key.clone(), transfer.clone());
        transfer
    };
    let (hold, transfer) = {
        let mut ledger = ledger.lock().unwrap();
        *ledger.received.entry(key.clone()).or_default() += 1;
        let hold = ledger.holds.remove(&key);
        let transfer = match &hold {
            Some(h) if !h.effect => None,
            _ => Some(effect(&mut ledger)),
        };
        (hold, transfer)
    };
    ring(&bell);
    if let Some(hold) = hold {
        // The upstream's own slowness, until the test releases it.
        hold.release.notified().await;
        if !hold.effect {
            *ledger
                .lock()
                .unwrap()
                .answered
                .entry(key.clone())
                .or_default() += 1;
            ring(&bell);
            return broken_body();
        }
    }
    {
        let mut l = ledger.lock().unwrap();
        *l.answered.entry(key.clone()).or_default() += 1;
    }
    ring(&bell);
    let transfer = transfer.expect("an effect");
    let location = format!(
        "/v1/transfers/{}",
        transfer["id"].as_str().unwrap_or_default()
    );
    (
        StatusCode::CREATED,
        [("location", location)],
        axum::Json(transfer),
    )
        .into_response()
}

async fn lookup(
    State((ledger, _)): State<Shared>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let key = q.get("idempotency_key").cloned().unwrap_or_default();
    let ledger = ledger.lock().unwrap();
    match ledger.transfers.get(&key) {
        Some(transfer) => (StatusCode::OK, axum::Json(transfer.clone())).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// A running `idemkey gateway`; SIGKILLed when dropped.
#[derive(Debug)]
pub(crate) struct Gateway {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
    log: PathBuf,
}

impl Gateway {
    /// Starts `idemkey gateway` on `database_url` in front of `upstream` with tenant `t1`
    /// (`tok1`) and `extra` flags; returns once it listens. Logs go to `dir`.
    pub(crate) async fn start(
        database_url: &str,
        upstream: &str,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        let args = [&["--api-key", "t1=tok1"][..], extra].concat();
        Self::start_with(database_url, upstream, dir, &args).await
    }

    /// Starts `idemkey gateway` on `database_url` in front of `upstream` with `flags` only
    /// (a tenant source among them); returns once it listens. Logs go to `dir`.
    pub(crate) async fn start_with(
        database_url: &str,
        upstream: &str,
        dir: &std::path::Path,
        flags: &[&str],
    ) -> Self {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let mut args: Vec<String> = [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            database_url,
            "--upstream",
            upstream,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let log = dir.join(format!(
            "gateway-{}.log",
            STARTED.fetch_add(1, Ordering::SeqCst)
        ));
        tokio::task::spawn_blocking(move || Self::spawn(args, log))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// Runs `idemkey ARGS` (a `gateway` command line), logging to `log`; returns once it
    /// listens.
    pub(crate) fn spawn(args: Vec<String>, log: PathBuf) -> Self {
        let stderr = std::fs::File::create(&log).expect("log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(&args)
            .env_remove("IDEMKEY_API_KEYS")
            .env_remove("IDEMKEY_KEY_SECRET")
            .envs(postgres_secret(args.iter().map(String::as_str)))
            .env_remove("IDEMKEY_DATABASE_URL")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start idemkey gateway");
        let stdout = child.stdout.take().expect("stdout");
        let (rx, _) = read_stdout(stdout, "idemkey gateway listening on ");
        let mut gateway = Self {
            child: Some(child),
            base: String::new(),
            log,
        };
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(base) => {
                assert!(base.starts_with("http://127.0.0.1:"), "{base}");
                gateway.base = base;
                gateway
            }
            Err(e) => {
                gateway.kill9();
                panic!("the gateway did not start ({e}):\n{}", gateway.log_text());
            }
        }
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends `signal` (`-TERM`, …) with `kill`.
    pub(crate) fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal}");
    }

    /// SIGKILL, then reap.
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the process is still running.
    pub(crate) fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Its log (stderr).
    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `idemkey keys SUBCOMMAND --database-url URL ARGS…` (as operator `alice`); returns
/// (success, stdout, stderr).
pub(crate) async fn keys(url: &str, args: &[&str]) -> (bool, String, String) {
    let mut all: Vec<String> = vec!["keys".into(), args[0].into()];
    all.extend(["--database-url".into(), url.to_owned()]);
    all.extend(args[1..].iter().map(|s| (*s).to_owned()));
    tokio::task::spawn_blocking(move || {
        let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(&all)
            .env_remove("IDEMKEY_API_KEYS")
            .env_remove("IDEMKEY_KEY_SECRET")
            .envs(postgres_secret(all.iter().map(String::as_str)))
            .env_remove("IDEMKEY_DATABASE_URL")
            .env("USER", "alice")
            .stdin(Stdio::null())
            .output()
            .expect("run idemkey keys");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    })
    .await
    .expect("keys task")
}
