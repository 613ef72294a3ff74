//! An in-memory SQLite database is refused at start, however it is spelled, by every
//! command that takes `--database-url`: each of the store's connections would open a
//! database of its own. The refusal names the URL, and nothing is created in the working
//! directory (sqlx renames `:memory:` to `file:sqlx-in-memory-N`, which opened as a path
//! would be a new file).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};

/// The in-memory spellings: sqlx's (`:memory:`, `mode=memory`), SQLite's own URI filenames,
/// and the name sqlx gives `:memory:`.
const IN_MEMORY: [&str; 9] = [
    "sqlite::memory:",
    "sqlite://:memory:",
    "sqlite::memory:?cache=shared",
    "sqlite://?mode=memory",
    "sqlite:?mode=memory",
    "sqlite:idemkey.db?mode=memory",
    "sqlite:file::memory:",
    "sqlite:file:idemkey.db%3Fmode%3Dmemory",
    "sqlite:file:sqlx-in-memory-0",
];

/// What a command prints once it runs: a refused one never prints it.
const STARTED: [&str; 3] = [
    "idemkey listening on ",
    "idemkey gateway listening on ",
    "idemkey relay delivering to ",
];

/// The refusal's words.
const REFUSED: &str = "is an in-memory database, which the server's connections cannot share";

/// Runs `idemkey` with `args` and `--database-url url` in an empty directory, and says what
/// went wrong, if anything: it started (it is stopped then), it exited 0, it did not give
/// the refusal, or it left files behind.
fn refused(args: &[&str], url: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(args)
        .args(["--database-url", url])
        .current_dir(dir.path())
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_PREVIOUS_KEY_SECRET")
        .env_remove("IDEMKEY_API_KEYS")
        .env_remove("IDEMKEY_OUTBOX_WEBHOOK")
        .env_remove("IDEMKEY_OUTBOX_NATS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idemkey");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    // Read until the command exits (its stdout closes) or says it runs.
    let stdout = child.stdout.take().expect("piped stdout");
    let started = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|line| STARTED.iter().any(|s| line.starts_with(s)));
    if started.is_some() {
        child.kill().expect("stop idemkey");
    }
    let status = child.wait().expect("reap idemkey");
    let stderr = errors.join().expect("the stderr reader");
    let left = files(dir.path());
    let shown = format!("idemkey {} --database-url {url}", args.join(" "));
    if let Some(line) = started {
        return Err(format!("{shown}: started ({line}), left {left:?}"));
    }
    if status.success() {
        return Err(format!("{shown}: exited 0, left {left:?}"));
    }
    if !stderr.contains(REFUSED) || !stderr.contains(url) {
        return Err(format!("{shown}: not refused as in-memory: {stderr}"));
    }
    if !left.is_empty() {
        return Err(format!("{shown}: left {left:?}"));
    }
    Ok(())
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read the directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

/// Runs `args` with every in-memory spelling; fails naming each one that was not refused.
fn every_spelling_refused(args: &[&str]) {
    let failures: Vec<String> = IN_MEMORY
        .iter()
        .filter_map(|url| refused(args, url).err())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn serve_refuses_an_in_memory_database() {
    every_spelling_refused(&["serve", "--listen", "127.0.0.1:0", "--api-key", "t1=tok1"]);
}

#[test]
fn gateway_refuses_an_in_memory_database() {
    every_spelling_refused(&[
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
        "--single-tenant",
        "all",
    ]);
}

#[test]
fn migrate_refuses_an_in_memory_database() {
    every_spelling_refused(&["migrate"]);
}

#[test]
fn keys_refuses_an_in_memory_database() {
    every_spelling_refused(&["keys", "list"]);
}

#[test]
fn relay_refuses_an_in_memory_database() {
    every_spelling_refused(&[
        "relay",
        "--listen",
        "127.0.0.1:0",
        "--outbox-webhook",
        "http://127.0.0.1:9/hook",
    ]);
}

#[test]
fn outbox_refuses_an_in_memory_database() {
    every_spelling_refused(&["outbox", "list"]);
}

#[test]
fn demo_refuses_an_in_memory_database() {
    every_spelling_refused(&["demo", "--payments", "1"]);
}
