//! What the idempotency record costs PostgreSQL in the messages `idemkey serve` sends, without
//! its HTTP server: CLIENTS tasks each make one fresh payment at a time for SECONDS, through
//! the same code serve's two routes run on PostgreSQL, and the count is printed.
//!
//! - `baseline`: serve's unkeyed route: `PgStore::begin` (sqlx's `BEGIN`), the handler's
//!   payment and ledger entry (`AppDb::insert_payment`, prepared), `COMMIT`;
//! - `keyed`: serve's keyed route: `PgStore::begin_claim` (`BEGIN` and the claim in one
//!   message), the same payment, `PgStore::complete_and_commit` (the completion and `COMMIT`
//!   in one message), with a record of the sizes `idemkey bench --mode fresh` makes.
//!
//! `scripts/pgbench_record.sh` runs it as its `sqlx_baseline` and `sqlx_keyed` variants,
//! beside pgbench's, and reads the database's CPU around it; on the schema that script makes.
//!
//! ```text
//! cargo run --release -p idemkey-server --example pg_store_record -- URL VARIANT SECONDS CLIENTS
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemkey_core::{Begun, NewRecord, RecordId, RecordState, Store, StoredResponse, Timestamp};
use idemkey_postgres::PgStore;
use idemkey_server::{AppDb, Payment};
use idemkey_testkit::conformance::json_fp;
use rand::RngCore;

/// The body `idemkey bench` posts, fingerprinted as serve does (members included).
const REQUEST: &str =
    r#"{"amount":100,"currency":"EUR","customer":"bench-0","description":"load test"}"#;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, variant, seconds, clients] = args.as_slice() else {
        anyhow::bail!("usage: pg_store_record URL baseline|keyed SECONDS CLIENTS");
    };
    let keyed = match variant.as_str() {
        "baseline" => false,
        "keyed" => true,
        other => anyhow::bail!("unknown variant {other:?}: baseline or keyed"),
    };
    let seconds: u64 = seconds.parse()?;
    let clients: u32 = clients.parse()?;
    // A connection for each client: none waits on the pool.
    let store = PgStore::connect(url, clients).await?;
    let made = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (store, made) = (store.clone(), made.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    pay(&store, keyed).await?;
                    made.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let made = made.load(Ordering::Relaxed);
    let rate = made as f64 / started.elapsed().as_secs_f64();
    println!("{made} requests, {rate:.0} req/s");
    Ok(())
}

/// One fresh payment, as serve's keyed or unkeyed route makes it.
async fn pay(store: &PgStore, keyed: bool) -> anyhow::Result<()> {
    let mut id = [0u8; 12];
    rand::thread_rng().fill_bytes(&mut id);
    let payment = Payment {
        id: format!("pay_{}", hex::encode(id)),
        tenant: "bench".to_owned(),
        amount: 100,
        currency: "EUR".to_owned(),
        customer: "bench-0".to_owned(),
        description: Some("load test".to_owned()),
        status: "succeeded".to_owned(),
        created_at: "2026-12-03T05:56:21.413Z".to_owned(),
        reference: None,
    };
    if !keyed {
        let mut tx = store.begin().await?;
        store.insert_payment(&mut tx, &payment).await?;
        store.commit(tx).await?;
        return Ok(());
    }
    let now = Timestamp::now();
    let mut key_hash = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut key_hash);
    let record = NewRecord {
        id: RecordId {
            tenant: "bench".to_owned(),
            key_hash,
            route: "POST /v1/payments".to_owned(),
        },
        fingerprint: json_fp(REQUEST),
        state: RecordState::Executing,
        token: idemkey_core::fresh_token(),
        lease_expires_at: None,
        now,
        expires_at: now.plus(Duration::from_secs(86_400)),
        sealed_key: None,
        first_sent: None,
    };
    let Begun::Claimed(mut tx, _) = store.begin_claim(&record, None).await? else {
        anyhow::bail!("a fresh key was held");
    };
    store.insert_payment(&mut tx, &payment).await?;
    let body = serde_json::to_vec(&payment)?;
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".to_owned(), b"application/json".to_vec()),
            (
                "location".to_owned(),
                format!("/v1/payments/{}", payment.id).into_bytes(),
            ),
        ],
        body,
    };
    store
        .complete_and_commit(tx, &record.id, record.token, &response, Timestamp::now())
        .await?;
    Ok(())
}
