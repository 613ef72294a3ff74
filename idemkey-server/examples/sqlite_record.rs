//! What the idempotency record costs SQLite, without idemkey's server: one thread runs the
//! statements of one fresh payment four ways, in alternating rounds, on a file with
//! `idemkey serve`'s settings (WAL, `synchronous = NORMAL`, foreign keys on) and schema, and
//! prints transactions per second, each variant's ratio to the baseline of the same round,
//! CPU µs and pages written to the WAL per transaction. The SQLite counterpart of `scripts/pgbench_record.sh`.
//!
//! - `baseline`: `BEGIN IMMEDIATE`, the payment and its ledger entry, `COMMIT` (serve's
//!   unkeyed route);
//! - `claim`: the claim's `INSERT` first, the completing `UPDATE` last (what both SQLite
//!   stores run);
//! - `deferred`: a read of the record first, the completed record's `INSERT` last (a claim
//!   that relies on the write lock `BEGIN IMMEDIATE` holds);
//! - `floor`: only the completed record's `INSERT` (no claim at all: the least any record
//!   written with the effect costs).
//!
//! Statements are prepared once (cached), values have the sizes of a record `idemkey serve`
//! writes for `idemkey bench --mode fresh`, and key hashes are spread as an HMAC spreads
//! them. The WAL is checkpointed every 1000 commits (serve's checkpointer does about as
//! often), which also counts its pages.
//!
//! With `GROUP` above 1, each transaction is a savepoint and `GROUP` of them are committed
//! together (not something idemkey does: what grouping commits would change).
//!
//! ```text
//! cargo run --release -p idemkey-server --example sqlite_record -- [ROUNDS] [TRANSACTIONS] [GROUP]
//! ```

use std::time::Instant;

use idemkey_server::AppDb;
use idemkey_sqlite::RusqliteStore;
use idemkey_sqlite::rusqlite::{self, Connection, params};

const PAYMENT: &str = "INSERT INTO payments
    (id, tenant, amount, currency, customer, description, status, created_at, reference)
    VALUES (?1, 'bench', 100, 'EUR', 'bench-0', 'load test', 'succeeded',
            '2026-12-03T05:56:21.413Z', NULL)
    ON CONFLICT (tenant, reference) WHERE reference IS NOT NULL DO NOTHING";
const LEDGER: &str = "INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
    SELECT ?1, 'bench', 100, 'EUR', '2026-12-03T05:56:21.413Z'
     WHERE EXISTS (SELECT 1 FROM payments WHERE id = ?1 AND reference IS NULL)";
const CLAIM: &str = "INSERT INTO idemkey_records
    (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token, lease_expires_at,
     created_at, updated_at, expires_at, sealed_key, fingerprint_members, first_sent)
    VALUES ('bench', ?1, 'POST /v1/payments', ?2, ?3, 'executing', 1, NULL,
            1700000000000, 1700000000000, 1700086400000, NULL, ?4, NULL)
    ON CONFLICT (tenant, key_hash, route) DO NOTHING RETURNING token";
const COMPLETE: &str = "UPDATE idemkey_records
    SET state = 'completed', token = token + 1, lease_expires_at = NULL,
        response_status = 201, response_headers = ?2, response_body = ?3,
        updated_at = 1700000000001
  WHERE tenant = 'bench' AND key_hash = ?1 AND route = 'POST /v1/payments' AND token = 1";
const READ: &str = "SELECT * FROM idemkey_records WHERE tenant = 'bench' AND key_hash = ?1 AND route = 'POST /v1/payments'";
const COMPLETED: &str = "INSERT INTO idemkey_records
    (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token, lease_expires_at,
     created_at, updated_at, expires_at, sealed_key, fingerprint_members, first_sent,
     response_status, response_headers, response_body)
    VALUES ('bench', ?1, 'POST /v1/payments', ?2, ?3, 'completed', 2, NULL,
            1700000000000, 1700000000001, 1700086400000, NULL, ?4, NULL, 201, ?5, ?6)";
const BODY: &[u8] = br#"{"id":"pay_00fcf0c6aa09412a9620df83","amount":100,"currency":"EUR","customer":"bench-0","description":"load test","status":"succeeded","created_at":"2026-12-03T05:56:21.413Z"}"#;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Baseline,
    Claim,
    Deferred,
    Floor,
}

