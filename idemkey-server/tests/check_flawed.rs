//! `idemkey check` is tested by what it catches: the correct reference server passes the
//! required checks, and each flawed server fails the check named for its flaw, for its own
//! reason, with exit code 1.

mod common;

use idemkey_server::check::{self, CheckOptions, Level, Profile, Report, Verdict};

use self::common::flawed::{self, Flaw};

/// The order every check writes.
const BODY: &str = r#"{"item":"book","qty":1}"#;

/// Runs the checker against the server with `flaw`, counting its executions at `/effects`
/// when `effects`, else telling them apart by the answers' bodies.
async fn check(flaw: Flaw, effects: bool) -> Report {
    check_under(flaw, effects, Profile::Ietf).await
}

/// [`check`] under `profile`.
async fn check_under(flaw: Flaw, effects: bool, profile: Profile) -> Report {
    let base = flawed::start(flaw).await;
    let mut options = CheckOptions::new(format!("{base}/orders"), BODY);
    options.headers = vec![("Authorization".into(), "Bearer a".into())];
    options.other_caller = vec![("Authorization".into(), "Bearer b".into())];
    options.race = 8;
    options.max_writes = 200;
    options.effects = effects.then(|| format!("{base}/effects"));
    options.profile = profile;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_as_conflict_fails_replay_same_bytes() {
    let flaw = Flaw::ReplayAsConflict;
    assert_caught(flaw, &check(flaw, false).await, "replay-same-bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_while_in_flight_passes_the_required_checks() {
    let report = check(Flaw::LockedWhileInFlight, true).await;
    assert_passes(&report);
    let saw = |id| report.check(id).map(|c| c.saw.clone()).unwrap_or_default();
    assert!(
        saw("race-one-execution").contains("× 423"),
        "{}",
        report.table()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_keys_pass_under_ietf_as_a_fact() {
    let report = check(Flaw::LongKeysAccepted, true).await;
    assert_passes(&report);
    let too_long = report.check("key-too-long");
    assert_eq!(
        too_long.map(|c| (c.level, c.verdict)),
        Some((Level::Advisory, Verdict::Info)),
        "{}",
        report.table()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_keys_fail_key_too_long_under_stripe() {
    let flaw = Flaw::LongKeysAccepted;
    let report = check_under(flaw, true, Profile::Stripe).await;
    assert_caught(flaw, &report, "key-too-long");
    assert_eq!(
        report.check("key-too-long").map(|c| c.level),
        Some(Level::Required)
    );
}
