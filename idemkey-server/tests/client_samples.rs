//! The client samples of `docs/guide/clients.md` run against a real `idemkey serve`.
//!
//! A sample is the code block on the line after `<!-- sample: NAME -->`; its file name picks
//! the interpreter (`pay.sh`: `sh`, with `curl`; `pay.py`: `python3`, with `requests`;
//! `pay.mjs`: `node` 18 or newer). Each is written to a file as the page shows it and run
//! twice, each time against a fresh `serve` on SQLite that requires
//! `Repeatability-First-Sent`, with `IDEMKEY_URL` and `IDEMKEY_TOKEN` set:
//!
//! - straight to the server: the sample's two calls with one key print the payment, then its
//!   replay (`replayed: true`, the same id);
//! - through a relay that loses the first answer (the server made the payment and answered,
//!   the connection is closed before a byte of the answer arrives): the sample's retry loop
//!   must send the request again with the same key, so both calls print the replay.
//!
//! Either way the sample exits 0 and the database holds one payment, its record and its
//! ledger entry. A missing interpreter, or a Python without `requests`, fails the test with
//! what to install.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;

use common::{Backend, TOKEN1};

/// The page the samples are taken from, relative to the workspace.
const PAGE: &str = "docs/guide/clients.md";
/// What marks a sample: the line before its code block.
const MARKER: &str = "<!-- sample:";
/// The samples the page must hold.
const SAMPLES: [&str; 3] = ["pay.sh", "pay.py", "pay.mjs"];
/// The longest a sample may be.
const MAX_LINES: usize = 40;
/// How long a sample may run, in seconds (its retries are bounded far below).
const BOUND_SECS: &str = "120";

/// Every sample of the page: its file name and its code.
fn samples() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(PAGE);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix(MARKER) else {
            continue;
        };
        let name = rest.trim_end_matches("-->").trim().to_owned();
        let fence = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
        assert!(
            fence.starts_with("```"),
            "{PAGE}:{}: the sample marker must be on the line just before its code block",
            i + 1
        );
        let code: Vec<&str> = lines[i + 2..]
            .iter()
            .take_while(|l| !l.trim().starts_with("```"))
            .copied()
            .collect();
        found.push((name, code.join("\n") + "\n"));
    }
    found
}

/// The sample named `name`.
fn sample(name: &str) -> String {
    samples()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, code)| code)
        .unwrap_or_else(|| panic!("{PAGE} has no `{MARKER} {name} -->` sample"))
}

/// Runs `program args`, which must succeed; else fails the test, saying what to install.
fn require(program: &str, args: &[&str], install: &str) -> String {
    match Command::new(program).args(args).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        Ok(out) => panic!(
            "`{program} {}` failed ({}): {}\n{install}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => panic!("cannot run `{program}` ({e})\n{install}"),
    }
}

/// The interpreter of the sample `name`, after checking that it, and what the sample uses,
/// are installed.
fn interpreter(name: &str) -> &'static str {
    match Path::new(name).extension().and_then(|e| e.to_str()) {
        Some("sh") => {
            require(
                "curl",
                &["--version"],
                "install curl (Debian: apt-get install curl)",
            );
            "sh"
        }
        Some("py") => {
            require(
                "python3",
                &["-c", "import requests"],
                "the Python sample needs python3 on PATH with the requests module: \
                 `python3 -m pip install requests`, or for Debian's /usr/bin/python3 \
                 `apt-get install python3-requests` (.ci/run installs it)",
            );
            "python3"
        }
        Some("mjs") => {
            let install = "the JavaScript sample needs Node.js 18 or newer as `node` on PATH \
                           (Debian: apt-get install nodejs; .ci/run installs it)";
            let version = require("node", &["--version"], install);
            let major = version
                .trim()
                .trim_start_matches('v')
                .split('.')
                .next()
                .and_then(|m| m.parse::<u32>().ok());
            assert!(
                major.is_some_and(|m| m >= 18),
                "node --version says {}: {install}",
                version.trim()
            );
            "node"
        }
        _ => panic!("{PAGE}: no interpreter for the sample `{name}` (.sh, .py or .mjs)"),
    }
}

/// Runs the sample `code` as `dir/name` with `interpreter`, against the server at `base`.
async fn run(interpreter: &'static str, dir: &Path, name: &str, code: &str, base: &str) -> Output {
    let file = dir.join(name);
    std::fs::write(&file, code).expect("write the sample");
    let mut command = Command::new("timeout");
    command
        .arg(BOUND_SECS)
        .arg(interpreter)
        .arg(&file)
        .current_dir(dir)
        .env("IDEMKEY_URL", base)
        .env("IDEMKEY_TOKEN", TOKEN1);
    // Loopback only: no proxy of the environment's.
    for proxy in ["http_proxy", "https_proxy", "all_proxy"] {
        command
            .env_remove(proxy)
            .env_remove(proxy.to_ascii_uppercase());
    }
    tokio::task::spawn_blocking(move || command.output().expect("start the sample"))
        .await
        .expect("run the sample")
}

