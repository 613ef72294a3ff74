//! `docs/guide/tutorial.md`, walked as a reader walks it: its commands run with `sh` as shown,
//! its files written as shown, its answers compared with what the commands print.
//!
//! The page marks what the test takes with the line before a code block:
//!
//! - `<!-- tutorial: file PATH -->`: a file of the crate (`Cargo.toml` is its
//!   `[dependencies]` section, which takes the place of the one `cargo new` wrote);
//! - `<!-- tutorial: run NAME -->`: commands, run with `sh` in the crate's directory (`new` in
//!   the directory above it);
//! - `<!-- tutorial: output NAME -->`: what the commands print: the status line, the header
//!   names and the body (`date` and `idempotency-key-expires` are the page's own moment), a
//!   curl error line, or a table.
//!
//! What the test changes, and only that: the dependencies on idemkey by `../idemkey/` become
//! paths into this workspace; the service listens on a port of its own instead of 3000 (the
//! commands call it there); the workspace's `[profile.dev]`, `Cargo.lock` and toolchain file
//! are added, and cargo runs offline in the workspace's target directory, so that the build
//! reuses what the workspace built where the features agree (where they do not, cargo builds
//! those crates once per target directory: docs/decisions.md, "The tutorial is built and run
//! as the page shows it"). The database is a fresh one on the test kit's PostgreSQL, named by
//! `DATABASE_URL` as the page tells the reader to; `src/main.rs` must be as rustfmt writes it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process_group};

/// The page, relative to the workspace.
const PAGE: &str = "docs/guide/tutorial.md";
/// What starts a marker line.
const MARKER: &str = "<!-- tutorial:";
/// Where the page's service listens, in its code and its commands.
const PAGE_ADDRESS: &str = "127.0.0.1:3000";
/// What the service prints once it listens, before its address.
const LISTENING: &str = "listening on ";
/// How the page depends on idemkey's crates: a checkout beside the new crate.
const CHECKOUT: &str = "\"../idemkey/";
/// How long `cargo run` may take to start the service: the crate is built by then, but cargo
/// may wait for another build's lock on the target directory.
const START_BOUND: Duration = Duration::from_secs(300);

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_owned()
}

/// The target directory this test was built in (`target/`, or `CARGO_TARGET_DIR`), where the
/// workspace's dependencies are.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory holds tmp/")
        .to_owned()
}

/// A marked code block of the page.
struct Block {
    kind: String,
    name: String,
    text: String,
}

/// Every marked block of the page, in order.
fn blocks() -> Vec<Block> {
    let path = root().join(PAGE);
    let page =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let lines: Vec<&str> = page.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix(MARKER) else {
            continue;
        };
        let words: Vec<&str> = rest.trim_end_matches("-->").split_whitespace().collect();
        let [kind, name] = words[..] else {
            panic!("{PAGE}:{}: a marker is `{MARKER} KIND NAME -->`", i + 1);
        };
        assert!(
            lines.get(i + 1).is_some_and(|l| l.starts_with("```")),
            "{PAGE}:{}: the marker must be on the line just before its code block",
            i + 1
        );
        let text: Vec<&str> = lines[i + 2..]
            .iter()
            .take_while(|l| !l.starts_with("```"))
            .copied()
            .collect();
        found.push(Block {
            kind: kind.to_owned(),
            name: name.to_owned(),
            text: text.join("\n") + "\n",
        });
    }
    found
}

/// The one block of `kind` named `name`.
fn block<'a>(blocks: &'a [Block], kind: &str, name: &str) -> &'a str {
    let mut matching = blocks.iter().filter(|b| b.kind == kind && b.name == name);
    let found = matching
        .next()
        .unwrap_or_else(|| panic!("{PAGE} has no `{MARKER} {kind} {name} -->` block"));
    assert!(
        matching.next().is_none(),
        "{PAGE}: two `{kind} {name}` blocks"
    );
    &found.text
}

/// `[dependencies]` and what follows, as the page shows it, with idemkey's crates taken from
/// this workspace.
fn dependencies(page: &str) -> String {
    assert!(
        page.starts_with("[dependencies]\n"),
        "{PAGE}: the Cargo.toml block is the `[dependencies]` section"
    );
    for krate in ["idemkey-core", "idemkey-tower", "idemkey-postgres"] {
        assert!(
            page.contains(&format!("{krate} = {{ path = {CHECKOUT}{krate}\" }}")),
            "{PAGE}: {krate} is taken from the checkout, as the README says"
        );
    }
    page.replace(CHECKOUT, &format!("\"{}/", root().display()))
}

