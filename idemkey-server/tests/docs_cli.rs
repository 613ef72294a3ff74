//! Docs that cannot drift: every `idemkey` command line shown in `README.md` and `docs/`
//! is checked against the real command line.
//!
//! A command line is a line of a `sh`/`bash`/`shell` code block that starts with `idemkey `
//! or `cargo run -p idemkey-server -- ` (a trailing `\` continues it). Each one:
//!
//! - must parse: [`Cli::try_parse_from`] accepts its arguments (`$KEY`, `$URL`, `$PID` stand
//!   for sample values);
//! - runs, with the real binary in a temporary directory, unless the line before its code
//!   block is `<!-- not run: REASON -->` (the reason is required). `serve` and `gateway`
//!   must print their "listening" line (they get `--listen 127.0.0.1:0`, and are then
//!   killed); every other command must exit 0 (`demo` gets `--payments 20`; `keys …` run on
//!   a migrated database). A `postgres://` database URL is replaced by a fresh database on
//!   the test PostgreSQL server; a `sqlite:` one lives in the temporary directory.
//!
//! `idemkey --help`, `idemkey keys --help` and `idemkey outbox --help` are compared with `tests/snapshots/`;
//! `UPDATE_SNAPSHOTS=1` rewrites the snapshots instead.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use idemkey_server::cli::Cli;

mod doc_pages;

/// How long a command may take to finish, or a server to print its "listening" line.
const BOUND: Duration = Duration::from_secs(90);

/// Sample values of the shell variables the docs use.
const VARIABLES: &[(&str, &str)] = &[
    ("KEY", "5b1c0d2e-docs-cli"),
    ("URL", "http://127.0.0.1:8080"),
    ("PID", "1"),
    ("PG_PID", "1"),
];

/// One command line from the docs.
#[derive(Debug)]
struct Invocation {
    /// `file:line`, for messages.
    at: String,
    /// The arguments after `idemkey`.
    args: Vec<String>,
    /// `Some(reason)` when its code block is marked `<!-- not run: REASON -->`.
    not_run: Option<String>,
}

/// The documents to check: the README and every Markdown page under `docs/`.
fn documents() -> Vec<(String, String)> {
    let root = doc_pages::root();
    let paths = doc_pages::pages();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let name = path
                .strip_prefix(&root)
                .unwrap_or(&path)
                .display()
                .to_string();
            (name, text)
        })
        .collect()
}

/// Every command line of every document, and every problem found on the way (a marker
/// without a reason, or not followed by a code block).
fn invocations() -> (Vec<Invocation>, Vec<String>) {
    let mut found = Vec::new();
    let mut problems = Vec::new();
    for (file, text) in documents() {
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i].trim();
            if let Some(marker) = line.strip_prefix("<!-- not run:") {
                let next = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
                if !next.starts_with("```") {
                    problems.push(format!(
                        "{file}:{}: a `not run` marker must be on the line just before a code block",
                        i + 1
                    ));
                }
                if marker.trim_end_matches("-->").trim().is_empty() || !marker.ends_with("-->") {
                    problems.push(format!(
                        "{file}:{}: write `<!-- not run: REASON -->`, with a reason",
                        i + 1
                    ));
                }
            }
            let Some(lang) = line.strip_prefix("```") else {
                i += 1;
                continue;
            };
            let not_run = i
                .checked_sub(1)
                .and_then(|j| lines[j].trim().strip_prefix("<!-- not run:"))
                .map(|m| m.trim_end_matches("-->").trim().to_owned());
            let shell = matches!(lang.trim(), "sh" | "bash" | "shell");
            let mut commands = 0;
            i += 1;
            while i < lines.len() && !lines[i].trim().starts_with("```") {
                let start = i;
                let mut logical = String::new();
                loop {
                    let part = lines[i];
                    match part.strip_suffix('\\') {
                        Some(head) if i + 1 < lines.len() => {
                            logical.push_str(head);
                            logical.push(' ');
                            i += 1;
                        }
                        _ => {
                            logical.push_str(part);
                            i += 1;
                            break;
                        }
                    }
                }
                let logical = logical.trim();
                let rest = logical
                    .strip_prefix("idemkey ")
                    .or_else(|| logical.strip_prefix("cargo run -p idemkey-server -- "));
                if let (true, Some(rest)) = (shell, rest) {
                    commands += 1;
                    let at = format!("{file}:{}", start + 1);
                    match shell_words(rest) {
                        Ok(args) => found.push(Invocation {
                            at,
                            args,
                            not_run: not_run.clone(),
                        }),
                        Err(e) => problems.push(format!("{at}: {e}: {logical}")),
                    }
                }
            }
            if not_run.is_some() && commands == 0 {
                problems.push(format!(
                    "{file}:{i}: a `not run` marker on a block without any idemkey command"
                ));
            }
            i += 1;
        }
    }
    (found, problems)
}

