//! RFC 8785 (JCS) test vectors.
//!
//! Each vector is checked twice: the reference canonicalizer the fingerprint's own writer
//! is held to (`serde_json` + `serde_json_canonicalizer`, see `fingerprint.rs`'s property
//! test) must produce the expected bytes exactly, and
//! [`fingerprint()`] of the input must equal an independent reimplementation of the byte
//! layout in `docs/fingerprint.md` over those expected bytes, which proves that the
//! fingerprint hashes exactly the canonical form.

use idemkey_core::{FINGERPRINT_VERSION, FingerprintSpec, RequestParts, fingerprint};
use sha2::{Digest, Sha256};

/// Canonicalizes a JSON text with the reference canonicalizer.
fn jcs(input: &[u8]) -> Vec<u8> {
    let value: serde_json::Value = serde_json::from_slice(input).expect("valid JSON");
    serde_json_canonicalizer::to_vec(&value).expect("canonicalizable")
}

fn lp(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// The digest `docs/fingerprint.md` specifies for `POST /jcs`, no path parameters, no
/// query, `Content-Type: application/json` and a body whose canonical form is `canonical`.
fn documented_digest(canonical: &[u8]) -> [u8; 32] {
    let mut method = b"M".to_vec();
    lp(&mut method, b"POST");
    let mut route = b"R".to_vec();
    lp(&mut route, b"/jcs");
    let params = [&b"P"[..], &0u64.to_be_bytes()].concat();
    let query = [&b"Q"[..], &0u64.to_be_bytes()].concat();
    let mut body = b"B".to_vec();
    lp(&mut body, b"application/json");
    body.push(b'J');
    lp(&mut body, canonical);

    let mut all = vec![FINGERPRINT_VERSION];
    for part in [&method, &route, &params, &query, &body] {
        lp(&mut all, part);
    }
    Sha256::digest(&all).into()
}

fn fingerprint_digest(body: &[u8]) -> [u8; 32] {
    let req = RequestParts {
        method: "POST",
        route: "/jcs",
        path_params: &[],
        query: None,
        content_type: Some("application/json"),
        body,
    };
    fingerprint(&req, &FingerprintSpec::default()).digest
}

#[track_caller]
fn check(name: &str, input: &[u8], expected: &[u8]) {
    let got = jcs(input);
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(expected),
        "{name}: canonical text"
    );
    assert_eq!(got, expected, "{name}: canonical bytes");
    assert_eq!(
        jcs(expected),
        expected,
        "{name}: canonical form is a fixed point"
    );
    assert_eq!(
        fingerprint_digest(input),
        documented_digest(expected),
        "{name}: fingerprint() hashes exactly the canonical bytes"
    );
}

fn unhex(hex: &str) -> Vec<u8> {
    hex.split_whitespace()
        .map(|h| u8::from_str_radix(h, 16).expect("hex byte"))
        .collect()
}

#[test]
fn rfc_example_sections_3_2_2_to_3_2_4() {
    let input = include_bytes!("data/jcs/rfc_example.input.json");
    let expected = include_bytes!("data/jcs/rfc_example.expected.json");
    assert_eq!(
        std::str::from_utf8(expected).unwrap(),
        r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
    );
    check("rfc_example", input, expected);
    // Section 3.2.4: the UTF-8 bytes of the result.
    let utf8 = unhex(
        "7b 22 6c 69 74 65 72 61 6c 73 22 3a 5b 6e 75 6c 6c 2c 74 72 \
         75 65 2c 66 61 6c 73 65 5d 2c 22 6e 75 6d 62 65 72 73 22 3a \
         5b 33 33 33 33 33 33 33 33 33 2e 33 33 33 33 33 33 33 2c 31 \
         65 2b 33 30 2c 34 2e 35 2c 30 2e 30 30 32 2c 31 65 2d 32 37 \
         5d 2c 22 73 74 72 69 6e 67 22 3a 22 e2 82 ac 24 5c 75 30 30 \
         30 66 5c 6e 41 27 42 5c 22 5c 5c 5c 5c 5c 22 2f 22 7d",
    );
    assert_eq!(jcs(input), utf8);
}

#[test]
fn rfc_sorting_example_section_3_2_3() {
    let input = include_bytes!("data/jcs/rfc_sorting.input.json");
    let expected = include_bytes!("data/jcs/rfc_sorting.expected.json");
    // Sorted by UTF-16 code units: "\r" < "1" < U+0080 < "ö" < "€" < U+1F600 (D83D DE00) < U+FB33.
    assert_eq!(
        std::str::from_utf8(expected).unwrap(),
        "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
         \"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\
         \"😀\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
    );
    check("rfc_sorting", input, expected);
}

