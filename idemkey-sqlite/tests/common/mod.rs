//! What the SQLite store's own test files share: a claim of a key, and the effect a handler
//! writes (into an `effects (label)` table each file creates).

use idemkey_core::Timestamp;
use idemkey_core::protocol::Claim;
use idemkey_testkit::conformance::{claim_at, record_id};
use sqlx::sqlite::SqliteConnection;

/// A claim of `key` on `POST /v1/payments` of tenant `t1`, now.
pub(crate) fn claim(key: &str) -> Claim {
    claim_at(&record_id("t1", "/v1/payments", key), 1, Timestamp::now())
}

/// Writes one effect labelled `label`.
pub(crate) async fn write_effect(conn: &mut SqliteConnection, label: &str) {
    sqlx::query("INSERT INTO effects (label) VALUES (?1)")
        .bind(label)
        .execute(conn)
        .await
        .expect("effect");
}