/// Splits a shell command line into words: single and double quotes, backslash escapes,
/// `$NAME` from [`VARIABLES`], `#` comments. Anything else a shell would do is refused.
fn shell_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars().peekable();
    let variable = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
        let mut name = String::new();
        while let Some(&c) = chars.peek() {
            if !(c.is_ascii_alphanumeric() || c == '_') {
                break;
            }
            name.push(c);
            chars.next();
        }
        VARIABLES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, value)| (*value).to_owned())
            .ok_or_else(|| format!("unknown shell variable `${name}` (add it to VARIABLES)"))
    };
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => {
                if let Some(w) = word.take() {
                    words.push(w);
                }
            }
            '#' if word.is_none() => break,
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err("unterminated '".into()),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('$') => w.push_str(&variable(&mut chars)?),
                        Some('\\') => w.push(chars.next().ok_or("dangling \\")?),
                        Some(c) => w.push(c),
                        None => return Err("unterminated \"".into()),
                    }
                }
            }
            '\\' => word
                .get_or_insert_with(String::new)
                .push(chars.next().ok_or("dangling \\")?),
            '$' => {
                let value = variable(&mut chars)?;
                word.get_or_insert_with(String::new).push_str(&value);
            }
            '|' | '&' | ';' | '<' | '>' | '`' | '(' | ')' => {
                return Err(format!("`{c}` is not supported in a documented command"));
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

#[test]
fn not_run_markers_give_a_reason_and_mark_a_command() {
    let (found, problems) = invocations();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        found.len() >= 5,
        "found only {} documented commands: is the scanner broken?\n{found:#?}",
        found.len()
    );
}

#[test]
fn every_documented_command_parses() {
    let (found, _) = invocations();
    let failures: Vec<String> = found
        .iter()
        .filter_map(|inv| {
            let argv = std::iter::once("idemkey".to_owned()).chain(inv.args.iter().cloned());
            Cli::try_parse_from(argv)
                .err()
                .map(|e| format!("{}: idemkey {}\n{e}", inv.at, inv.args.join(" ")))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_documented_command_runs_unless_marked_not_run() {
    let (found, _) = invocations();
    let mut ran = 0;
    for inv in &found {
        if let Some(reason) = &inv.not_run {
            eprintln!(
                "{}: not run ({reason}): idemkey {}",
                inv.at,
                inv.args.join(" ")
            );
            continue;
        }
        run(inv);
        ran += 1;
    }
    assert!(ran > 0, "no documented command ran");
}

/// Replaces `--flag VALUE` (or `--flag=VALUE`) or appends it.
fn set_flag(args: &mut Vec<String>, flag: &str, value: String) {
    if let Some(i) = args.iter().position(|a| a == flag) {
        args[i + 1] = value;
    } else if let Some(i) = args.iter().position(|a| a.starts_with(&format!("{flag}="))) {
        args[i] = format!("{flag}={value}");
    } else {
        args.extend([flag.to_owned(), value]);
    }
}

fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(String::as_str)
}

fn run(inv: &Invocation) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut args = inv.args.clone();
    if let Some(url) = flag_value(&args, "--database-url") {
        let url = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            idemkey_testkit::fresh_database_url()
        } else if let Some(path) = url.strip_prefix("sqlite:") {
            let name = Path::new(path).file_name().expect("a sqlite file name");
            format!("sqlite:{}", dir.path().join(name).display())
        } else {
            panic!("{}: unexpected database URL {url}", inv.at);
        };
        set_flag(&mut args, "--database-url", url);
    }
    // A secret file the docs name (`/run/secrets/…`) is made in the temporary directory.
    for flag in ["--key-secret-file", "--previous-key-secret-file"] {
        if let Some(path) = flag_value(&args, flag) {
            let name = Path::new(path).file_name().expect("a secret file name");
            let file = dir.path().join(name);
            std::fs::write(&file, format!("{flag} for {}\n", inv.at)).expect("secret file");
            set_flag(&mut args, flag, file.display().to_string());
        }
    }
    let subcommand = args.first().cloned().unwrap_or_default();
    eprintln!("{}: running idemkey {}", inv.at, args.join(" "));
    match subcommand.as_str() {
        "serve" | "gateway" => {
            set_flag(&mut args, "--listen", "127.0.0.1:0".to_owned());
            let (listening, output) = spawn(dir.path(), &args, Until::Listening);
            assert!(
                listening,
                "{}: `idemkey {}` did not print its listening line (it exited, or {BOUND:?} passed)\n{output}",
                inv.at,
                args.join(" ")
            );
        }
        _ => {
            if subcommand == "demo" {
                set_flag(&mut args, "--payments", "20".to_owned());
            }
            if subcommand == "keys" || subcommand == "outbox" {
                // What an operator inspects is a database `idemkey serve` has used, with the
                // same database and key secret flags as the documented line.
                let mut serve = vec!["serve".to_owned(), "--listen".to_owned()];
                serve.push("127.0.0.1:0".to_owned());
                for flag in ["--database-url", "--key-secret", "--key-secret-file"] {
                    if let Some(value) = flag_value(&args, flag) {
                        serve.extend([flag.to_owned(), value.to_owned()]);
                    }
                }
                let (listening, output) = spawn(dir.path(), &serve, Until::Listening);
                assert!(
                    listening,
                    "{}: `idemkey serve` for `keys` failed\n{output}",
                    inv.at
                );
            }
            let (ok, output) = spawn(dir.path(), &args, Until::Exit);
            assert!(
                ok,
                "{}: `idemkey {}` did not exit 0 within {BOUND:?}\n{output}",
                inv.at,
                args.join(" ")
            );
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Until {
    /// Until the process prints `… listening on …`; then it is killed.
    Listening,
    /// Until the process exits.
    Exit,
}

/// Runs `idemkey ARGS` in `dir`, bounded by [`BOUND`]. Returns whether it listened (or exited
/// 0) and what it printed.
fn spawn(dir: &Path, args: &[String], until: Until) -> (bool, String) {
    let mut child = idemkey(dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idemkey");
    let (tx, rx) = mpsc::channel::<(bool, String)>();
    let readers: Vec<_> = [
        (
            false,
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
        ),
        (true, Box::new(child.stderr.take().expect("stderr"))),
    ]
    .into_iter()
    .map(|(is_stderr, pipe)| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if tx.send((is_stderr, line)).is_err() {
                    break;
                }
            }
        })
    })
    .collect();
    drop(tx);

    let deadline = Instant::now() + BOUND;
    let mut output = String::new();
    let mut listened = false;
    let finished = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((is_stderr, line)) => {
                output.push_str(if is_stderr { "stderr| " } else { "stdout| " });
                output.push_str(&line);
                output.push('\n');
                if until == Until::Listening && !is_stderr && line.contains(" listening on ") {
                    listened = true;
                    break false;
                }
            }
            // Both pipes closed: the process is exiting.
            Err(mpsc::RecvTimeoutError::Disconnected) => break true,
            Err(mpsc::RecvTimeoutError::Timeout) => break false,
        }
    };
    let status = if finished {
        child.wait().expect("wait for idemkey")
    } else {
        kill(&mut child)
    };
    drop(rx);
    for reader in readers {
        let _ = reader.join();
    }
    output.push_str(&format!("exit: {status}\n"));
    match until {
        Until::Listening => (listened, output),
        Until::Exit => (finished && status.success(), output),
    }
}

