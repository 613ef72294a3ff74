//! A SQLite URL the server cannot honour is refused at start by every command that takes
//! `--database-url`, with a message that names the URL and what to write instead, and
//! nothing is created in the working directory:
//!
//! - an in-memory database, however it is spelled: each of the store's connections would
//!   open a database of its own (sqlx renames `:memory:` to `file:sqlx-in-memory-N`, which
//!   opened as a path would be a new file);
//! - no file at all: SQLite would open a temporary database for each connection;
//! - a file named as a SQLite `file:` URI: SQLite would open another file than the one the
//!   server makes private (0600);
//! - query parameters: the store opens the file by its path alone, so `mode=ro`,
//!   `immutable=1`, `vfs=…` or `cache=shared` would be accepted and have no effect;
//! - a file name that holds `?` or a %-escape: the migrations would open another file.
//!
//! The forms that are accepted make the file they name, mode 0600, and nothing else.

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

/// The in-memory refusal's words.
const IN_MEMORY_REFUSED: &str =
    "is an in-memory database, which the server's connections cannot share";

/// URLs that name no file.
const NO_FILE: [&str; 2] = ["sqlite:", "sqlite://"];

/// The refusal's words for a URL without a file.
const NO_FILE_REFUSED: &str = "names no file";

/// `file:` URIs, and the URL to write instead: sqlx's percent-decoding makes `file%3A` one
/// too, and the URI's own query (escaped, or in the URL) goes with it.
const FILE_URIS: [(&str, &str); 7] = [
    ("sqlite:file:idemkey.db", "sqlite:idemkey.db"),
    ("sqlite://file:idemkey.db", "sqlite:idemkey.db"),
    ("sqlite:file%3Aidemkey.db", "sqlite:idemkey.db"),
    ("sqlite:file:idemkey.db%3Fmode%3Dro", "sqlite:idemkey.db"),
    ("sqlite:file:idemkey.db?mode=ro", "sqlite:idemkey.db"),
    ("sqlite:file:data/idemkey.db", "sqlite:data/idemkey.db"),
    (
        "sqlite:file:///idemkey-absent-directory/idemkey.db",
        "sqlite:/idemkey-absent-directory/idemkey.db",
    ),
];

/// The refusal's words for a `file:` URI.
const FILE_URI_REFUSED: &str = "names its file as a SQLite `file:` URI";

/// URLs with query parameters: each of those sqlx reads (`mode`, `cache`, `immutable`,
/// `vfs`) and one it does not, as the message shows the URL and the parameters' names, and
/// the URL to write instead.
const QUERIES: [(&str, &str, &str, &str); 10] = [
    (
        "sqlite:idemkey.db?mode=ro",
        "sqlite:idemkey.db?mode=ro",
        "(mode)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?mode=rw",
        "sqlite:idemkey.db?mode=rw",
        "(mode)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?mode=rwc",
        "sqlite:idemkey.db?mode=rwc",
        "(mode)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?cache=shared",
        "sqlite:idemkey.db?cache=shared",
        "(cache)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?cache=private",
        "sqlite:idemkey.db?cache=private",
        "(cache)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?immutable=1",
        "sqlite:idemkey.db?immutable=1",
        "(immutable)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?vfs=unix-dotfile",
        "sqlite:idemkey.db?vfs=unix-dotfile",
        "(vfs)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite://idemkey.db?mode=rwc&cache=private",
        "sqlite://idemkey.db?mode=rwc&cache=private",
        "(mode, cache)",
        "sqlite://idemkey.db",
    ),
    (
        "sqlite:idemkey.db?mode=bogus",
        "sqlite:idemkey.db?mode=bogus",
        "(mode)",
        "sqlite:idemkey.db",
    ),
    (
        "sqlite:idemkey.db?key=hunter2",
        "sqlite:idemkey.db?key=***",
        "(key)",
        "sqlite:idemkey.db",
    ),
];

/// The refusal's words for query parameters.
const QUERY_REFUSED: &str = "which the server does not apply";

/// File names that the migrations, given `sqlite:<name>`, would read as another file.
const UNSAFE_NAMES: [&str; 2] = ["sqlite:a%3Fb.db", "sqlite:a%2541.db"];

/// The refusal's words for such a name.
const UNSAFE_NAME_REFUSED: &str = "would read as another file";

/// What a command prints once it runs: a refused one never prints it.
const STARTED: [&str; 3] = [
    "idemkey listening on ",
    "idemkey gateway listening on ",
    "idemkey relay delivering to ",
];

/// Every command that takes `--database-url`, with what else it needs to start.
const COMMANDS: [&[&str]; 7] = [
    &["serve", "--listen", "127.0.0.1:0", "--api-key", "t1=tok1"],
    &[
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
        "--single-tenant",
        "all",
    ],
    &["migrate"],
    &["keys", "list"],
    &[
        "relay",
        "--listen",
        "127.0.0.1:0",
        "--outbox-webhook",
        "http://127.0.0.1:9/hook",
    ],
    &["outbox", "list"],
    &["demo", "--payments", "1"],
];

