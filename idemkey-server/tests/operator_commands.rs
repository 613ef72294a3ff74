//! Operator commands (`idemkey keys …`) open an existing database and an existing key secret
//! and create neither: pointed at the wrong database, they fail and leave nothing behind.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs `idemkey` with `args` in `dir`, without the environment's idemkey settings.
fn idemkey(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(args)
        .current_dir(dir)
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_PREVIOUS_KEY_SECRET")
        .env_remove("IDEMKEY_API_KEYS")
        .stdin(Stdio::null())
        .output()
        .expect("run idemkey")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Starts `idemkey serve` in `dir` with `args`, waits until it listens, then kills it.
fn serve_once(dir: &Path, args: &[&str]) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(["serve", "--listen", "127.0.0.1:0", "--api-key", "t1=tok1"])
        .args(args)
        .current_dir(dir)
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_KEY_SECRET")
        .env_remove("IDEMKEY_PREVIOUS_KEY_SECRET")
        .env_remove("IDEMKEY_API_KEYS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start idemkey serve");
    let stdout = child.stdout.take().expect("piped stdout");
    let listening = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line.starts_with("idemkey listening on "));
    child.kill().expect("stop idemkey serve");
    child.wait().expect("reap idemkey serve");
    assert!(listening, "idemkey serve {args:?} did not start");
}

#[test]
fn keys_refuses_a_missing_sqlite_file_and_creates_none() {
    let dir = tempfile::tempdir().unwrap();
    let output = idemkey(
        dir.path(),
        &["keys", "list", "--database-url", "sqlite:none.db"],
    );
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(message.contains("none.db"), "{message}");
    assert!(message.contains("--database-url"), "{message}");
    assert!(!dir.path().join("none.db").exists());
    assert_eq!(
        files(dir.path()),
        Vec::<String>::new(),
        "nothing left behind"
    );

    // The default URL too.
    let output = idemkey(dir.path(), &["keys", "purge"]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("idemkey.db"),
        "{}",
        stderr(&output)
    );
    assert_eq!(files(dir.path()), Vec::<String>::new());
}

#[test]
fn keys_refuses_a_database_without_idemkey_tables_and_adds_none() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other.db");
    std::fs::write(&other, b"").unwrap(); // an empty SQLite database
    for command in [&["keys", "list"][..], &["keys", "purge"][..]] {
        let mut args = command.to_vec();
        args.extend(["--database-url", "sqlite:other.db", "--key-secret", "x"]);
        let output = idemkey(dir.path(), &args);
        assert!(!output.status.success(), "{args:?}");
        let message = stderr(&output);
        assert!(message.contains("other.db"), "{message}");
        assert!(message.contains("no idemkey tables"), "{message}");
    }
    assert_eq!(
        std::fs::metadata(&other).unwrap().len(),
        0,
        "no tables made"
    );
    assert_eq!(files(dir.path()), vec!["other.db".to_owned()]);
}

#[test]
fn keys_needs_the_secret_serve_was_given_and_makes_none() {
    let dir = tempfile::tempdir().unwrap();
    serve_once(
        dir.path(),
        &["--database-url", "sqlite:given.db", "--key-secret", "X"],
    );
    for _ in 0..2 {
        // Twice: the first failure did not store a secret either.
        let output = idemkey(
            dir.path(),
            &["keys", "list", "--database-url", "sqlite:given.db"],
        );
        assert!(!output.status.success());
        let message = stderr(&output);
        assert!(message.contains("no key secret"), "{message}");
        assert!(message.contains("--key-secret"), "{message}");
        assert!(message.contains("given.db"), "{message}");
    }
    let output = idemkey(
        dir.path(),
        &[
            "keys",
            "list",
            "--database-url",
            "sqlite:given.db",
            "--key-secret",
            "X",
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));

    // Given as a file (its newline trimmed), the same.
    std::fs::write(dir.path().join("secret"), "X\n").unwrap();
    let output = idemkey(
        dir.path(),
        &[
            "keys",
            "list",
            "--database-url",
            "sqlite:given.db",
            "--key-secret-file",
            "secret",
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
}

#[test]
fn keys_reads_a_secret_kept_in_the_database() {
    let dir = tempfile::tempdir().unwrap();
    serve_once(dir.path(), &["--database-url", "sqlite:kept.db"]);
    let output = idemkey(
        dir.path(),
        &["keys", "list", "--database-url", "sqlite:kept.db"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
}

#[test]
fn serve_on_postgres_refuses_to_start_without_a_secret() {
    // The refusal comes before any connection: no server is needed to see it. The URL names
    // nothing that listens; the error must be about the secret, not the connection.
    let dir = tempfile::tempdir().unwrap();
    let output = idemkey(
        dir.path(),
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            "postgres://u:pw@127.0.0.1:1/none",
        ],
    );
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(
        !message.contains("pw"),
        "the password is not shown: {message}"
    );
    assert!(
        message.contains("postgres://u:***@127.0.0.1:1/none"),
        "{message}"
    );
    for way in [
        "--key-secret",
        "--key-secret-file",
        "--key-secret-in-database",
    ] {
        assert!(message.contains(way), "{way}: {message}");
    }
    // The gateway too.
    let output = idemkey(
        dir.path(),
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
            "--database-url",
            "postgres://u:pw@127.0.0.1:1/none",
        ],
    );
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("--key-secret-in-database"),
        "{}",
        stderr(&output)
    );
}