/// The workspace's `[profile.dev]` table: the scratch crate builds its dependencies as the
/// workspace does, so the ones the workspace built are not built again.
fn workspace_dev_profile() -> String {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("the workspace");
    let mut lines = manifest.lines().skip_while(|l| l.trim() != "[profile.dev]");
    let header = lines.next().expect("the workspace has a [profile.dev]");
    let table: Vec<&str> = lines.take_while(|l| !l.starts_with('[')).collect();
    format!("\n{header}\n{}\n", table.join("\n").trim())
}

/// `sh -c script` in `dir`, with the environment a reader's terminal has here: cargo
/// offline in the workspace's target directory, psql on `PATH`, no proxy.
fn sh(script: &str, dir: &Path, database_url: &str) -> Command {
    let psql_dir = idemkey_testkit::postgres_binary("psql")
        .parent()
        .expect("psql's directory")
        .to_owned();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(std::iter::once(psql_dir).chain(std::env::split_paths(&path)))
        .expect("PATH");
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .stdin(Stdio::null())
        .env("PATH", path)
        .env("DATABASE_URL", database_url)
        .env("CARGO_TARGET_DIR", target_dir())
        .env("CARGO_NET_OFFLINE", "true")
        .env("PSQLRC", "/dev/null");
    for proxy in ["http_proxy", "https_proxy", "all_proxy"] {
        command
            .env_remove(proxy)
            .env_remove(proxy.to_ascii_uppercase());
    }
    command
}

/// Runs `command` to its end.
fn output(mut command: Command, what: &str) -> Output {
    command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run sh: {e}"))
}

/// The service the page's `run` commands start, in a process group of its own (`sh`, and
/// `cargo run`, and the service), killed whole when dropped.
struct Service {
    child: Child,
    log: PathBuf,
}

impl Service {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = kill_process_group(Pid::from_child(&self.child), Signal::KILL);
        let _ = self.child.wait();
    }
}

/// Starts the page's `run` commands and waits for the service's address.
fn start(script: &str, dir: &Path, database_url: &str) -> (Service, String) {
    let log = dir.join("service.log");
    let mut command = sh(script, dir, database_url);
    command
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("the service's log"));
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().expect("start the service");
    let stdout = child.stdout.take().expect("piped stdout");
    let service = Service { child, log };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(address) = line.strip_prefix(LISTENING)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(address.trim().to_owned());
            }
        }
    });
    match rx.recv_timeout(START_BOUND) {
        Ok(address) => (service, address),
        Err(e) => panic!(
            "the service did not say `{LISTENING}…` ({e}); its stderr:\n{}",
            service.log()
        ),
    }
}

