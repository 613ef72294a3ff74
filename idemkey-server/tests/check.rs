//! `idemkey check` against the real `idemkey serve`: every required check passes on the
//! reference payments API, and the command refuses what it must not run.

mod common;

use std::process::Command;

use idemkey_server::check::{self, CheckOptions, Level, Report, Verdict};

/// Every required check passed (or was skipped for a stated reason), exit code 0.
fn assert_all_required_pass(report: &Report) {
    let table = report.table();
    for c in &report.checks {
        if c.level == Level::Required && !skipped_by_profile(report, c.id) {
            assert_eq!(c.verdict, Verdict::Pass, "{} did not pass\n{table}", c.id);
        }
    }
    assert_eq!(report.exit_code(), 0, "{table}");
    assert!(
        report.writes_made <= report.writes_planned,
        "more writes made than planned\n{table}"
    );
}

/// `first-sent-expired` outside the oasis profile: skipped, saying so.
fn skipped_by_profile(report: &Report, id: &str) -> bool {
    report
        .check(id)
        .is_some_and(|c| c.verdict == Verdict::Skipped && c.saw == "oasis profile only")
}

/// The options against a server's payments route, as tenant `t1`, with `t2` as the other
/// caller; the payment's reference differs per key (`{{uuid}}`), and `t1`'s payments are
/// counted by the list's `total`.
fn payments(base: &str) -> CheckOptions {
    let mut options = CheckOptions::new(
        format!("{base}/v1/payments"),
        r#"{"amount": 500, "currency": "EUR", "customer": "c1", "reference": "ref-{{uuid}}"}"#,
    );
    options.headers = vec![(
        "Authorization".to_owned(),
        format!("Bearer {}", common::TOKEN1),
    )];
    options.other_caller = vec![(
        "Authorization".to_owned(),
        format!("Bearer {}", common::TOKEN2),
    )];
    options.effects = Some(format!("{base}/v1/payments?limit=1"));
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_passes_every_required_check() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let report = check::run(payments(server.base()))
        .await
        .expect("the checker runs");
    assert_all_required_pass(&report);
    for id in [
        "key-missing",
        "key-empty",
        "key-too-long",
        "key-malformed",
        "replay-same-bytes",
        "key-reused-other-body",
        "reserialized-body",
        "race-one-execution",
        "in-flight",
        "lost-response",
        "scope",
        "advertised",
        "first-sent-expired",
    ] {
        assert_eq!(
            report.checks.iter().filter(|c| c.id == id).count(),
            1,
            "{id}\n{}",
            report.table()
        );
    }
    // The re-serialized body is the same request to serve (its fingerprint is of the JSON).
    assert_eq!(
        report.check("reserialized-body").map(|c| c.verdict),
        Some(Verdict::Pass)
    );
    // The JSON and JUnit renderings say the same.
    let json = report.to_json();
    assert_eq!(json["exit_code"], 0);
    assert_eq!(
        json["checks"].as_array().map(Vec::len),
        Some(report.checks.len())
    );
    let junit = report.junit_xml();
    assert!(junit.contains("failures=\"0\""), "{junit}");
}

/// Without `--effects`, the answers tell one execution from two; a lost response whose retry
/// executes afresh (the first attempt rolled back with its connection) cannot be told from a
/// second execution, and is skipped, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_passes_without_effects() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let mut options = payments(server.base());
    options.effects = None;
    let report = check::run(options).await.expect("the checker runs");
    let table = report.table();
    for c in &report.checks {
        if c.level == Level::Required
            && c.id != "lost-response"
            && !skipped_by_profile(&report, c.id)
        {
            assert_eq!(c.verdict, Verdict::Pass, "{} did not pass\n{table}", c.id);
        }
    }
    let lost = report.check("lost-response").expect("lost-response");
    assert!(
        matches!(lost.verdict, Verdict::Pass | Verdict::Skipped),
        "{table}"
    );
    assert_eq!(report.exit_code(), 0, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_passes_under_the_oasis_profile_with_first_sent_required() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&["--first-sent", "optional"]).await;
    let mut options = payments(server.base());
    options.profile = check::Profile::Oasis;
    let report = check::run(options).await.expect("the checker runs");
    assert_eq!(
        report.check("first-sent-expired").map(|c| c.verdict),
        Some(Verdict::Pass),
        "{}",
        report.table()
    );
    assert_all_required_pass(&report);
}

