//! 500 logical payments through a proxy that loses 30 % of responses after the server
//! answered: the client retries with the same key, and every payment exists exactly once.

use idemkey_server::demo::{DemoOptions, DemoReport, run};

async fn lossy_run(database_url: Option<String>) -> DemoReport {
    run(DemoOptions {
        operations: 500,
        loss: 0.3,
        concurrency: 16,
        database_url: database_url.map(Into::into),
        seed: Some(30),
        quiet: true,
        late: false,
    })
    .await
    .expect("the demo runs")
}

fn assert_exactly_once(report: &DemoReport) {
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.operations, 500);
    assert_eq!(
        report.succeeded, 500,
        "every logical payment ends in success"
    );
    assert_eq!(
        report.payments_created, 500,
        "each payment exists exactly once"
    );
    assert!(
        report.lost_responses > 100,
        "the proxy did lose responses: {}",
        report.lost_responses
    );
    assert!(
        report.transport_attempts >= 500 + report.lost_responses,
        "every lost response was retried: {report:?}"
    );
    assert!(report.replays > 0, "some retries were answered by replays");
    assert!(report.is_exact());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_payments_at_30_percent_loss_on_sqlite() {
    let report = lossy_run(None).await;
    assert_exactly_once(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_payments_at_30_percent_loss_on_postgres() {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("fresh database");
    let report = lossy_run(Some(url)).await;
    assert_exactly_once(&report);
}

/// 200 payments whose lost answers are retried after the retention passed and the purge ran:
/// none is created twice; every retry is refused (412, it stated its first attempt's time)
/// or settled by the payment's reference (409).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn late_retries_after_the_purge_create_nothing_twice() {
    let report = run(DemoOptions {
        operations: 200,
        loss: 0.3,
        concurrency: 16,
        database_url: None,
        seed: Some(31),
        quiet: true,
        late: true,
    })
    .await
    .expect("the demo runs");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let late = report.late.as_ref().expect("a late report");
    assert!(late.retried > 20, "answers were lost: {report:?}");
    assert!(
        late.refused > 0 && late.settled_by_reference > 0,
        "{late:?}"
    );
    assert_eq!(late.refused + late.settled_by_reference, late.retried);
    assert_eq!(report.succeeded + late.retried, 200);
    assert_eq!(
        report.payments_created, 200,
        "each payment exists exactly once"
    );
    assert!(report.is_exact());
    assert!(
        report.render().contains("VERDICT: OK"),
        "{}",
        report.render()
    );
}
