//! `docs/metrics.md` names exactly the metrics each process serves: a server on SQLite with
//! an outbox sink (so the outbox's families are served too) takes a payment and its replay,
//! and every family of its `/metrics`, with its type and labels, is a row of the page's
//! layer and outbox tables, and every such row is a family it serves. The gateway serves
//! the layer's and its reconciler's tables, `idemkey relay` the outbox's. The Grafana
//! dashboard's expressions name only documented metrics, and each documented one has a
//! panel.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use clap::Parser;
use http::StatusCode;
use idemkey_core::Store;
use idemkey_outbox::{Outgoing, enqueue_on};
use idemkey_server::cli::{Cli, Command as CliCommand};
use idemkey_server::gateway::GatewayOptions;
use idemkey_server::{AppDb, KeySecrets};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::Metrics;
use serde_json::Value;
use tower::ServiceExt;

use common::gateway::serve_on_own_thread;
use common::{Backend, TOKEN1, payment};

/// The sections of `docs/metrics.md` whose tables list metrics, by who serves them.
const LAYER: &str = "The idempotency layer";
const RECONCILER: &str = "The gateway's reconciler";
const OUTBOX: &str = "The outbox";

/// The content type every `/metrics` answers with.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4";

/// A metric family's type and label names (`le` left out).
type Families = BTreeMap<String, (String, BTreeSet<String>)>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The rows of `docs/metrics.md`'s tables (`` | `name` | type | `label`, … or — | meaning | ``)
/// under the `## ` headings of `sections`; every row when `sections` is empty.
fn documented_in(sections: &[&str]) -> Families {
    let text = std::fs::read_to_string(root().join("docs/metrics.md")).expect("docs/metrics.md");
    let mut section = "";
    let mut families = Families::new();
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            section = heading.trim();
            continue;
        }
        if !line.starts_with("| `idemkey_") || !(sections.is_empty() || sections.contains(&section))
        {
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`').to_owned();
        let kind = cells[2].to_owned();
        let labels = cells[3]
            .split(',')
            .map(|l| l.trim().trim_matches('`'))
            .filter(|l| !l.is_empty() && *l != "—")
            .map(str::to_owned)
            .collect();
        families.insert(name, (kind, labels));
    }
    families
}

/// Every row of `docs/metrics.md`'s tables.
fn documented() -> Families {
    documented_in(&[])
}

/// The family of a sample's series name: itself, or a histogram's `_bucket`, `_sum`, `_count`.
fn family<'a>(series: &'a str, types: &BTreeMap<String, String>) -> &'a str {
    if types.contains_key(series) {
        return series;
    }
    ["_bucket", "_sum", "_count"]
        .iter()
        .filter_map(|suffix| series.strip_suffix(suffix))
        .find(|base| types.get(*base).is_some_and(|t| t == "histogram"))
        .unwrap_or(series)
}

/// The families of a Prometheus text exposition.
fn served(text: &str) -> Families {
    let types: BTreeMap<String, String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|rest| {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
            (name.to_owned(), kind.to_owned())
        })
        .collect();
    let mut families: Families = types
        .iter()
        .map(|(name, kind)| (name.clone(), (kind.clone(), BTreeSet::new())))
        .collect();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let series = line.split([' ', '{']).next().unwrap_or_default();
        let name = family(series, &types);
        let entry = families
            .get_mut(name)
            .unwrap_or_else(|| panic!("sample {line:?} has no # TYPE line"));
        if let Some((_, labels)) = line.split_once('{') {
            let labels = labels.split_once('}').expect("closed labels").0;
            for pair in labels.split(',') {
                let key = pair.split_once('=').expect("label=value").0;
                if key != "le" {
                    entry.1.insert(key.to_owned());
                }
            }
        }
    }
    families
}

#[track_caller]
fn assert_same(documented: &Families, served: &Families) {
    let undocumented: Vec<_> = served
        .iter()
        .filter(|(name, _)| !documented.contains_key(*name))
        .collect();
    let not_served: Vec<_> = documented
        .iter()
        .filter(|(name, _)| !served.contains_key(*name))
        .collect();
    let differ: Vec<_> = served
        .iter()
        .filter_map(|(name, s)| {
            let d = documented.get(name)?;
            (d != s).then_some((name, ("documented", d), ("served", s)))
        })
        .collect();
    assert!(
        undocumented.is_empty() && not_served.is_empty() && differ.is_empty(),
        "docs/metrics.md and /metrics disagree:\n  served, not documented: {undocumented:?}\n  \
         documented, not served: {not_served:?}\n  type or labels differ: {differ:?}"
    );
}

#[tokio::test]
async fn every_served_metric_is_documented_and_every_documented_one_is_served() {
    let sink = serve_on_own_thread(Router::new().route("/hook", post(|| async { StatusCode::OK })));
    let backend = Backend::sqlite().await;
    let server = backend
        .start(&["--outbox-webhook", &format!("http://{sink}/hook")])
        .await;
    let api = server.api();
    let body = payment(500, "metrics");
    assert_eq!(api.pay_ok(TOKEN1, "metrics-1", &body).await.status, 201);
    let replay = api.pay_ok(TOKEN1, "metrics-1", &body).await;
    assert!(replay.replayed(), "the second attempt is a replay");

    let answer = api.get("/metrics", None).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), Some(PROMETHEUS_TEXT));
    assert_same(&documented_in(&[LAYER, OUTBOX]), &served(&answer.text()));

    // The two attempts are counted as the page says.
    assert_eq!(api.metric("idemkey_attempts_total").await, 2);
    for (outcome, n) in [("executed", 1), ("replayed", 1), ("mismatched", 0)] {
        let series = format!("idemkey_requests_total{{outcome=\"{outcome}\"}}");
        assert_eq!(api.metric(&series).await, n, "{series}");
    }
    assert_eq!(api.metric("idemkey_replay_cache_hits_total").await, 1);

    let health = api.get("/healthz", None).await;
    assert_eq!((health.status, health.text().as_str()), (200, "ok\n"));
}

