//! A client of `idemkey gateway` that hangs up while its key is being reserved, over real
//! HTTP with the default 10 s lease: the gateway closes the connection at the client's end
//! of stream (and drops the request's future), yet the reservation's write goes through;
//! its owner goes on to the upstream and stores the answer, and the retry replays it at
//! once instead of waiting for the lease.
//!
//! The reservation is held at the database: the test locks the records table on
//! PostgreSQL, sees the gateway's insert wait for that lock (`pg_stat_activity`), closes
//! its side of the connection, sees the gateway close the other, then lets the insert go.

mod common;

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::gateway::{Gateway, Upstream};

const KEY: &str = "hang-up-while-reserving";

/// Waits until a statement inserting into the records table waits for a lock.
async fn until_the_reservation_waits(conn: &mut PgConnection) {
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query ILIKE '%INSERT INTO idemkey_records%'",
        )
        .fetch_one(&mut *conn)
        .await
        .expect("read pg_stat_activity");
        if waiting > 0 {
            return;
        }
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_its_key_is_reserved_gets_a_replay_on_retry() {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let dir = tempfile::tempdir().expect("a temporary directory");
    let upstream = Upstream::start();
    let gateway =
        Gateway::start(&url, &upstream.base, dir.path(), &["--route", "POST /v1/*"]).await;

    let mut lock = PgConnection::connect(&url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("LOCK TABLE idemkey_records IN EXCLUSIVE MODE")
        .execute(&mut lock)
        .await
        .unwrap();

    let addr = gateway.base.trim_start_matches("http://");
    let body = r#"{"amount":500}"#;
    let mut client = TcpStream::connect(addr)
        .await
        .expect("connect to the gateway");
    let request = format!(
        "POST /v1/transfers HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer tok1\r\n\
         Idempotency-Key: {KEY}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let mut watcher = PgConnection::connect(&url).await.expect("connect");
    tokio::time::timeout(
        Duration::from_secs(30),
        until_the_reservation_waits(&mut watcher),
    )
    .await
    .expect("the gateway's reservation never waited for the lock");
    // The client hangs up; the gateway closes its side without an answer.
    client.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut answer))
        .await
        .expect("the gateway kept the connection open")
        .ok();
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();

    let started = Instant::now();
    let retry = reqwest::Client::new()
        .post(format!("{}/v1/transfers", gateway.base))
        .bearer_auth("tok1")
        .header("idempotency-key", KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the retry is answered");
    let took = started.elapsed();
    let status = retry.status();
    let replayed = retry.headers().contains_key("idempotent-replayed");
    let text = retry.text().await.unwrap_or_default();
    assert_eq!(
        (status.as_u16(), replayed),
        (201, true),
        "after {took:?}: {text}\n{}",
        gateway.log_text()
    );
    assert!(
        took < Duration::from_secs(5),
        "the retry took {took:?}, as if it waited for the lease"
    );
    assert_eq!(upstream.effects(KEY), 1);
    assert_eq!(upstream.received(KEY), 1);
}
