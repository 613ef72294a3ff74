//! SQL literals, for the statements the store sends together in one simple-query message
//! (the extended protocol that carries bound parameters answers each statement before the
//! next is sent, so it cannot put two in one round trip), and for the grouped completion,
//! whose rows are planned with each statement.
//!
//! Only values this crate builds go through here, and each is written so that nothing in it
//! can end the literal: text as an escape string (`E'…'`, with `\` and `'` doubled, which
//! reads the same whatever `standard_conforming_strings` says), bytes as hex digits in one
//! (`E'\\x…'::bytea`), numbers as digits.

use std::fmt::Write;

use idemkey_core::{RecordId, StoreError, StoredResponse, Timestamp};

/// A statement being written, value by value.
#[derive(Debug, Default)]
pub(crate) struct Sql(String);

impl Sql {
    pub(crate) fn new(start: &str) -> Self {
        Self(start.to_owned())
    }

    /// Appends SQL text of this crate's own (never a value).
    pub(crate) fn push(&mut self, sql: &str) -> &mut Self {
        self.0.push_str(sql);
        self
    }

    /// A text value. PostgreSQL text cannot hold NUL, so a value with one is refused, as the
    /// server would refuse it bound.
    pub(crate) fn text(&mut self, value: &str) -> Result<&mut Self, StoreError> {
        if value.contains('\0') {
            return Err(StoreError::Database(
                "a text value contains a NUL character, which PostgreSQL cannot store".into(),
            ));
        }
        self.0.reserve(value.len() + 3);
        self.0.push_str("E'");
        for c in value.chars() {
            match c {
                '\'' => self.0.push_str("''"),
                '\\' => self.0.push_str("\\\\"),
                c => self.0.push(c),
            }
        }
        self.0.push('\'');
        Ok(self)
    }

    /// A `bytea` value, in the type's hex input format.
    pub(crate) fn bytes(&mut self, value: &[u8]) -> &mut Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        self.0.reserve(value.len() * 2 + 16);
        self.0.push_str("E'\\\\x");
        for &b in value {
            self.0.push(char::from(DIGITS[usize::from(b >> 4)]));
            self.0.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
        self.0.push_str("'::bytea");
        self
    }

    /// A nullable `bytea` value.
    pub(crate) fn opt_bytes(&mut self, value: Option<&[u8]>) -> &mut Self {
        match value {
            Some(value) => self.bytes(value),
            None => self.push("NULL"),
        }
    }

    /// An integer.
    pub(crate) fn int(&mut self, value: i64) -> &mut Self {
        let _ = write!(self.0, "{value}");
        self
    }

    /// A nullable integer.
    pub(crate) fn opt_int(&mut self, value: Option<i64>) -> &mut Self {
        match value {
            Some(value) => self.int(value),
            None => self.push("NULL"),
        }
    }

    /// A record's identity: `tenant, key_hash, route`.
    pub(crate) fn id(&mut self, id: &RecordId) -> Result<&mut Self, StoreError> {
        self.text(&id.tenant)?.push(", ");
        self.bytes(&id.key_hash).push(", ");
        self.text(&id.route)
    }

    /// A completion, in `idemkey_complete_v1`'s order: the record's identity, the owner's
    /// token, the response's status, headers and body, when it was written.
    pub(crate) fn completion(
        &mut self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<&mut Self, StoreError> {
        self.id(id)?.push(", ").int(token).push(", ");
        self.int(i64::from(response.status)).push(", ");
        self.bytes(&response.encode_headers()).push(", ");
        self.bytes(&response.body).push(", ");
        Ok(self.int(now.as_millis()))
    }

    pub(crate) fn finish(self) -> String {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &str) -> String {
        let mut sql = Sql::default();
        sql.text(value).expect("text");
        sql.finish()
    }

    #[test]
    fn text_doubles_quotes_and_backslashes() {
        assert_eq!(text("plain"), "E'plain'");
        assert_eq!(text("it's"), "E'it''s'");
        assert_eq!(
            text(r"a\'); DROP TABLE x; --"),
            r"E'a\\''); DROP TABLE x; --'"
        );
        assert_eq!(text("ünïcode ✓"), "E'ünïcode ✓'");
    }

    #[test]
    fn text_refuses_nul() {
        assert!(Sql::default().text("a\0b").is_err());
    }

    #[test]
    fn bytes_are_hex() {
        let mut sql = Sql::default();
        sql.bytes(&[0, 0x27, 0x5c, 0xff]).push(", ").opt_bytes(None);
        sql.push(", ").opt_int(Some(-5)).push(", ").opt_int(None);
        assert_eq!(sql.finish(), r"E'\\x00275cff'::bytea, NULL, -5, NULL");
    }
}
