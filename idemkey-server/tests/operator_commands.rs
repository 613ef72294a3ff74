//! Operator commands (`idemkey keys …`) open an existing database and an existing key secret
//! and create neither: pointed at the wrong database, they fail and leave nothing behind.
//! They need only idemkey's tables; the gateway makes those and none of the payments API's.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idemkey_core::{IdempotencyKey, KeyHasher, Scope, Timestamp};

/// A key secret of 32 bytes, as the server asks for.
const SECRET: &str = "0123456789abcdef0123456789abcdef";

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
    let mut all = vec!["serve", "--listen", "127.0.0.1:0", "--api-key", "t1=tok1"];
    all.extend_from_slice(args);
    run_until_listening(dir, &all, "idemkey listening on ");
}

/// Starts `idemkey` with `args` in `dir`, waits until it prints a line starting with
/// `listening`, then kills it.
fn run_until_listening(dir: &Path, args: &[&str], listening: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
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
        .expect("start idemkey");
    let stdout = child.stdout.take().expect("piped stdout");
    let listened = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line.starts_with(listening));
    child.kill().expect("stop idemkey");
    child.wait().expect("reap idemkey");
    assert!(listened, "idemkey {args:?} did not start");
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
        args.extend(["--database-url", "sqlite:other.db", "--key-secret", SECRET]);
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
        &["--database-url", "sqlite:given.db", "--key-secret", SECRET],
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
            SECRET,
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));

    // Given as a file (its newline trimmed), the same.
    std::fs::write(dir.path().join("secret"), format!("{SECRET}\n")).unwrap();
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

#[test]
fn help_shows_no_secret_values_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = [
        ("IDEMKEY_DATABASE_URL", "postgres://u:env-s3cret-db@h/db"),
        ("IDEMKEY_KEY_SECRET", "env-s3cret-key"),
        ("IDEMKEY_PREVIOUS_KEY_SECRET", "env-s3cret-previous"),
        ("IDEMKEY_API_KEYS", "t=env-s3cret-token"),
        ("IDEMKEY_OUTBOX_WEBHOOK", "https://h/env-s3cret-hook"),
        ("IDEMKEY_OUTBOX_NATS", "nats://u:env-s3cret-nats@h"),
        ("IDEMKEY_TOKEN", "env-s3cret-bench"),
    ];
    for command in [
        &["serve", "--help"][..],
        &["gateway", "--help"],
        &["keys", "list", "--help"],
        &["relay", "--help"],
        &["bench", "--help"],
        &["migrate", "--help"],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(command)
            .current_dir(dir.path())
            .envs(secrets)
            .output()
            .expect("run idemkey");
        assert!(output.status.success(), "{command:?}");
        let help = String::from_utf8_lossy(&output.stdout);
        assert!(help.contains("[env: IDEMKEY_"), "{command:?}: {help}");
        assert!(!help.contains("s3cret"), "{command:?}: {help}");
    }
}

#[test]
fn a_key_secret_shorter_than_32_bytes_is_refused_with_how_to_make_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("short"), format!("{}\n", &SECRET[..31])).unwrap();
    let short = &SECRET[..31];
    for args in [
        &["serve", "--key-secret", short][..],
        &["serve", "--key-secret-file", "short"],
        &[
            "gateway",
            "--upstream",
            "http://127.0.0.1:9",
            "--key-secret",
            short,
        ],
        &["keys", "list", "--key-secret", short],
    ] {
        let output = idemkey(dir.path(), args);
        assert!(!output.status.success(), "{args:?}");
        let message = stderr(&output);
        assert!(message.contains("31 bytes"), "{message}");
        assert!(message.contains("at least 32"), "{message}");
        assert!(message.contains("openssl rand -hex 32"), "{message}");
        assert!(
            !message.contains(short),
            "the secret is not repeated: {message}"
        );
    }
    // Refused before anything is created.
    assert_eq!(files(dir.path()), vec!["short".to_owned()]);

    // 32 bytes start; a shorter previous secret is accepted, so that a rotation away from
    // a short secret works.
    serve_once(
        dir.path(),
        &[
            "--database-url",
            "sqlite:long.db",
            "--key-secret",
            SECRET,
            "--previous-key-secret",
            "old",
        ],
    );
}

