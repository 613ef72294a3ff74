//! Benchmarks of [`fingerprint()`] on the payment body `idemkey bench` sends and on JSON
//! bodies of 1 KiB and 64 KiB.
//!
//! `cargo bench -p idemkey-core --bench fingerprint`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use idemkey_core::{FingerprintSpec, RequestParts, fingerprint};

/// A realistic payment-like JSON body of at least `target` bytes (within a few hundred).
fn json_body(target: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut i = 0u64;
    loop {
        items.push(serde_json::json!({
            "sku": format!("SKU-{i:06}"),
            "description": "Blue widget, größe M — 10% off",
            "quantity": i % 7 + 1,
            "unit_price": 12.5 + i as f64 / 100.0,
            "tags": ["a", "b", i.to_string()],
            "gift": i.is_multiple_of(3),
        }));
        let body = serde_json::to_vec_pretty(&serde_json::json!({
            "currency": "EUR",
            "customer": { "id": "cus_123", "email": "a@example.com" },
            "metadata": { "order": "o_42", "note": null },
            "items": items,
        }))
        .unwrap();
        if body.len() >= target {
            return body;
        }
        i += 1;
    }
}

fn bench_fingerprint(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    let spec = FingerprintSpec::default();
    let fields = FingerprintSpec {
        fields: Some(vec!["/currency".into(), "/customer/id".into()]),
    };
    let payment =
        br#"{"amount":1042,"currency":"EUR","customer":"bench-1042","description":"load test"}"#;
    for (label, body) in [
        ("payment", payment.to_vec()),
        ("1KiB", json_body(1024)),
        ("64KiB", json_body(64 * 1024)),
    ] {
        group.throughput(Throughput::Bytes(body.len() as u64));
        let req = RequestParts {
            method: "POST",
            route: "/v1/orders/{id}",
            path_params: &[("id", "o_42")],
            query: Some("expand=items&dry_run=false"),
            content_type: Some("application/json; charset=utf-8"),
            body: &body,
        };
        group.bench_with_input(BenchmarkId::new("json", label), &req, |b, req| {
            b.iter(|| fingerprint(black_box(req), &spec))
        });
        group.bench_with_input(BenchmarkId::new("json_fields", label), &req, |b, req| {
            b.iter(|| fingerprint(black_box(req), &fields))
        });
        let raw = RequestParts {
            content_type: Some("application/octet-stream"),
            ..req.clone()
        };
        group.bench_with_input(BenchmarkId::new("raw", label), &raw, |b, req| {
            b.iter(|| fingerprint(black_box(req), &spec))
        });
    }
    group.finish();
}

/// The benchmark group; `criterion_group!` generates an undocumented `pub fn`.
mod group {
    #![allow(missing_docs, unreachable_pub)]
    criterion::criterion_group!(benches, super::bench_fingerprint);
}

criterion_main!(group::benches);