/// The gateway in front of an upstream that executes every request it gets (a fresh
/// transfer id each time): the contract is the gateway's alone, with its default lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_passes_every_required_check() {
    let upstream = common::gateway::Upstream::start();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database_url = format!("sqlite:{}", dir.path().join("g.db").display());
    let gateway = common::gateway::Gateway::start(
        &database_url,
        &upstream.base,
        dir.path(),
        &[
            "--api-key",
            "t2=tok2",
            "--route",
            "POST /v1/*",
            "--reconcile-url",
            &upstream.reconcile_url(),
            "--reconcile-interval",
            "100ms",
        ],
    )
    .await;
    let mut options = payments(&gateway.base);
    options.url = format!("{}/v1/transfers", gateway.base);
    options.body = r#"{"amount": 500, "to": "acct_{{uuid}}"}"#.to_owned();
    options.effects = None;
    // The upstream counts by the key it is forwarded, which the gateway does not scope by
    // caller: without `scope`, each key the upstream saw must have run once.
    options.other_caller.clear();
    let report = check::run(options).await.expect("the checker runs");
    let table = report.table();
    for c in &report.checks {
        if c.level == Level::Required {
            assert_ne!(c.verdict, Verdict::Fail, "{} failed\n{table}", c.id);
        }
    }
    assert_eq!(report.exit_code(), 0, "{table}");
    // Every 2xx of the run came from one execution per key: the upstream ran each key once.
    let (most, _) = upstream.effect_counts();
    assert_eq!(most, 1, "an upstream key ran more than once\n{table}");
}

/// Under `stripe`, a missing key is a fact (keys are optional there), not a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_passes_under_the_stripe_profile() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let mut options = payments(server.base());
    options.profile = check::Profile::Stripe;
    let report = check::run(options).await.expect("the checker runs");
    let missing = report.check("key-missing").expect("key-missing");
    assert_eq!(
        (missing.level, missing.verdict),
        (Level::Advisory, Verdict::Info)
    );
    assert_all_required_pass(&report);
}

/// The command prints its plan and the table, writes the JSON and JUnit reports, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_writes_its_reports_and_exits_0() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (json, junit) = (dir.path().join("check.json"), dir.path().join("check.xml"));
    let url = format!("{}/v1/payments", server.base());
    let auth = format!("Authorization: Bearer {}", common::TOKEN1);
    let other = format!("Authorization: Bearer {}", common::TOKEN2);
    let args = [
        url.as_str(),
        "--body",
        r#"{"amount": 500, "currency": "EUR", "customer": "c1", "reference": "ref-{{uuid}}"}"#,
        "--header",
        &auth,
        "--other-caller",
        &other,
        "--json",
        json.to_str().expect("a UTF-8 path"),
        "--junit",
        junit.to_str().expect("a UTF-8 path"),
    ]
    .map(str::to_owned);
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        run_cli(&args.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await
    .expect("the command ran");
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.starts_with(&format!("idemkey check: 30 writes planned against {url}\n")),
        "{stdout}"
    );
    assert!(stdout.contains("replay-same-bytes"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON report"))
            .expect("JSON");
    assert_eq!(report["exit_code"], 0);
    assert_eq!(report["writes_planned"], 30);
    let xml = std::fs::read_to_string(&junit).expect("the JUnit report");
    assert!(
        xml.contains("<testcase classname=\"idemkey.check.required\" name=\"scope\">"),
        "{xml}"
    );
}

/// `idemkey check` with `args`: its exit code and stderr.
fn run_cli(args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .arg("check")
        .args(args)
        .output()
        .expect("run idemkey check");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_non_loopback_target_without_yes_exits_2() {
    // 192.0.2.0/24 is TEST-NET-1: nothing is sent, the refusal comes first.
    let (code, stdout, stderr) = run_cli(&["http://192.0.2.1/v1/payments", "--body", r#"{"a":1}"#]);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("error: non-loopback target 192.0.2.1 without --yes"),
        "{stderr}"
    );
}

#[test]
fn too_small_a_max_writes_exits_2_naming_the_plan() {
    let (code, stdout, stderr) = run_cli(&[
        "http://127.0.0.1:9/v1/payments",
        "--body",
        r#"{"a":1}"#,
        "--max-writes",
        "5",
    ]);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("the checks need 29 writes, --max-writes allows 5"),
        "{stderr}"
    );
}

#[test]
fn a_body_that_is_not_json_exits_2() {
    let (code, stdout, stderr) = run_cli(&["http://127.0.0.1:9/v1/payments", "--body", "{"]);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("error: bad arguments: --body is not JSON"),
        "{stderr}"
    );
}

#[test]
fn an_unreachable_target_exits_2() {
    // Port 9 (discard) on loopback: nothing listens there in the test environment.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let url = format!("http://127.0.0.1:{port}/v1/payments");
    let (code, stdout, stderr) = run_cli(&[&url, "--body", r#"{"a":1}"#]);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stdout.starts_with("idemkey check: 29 writes planned against "),
        "{stdout}"
    );
    assert!(stderr.contains("error: unreachable:"), "{stderr}");
}
