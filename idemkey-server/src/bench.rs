//! `idemkey bench`: a load generator against any server speaking the contract.
//!
//! Each run measures its own baseline, so a result is a ratio taken under the same machine
//! load: `fresh` runs the unkeyed route first (`--baseline-path`) and then the keyed one;
//! `replay` runs `fresh` (which also creates the keys) and then replays those keys.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, RngCore};
use serde::Serialize;
use tokio::sync::Mutex;

/// The load shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A new key per request; compared with the unkeyed baseline route.
    Fresh,
    /// Keys already completed; compared with the fresh phase that created them.
    Replay,
    /// `--race-width` concurrent requests per key; effects read back to find duplicates.
    Race,
    /// A mix of replays (`--replay-ratio`), fresh keys, mismatched replays
    /// (`--mismatch-ratio`, answered 422) and unkeyed requests (`--unkeyed-ratio`).
    Mixed,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The server, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    /// The keyed route's path.
    pub path: String,
    /// The unkeyed route doing the same effect (the baseline of `fresh`).
    pub baseline_path: String,
    /// Where the effects are counted (`GET`, JSON with `total`); empty: not read back.
    pub effects_path: String,
    /// Bearer token.
    pub token: crate::secret::SecretString,
    /// The load shape.
    pub mode: Mode,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Requests per measured phase.
    pub requests: usize,
    /// Upper bound of each phase.
    pub duration: Duration,
    /// Concurrent requests per key in `race`.
    pub race_width: usize,
    /// Share of replays in `mixed`.
    pub replay_ratio: f64,
    /// Share of `mixed` requests that reuse a completed key with another body (422).
    pub mismatch_ratio: f64,
    /// Share of `mixed` requests sent to the unkeyed baseline route without a key.
    pub unkeyed_ratio: f64,
    /// The keys' namespace (`bench-<ID>-<n>`); `None`: a random one per run. Giving the ID
    /// of an earlier run replays its keys, from the store rather than a cache if the server
    /// restarted in between.
    pub run_id: Option<String>,
    /// A server process to report the peak memory (Linux `VmHWM`) and the CPU time per
    /// request of.
    pub server_pid: Option<u32>,
    /// A database server to report the CPU time per request of: the process and its
    /// children (PostgreSQL's postmaster and its backends), from `/proc`.
    pub database_pid: Option<u32>,
    /// Print JSON instead of a table.
    pub json: bool,
}

#[derive(Debug, Clone)]
struct Req {
    key: Option<String>,
    body: String,
    path_is_baseline: bool,
}

/// One measured phase.
#[derive(Debug, Serialize)]
pub struct Phase {
    name: String,
    requests: u64,
    seconds: f64,
    requests_per_second: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    statuses: BTreeMap<u16, u64>,
    transport_errors: u64,
    replayed: u64,
    /// Requests without a key that got a 2xx: each made one effect.
    #[serde(skip)]
    unkeyed_succeeded: u64,
    /// CPU time (user + system) the server process spent in this phase, per request, in µs;
    /// `null` without `--server-pid`.
    server_cpu_us_per_request: Option<f64>,
    /// CPU time the database (the process given by `--database-pid` and its children) spent
    /// in this phase, per request, in µs; `null` without `--database-pid`.
    database_cpu_us_per_request: Option<f64>,
    #[serde(skip)]
    created_keys: Vec<String>,
}

/// Effects read back after the run.
#[derive(Debug, Serialize)]
pub struct Effects {
    before: i64,
    after: i64,
    /// Effects the run should have made: one per key that got a 2xx not marked replayed,
    /// one per unkeyed 2xx.
    expected: i64,
    /// `after - before - expected`: more than zero means an operation ran twice.
    duplicates: i64,
}

/// The whole report.
#[derive(Debug, Serialize)]
pub struct Report {
    mode: Mode,
    concurrency: usize,
    phases: Vec<Phase>,
    /// Throughput of the second phase over the first (keyed / baseline, replay / fresh).
    ratio: Option<f64>,
    effects: Option<Effects>,
    server_peak_rss_kib: Option<u64>,
}

struct Load {
    client: reqwest::Client,
    options: BenchOptions,
    run_id: String,
}

fn body(n: usize) -> String {
    format!(
        r#"{{"amount":{},"currency":"EUR","customer":"bench-{}","description":"load test"}}"#,
        100 + n % 9000,
        n % 1000
    )
}

impl Load {
    fn key(&self, n: usize) -> String {
        format!("bench-{}-{n}", self.run_id)
    }