/// An answer as `curl -i` prints it.
#[derive(Debug, PartialEq)]
struct Answer {
    status: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn parse(text: &str) -> Self {
        let text = text.replace("\r\n", "\n");
        let (head, body) = text
            .split_once("\n\n")
            .unwrap_or_else(|| panic!("not an answer with a head and a body:\n{text}"));
        let mut lines = head.lines();
        let status = lines.next().unwrap_or_default().trim().to_owned();
        let headers = lines
            .map(|line| {
                let (name, value) = line.split_once(':').expect("a header line");
                (name.trim().to_ascii_lowercase(), value.trim().to_owned())
            })
            .collect();
        Self {
            status,
            headers,
            body: body.trim_end().to_owned(),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// This answer, with the values that name a moment left out.
    fn timeless(&self) -> Self {
        let headers = self
            .headers
            .iter()
            .map(|(name, value)| match name.as_str() {
                "date" | "idempotency-key-expires" => (name.clone(), String::new()),
                _ => (name.clone(), value.clone()),
            })
            .collect();
        Self {
            status: self.status.clone(),
            headers,
            body: self.body.clone(),
        }
    }
}

/// What `out` printed, which must be a success, as an answer.
fn answer(out: &Output, what: &str) -> Answer {
    assert!(
        out.status.success(),
        "{what}: {}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Answer::parse(&String::from_utf8_lossy(&out.stdout))
}

/// Asserts that `got` is the answer the page shows as `output name`, but for its moments.
fn assert_shown(blocks: &[Block], name: &str, got: &Answer) {
    let shown = Answer::parse(block(blocks, "output", name));
    assert_eq!(
        got.timeless(),
        shown.timeless(),
        "{PAGE}: `output {name}` is not what the commands printed"
    );
}

/// The lines of `text` without their trailing blanks and blank lines at the end.
fn trimmed_lines(text: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines
}

#[test]
fn the_tutorial_builds_and_charges_a_retried_payment_once() {
    let blocks = blocks();
    let database_url = idemkey_testkit::fresh_database_url();
    let scratch = tempfile::tempdir().expect("a temporary directory");
    let root = root();

    // `cargo new`, as the page runs it.
    let new = output(
        sh(block(&blocks, "run", "new"), scratch.path(), &database_url),
        "cargo new",
    );
    assert!(
        new.status.success(),
        "cargo new: {}",
        String::from_utf8_lossy(&new.stderr)
    );
    let krate = scratch.path().join("payments");

    // The files the page shows.
    let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("cargo new's manifest");
    let (package, _) = manifest
        .split_once("[dependencies]")
        .expect("cargo new writes a [dependencies] section");
    let toml = block(&blocks, "file", "Cargo.toml");
    let manifest = format!("{package}{}{}", dependencies(toml), workspace_dev_profile());
    std::fs::write(krate.join("Cargo.toml"), manifest).expect("write Cargo.toml");
    let mut main_rs = false;
    for file in blocks
        .iter()
        .filter(|b| b.kind == "file" && b.name != "Cargo.toml")
    {
        let mut text = file.text.clone();
        if file.name == "src/main.rs" {
            assert_eq!(
                text.matches(PAGE_ADDRESS).count(),
                1,
                "{PAGE}: src/main.rs binds {PAGE_ADDRESS}, once"
            );
            text = text.replace(PAGE_ADDRESS, "127.0.0.1:0");
            main_rs = true;
        }
        let path = krate.join(&file.name);
        std::fs::create_dir_all(path.parent().expect("a directory")).expect("mkdir");
        std::fs::write(&path, text).expect("write a file of the page");
    }
    assert!(main_rs, "{PAGE} shows src/main.rs");
    for kept in ["Cargo.lock", "rust-toolchain.toml"] {
        std::fs::copy(root.join(kept), krate.join(kept)).expect("copy the workspace's file");
    }

    // Formatted as rustfmt formats it, as a reader's editor would leave it.
    let fmt = output(
        sh(
            "rustfmt --check --edition 2024 src/main.rs",
            &krate,
            &database_url,
        ),
        "rustfmt",
    );
    assert!(
        fmt.status.success(),
        "{PAGE}: src/main.rs is not as rustfmt writes it:\n{}",
        String::from_utf8_lossy(&fmt.stdout)
    );

    // The build `cargo run` makes, measured on its own.
    let started = Instant::now();
    let build = output(sh("cargo build", &krate, &database_url), "cargo build");
    assert!(
        build.status.success(),
        "the tutorial's crate does not build:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let compiled = String::from_utf8_lossy(&build.stderr)
        .lines()
        .filter(|l| l.trim_start().starts_with("Compiling "))
        .count();
    eprintln!(
        "the tutorial's crate built in {:.1?}, {compiled} crates compiled",
        started.elapsed()
    );

    // `cargo run`, as the page runs it, on a fresh database.
    let started = Instant::now();
    let (service, address) = start(block(&blocks, "run", "service"), &krate, &database_url);
    eprintln!("the service listened after {:.1?}", started.elapsed());
    let base = format!("http://{PAGE_ADDRESS}");
    let call = |name: &str| {
        let script = block(&blocks, "run", name);
        output(
            sh(&script.replace(&base, &address), &krate, &database_url),
            name,
        )
    };

    for name in ["pay", "lost", "retry"] {
        assert!(
            block(&blocks, "run", name).contains(&base),
            "{PAGE}: `run {name}` calls {base}"
        );
    }

    // The payment, then the same command again: a replay, byte for byte.
    let first = answer(&call("pay"), "the payment");
    assert_eq!(first.status, "HTTP/1.1 201 Created", "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), None, "{first:?}");
    assert_shown(&blocks, "pay", &first);
    let again = answer(&call("pay"), "the payment again");
    assert_eq!(again.status, first.status);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body, "the replay's body is the first's");
    assert_shown(&blocks, "pay-again", &again);

    // An answer lost after the payment was made, then the retry with its key.
    let lost = call("lost");
    let stderr = String::from_utf8_lossy(&lost.stderr);
    assert_eq!(
        lost.status.code(),
        Some(63),
        "curl gives up on the answer: {stderr}"
    );
    assert!(lost.stdout.is_empty(), "nothing of the answer is printed");
    let shown = trimmed_lines(block(&blocks, "output", "lost"));
    assert_eq!(
        trimmed_lines(&stderr).last(),
        shown.last(),
        "{PAGE}: `output lost` is not what curl said"
    );
    let retry = answer(&call("retry"), "the retry");
    assert_eq!(retry.status, "HTTP/1.1 201 Created", "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_shown(&blocks, "retry", &retry);

    // One row per payment.
    let table = call("table");
    assert!(
        table.status.success(),
        "psql: {}",
        String::from_utf8_lossy(&table.stderr)
    );
    let printed = String::from_utf8_lossy(&table.stdout);
    assert_eq!(
        trimmed_lines(&printed),
        trimmed_lines(block(&blocks, "output", "table")),
        "{PAGE}: `output table` is not what psql printed"
    );
    assert!(printed.contains("(2 rows)"), "{printed}");
    drop(service);
}
