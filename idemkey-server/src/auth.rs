//! Bearer tokens → tenants.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::header;
use idemkey_tower::Tenant;

use crate::problem::ApiError;

/// The configured API keys: token → tenant.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys(Arc<HashMap<String, String>>);

impl ApiKeys {
    /// Keys from `(tenant, token)` pairs.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Self {
        Self(Arc::new(
            pairs
                .into_iter()
                .map(|(tenant, token)| (token, tenant))
                .collect(),
        ))
    }

    /// Parses `TENANT=TOKEN`.
    pub fn parse_pair(s: &str) -> Result<(String, String), String> {
        match s.split_once('=') {
            Some((tenant, token)) if !tenant.trim().is_empty() && !token.trim().is_empty() => {
                Ok((tenant.trim().to_owned(), token.trim().to_owned()))
            }
            _ => Err(format!("expected TENANT=TOKEN, got {s:?}")),
        }
    }

    /// Whether no key is configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tenant of `token`.
    pub fn tenant(&self, token: &str) -> Option<&str> {
        self.0.get(token).map(String::as_str)
    }
}

/// Middleware: `Authorization: Bearer <token>` → the [`Tenant`] extension; otherwise 401.
pub(crate) async fn authenticate(
    State(keys): State<ApiKeys>,
    mut req: Request,
    next: Next,
) -> Response {
    let tenant = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|token| keys.tenant(token.trim()))
        .map(str::to_owned);
    match tenant {
        Some(tenant) => {
            req.extensions_mut().insert(Tenant(tenant));
            next.run(req).await
        }
        None => ApiError::Unauthorized.into_response(),
    }
}
