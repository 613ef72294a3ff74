//! The client against the real `idemkey serve`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use idemkey_client::problem::types;
use idemkey_client::{Error, IdempotentClient, Operation};

/// A running `idemkey serve`, killed on drop.
struct Server {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server() -> Server {
    let binary = env!("CARGO_BIN_EXE_idemkey");
    let dir = tempfile::tempdir().unwrap();
    let database_url = format!("sqlite:{}", dir.path().join("c.db").display());
    let mut child = Command::new(binary)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            &database_url,
            "--api-key",
            "t=tok",
        ])
        .env_remove("IDEMKEY_API_KEYS")
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_KEY_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("idemkey starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Keep reading so the server never blocks on a full pipe.
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(url) = line.strip_prefix("idemkey listening on ") {
                let _ = tx.send(url.trim().to_owned());
            }
        }
    });
    let mut server = Server {
        child,
        url: String::new(),
        _dir: dir,
    };
    server.url = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("idemkey prints the address it listens on");
    server
}

#[tokio::test]
async fn one_operation_against_idemkey_serve() {
    let server = start_server();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let client = IdempotentClient::new(http.clone());
    let payments = format!("{}/v1/payments", server.url);
    let op = Operation::new();
    let pay = |body: &'static str| {
        http.post(&payments)
            .bearer_auth("tok")
            .header("content-type", "application/json")
            .body(body)
    };

    let first = client
        .send(
            &op,
            pay(r#"{"amount": 500, "currency": "EUR", "customer": "c1"}"#),
        )
        .await
        .unwrap();
    assert_eq!(first.status(), 201, "{:?}", first.text());
    assert!(!first.is_replayed());
    assert_eq!(first.attempts(), 1);
    assert!(
        first.expires_at().is_some(),
        "the server advertises the expiry"
    );

    // The same operation again (members reordered, the same amount spelt differently).
    let second = client
        .send(
            &op,
            pay(r#"{"customer": "c1", "currency": "EUR", "amount": 500.0}"#),
        )
        .await
        .unwrap();
    assert_eq!(second.status(), 201);
    assert!(second.is_replayed());
    assert_eq!(second.body(), first.body(), "replayed byte for byte");
    assert_eq!(second.headers()["location"], first.headers()["location"]);

    let list: serde_json::Value = http
        .get(format!("{payments}?limit=1"))
        .bearer_auth("tok")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["total"], 1, "{list}");

    let error = client
        .send(
            &op,
            pay(r#"{"amount": 700, "currency": "EUR", "customer": "c1"}"#),
        )
        .await
        .unwrap_err();
    let Error::Problem { problem, attempts } = &error else {
        panic!("expected key-reused, got {error:?}");
    };
    assert_eq!(*attempts, 1);
    assert!(problem.is(types::KEY_REUSED), "{problem}");
    assert_eq!(problem.http_status, 422);
    assert_eq!(problem.extensions["differs"], serde_json::json!(["body"]));
}
