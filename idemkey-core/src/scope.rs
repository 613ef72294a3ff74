//! Scope and keyed hashing: a record's identity is `(tenant, route, key)`.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::IdempotencyKey;

type HmacSha256 = Hmac<Sha256>;

/// Where a key lives: the authenticated tenant and the route (method + route template).
///
/// The tenant must come from the authenticated principal, never from a header the caller
/// can set freely. The same key under two scopes names two independent operations.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The authenticated principal's tenant.
    pub tenant: String,
    /// Method and route template, e.g. `POST /v1/payments`.
    pub route: String,
}

impl Scope {
    /// A scope for `tenant` on `method` + `route_template`.
    ///
    /// ```
    /// let scope = idemkey_core::Scope::new("acme", "POST", "/v1/payments");
    /// assert_eq!(scope.route, "POST /v1/payments");
    /// ```
    pub fn new(tenant: impl Into<String>, method: &str, route_template: &str) -> Self {
        Self {
            tenant: tenant.into(),
            route: format!("{} {route_template}", method.to_ascii_uppercase()),
        }
    }
}

/// The identity of a record as stores see it: the raw key is replaced by a keyed hash.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordId {
    /// The tenant, in clear (operators list by it).
    pub tenant: String,
    /// `HMAC-SHA256(secret, tenant, key)`: the same for every route of one tenant, so the
    /// status resource can find a caller's key without knowing the route.
    pub key_hash: [u8; 32],
    /// Method and route template.
    pub route: String,
}

impl RecordId {
    /// A short, log-safe identifier: the first 8 bytes of the key hash, in hex.
    pub fn key_id(&self) -> String {
        Self::key_id_of(&self.key_hash)
    }

    /// A fixed-size digest of the whole identity,
    /// `SHA-256("idemkey record v1" ‖ lp(tenant) ‖ key_hash ‖ lp(route))`, `lp` being a
    /// big-endian `u64` length before the bytes. It names the record in eviction notices
    /// ([`EvictionNotice`](crate::EvictionNotice)) and keys in-process caches; it reveals no
    /// more than the key hash does.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"idemkey record v1");
        h.update((self.tenant.len() as u64).to_be_bytes());
        h.update(self.tenant.as_bytes());
        h.update(self.key_hash);
        h.update((self.route.len() as u64).to_be_bytes());
        h.update(self.route.as_bytes());
        h.finalize().into()
    }

    /// The [`key_id`](Self::key_id) of a key hash.
    pub fn key_id_of(key_hash: &[u8; 32]) -> String {
        hex::encode(&key_hash[..8])
    }
}

/// Derives record identities and log-safe key identifiers from raw keys with a secret.
///
/// Keys are stored as `HMAC-SHA256(secret, len(tenant) ‖ tenant ‖ len(key) ‖ key)`, so a
/// leaked table reveals neither the keys nor whether a guessed key was used.
#[derive(Clone)]
pub struct KeyHasher {
    mac: HmacSha256,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyHasher(..)")
    }
}

impl KeyHasher {
    /// A hasher keyed with `secret`. Use at least 32 random bytes; keep it stable, since
    /// changing it makes every stored record unreachable (they expire as usual).
    pub fn new(secret: &[u8]) -> Self {
        Self {
            mac: HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length"),
        }
    }

    /// The keyed hash of `key` for `tenant`.
    pub fn key_hash(&self, tenant: &str, key: &IdempotencyKey) -> [u8; 32] {
        let mut mac = self.mac.clone();
        for part in [tenant.as_bytes(), key.as_str().as_bytes()] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }

    /// The record identity of `key` in `scope`.
    pub fn record_id(&self, scope: &Scope, key: &IdempotencyKey) -> RecordId {
        RecordId {
            tenant: scope.tenant.clone(),
            key_hash: self.key_hash(&scope.tenant, key),
            route: scope.route.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s.as_bytes()).unwrap()
    }

    #[test]
    fn same_key_in_two_tenants_or_routes_is_two_identities() {
        let h = KeyHasher::new(b"secret");
        let a = h.record_id(&Scope::new("t1", "POST", "/p"), &key("k"));
        let b = h.record_id(&Scope::new("t2", "POST", "/p"), &key("k"));
        let c = h.record_id(&Scope::new("t1", "POST", "/q"), &key("k"));
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, h.record_id(&Scope::new("t1", "post", "/p"), &key("k")));
    }

    #[test]
    fn tenant_and_key_boundaries_cannot_be_shifted() {
        let h = KeyHasher::new(b"secret");
        assert_ne!(h.key_hash("ab", &key("c")), h.key_hash("a", &key("bc")));
    }

    #[test]
    fn digest_names_the_whole_identity() {
        let h = KeyHasher::new(b"secret");
        let a = h.record_id(&Scope::new("t1", "POST", "/p"), &key("k"));
        let b = h.record_id(&Scope::new("t1", "POST", "/q"), &key("k"));
        let c = h.record_id(&Scope::new("t2", "POST", "/p"), &key("k"));
        assert_eq!(a.digest(), a.clone().digest());
        assert_ne!(a.digest(), b.digest());
        assert_ne!(a.digest(), c.digest());
    }

    #[test]
    fn hash_depends_on_the_secret() {
        assert_ne!(
            KeyHasher::new(b"one").key_hash("t", &key("k")),
            KeyHasher::new(b"two").key_hash("t", &key("k"))
        );
    }
}
