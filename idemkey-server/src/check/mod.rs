//! `idemkey check`: a black-box checker of the idempotency contract.
//!
//! [`run`] sends real HTTP requests to one keyed write endpoint and reports, check by check,
//! whether it keeps the contract: a key is required and well-formed, a retry is a replay,
//! a reused key with another body is refused, a race or a lost response runs the write once,
//! and keys are scoped to their caller. Each check names the rule it holds the endpoint to
//! (the IETF `Idempotency-Key` draft, Stripe's idempotent requests, or OASIS Repeatable
//! Requests) and whether that rule is required or advisory.
//!
//! One execution is told from two by the answers (two executions of a create endpoint
//! answer different bodies, a new id), or, with [`CheckOptions::effects`], by a count of
//! executions the endpoint's owner exposes, read before and after.

use std::path::PathBuf;
use std::time::Duration;

mod checks;
mod report;

/// Which published contract the checks hold the endpoint to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// The IETF `Idempotency-Key` header draft: a key is required, a reused key with another
    /// body is 422.
    #[default]
    Ietf,
    /// Stripe's idempotent requests: a key is optional, a reused key with another body is 400
    /// `idempotency_error` (422 accepted too).
    Stripe,
    /// OASIS Repeatable Requests: as `ietf`, plus `Repeatability-First-Sent` too far in the
    /// past is refused with 412.
    Oasis,
}

/// What `idemkey check` runs against, and its bounds.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The keyed write endpoint, e.g. `http://127.0.0.1:8080/v1/payments`.
    pub url: String,
    /// The method of the write (`POST` by default).
    pub method: http::Method,
    /// The JSON body as given on the command line (it must parse as JSON). Each occurrence of
    /// `{{uuid}}` is replaced by a fresh UUID per key, for endpoints that refuse a reused
    /// business reference under another key.
    pub body: String,
    /// Headers sent with every request (the caller's authentication).
    pub headers: Vec<(String, String)>,
    /// Another caller's headers; empty: the `scope` check is skipped.
    pub other_caller: Vec<(String, String)>,
    /// The contract checked.
    pub profile: Profile,
    /// The most writes the checker may send; [`run`] refuses to start if its plan needs more.
    pub max_writes: usize,
    /// How many attempts the race check releases together.
    pub race: usize,
    /// A URL whose `GET` answers the number of executions so far: a JSON number, or an
    /// object with `count` (or `total`, as `GET /v1/payments?limit=1` of `idemkey serve`).
    pub effects: Option<String>,
    /// Allow a target whose host is not loopback.
    pub yes: bool,
    /// The bound on each request.
    pub timeout: Duration,
}

impl CheckOptions {
    /// Options with the command line's defaults: `POST`, profile `ietf`, at most 100 writes,
    /// a race of 8, a 10 s bound per request, loopback only.
    pub fn new(url: impl Into<String>, body: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            method: http::Method::POST,
            body: body.into(),
            headers: Vec::new(),
            other_caller: Vec::new(),
            profile: Profile::Ietf,
            max_writes: 100,
            race: 8,
            effects: None,
            yes: false,
            timeout: Duration::from_secs(10),
        }
    }
}

/// Whether a failed check fails the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// The profile's rule requires it: a failure makes the exit code 1.
    Required,
    /// Good practice: reported, never failing the run.
    Advisory,
}

/// What one check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The endpoint keeps the rule.
    Pass,
    /// The endpoint breaks the rule.
    Fail,
    /// A fact, neither pass nor fail.
    Info,
    /// Not run (not asked for, or not part of this profile).
    Skipped,
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    /// The check's fixed id, e.g. `replay-same-bytes`.
    pub id: &'static str,
    /// The rule it holds the endpoint to, e.g. `IETF draft-ietf-httpapi-idempotency-key-header §2.6`.
    pub rule: &'static str,
    /// Whether a failure fails the run.
    pub level: Level,
    /// What it found.
    pub verdict: Verdict,
    /// What it saw: statuses, headers, counts.
    pub saw: String,
}

/// All checks' outcomes, one per check id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The writes the plan needed, computed before the first was sent.
    pub writes_planned: usize,
    /// The writes sent, refused ones included.
    pub writes_made: usize,
    /// One outcome per check id, in the order they ran.
    pub checks: Vec<CheckResult>,
}

impl Report {
    /// The outcome of the check `id`.
    pub fn check(&self, id: &str) -> Option<&CheckResult> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// 0 when every required check passed (or was skipped), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        let failed = self.checks.iter().any(|c| {
            c.level == Level::Required && !matches!(c.verdict, Verdict::Pass | Verdict::Skipped)
        });
        i32::from(failed)
    }
}

/// Why the checker did not run.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The endpoint could not be reached.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// The endpoint did not behave as a keyed write (e.g. a valid request was not a 2xx).
    #[error("not a keyed write: {0}")]
    NotKeyedWrite(String),
    /// The options cannot hold.
    #[error("bad arguments: {0}")]
    BadArguments(String),
    /// The plan needs more writes than allowed.
    #[error(
        "over --max-writes: the checks need {planned} writes, --max-writes allows {max} (raise it, or lower --race)"
    )]
    OverMaxWrites {
        /// The writes the plan needs.
        planned: usize,
        /// The bound given.
        max: usize,
    },
    /// The target is not on this machine and `yes` was not given.
    #[error(
        "non-loopback target {host} without --yes: the checker sends real writes; pass --yes to run it against another host"
    )]
    NotLoopback {
        /// The target's host.
        host: String,
    },
}

/// Where [`command`] writes the report besides the table on stdout; `None`: not written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReportFiles {
    /// The report as JSON.
    pub json: Option<PathBuf>,
    /// The report as JUnit XML.
    pub junit: Option<PathBuf>,
}

/// `idemkey check`: prints the plan and the table, writes the JSON and JUnit files asked
/// for, and returns the exit code: 0 every required check passed, 1 one failed, 2 the checks
/// could not run (the reason on stderr).
pub async fn command(options: CheckOptions, files: &ReportFiles) -> i32 {
    let url = options.url.clone();
    let report = match checks::run(options, |planned| {
        println!("idemkey check: {planned} writes planned against {url}");
    })
    .await
    {
        Ok(report) => report,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    print!("{}", report.table());
    let json = serde_json::to_string_pretty(&report.to_json()).unwrap_or_default();
    for (path, text) in [(&files.json, json), (&files.junit, report.junit_xml())] {
        if let Some(path) = path
            && let Err(e) = std::fs::write(path, text)
        {
            eprintln!("error: writing {}: {e}", path.display());
            return 2;
        }
    }
    report.exit_code()
}

/// Runs every check against `options.url` and reports each one's verdict.
///
/// # Errors
///
/// [`CheckError`] when the options cannot hold, the target is not loopback without `yes`,
/// the plan needs more than `max_writes` writes, the endpoint is unreachable, or a plain
/// keyed write is not answered with a 2xx.
pub async fn run(options: CheckOptions) -> Result<Report, CheckError> {
    checks::run(options, |_| {}).await
}
