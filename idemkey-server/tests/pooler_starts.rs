//! `idemkey serve` instances starting behind PgBouncer in transaction mode while others
//! serve, as rolling deploys, autoscaling and crash recovery start them: every start runs
//! the migrations on a server connection that other clients used before, and uses after.
//!
//! The pooler here has one server connection, so whatever a client leaves on it, the next
//! client meets: a named statement left there by one instance (its health check's) or met
//! there by another (its migrations') shows on every start, not on some.

mod common;

use common::{Answer, Api, Backend, Server, TOKEN1, payment};
use idemkey_postgres::PgStore;
use idemkey_server::GatewayDb;
use idemkey_testkit::PgBouncer;
use sqlx::{Connection, Row};
use tokio::sync::watch;

/// A PgBouncer of the test's own with one server connection.
async fn pooler_of_one() -> PgBouncer {
    tokio::task::spawn_blocking(|| PgBouncer::start(&idemkey_testkit::postgres_url(), 1))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// The named statements prepared on the pooler's one server connection, read through the
/// pooler at `url` (a simple query, which prepares none).
async fn prepared_on_the_server_connection(url: &str) -> Vec<String> {
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .expect("connect through the pooler");
    let names = sqlx::raw_sql("SELECT name FROM pg_prepared_statements ORDER BY name")
        .fetch_all(&mut conn)
        .await
        .expect("read pg_prepared_statements")
        .iter()
        .map(|row| row.get::<String, _>(0))
        .collect();
    let _ = conn.close().await;
    names
}

/// The health check's `SELECT 1` through the pooler leaves no named statement on the
/// server connection it ran on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_check_leaves_no_named_statement() {
    let pgbouncer = pooler_of_one().await;
    let backend = Backend::postgres_through(&pgbouncer).await;
    let store = PgStore::connect(backend.url(), 2).await.expect("connect");
    let through = pgbouncer.url_for(backend.direct_url());
    for _ in 0..2 {
        store.ping().await.expect("ping");
        assert_eq!(
            prepared_on_the_server_connection(&through).await,
            Vec::<String>::new(),
            "the ping left a named statement"
        );
    }
}

/// A payment sent by [`Load`]: its key, its body and its answer.
type Paid = (String, String, Answer);

/// Keyed payments sent to running servers, one after another in turn, each with a key of
/// its own, with a health check of each server between them, until told to stop (at most
/// [`Load::MAX`]).
struct Load {
    stop: watch::Sender<bool>,
    answered: watch::Receiver<usize>,
    task: tokio::task::JoinHandle<Vec<Paid>>,
}

impl Load {
    const MAX: usize = 200;

    fn start(servers: &[&Server], round: usize) -> Self {
        let apis: Vec<Api> = servers.iter().map(|s| s.api()).collect();
        let (stop, stopped) = watch::channel(false);
        let (count, answered) = watch::channel(0);
        let task = tokio::spawn(async move {
            let mut answers = Vec::new();
            for n in 0..Self::MAX {
                if *stopped.borrow() {
                    break;
                }
                let api = &apis[n % apis.len()];
                let key = format!("start-{round}-{n}");
                let body = payment(100 + n as i64, &key);
                let answer = api.pay_ok(TOKEN1, &key, &body).await;
                let health = api.get("/healthz", None).await;
                assert_eq!(health.status, 200, "{key}: {}", health.text());
                answers.push((key, body, answer));
                count.send_replace(answers.len());
            }
            answers
        });
        Self {
            stop,
            answered,
            task,
        }
    }

    /// Returns once a request of this load was answered.
    async fn running(&mut self) {
        self.answered
            .wait_for(|n| *n > 0)
            .await
            .expect("the load stopped before its first answer");
    }

    /// Stops the load; every payment it sent was created.
    async fn stop(self) -> Vec<Paid> {
        let _ = self.stop.send(true);
        let answers = self.task.await.expect("the load");
        for (key, _, answer) in &answers {
            assert_eq!(answer.status, 201, "{key}: {}", answer.text());
            assert!(!answer.replayed(), "{key}: a new key");
        }
        answers
    }
}

/// A server just started serves keyed requests: a new key is executed, its retry replays
/// it, and a key another server executed replays that server's payment.
async fn assert_serves(server: &Server, fresh: &str, earlier: &Paid) {
    let api = server.api();
    let body = payment(9_999, fresh);
    let first = api.pay_ok(TOKEN1, fresh, &body).await;
    assert_eq!(first.status, 201, "{fresh}: {}", first.text());
    assert!(!first.replayed(), "{fresh}: executed");
    let again = api.pay_ok(TOKEN1, fresh, &body).await;
    assert_eq!(again.status, 201, "{fresh}: {}", again.text());
    assert!(again.replayed(), "{fresh}: its retry replays");
    assert_eq!(again.body, first.body, "{fresh}: the same payment");
    let (key, body, before) = earlier;
    let replay = api.pay_ok(TOKEN1, key, body).await;
    assert!(replay.replayed(), "{key}: replays on the new server");
    assert_eq!(replay.body, before.body, "{key}: the same payment");
}

/// Servers started one after another while the others serve and are sent requests, and
/// one started after another was killed with `SIGKILL`: each start succeeds (its
/// migrations run on the one server connection every other client uses) and serves keyed
/// requests correctly; every payment is made once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_start_while_others_serve_and_after_a_kill() {
    const STARTS: usize = 4;
    let pgbouncer = pooler_of_one().await;
    let backend = Backend::postgres_through(&pgbouncer).await;
    let mut running = vec![backend.start(&[]).await];
    let mut paid = 0;
    for round in 0..STARTS {
        // The third start replaces a server killed with SIGKILL while the others serve.
        if round == 2 {
            running.remove(0).kill9();
        }
        let mut load = Load::start(&running.iter().collect::<Vec<_>>(), round);
        load.running().await;
        let server = backend.start(&[]).await;
        let answers = load.stop().await;
        paid += answers.len();
        assert_serves(&server, &format!("fresh-{round}"), &answers[0]).await;
        paid += 1;
        running.push(server);
    }
    backend.snapshot().await.assert_consistent(paid);
}