    async fn effects(&self) -> Option<i64> {
        if self.options.effects_path.is_empty() {
            return None;
        }
        let url = format!("{}{}", self.options.url, self.options.effects_path);
        let response = self
            .client
            .get(url)
            .bearer_auth(self.options.token.expose())
            .send()
            .await
            .ok()?;
        let json: serde_json::Value = response.json().await.ok()?;
        json["total"].as_i64()
    }

    async fn phase(&self, name: &str, plan: Vec<Req>) -> anyhow::Result<Phase> {
        let total = plan.len();
        let plan = Arc::new(plan);
        let next = Arc::new(AtomicUsize::new(0));
        let results = Arc::new(Mutex::new(Vec::with_capacity(total)));
        let bar = if self.options.json {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(total as u64)
        };
        bar.set_style(
            ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message(name.to_owned());
        let server_cpu = self.options.server_pid.and_then(process_cpu_ticks);
        let database_cpu = self.options.database_pid.and_then(process_tree_cpu_ticks);
        let started = Instant::now();
        let deadline = started + self.options.duration;
        let workers: Vec<_> = (0..self.options.concurrency.max(1))
            .map(|_| {
                let (plan, next, results, bar) =
                    (plan.clone(), next.clone(), results.clone(), bar.clone());
                let client = self.client.clone();
                let options = self.options.clone();
                tokio::spawn(async move {
                    let mut local = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= plan.len() || Instant::now() >= deadline {
                            break;
                        }
                        let req = &plan[i];
                        let path = if req.path_is_baseline {
                            &options.baseline_path
                        } else {
                            &options.path
                        };
                        let mut builder = client
                            .post(format!("{}{path}", options.url))
                            .bearer_auth(options.token.expose())
                            .header("content-type", "application/json")
                            .body(req.body.clone());
                        if let Some(key) = &req.key {
                            builder = builder.header("idempotency-key", key);
                        }
                        let t = Instant::now();
                        let outcome = match builder.send().await {
                            Ok(response) => {
                                let replayed =
                                    response.headers().contains_key("idempotent-replayed");
                                let status = response.status().as_u16();
                                // Read the body: the request is done when the response is.
                                let _ = response.bytes().await;
                                Ok((status, replayed))
                            }
                            Err(_) => Err(()),
                        };
                        local.push((i, t.elapsed(), outcome));
                        bar.inc(1);
                    }
                    results.lock().await.extend(local);
                })
            })
            .collect();
        for worker in workers {
            worker.await.context("a load worker failed")?;
        }
        let seconds = started.elapsed().as_secs_f64();
        let server_cpu = server_cpu.zip(self.options.server_pid.and_then(process_cpu_ticks));
        let database_cpu =
            database_cpu.zip(self.options.database_pid.and_then(process_tree_cpu_ticks));
        bar.finish_and_clear();
        let results = results.lock().await;
        let mut hist = Histogram::<u64>::new_with_bounds(1, 120_000_000, 3)?;
        let mut statuses = BTreeMap::new();
        let (mut transport_errors, mut replayed, mut unkeyed_succeeded) = (0, 0, 0);
        let mut created_keys = Vec::new();
        for (i, elapsed, outcome) in results.iter() {
            hist.saturating_record(elapsed.as_micros().max(1) as u64);
            match outcome {
                Ok((status, was_replayed)) => {
                    *statuses.entry(*status).or_default() += 1;
                    replayed += u64::from(*was_replayed);
                    // An effect per executed 2xx: a replay made none (a key replayed from
                    // an earlier run, `--run-id`, counts nowhere).
                    if (200..300).contains(status) && !was_replayed {
                        match &plan[*i].key {
                            Some(key) => created_keys.push(key.clone()),
                            None => unkeyed_succeeded += 1,
                        }
                    }
                }
                Err(()) => transport_errors += 1,
            }
        }
        let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        let requests = results.len() as u64;
        let per_request = |(before, after): (u64, u64)| {
            let ticks = after.saturating_sub(before) as f64;
            ticks * 1e6 / clock_ticks_per_second() as f64 / requests.max(1) as f64
        };
        Ok(Phase {
            name: name.to_owned(),
            requests,
            seconds,
            requests_per_second: requests as f64 / seconds.max(1e-9),
            p50_ms: ms(0.50),
            p90_ms: ms(0.90),
            p99_ms: ms(0.99),
            max_ms: hist.max() as f64 / 1000.0,
            statuses,
            transport_errors,
            replayed,
            unkeyed_succeeded,
            server_cpu_us_per_request: server_cpu.map(per_request),
            database_cpu_us_per_request: database_cpu.map(per_request),
            created_keys,
        })
    }
}

