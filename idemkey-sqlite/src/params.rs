//! The values of the protocol's statements, each statement's built in one place and bound by
//! either driver (`driver.rs`): a record's twelve, a completion's eight.

use idemkey_core::{Members, NewRecord, RecordId, StoredResponse, Timestamp};

/// One bound value, borrowed from the caller where it can be: binding it copies nothing
/// that the driver does not copy anyway.
#[derive(Debug, Clone)]
pub(crate) enum Value<'a> {
    Null,
    Int(i64),
    Text(&'a str),
    Bytes(&'a [u8]),
    /// Bytes made for the statement (encoded headers, members), moved into the driver.
    Owned(Vec<u8>),
    /// A fingerprint's parts, made for the statement.
    Parts([u8; 24]),
}

impl Value<'_> {
    fn opt_int(n: Option<i64>) -> Self {
        n.map_or(Value::Null, Value::Int)
    }
}

/// A record's values, `?1`–`?12` of the claim's `INSERT` and of `REPLACE`: tenant, key hash,
/// route, fingerprint, its parts, state, lease, now, expiry, sealed key, members, first sent.
pub(crate) fn record(r: &NewRecord) -> [Value<'_>; 12] {
    [
        Value::Text(&r.id.tenant),
        Value::Bytes(&r.id.key_hash),
        Value::Text(&r.id.route),
        Value::Bytes(&r.fingerprint.digest),
        Value::Parts(r.fingerprint.parts.to_bytes()),
        Value::Text(r.state.as_str()),
        Value::opt_int(r.lease_expires_at.map(Timestamp::as_millis)),
        Value::Int(r.now.as_millis()),
        Value::Int(r.expires_at.as_millis()),
        r.sealed_key.as_deref().map_or(Value::Null, Value::Bytes),
        r.fingerprint
            .members
            .as_ref()
            .map_or(Value::Null, |m| Value::Owned(Members::to_bytes(m))),
        Value::opt_int(r.first_sent.map(Timestamp::as_millis)),
    ]
}

/// The fourteen columns a claim's `INSERT` writes, in the order it names them: the record's
/// values with its token, and `now` as both creation and update time. For the statements that
/// write whole rows (a group's `INSERT`, the claim written as literals).
pub(crate) fn inserted_row(r: &NewRecord) -> [Value<'_>; 14] {
    let [
        tenant,
        key,
        route,
        fp,
        parts,
        state,
        lease,
        now,
        expires,
        sealed,
        members,
        first,
    ] = record(r);
    [
        tenant,
        key,
        route,
        fp,
        parts,
        state,
        Value::Int(r.token),
        lease,
        now.clone(),
        now,
        expires,
        sealed,
        members,
        first,
    ]
}

/// `INSERT`'s values: the record's, then the token it starts at (`?13`).
pub(crate) fn insert(r: &NewRecord) -> [Value<'_>; 13] {
    let [a, b, c, d, e, f, g, h, i, j, k, l] = record(r);
    [a, b, c, d, e, f, g, h, i, j, k, l, Value::Int(r.token)]
}

/// `REPLACE`'s values: the record's, then the token it must still carry (`?13`).
pub(crate) fn replace(r: &NewRecord, token: i64) -> [Value<'_>; 13] {
    let [a, b, c, d, e, f, g, h, i, j, k, l] = record(r);
    [a, b, c, d, e, f, g, h, i, j, k, l, Value::Int(token)]
}

/// A record's key, `?1`–`?3` of every statement on one record.
pub(crate) fn id(id: &RecordId) -> [Value<'_>; 3] {
    [
        Value::Text(&id.tenant),
        Value::Bytes(&id.key_hash),
        Value::Text(&id.route),
    ]
}

/// The key and the owner's token, `?1`–`?4`, then `rest`.
pub(crate) fn owned<'a, const N: usize, const M: usize>(
    record: &'a RecordId,
    token: i64,
    rest: [i64; N],
) -> [Value<'a>; M] {
    const { assert!(M == N + 4, "the key, the token and the rest") };
    let [tenant, key, route] = id(record);
    let mut head = [tenant, key, route, Value::Int(token)].into_iter();
    std::array::from_fn(|i| match head.next() {
        Some(v) => v,
        None => Value::Int(rest[i - 4]),
    })
}

/// A completion's values, `?1`–`?8` of its `UPDATE`: the key, the owner's token, then the
/// response's status, encoded headers and body, and the time.
pub(crate) fn completion<'a>(
    record: &'a RecordId,
    token: i64,
    response: &'a StoredResponse,
    now: Timestamp,
) -> [Value<'a>; 8] {
    let [tenant, key, route] = id(record);
    [
        tenant,
        key,
        route,
        Value::Int(token),
        Value::Int(i64::from(response.status)),
        Value::Owned(response.encode_headers()),
        Value::Bytes(&response.body),
        Value::Int(now.as_millis()),
    ]
}