const VARIANTS: [(Variant, &str); 4] = [
    (Variant::Baseline, "baseline"),
    (Variant::Claim, "claim"),
    (Variant::Deferred, "deferred"),
    (Variant::Floor, "floor"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(Ok(3), |a| a.parse())?;
    let transactions: u64 = args.next().map_or(Ok(20_000), |a| a.parse())?;
    let group: u64 = args.next().map_or(Ok(1), |a| a.parse())?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("record.db");
    // serve's schema, made by serve's own migrations.
    let store = RusqliteStore::open(&path)?;
    tokio::runtime::Runtime::new()?.block_on(store.migrate_all())?;
    drop(store);
    let conn = Connection::open(&path)?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;
         PRAGMA wal_autocheckpoint = 0",
    )?;
    println!(
        "{transactions} transactions a variant, {group} a commit, {rounds} rounds, one connection, one thread"
    );
    let mut next = 0u64;
    for round in 1..=rounds {
        let mut order = VARIANTS.to_vec();
        if round % 2 == 0 {
            order.reverse();
        }
        let mut results = Vec::new();
        for (variant, name) in order {
            let (tps, cpu, pages) = run(&conn, variant, &mut next, transactions, group)?;
            results.push((variant, name, tps, cpu, pages));
        }
        let baseline = results
            .iter()
            .find(|r| r.0 == Variant::Baseline)
            .map_or(1.0, |r| r.2);
        let line: Vec<String> = VARIANTS
            .iter()
            .filter_map(|(v, _)| results.iter().find(|r| r.0 == *v))
            .map(|(_, name, tps, cpu, pages)| {
                format!(
                    "{name} {tps:.0} tps, {:.2}, {cpu:.1} µs, {pages:.1} pages",
                    tps / baseline
                )
            })
            .collect();
        println!("round {round}: {}", line.join(" · "));
    }
    Ok(())
}

/// Runs `n` transactions of `variant`; returns transactions per second, CPU µs and pages
/// written to the WAL per transaction.
fn run(
    conn: &Connection,
    variant: Variant,
    next: &mut u64,
    n: u64,
    group: u64,
) -> rusqlite::Result<(f64, f64, f64)> {
    let parts = [1u8; 24];
    let members = [4u8; 81];
    let headers = [5u8; 89];
    let fingerprint = [7u8; 32];
    // Nothing of the last variant left in the WAL.
    checkpoint(conn)?;
    let mut frames = 0;
    let started = Instant::now();
    let cpu = cpu_seconds();
    for _ in 0..n {
        *next += 1;
        let key = spread(*next);
        // Random, as serve's payment ids are.
        let id = format!("pay_{}", hex::encode(&spread(!*next)[..12]));
        if group == 1 {
            conn.execute_batch("BEGIN IMMEDIATE")?;
        } else {
            // A transaction of a group: a savepoint in the group's transaction.
            if conn.is_autocommit() {
                conn.execute_batch("BEGIN IMMEDIATE")?;
            }
            conn.execute_batch("SAVEPOINT request")?;
        }
        match variant {
            Variant::Claim => {
                let token: Option<i64> = conn
                    .prepare_cached(CLAIM)?
                    .query_row(params![key, fingerprint, parts, members], |r| r.get(0))
                    .map(Some)
                    .or_else(none_if_no_rows)?;
                assert_eq!(token, Some(1), "a fresh key");
            }
            Variant::Deferred => {
                let found = conn
                    .prepare_cached(READ)?
                    .query_row(params![key], |_| Ok(()))
                    .map(Some)
                    .or_else(none_if_no_rows)?;
                assert!(found.is_none(), "a fresh key");
            }
            Variant::Baseline | Variant::Floor => {}
        }
        conn.prepare_cached(PAYMENT)?.execute(params![id])?;
        conn.prepare_cached(LEDGER)?.execute(params![id])?;
        match variant {
            Variant::Claim => {
                let changed = conn
                    .prepare_cached(COMPLETE)?
                    .execute(params![key, headers, BODY])?;
                assert_eq!(changed, 1);
            }
            Variant::Deferred | Variant::Floor => {
                conn.prepare_cached(COMPLETED)?.execute(params![
                    key,
                    fingerprint,
                    parts,
                    members,
                    headers,
                    BODY
                ])?;
            }
            Variant::Baseline => {}
        }
        if group == 1 {
            conn.execute_batch("COMMIT")?;
        } else {
            conn.execute_batch("RELEASE request")?;
            if next.is_multiple_of(group) {
                conn.execute_batch("COMMIT")?;
            }
        }
        if next.is_multiple_of(1000) && conn.is_autocommit() {
            frames += checkpoint(conn)?;
        }
    }
    if !conn.is_autocommit() {
        conn.execute_batch("COMMIT")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu;
    frames += checkpoint(conn)?;
    Ok((
        n as f64 / seconds,
        cpu * 1e6 / n as f64,
        frames as f64 / n as f64,
    ))
}

/// Copies the WAL into the database (`PASSIVE`: nobody else holds it here, so all of it);
/// returns how many frames (pages) it held. The next write starts the WAL over.
fn checkpoint(conn: &Connection) -> rusqlite::Result<i64> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))
}

fn none_if_no_rows<T>(e: rusqlite::Error) -> rusqlite::Result<Option<T>> {
    match e {
        rusqlite::Error::QueryReturnedNoRows => Ok(None),
        e => Err(e),
    }
}

/// 32 bytes from `n`, spread over the key space as an HMAC's are (splitmix64).
fn spread(n: u64) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut x = n;
    for chunk in out.chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out
}

/// This process's CPU time so far (user + system), from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime are 14 and 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<f64>().ok()))
        .sum();
    // In USER_HZ, which Linux fixes at 100 for `/proc` (`getconf CLK_TCK`).
    ticks / 100.0
}