/// Request `i` of a `mixed` phase: a replay of one of the `warm` keys made by the warm-up,
/// the same key with another body (a mismatch), an unkeyed request, or a fresh key (numbered
/// after the warm-up's).
fn mixed_request(
    load: &Load,
    rng: &mut impl Rng,
    options: &BenchOptions,
    warm: usize,
    i: usize,
) -> Req {
    let share = |r: f64| r.clamp(0.0, 1.0);
    let roll: f64 = rng.r#gen();
    let (replay, mismatch) = (share(options.replay_ratio), share(options.mismatch_ratio));
    let unkeyed = share(options.unkeyed_ratio);
    if roll < replay {
        let k = rng.gen_range(0..warm);
        Req {
            key: Some(load.key(k)),
            body: body(k),
            path_is_baseline: false,
        }
    } else if roll < replay + mismatch {
        let k = rng.gen_range(0..warm);
        Req {
            key: Some(load.key(k)),
            body: body(k + 1),
            path_is_baseline: false,
        }
    } else if roll < replay + mismatch + unkeyed {
        Req {
            key: None,
            body: body(i),
            path_is_baseline: true,
        }
    } else {
        Req {
            key: Some(load.key(warm + i)),
            body: body(warm + i),
            path_is_baseline: false,
        }
    }
}

/// Runs the benchmark and prints its report.
pub async fn bench(options: BenchOptions) -> anyhow::Result<Report> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(options.concurrency.max(1))
        .timeout(Duration::from_secs(60))
        .build()?;
    let run_id = options.run_id.clone().unwrap_or_else(|| {
        let mut id = [0u8; 6];
        rand::thread_rng().fill_bytes(&mut id);
        hex::encode(id)
    });
    let load = Load {
        client,
        options: options.clone(),
        run_id,
    };
    let n = options.requests.max(1);
    let before = load.effects().await;
    let mut phases = Vec::new();
    let mut warm_keys: Vec<String> = Vec::new();
    match options.mode {
        Mode::Fresh => {
            let baseline = (0..n)
                .map(|i| Req {
                    key: None,
                    body: body(i),
                    path_is_baseline: true,
                })
                .collect();
            phases.push(load.phase("baseline", baseline).await?);
            let keyed = (0..n)
                .map(|i| Req {
                    key: Some(load.key(i)),
                    body: body(i),
                    path_is_baseline: false,
                })
                .collect();
            phases.push(load.phase("fresh", keyed).await?);
        }
        Mode::Replay => {
            let keyed: Vec<Req> = (0..n)
                .map(|i| Req {
                    key: Some(load.key(i)),
                    body: body(i),
                    path_is_baseline: false,
                })
                .collect();
            phases.push(load.phase("fresh", keyed.clone()).await?);
            phases.push(load.phase("replay", keyed).await?);
        }
        Mode::Race => {
            let width = options.race_width.max(2);
            let keys = n.div_ceil(width);
            let plan = (0..keys)
                .flat_map(|k| {
                    let key = load.key(k);
                    (0..width).map(move |_| Req {
                        key: Some(key.clone()),
                        body: body(k),
                        path_is_baseline: false,
                    })
                })
                .collect();
            phases.push(load.phase("race", plan).await?);
        }
        Mode::Mixed => {
            let warm = (n / 10).max(1);
            let seed: Vec<Req> = (0..warm)
                .map(|i| Req {
                    key: Some(load.key(i)),
                    body: body(i),
                    path_is_baseline: false,
                })
                .collect();
            let warmed = load.phase("warm-up", seed).await?;
            warm_keys = warmed.created_keys;
            let mut rng = rand::thread_rng();
            let plan = (0..n)
                .map(|i| mixed_request(&load, &mut rng, &options, warm, i))
                .collect();
            phases.push(load.phase("mixed", plan).await?);
        }
    }
    let after = load.effects().await;
    let effects = match (before, after) {
        (Some(before), Some(after)) => {
            let mut keys: Vec<&String> = phases
                .iter()
                .flat_map(|p| &p.created_keys)
                .chain(&warm_keys)
                .collect();
            keys.sort();
            keys.dedup();
            let unkeyed: i64 = phases.iter().map(|p| p.unkeyed_succeeded as i64).sum();
            let expected = keys.len() as i64 + unkeyed;
            Some(Effects {
                before,
                after,
                expected,
                duplicates: after - before - expected,
            })
        }
        _ => None,
    };
    let ratio = match phases.as_slice() {
        [first, second] => Some(second.requests_per_second / first.requests_per_second.max(1e-9)),
        _ => None,
    };
    let report = Report {
        mode: options.mode,
        concurrency: options.concurrency,
        phases,
        ratio,
        effects,
        server_peak_rss_kib: options.server_pid.and_then(peak_rss_kib),
    };
    Ok(report)
}

