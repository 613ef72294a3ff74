//! The `idemkey` binary on MySQL and MariaDB: `migrate`, `serve`, `keys` and `gateway` on a
//! `mysql://` URL, each test on a fresh database of a throwaway MariaDB server (one per test
//! binary), over real HTTP on loopback. Every process of a test shares that database and is
//! given the key secret, as on PostgreSQL.

mod common;

use common::gateway::{Gateway, Upstream};
use common::{Backend, TOKEN1, e2e_scenarios, idemkey_cli, payment};
use futures::future::join_all;

// The scenarios the other stores run (races, `kill -9` and a graceful shutdown with requests
// in flight, the contract, `keys list`, `keys show` and `keys evict`), on a fresh database
// each.
e2e_scenarios!(common::Backend::mysql());

/// Three processes on one database race for the same keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_across_three_processes() {
    common::race_across_three_processes(Backend::mysql().await).await;
}

/// `idemkey migrate` (given the `mariadb://` spelling) makes the tables; `serve` then takes a
/// keyed payment once and answers its retry with the stored answer, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_takes_a_payment_once_and_replays_its_retry() {
    let backend = Backend::mysql().await;
    // sqlx reads `mariadb://` as `mysql://`, and so does idemkey.
    let mariadb = backend.url().replacen("mysql://", "mariadb://", 1);
    let out = idemkey_cli(vec!["migrate".into(), "--database-url".into(), mariadb]).await;
    assert!(out.contains("migrations are up to date"), "{out}");

    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "once");
    let first = api.pay_ok(TOKEN1, "k-once", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    let retry = api.pay_ok(TOKEN1, "k-once", &body).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.replayed(), "the retry is a replay");
    assert_eq!(retry.body, first.body, "byte for byte");
    assert_eq!(retry.header("location"), first.header("location"));

    let id = first.json()["id"]
        .as_str()
        .expect("a payment id")
        .to_owned();
    let shown = api.get(&format!("/v1/payments/{id}"), Some(TOKEN1)).await;
    assert_eq!(shown.status, 200, "{}", shown.text());
    assert_eq!(shown.json(), first.json());
    assert_eq!(api.total(TOKEN1).await, 1, "payments");
    backend.snapshot().await.assert_consistent(1);
}

/// Sixteen identical requests on one key at once: one payment, and every answer is its 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_race_of_sixteen_on_one_key_makes_one_payment() {
    let backend = Backend::mysql().await;
    let server = backend.start(&["--simulate-latency", "50"]).await;
    let api = server.api();
    let body = payment(700, "race");
    let answers = join_all((0..16).map(|_| api.pay_ok(TOKEN1, "k-race", &body))).await;
    let executed: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(executed.len(), 1, "one execution");
    for answer in &answers {
        assert_eq!(answer.status, 201, "{}", answer.text());
        assert_eq!(
            answer.body, executed[0].body,
            "every answer is the one payment"
        );
    }
    assert_eq!(api.total(TOKEN1).await, 1, "payments");
    backend.snapshot().await.assert_consistent(1);
}

/// `idemkey gateway` on MySQL in front of an upstream: a keyed request reaches it once, and
/// the retry is the stored answer, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_runs_once_and_replays() {
    let backend = Backend::mysql().await;
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("temporary directory");
    let gateway = Gateway::start(backend.url(), &upstream.base, dir.path(), &[]).await;
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let send = || async {
        let response = client
            .post(format!("{}/v1/transfers", gateway.base))
            .bearer_auth(TOKEN1)
            .header("idempotency-key", "k-gateway")
            .header("content-type", "application/json")
            .body(r#"{"amount":300,"to":"acct-9"}"#)
            .send()
            .await
            .expect("POST through the gateway");
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        (status, replayed, response.bytes().await.expect("body"))
    };
    let (status, replayed, first) = send().await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&first));
    assert!(!replayed);
    let (status, replayed, again) = send().await;
    assert_eq!(status, 201);
    assert!(replayed, "the retry is a replay");
    assert_eq!(again, first, "byte for byte");
    assert_eq!(upstream.effects("k-gateway"), 1, "one upstream execution");
    assert_eq!(
        upstream.received("k-gateway"),
        1,
        "the retry never reached it"
    );
}

