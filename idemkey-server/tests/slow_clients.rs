//! Slow, idle and too many clients against `idemkey serve` and `idemkey gateway`, on real
//! sockets: the header-read timeout, the idle timeout, the request-body deadline and the
//! client connection limit close what would otherwise stay open, while real payments are
//! answered; a body cut by its deadline leaves the key free.
//!
//! A trickled body sends one byte each time the server has not answered within a short
//! poll, so it never pauses long enough for a per-read timeout: only a deadline on the
//! whole body stops it. The timeouts are set short by flags; nothing asserts on elapsed time.
//!
//! `slow_sockets_held_against_a_payment_load` prints a `CHAOS-ROW|…` line
//! (`scripts/chaos.sh`; `CHAOS_OPS` payments, waves of `CHAOS_SLOW_SOCKETS` slow sockets while they run).

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use common::gateway::{Gateway, Upstream};
use common::load::{self, Audit, OpResult};
use common::{Api, Backend, TOKEN1, payment};
use idemkey_server::cli::Cli;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The payments route.
const PAYMENTS: &str = "/v1/payments";

/// How long a trickling client waits for an answer before it sends its next byte.
const TRICKLE_POLL: Duration = Duration::from_millis(50);

/// A bound on how long a socket waits for the server to close it (a hang guard, far above
/// any timeout the tests set).
const CLOSE_BOUND: Duration = Duration::from_secs(60);

/// The short limits the tests run the server with.
const SHORT: &[&str] = &[
    "--header-read-timeout",
    "800ms",
    "--idle-timeout",
    "500ms",
    "--request-body-deadline",
    "800ms",
];

/// The ways a client can hold a connection without finishing a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slow {
    /// Connects and sends nothing.
    Silent,
    /// Sends half a request head.
    HalfHead,
    /// Sends a whole head, then its body a byte at a time.
    Trickle,
}

/// A slow client's connection.
struct SlowSocket {
    kind: Slow,
    stream: TcpStream,
    /// What is left to send of the body ([`Slow::Trickle`]).
    rest: Vec<u8>,
}

fn address(base: &str) -> String {
    base.strip_prefix("http://")
        .expect("an http URL")
        .to_owned()
}

