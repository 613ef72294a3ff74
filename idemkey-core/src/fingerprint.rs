//! The canonical request fingerprint.
//!
//! A fingerprint says whether a retry carries the *same operation* as the request that
//! claimed a key. It is SHA-256 over a versioned, unambiguous encoding of the method, the
//! route template, the path parameters, the query string and the body, where JSON bodies
//! are first canonicalized by RFC 8785 (JCS), so that member order, whitespace, number
//! spelling and string escapes do not matter while any changed value does.
//!
//! The exact byte layout is specified in `docs/fingerprint.md`; the summary:
//!
//! ```text
//! lp(x)      = u64be(len(x)) ‖ x
//! pairs(ps)  = u64be(count) ‖ for each (name, value) sorted bytewise: lp(name) ‖ lp(value)
//! method     = 'M' ‖ lp(ASCII-uppercase(method))
//! route      = 'R' ‖ lp(route)
//! params     = 'P' ‖ pairs(path parameters)
//! query      = 'Q' ‖ pairs(decoded query)
//! body       = 'B' ‖ lp(media type) ‖ ( 'J' ‖ lp(JCS(document))
//!                                     | 'F' ‖ u64be(n) ‖ per pointer: lp(pointer) ‖ (0x00 | 0x01 ‖ lp(JCS(value)))
//!                                     | 'W' ‖ pairs(decoded form)
//!                                     | 'X' ‖ lp(raw bytes) )
//! digest     = SHA-256(FINGERPRINT_VERSION ‖ lp(method) ‖ lp(route) ‖ lp(params) ‖ lp(query) ‖ lp(body))
//! parts.*    = SHA-256(part)[..8]
//! ```
//!
//! A JSON body also yields [`Members`]: per value, a short digest of its JSON Pointer and
//! one of its canonical value, so that a 422 can name the first member that differs without
//! the record keeping any name or value in clear.

use std::borrow::Cow;

use sha2::{Digest, Sha256};

use crate::jcs::{self, Node};

/// Version of the canonical encoding; part of every digest.
pub const FINGERPRINT_VERSION: u8 = 1;

/// The fingerprint of a request: one digest to compare, and short per-part digests to say
/// which part differs when the digests do not match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// SHA-256 over the whole versioned encoding.
    pub digest: [u8; 32],
    /// Truncated per-part digests, to name which part differs.
    pub parts: FingerprintParts,
    /// Per-member digests of a JSON body, to name the first member that differs; `None` for
    /// a body that is not JSON (or falls back to raw bytes) and past [`MAX_MEMBERS`] values.
    pub members: Option<Members>,
}

/// At most this many values of a JSON body (the document, its members and elements, at
/// every depth; or, under a field selection, the selected values and theirs) get member
/// digests. A larger body gets none, and its 422 names only the part that differs.
pub const MAX_MEMBERS: usize = 256;

/// The first byte of [`Members::to_bytes`]: the version of the member digest encoding.
pub const MEMBERS_VERSION: u8 = 1;

/// What the record keeps of one value of a JSON body: two truncated digests, neither the
/// member's name nor its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemberDigest {
    /// `SHA-256('p' ‖ lp(pointer))[..8]`.
    pub pointer: [u8; 8],
    /// `SHA-256('v' ‖ lp(pointer) ‖ node)[..8]`, `node` being the value's canonical form
    /// (scalars), its member names (objects), its length (arrays) or "missing".
    pub value: [u8; 8],
}

/// One value of the request's own JSON body, as only the request itself knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberPointer {
    /// Its JSON Pointer (RFC 6901, escaped), e.g. `/items/2/qty`.
    pub pointer: String,
    /// An object or an array (whose members follow it), not a scalar or a missing field.
    pub container: bool,
}

/// The per-value digests of a JSON body, in canonical order: the order in which the values
/// appear in the body's RFC 8785 form (a container before its members; members sorted as JCS
/// sorts them, elements by index). Under a field selection: per selected pointer, sorted and
/// deduplicated, the value there and its members, or one "missing" entry.
///
/// A fingerprint computed from a request also holds the request's own pointers
/// ([`pointers`](Self::pointers)); one read from a record holds only the digests, which is
/// all a record stores. Equality compares the digests only.
#[derive(Debug, Clone, Default)]
pub struct Members {
    digests: Vec<MemberDigest>,
    pointers: Vec<MemberPointer>,
}

impl PartialEq for Members {
    fn eq(&self, other: &Self) -> bool {
        self.digests == other.digests
    }
}

impl Eq for Members {}

impl Members {
    /// The digests, in canonical order.
    pub fn digests(&self) -> &[MemberDigest] {
        &self.digests
    }

    /// The request's own pointers, parallel to [`digests`](Self::digests); empty when read
    /// from a record.
    pub fn pointers(&self) -> &[MemberPointer] {
        &self.pointers
    }

