//! The reference payments API: the effect the idempotency layer protects.

use std::time::{Duration, SystemTime};

use axum::Extension;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use idemkey_outbox::{Outgoing, enqueue};
use idemkey_tower::{Tenant, Tx};
use rand::RngCore;
use serde::Deserialize;

use crate::AppState;
use crate::db::{AppDb, Payment, PaymentWrite, sqlite_unavailable, unavailable};
use crate::problem::ApiError;

/// Payments above this many minor units are declined (402, stored like any outcome).
pub(crate) const DECLINE_ABOVE: i64 = 1_000_000;
/// The largest amount accepted, in minor units.
pub(crate) const MAX_AMOUNT: i64 = 1_000_000_000_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewPayment {
    amount: serde_json::Number,
    currency: String,
    customer: String,
    #[serde(default)]
    description: Option<String>,
    /// The client's own reference for the payment, unique per tenant for good.
    #[serde(default)]
    reference: Option<String>,
}

/// Checks a request body; every problem found is listed.
fn validate(body: &[u8]) -> Result<NewPaymentChecked, ApiError> {
    let new: NewPayment = serde_json::from_slice(body)
        .map_err(|e| ApiError::InvalidRequest(vec![format!("body: {e}")]))?;
    let mut errors = Vec::new();
    // `1000`, `1000.0` and `1e3` are one amount: the fingerprint treats them alike too.
    let amount = new.amount.as_i64().or_else(|| {
        new.amount
            .as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= MAX_AMOUNT as f64)
            .map(|f| f as i64)
    });
    let amount = match amount {
        Some(a) if (1..=MAX_AMOUNT).contains(&a) => a,
        _ => {
            errors.push(format!(
                "amount: must be a whole number of minor units from 1 to {MAX_AMOUNT}"
            ));
            0
        }
    };
    if !(new.currency.len() == 3 && new.currency.bytes().all(|b| b.is_ascii_uppercase())) {
        errors.push("currency: must be three upper-case letters (ISO 4217)".to_owned());
    }
    let customer_len = new.customer.chars().count();
    if !(1..=64).contains(&customer_len) {
        errors.push("customer: must be 1 to 64 characters".to_owned());
    }
    if new
        .description
        .as_ref()
        .is_some_and(|d| d.chars().count() > 1000)
    {
        errors.push("description: must be at most 1000 characters".to_owned());
    }
    if new
        .reference
        .as_ref()
        .is_some_and(|r| !(1..=128).contains(&r.chars().count()))
    {
        errors.push("reference: must be 1 to 128 characters".to_owned());
    }
    if !errors.is_empty() {
        return Err(ApiError::InvalidRequest(errors));
    }
    Ok(NewPaymentChecked {
        amount,
        currency: new.currency,
        customer: new.customer,
        description: new.description,
        reference: new.reference,
    })
}

struct NewPaymentChecked {
    amount: i64,
    currency: String,
    customer: String,
    description: Option<String>,
    reference: Option<String>,
}

fn new_id() -> String {
    let mut bytes = [0u8; 12];
    rand::thread_rng().fill_bytes(&mut bytes);
    format!("pay_{}", hex::encode(bytes))
}

