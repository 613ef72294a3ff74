use idemkey_core::RecordState;
use idemkey_testkit::conformance::{claim_at, record_id, response};
use proptest::prelude::*;

use super::*;

fn text(value: &str) -> String {
    let mut sql = Sql::default();
    sql.text(value).expect("text");
    sql.finish()
}

/// Reads an escape string literal (`E'…'`) back as PostgreSQL reads it: `None` unless `sql`
/// is exactly one literal (it ends where `sql` ends) whose escapes are the two this crate
/// writes (`\\`, `''`). Any other backslash escape (`\n`, `\x41`, `\'`) is `None`.
fn read_text(sql: &str) -> Option<String> {
    let mut chars = sql.strip_prefix("E'")?.chars();
    let mut out = String::new();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                '\\' => out.push('\\'),
                _ => return None,
            },
            '\'' => match chars.next() {
                Some('\'') => out.push('\''),
                Some(_) => return None,
                None => return Some(out),
            },
            c => out.push(c),
        }
    }
    None
}

/// Text rich in what could end or bend a literal: quotes, backslashes, `$`, digits.
fn tricky_text() -> impl Strategy<Value = String> {
    let c = prop_oneof![
        Just('\''),
        Just('\\'),
        Just('$'),
        Just('E'),
        Just('x'),
        Just(';'),
        prop::char::range('0', '9'),
        any::<char>().prop_filter("no NUL", |c| *c != '\0'),
    ];
    prop::collection::vec(c, 0..48).prop_map(String::from_iter)
}

proptest! {
    #[test]
    fn any_text_reads_back_as_written(value in tricky_text()) {
        prop_assert_eq!(read_text(&text(&value)), Some(value));
    }

    #[test]
    fn any_text_without_nul_reads_back(value in "[^\u{0}]*") {
        prop_assert_eq!(read_text(&text(&value)), Some(value));
    }

    #[test]
    fn text_with_nul_is_refused(a in tricky_text(), b in tricky_text()) {
        let value = format!("{a}\0{b}");
        prop_assert!(Sql::default().text(&value).is_err());
    }

    #[test]
    fn any_bytes_read_back_as_hex(value in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut sql = Sql::default();
        sql.bytes(&value);
        let sql = sql.finish();
        let literal = sql.strip_suffix("::bytea").expect("a bytea cast");
        let read = read_text(literal).expect("one literal");
        let hex = read.strip_prefix("\\x").expect("hex format");
        prop_assert_eq!(hex::decode(hex).expect("hex digits"), value);
    }

    #[test]
    fn any_integer_reads_back(value in any::<i64>()) {
        let mut sql = Sql::default();
        value.write(&mut sql).expect("integer");
        let sql = sql.finish();
        let read = if value == i64::MIN {
            prop_assert_eq!(&sql, "(-9223372036854775807 - 1)");
            i64::MIN
        } else if value < 0 {
            let inner = sql.strip_prefix('(').and_then(|s| s.strip_suffix(')'));
            inner.expect("a negative one in parentheses").parse().expect("digits")
        } else {
            sql.parse().expect("digits")
        };
        prop_assert_eq!(read, value);
    }

    /// A value is written where its placeholder is and never read for placeholders itself.
    #[test]
    fn values_are_not_read_for_placeholders(a in tricky_text(), b in tricky_text()) {
        let sent = query("SELECT $2, $1").bind(a.as_str()).bind(b.as_str()).text();
        prop_assert_eq!(sent.expect("text"), format!("SELECT {}, {}", text(&b), text(&a)));
    }

    /// Arguments are written in order, `, ` between them, each one literal.
    #[test]
    fn arguments_read_back_in_order(values in prop::collection::vec(tricky_text(), 1..6)) {
        let args = values
            .iter()
            .fold(Args::after(Sql::new("f(")), |args, v| args.bind(v.as_str()));
        let sql = args.finish().expect("values").finish();
        let expected: Vec<String> = values.iter().map(|v| text(v)).collect();
        prop_assert_eq!(sql, format!("f({}", expected.join(", ")));
    }
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
    let args = Args::after(Sql::default())
        .bind(&[0, 0x27, 0x5c, 0xff][..])
        .bind(None::<&[u8]>)
        .bind(Some(-5i64))
        .bind(None::<i64>);
    let sql = args.finish().expect("values").finish();
    assert_eq!(sql, r"E'\\x00275cff'::bytea, NULL, (-5), NULL");
}