/// A keyed payment's request head for a body of `len` bytes.
fn head(address: &str, key: &str, len: usize) -> String {
    format!(
        "POST {PAYMENTS} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {TOKEN1}\r\n\
         Idempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    )
}

impl SlowSocket {
    /// Connects to `address` and sends what a client of `kind` sends at first.
    async fn open(address: &str, kind: Slow, key: &str, body: &str) -> Self {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        let mut rest = Vec::new();
        match kind {
            Slow::Silent => {}
            Slow::HalfHead => {
                let head = head(address, key, body.len());
                stream
                    .write_all(&head.as_bytes()[..head.len() / 2])
                    .await
                    .expect("send half a head");
            }
            Slow::Trickle => {
                stream
                    .write_all(head(address, key, body.len()).as_bytes())
                    .await
                    .expect("send the head");
                rest = body.as_bytes().to_vec();
            }
        }
        Self { kind, stream, rest }
    }

    /// Everything the server sends until it closes the connection (a trickle goes on
    /// meanwhile). Fails if the whole body got sent, or the server did not close within
    /// [`CLOSE_BOUND`].
    async fn until_closed(mut self) -> Result<String, String> {
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        let read_all = async {
            loop {
                let read = if self.rest.is_empty() {
                    self.stream.read(&mut buf).await
                } else {
                    match tokio::time::timeout(TRICKLE_POLL, self.stream.read(&mut buf)).await {
                        Ok(read) => read,
                        Err(_) => {
                            let byte = self.rest.remove(0);
                            if self.rest.is_empty() {
                                return Err("the whole trickled body was sent".to_owned());
                            }
                            // The server may have stopped reading: a failed write is fine.
                            let _ = self.stream.write_all(&[byte]).await;
                            continue;
                        }
                    }
                };
                match read {
                    Ok(0) => return Ok(()),
                    Ok(n) => received.extend_from_slice(&buf[..n]),
                    // A reset after the answer still closes the connection.
                    Err(_) => return Ok(()),
                }
            }
        };
        match tokio::time::timeout(CLOSE_BOUND, read_all).await {
            Ok(Ok(())) => Ok(String::from_utf8_lossy(&received).into_owned()),
            Ok(Err(e)) => Err(format!("{:?}: {e}", self.kind)),
            Err(_) => Err(format!(
                "{:?}: the server did not close the connection within {CLOSE_BOUND:?}",
                self.kind
            )),
        }
    }
}

/// Asserts what a slow client of `kind` got before its connection was closed: nothing for
/// a silent one or half a head (hyper closes a head that timed out without an answer), `400
/// request-unreadable` for a trickled body.
#[track_caller]
fn assert_closed_answer(kind: Slow, answer: &str) {
    match kind {
        Slow::Silent | Slow::HalfHead => {
            assert_eq!(answer, "", "a {kind:?} connection got an answer");
        }
        Slow::Trickle => {
            assert!(answer.starts_with("HTTP/1.1 400"), "trickle got: {answer}");
            assert!(
                answer.contains("urn:idemkey:problem:request-unreadable"),
                "trickle got: {answer}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_cut_by_its_deadline_leaves_the_key_free_and_the_retry_runs_once() {
    let backend = Backend::sqlite().await;
    let server = backend.start(SHORT).await;
    let body = payment(700, "trickled past the deadline");

    let socket = SlowSocket::open(&address(server.base()), Slow::Trickle, "k-trickle", &body).await;
    let answer = socket
        .until_closed()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_closed_answer(Slow::Trickle, &answer);
    let nothing = backend.snapshot().await;
    nothing.assert_consistent(0);

    let api = server.api();
    let whole = api.pay_ok(TOKEN1, "k-trickle", &body).await;
    assert_eq!(whole.status, 201, "{}", whole.text());
    assert!(!whole.replayed(), "the cut attempt left a record behind");
    let again = api.pay_ok(TOKEN1, "k-trickle", &body).await;
    assert!(again.replayed());
    assert_eq!(again.body, whole.body);
    backend.snapshot().await.assert_consistent(1);
}

/// Opens `n` slow sockets of each kind against `address`.
async fn slow_sockets(address: &str, n: usize) -> Vec<SlowSocket> {
    let mut sockets = Vec::new();
    for i in 0..n {
        for kind in [Slow::Silent, Slow::HalfHead, Slow::Trickle] {
            let key = format!("k-slow-{i}");
            let body = payment(100, &format!("slow-{i} {}", "x".repeat(200)));
            sockets.push(SlowSocket::open(address, kind, &key, &body).await);
        }
    }
    sockets
}

/// Waits for every slow socket to be closed by the server and checks what each got;
/// returns how many were closed.
async fn assert_all_closed(sockets: Vec<SlowSocket>) -> usize {
    let closing = sockets.into_iter().map(|s| {
        let kind = s.kind;
        tokio::spawn(async move { (kind, s.until_closed().await) })
    });
    let mut closed = 0;
    for (kind, answer) in futures::future::join_all(closing)
        .await
        .into_iter()
        .map(|r| r.unwrap())
    {
        let answer = answer.unwrap_or_else(|e| panic!("{e}"));
        assert_closed_answer(kind, &answer);
        closed += 1;
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_and_idle_sockets_are_closed_while_payments_are_answered() {
    let backend = Backend::sqlite().await;
    let server = backend.start(SHORT).await;
    let sockets = slow_sockets(&address(server.base()), 10).await;
    let held = tokio::spawn(assert_all_closed(sockets));

    let api = Api::new(server.base());
    for i in 0..20 {
        let answer = api
            .pay_ok(TOKEN1, &format!("k-real-{i}"), &payment(100 + i, "real"))
            .await;
        assert_eq!(answer.status, 201, "{}", answer.text());
    }
    assert_eq!(held.await.unwrap(), 30);
    // The trickled payments ran nothing; the real ones ran once each.
    backend.snapshot().await.assert_consistent(20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_idle_timeout_closes_kept_alive_and_silent_connections() {
    let backend = Backend::sqlite().await;
    // With a ten-minute header-read timeout, only the idle timeout can close these.
    let flags = ["--header-read-timeout", "10m", "--idle-timeout", "500ms"];
    let server = backend.start(&flags).await;
    let address = address(server.base());
    let silent = SlowSocket::open(&address, Slow::Silent, "", "").await;
    let mut stream = TcpStream::connect(&address).await.expect("connect");
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut answer = Vec::new();
    tokio::time::timeout(CLOSE_BOUND, stream.read_to_end(&mut answer))
        .await
        .expect("the idle connection was not closed")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "the answer itself did not keep the connection open: {answer}"
    );
    assert_eq!(silent.until_closed().await.unwrap(), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_connection_limit_a_client_gets_503_server_overloaded_and_nothing_runs() {
    let backend = Backend::sqlite().await;
    let long = [
        "--max-client-connections",
        "3",
        "--header-read-timeout",
        "10m",
        "--idle-timeout",
        "10m",
    ];
    let server = backend.start(&long).await;
    let address = address(server.base());
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(SlowSocket::open(&address, Slow::Silent, "", "").await);
    }

    let api = Api::without_keep_alive(server.base());
    let body = payment(300, "past the limit");
    let refused = api.pay_ok(TOKEN1, "k-limit", &body).await;
    refused.assert_problem(503, "server-overloaded");
    assert!(refused.header("retry-after").is_some(), "no Retry-After");
    assert_eq!(refused.header("connection"), Some("close"));
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    backend.snapshot().await.assert_consistent(0);

    drop(held);
    // The server frees the slots once it sees the connections closed: poll (bounded).
    let mut attempts = 0;
    let created = loop {
        attempts += 1;
        assert!(attempts <= 500, "the slots were not freed");
        let answer = api.pay_ok(TOKEN1, "k-limit", &body).await;
        if answer.status != 503 {
            break answer;
        }
        answer.assert_problem(503, "server-overloaded");
        tokio::task::yield_now().await;
    };
    assert_eq!(created.status, 201, "{}", created.text());
    assert!(!created.replayed());
    backend.snapshot().await.assert_consistent(1);
}

/// How long a socket past the limit may wait for its answer and the close (a hang guard:
/// the server writes both when it accepts the socket).
const REFUSAL_BOUND: Duration = Duration::from_secs(15);

/// Reads `stream` until the server closes it (a reset counts as closed), within `bound`.
async fn read_to_close(mut stream: TcpStream, bound: Duration) -> Result<String, String> {
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
    };
    match tokio::time::timeout(bound, read_all).await {
        Ok(()) => Ok(String::from_utf8_lossy(&received).into_owned()),
        Err(_) => Err(format!(
            "the server neither answered nor closed within {bound:?}; got {:?}",
            String::from_utf8_lossy(&received)
        )),
    }
}

/// Asserts the whole 503 `server-overloaded` answer a socket past the limit gets.
#[track_caller]
fn assert_overloaded(answer: &str) {
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no whole answer: {answer:?}"));
    let head = head.to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 503 service unavailable\r\n"),
        "{answer}"
    );
    for field in [
        "content-type: application/problem+json",
        "retry-after: 1",
        "connection: close",
        &format!("content-length: {}", body.len()),
    ] {
        assert!(head.contains(field), "no {field}: {answer}");
    }
    let problem: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    assert_eq!(problem["type"], "urn:idemkey:problem:server-overloaded");
    assert_eq!(problem["status"], 503);
}

/// A new connection to `address`, within [`REFUSAL_BOUND`]: a server that stops accepting
/// fills its queue, and a connect then waits for minutes.
async fn connect(address: &str) -> TcpStream {
    tokio::time::timeout(REFUSAL_BOUND, TcpStream::connect(address))
        .await
        .unwrap_or_else(|_| {
            panic!("no connection within {REFUSAL_BOUND:?}: the server stopped accepting")
        })
        .expect("connect")
}

/// `GET /healthz` on a connection of its own, read until the server closes it: any client
/// that reads what comes (past the limit, the 503 may come before the request is sent).
async fn healthz(address: &str) -> String {
    let mut stream = connect(address).await;
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    // Refused before it was sent, the request may meet a closed socket.
    let _ = stream.write_all(request.as_bytes()).await;
    read_to_close(stream, REFUSAL_BOUND)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Asks [`healthz`] until the server answers 200 (a bounded poll: the server frees a slot
/// once it sees its connection closed); returns how many times it was refused.
async fn until_served(address: &str) -> u64 {
    let mut refused = 0;
    loop {
        assert!(refused < 500, "the slots were not freed");
        let answer = healthz(address).await;
        if answer.starts_with("HTTP/1.1 200") {
            return refused;
        }
        assert_overloaded(&answer);
        refused += 1;
        tokio::task::yield_now().await;
    }
}

/// The lines of a server log that report connections refused at the limit, each with the
/// count it reports (1 when it gives none).
fn refusal_reports(log: &str) -> Vec<u64> {
    // The log may be coloured: drop the escape sequences.
    let mut plain = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| c.is_ascii_alphabetic());
        } else {
            plain.push(c);
        }
    }
    plain
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("at the client connection limit"))
        .map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("refused="))
                .map_or(1, |n| n.parse().expect("a count"))
        })
        .collect()
}

/// Sockets past the limit, which never send a byte, each get the 503 and are closed at once:
/// the server holds none of them. The log reports them in a line or two, with their count,
/// rather than one line each; and the server answers again once its slots are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_connection_limit_sockets_are_answered_and_closed_at_once_and_logged_in_one_line()
{
    const OVER: u64 = 300;
    let started = std::time::Instant::now();
    let backend = Backend::sqlite().await;
    let long = [
        "--max-client-connections",
        "3",
        "--header-read-timeout",
        "10m",
        "--idle-timeout",
        "10m",
    ];
    let mut server = backend.start(&long).await;
    let address = address(server.base());
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(SlowSocket::open(&address, Slow::Silent, "", "").await);
    }

    let mut over = Vec::new();
    for _ in 0..OVER {
        over.push(connect(&address).await);
    }
    let answers = over
        .into_iter()
        .map(|s| tokio::spawn(read_to_close(s, REFUSAL_BOUND)));
    for answer in futures::future::join_all(answers).await {
        assert_overloaded(&answer.unwrap().unwrap_or_else(|e| panic!("{e}")));
    }

    // The held connections keep their slots until they close; then a request is served.
    drop(held);
    let refused_after = until_served(&address).await;

    // The count not reported yet is written at shutdown.
    server.sigterm();
    assert!(server.wait_exit(CLOSE_BOUND).await.success());
    let reports = refusal_reports(&server.log());
    assert_eq!(
        reports.iter().sum::<u64>(),
        OVER + refused_after,
        "{reports:?}"
    );
    // One line at the first refusal, one per 10 s period after, one at shutdown.
    let bound = 2 + started.elapsed().as_secs() / 10;
    assert!(
        reports.len() as u64 <= bound,
        "{} refusal lines for {} refusals: {reports:?}",
        reports.len(),
        OVER + refused_after
    );
}

