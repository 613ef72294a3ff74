//! Bearer tokens → tenants.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, header};
use idemkey_tower::Tenant;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::problem::ApiError;

/// The configured API keys: each token's SHA-256 digest and its tenant. Tokens are not kept,
/// and a presented token is compared with every digest in constant time, so neither a
/// memory dump nor the time an answer takes tells a token.
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<Vec<([u8; 32], String)>>);

/// The same API token was given for two tenants: a request carrying it could belong to
/// either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the same API token is given for tenants {first:?} and {second:?}: each tenant needs a \
     token of its own"
)]
pub struct DuplicateToken {
    /// The tenant the token was given for first.
    pub first: String,
    /// The other tenant it was given for.
    pub second: String,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl ApiKeys {
    /// Keys from `(tenant, token)` pairs. A pair given twice counts once; one token given
    /// for two tenants is refused.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self, DuplicateToken> {
        let mut keys: Vec<([u8; 32], String)> = Vec::new();
        for (tenant, token) in pairs {
            let digest = digest(&token);
            match keys.iter().find(|(d, _)| *d == digest) {
                Some((_, first)) if *first == tenant => {}
                Some((_, first)) => {
                    return Err(DuplicateToken {
                        first: first.clone(),
                        second: tenant,
                    });
                }
                None => keys.push((digest, tenant)),
            }
        }
        Ok(Self(Arc::new(keys)))
    }

    /// Parses `TENANT=TOKEN`.
    pub fn parse_pair(s: &str) -> Result<(String, String), String> {
        match s.split_once('=') {
            Some((tenant, token)) if !tenant.trim().is_empty() && !token.trim().is_empty() => {
                Ok((tenant.trim().to_owned(), token.trim().to_owned()))
            }
            // The text is not repeated: it may be a token with a typo.
            _ => Err("expected TENANT=TOKEN".to_owned()),
        }
    }

    /// Whether no key is configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tenant of `token`. Every configured digest is compared, in constant time.
    pub fn tenant(&self, token: &str) -> Option<&str> {
        let presented = digest(token);
        let mut found = None;
        for (digest, tenant) in self.0.iter() {
            if bool::from(digest.ct_eq(&presented)) {
                found = Some(tenant.as_str());
            }
        }
        found
    }

    /// The tenant of an `Authorization: Bearer <token>` header; the scheme's name is matched
    /// without regard to case, as HTTP says.
    pub fn tenant_of_authorization(&self, authorization: &HeaderValue) -> Option<&str> {
        let (scheme, token) = authorization.to_str().ok()?.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        self.tenant(token.trim())
    }
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenants: Vec<&str> = self.0.iter().map(|(_, t)| t.as_str()).collect();
        f.debug_struct("ApiKeys")
            .field("tenants", &tenants)
            .finish_non_exhaustive()
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
        .and_then(|v| keys.tenant_of_authorization(v))
        .map(str::to_owned);
    match tenant {
        Some(tenant) => {
            req.extensions_mut().insert(Tenant(tenant));
            next.run(req).await
        }
        None => ApiError::Unauthorized.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> ApiKeys {
        ApiKeys::new([
            ("a".to_owned(), "tok_a".to_owned()),
            ("b".to_owned(), "tok_b".to_owned()),
            ("a".to_owned(), "tok_a".to_owned()),
        ])
        .unwrap()
    }

    #[test]
    fn finds_tenants_by_token() {
        let keys = keys();
        assert_eq!(keys.tenant("tok_a"), Some("a"));
        assert_eq!(keys.tenant("tok_b"), Some("b"));
        assert_eq!(keys.tenant("tok_"), None);
        assert_eq!(keys.tenant(""), None);
    }

    #[test]
    fn refuses_one_token_for_two_tenants() {
        let err = ApiKeys::new([
            ("a".to_owned(), "tok".to_owned()),
            ("b".to_owned(), "tok".to_owned()),
        ])
        .unwrap_err();
        assert_eq!(err.first, "a");
        assert_eq!(err.second, "b");
        assert!(!err.to_string().contains("tok\""), "{err}");
    }

    #[test]
    fn matches_the_bearer_scheme_in_any_case() {
        let keys = keys();
        for header in [
            "Bearer tok_a",
            "bearer tok_a",
            "BEARER  tok_a",
            "bEaReR tok_a ",
        ] {
            let value = HeaderValue::from_str(header).unwrap();
            assert_eq!(keys.tenant_of_authorization(&value), Some("a"), "{header}");
        }
        for header in ["Basic tok_a", "Bearertok_a", "tok_a", "Bearer"] {
            let value = HeaderValue::from_str(header).unwrap();
            assert_eq!(keys.tenant_of_authorization(&value), None, "{header}");
        }
    }

    #[test]
    fn debug_shows_tenants_not_tokens() {
        let shown = format!("{:?}", keys());
        assert!(
            shown.contains("\"a\"") && shown.contains("\"b\""),
            "{shown}"
        );
        assert!(!shown.contains("tok_"), "{shown}");
    }
}