fn kill(child: &mut Child) -> std::process::ExitStatus {
    let _ = child.kill();
    child.wait().expect("wait for idemkey")
}

/// `idemkey` in `dir`, without the caller's idemkey settings.
fn idemkey(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemkey"));
    command
        .current_dir(dir)
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_API_KEYS")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_TOKEN")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    command
}

#[test]
fn help_matches_its_snapshot() {
    check_snapshot("idemkey-help.txt", &["--help"]);
}

#[test]
fn keys_help_matches_its_snapshot() {
    check_snapshot("idemkey-keys-help.txt", &["keys", "--help"]);
}

#[test]
fn outbox_help_matches_its_snapshot() {
    check_snapshot("idemkey-outbox-help.txt", &["outbox", "--help"]);
}

/// Compares `idemkey ARGS`'s standard output with `tests/snapshots/NAME`, or rewrites the
/// snapshot when `UPDATE_SNAPSHOTS=1`.
fn check_snapshot(name: &str, args: &[&str]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let output = idemkey(dir.path())
        .args(args)
        .output()
        .expect("run idemkey");
    assert!(output.status.success(), "idemkey {args:?}: {output:?}");
    let actual = String::from_utf8(output.stdout).expect("UTF-8 help");
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("snapshot directory");
        std::fs::write(&path, &actual).expect("write the snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        expected == actual,
        "`idemkey {}` differs from {} (- snapshot, + now); update the docs that show it, then \
         rerun with UPDATE_SNAPSHOTS=1 to accept:\n{}",
        args.join(" "),
        path.display(),
        diff(&expected, &actual)
    );
}

/// A line diff (longest common subsequence): ` ` same, `-` only in `old`, `+` only in `new`.
fn diff(old: &str, new: &str) -> String {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            out.push_str(&format!("  {}\n", a[i]));
            (i, j) = (i + 1, j + 1);
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            out.push_str(&format!("- {}\n", a[i]));
            i += 1;
        } else {
            out.push_str(&format!("+ {}\n", b[j]));
            j += 1;
        }
    }
    out
}

#[test]
fn shell_words_follow_the_shell() {
    assert_eq!(
        shell_words(r#"keys show --tenant acme "$KEY" --body '{"a": 1}' a\ b # note"#).unwrap(),
        [
            "keys",
            "show",
            "--tenant",
            "acme",
            "5b1c0d2e-docs-cli",
            "--body",
            r#"{"a": 1}"#,
            "a b"
        ]
    );
    assert!(shell_words("serve | tee log").is_err());
    assert!(shell_words("serve $UNKNOWN").is_err());
}
