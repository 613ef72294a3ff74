//! The `Idempotency-Key` header: parsing and validation.
//!
//! Two spellings are accepted: the IETF draft's structured-field string
//! (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`) and Stripe's bare token
//! (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`). After unquoting, a key is 1 to
//! 255 characters of visible ASCII other than space, `"`, `\` and `,`.

use std::fmt;

/// The name of the request header that carries the key.
pub const HEADER_NAME: &str = "idempotency-key";

/// The longest key accepted, in characters (bytes: keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as the client sent it (after unquoting).
///
/// The raw key is never stored nor logged: stores receive a keyed hash of it
/// (see [`KeyHasher`](crate::KeyHasher)).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why an `Idempotency-Key` header was refused. Each case answers 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request carried more than one `Idempotency-Key` field.
    #[error("more than one Idempotency-Key header field")]
    Multiple,
    /// The key was empty (or an empty quoted string).
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key was longer than [`MAX_KEY_LEN`].
    #[error("the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// The length that was sent.
        len: usize,
    },
    /// The key contained a character that is not allowed.
    #[error("the Idempotency-Key contains a forbidden character at position {position}")]
    ForbiddenCharacter {
        /// Zero-based byte offset in the unquoted key.
        position: usize,
    },
    /// A quoted key was not a well-formed structured-field string.
    #[error("the Idempotency-Key is not a well-formed quoted string")]
    MalformedQuotedString,
}

impl IdempotencyKey {
    /// Parses one header field value (bytes as received).
    ///
    /// ```
    /// use idemkey_core::IdempotencyKey;
    /// let bare = IdempotencyKey::parse(b"8e03978e").unwrap();
    /// let quoted = IdempotencyKey::parse(b"\"8e03978e\"").unwrap();
    /// assert_eq!(bare, quoted);
    /// assert!(IdempotencyKey::parse(b"a,b").is_err());
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        let inner = match value {
            [b'"', rest @ ..] => match rest.split_last() {
                Some((b'"', inner)) => inner,
                _ => return Err(KeyError::MalformedQuotedString),
            },
            _ => value,
        };
        if inner.is_empty() {
            return Err(KeyError::Empty);
        }
        if inner.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: inner.len() });
        }
        if let Some(position) = inner.iter().position(|&b| !is_key_char(b)) {
            return Err(KeyError::ForbiddenCharacter { position });
        }
        // Every byte is visible ASCII, so this is valid UTF-8.
        let key = std::str::from_utf8(inner).map_err(|_| KeyError::MalformedQuotedString)?;
        Ok(Self(key.to_owned()))
    }

    /// Parses the key from all the `Idempotency-Key` field values of a request.
    ///
    /// `Ok(None)` when there is none; [`KeyError::Multiple`] when there are several.
    pub fn from_fields<'a, I>(values: I) -> Result<Option<Self>, KeyError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let mut values = values.into_iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Multiple);
        }
        // A single field holding a list ("a", "b") is several keys too; a comma is
        // forbidden inside a key, so `parse` refuses it.
        Self::parse(first).map(Some)
    }

    /// The key as the client sent it. Do not log it; use a [`KeyHasher`](crate::KeyHasher) id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys may embed business identifiers; keep them out of debug output and logs.
        f.write_str("IdempotencyKey(..)")
    }
}

fn is_key_char(b: u8) -> bool {
    b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b',')
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_bare_and_quoted_forms_alike() {
        let bare = IdempotencyKey::parse(b"abc-123_~!").unwrap();
        let quoted = IdempotencyKey::parse(b"\"abc-123_~!\"").unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(bare.as_str(), "abc-123_~!");
    }

    #[test]
    fn trims_optional_whitespace_around_the_value() {
        assert_eq!(IdempotencyKey::parse(b"  k1\t").unwrap().as_str(), "k1");
    }

    #[test]
    fn rejects_empty_keys() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"   "), Err(KeyError::Empty));
    }

    #[test]
    fn accepts_255_and_rejects_256_characters() {
        assert!(IdempotencyKey::parse(&[b'a'; 255]).is_ok());
        assert_eq!(
            IdempotencyKey::parse(&[b'a'; 256]),
            Err(KeyError::TooLong { len: 256 })
        );
        let mut quoted = vec![b'"'];
        quoted.extend_from_slice(&[b'a'; 255]);
        quoted.push(b'"');
        assert!(IdempotencyKey::parse(&quoted).is_ok());
    }

    #[test]
    fn rejects_forbidden_characters() {
        for bad in [
            &b"a b"[..],
            b"a,b",
            b"a\\b",
            b"a\"b",
            b"a\x7fb",
            b"a\x01b",
            "é".as_bytes(),
        ] {
            assert!(
                matches!(
                    IdempotencyKey::parse(bad),
                    Err(KeyError::ForbiddenCharacter { .. })
                ),
                "{bad:?} must be refused"
            );
        }
    }

    #[test]
    fn rejects_unterminated_quotes() {
        assert_eq!(
            IdempotencyKey::parse(b"\"abc"),
            Err(KeyError::MalformedQuotedString)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\""),
            Err(KeyError::MalformedQuotedString)
        );
    }

    #[test]
    fn rejects_several_fields_and_lists() {
        assert_eq!(
            IdempotencyKey::from_fields([&b"a"[..], b"b"]),
            Err(KeyError::Multiple)
        );
        assert!(IdempotencyKey::from_fields([&b"\"a\", \"b\""[..]]).is_err());
        assert_eq!(IdempotencyKey::from_fields(Vec::<&[u8]>::new()), Ok(None));
        assert_eq!(
            IdempotencyKey::from_fields([&b"k"[..]])
                .unwrap()
                .unwrap()
                .as_str(),
            "k"
        );
    }

    #[test]
    fn debug_output_hides_the_key() {
        let key = IdempotencyKey::parse(b"secret-order-42").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }

    proptest! {
        #[test]
        fn parser_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = IdempotencyKey::parse(&bytes);
        }

        #[test]
        fn accepted_keys_respect_the_charset_and_length(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = IdempotencyKey::parse(&bytes) {
                let k = key.as_str();
                prop_assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN);
                prop_assert!(k.bytes().all(is_key_char));
            }
        }

        #[test]
        fn valid_keys_round_trip_in_both_forms(key in "[!#-+\\--\\[\\]-~]{1,255}") {
            let bare = IdempotencyKey::parse(key.as_bytes()).unwrap();
            let quoted = IdempotencyKey::parse(format!("\"{key}\"").as_bytes()).unwrap();
            prop_assert_eq!(bare.as_str(), key.as_str());
            prop_assert_eq!(quoted.as_str(), key.as_str());
        }
    }
}