    /// The stored form: [`MEMBERS_VERSION`], then 16 bytes per value (pointer digest ‖
    /// value digest).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 16 * self.digests.len());
        out.push(MEMBERS_VERSION);
        for d in &self.digests {
            out.extend_from_slice(&d.pointer);
            out.extend_from_slice(&d.value);
        }
        out
    }

    /// Inverse of [`to_bytes`](Self::to_bytes), without pointers. `None` for another
    /// version or a malformed length: the record then names no member, nothing else changes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let (&version, rest) = b.split_first()?;
        if version != MEMBERS_VERSION || rest.len() % 16 != 0 || rest.len() / 16 > MAX_MEMBERS {
            return None;
        }
        let digests = rest
            .chunks_exact(16)
            .map(|c| {
                let mut d = MemberDigest {
                    pointer: [0; 8],
                    value: [0; 8],
                };
                d.pointer.copy_from_slice(&c[..8]);
                d.value.copy_from_slice(&c[8..]);
                d
            })
            .collect();
        Some(Self {
            digests,
            pointers: Vec::new(),
        })
    }

    /// Adds the digests of the value at `pointer` (`None`: a selected pointer that
    /// resolves to nothing); `false` past [`MAX_MEMBERS`].
    fn push(&mut self, pointer: &str, node: Option<Node<'_>>) -> bool {
        if self.digests.len() == MAX_MEMBERS {
            return false;
        }
        let lp = (pointer.len() as u64).to_be_bytes();
        let mut p = Sha256::new();
        p.update(b"p");
        p.update(lp);
        p.update(pointer.as_bytes());
        let mut v = Sha256::new();
        v.update(b"v");
        v.update(lp);
        v.update(pointer.as_bytes());
        let u64be = |n: usize| (n as u64).to_be_bytes();
        let container = match node {
            None => {
                v.update(b"N");
                false
            }
            Some(Node::Object(names)) => {
                v.update(b"O");
                v.update(u64be(names.len()));
                for name in names {
                    v.update(u64be(name.len()));
                    v.update(name.as_bytes());
                }
                true
            }
            Some(Node::Array(len)) => {
                v.update(b"A");
                v.update(u64be(len));
                true
            }
            Some(Node::Scalar(canonical)) => {
                v.update(b"S");
                v.update(u64be(canonical.len()));
                v.update(canonical);
                false
            }
        };
        let mut d = MemberDigest {
            pointer: [0; 8],
            value: [0; 8],
        };
        d.pointer.copy_from_slice(&p.finalize()[..8]);
        d.value.copy_from_slice(&v.finalize()[..8]);
        self.digests.push(d);
        self.pointers.push(MemberPointer {
            pointer: pointer.to_owned(),
            container,
        });
        true
    }
}

/// Collects the member digests of a JSON body as its canonical form is written: `None`
/// once past [`MAX_MEMBERS`].
struct Collect(Option<Members>);

impl Collect {
    fn add(&mut self, pointer: &str, node: Option<Node<'_>>) {
        if let Some(members) = &mut self.0
            && !members.push(pointer, node)
        {
            self.0 = None;
        }
    }
}

/// The first 8 bytes of SHA-256 over each part's own canonical encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FingerprintParts {
    /// Path parameters.
    pub params: [u8; 8],
    /// Query string.
    pub query: [u8; 8],
    /// Body (with its media type).
    pub body: [u8; 8],
}

impl FingerprintParts {
    /// 24 bytes: params ‖ query ‖ body.
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.params);
        out[8..16].copy_from_slice(&self.query);
        out[16..].copy_from_slice(&self.body);
        out
    }
    /// Inverse of [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != 24 {
            return None;
        }
        let mut p = Self {
            params: [0; 8],
            query: [0; 8],
            body: [0; 8],
        };
        p.params.copy_from_slice(&b[..8]);
        p.query.copy_from_slice(&b[8..16]);
        p.body.copy_from_slice(&b[16..]);
        Some(p)
    }
}

/// The parts of a request that define the operation.
#[derive(Debug, Clone)]
pub struct RequestParts<'a> {
    /// The HTTP method, e.g. `"POST"`; compared case-insensitively (ASCII-uppercased).
    pub method: &'a str,
    /// The route template, e.g. `"/v1/payments/{id}"`, compared exactly.
    pub route: &'a str,
    /// The path parameters as `(name, value)`; their order does not matter.
    pub path_params: &'a [(&'a str, &'a str)],
    /// The raw query string, without the leading `?`. `None` and `Some("")` are the same.
    pub query: Option<&'a str>,
    /// The raw `Content-Type` header value, parameters included.
    pub content_type: Option<&'a str>,
    /// The raw request body.
    pub body: &'a [u8],
}

/// Which JSON fields define the operation (JSON Pointers, RFC 6901). Empty/None = whole body.
///
/// With `fields: Some(pointers)` and a JSON body, only the values at those pointers count;
/// a pointer that resolves to nothing is encoded as *missing*, which differs from a field
/// that is present with the value `null`. The order of the pointers and duplicates among
/// them do not matter. For a body that is not JSON the selection is ignored and the whole
/// body counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FingerprintSpec {
    /// The JSON Pointers of the fields that count; `None` or an empty list means the whole body.
    pub fields: Option<Vec<String>>,
}

/// Computes the fingerprint of a request.
///
/// Never panics and never fails: a body that is declared as JSON but is not valid I-JSON
/// (malformed, duplicate member names, numbers out of range, lone surrogates, nesting deeper
/// than 128) is fingerprinted as raw bytes instead.
pub fn fingerprint(req: &RequestParts<'_>, spec: &FingerprintSpec) -> Fingerprint {
    let method = {
        let mut e = Enc::new(b'M', req.method.len());
        e.lp(req.method.to_ascii_uppercase().as_bytes());
        e.0
    };
    let route = {
        let mut e = Enc::new(b'R', req.route.len());
        e.lp(req.route.as_bytes());
        e.0
    };
    let params = {
        let mut pairs: Vec<Pair<'_>> = req
            .path_params
            .iter()
            .map(|(n, v)| (Cow::Borrowed(n.as_bytes()), Cow::Borrowed(v.as_bytes())))
            .collect();
        let mut e = Enc::new(b'P', 0);
        e.pairs(&mut pairs);
        e.0
    };
    let query = {
        let mut pairs = decode_form(req.query.unwrap_or("").as_bytes());
        let mut e = Enc::new(b'Q', 0);
        e.pairs(&mut pairs);
        e.0
    };
    let (body, members) = encode_body(req.content_type, req.body, spec);

    let mut h = Sha256::new();
    h.update([FINGERPRINT_VERSION]);
    for part in [&method, &route, &params, &query, &body] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Fingerprint {
        digest: h.finalize().into(),
        parts: FingerprintParts {
            params: short_hash(&params),
            query: short_hash(&query),
            body: short_hash(&body),
        },
        members,
    }
}

/// A `(name, value)` pair of path parameters, query or form fields, as bytes.
type Pair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// A part's encoding under construction: a tag byte, then length-prefixed components.
struct Enc(Vec<u8>);