macro_rules! reference_testdata {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let name = stringify!($name);
                let input = include_bytes!(concat!("data/jcs/input/", stringify!($name), ".json"));
                let output = include_bytes!(concat!("data/jcs/output/", stringify!($name), ".json"));
                let outhex = include_str!(concat!("data/jcs/outhex/", stringify!($name), ".txt"));
                assert_eq!(unhex(outhex), output, "{name}: output and outhex agree");
                check(name, input, output);
            }
        )*
    };
}

reference_testdata!(arrays, french, structures, unicode, values, weird);

/// RFC 8785 Appendix B: IEEE 754 double (as hex bits) → canonical JSON number.
const APPENDIX_B: &[(u64, &str)] = &[
    (0x0000000000000000, "0"),
    (0x8000000000000000, "0"), // minus zero
    (0x0000000000000001, "5e-324"),
    (0x8000000000000001, "-5e-324"),
    (0x7fefffffffffffff, "1.7976931348623157e+308"),
    (0xffefffffffffffff, "-1.7976931348623157e+308"),
    (0x4340000000000000, "9007199254740992"),
    (0xc340000000000000, "-9007199254740992"),
    (0x4430000000000000, "295147905179352830000"),
    (0x44b52d02c7e14af5, "9.999999999999997e+22"),
    (0x44b52d02c7e14af6, "1e+23"),
    (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
    (0x444b1ae4d6e2ef4e, "999999999999999700000"),
    (0x444b1ae4d6e2ef4f, "999999999999999900000"),
    (0x444b1ae4d6e2ef50, "1e+21"),
    (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
    (0x3eb0c6f7a0b5ed8d, "0.000001"),
    (0x41b3de4355555553, "333333333.3333332"),
    (0x41b3de4355555554, "333333333.33333325"),
    (0x41b3de4355555555, "333333333.3333333"),
    (0x41b3de4355555556, "333333333.3333334"),
    (0x41b3de4355555557, "333333333.33333343"),
    (0xbecbf647612f3696, "-0.0000033333333333333333"),
    (0x43143ff3c1cb0959, "1424953923781206.2"), // round to even
];

#[test]
fn appendix_b_number_serialization() {
    for &(bits, expected) in APPENDIX_B {
        let f = f64::from_bits(bits);
        assert_eq!(
            serde_json_canonicalizer::to_string(&f).unwrap(),
            expected,
            "{bits:#018x}"
        );
        // The same double spelled in several ways in a JSON body.
        for text in [
            format!("{f:e}"),
            format!("{f:E}"),
            format!("{f}"),
            format!("{f:?}"),
            expected.to_owned(),
        ] {
            check(
                &format!("{bits:#018x} as {text}"),
                text.as_bytes(),
                expected.as_bytes(),
            );
            let in_array = format!("[ {text} ]");
            check(
                &in_array,
                in_array.as_bytes(),
                format!("[{expected}]").as_bytes(),
            );
        }
    }
}

#[test]
fn appendix_b_nan_and_infinity_are_errors() {
    for bits in [
        0x7fffffffffffffff_u64,
        0x7ff0000000000000,
        0xfff0000000000000,
    ] {
        let f = f64::from_bits(bits);
        assert!(
            serde_json_canonicalizer::to_vec(&f).is_err(),
            "{bits:#018x}"
        );
    }
    // Not JSON numbers at all: the fingerprint falls back to raw bytes, without panicking.
    for body in ["NaN", "Infinity", "-Infinity", "1e400"] {
        let digest = fingerprint_digest(body.as_bytes());
        assert_ne!(digest, documented_digest(body.as_bytes()), "{body}");
    }
}

/// The documented limit: without `serde_json/arbitrary_precision` every number is an IEEE
/// double, so integers beyond 2^53 collapse onto their nearest double (as in ECMAScript).
#[test]
fn integers_beyond_2_pow_53_lose_precision() {
    check("2^53 + 1", b"9007199254740993", b"9007199254740992");
    check("-(2^53 + 1)", b"-9007199254740993", b"-9007199254740992");
    check("u64::MAX", b"18446744073709551615", b"18446744073709552000");
    check("i64::MIN", b"-9223372036854775808", b"-9223372036854776000");
    check(
        "beyond u64",
        b"123456789012345678901234567890",
        b"1.2345678901234568e+29",
    );
    assert_eq!(
        fingerprint_digest(br#"{"id":9007199254740993}"#),
        fingerprint_digest(br#"{"id":9007199254740992}"#)
    );
    // Up to 2^53 integers are exact.
    check("2^53 - 1", b"9007199254740991", b"9007199254740991");
    assert_ne!(
        fingerprint_digest(br#"{"id":9007199254740991}"#),
        fingerprint_digest(br#"{"id":9007199254740992}"#)
    );
}