/// The time now, RFC 3339 with milliseconds.
pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// `POST /v1/payments`: creates a payment and its ledger entry on the claim's transaction.
pub(crate) async fn create_payment<S: AppDb>(
    State(state): State<AppState<S>>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    mut tx: Tx<S>,
    body: Bytes,
) -> Response {
    let new = match validate(&body) {
        Ok(new) => new,
        Err(e) => return e.into_response(),
    };
    if state.simulate_latency > Duration::ZERO {
        tokio::time::sleep(state.simulate_latency).await;
    }
    if new.amount > DECLINE_ABOVE {
        return ApiError::PaymentDeclined(format!(
            "amount {} exceeds the limit of {DECLINE_ABOVE}",
            new.amount
        ))
        .into_response();
    }
    let payment = Payment {
        id: new_id(),
        tenant,
        amount: new.amount,
        currency: new.currency,
        customer: new.customer,
        description: new.description,
        status: "succeeded".to_owned(),
        created_at: now_rfc3339(),
        reference: new.reference,
    };
    match state.db.insert_payment(&mut tx, &payment).await {
        Ok(PaymentWrite::Created) => {}
        // The business key outlives the idempotency record: whatever the key, however late,
        // a used reference names its payment (an outcome, stored like any other).
        Ok(PaymentWrite::ReferenceUsed { payment_id }) => {
            return ApiError::ReferenceUsed { payment_id }.into_response();
        }
        Err(e) => {
            tracing::error!(error = %e, "writing the payment failed");
            // Rolled back either way; a database that cannot take writes is a 503 that says
            // why, like the layer's own, not a 500.
            return match unavailable_reason::<S>(&e) {
                Some(reason) => {
                    ApiError::Unavailable(format!("{reason}; the payment was not made"))
                }
                None => ApiError::Internal,
            }
            .into_response();
        }
    }
    if state.emit_messages {
        // `data` is the payment exactly as `GET /v1/payments/{id}` answers it.
        let message = Outgoing::new("payment.succeeded", &payment);
        let enqueued = match message {
            Ok(message) => enqueue(&mut tx, message).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = enqueued {
            tracing::error!(error = %e, "writing the payment's outbox message failed");
            return ApiError::Internal.into_response();
        }
    }
    let mut response = (StatusCode::CREATED, Json(&payment)).into_response();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/payments/{}", payment.id)) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

/// Why the database cannot take a write now, when `error` says it is that (full, read-only,
/// locked, unreachable) rather than a refused statement. Classified by kind and code, from
/// sqlx (the store's own, [`unavailable`]) or rusqlite (`RusqliteStore`'s connections).
fn unavailable_reason<S: AppDb>(error: &anyhow::Error) -> Option<&'static str> {
    if let Some(e) = error.downcast_ref::<idemkey_sqlite::rusqlite::Error>() {
        return match e {
            idemkey_sqlite::rusqlite::Error::SqliteFailure(failure, _) => {
                sqlite_unavailable(failure.extended_code).map(|u| u.reason)
            }
            _ => None,
        };
    }
    unavailable::<S>(error.downcast_ref::<sqlx::Error>()?).map(|u| u.reason)
}

/// `GET /v1/payments/{id}`.
pub(crate) async fn get_payment<S: AppDb>(
    State(state): State<AppState<S>>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    match state.db.payment(&tenant, &id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => ApiError::NotFound.into_response(),
        Err(e) => {
            tracing::error!(error = %e, "reading a payment failed");
            ApiError::Internal.into_response()
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListParams {
    limit: Option<String>,
}

/// `GET /v1/payments?limit=N`: the newest payments and the tenant's total.
pub(crate) async fn list_payments<S: AppDb>(
    State(state): State<AppState<S>>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Query(params): Query<ListParams>,
) -> Response {
    let limit = match params.limit.as_deref().map(str::parse::<i64>) {
        None => 10,
        Some(Ok(n)) if (1..=100).contains(&n) => n,
        Some(_) => {
            return ApiError::InvalidRequest(vec!["limit: must be a number from 1 to 100".into()])
                .into_response();
        }
    };
    match state.db.payments(&tenant, limit).await {
        Ok((data, total)) => {
            Json(serde_json::json!({ "data": data, "total": total })).into_response()
        }
        Err(e) => {
            tracing::error!(error = %e, "listing payments failed");
            ApiError::Internal.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_a_valid_payment_and_integral_number_spellings() {
        for amount in ["1000", "1000.0", "1e3"] {
            let body = format!(r#"{{"amount":{amount},"currency":"EUR","customer":"c1"}}"#);
            assert_eq!(validate(body.as_bytes()).ok().map(|p| p.amount), Some(1000));
        }
    }

    #[test]
    fn lists_every_problem() {
        let body = br#"{"amount":0.5,"currency":"eur","customer":""}"#;
        match validate(body) {
            Err(ApiError::InvalidRequest(errors)) => assert_eq!(errors.len(), 3, "{errors:?}"),
            other => panic!("{:?}", other.ok().map(|p| p.amount)),
        }
    }

    #[test]
    fn rejects_unknown_fields_and_bad_json() {
        assert!(validate(br#"{"amount":1,"currency":"EUR","customer":"c","x":1}"#).is_err());
        assert!(validate(b"{").is_err());
        assert!(validate(br#"{"amount":1000000000001,"currency":"EUR","customer":"c"}"#).is_err());
    }
}
