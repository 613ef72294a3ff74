//! `idemkey check` is tested by what it catches: the correct reference server passes the
//! required checks, and each flawed server fails the check named for its flaw, for its own
//! reason, with exit code 1.

mod common;

use idemkey_server::check::{self, CheckOptions, Level, Report, Verdict};

use self::common::flawed::{self, Flaw};

/// The order every check writes.
const BODY: &str = r#"{"item":"book","qty":1}"#;

/// Runs the checker against the server with `flaw`, counting its executions at `/effects`
/// when `effects`, else telling them apart by the answers' bodies.
async fn check(flaw: Flaw, effects: bool) -> Report {
    let base = flawed::start(flaw).await;
    let mut options = CheckOptions::new(format!("{base}/orders"), BODY);
    options.headers = vec![("Authorization".into(), "Bearer a".into())];
    options.other_caller = vec![("Authorization".into(), "Bearer b".into())];
    options.race = 8;
    options.max_writes = 200;
    options.effects = effects.then(|| format!("{base}/effects"));
    match check::run(options).await {
        Ok(report) => report,
        Err(e) => panic!("{flaw:?}: the checker did not run: {e}"),
    }
}

/// The report fails the run, and the check `id` fails in it.
fn assert_caught(flaw: Flaw, report: &Report, id: &str) {
    let table = report.table();
    let verdict = report.check(id).map(|c| c.verdict);
    assert_eq!(
        verdict,
        Some(Verdict::Fail),
        "{flaw:?}: {id} did not fail\n{table}"
    );
    assert_eq!(report.exit_code(), 1, "{flaw:?}: exit code\n{table}");
}

/// Every required check passes (or is skipped), and the exit code says so.
fn assert_passes(report: &Report) {
    let table = report.table();
    for c in &report.checks {
        if c.level == Level::Required {
            assert!(
                matches!(c.verdict, Verdict::Pass | Verdict::Skipped),
                "{}: {:?}\n{table}",
                c.id,
                c.verdict
            );
        }
    }
    assert_eq!(report.exit_code(), 0, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_server_passes_the_required_checks_with_effects() {
    assert_passes(&check(Flaw::Correct, true).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_server_passes_the_required_checks_by_bodies() {
    assert_passes(&check(Flaw::Correct, false).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_then_insert_fails_race_one_execution() {
    let flaw = Flaw::CheckThenInsert;
    assert_caught(flaw, &check(flaw, true).await, "race-one-execution");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replay_fails_replay_same_bytes() {
    let flaw = Flaw::NoReplay;
    assert_caught(flaw, &check(flaw, false).await, "replay-same-bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fingerprint_fails_key_reused_other_body() {
    let flaw = Flaw::NoFingerprint;
    assert_caught(flaw, &check(flaw, true).await, "key-reused-other-body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_other_bytes_fails_replay_same_bytes() {
    let flaw = Flaw::ReplayOtherBytes;
    assert_caught(flaw, &check(flaw, false).await, "replay-same-bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_while_in_flight_fails_in_flight() {
    let flaw = Flaw::RunsWhileInFlight;
    assert_caught(flaw, &check(flaw, true).await, "in-flight");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_keys_fail_scope() {
    let flaw = Flaw::SharedKeys;
    assert_caught(flaw, &check(flaw, false).await, "scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_key_fails_key_missing() {
    let flaw = Flaw::KeyOptional;
    assert_caught(flaw, &check(flaw, true).await, "key-missing");
}