#[test]
fn statement_values_replace_their_placeholders() {
    let text = query("SELECT $1, $10, $2 WHERE x = $1 AND y >= $3 AND z = $4")
        .bind("it's")
        .bind(None::<i64>)
        .bind(i64::MIN)
        .bind(Array(vec![Some(-5i64), None]))
        .bind(5i64)
        .bind(6i64)
        .bind(7i64)
        .bind(8i64)
        .bind(9i64)
        .bind(&b"\x01"[..])
        .text()
        .expect("text");
    assert_eq!(
        text,
        concat!(
            r"SELECT E'it''s', E'\\x01'::bytea, NULL WHERE x = E'it''s' ",
            "AND y >= (-9223372036854775807 - 1) AND z = ARRAY[(-5), NULL]"
        )
    );
}

#[test]
fn a_statement_with_a_value_postgres_refuses_is_not_sent() {
    assert!(query("SELECT $1").bind("a\0b").text().is_err());
    assert!(query("SELECT $2").bind(1i64).text().is_err());
}

/// A reservation of `key`, every optional value set but the sealed key when `sealed` is
/// `None`.
fn record(key: &str, sealed: Option<&[u8]>) -> NewRecord {
    let now = Timestamp(1_700_000_000_000);
    let claim = claim_at(&record_id("t'1", "/v1/transfers", key), 1, now);
    NewRecord {
        id: claim.id,
        fingerprint: claim.fingerprint,
        state: RecordState::Executing,
        token: 7,
        lease_expires_at: Some(now.plus(Duration::from_secs(30))),
        now,
        expires_at: now.plus(Duration::from_secs(3600)),
        sealed_key: sealed.map(<[u8]>::to_vec),
        first_sent: Some(Timestamp(1_699_999_999_000)),
    }
}

/// `r`'s values as a statement's parameters, one literal each.
fn record_values(r: &NewRecord) -> Vec<String> {
    let each = "$1\n$2\n$3\n$4\n$5\n$6\n$7\n$8\n$9\n$10\n$11\n$12\n$13";
    let text = bind_new_record(query(each), r).text().expect("text");
    text.split('\n').map(str::to_owned).collect()
}

#[test]
fn a_record_is_written_alike_as_parameters_arguments_and_columns() {
    let a = record("k1", Some(b"sealed"));
    let b = record("k2", None);
    let (a_values, b_values) = (record_values(&a), record_values(&b));
    assert_eq!(a_values.len(), 13);
    assert_eq!(a_values[12], "7", "the token the record starts at");
    assert_eq!(b_values[9], "NULL", "no sealed key");

    let claim = claim(Sql::new("BEGIN"), &a).expect("claim");
    let arguments = a_values.join(", ");
    assert_eq!(
        claim,
        format!("BEGIN; EXECUTE idemkey_claim_v3({arguments})")
    );

    let columns = [&a, &b].into_iter().fold(Columns::default(), |columns, r| {
        bind_new_record(columns.row(), r)
    });
    let each = "$1\n$2\n$3\n$4\n$5\n$6\n$7\n$8\n$9\n$10\n$11\n$12\n$13";
    let sent = columns.bind_to(query(each)).expect("columns").text();
    let expected: Vec<String> = (a_values.iter().zip(&b_values))
        .map(|(a, b)| format!("ARRAY[{a}, {b}]"))
        .collect();
    assert_eq!(sent.expect("text"), expected.join("\n"));
}

#[test]
fn a_completion_is_written_alike_as_parameters_and_arguments() {
    let id = record_id("t'1", "/v1/transfers", "k1");
    let (response, now) = (response("done"), Timestamp(1_700_000_000_000));
    let parameters = "$1, $2, $3, $4, $5, $6, $7, $8";
    let values = bind_completion(query(parameters), &id, 7, &response, now).text();
    let sent = completion(&id, 7, &response, now).expect("completion");
    let values = values.expect("text");
    assert_eq!(sent, format!("EXECUTE idemkey_complete_v1({values})"));
}

#[test]
fn a_value_postgres_refuses_fails_the_claim_and_the_columns() {
    let mut r = record("k1", None);
    r.id.route = "/v1/\0".to_owned();
    assert!(claim(Sql::new("BEGIN"), &r).is_err());
    let columns = bind_new_record(Columns::default().row(), &r);
    assert!(columns.bind_to(query("$1")).is_err());
}
