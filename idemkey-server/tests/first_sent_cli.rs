//! A clock-skew allowance the retention cannot hold is refused when `serve` or `gateway`
//! starts: a first-sent time accepted that far ahead would not count as late until after its
//! record expired, and a retry in between would run again.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// A key secret of 32 bytes, as the server asks for.
const SECRET: &str = "0123456789abcdef0123456789abcdef";

#[test]
fn a_skew_over_a_quarter_of_the_retention_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("skew.db").display());
    for command in [
        &["serve", "--api-key", "t=tok-skew-test"][..],
        &[
            "gateway",
            "--upstream",
            "http://127.0.0.1:9",
            "--single-tenant",
            "t",
        ],
    ] {
        let log = dir.path().join("stderr.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(command)
            .args(["--retention", "8s", "--first-sent-skew", "5m"])
            .args(["--listen", "127.0.0.1:0", "--database-url", &url])
            .args(["--key-secret", SECRET])
            .current_dir(dir.path())
            .env_remove("IDEMKEY_DATABASE_URL")
            .env_remove("IDEMKEY_API_KEYS")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("run idemkey");
        // Its output ends when it exits; a server that started says so first.
        let stdout = child.stdout.take().unwrap();
        let started = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|line| line.contains("listening on"));
        if let Some(line) = started {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} started: {line}");
        }
        let status = child.wait().unwrap();
        let message = std::fs::read_to_string(&log).unwrap();
        assert!(!status.success(), "{command:?}: {message}");
        for says in ["--first-sent-skew 5m", "--retention 8s", "2s"] {
            assert!(
                message.contains(says),
                "{command:?} should say {says:?}: {message}"
            );
        }
    }
}
