//! Sealing raw keys for the reconciler.
//!
//! Records store a keyed hash of the key, which a reconciler cannot ask the upstream about.
//! External-mode records therefore also keep the key sealed with ChaCha20-Poly1305 under a
//! cipher key derived from the key secret: `HMAC-SHA256(secret, "idemkey seal v1")`. The
//! stored value is the random 12-byte nonce followed by the ciphertext and its tag; the
//! record's key hash is the associated data, so a sealed key cannot be moved to another row.

use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, KeyInit, Nonce};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

const NONCE_LEN: usize = 12;

fn mac(secret: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length")
}

/// Seals and unseals raw keys with a cipher key derived from the key secret.
#[derive(Clone)]
pub(crate) struct KeySealer {
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for KeySealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySealer(..)")
    }
}

impl KeySealer {
    /// A sealer for `secret` (the key-hashing secret).
    pub(crate) fn new(secret: &[u8]) -> Self {
        let mut derive = mac(secret);
        derive.update(b"idemkey seal v1");
        let key = derive.finalize().into_bytes();
        Self {
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key)),
        }
    }

    /// `nonce ‖ ChaCha20-Poly1305(key)`, bound to `aad` (the record's key hash).
    pub(crate) fn seal(&self, key: &str, aad: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::thread_rng().fill_bytes(&mut nonce);
        let sealed = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: key.as_bytes(),
                    aad,
                },
            )
            .expect("ChaCha20-Poly1305 encrypts any key of at most 255 bytes");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        out
    }

    /// The key sealed by [`seal`](Self::seal) with the same secret and `aad`; `None` if the
    /// value was sealed under another secret, for another row, or was tampered with.
    pub(crate) fn unseal(&self, sealed: &[u8], aad: &[u8]) -> Option<String> {
        if sealed.len() < NONCE_LEN {
            return None;
        }
        let (nonce, ciphertext) = sealed.split_at(NONCE_LEN);
        let plain = self
            .cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .ok()?;
        String::from_utf8(plain).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seals_and_unseals_only_with_the_same_secret_and_row() {
        let sealer = KeySealer::new(b"secret");
        let sealed = sealer.seal("key-1", b"row-a");
        assert!(!sealed.windows(5).any(|w| w == b"key-1"), "no clear text");
        assert_eq!(sealer.unseal(&sealed, b"row-a").as_deref(), Some("key-1"));
        assert_eq!(sealer.unseal(&sealed, b"row-b"), None, "bound to its row");
        assert_eq!(KeySealer::new(b"other").unseal(&sealed, b"row-a"), None);
        let mut tampered = sealed.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert_eq!(sealer.unseal(&tampered, b"row-a"), None);
        assert_eq!(sealer.unseal(&sealed[..5], b"row-a"), None);
        assert_ne!(
            sealer.seal("key-1", b"row-a"),
            sealed,
            "fresh nonce each time"
        );
    }
}