/// Under an open-file limit the connection limit just fits, a burst of sockets past the
/// limit, which the clients keep open, uses up no descriptor of the server: a new request
/// is answered (503, the slots being held) rather than left waiting, and once the slots
/// are free it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_past_the_connection_limit_under_a_low_open_file_limit_leaves_the_server_answering()
{
    const OPEN_FILES: usize = 128;
    const LIMIT: usize = OPEN_FILES - 64 - 32;
    const BURST: usize = 4 * OPEN_FILES;
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("idemkey.db").display());
    let log = dir.path().join("serve.log");
    let limit = LIMIT.to_string();
    let mut serve = Command::new("sh");
    serve
        .arg("-c")
        .arg(format!("ulimit -n {OPEN_FILES} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_idemkey"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &url])
        .args(["--api-key", "t1=tok1", "--max-client-connections", &limit])
        .args(["--header-read-timeout", "10m", "--idle-timeout", "10m"])
        .env_remove("IDEMKEY_API_KEYS")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_DATABASE_URL")
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log).expect("log file"));
    let (_server, base) = common::spawn_announcing(serve, "idemkey listening on ").await;
    let base = base.unwrap_or_else(|e| {
        panic!(
            "serve did not start ({e}): {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    let address = address(&base);

    let mut held = Vec::new();
    for _ in 0..LIMIT {
        held.push(SlowSocket::open(&address, Slow::Silent, "", "").await);
    }
    let mut burst = Vec::new();
    for _ in 0..BURST {
        burst.push(connect(&address).await);
    }

    // Answered at once: not left waiting for a descriptor.
    assert_overloaded(&healthz(&address).await);

    drop(burst);
    drop(held);
    until_served(&address).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_closes_idle_and_silent_connections_at_once() {
    let backend = Backend::sqlite().await;
    let long = ["--header-read-timeout", "10m", "--idle-timeout", "10m"];
    let mut server = backend.start(&long).await;
    let address = address(server.base());
    let silent = SlowSocket::open(&address, Slow::Silent, "", "").await;
    let mut idle = TcpStream::connect(&address).await.expect("connect");
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n");
    idle.write_all(request.as_bytes()).await.expect("send");
    let mut buf = [0u8; 1024];
    let n = idle.read(&mut buf).await.expect("the answer");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));

    server.sigterm();
    // With ten-minute timeouts, only the shutdown can close these two in time.
    let status = server.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
    assert_eq!(silent.until_closed().await.unwrap(), "");
}

#[test]
fn the_limit_flags_refuse_zero_and_absurd_values() {
    let parse = |args: &[&str]| {
        let mut line = vec!["idemkey"];
        line.extend_from_slice(args);
        Cli::try_parse_from(line)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    for command in [
        &["serve"][..],
        &["gateway", "--upstream", "http://127.0.0.1:9"][..],
    ] {
        let with = |flag: &str, value: &str| {
            let mut args = command.to_vec();
            args.extend_from_slice(&[flag, value]);
            parse(&args)
        };
        assert!(with("--idle-timeout", "2s").is_ok());
        for flag in [
            "--header-read-timeout",
            "--idle-timeout",
            "--request-body-deadline",
        ] {
            for value in ["0s", "2h", "soon"] {
                let e = with(flag, value).unwrap_err();
                assert!(e.contains(flag), "{e}");
            }
            assert!(with(flag, "0s").unwrap_err().contains("out of range"));
        }
        for value in ["0", "2000000", "many"] {
            let e = with("--max-client-connections", value).unwrap_err();
            assert!(e.contains("--max-client-connections"), "{e}");
        }
    }
}

/// Runs `idemkey serve` (through `sh`, so `prefix` can set limits first); it must exit at
/// once with an error; returns its stderr.
fn refused_at_start(prefix: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("idemkey.db").display());
    let output = Command::new("sh")
        .arg("-c")
        .arg(format!("{prefix} exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_idemkey"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &url])
        .args(args)
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run idemkey serve");
    assert!(!output.status.success(), "serve started");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!stdout.contains("listening"), "{stdout}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn an_idle_timeout_longer_than_the_header_read_timeout_is_refused_at_start() {
    let e = refused_at_start(
        "",
        &["--idle-timeout", "20s", "--header-read-timeout", "10s"],
    );
    assert!(
        e.contains("--idle-timeout 20s is longer than --header-read-timeout 10s"),
        "{e}"
    );
}

#[test]
fn a_connection_limit_past_the_open_file_limit_is_refused_at_start() {
    let e = refused_at_start("ulimit -n 256 &&", &["--max-client-connections", "512"]);
    assert!(
        e.contains("--max-client-connections 512 cannot hold"),
        "{e}"
    );
    assert!(e.contains("256"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_closes_slow_sockets_while_it_forwards() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    let gateway = Gateway::start(&url, &upstream.base, dir.path(), SHORT).await;
    let sockets = slow_sockets(&address(&gateway.base), 2).await;
    let held = tokio::spawn(assert_all_closed(sockets));

    let api = Api::new(&gateway.base);
    let answer = api.pay_ok(TOKEN1, "k-gw", &payment(100, "through")).await;
    assert!(answer.status < 300, "{} {}", answer.status, answer.text());
    assert_eq!(held.await.unwrap(), 6);
    assert_eq!(upstream.effects("k-gw"), 1);
    // The trickled requests never reached the upstream.
    assert_eq!(upstream.effect_counts().1, 1, "upstream effects");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_answers_503_server_overloaded_past_its_limit() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    let long = [
        "--max-client-connections",
        "2",
        "--header-read-timeout",
        "10m",
        "--idle-timeout",
        "10m",
    ];
    let gateway = Gateway::start(&url, &upstream.base, dir.path(), &long).await;
    let address = address(&gateway.base);
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(SlowSocket::open(&address, Slow::Silent, "", "").await);
    }
    let api = Api::without_keep_alive(&gateway.base);
    let refused = api
        .pay_ok(TOKEN1, "k-gw-limit", &payment(100, "refused"))
        .await;
    refused.assert_problem(503, "server-overloaded");
    assert!(refused.header("retry-after").is_some(), "no Retry-After");
    assert_eq!(upstream.effects("k-gw-limit"), 0);
    assert_eq!(upstream.received("k-gw-limit"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_sockets_held_against_a_payment_load() {
    let ops = load::scaled(200);
    let per_kind = std::env::var("CHAOS_SLOW_SOCKETS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(60)
        / 3;
    let backend = Backend::sqlite().await;
    let mut flags = SHORT.to_vec();
    let cap = (per_kind * 3 + 64).to_string();
    flags.extend_from_slice(&["--max-client-connections", &cap]);
    let server = backend.start(&flags).await;
    // Waves of slow sockets, one after the other, for as long as the load runs (at least
    // one): each wave is held until the server has closed every socket of it.
    let load_done = Arc::new(AtomicBool::new(false));
    let waves = {
        let address = address(server.base());
        let load_done = load_done.clone();
        tokio::spawn(async move {
            let (mut opened, mut closed) = (0, 0);
            loop {
                let sockets = slow_sockets(&address, per_kind).await;
                opened += sockets.len();
                closed += assert_all_closed(sockets).await;
                if load_done.load(Ordering::SeqCst) {
                    return (opened, closed);
                }
            }
        })
    };

    let client = load::client(load::patient_policy());
    let results = load::payments(
        &client,
        &[server.base().to_owned()],
        TOKEN1,
        0..ops,
        8,
        &load::Progress::default(),
    )
    .await;
    load_done.store(true, Ordering::SeqCst);
    let failed = results.iter().filter(|r| !r.succeeded()).count();
    let (slow, closed) = waves.await.unwrap();
    let audit = Audit::sqlite(backend.url()).await;
    load::row(&load::row_of(
        "slow and idle sockets held against serve (SQLite)",
        &results,
        failed,
        &audit,
        None,
        format!(
            "{slow} slow sockets held in waves of {} during the load (silent, half head, \
             trickled body), {closed} closed by the server's timeouts; trickled payments ran \
             nothing",
            per_kind * 3
        ),
    ));
    assert!(results.iter().all(OpResult::succeeded), "{failed} failed");
    audit.assert_exactly_once(&results);
    audit.assert_all(ops);
    assert_eq!(closed, slow);
}