#[test]
fn one_token_for_two_tenants_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &[
            "serve",
            "--api-key",
            "a=tok-shared",
            "--api-key",
            "b=tok-shared",
        ][..],
        &[
            "gateway",
            "--upstream",
            "http://127.0.0.1:9",
            "--api-key",
            "a=tok-shared",
        ],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(args)
            .args(["--key-secret", SECRET])
            .current_dir(dir.path())
            .env_remove("IDEMKEY_DATABASE_URL")
            .env("IDEMKEY_API_KEYS", "b=tok-shared")
            .output()
            .expect("run idemkey");
        assert!(!output.status.success(), "{args:?}");
        let message = stderr(&output);
        assert!(message.contains("same API token"), "{message}");
        assert!(
            message.contains("\"a\"") && message.contains("\"b\""),
            "{message}"
        );
        assert!(!message.contains("tok-shared"), "{message}");
    }
    assert_eq!(files(dir.path()), Vec::<String>::new());
}

#[test]
fn durations_and_sizes_that_cannot_hold_are_refused_when_parsed() {
    let dir = tempfile::tempdir().unwrap();
    for (args, says) in [
        (
            &["serve", "--retention", "9000years"][..],
            "a retention is from 1s to 10years",
        ),
        (&["serve", "--retention", "0s"], "a retention is from 1s"),
        (&["serve", "--retention", "500ms"], "a retention is from 1s"),
        (
            &["serve", "--wait-timeout", "300000000000years"],
            "a time-out is from 1ms to 1day",
        ),
        (
            &["serve", "--wait-timeout", "99999999999999999999999years"],
            "invalid duration",
        ),
        (
            &["serve", "--purge-interval", "0s"],
            "an interval is from 10ms",
        ),
        (
            &["serve", "--outbox-keep-sent", "0s"],
            "a retention is from 1s",
        ),
        (
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--lease",
                "100ms",
            ],
            "a lease is from 300ms",
        ),
        (
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--upstream-timeout",
                "0s",
            ],
            "a time-out",
        ),
        (
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--max-request-body",
                "0",
            ],
            "from 1 byte to 1GiB",
        ),
        (
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--max-stored-response",
                "2000MiB",
            ],
            "from 1 byte to 1GiB",
        ),
        (
            &["keys", "list", "--older-than", "11years"],
            "an age is from 0s to 10years",
        ),
    ] {
        // Were the value accepted, the command would stop at the missing directory (exit
        // status 1) rather than serve.
        let mut args = args.to_vec();
        args.extend(["--database-url", "sqlite:missing/x.db"]);
        let output = idemkey(dir.path(), &args);
        let message = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {message}");
        assert!(message.contains(says), "{args:?}: {message}");
        assert!(!message.contains("panicked"), "{args:?}: {message}");
    }
    assert_eq!(files(dir.path()), Vec::<String>::new());
}

#[test]
fn database_url_credentials_are_not_printed() {
    let dir = tempfile::tempdir().unwrap();
    // Port 1 refuses the connection; the message names the URL without its password.
    for url in [
        "postgres://app@127.0.0.1:1/db?sslmode=disable&password=qs3cret",
        "postgres://app:us3cret@127.0.0.1:1/db",
        "mysql://app:us3cret@127.0.0.1:1/db",
    ] {
        let output = idemkey(
            dir.path(),
            &[
                "keys",
                "list",
                "--database-url",
                url,
                "--key-secret",
                SECRET,
            ],
        );
        assert!(!output.status.success(), "{url}");
        let message = stderr(&output);
        assert!(message.contains("127.0.0.1:1/db"), "{message}");
        assert!(!message.contains("s3cret"), "{message}");
    }
}

#[cfg(unix)]
#[test]
fn sqlite_files_are_created_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;

    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    // The database keeps the key secret it generated: nobody else may read it.
    serve_once(dir.path(), &["--database-url", "sqlite:made.db"]);
    for name in ["made.db", "made.db-wal", "made.db-shm"] {
        assert_eq!(mode(&dir.path().join(name)), 0o600, "{name}");
    }

    // An existing file keeps the mode its operator chose, with a warning.
    let open = dir.path().join("open.db");
    std::fs::write(&open, b"").unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let output = idemkey(dir.path(), &["migrate", "--database-url", "sqlite:open.db"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("open to other users (mode 644)"),
        "{}",
        stderr(&output)
    );
    assert_eq!(mode(&open), 0o644);
}

/// The tables of the SQLite file at `path`, sorted.
async fn sqlite_tables(path: &Path) -> Vec<String> {
    let url = format!("sqlite:{}", path.display());
    let store = idemkey_sqlite::SqliteStore::connect(&url).await.unwrap();
    let tables = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
         ORDER BY name",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    store.pool().close().await;
    tables
}