/// `VmHWM` of a process, in KiB (Linux).
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Clock ticks per second, the unit of the CPU times in `/proc/PID/stat`.
fn clock_ticks_per_second() -> u64 {
    rustix::param::clock_ticks_per_second().max(1)
}

/// The fields of `/proc/PID/stat` after the command name (which may hold spaces and
/// parentheses, so the line is split after its last `)`): field 3 (`state`) comes first.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().collect())
}

/// Field `n` (1-based, as `proc(5)` numbers them) of a `/proc/PID/stat` line, as a number.
fn stat_field(fields: &[&str], n: usize) -> Option<u64> {
    fields.get(n.checked_sub(3)?)?.parse().ok()
}

/// User + system CPU time of a process so far, in clock ticks (fields 14 and 15).
fn process_cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = stat_fields(&stat)?;
    Some(stat_field(&fields, 14)? + stat_field(&fields, 15)?)
}

/// CPU time of a process and of its children so far, in clock ticks: its own user + system
/// time, the time of the children it has waited for (fields 16 and 17: a backend that
/// exited during a phase still counts), and that of every live child (field 4, the parent,
/// is `pid`). For PostgreSQL, `pid` is the postmaster and its children are the backends.
fn process_tree_cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = stat_fields(&stat)?;
    let mut total = (14..=17)
        .map(|n| stat_field(&fields, n))
        .sum::<Option<u64>>()?;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // A process may exit between the listing and the read: it is skipped.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let Some(fields) = stat_fields(&stat) else {
            continue;
        };
        if stat_field(&fields, 4) == Some(u64::from(pid)) {
            total += stat_field(&fields, 14).unwrap_or(0) + stat_field(&fields, 15).unwrap_or(0);
        }
    }
    Some(total)
}

impl Report {
    /// Whether the run found an operation executed twice.
    pub fn found_duplicates(&self) -> bool {
        self.effects.as_ref().is_some_and(|e| e.duplicates > 0)
    }

    /// A human-readable table.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<9} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11}  statuses",
            "phase",
            "requests",
            "req/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "max ms",
            "replayed",
            "srv µs/req",
            "db µs/req"
        );
        let cpu = |us: Option<f64>| us.map_or_else(|| "-".to_owned(), |us| format!("{us:.1}"));
        for p in &self.phases {
            let statuses: Vec<String> = p
                .statuses
                .iter()
                .map(|(s, n)| format!("{s}:{n}"))
                .chain(
                    (p.transport_errors > 0).then(|| format!("transport:{}", p.transport_errors)),
                )
                .collect();
            let _ = writeln!(
                out,
                "{:<9} {:>8} {:>10.1} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>11} {:>11}  {}",
                p.name,
                p.requests,
                p.requests_per_second,
                p.p50_ms,
                p.p90_ms,
                p.p99_ms,
                p.max_ms,
                p.replayed,
                cpu(p.server_cpu_us_per_request),
                cpu(p.database_cpu_us_per_request),
                statuses.join(" ")
            );
        }
        if let (Some(ratio), [first, second]) = (self.ratio, self.phases.as_slice()) {
            let _ = writeln!(out, "ratio {}/{}: {ratio:.3}", second.name, first.name);
        }
        if let Some(e) = &self.effects {
            let _ = writeln!(
                out,
                "effects: {} new (expected {}), duplicates: {}",
                e.after - e.before,
                e.expected,
                e.duplicates
            );
        }
        if let Some(kib) = self.server_peak_rss_kib {
            let _ = writeln!(out, "server peak memory: {:.1} MiB", kib as f64 / 1024.0);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cpu_fields_after_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (post gres: (x) idle) S 4200 4200 4200 0 -1 4194560 100 0 0 0 \
                    31 7 5 3 20 0 1 0 100 0 0";
        let fields = stat_fields(stat).expect("fields");
        assert_eq!(stat_field(&fields, 3), None, "state is not a number");
        assert_eq!(stat_field(&fields, 4), Some(4200), "ppid");
        assert_eq!(stat_field(&fields, 14), Some(31), "utime");
        assert_eq!(stat_field(&fields, 15), Some(7), "stime");
        assert_eq!(stat_field(&fields, 17), Some(3), "cstime");
    }

    #[test]
    fn this_process_has_spent_cpu() {
        let pid = std::process::id();
        let own = process_cpu_ticks(pid).expect("own stat");
        let tree = process_tree_cpu_ticks(pid).expect("own tree");
        assert!(tree >= own);
        assert!(clock_ticks_per_second() > 0);
    }
}
