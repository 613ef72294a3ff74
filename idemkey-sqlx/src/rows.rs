//! The rows of the tables, as the sqlx stores select them, and the binds they share.
//!
//! Every dialect stores the same columns with the same Rust types (text, bytes, 64-bit
//! integers), so one `FromRow` type reads a record from any of them. (MySQL keeps the tenant
//! and the route as bytes, compared byte for byte, and selects them cast to text.)

use idemkey_core::outbox::{Message, MessageState, OutboxAuditEntry};
use idemkey_core::{
    AuditEntry, Fingerprint, FingerprintParts, Members, Record, RecordId, RecordState, StoreError,
    StoredResponse, Timestamp,
};

/// One row of `idemkey_records`, as the stores select it (`SELECT *`), column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct RecordRow {
    pub tenant: String,
    pub key_hash: Vec<u8>,
    pub route: String,
    pub fingerprint: Vec<u8>,
    pub fingerprint_parts: Vec<u8>,
    pub state: String,
    pub token: i64,
    pub lease_expires_at: Option<i64>,
    pub response_status: Option<i32>,
    pub response_headers: Option<Vec<u8>>,
    pub response_body: Option<Vec<u8>>,
    pub created_at: i64,
    pub updated_at: i64,
    pub expires_at: i64,
    pub sealed_key: Option<Vec<u8>>,
    pub fingerprint_members: Option<Vec<u8>>,
    pub first_sent: Option<i64>,
}

impl TryFrom<RecordRow> for Record {
    type Error = StoreError;

    fn try_from(row: RecordRow) -> Result<Self, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("{what} in idemkey_records"));
        let state = RecordState::parse(&row.state).ok_or_else(|| corrupt("unknown state"))?;
        let response = match (row.response_status, row.response_headers, row.response_body) {
            (Some(status), Some(headers), Some(body)) => Some(StoredResponse {
                status: u16::try_from(status).map_err(|_| corrupt("bad status"))?,
                headers: StoredResponse::decode_headers(&headers)
                    .ok_or_else(|| corrupt("bad response headers"))?,
                body,
            }),
            (None, None, None) => None,
            _ => return Err(corrupt("partial response")),
        };
        Ok(Record {
            id: RecordId {
                tenant: row.tenant,
                key_hash: row
                    .key_hash
                    .try_into()
                    .map_err(|_| corrupt("bad key hash"))?,
                route: row.route,
            },
            fingerprint: Fingerprint {
                digest: row
                    .fingerprint
                    .try_into()
                    .map_err(|_| corrupt("bad fingerprint"))?,
                parts: FingerprintParts::from_bytes(&row.fingerprint_parts)
                    .ok_or_else(|| corrupt("bad fingerprint parts"))?,
                // Only ever used to name a member in a 422: a value this version cannot read
                // (another encoding version) names none rather than make the record unusable.
                members: row
                    .fingerprint_members
                    .as_deref()
                    .and_then(Members::from_bytes),
            },
            state,
            token: row.token,
            lease_expires_at: row.lease_expires_at.map(Timestamp),
            response,
            created_at: Timestamp(row.created_at),
            updated_at: Timestamp(row.updated_at),
            expires_at: Timestamp(row.expires_at),
            sealed_key: row.sealed_key,
            first_sent: row.first_sent.map(Timestamp),
        })
    }
}

/// One row of `idemkey_audit`, as the stores select it, column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct AuditRow {
    pub tenant: String,
    pub key_hash: Vec<u8>,
    pub route: String,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub detail: String,
}

impl TryFrom<AuditRow> for AuditEntry {
    type Error = StoreError;

    fn try_from(row: AuditRow) -> Result<Self, StoreError> {
        Ok(AuditEntry {
            id: RecordId {
                tenant: row.tenant,
                key_hash: row
                    .key_hash
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("bad key hash in idemkey_audit".into()))?,
                route: row.route,
            },
            at: Timestamp(row.at),
            actor: row.actor,
            action: row.action,
            detail: row.detail,
        })
    }
}

/// One row of `idemkey_outbox`, as the stores select it, column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct MessageRow {
    pub seq: i64,
    pub id: String,
    pub grp: String,
    pub kind: String,
    pub data: String,
    pub created_at: i64,
    pub state: String,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub claimed_by: Option<String>,
    pub claimed_until: Option<i64>,
    pub last_error: Option<String>,
    pub sent_at: Option<i64>,
}

impl TryFrom<MessageRow> for Message {
    type Error = StoreError;

    fn try_from(row: MessageRow) -> Result<Self, StoreError> {
        Ok(Message {
            seq: row.seq,
            id: row.id,
            group: row.grp,
            kind: row.kind,
            data: row.data,
            created_at: Timestamp(row.created_at),
            state: MessageState::parse(&row.state)
                .ok_or_else(|| StoreError::Corrupt("unknown state in idemkey_outbox".into()))?,
            attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
            next_attempt_at: Timestamp(row.next_attempt_at),
            claimed_by: row.claimed_by,
            claimed_until: row.claimed_until.map(Timestamp),
            last_error: row.last_error,
            sent_at: row.sent_at.map(Timestamp),
        })
    }
}

/// One row of `idemkey_outbox_audit`, as the stores select it, column by column.
#[allow(missing_docs)] // The columns, named as in the table.
#[derive(Debug, sqlx::FromRow)]
pub struct OutboxAuditRow {
    pub message_id: String,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub detail: String,
}

impl From<OutboxAuditRow> for OutboxAuditEntry {
    fn from(row: OutboxAuditRow) -> Self {
        OutboxAuditEntry {
            message_id: row.message_id,
            at: Timestamp(row.at),
            actor: row.actor,
            action: row.action,
            detail: row.detail,
        }
    }
}