/// Stores a completed record of `key` for tenant `t1` claimed at `now`, as an application's
/// own layer would (its retention is a day).
async fn complete_one<S: idemkey_core::Store>(store: &S, key: &str, now: Timestamp) {
    use idemkey_core::protocol::{self, ClaimOutcome};
    let hasher = KeyHasher::new(SECRET.as_bytes());
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    let id = hasher.record_id(&Scope::new("t1", "POST", "/v1/orders"), &key);
    let claim = idemkey_testkit::conformance::claim_at(&id, 1, now);
    let (tx, outcome) = protocol::begin_claim(store, &claim, None).await.unwrap();
    let mut tx = tx.expect("the claim got its lock");
    let ClaimOutcome::Owned { token, .. } = outcome else {
        panic!("a fresh key is owned: {outcome:?}");
    };
    let response = idemkey_testkit::conformance::response(r#"{"id":"order-1"}"#);
    protocol::complete(store, &mut tx, &id, token, &response, now)
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
}

#[tokio::test]
async fn keys_commands_work_on_a_database_with_only_idemkeys_tables() {
    // An application's own database: its own table, and idemkey's migrations, nothing of
    // the reference server's (no payments, no settings).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("own.db");
    let store = idemkey_sqlite::SqliteStore::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .unwrap();
    complete_one(&store, "k-fresh", Timestamp::now()).await;
    let two_days_ago = Timestamp::now().minus(Duration::from_secs(2 * 24 * 3600));
    complete_one(&store, "k-expired", two_days_ago).await;
    store.pool().close().await;
    let before = sqlite_tables(&path).await;
    assert!(!before.iter().any(|t| t == "server_settings"), "{before:?}");

    let db = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--database-url", "sqlite:own.db", "--key-secret", SECRET]);
        idemkey(dir.path(), &all)
    };
    let listed = db(&["keys", "list", "--json"]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines.iter().all(|r| r["route"] == "POST /v1/orders"));

    let shown = db(&["keys", "show", "--tenant", "t1", "k-fresh"]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let view: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(view["state"], "completed");
    assert_eq!(view["response_status"], 201);
    assert_eq!(view["expired"], false);

    let purged = db(&["keys", "purge"]);
    assert!(purged.status.success(), "{}", stderr(&purged));
    let out = String::from_utf8_lossy(&purged.stdout);
    assert!(out.contains("purged 1 expired record"), "{out}");
    let listed = db(&["keys", "list", "--json"]);
    assert_eq!(String::from_utf8_lossy(&listed.stdout).lines().count(), 1);

    assert_eq!(sqlite_tables(&path).await, before, "no table was added");
}

#[tokio::test]
async fn the_gateway_creates_idemkeys_tables_and_none_of_the_payments_api() {
    let dir = tempfile::tempdir().unwrap();
    run_until_listening(
        dir.path(),
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--single-tenant",
            "all",
            "--database-url",
            "sqlite:gw.db",
        ],
        "idemkey gateway listening on ",
    );

    let tables = sqlite_tables(&dir.path().join("gw.db")).await;
    for table in ["idemkey_records", "idemkey_audit", "server_settings"] {
        assert!(tables.iter().any(|t| t == table), "{table}: {tables:?}");
    }
    for table in ["payments", "ledger_entries", "_sqlx_migrations"] {
        assert!(!tables.iter().any(|t| t == table), "{table}: {tables:?}");
    }

    // The operator commands read the secret the gateway keeps there.
    let listed = idemkey(
        dir.path(),
        &["keys", "list", "--database-url", "sqlite:gw.db"],
    );
    assert!(listed.status.success(), "{}", stderr(&listed));
    assert!(String::from_utf8_lossy(&listed.stdout).contains("(0 records)"));
}

#[tokio::test]
async fn keys_commands_work_on_a_postgres_database_with_only_idemkeys_tables() {
    let url = idemkey_testkit::fresh_database_url();
    let store = idemkey_postgres::PgStore::connect(&url, 2).await.unwrap();
    store.migrate().await.unwrap();
    complete_one(&store, "k-fresh", Timestamp::now()).await;
    let dir = tempfile::tempdir().unwrap();
    let db = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--database-url", &url, "--key-secret", SECRET]);
        idemkey(dir.path(), &all)
    };
    let listed = db(&["keys", "list", "--json"]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    assert_eq!(String::from_utf8_lossy(&listed.stdout).lines().count(), 1);
    let shown = db(&["keys", "show", "--tenant", "t1", "k-fresh"]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let view: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(view["state"], "completed");
    let purged = db(&["keys", "purge"]);
    assert!(purged.status.success(), "{}", stderr(&purged));
    assert!(String::from_utf8_lossy(&purged.stdout).contains("purged 0 expired records"));

    let added: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' \
         AND tablename IN ('server_settings', 'payments', 'ledger_entries')",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(added, Vec::<String>::new(), "no table was added");
}
