use sqlx::migrate::Migrate;
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection, Row};

use crate::PgStore;

/// The named statements prepared on the connection's server connection (protocol-level and
/// SQL-level alike), by name.
async fn prepared(conn: &mut PgConnection) -> Vec<String> {
    sqlx::raw_sql("SELECT name FROM pg_prepared_statements ORDER BY name")
        .fetch_all(conn)
        .await
        .expect("read pg_prepared_statements")
        .iter()
        .map(|row| row.get::<String, _>(0))
        .collect()
}

/// Through PgBouncer in transaction mode with one server connection, on which another
/// client of the pooler left sqlx's first named statement (`sqlx_s_1`, as any sqlx
/// application's first query with `sqlx::query` does): the migrations run, again and
/// again, and leave no named statement of their own there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_meet_and_leave_no_named_statement_on_a_pooled_connection() {
    let pgbouncer = tokio::task::spawn_blocking(|| {
        idemkey_testkit::PgBouncer::start(&idemkey_testkit::postgres_url(), 1)
    })
    .await
    .expect("pgbouncer");
    let direct = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("fresh database");
    let through = pgbouncer.url_for(&direct);
    let mut other = PgConnection::connect(&through).await.expect("connect");
    sqlx::query("SELECT 1")
        .execute(&mut other)
        .await
        .expect("another client's statement");
    let left = prepared(&mut other).await;
    assert_eq!(left, ["sqlx_s_1"], "the other client's statement is kept");

    let pooled = format!("{through}?{}=transaction", PgStore::POOLER_PARAMETER);
    let store = PgStore::connect(&pooled, 2).await.expect("connect");
    for run in 0..2 {
        if let Err(e) = store.migrate().await {
            panic!("run {run}: the migrations fail: {e}");
        }
        assert_eq!(
            prepared(&mut other).await,
            left,
            "run {run}: the migrations left a named statement"
        );
    }
}

#[test]
fn crc32_is_ieee() {
    assert_eq!(super::crc32(b"123456789"), 0xcbf4_3926);
    assert_eq!(super::crc32(b""), 0);
}

/// Whether the advisory lock `id` is free: taken at once by a transaction that ends with
/// the statement.
async fn free(conn: &mut PgConnection, id: i64) -> bool {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT pg_try_advisory_xact_lock({id})"
    )))
    .fetch_one(conn)
    .await
    .expect("try the lock")
    .get(0)
}

/// While sqlx's own runner holds its lock on a database (a session's), the lock of this
/// runner on the same database cannot be had: the two wait for each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_is_the_one_of_sqlx_runner() {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("fresh database");
    let mut sqlx_runner = PgConnection::connect(&url).await.expect("connect");
    let mut other = PgConnection::connect(&url).await.expect("connect");
    let database: String = sqlx::raw_sql("SELECT current_database()")
        .fetch_one(&mut other)
        .await
        .expect("current_database")
        .get(0);
    let id = super::lock_id(&database);
    assert!(free(&mut other, id).await, "nobody holds the lock yet");
    Migrate::lock(&mut sqlx_runner).await.expect("sqlx's lock");
    assert!(
        !free(&mut other, id).await,
        "sqlx's runner holds the same lock"
    );
    Migrate::unlock(&mut sqlx_runner)
        .await
        .expect("sqlx's unlock");
    assert!(free(&mut other, id).await, "free again");
}

/// A database migrated by sqlx's own runner is migrated for this one (the same table, the
/// same checksums), and the other way round: each finds nothing to run, and sqlx reads
/// this runner's rows as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_runner_and_this_one_share_the_table() {
    let mut stores = Vec::new();
    for _ in 0..2 {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        stores.push(PgStore::connect(&url, 2).await.expect("connect"));
    }
    // sqlx's runner first, then this one.
    PgStore::migrator()
        .run(stores[0].pool())
        .await
        .expect("sqlx's runner");
    stores[0].migrate().await.expect("this runner after sqlx's");
    // This one first, then sqlx's.
    stores[1].migrate().await.expect("this runner");
    PgStore::migrator()
        .run(stores[1].pool())
        .await
        .expect("sqlx's runner after this one");

    let mut tables = Vec::new();
    for store in &stores {
        let mut conn = store.pool().acquire().await.expect("connection");
        let applied = conn
            .list_applied_migrations(PgStore::MIGRATIONS_TABLE)
            .await
            .expect("sqlx reads the table");
        let rows: Vec<(i64, String, bool, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT version, description, success, execution_time FROM {} ORDER BY version",
            PgStore::MIGRATIONS_TABLE
        )))
        .fetch_all(&mut *conn)
        .await
        .expect("read the table");
        assert!(rows.iter().all(|r| r.2 && r.3 >= 0), "{rows:?}");
        let rows: Vec<(i64, String)> = rows.into_iter().map(|r| (r.0, r.1)).collect();
        let applied: Vec<(i64, Vec<u8>)> = applied
            .into_iter()
            .map(|m| (m.version, m.checksum.into_owned()))
            .collect();
        tables.push((rows, applied));
    }
    let expected: Vec<(i64, Vec<u8>)> = PgStore::migrator()
        .iter()
        .map(|m| (m.version, m.checksum.to_vec()))
        .collect();
    assert_eq!(tables[0].1, expected, "sqlx's rows");
    assert_eq!(tables[1], tables[0], "this runner's rows are sqlx's");
}
