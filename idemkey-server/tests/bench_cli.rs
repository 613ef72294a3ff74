//! `idemkey bench` against a live `idemkey serve`: every mode runs, the JSON report is
//! well formed, and the effects read back show no duplicates.

mod common;

use std::process::Command;

async fn bench(base: &str, args: &[&str]) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(["bench", "--url", base, "--token", common::TOKEN1, "--json"])
        .args(args)
        .output()
        .expect("idemkey bench runs");
    assert!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the report is JSON")
}

fn phase<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["phases"]
        .as_array()
        .and_then(|phases| phases.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no phase {name} in {report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_modes_report_ratios_and_find_no_duplicates() {
    let backend = common::Backend::sqlite().await;
    let server = backend.start(&["--simulate-latency", "2"]).await;
    let pid = server.pid().to_string();

    let race = bench(
        server.base(),
        &[
            "--mode",
            "race",
            "--requests",
            "160",
            "--race-width",
            "8",
            "--concurrency",
            "16",
        ],
    )
    .await;
    let p = phase(&race, "race");
    assert_eq!(p["requests"], 160);
    assert_eq!(p["statuses"]["201"], 160, "{race}");
    assert_eq!(p["replayed"], 160 - 20, "one execution per key: {race}");
    assert_eq!(race["effects"]["expected"], 20);
    assert_eq!(race["effects"]["duplicates"], 0, "{race}");

    // The server is a child of this test process: as `--database-pid`, this process
    // stands for a postmaster whose children are the backends.
    let parent = std::process::id().to_string();
    let fresh = bench(
        server.base(),
        &[
            "--mode",
            "fresh",
            "--requests",
            "200",
            "--concurrency",
            "4",
            "--server-pid",
            &pid,
            "--database-pid",
            &parent,
        ],
    )
    .await;
    assert_eq!(phase(&fresh, "baseline")["statuses"]["201"], 200);
    assert_eq!(phase(&fresh, "fresh")["replayed"], 0);
    assert!(fresh["ratio"].as_f64().is_some_and(|r| r > 0.0), "{fresh}");
    for name in ["baseline", "fresh"] {
        for field in ["server_cpu_us_per_request", "database_cpu_us_per_request"] {
            assert!(
                phase(&fresh, name)[field]
                    .as_f64()
                    .is_some_and(|us| us > 0.0),
                "{name} {field}: {fresh}"
            );
        }
    }
    assert_eq!(fresh["effects"]["expected"], 400, "200 unkeyed + 200 keyed");
    assert_eq!(fresh["effects"]["duplicates"], 0);
    assert!(
        fresh["server_peak_rss_kib"]
            .as_u64()
            .is_some_and(|kib| kib > 0)
    );

    let replay = bench(
        server.base(),
        &["--mode", "replay", "--requests", "50", "--concurrency", "4"],
    )
    .await;
    assert_eq!(phase(&replay, "replay")["replayed"], 50, "{replay}");
    assert!(
        phase(&replay, "replay")["server_cpu_us_per_request"].is_null(),
        "not measured without --server-pid: {replay}"
    );
    assert_eq!(replay["effects"]["duplicates"], 0);

    let mixed = bench(
        server.base(),
        &["--mode", "mixed", "--requests", "50", "--concurrency", "4"],
    )
    .await;
    assert_eq!(phase(&mixed, "mixed")["statuses"]["201"], 50, "{mixed}");
    assert_eq!(mixed["effects"]["duplicates"], 0);

    // Mismatched replays are refused and make no effect; unkeyed requests make one each.
    let soak = bench(
        server.base(),
        &[
            "--mode",
            "mixed",
            "--requests",
            "200",
            "--concurrency",
            "4",
            "--replay-ratio",
            "0.3",
            "--mismatch-ratio",
            "0.3",
            "--unkeyed-ratio",
            "0.2",
        ],
    )
    .await;
    let p = phase(&soak, "mixed");
    let count = |status: &str| p["statuses"][status].as_u64().unwrap_or(0);
    assert!(count("422") > 0, "some mismatches: {soak}");
    assert_eq!(count("201") + count("422"), 200, "{soak}");
    assert_eq!(soak["effects"]["duplicates"], 0, "{soak}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_id_replays_an_earlier_runs_keys_after_a_restart() {
    let backend = common::Backend::sqlite().await;
    let args = ["--mode", "replay", "--requests", "20", "--concurrency", "2"];
    let first = {
        let server = backend.start(&[]).await;
        bench(server.base(), &[&args[..], &["--run-id", "again"]].concat()).await
    };
    assert_eq!(phase(&first, "fresh")["replayed"], 0, "{first}");
    assert_eq!(first["effects"]["expected"], 20, "{first}");

    // A new process: no cache, so the first phase replays from the database.
    let server = backend.start(&[]).await;
    let second = bench(server.base(), &[&args[..], &["--run-id", "again"]].concat()).await;
    for name in ["fresh", "replay"] {
        assert_eq!(phase(&second, name)["replayed"], 20, "{name}: {second}");
    }
    assert_eq!(second["effects"]["expected"], 0, "{second}");
    assert_eq!(second["effects"]["duplicates"], 0, "{second}");
}