/// How a run of `idemkey` ended.
struct Run {
    /// The command line, for messages.
    shown: String,
    /// The line that said it runs (it was stopped then).
    started: Option<String>,
    success: bool,
    stderr: String,
    /// The working directory's files once it ended.
    left: Vec<String>,
}

/// Runs `idemkey` with `args` and `--database-url url` in the empty directory `dir`, until
/// it exits or says it runs (then it is stopped).
fn run(dir: &Path, args: &[&str], url: &str) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(args)
        .args(["--database-url", url])
        .current_dir(dir)
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
    Run {
        shown: format!("idemkey {} --database-url {url}", args.join(" ")),
        started,
        success: status.success(),
        stderr: errors.join().expect("the stderr reader"),
        left: files(dir),
    }
}

/// Runs `idemkey` with `args` and `--database-url url` in an empty directory, and says what
/// went wrong, if anything: it started, it exited 0, its message lacks one of `words` or
/// holds `hidden`, or it left files behind.
fn refused(args: &[&str], url: &str, words: &[&str], hidden: Option<&str>) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let run = run(dir.path(), args, url);
    let Run {
        shown,
        started,
        success,
        stderr,
        left,
    } = run;
    if let Some(line) = started {
        return Err(format!("{shown}: started ({line}), left {left:?}"));
    }
    if success {
        return Err(format!("{shown}: exited 0, left {left:?}"));
    }
    if let Some(missing) = words.iter().find(|w| !stderr.contains(*w)) {
        return Err(format!("{shown}: no {missing:?} in: {stderr}"));
    }
    if let Some(hidden) = hidden.filter(|h| stderr.contains(h)) {
        return Err(format!("{shown}: shows {hidden:?}: {stderr}"));
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

/// Asserts that no failure was found, naming each one.
fn none(failures: Vec<String>) {
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Runs every command with every in-memory spelling; fails naming each one that was not
/// refused.
#[test]
fn every_command_refuses_an_in_memory_database() {
    none(
        COMMANDS
            .iter()
            .flat_map(|args| IN_MEMORY.map(|url| (args, url)))
            .filter_map(|(args, url)| refused(args, url, &[IN_MEMORY_REFUSED, url], None).err())
            .collect(),
    );
}

#[test]
fn every_command_refuses_a_url_without_a_file() {
    none(
        COMMANDS
            .iter()
            .flat_map(|args| NO_FILE.map(|url| (args, url)))
            .filter_map(|(args, url)| {
                refused(
                    args,
                    url,
                    &[NO_FILE_REFUSED, url, "sqlite:idemkey.db"],
                    None,
                )
                .err()
            })
            .collect(),
    );
}

#[test]
fn every_command_refuses_a_file_uri() {
    none(
        COMMANDS
            .iter()
            .flat_map(|args| FILE_URIS.map(|case| (args, case)))
            .filter_map(|(args, (url, instead))| {
                let instead = format!("write `{instead}`");
                refused(args, url, &[FILE_URI_REFUSED, url, &instead], None).err()
            })
            .collect(),
    );
}

#[test]
fn every_command_refuses_query_parameters() {
    none(
        COMMANDS
            .iter()
            .flat_map(|args| QUERIES.map(|case| (args, case)))
            .filter_map(|(args, (url, shown, names, instead))| {
                let shown = format!("`{shown}`");
                let instead = format!("write `{instead}`");
                let words = [QUERY_REFUSED, &shown, names, &instead];
                refused(args, url, &words, Some("hunter2")).err()
            })
            .collect(),
    );
}

#[test]
fn every_command_refuses_a_name_the_migrations_would_misread() {
    none(
        COMMANDS
            .iter()
            .flat_map(|args| UNSAFE_NAMES.map(|url| (args, url)))
            .filter_map(|(args, url)| refused(args, url, &[UNSAFE_NAME_REFUSED, url], None).err())
            .collect(),
    );
}

/// The accepted forms, and the file each makes: `sqlite:<path>`, `sqlite://<path>`, a
/// %-escape for a character a URL cannot hold, and `./` before a name that begins with
/// `file:`.
const ACCEPTED: [(&str, &str); 4] = [
    ("sqlite:idemkey.db", "idemkey.db"),
    ("sqlite://idemkey.db", "idemkey.db"),
    ("sqlite:idemkey%20one.db", "idemkey one.db"),
    ("sqlite:./file:idemkey.db", "file:idemkey.db"),
];

#[test]
fn migrate_makes_the_file_an_accepted_url_names_and_only_it() {
    use std::os::unix::fs::PermissionsExt;

    let mut failures = Vec::new();
    for (url, file) in ACCEPTED {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let run = run(dir.path(), &["migrate"], url);
        let shown = &run.shown;
        if !run.success || run.left != [file] {
            failures.push(format!(
                "{shown}: success {}, left {:?}: {}",
                run.success, run.left, run.stderr
            ));
            continue;
        }
        let mode = std::fs::metadata(dir.path().join(file))
            .expect("the database file")
            .permissions()
            .mode()
            & 0o777;
        if mode != 0o600 {
            failures.push(format!("{shown}: {file} has mode {mode:o}"));
        }
    }
    none(failures);
}