/// `serve` on MySQL starts while the database server is down: it listens, answers 503
/// `store-unavailable` with `Retry-After` meanwhile, and once the server is back takes a
/// payment once, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_waits_for_a_database_down_at_start() {
    let mut mariadb = tokio::task::spawn_blocking(|| {
        let mut mariadb = idemkey_testkit::MariaDb::start();
        mariadb.kill9();
        mariadb
    })
    .await
    .expect("a stopped MariaDB");
    let backend = Backend::mysql_at(mariadb.url());
    let server = backend.start(&[]).await;
    let api = server.api();
    let down = api.get("/healthz", None).await;
    down.assert_problem(503, "store-unavailable");
    assert!(down.header("retry-after").is_some(), "{}", down.text());
    let body = payment(900, "after the start");
    let refused = api.pay_ok(TOKEN1, "k-later", &body).await;
    refused.assert_problem(503, "store-unavailable");

    let mariadb = tokio::task::spawn_blocking(move || {
        mariadb.restart();
        mariadb
    })
    .await
    .expect("MariaDB back");
    let first = api.pay_until_created(TOKEN1, "k-later", &body).await;
    assert!(!first.replayed());
    let retry = api.pay_ok(TOKEN1, "k-later", &body).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    backend.snapshot().await.assert_consistent(1);
    drop(mariadb);
}

/// What the store reads as a database that cannot take work now, from MariaDB's own errors:
/// a write in a read-only transaction (1792) is the database being read-only, a session the
/// server killed is a lost connection (waited out at start), and a refused statement (a
/// duplicate key, 1062) is neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_is_read_by_mysql_error_number() {
    use idemkey_mysql::MySqlStore;
    use idemkey_server::{AppDb, Unavailable};

    let backend = Backend::mysql().await;
    let pool = sqlx::MySqlPool::connect(backend.url())
        .await
        .expect("connect");
    sqlx::raw_sql("CREATE TABLE t (id INT PRIMARY KEY) ENGINE = InnoDB")
        .execute(&pool)
        .await
        .expect("create a table");
    let mut conn = pool.acquire().await.expect("a connection");

    sqlx::raw_sql("START TRANSACTION READ ONLY")
        .execute(&mut *conn)
        .await
        .expect("begin read-only");
    let read_only = sqlx::raw_sql("INSERT INTO t VALUES (1)")
        .execute(&mut *conn)
        .await
        .expect_err("a write in a read-only transaction");
    assert_eq!(
        <MySqlStore as AppDb>::unavailable(&read_only),
        Some(Unavailable::answered("the database is read-only")),
        "{read_only}"
    );
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *conn)
        .await
        .expect("roll back");

    sqlx::raw_sql("INSERT INTO t VALUES (1)")
        .execute(&mut *conn)
        .await
        .expect("insert");
    let duplicate = sqlx::raw_sql("INSERT INTO t VALUES (1)")
        .execute(&mut *conn)
        .await
        .expect_err("a duplicate key");
    assert_eq!(
        <MySqlStore as AppDb>::unavailable(&duplicate),
        None,
        "{duplicate}"
    );

    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *conn)
        .await
        .expect("its id");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
        .execute(&pool)
        .await
        .expect("kill the session");
    let killed = sqlx::raw_sql("SELECT 1")
        .execute(&mut *conn)
        .await
        .expect_err("a statement on a killed session");
    assert_eq!(
        <MySqlStore as AppDb>::unavailable(&killed),
        Some(Unavailable::CONNECTION_LOST),
        "{killed}"
    );
    conn.detach();
}

/// `idemkey demo` on a MySQL database: its payments through the lossy proxy exist exactly once
/// (it exits 0 only then), and the database holds one of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_on_mysql() {
    let backend = Backend::mysql().await;
    let out = idemkey_cli(vec![
        "demo".into(),
        "--payments".into(),
        "20".into(),
        "--database-url".into(),
        backend.url().to_owned(),
    ])
    .await;
    assert!(!out.is_empty(), "the demo prints its report");
    backend.snapshot().await.assert_consistent(20);
}

/// A database URL of no kind idemkey knows is refused, naming every kind, MySQL among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_scheme_is_refused_naming_mysql() {
    let output = tokio::task::spawn_blocking(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(["migrate", "--database-url", "oracle://db/app"])
            .env_remove("IDEMKEY_DATABASE_URL")
            .output()
            .expect("run idemkey migrate")
    })
    .await
    .expect("join");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unsupported database URL"), "{stderr}");
    assert!(stderr.contains("mysql://"), "{stderr}");
}