impl Enc {
    fn new(tag: u8, capacity: usize) -> Self {
        let mut v = Vec::with_capacity(capacity + 9);
        v.push(tag);
        Self(v)
    }
    fn byte(&mut self, b: u8) {
        self.0.push(b);
    }
    fn u64(&mut self, n: usize) {
        self.0.extend_from_slice(&(n as u64).to_be_bytes());
    }
    /// A length-prefixed component.
    fn lp(&mut self, bytes: &[u8]) {
        self.u64(bytes.len());
        self.0.extend_from_slice(bytes);
    }
    /// A length-prefixed component that `write` appends.
    fn lp_with<E>(&mut self, write: impl FnOnce(&mut Vec<u8>) -> Result<(), E>) -> Result<(), E> {
        let at = self.0.len();
        self.0.extend_from_slice(&[0; 8]);
        write(&mut self.0)?;
        let len = (self.0.len() - at - 8) as u64;
        self.0[at..at + 8].copy_from_slice(&len.to_be_bytes());
        Ok(())
    }
    /// A count, then the pairs sorted bytewise by name, then value.
    fn pairs(&mut self, pairs: &mut [Pair<'_>]) {
        pairs.sort_unstable();
        self.u64(pairs.len());
        for (name, value) in pairs.iter() {
            self.lp(name);
            self.lp(value);
        }
    }
}

fn short_hash(part: &[u8]) -> [u8; 8] {
    let full = Sha256::digest(part);
    let mut out = [0u8; 8];
    out.copy_from_slice(&full[..8]);
    out
}

/// How the body is interpreted, from its normalized media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyKind {
    Json,
    Form,
    Raw,
}

/// The media type without parameters, trimmed and ASCII-lowercased (`""` when absent).
fn normalize_media_type(content_type: Option<&str>) -> String {
    let raw = content_type.unwrap_or("");
    let essence = raw.split(';').next().unwrap_or("");
    essence
        .trim_matches(|c| c == ' ' || c == '\t')
        .to_ascii_lowercase()
}

fn body_kind(media_type: &str) -> BodyKind {
    if media_type == "application/x-www-form-urlencoded" {
        return BodyKind::Form;
    }
    match media_type.split_once('/') {
        Some((ty, subtype))
            if !ty.is_empty()
                && ((ty == "application" && subtype == "json")
                    || (subtype.len() > "+json".len() && subtype.ends_with("+json"))) =>
        {
            BodyKind::Json
        }
        _ => BodyKind::Raw,
    }
}

fn encode_body(
    content_type: Option<&str>,
    body: &[u8],
    spec: &FingerprintSpec,
) -> (Vec<u8>, Option<Members>) {
    let media_type = normalize_media_type(content_type);
    let mut e = Enc::new(b'B', media_type.len() + body.len() + 32);
    e.lp(media_type.as_bytes());
    let mut members = None;
    match body_kind(&media_type) {
        BodyKind::Json => match encode_json(&mut e, body, spec) {
            Some(m) => members = m,
            None => {
                e.0.truncate(1 + 8 + media_type.len());
                encode_raw(&mut e, body);
            }
        },
        BodyKind::Form => {
            e.byte(b'W');
            e.pairs(&mut decode_form(body));
        }
        BodyKind::Raw => encode_raw(&mut e, body),
    }
    (e.0, members)
}

fn encode_raw(e: &mut Enc, body: &[u8]) {
    e.byte(b'X');
    e.lp(body);
}

/// Appends the JSON body's encoding and answers its members (`Some(None)` past
/// [`MAX_MEMBERS`]); `None` (with `e` partly written) if it is not I-JSON.
fn encode_json(e: &mut Enc, body: &[u8], spec: &FingerprintSpec) -> Option<Option<Members>> {
    let doc = jcs::parse(body)?;
    let mut members = Collect(Some(Members::default()));
    match spec.fields.as_deref() {
        None | Some([]) => {
            e.byte(b'J');
            e.lp_with(|out| jcs::write(&doc, out, "", &mut |p, n| members.add(p, Some(n))))
                .ok()?;
        }
        Some(fields) => {
            let mut pointers: Vec<&str> = fields.iter().map(String::as_str).collect();
            pointers.sort_unstable();
            pointers.dedup();
            e.byte(b'F');
            e.u64(pointers.len());
            for &pointer in &pointers {
                e.lp(pointer.as_bytes());
                match doc.pointer(pointer) {
                    None => {
                        e.byte(0x00);
                        members.add(pointer, None);
                    }
                    Some(value) => {
                        e.byte(0x01);
                        e.lp_with(|out| {
                            jcs::write(value, out, pointer, &mut |p, n| members.add(p, Some(n)))
                        })
                        .ok()?;
                    }
                }
            }
        }
    }
    Some(members.0)
}

/// Decodes `application/x-www-form-urlencoded` bytes into `(name, value)` byte pairs, as the
/// WHATWG URL standard does but without the lossy UTF-8 step: split on `&`, skip empty
/// sequences, split each at its first `=`, turn `+` into a space and percent-decode (a `%`
/// not followed by two hex digits stays as it is).
fn decode_form(input: &[u8]) -> Vec<Pair<'_>> {
    input
        .split(|&b| b == b'&')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (name, value) = match s.iter().position(|&b| b == b'=') {
                Some(i) => (&s[..i], &s[i + 1..]),
                None => (s, &s[s.len()..]),
            };
            (percent_decode_plus(name), percent_decode_plus(value))
        })
        .collect()
}