/// How a relay loses the first answer.
#[derive(Debug, Clone, Copy)]
enum Loss {
    /// Nothing of it reaches the client.
    Whole,
    /// The client gets its first bytes, never its last: a body (or a header) cut short.
    CutShort,
}

/// What a relay in front of the server did.
#[derive(Debug, Default)]
struct Relayed {
    /// Client connections accepted.
    connections: AtomicUsize,
    /// Whether the first connection's answer was withheld after the server began it.
    lost: AtomicBool,
}

/// A relay on loopback to the server at `base` whose first connection loses its answer: the
/// request is forwarded, and once the server's answer begins (the payment is made) the
/// connections are closed, `loss` saying what of the answer's first read is forwarded first.
/// Later connections are relayed whole. Returns the relay's base URL.
async fn lose_first_answer(base: &str, loss: Loss) -> (String, Arc<Relayed>) {
    let upstream = base
        .strip_prefix("http://")
        .expect("an http:// base")
        .to_owned();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let relayed = Arc::new(Relayed::default());
    let counts = relayed.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let Ok(mut server) = TcpStream::connect(&upstream).await else {
                return;
            };
            let first = counts.connections.fetch_add(1, Ordering::SeqCst) == 0;
            let counts = counts.clone();
            tokio::spawn(async move {
                if !first {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let forward = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                });
                let mut answer = [0u8; 64 * 1024];
                if let Ok(n @ 1..) = from_server.read(&mut answer).await {
                    counts.lost.store(true, Ordering::SeqCst);
                    if let Loss::CutShort = loss {
                        let _ = to_client.write_all(&answer[..n - 1]).await;
                    }
                }
                forward.abort();
                let _ = forward.await;
                drop(to_client);
            });
        }
    });
    (url, relayed)
}

/// What the sample printed: one `STATUS ID replayed: true|false` line per call.
fn calls(name: &str, out: &Output) -> Vec<(String, String, String)> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stopped = match out.status.code() {
        Some(124) => format!(" (stopped: still running after {BOUND_SECS} s)"),
        _ => String::new(),
    };
    assert!(
        out.status.success(),
        "{name} exited with {}{stopped}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
        .lines()
        .map(
            |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                [status, id, "replayed:", replayed] => {
                    (status.to_owned(), id.to_owned(), replayed.to_owned())
                }
                _ => panic!("{name} printed `{line}`, not `STATUS ID replayed: true|false`"),
            },
        )
        .collect()
}

/// Runs the sample `name` straight to a server, then through a relay that loses its first
/// answer whole, then through one that cuts it short, each time on a database of its own.
async fn check(name: &str) {
    let interpreter = interpreter(name);
    let code = sample(name);
    let dir = tempfile::tempdir().expect("temporary directory");

    let backend = Backend::sqlite().await;
    let server = backend.start(&["--first-sent", "required"]).await;
    let out = run(interpreter, dir.path(), name, &code, server.base()).await;
    let printed = calls(name, &out);
    let snapshot = backend.snapshot().await;
    snapshot.assert_consistent(1);
    let id = &snapshot.payments[0];
    assert_eq!(
        printed,
        [
            ("201".into(), id.clone(), "false".into()),
            ("201".into(), id.clone(), "true".into())
        ],
        "{name}: the payment, then its replay"
    );

    for loss in [Loss::Whole, Loss::CutShort] {
        let backend = Backend::sqlite().await;
        let server = backend.start(&["--first-sent", "required"]).await;
        let (relay, relayed) = lose_first_answer(server.base(), loss).await;
        let out = run(interpreter, dir.path(), name, &code, &relay).await;
        let printed = calls(name, &out);
        assert!(
            relayed.lost.load(Ordering::SeqCst),
            "{name}: the relay lost no answer"
        );
        assert!(relayed.connections.load(Ordering::SeqCst) >= 2);
        let snapshot = backend.snapshot().await;
        snapshot.assert_consistent(1);
        let id = &snapshot.payments[0];
        assert_eq!(
            printed,
            [
                ("201".into(), id.clone(), "true".into()),
                ("201".into(), id.clone(), "true".into())
            ],
            "{name}, answer lost {loss:?}: the retry with the same key gets the replay"
        );
    }
}

#[test]
fn the_page_holds_each_sample_once_and_short() {
    let samples = samples();
    let names: Vec<&str> = samples.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, SAMPLES, "the samples of {PAGE}, in order");
    for (name, code) in &samples {
        let lines = code.lines().count();
        assert!(
            lines <= MAX_LINES,
            "{PAGE}: {name} has {lines} lines; at most {MAX_LINES}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_curl_sample_pays_once() {
    check("pay.sh").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sample_pays_once() {
    check("pay.py").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_javascript_sample_pays_once() {
    check("pay.mjs").await;
}
