//! JSON bodies for the fingerprint: parsed once as I-JSON, written once in their RFC 8785
//! (JCS) form, each value reported on the way with its JSON Pointer (for the member
//! digests).
//!
//! The output is byte for byte what `serde_json_canonicalizer` 0.4 writes for the same
//! `serde_json::Value` (its tests hold it to that, and to the RFC's vectors): members sorted
//! by UTF-16 code units, no whitespace, every number as a double written as ECMAScript's
//! `Number.prototype.toString` (`ryu-js`), strings with only the mandatory escapes.

use std::fmt::{self, Write as _};

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses a JSON text that is also I-JSON as far as JCS needs: no duplicate member names
/// (which `serde_json::Value` would otherwise silently collapse, last one winning), nothing
/// after the value. `None` otherwise (also past `serde_json`'s nesting limit of 128).
pub(crate) fn parse(body: &[u8]) -> Option<Value> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = IJson.deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(value)
}

/// Builds a `Value` as `serde_json`'s own visitor does, refusing duplicate member names.
#[derive(Clone, Copy)]
struct IJson;

impl<'de> DeserializeSeed<'de> for IJson {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for IJson {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            if members.insert(name, value).is_some() {
                return Err(de::Error::custom("duplicate member name"));
            }
        }
        Ok(Value::Object(members))
    }
}

/// One value of the document, as the writer reaches it (a container before its members).
pub(crate) enum Node<'a> {
    /// An object, with its member names in canonical order.
    Object(&'a [&'a String]),
    /// An array of this many elements.
    Array(usize),
    /// A scalar, in its canonical form.
    Scalar(&'a [u8]),
}

/// A number JCS cannot write (not a finite double).
#[derive(Debug)]
pub(crate) struct NotCanonical;

/// Appends the canonical form of `value` to `out`, telling `visit` each value with its
/// JSON Pointer (RFC 6901, escaped), starting at `pointer`, in canonical order.
pub(crate) fn write(
    value: &Value,
    out: &mut Vec<u8>,
    pointer: &str,
    visit: &mut dyn FnMut(&str, Node<'_>),
) -> Result<(), NotCanonical> {
    Writer {
        out,
        pointer: pointer.to_owned(),
        visit,
    }
    .value(value)
}

struct Writer<'a> {
    out: &'a mut Vec<u8>,
    pointer: String,
    visit: &'a mut dyn FnMut(&str, Node<'_>),
}

impl Writer<'_> {
    fn value(&mut self, value: &Value) -> Result<(), NotCanonical> {
        match value {
            Value::Object(map) => {
                let mut names: Vec<&String> = map.keys().collect();
                names.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
                (self.visit)(&self.pointer, Node::Object(&names));
                self.out.push(b'{');
                for (i, name) in names.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    string(self.out, name);
                    self.out.push(b':');
                    let len = self.pointer.len();
                    self.pointer.push('/');
                    for c in name.chars() {
                        match c {
                            '~' => self.pointer.push_str("~0"),
                            '/' => self.pointer.push_str("~1"),
                            c => self.pointer.push(c),
                        }
                    }
                    let done = self.value(&map[name.as_str()]);
                    self.pointer.truncate(len);
                    done?;
                }
                self.out.push(b'}');
            }
            Value::Array(items) => {
                (self.visit)(&self.pointer, Node::Array(items.len()));
                self.out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    let len = self.pointer.len();
                    let _ = write!(self.pointer, "/{i}");
                    let done = self.value(item);
                    self.pointer.truncate(len);
                    done?;
                }
                self.out.push(b']');
            }
            scalar => {
                let start = self.out.len();
                match scalar {
                    Value::Null => self.out.extend_from_slice(b"null"),
                    Value::Bool(true) => self.out.extend_from_slice(b"true"),
                    Value::Bool(false) => self.out.extend_from_slice(b"false"),
                    Value::Number(n) => match n.as_f64() {
                        Some(f) if f.is_finite() => self
                            .out
                            .extend_from_slice(ryu_js::Buffer::new().format_finite(f).as_bytes()),
                        _ => return Err(NotCanonical),
                    },
                    Value::String(s) => string(self.out, s),
                    Value::Array(_) | Value::Object(_) => unreachable!("containers are above"),
                }
                (self.visit)(&self.pointer, Node::Scalar(&self.out[start..]));
            }
        }
        Ok(())
    }
}

/// A JSON string with only the escapes JCS requires (`serde_json`'s escapes, which are
/// the same): `\"`, `\\`, `\b \t \n \f \r`, other controls as lowercase `\u00xx`.
fn string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut control = *b"\\u0000";
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0x00..=0x1f => {
                control[4] = HEX[usize::from(b >> 4)];
                control[5] = HEX[usize::from(b & 0xf)];
                &control
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(escape);
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}