fn percent_decode_plus(input: &[u8]) -> Cow<'_, [u8]> {
    if !input.iter().any(|&b| b == b'%' || b == b'+') {
        return Cow::Borrowed(input);
    }
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        match input[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hi = input.get(i + 1).and_then(|&b| hex_value(b));
                let lo = input.get(i + 2).and_then(|&b| hex_value(b));
                if let (Some(hi), Some(lo)) = (hi, lo) {
                    out.push(hi << 4 | lo);
                    i += 2;
                } else {
                    out.push(b'%');
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(out)
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    const JSON: Option<&str> = Some("application/json");

    fn req<'a>(content_type: Option<&'a str>, body: &'a [u8]) -> RequestParts<'a> {
        RequestParts {
            method: "POST",
            route: "/v1/payments/{id}",
            path_params: &[("id", "p_1")],
            query: Some("expand=items"),
            content_type,
            body,
        }
    }

    fn fp_body(content_type: Option<&str>, body: &str) -> Fingerprint {
        fingerprint(
            &req(content_type, body.as_bytes()),
            &FingerprintSpec::default(),
        )
    }

    fn fp_json(body: &str) -> Fingerprint {
        fp_body(JSON, body)
    }

    fn fp_fields(fields: &[&str], body: &str) -> Fingerprint {
        let spec = FingerprintSpec {
            fields: Some(fields.iter().map(|f| f.to_string()).collect()),
        };
        fingerprint(&req(JSON, body.as_bytes()), &spec)
    }

    fn fp_query(query: Option<&str>) -> Fingerprint {
        let r = RequestParts {
            query,
            ..req(JSON, b"{}")
        };
        fingerprint(&r, &FingerprintSpec::default())
    }

    fn fp_params(params: &[(&str, &str)]) -> Fingerprint {
        let r = RequestParts {
            path_params: params,
            ..req(JSON, b"{}")
        };
        fingerprint(&r, &FingerprintSpec::default())
    }

    fn assert_all_equal(fps: &[Fingerprint]) {
        for (i, fp) in fps.iter().enumerate() {
            assert_eq!(fp, &fps[0], "variant {i} differs from variant 0");
        }
    }

    /// Asserts the digests differ and exactly the named parts differ.
    #[track_caller]
    fn assert_differ_in(a: &Fingerprint, b: &Fingerprint, params: bool, query: bool, body: bool) {
        assert_ne!(a.digest, b.digest);
        assert_eq!(a.parts.params != b.parts.params, params, "params");
        assert_eq!(a.parts.query != b.parts.query, query, "query");
        assert_eq!(a.parts.body != b.parts.body, body, "body");
    }

    fn lp(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    }

    #[test]
    fn digest_matches_the_documented_layout() {
        let r = RequestParts {
            method: "post",
            route: "/v1/payments/{id}",
            path_params: &[("id", "p_1"), ("a", "x")],
            query: Some("b=2&a=1"),
            content_type: Some("application/json; charset=utf-8"),
            body: br#"{ "b": 1.0, "a": "\u00e9" }"#,
        };
        let got = fingerprint(&r, &FingerprintSpec::default());

        let method = [&b"M"[..], &4u64.to_be_bytes(), b"POST"].concat();
        let route = {
            let mut v = b"R".to_vec();
            lp(&mut v, b"/v1/payments/{id}");
            v
        };
        let pairs = |tag: &[u8], ps: &[(&str, &str)]| {
            let mut v = tag.to_vec();
            v.extend_from_slice(&(ps.len() as u64).to_be_bytes());
            for (n, x) in ps {
                lp(&mut v, n.as_bytes());
                lp(&mut v, x.as_bytes());
            }
            v
        };
        let params = pairs(b"P", &[("a", "x"), ("id", "p_1")]);
        let query = pairs(b"Q", &[("a", "1"), ("b", "2")]);
        let body = {
            let mut v = b"B".to_vec();
            lp(&mut v, b"application/json");
            v.push(b'J');
            lp(&mut v, "{\"a\":\"é\",\"b\":1}".as_bytes());
            v
        };
        let mut all = vec![FINGERPRINT_VERSION];
        for part in [&method, &route, &params, &query, &body] {
            lp(&mut all, part);
        }
        let short = |p: &[u8]| -> [u8; 8] { Sha256::digest(p)[..8].try_into().unwrap() };
        assert_eq!(got.digest, <[u8; 32]>::from(Sha256::digest(&all)));
        assert_eq!(got.parts.params, short(&params));
        assert_eq!(got.parts.query, short(&query));
        assert_eq!(got.parts.body, short(&body));
    }

    #[test]
    fn member_digests_keep_no_names_or_values_and_ignore_spelling() {
        let a = fp_json(r#"{"customer_name":"Alice Liddell","amount":1.0}"#);
        let b = fp_json(r#"{ "amount": 1, "customer_name": "Alice Liddell" }"#);
        let members = a.members.as_ref().expect("a JSON body has members");
        assert_eq!(a.members, b.members);
        let pointers: Vec<&str> = members
            .pointers()
            .iter()
            .map(|p| p.pointer.as_str())
            .collect();
        assert_eq!(
            pointers,
            ["", "/amount", "/customer_name"],
            "canonical order"
        );
        let stored = members.to_bytes();
        assert_eq!(stored.len(), 1 + 16 * 3);
        assert_eq!(stored[0], MEMBERS_VERSION);
        for clear in ["customer_name", "Alice", "amount"] {
            assert!(
                !stored.windows(clear.len()).any(|w| w == clear.as_bytes()),
                "{clear} is stored in clear"
            );
        }
        let back = Members::from_bytes(&stored).expect("round trip");
        assert_eq!(&back, members);
        assert!(back.pointers().is_empty(), "pointers are never stored");
        assert_eq!(Members::from_bytes(&[2]), None, "another version");
        assert_eq!(
            Members::from_bytes(&stored[..20]),
            None,
            "a malformed length"
        );
        // Bodies that are not JSON have none.
        assert_eq!(fp_body(Some("text/plain"), "{}").members, None);
        assert_eq!(fp_json("{").members, None);
    }

    #[test]
    fn json_member_order_and_whitespace_do_not_matter() {
        assert_all_equal(&[
            fp_json(r#"{"a":1,"b":[1,2,{"c":"x","d":null}],"e":{"f":true}}"#),
            fp_json(r#"{"e":{"f":true},"b":[1,2,{"d":null,"c":"x"}],"a":1}"#),
            fp_json(
                " \n{ \"b\" : [ 1 ,\t2 , { \"c\" : \"x\" , \"d\" : null } ] ,\r\n \"e\":{ \"f\" : true }, \"a\" : 1 } \n",
            ),
        ]);
    }

    #[test]
    fn json_number_spelling_does_not_matter() {
        assert_all_equal(&[
            fp_json(r#"{"n":1}"#),
            fp_json(r#"{"n":1.0}"#),
            fp_json(r#"{"n":1e0}"#),
            fp_json(r#"{"n":1E+0}"#),
            fp_json(r#"{"n":10e-1}"#),
            fp_json(r#"{"n":0.1e1}"#),
            fp_json(r#"{"n":1.000}"#),
        ]);
        assert_all_equal(&[
            fp_json(r#"[0.5, -0, 1e21, 123456789.25]"#),
            fp_json(r#"[5e-1, 0, 1000000000000000000000, 1.2345678925e8]"#),
            fp_json(r#"[0.50, -0.0, 1E21, 12345678925e-2]"#),
        ]);
    }

    #[test]
    fn json_string_escapes_do_not_matter() {
        assert_all_equal(&[
            fp_json(r#"{"s":"é/A\n😀","\u00e9":1}"#),
            fp_json(r#"{"s":"\u00e9\/\u0041\u000a\ud83d\ude00","é":1}"#),
            fp_json(r#"{"s":"\u00E9/A\n\uD83D\uDE00","\u00E9":1}"#),
        ]);
    }

    #[test]
    fn changed_json_value_changes_only_the_body_part() {
        let a = fp_json(r#"{"amount":100,"currency":"EUR"}"#);
        for other in [
            r#"{"amount":101,"currency":"EUR"}"#,
            r#"{"amount":"100","currency":"EUR"}"#,
            r#"{"amount":100,"currency":"eur"}"#,
            r#"{"amount":100,"currency":"EUR","x":null}"#,
            r#"{"amount":100}"#,
            r#"[{"amount":100,"currency":"EUR"}]"#,
        ] {
            assert_differ_in(&a, &fp_json(other), false, false, true);
        }
    }

    #[test]
    fn json_media_types_and_parameters() {
        let body = r#"{"b":2,"a":1}"#;
        let reordered = r#"{"a":1, "b":2.0}"#;
        assert_all_equal(&[
            fp_body(Some("application/json"), body),
            fp_body(Some("application/json; charset=utf-8"), reordered),
            fp_body(Some("Application/JSON;charset=UTF-8"), reordered),
            fp_body(Some(" application/json ; charset=\"utf-8\""), reordered),
        ]);
        // Any `+json` suffix is canonicalized too, but the media type is part of the body.
        let merge = fp_body(Some("application/merge-patch+json"), body);
        assert_eq!(
            merge,
            fp_body(
                Some("application/merge-patch+JSON; charset=utf-8"),
                reordered
            )
        );
        assert_differ_in(&merge, &fp_json(body), false, false, true);
        // Not JSON media types: raw bytes.
        assert_ne!(
            fp_body(Some("text/json"), body),
            fp_body(Some("text/json"), reordered)
        );
        assert_ne!(
            fp_body(Some("+json"), body),
            fp_body(Some("+json"), reordered)
        );
        assert_ne!(fp_body(None, body), fp_body(None, reordered));
    }

    #[test]
    fn invalid_json_falls_back_to_raw_bytes() {
        for (a, b) in [
            (r#"{"a":1"#, r#"{"a": 1"#),
            (r#"{"a":1,"a":2}"#, r#"{"a":2}"#), // duplicate member names are not I-JSON
            (r#"{"a":1} x"#, r#"{"a":1}"#),
            (r#"{"a":"\ud800"}"#, r#"{"a":"\ud801"}"#), // lone surrogates
            (r#"[1e400]"#, r#"[1e401]"#),
            ("", " "),
        ] {
            let (fa, fb) = (fp_json(a), fp_json(b));
            assert_differ_in(&fa, &fb, false, false, true);
            assert_eq!(fa, fp_json(a), "deterministic");
        }
        let deep = "[".repeat(10_000);
        let _ = fp_json(&deep);
        // Nesting deeper than serde_json's limit of 128 is raw bytes; within it, JSON.
        let nested =
            |depth: usize, gap: &str| format!("{}{gap}{}", "[".repeat(depth), "]".repeat(depth));
        assert_ne!(fp_json(&nested(200, "")), fp_json(&nested(200, " ")));
        assert_eq!(fp_json(&nested(100, "")), fp_json(&nested(100, " ")));
        // Not JSON at all, and not UTF-8 either.
        let raw = fingerprint(&req(JSON, &[0xff, 0xfe, 0x00]), &FingerprintSpec::default());
        assert_ne!(raw, fp_json(""));
    }

    #[test]
    fn query_pairs_are_decoded_and_sorted() {
        assert_all_equal(&[
            fp_query(Some("a=1&b=2")),
            fp_query(Some("b=2&a=1")),
            fp_query(Some("b=2&&a=%31&")),
            fp_query(Some("%61=1&b=2")),
        ]);
        assert_eq!(fp_query(Some("q=x+y")), fp_query(Some("q=x%20y")));
        assert_eq!(fp_query(None), fp_query(Some("")));
        assert_eq!(fp_query(Some("a")), fp_query(Some("a=")));
        let base = fp_query(Some("a=1&b=2"));
        for other in [
            "a=1&b=3",
            "a=1&b=2&b=2",
            "a=1",
            "a=1&B=2",
            "a=12",
            "a=1%26b%3D2",
            "a=1&b=2&c",
        ] {
            assert_differ_in(&base, &fp_query(Some(other)), false, true, false);
        }
        // Decoding is byte-exact: no lossy UTF-8 step merging invalid sequences.
        assert_ne!(fp_query(Some("a=%FF")), fp_query(Some("a=%FE")));
        // A malformed escape stays as it is.
        assert_eq!(fp_query(Some("a=%zz")), fp_query(Some("a=%25zz")));
        assert_ne!(fp_query(Some("a=%zz")), fp_query(Some("a=zz")));
    }

    #[test]
    fn form_bodies_are_decoded_and_sorted() {
        let form = Some("application/x-www-form-urlencoded");
        assert_all_equal(&[
            fp_body(form, "a=1&b=hello+world"),
            fp_body(form, "b=hello%20world&a=1"),
            fp_body(
                Some("Application/X-WWW-Form-Urlencoded; charset=UTF-8"),
                "b=hello+world&a=%31",
            ),
        ]);
        let base = fp_body(form, "a=1&b=2");
        assert_differ_in(&base, &fp_body(form, "a=1&b=3"), false, false, true);
        assert_differ_in(&base, &fp_body(form, "a=1&b=2&b=2"), false, false, true);
        // The same bytes under another media type are raw, hence different.
        assert_differ_in(
            &base,
            &fp_body(Some("text/plain"), "a=1&b=2"),
            false,
            false,
            true,
        );
    }

    #[test]
    fn raw_bodies_count_bytes_and_media_type() {
        let text = Some("text/plain");
        let base = fp_body(text, "hello");
        assert_eq!(base, fp_body(Some("TEXT/plain; charset=utf-8"), "hello"));
        assert_differ_in(&base, &fp_body(text, "hello "), false, false, true);
        assert_differ_in(&base, &fp_body(text, "Hello"), false, false, true);
        assert_differ_in(
            &base,
            &fp_body(Some("application/octet-stream"), "hello"),
            false,
            false,
            true,
        );
        assert_differ_in(&base, &fp_body(None, "hello"), false, false, true);
        assert_eq!(fp_body(None, "hello"), fp_body(Some(""), "hello"));
        // Length prefixes keep the media type and the bytes apart.
        assert_ne!(
            fp_body(Some("text/plainx"), "y"),
            fp_body(Some("text/plain"), "xy")
        );
    }

    #[test]
    fn field_selection_counts_only_the_selected_fields() {
        let fields = ["/amount", "/currency", "/items/0/sku"];
        let base = fp_fields(
            &fields,
            r#"{"amount":100,"currency":"EUR","note":"a","items":[{"sku":"x","qty":1}]}"#,
        );
        // Unselected fields, order, spelling: no difference.
        assert_eq!(
            base,
            fp_fields(
                &fields,
                r#"{"items":[{"qty":2,"sku":"x"},3],"note":"b","currency":"EUR","amount":1e2,"extra":true}"#
            )
        );
        // The order of the pointers and duplicates among them do not matter.
        assert_eq!(
            base,
            fp_fields(
                &["/items/0/sku", "/currency", "/amount", "/amount"],
                r#"{"amount":100,"currency":"EUR","items":[{"sku":"x"}]}"#
            )
        );
        // Selected fields do.
        for other in [
            r#"{"amount":101,"currency":"EUR","items":[{"sku":"x"}]}"#,
            r#"{"amount":100,"currency":"USD","items":[{"sku":"x"}]}"#,
            r#"{"amount":100,"currency":"EUR","items":[{"sku":"y"}]}"#,
            r#"{"amount":100,"currency":"EUR","items":[]}"#,
        ] {
            assert_differ_in(&base, &fp_fields(&fields, other), false, false, true);
        }
        // Selecting other fields is a different fingerprint even for the same body.
        let body = r#"{"amount":100,"currency":"EUR"}"#;
        assert_ne!(
            fp_fields(&["/amount"], body),
            fp_fields(&["/currency"], body)
        );
        // A selection differs from the whole body; an empty selection is the whole body.
        assert_ne!(fp_fields(&["/amount", "/currency"], body), fp_json(body));
        assert_eq!(fp_fields(&[], body), fp_json(body));
    }

    #[test]
    fn missing_field_differs_from_null() {
        let f = ["/note"];
        let missing = fp_fields(&f, r#"{"a":1}"#);
        let null = fp_fields(&f, r#"{"a":1,"note":null}"#);
        assert_differ_in(&missing, &null, false, false, true);
        assert_eq!(missing, fp_fields(&f, r#"{"b":2}"#));
        assert_eq!(missing, fp_fields(&f, "[1]"));
        assert_eq!(null, fp_fields(&f, r#"{"note":null,"b":2}"#));
        assert_ne!(null, fp_fields(&f, r#"{"note":"null"}"#));
        // Not a JSON Pointer (no leading '/'): resolves to nothing, like a missing field.
        assert_eq!(
            fp_fields(&["note"], r#"{"note":1}"#),
            fp_fields(&["note"], r#"{"note":2}"#)
        );
    }

    #[test]
    fn field_selection_is_ignored_for_bodies_that_are_not_json() {
        let spec = FingerprintSpec {
            fields: Some(vec!["/a".into()]),
        };
        let text =
            |body: &'static str| fingerprint(&req(Some("text/plain"), body.as_bytes()), &spec);
        assert_eq!(
            text(r#"{"a":1}"#),
            fp_body(Some("text/plain"), r#"{"a":1}"#)
        );
        assert_ne!(text(r#"{"a":1,"b":1}"#), text(r#"{"a":1,"b":2}"#));
        let broken = |body: &'static str| fingerprint(&req(JSON, body.as_bytes()), &spec);
        assert_ne!(broken(r#"{"a":1,"b":1"#), broken(r#"{"a":1,"b":2"#));
    }

    #[test]
    fn path_params_are_order_insensitive() {
        let base = fp_params(&[("org", "o_1"), ("id", "p_1")]);
        assert_eq!(base, fp_params(&[("id", "p_1"), ("org", "o_1")]));
        assert_differ_in(
            &base,
            &fp_params(&[("id", "p_2"), ("org", "o_1")]),
            true,
            false,
            false,
        );
        assert_differ_in(
            &base,
            &fp_params(&[("id", "o_1"), ("org", "p_1")]),
            true,
            false,
            false,
        );
        assert_differ_in(&base, &fp_params(&[("id", "p_1")]), true, false, false);
        // Length prefixes: no shifting of bytes between name and value.
        assert_ne!(fp_params(&[("ab", "c")]), fp_params(&[("a", "bc")]));
        assert_ne!(
            fp_params(&[("a", "b"), ("c", "d")]),
            fp_params(&[("a", "bcd")])
        );
    }

    #[test]
    fn method_is_case_insensitive_and_method_and_route_count() {
        let with = |method: &'static str, route: &'static str| {
            let r = RequestParts {
                method,
                route,
                ..req(JSON, b"{}")
            };
            fingerprint(&r, &FingerprintSpec::default())
        };
        let base = with("POST", "/v1/payments/{id}");
        assert_eq!(base, with("post", "/v1/payments/{id}"));
        assert_eq!(base, with("PoSt", "/v1/payments/{id}"));
        for other in [
            with("PUT", "/v1/payments/{id}"),
            with("POST", "/v1/refunds/{id}"),
        ] {
            assert_ne!(base.digest, other.digest);
            assert_eq!(base.parts, other.parts, "method and route are not parts");
        }
        // Length prefixes keep method and route apart.
        assert_ne!(with("POST", "X/a").digest, with("POSTX", "/a").digest);
    }

    // ---- property tests ----

    /// xorshift64*: a tiny deterministic generator for the serialization choices.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
            xs[self.below(xs.len())]
        }
    }

    fn ws(rng: &mut Rng, out: &mut String) {
        out.push_str(rng.pick(&["", "", " ", "\n", "\t", "\r\n    ", "  "]));
    }

    fn hex4(rng: &mut Rng, unit: u16) -> String {
        if rng.below(2) == 0 {
            format!("\\u{unit:04x}")
        } else {
            format!("\\u{unit:04X}")
        }
    }

    fn write_string(s: &str, rng: &mut Rng, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let escape = rng.below(2) == 0;
            match c {
                '"' if escape => out.push_str("\\\""),
                '\\' if escape => out.push_str("\\\\"),
                '/' if escape => out.push_str("\\/"),
                '\u{8}' if escape => out.push_str("\\b"),
                '\u{c}' if escape => out.push_str("\\f"),
                '\n' if escape => out.push_str("\\n"),
                '\r' if escape => out.push_str("\\r"),
                '\t' if escape => out.push_str("\\t"),
                c if c < ' ' || c == '"' || c == '\\' || escape => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&hex4(rng, *unit));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn spell_number(n: &serde_json::Number, rng: &mut Rng) -> String {
        let int = n
            .as_u64()
            .map(|u| u.to_string())
            .or_else(|| n.as_i64().map(|i| i.to_string()));
        match int {
            Some(i) => {
                let mut options = vec![
                    i.clone(),
                    format!("{i}.0"),
                    format!("{i}e0"),
                    format!("{i}E+0"),
                    format!("{i}.000e-0"),
                ];
                if let Some(tenth) = i.strip_suffix('0').filter(|t| !t.is_empty() && *t != "-") {
                    options.push(format!("{tenth}e1"));
                }
                options.swap_remove(rng.below(options.len()))
            }
            None => {
                let f = n.as_f64().unwrap();
                match rng.below(4) {
                    0 => format!("{f}"),
                    1 => format!("{f:e}"),
                    2 => format!("{f:E}"),
                    _ => format!("{f:?}"),
                }
            }
        }
    }

    /// Writes `v` as JSON text with random member order, whitespace, number spelling and
    /// string escapes.
    fn write_value(v: &Value, rng: &mut Rng, out: &mut String) {
        ws(rng, out);
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => out.push_str(&spell_number(n, rng)),
            Value::String(s) => write_string(s, rng, out),
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        ws(rng, out);
                        out.push(',');
                    }
                    write_value(item, rng, out);
                }
                ws(rng, out);
                out.push(']');
            }
            Value::Object(members) => {
                let mut members: Vec<_> = members.iter().collect();
                for i in (1..members.len()).rev() {
                    members.swap(i, rng.below(i + 1));
                }
                out.push('{');
                for (i, (k, v)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    write_string(k, rng, out);
                    ws(rng, out);
                    out.push(':');
                    write_value(v, rng, out);
                }
                ws(rng, out);
                out.push('}');
            }
        }
        ws(rng, out);
    }

    fn arb_string() -> impl Strategy<Value = String> {
        let special = prop::sample::select(vec![
            '"', '\\', '/', '\n', '\t', '\u{1}', '\u{1f}', '\u{7f}', '\u{80}', 'é', '€', '😀',
            '\u{fb33}', '\u{fffd}', 'a', 'Z', '~',
        ]);
        prop::collection::vec(prop_oneof![any::<char>(), special], 0..8).prop_map(String::from_iter)
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        use prop::num::f64 as f;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1000i64..1000).prop_map(Value::from),
            (f::POSITIVE | f::NEGATIVE | f::NORMAL | f::SUBNORMAL | f::ZERO).prop_map(Value::from),
            (-100_000i32..100_000, 0i32..6)
                .prop_map(|(m, e)| Value::from(f64::from(m) / 10f64.powi(e))),
            arb_string().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((arb_string(), inner), 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Every leaf (scalars, empty arrays and objects) as an escaped JSON Pointer.
    fn leaves(v: &Value, path: &mut String, out: &mut Vec<String>) {
        let len = path.len();
        match v {
            Value::Array(items) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    path.push('/');
                    path.push_str(&i.to_string());
                    leaves(item, path, out);
                    path.truncate(len);
                }
            }
            Value::Object(members) if !members.is_empty() => {
                for (k, item) in members {
                    path.push('/');
                    path.push_str(&k.replace('~', "~0").replace('/', "~1"));
                    leaves(item, path, out);
                    path.truncate(len);
                }
            }
            _ => out.push(path.clone()),
        }
    }

    /// The member digests of `v` at `pointer` as `docs/fingerprint.md` lays them out, over
    /// the reference canonicalizer's form of each scalar.
    fn documented_members(v: &Value, pointer: &str, out: &mut Vec<MemberDigest>) {
        let lp = |x: &[u8]| [&(x.len() as u64).to_be_bytes()[..], x].concat();
        let node = match v {
            Value::Object(map) => {
                let mut names: Vec<&String> = map.keys().collect();
                names.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
                let mut node = [&b"O"[..], &(names.len() as u64).to_be_bytes()].concat();
                for name in &names {
                    node.extend(lp(name.as_bytes()));
                }
                node
            }
            Value::Array(items) => [&b"A"[..], &(items.len() as u64).to_be_bytes()].concat(),
            scalar => [
                &b"S"[..],
                &lp(&serde_json_canonicalizer::to_vec(scalar).unwrap()),
            ]
            .concat(),
        };
        let short = |x: &[u8]| -> [u8; 8] { Sha256::digest(x)[..8].try_into().unwrap() };
        out.push(MemberDigest {
            pointer: short(&[&b"p"[..], &lp(pointer.as_bytes())].concat()),
            value: short(&[&b"v"[..], &lp(pointer.as_bytes()), &node].concat()),
        });
        match v {
            Value::Object(map) => {
                let mut names: Vec<&String> = map.keys().collect();
                names.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
                for name in names {
                    let escaped = name.replace('~', "~0").replace('/', "~1");
                    documented_members(&map[name.as_str()], &format!("{pointer}/{escaped}"), out);
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    documented_members(item, &format!("{pointer}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    /// A value that is different under canonicalization.
    fn mutate(v: &mut Value) {
        *v = match v.take() {
            Value::Null => Value::Bool(false),
            Value::Bool(b) => Value::Bool(!b),
            Value::Number(n) => {
                let f = n.as_f64().unwrap();
                Value::from(if f == 0.0 { 1.0 } else { -f })
            }
            Value::String(s) => Value::String(s + "x"),
            Value::Array(_) => Value::Array(vec![Value::Null]),
            Value::Object(_) => serde_json::json!({ "k": null }),
        };
    }

    proptest! {
        // No regression files: failures print the minimal input instead.
        #![proptest_config(ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn prop_the_canonical_form_and_members_are_as_documented(
            v in arb_json(),
            seed in 1u64..,
        ) {
            // The body's own writer against the reference canonicalizer, byte for byte.
            let reference = serde_json_canonicalizer::to_vec(&v).unwrap();
            let mut written = Vec::new();
            crate::jcs::write(&v, &mut written, "", &mut |_, _| {}).unwrap();
            prop_assert_eq!(
                String::from_utf8_lossy(&written),
                String::from_utf8_lossy(&reference)
            );
            // The member digests of any spelling of the body against their documented layout.
            let mut text = String::new();
            write_value(&v, &mut Rng(seed), &mut text);
            let mut expected = Vec::new();
            documented_members(&v, "", &mut expected);
            let members = fp_json(&text).members;
            if expected.len() <= MAX_MEMBERS {
                prop_assert_eq!(members.as_ref().map(Members::digests), Some(&expected[..]));
            } else {
                prop_assert!(members.is_none());
            }
            // Under a field selection: per selected pointer, its value's members.
            let mut paths = Vec::new();
            leaves(&v, &mut String::new(), &mut paths);
            let mut fields: Vec<String> = paths.into_iter().take(3).collect();
            fields.push("/not-there".into());
            fields.sort();
            let mut expected = Vec::new();
            for field in &fields {
                match v.pointer(field) {
                    Some(value) => documented_members(value, field, &mut expected),
                    None => {
                        let short = |x: &[u8]| -> [u8; 8] { Sha256::digest(x)[..8].try_into().unwrap() };
                        let lp = [&(field.len() as u64).to_be_bytes()[..], field.as_bytes()].concat();
                        expected.push(MemberDigest {
                            pointer: short(&[&b"p"[..], &lp].concat()),
                            value: short(&[&b"v"[..], &lp, b"N"].concat()),
                        });
                    }
                }
            }
            let spec = FingerprintSpec { fields: Some(fields) };
            let members = fingerprint(&req(JSON, text.as_bytes()), &spec).members;
            prop_assert_eq!(members.as_ref().map(Members::digests), Some(&expected[..]));
        }

        #[test]
        fn prop_serialization_does_not_change_the_digest(
            v in arb_json(),
            seed1 in 1u64..,
            seed2 in 1u64..,
        ) {
            let (mut t1, mut t2) = (String::new(), String::new());
            write_value(&v, &mut Rng(seed1), &mut t1);
            write_value(&v, &mut Rng(seed2), &mut t2);
            // The variants fingerprint the same as the compact, pretty and canonical forms.
            let canonical = serde_json_canonicalizer::to_string(&v).unwrap();
            let expected = fp_json(&canonical);
            for text in [t1, t2, serde_json::to_string(&v).unwrap(), serde_json::to_string_pretty(&v).unwrap()] {
                prop_assert_eq!(&fp_json(&text), &expected, "{}", text);
            }
        }

        #[test]
        fn prop_changing_one_leaf_changes_the_digest(
            v in arb_json(),
            which in any::<prop::sample::Index>(),
            seed in 1u64..,
        ) {
            let mut paths = Vec::new();
            leaves(&v, &mut String::new(), &mut paths);
            let path = which.get(&paths).clone();
            let mut changed = v.clone();
            let leaf = changed.pointer_mut(&path).unwrap();
            mutate(leaf);

            let mut text = String::new();
            write_value(&v, &mut Rng(seed), &mut text);
            let (a, b) = (fp_json(&text), fp_json(&serde_json::to_string(&changed).unwrap()));
            prop_assert_ne!(a.digest, b.digest);
            prop_assert_ne!(a.parts.body, b.parts.body);
            prop_assert_eq!(a.parts.params, b.parts.params);
            prop_assert_eq!(a.parts.query, b.parts.query);

            // With that leaf selected, the change counts; with it left out, it does not.
            let spec = |fields: Vec<String>| FingerprintSpec { fields: Some(fields) };
            let body = |x: &Value| serde_json::to_string(x).unwrap();
            let fp = |x: &Value, s: &FingerprintSpec| fingerprint(&req(JSON, body(x).as_bytes()), s);
            let selected = spec(vec![path.clone()]);
            prop_assert_ne!(fp(&v, &selected), fp(&changed, &selected));
            let other = spec(vec![format!("{path}/nothing-here"), "/not-selected~".into()]);
            prop_assert_eq!(fp(&v, &other), fp(&changed, &other));
        }
    }
}