/// The gateway (its `app`, in this process) serves the layer's families and its
/// reconciler's, each documented.
#[tokio::test]
async fn the_gateway_serves_the_layer_and_reconciler_families() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    let line = [
        "idemkey",
        "gateway",
        "--database-url",
        &url,
        "--upstream",
        "http://127.0.0.1:9",
        "--api-key",
        "t1=tok1",
    ];
    let CliCommand::Gateway(args) = Cli::try_parse_from(line).unwrap().command else {
        panic!("not a gateway command line");
    };
    let options = GatewayOptions::try_from(&args).unwrap();
    let db = SqliteStore::connect(&url).await.unwrap();
    db.migrate_all().await.unwrap();
    let secrets = KeySecrets::new(&b"metrics doc gateway secret, 32 bytes long"[..], None);
    let app = idemkey_server::gateway::app(db, &secrets, Metrics::new(), &options);
    let request = http::Request::get("/metrics").body(Body::empty()).unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()[http::header::CONTENT_TYPE],
        PROMETHEUS_TEXT
    );
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert_same(&documented_in(&[LAYER, RECONCILER]), &served(&text));
    assert!(
        text.contains("idemkey_reconciled_total{result=\"still_unknown\"} 0\n"),
        "{text}"
    );
}

/// `idemkey relay` serves `GET /metrics` on `--listen`: the outbox's families, documented,
/// counting the deliveries it makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_serves_the_outbox_families_and_counts_its_deliveries() {
    const MESSAGES: usize = 2;
    let delivered = Arc::new(AtomicUsize::new(0));
    let counter = delivered.clone();
    let sink = serve_on_own_thread(Router::new().route(
        "/hook",
        post(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { StatusCode::OK }
        }),
    ));
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("relay.db").display());
    let db = SqliteStore::connect(&url).await.unwrap();
    db.migrate_all().await.unwrap();
    for i in 0..MESSAGES {
        let mut tx = db.begin().await.unwrap();
        let message = Outgoing::new("test.metrics", &serde_json::json!({ "n": i })).unwrap();
        enqueue_on::<SqliteStore>(&mut tx, &format!("op-{i}"), message)
            .await
            .unwrap();
        db.commit(tx).await.unwrap();
    }

    let mut relay = Command::new(env!("CARGO_BIN_EXE_idemkey"));
    relay
        .args(["relay", "--database-url", &url, "--listen", "127.0.0.1:0"])
        .args(["--outbox-webhook", &format!("http://{sink}/hook")])
        .env_remove("IDEMKEY_DATABASE_URL");
    let (relay, metrics) =
        common::spawn_announcing(relay, "idemkey relay serving its metrics on http://").await;
    let metrics = metrics.expect("idemkey relay prints its metrics address");
    let address = metrics.trim_end_matches("/metrics").to_owned();

    let scrape = || async {
        let response = reqwest::get(format!("http://{address}/metrics"))
            .await
            .expect("GET /metrics of the relay");
        assert_eq!(response.status(), 200);
        let content_type = response.headers()[http::header::CONTENT_TYPE].clone();
        assert_eq!(content_type, PROMETHEUS_TEXT);
        response.text().await.unwrap()
    };
    let acknowledged =
        format!("idemkey_outbox_deliveries_total{{outcome=\"acknowledged\"}} {MESSAGES}\n");
    // A bounded poll of another process.
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = scrape().await;
        if text.contains(&acknowledged) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the relay's /metrics does not count {MESSAGES} deliveries:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drop(relay);
    assert_same(&documented_in(&[OUTBOX]), &served(&text));
    assert_eq!(delivered.load(Ordering::SeqCst), MESSAGES);
    assert!(text.contains("idemkey_outbox_deliveries_total{outcome=\"failed\"} 0\n"));
    assert!(text.contains("idemkey_outbox_deliveries_total{outcome=\"dead\"} 0\n"));
}

/// Every `expr` of the dashboard, found wherever it is nested.
fn expressions(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    _ => expressions(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_charts_every_documented_metric_and_only_those() {
    let path = root().join("docs/grafana/idemkey.json");
    let text = std::fs::read_to_string(&path).expect("docs/grafana/idemkey.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    expressions(&dashboard, &mut exprs);
    let documented = documented();
    let types: BTreeMap<String, String> = documented
        .iter()
        .map(|(name, (kind, _))| (name.clone(), kind.clone()))
        .collect();
    let mut charted = BTreeSet::new();
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("idemkey_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = family(&tail[..end], &types);
            assert!(
                documented.contains_key(name),
                "the dashboard charts {name}, which docs/metrics.md does not document: {expr}"
            );
            charted.insert(name.to_owned());
            rest = &tail[end..];
        }
    }
    let uncharted: Vec<&String> = documented
        .keys()
        .filter(|name| !charted.contains(*name))
        .collect();
    assert!(uncharted.is_empty(), "no panel charts {uncharted:?}");
}
