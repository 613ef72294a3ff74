//! The command line of `idemkey`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idemkey_core::{FirstSentPolicy, FirstSentRequirement, RecordState};
use idemkey_outbox::{MessageState, NatsConfig, NatsSink, WebhookSink};
use idemkey_tower::{InFlightPolicy, KeyRequirement};

use crate::check::{CheckOptions, Profile, ReportFiles};
use crate::gateway::{GatewayOptions, RouteRule, Upstream};
use crate::keys::KeysAction;
use crate::outbox::{OutboxAction, OutboxOptions, OutboxSink};
use crate::secret::{KeySecretSource, SecretString, SecretUrl};
use crate::{ApiKeys, DatabaseOptions, ServeOptions};

/// idemkey: safe retries for HTTP writes.
#[derive(Debug, Parser)]
#[command(name = "idemkey", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the reference payments API.
    Serve(ServeArgs),
    /// Put the idempotency contract in front of any HTTP service (a reverse proxy).
    Gateway(GatewayArgs),
    /// Run the database migrations (idemkey's and the payments API's) and exit; creates a
    /// missing SQLite file.
    Migrate(DbArgs),
    /// Inspect and manage idempotency records (opens an existing, migrated database).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Load-test a server that speaks the contract (ratios against a baseline in one run).
    Bench(BenchArgs),
    /// Check that a keyed write endpoint keeps the idempotency contract, over real HTTP
    /// (exit 0: every required check passed, 1: one failed, 2: it could not run).
    Check(CheckArgs),
    /// Show what idemkey is for: payments through a network that loses responses.
    Demo(DemoArgs),
    /// Deliver the outbox's messages, as `serve` does with an outbox sink, in a process of
    /// its own (opens an existing, migrated database).
    Relay(RelayArgs),
    /// Inspect and manage outbox messages (opens an existing, migrated database).
    #[command(subcommand)]
    Outbox(OutboxCommand),
}

/// Where outbox messages go, and how hard the relay tries (`serve`, `relay`).
#[derive(Debug, Clone, Args)]
pub struct OutboxArgs {
    /// Emit outbox messages (`payment.succeeded`) and deliver each with `POST` to this URL,
    /// the message id as `Idempotency-Key`.
    #[arg(
        long,
        value_name = "URL",
        env = "IDEMKEY_OUTBOX_WEBHOOK",
        hide_env_values = true
    )]
    pub outbox_webhook: Option<SecretString>,
    /// Emit outbox messages and publish each to NATS JetStream at this URL (with
    /// `--outbox-subject`), `Nats-Msg-Id` set to the message id; several servers may be
    /// listed, separated by commas.
    #[arg(
        long,
        value_name = "URL",
        env = "IDEMKEY_OUTBOX_NATS",
        hide_env_values = true,
        conflicts_with = "outbox_webhook",
        requires = "outbox_subject"
    )]
    pub outbox_nats: Option<SecretUrl>,
    /// The subject `--outbox-nats` publishes to. A stream that captures it is used as it is;
    /// when none does, one is created (`OUTBOX_<SUBJECT>`, a 2-minute duplicate window).
    #[arg(
        long,
        value_name = "SUBJECT",
        env = "IDEMKEY_OUTBOX_SUBJECT",
        requires = "outbox_nats"
    )]
    pub outbox_subject: Option<String>,
    /// How long one delivery may take before it counts as failed. A relay's claim on the
    /// messages it delivers lasts three times this: a relay that dies leaves its messages to
    /// the next one after that.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_timeout)]
    pub outbox_delivery_timeout: Duration,
    /// Delivery attempts before a message is dead (`idemkey outbox retry` revives it).
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..))]
    pub outbox_max_attempts: u32,
    /// The longest wait between two attempts (waits double from 1s, with jitter).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_timeout)]
    pub outbox_max_backoff: Duration,
    /// How long sent messages are kept before they are deleted.
    #[arg(long, value_name = "DURATION", default_value = "7days", value_parser = parse_retention)]
    pub outbox_keep_sent: Duration,
}

/// `idemkey relay`.
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    /// Address to serve `GET /metrics` on (the outbox's metrics).
    #[arg(long, default_value = "127.0.0.1:8082")]
    pub listen: SocketAddr,
    /// The database.
    #[command(flatten)]
    pub db: DbArgs,
    /// Where outbox messages go.
    #[command(flatten)]
    pub outbox: OutboxArgs,
}

/// A message state, as `idemkey outbox list --state` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MessageStateArg {
    /// Waiting to be delivered.
    Pending,
    /// Acknowledged by the sink.
    Sent,
    /// Every attempt failed.
    Dead,
}

/// `idemkey outbox …`.
#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// List messages, newest first.
    List {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// Only messages in this state.
        #[arg(long, value_enum)]
        state: Option<MessageStateArg>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one message: its state, attempts, last error, the bytes it is delivered as, and
    /// the operators' actions on it.
    Show {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// The message id (`msg_…`).
        id: String,
    },
    /// Make a dead message pending again, its attempts reset (audited).
    Retry {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// Why, for the audit trail.
        #[arg(long)]
        note: Option<String>,
        /// The message id (`msg_…`).
        id: String,
    },
    /// Delete a dead message: it will never be delivered (audited).
    Drop {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// Why, for the audit trail.
        #[arg(long)]
        note: Option<String>,
        /// The message id (`msg_…`).
        id: String,
    },
}

/// `idemkey demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Logical payments to make.
    #[arg(long, default_value_t = 200)]
    pub payments: usize,
    /// Share of responses lost after the server answered (0.0 to 1.0).
    #[arg(long, default_value_t = 0.3)]
    pub loss: f64,
    /// Payments in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The database; default: a temporary SQLite file.
    #[arg(long)]
    pub database_url: Option<SecretUrl>,
    /// Seed of the losses, for a reproducible run.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Retry the lost answers a day late: after the server's clock has passed the retention
    /// and the purge ran. Each is refused (412) or settled by the payment's reference (409).
    #[arg(long)]
    pub late: bool,
}

/// `idemkey check`.
#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// The keyed write endpoint, e.g. `http://127.0.0.1:8080/v1/payments`.
    pub url: String,
    /// The JSON body of a valid write; each `{{uuid}}` in it is replaced by a fresh UUID per
    /// key.
    #[arg(long)]
    pub body: String,
    /// The write's method.
    #[arg(long, default_value = "POST")]
    pub method: http::Method,
    /// A header sent with every request, `Name: value` (the caller's authentication;
    /// repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Another caller's header, `Name: value` (repeatable): the `scope` check sends the same
    /// key and body as this caller; without it, `scope` is skipped.
    #[arg(long = "other-caller", value_name = "NAME: VALUE", value_parser = parse_header)]
    pub other_caller: Vec<(String, String)>,
    /// The contract checked.
    #[arg(long, value_enum, default_value_t = ProfileArg::Ietf)]
    pub profile: ProfileArg,
    /// The most writes the checks may send; refused before the first if the plan needs more.
    #[arg(long, default_value_t = 100)]
    pub max_writes: usize,
    /// How many attempts with one key the race check releases together.
    #[arg(long, default_value_t = 8)]
    pub race: usize,
    /// A URL whose `GET` (with the `--header`s) answers the count of executions so far: a JSON
    /// number, or an object with `count` or `total`. One execution is then counted, not
    /// inferred from the answers.
    #[arg(long, value_name = "URL")]
    pub effects: Option<String>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the report as JUnit XML to this file.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// The bound on each request (e.g. 10s).
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    pub timeout: Duration,
    /// Allow a target whose host is not loopback (the checks send real writes).
    #[arg(long)]
    pub yes: bool,
}

/// `idemkey check --profile`: the contract checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProfileArg {
    /// The IETF `Idempotency-Key` header draft: a key is required, a reused key with another
    /// body is 422.
    Ietf,
    /// Stripe's idempotent requests: a key is optional, a reused key with another body is 400
    /// `idempotency_error` (422 accepted too).
    Stripe,
    /// OASIS Repeatable Requests: as `ietf`, plus `Repeatability-First-Sent` too far in the
    /// past is refused with 412.
    Oasis,
}

impl From<ProfileArg> for Profile {
    fn from(profile: ProfileArg) -> Self {
        match profile {
            ProfileArg::Ietf => Self::Ietf,
            ProfileArg::Stripe => Self::Stripe,
            ProfileArg::Oasis => Self::Oasis,
        }
    }
}

impl From<&CheckArgs> for CheckOptions {
    fn from(args: &CheckArgs) -> Self {
        Self {
            url: args.url.clone(),
            method: args.method.clone(),
            body: args.body.clone(),
            headers: args.headers.clone(),
            other_caller: args.other_caller.clone(),
            profile: args.profile.into(),
            max_writes: args.max_writes,
            race: args.race,
            effects: args.effects.clone(),
            yes: args.yes,
            timeout: args.timeout,
        }
    }
}

impl From<&CheckArgs> for ReportFiles {
    fn from(args: &CheckArgs) -> Self {
        Self {
            json: args.json.clone(),
            junit: args.junit.clone(),
        }
    }
}

/// Parses `Name: value` (`--header`, `--other-caller`).
pub fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not `Name: value`"))?;
    let name = name.trim();
    http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a header name"))?;
    http::HeaderValue::from_str(value.trim())
        .map_err(|_| format!("the value of {name} is not a header value"))?;
    Ok((name.to_owned(), value.trim().to_owned()))
}

/// `idemkey bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Bearer token of the tenant to load.
    #[arg(long, env = "IDEMKEY_TOKEN", hide_env_values = true)]
    pub token: SecretString,
    /// The load shape.
    #[arg(long, value_enum, default_value_t = BenchMode::Fresh)]
    pub mode: BenchMode,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Requests per measured phase.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Upper bound of each phase (e.g. 60s).
    #[arg(long, default_value = "60s", value_parser = parse_timeout)]
    pub duration: Duration,
    /// Concurrent requests per key (race mode).
    #[arg(long, default_value_t = 8)]
    pub race_width: usize,
    /// Share of replays (mixed mode).
    #[arg(long, default_value_t = 0.5)]
    pub replay_ratio: f64,
    /// Share of requests that reuse a completed key with another body, answered 422 (mixed
    /// mode).
    #[arg(long, default_value_t = 0.0)]
    pub mismatch_ratio: f64,
    /// Share of requests sent to the unkeyed route without a key (mixed mode).
    #[arg(long, default_value_t = 0.0)]
    pub unkeyed_ratio: f64,
    /// The keys' namespace: keys are `bench-ID-N`, with a random ID per run by default. The ID
    /// of an earlier run replays its keys (from the database if the server restarted since).
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// The keyed route.
    #[arg(long, default_value = "/v1/payments")]
    pub path: String,
    /// The unkeyed route doing the same effect (fresh mode's baseline).
    #[arg(long, default_value = "/v1/baseline/payments")]
    pub baseline_path: String,
    /// Where effects are counted (GET, JSON `total`); "" to skip the read-back.
    #[arg(long, default_value = "/v1/payments?limit=1")]
    pub effects_path: String,
    /// Report this server process's peak memory and CPU time per request (Linux).
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Report the CPU time per request of this database process and its children, e.g.
    /// PostgreSQL's postmaster (Linux).
    #[arg(long)]
    pub database_pid: Option<u32>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `idemkey bench --mode`: the load shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchMode {
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

impl From<BenchMode> for crate::bench::Mode {
    fn from(mode: BenchMode) -> Self {
        match mode {
            BenchMode::Fresh => Self::Fresh,
            BenchMode::Replay => Self::Replay,
            BenchMode::Race => Self::Race,
            BenchMode::Mixed => Self::Mixed,
        }
    }
}

/// The key secret: what hashes keys (and seals the gateway's raw keys), and the previous one
/// during a rotation.
#[derive(Debug, Clone, Default, Args)]
pub struct KeySecretArgs {
    /// The secret keys are hashed with (not with --key-secret-file).
    #[arg(long, env = "IDEMKEY_KEY_SECRET", hide_env_values = true)]
    pub key_secret: Option<SecretString>,
    /// A file holding the key secret (its trailing newline is ignored).
    #[arg(long, value_name = "PATH")]
    pub key_secret_file: Option<PathBuf>,
    /// Rotation: the secret used before --key-secret, still accepted for look-ups until the
    /// retention has passed (not with --previous-key-secret-file).
    #[arg(long, env = "IDEMKEY_PREVIOUS_KEY_SECRET", hide_env_values = true)]
    pub previous_key_secret: Option<SecretString>,
    /// A file holding the previous key secret.
    #[arg(long, value_name = "PATH")]
    pub previous_key_secret_file: Option<PathBuf>,
}

/// Where the database is.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// `sqlite:<path>`, `postgres://…` or `mysql://…` (MariaDB too). Only `serve`, `gateway`
    /// and `migrate` create a missing SQLite file and the tables; the other commands open
    /// what they made.
    #[arg(
        long,
        env = "IDEMKEY_DATABASE_URL",
        hide_env_values = true,
        default_value = "sqlite:idemkey.db"
    )]
    pub database_url: SecretUrl,
    /// Connections in the pool (PostgreSQL, MySQL).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_connections: u32,
}

/// In-flight policy names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InFlight {
    /// Wait for the first attempt (up to --wait-timeout), then replay.
    Wait,
    /// Answer 409 with Retry-After at once.
    Reject,
}

/// Where the gateway marks the point of no return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PointOfNoReturn {
    /// In the reservation's write: one write less per request; a gateway that dies between
    /// its reservation and sending leaves the operation indeterminate.
    WithReservation,
    /// In a write of its own once the upstream connection is open: a gateway that dies
    /// before sending leaves the key to be taken over when the lease lapses.
    Separate,
}

/// `idemkey serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The database.
    #[command(flatten)]
    pub db: DbArgs,
    /// An API key, as TENANT=TOKEN (repeatable). Without any, two demo tenants are made up.
    #[arg(long = "api-key", value_parser = parse_api_key)]
    pub api_keys: Vec<(String, SecretString)>,
    /// API keys as "t1=tok1,t2=tok2" (added to --api-key).
    #[arg(long, env = "IDEMKEY_API_KEYS", hide_env_values = true)]
    pub api_keys_env: Option<SecretString>,
    /// The key secret (PostgreSQL, MySQL: required, unless --key-secret-in-database).
    #[command(flatten)]
    pub secret: KeySecretArgs,
    /// Without a given key secret, keep it in the database (generated on first start), beside
    /// the keys it protects. The default on SQLite (with a warning); PostgreSQL and MySQL need
    /// this flag.
    #[arg(long)]
    pub key_secret_in_database: bool,
    /// Milliseconds the payment handler waits inside its transaction.
    #[cfg(feature = "simulate")]
    #[arg(long, value_name = "MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(..=60_000))]
    pub simulate_latency: u64,
    /// How long outcomes are kept and replayed (e.g. 24h, 90m).
    #[arg(long, default_value = "24h", value_parser = parse_retention)]
    pub retention: Duration,
    /// What a retry gets while the first attempt is running.
    #[arg(long, value_enum, default_value_t = InFlight::Wait)]
    pub in_flight: InFlight,
    /// How long a retry waits for the first attempt under --in-flight wait.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub wait_timeout: Duration,
    /// How often expired records are purged.
    #[arg(long, default_value = "60s", value_parser = parse_interval)]
    pub purge_interval: Duration,
    /// Where outbox messages go.
    #[command(flatten)]
    pub outbox: OutboxArgs,
    /// Timeouts and the connection limit of the HTTP server.
    #[command(flatten)]
    pub limits: HttpLimitArgs,
    /// How the first attempt's time is read.
    #[command(flatten)]
    pub first_sent: FirstSentArgs,
}

impl ServeArgs {
    /// Every configured API key, from the flags and the environment.
    pub fn all_api_keys(&self) -> Result<ApiKeys, String> {
        all_api_keys(&self.api_keys, self.api_keys_env.as_ref())
    }

    /// How long the payment handler waits inside its transaction: `--simulate-latency`, which
    /// only a build with the `simulate` feature has; zero otherwise.
    pub fn simulate_latency(&self) -> Duration {
        #[cfg(feature = "simulate")]
        return Duration::from_millis(self.simulate_latency);
        #[cfg(not(feature = "simulate"))]
        Duration::ZERO
    }
}

fn all_api_keys(
    flags: &[(String, SecretString)],
    env: Option<&SecretString>,
) -> Result<ApiKeys, String> {
    let mut pairs: Vec<(String, String)> = flags
        .iter()
        .map(|(tenant, token)| (tenant.clone(), token.expose().to_owned()))
        .collect();
    if let Some(env) = env {
        for item in env.expose().split(',').filter(|s| !s.trim().is_empty()) {
            pairs.push(ApiKeys::parse_pair(item).map_err(|e| format!("IDEMKEY_API_KEYS: {e}"))?);
        }
    }
    ApiKeys::new(pairs).map_err(|e| e.to_string())
}

/// Parses `--api-key TENANT=TOKEN`.
fn parse_api_key(s: &str) -> Result<(String, SecretString), String> {
    ApiKeys::parse_pair(s).map(|(tenant, token)| (tenant, token.into()))
}

/// The longest retention, and the oldest age a flag names: ten years (`10years`). Any longer
/// has no use, and would reach past the last date an HTTP date can spell.
const MAX_RETENTION: Duration = Duration::from_secs(10 * 31_557_600);
/// The longest time-out or wait: a day.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);
/// The longest interval between two runs of a periodic task: a year.
const MAX_INTERVAL: Duration = Duration::from_secs(31_557_600);

/// Parses a duration (e.g. 90s, 24h, 500ms) within `range`, or says which range holds.
fn duration_in(
    s: &str,
    range: std::ops::RangeInclusive<Duration>,
    what: &str,
) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("invalid duration {s:?}: {e}"))?;
    if !range.contains(&d) {
        return Err(format!(
            "{s:?} is out of range: {what} is from {} to {}",
            humantime::format_duration(*range.start()),
            humantime::format_duration(*range.end())
        ));
    }
    Ok(d)
}

/// Parses a retention (`--retention`, `--outbox-keep-sent`): from 1 s (less keeps nothing
/// long enough to protect a retry) to 10 years.
pub fn parse_retention(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::from_secs(1)..=MAX_RETENTION, "a retention")
}

/// Parses an age (`--older-than`): from 0 to 10 years.
pub fn parse_age(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::ZERO..=MAX_RETENTION, "an age")
}

/// Parses a time-out or a wait (`--wait-timeout`, `--connect-timeout`, …): from 1 ms to a
/// day (0 would fail everything at once).
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::from_millis(1)..=MAX_TIMEOUT, "a time-out")
}

/// Parses how long an idle connection is kept (`--upstream-idle-timeout`): from 0 (none is
/// kept) to a day.
pub fn parse_idle_timeout(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::ZERO..=MAX_TIMEOUT, "an idle time-out")
}

/// Parses the interval of a periodic task (`--purge-interval`, `--reconcile-interval`):
/// from 10 ms to a year.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::from_millis(10)..=MAX_INTERVAL, "an interval")
}

/// Parses how far clocks may disagree (`--first-sent-skew`): from 0 to a day.
pub fn parse_skew(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::ZERO..=MAX_TIMEOUT, "a clock skew")
}

/// Parses the gateway's `--lease`: from 300 ms (it is renewed every third of it) to a day.
pub fn parse_lease(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::from_millis(300)..=MAX_TIMEOUT, "a lease")
}

/// The largest body size a flag names: 1 GiB, about the most either store keeps in one value.
const MAX_SIZE: usize = 1 << 30;

/// Parses a size: bytes, or with a suffix `KiB`, `MiB` (also `k`, `M`, `KB`, `MB`: binary),
/// from 1 byte to 1 GiB.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: usize = digits
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 1048576, 64KiB, 1MiB"))?;
    let factor = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1024,
        "m" | "mb" | "mib" => 1024 * 1024,
        other => return Err(format!("invalid size unit {other:?}: use KiB or MiB")),
    };
    let size = n
        .checked_mul(factor)
        .filter(|size| (1..=MAX_SIZE).contains(size));
    size.ok_or_else(|| format!("{s:?} is out of range: a size is from 1 byte to 1GiB"))
}

/// The HTTP server's timeouts and connection limit, for `serve` and `gateway`
/// (docs/guide/operating.md, "Timeouts and limits").
#[derive(Debug, Clone, Copy, Args)]
pub struct HttpLimitArgs {
    /// How long a client has to send a whole request head, counted from when the connection
    /// waits for one (on connect, and after each answer); a slower head closes the connection.
    #[arg(long, default_value = "10s", value_parser = parse_http_timeout)]
    pub header_read_timeout: Duration,
    /// How long a connection may stay open with no request in progress (at most
    /// --header-read-timeout).
    #[arg(long, default_value = "5s", value_parser = parse_http_timeout)]
    pub idle_timeout: Duration,
    /// How long a client has to send a whole request body, counted from its head; a body
    /// still arriving then is refused (nothing runs) and the connection closed.
    #[arg(long, default_value = "20s", value_parser = parse_http_timeout)]
    pub request_body_deadline: Duration,
    /// How many client connections are served at once; one more is answered 503
    /// `server-overloaded` with Retry-After and closed.
    #[arg(long, default_value = "400", value_parser = parse_connection_limit)]
    pub max_client_connections: usize,
}

impl HttpLimitArgs {
    /// The limits these flags set.
    pub fn limits(&self) -> crate::HttpLimits {
        crate::HttpLimits {
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
            request_body_deadline: self.request_body_deadline,
            max_connections: self.max_client_connections,
        }
    }
}

/// Parses one of the HTTP server's timeouts (e.g. 10s, 500ms): from 10 ms (0 would close
/// every connection at once) to 10 minutes (past that a slow client holds a connection for
/// nothing).
pub fn parse_http_timeout(s: &str) -> Result<Duration, String> {
    duration_in(
        s,
        Duration::from_millis(10)..=Duration::from_secs(600),
        "a timeout of the HTTP server",
    )
}

/// Parses --max-client-connections: from 1 to 1,000,000 (and, at start, below the open-file
/// limit).
pub fn parse_connection_limit(s: &str) -> Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|_| {
        format!("invalid connection count {s:?}: expected a whole number, e.g. 400")
    })?;
    if !(1..=1_000_000).contains(&n) {
        return Err(format!(
            "{s:?} is out of range: from 1 to 1000000 client connections"
        ));
    }
    Ok(n)
}

/// `idemkey gateway`.
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// The service requests are forwarded to, e.g. http://127.0.0.1:9000 (http only).
    #[arg(long)]
    pub upstream: String,
    /// `sqlite:<path>` (created if missing, with the tables), `postgres://…` or `mysql://…`
    /// (MariaDB too).
    #[arg(
        long,
        env = "IDEMKEY_DATABASE_URL",
        hide_env_values = true,
        default_value = "sqlite:idemkey-gateway.db"
    )]
    pub database_url: SecretUrl,
    /// Connections in the pool (PostgreSQL, MySQL).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_connections: u32,
    /// A route that requires an Idempotency-Key: "METHOD PATH [STATUS=ACTION ...]", PATH may
    /// end in `*` (a prefix), METHOD may be `*`, then the route's own changes to --answers
    /// (repeatable; default when no route is given: "POST *").
    #[arg(long = "route", value_name = "METHOD PATH [STATUS=ACTION ...]")]
    pub routes: Vec<String>,
    /// A route where the key is optional (requests without one are forwarded unprotected).
    #[arg(
        long = "optional-route",
        value_name = "METHOD PATH [STATUS=ACTION ...]"
    )]
    pub optional_routes: Vec<String>,
    /// What an upstream answer means once the request has left, for every route:
    /// STATUS=ACTION or Nxx=ACTION with ACTION store, release or indeterminate. The default
    /// stores every answer but refusals (400 401 403 405 406 408 411 413 414 415 422 429:
    /// release) and 5xx (indeterminate). E.g. "503=release 500=store".
    #[arg(long, value_name = "STATUS=ACTION ...", default_value = "")]
    pub answers: String,
    /// What a retry gets while the first attempt is running.
    #[arg(long, value_enum, default_value_t = InFlight::Wait)]
    pub in_flight: InFlight,
    /// How long a retry waits for the first attempt under --in-flight wait.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub wait_timeout: Duration,
    /// How long a reservation is held without renewal (renewed every third of it).
    #[arg(long, default_value = "10s", value_parser = parse_lease)]
    pub lease: Duration,
    /// Where the point of no return is marked: in the reservation's write (one write less
    /// per request), or in a write of its own just before the request leaves (a gateway
    /// that dies in between leaves the key free to take over rather than indeterminate).
    #[arg(long, value_enum, default_value_t = PointOfNoReturn::WithReservation)]
    pub point_of_no_return: PointOfNoReturn,
    /// Bound of the TCP connect to the upstream.
    #[arg(long, default_value = "2s", value_parser = parse_timeout)]
    pub connect_timeout: Duration,
    /// How long a connection to the upstream is kept idle for the next keyed request. Keep
    /// it below the upstream's keep-alive time-out; 0s opens one connection per request.
    #[arg(long, default_value = "1s", value_parser = parse_idle_timeout)]
    pub upstream_idle_timeout: Duration,
    /// Bound of the upstream's complete answer.
    #[arg(long, default_value = "30s", value_parser = parse_timeout)]
    pub upstream_timeout: Duration,
    /// Largest keyed request body (413 past it).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub max_request_body: usize,
    /// Largest upstream answer that is stored (a larger one leaves the outcome unknown).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub max_stored_response: usize,
    /// How long outcomes are kept and replayed (e.g. 24h, 90m).
    #[arg(long, default_value = "24h", value_parser = parse_retention)]
    pub retention: Duration,
    /// An API key, as TENANT=TOKEN (repeatable): each request's tenant is its bearer
    /// token's (401 without a known one). The gateway needs one tenant source: API keys,
    /// --tenant-header or --single-tenant.
    #[arg(long = "api-key", value_parser = parse_api_key)]
    pub api_keys: Vec<(String, SecretString)>,
    /// API keys as "t1=tok1,t2=tok2" (added to --api-key).
    #[arg(long, env = "IDEMKEY_API_KEYS", hide_env_values = true)]
    pub api_keys_env: Option<SecretString>,
    /// Each request's tenant is this header's value, set by an authenticating proxy in front
    /// of the gateway, which must replace any value a caller sends (401 without it).
    #[arg(long, value_name = "HEADER")]
    pub tenant_header: Option<String>,
    /// Every caller is this one tenant: only for an upstream that keeps no per-caller state.
    #[arg(long, value_name = "TENANT")]
    pub single_tenant: Option<String>,
    /// The secret keys are hashed and sealed with (PostgreSQL, MySQL: required, unless
    /// --key-secret-in-database).
    #[command(flatten)]
    pub secret: KeySecretArgs,
    /// Without a given key secret, keep it in the database (generated on first start), beside
    /// the keys it protects. The default on SQLite (with a warning); PostgreSQL and MySQL need
    /// this flag.
    #[arg(long)]
    pub key_secret_in_database: bool,
    /// Where the reconciler asks about an operation whose outcome is unknown; `{key}` and
    /// `{tenant}` are replaced by the key and its tenant (also sent as Idemkey-Tenant), e.g.
    /// http://127.0.0.1:9000/v1/transfers?idempotency_key={key}.
    #[arg(long, value_name = "TEMPLATE")]
    pub reconcile_url: Option<String>,
    /// How often the reconciler runs.
    #[arg(long, default_value = "5s", value_parser = parse_interval)]
    pub reconcile_interval: Duration,
    /// How often expired records are purged.
    #[arg(long, default_value = "60s", value_parser = parse_interval)]
    pub purge_interval: Duration,
    /// Tests and demos: milliseconds to wait after the reservation, before connecting.
    #[cfg(feature = "simulate")]
    #[arg(long, value_name = "MS", default_value_t = 0, hide = true, value_parser = clap::value_parser!(u64).range(..=60_000))]
    pub simulate_delay_before_forward: u64,
    /// Timeouts and the connection limit of the HTTP server.
    #[command(flatten)]
    pub limits: HttpLimitArgs,
    /// How the first attempt's time is read.
    #[command(flatten)]
    pub first_sent: FirstSentArgs,
}

impl GatewayArgs {
    /// The gateway's database.
    pub fn database(&self) -> DatabaseOptions {
        DatabaseOptions::new(self.database_url.clone(), self.max_connections)
    }

    /// Every configured API key, from the flags and the environment.
    pub fn all_api_keys(&self) -> Result<ApiKeys, String> {
        all_api_keys(&self.api_keys, self.api_keys_env.as_ref())
    }

    /// The one tenant source the flags name.
    pub fn tenant_source(&self) -> Result<crate::gateway::TenantSource, String> {
        crate::gateway::TenantSource::from_flags(
            self.all_api_keys()?,
            self.tenant_header.as_deref(),
            self.single_tenant.as_deref(),
        )
    }

    /// How long to wait after the reservation, before connecting:
    /// `--simulate-delay-before-forward`, which only a build with the `simulate` feature has;
    /// zero otherwise.
    pub fn simulate_delay_before_forward(&self) -> Duration {
        #[cfg(feature = "simulate")]
        return Duration::from_millis(self.simulate_delay_before_forward);
        #[cfg(not(feature = "simulate"))]
        Duration::ZERO
    }
}

/// The first attempt's time (`Repeatability-First-Sent`), as `serve` and `gateway` read it.
#[derive(Debug, Clone, Args)]
pub struct FirstSentArgs {
    /// Whether keyed requests must state their first attempt's time in
    /// Repeatability-First-Sent. One that states a time older than the retention less the
    /// skew margin is refused with 412 unless a live record answers it.
    #[arg(long = "first-sent", value_enum, default_value_t = FirstSentArg::Optional)]
    pub requirement: FirstSentArg,
    /// How far client and server clocks may disagree: a first-sent time further ahead is
    /// refused (400), and as much is taken off the retention before a first attempt counts
    /// as too old. At most a quarter of --retention; default 5m, or that quarter when less.
    #[arg(long = "first-sent-skew", value_name = "SKEW", value_parser = parse_skew)]
    pub skew: Option<Duration>,
}

impl FirstSentArgs {
    /// The policy these flags name for `retention` (`--retention`). A skew given over a
    /// quarter of it is refused: a first-sent time accepted that far ahead would count as
    /// late only after its record expired, and a retry in between would run again.
    pub fn policy(&self, retention: Duration) -> Result<FirstSentPolicy, String> {
        let policy = FirstSentPolicy {
            requirement: match self.requirement {
                FirstSentArg::Optional => FirstSentRequirement::Optional,
                FirstSentArg::Required => FirstSentRequirement::Required,
            },
            skew: self.skew.unwrap_or(FirstSentPolicy::DEFAULT_SKEW),
        };
        let held = policy.margin(retention);
        match self.skew {
            Some(skew) if skew > held => Err(format!(
                "--first-sent-skew {} is more than a quarter of --retention {}: a first-sent time \
                 that far ahead would outlive its record; give --first-sent-skew {} or less, or a \
                 longer --retention",
                humantime::format_duration(skew),
                humantime::format_duration(retention),
                humantime::format_duration(held),
            )),
            _ => Ok(policy),
        }
    }
}

/// `--first-sent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FirstSentArg {
    /// A keyed request may state it.
    Optional,
    /// A keyed request without it is refused (400 first-sent-missing).
    Required,
}

/// Record states, as the CLI names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// Claimed, before the point of no return.
    Reserved,
    /// Past the point of no return.
    Executing,
    /// Outcome stored.
    Completed,
    /// Outcome unknown.
    Indeterminate,
}

/// `idemkey keys …`.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List records, newest first.
    List {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// The key secret the server uses (default: the one kept in the database, if any).
        #[command(flatten)]
        secret: KeySecretArgs,
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Only records in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// Only records created longer ago than this (e.g. 2h).
        #[arg(long, value_parser = parse_age)]
        older_than: Option<Duration>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show a tenant's records for one key, with their audit trails.
    Show {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// The key secret the server uses (default: the one kept in the database, if any).
        #[command(flatten)]
        secret: KeySecretArgs,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Also show this route's audit trail when its record is gone (e.g. released).
        #[arg(long)]
        route: Option<String>,
        /// The Idempotency-Key, as the client sent it.
        key: String,
    },
    /// Delete a record whatever its state (the key is free again).
    Evict {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// The key secret the server uses (default: the one kept in the database, if any).
        #[command(flatten)]
        secret: KeySecretArgs,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Method and route template, e.g. "POST /v1/payments".
        #[arg(long)]
        route: String,
        /// The Idempotency-Key, as the client sent it.
        key: String,
    },
    /// Settle an operation whose outcome is unknown (indeterminate), and audit it.
    Resolve {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// The key secret the server uses (default: the one kept in the database, if any).
        #[command(flatten)]
        secret: KeySecretArgs,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Method and route, e.g. "POST /v1/transfers" (the gateway's: "POST *").
        #[arg(long)]
        route: String,
        /// The effect happened: store --status/--body; retries replay them.
        #[arg(
            long,
            conflicts_with = "released",
            required_unless_present = "released"
        )]
        completed: bool,
        /// The effect did not happen: free the key; the next retry executes.
        #[arg(long)]
        released: bool,
        /// The stored status (with --completed).
        #[arg(long, requires = "completed")]
        status: Option<u16>,
        /// The stored body (with --completed).
        #[arg(long, requires = "completed", default_value = "")]
        body: String,
        /// The stored Content-Type (with --completed and a body).
        #[arg(long, default_value = "application/json")]
        content_type: String,
        /// Why: kept in the audit trail.
        #[arg(long)]
        note: Option<String>,
        /// The Idempotency-Key, as the client sent it.
        key: String,
    },
    /// Delete every expired record now, in batches.
    Purge {
        /// The database.
        #[command(flatten)]
        db: DbArgs,
        /// The key secret the server uses (default: the one kept in the database, if any).
        #[command(flatten)]
        secret: KeySecretArgs,
        /// Rows per batch.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
    },
}

impl From<&DbArgs> for DatabaseOptions {
    fn from(args: &DbArgs) -> Self {
        Self::new(args.database_url.clone(), args.max_connections)
    }
}

impl From<&KeySecretArgs> for KeySecretSource {
    fn from(args: &KeySecretArgs) -> Self {
        Self {
            key_secret: args.key_secret.clone(),
            key_secret_file: args.key_secret_file.clone(),
            previous_key_secret: args.previous_key_secret.clone(),
            previous_key_secret_file: args.previous_key_secret_file.clone(),
        }
    }
}

/// The sink the flags name, if any; an unusable URL or subject is refused, naming its flag.
impl TryFrom<&OutboxArgs> for OutboxOptions {
    type Error = anyhow::Error;

    fn try_from(args: &OutboxArgs) -> anyhow::Result<Self> {
        let sink = if let Some(url) = &args.outbox_webhook {
            let sink = WebhookSink::with_timeout(url.expose(), args.outbox_delivery_timeout)
                .map_err(|e| anyhow::anyhow!("--outbox-webhook: {e}"))?;
            Some(OutboxSink::Webhook(sink))
        } else if let (Some(url), Some(subject)) = (&args.outbox_nats, &args.outbox_subject) {
            let mut config = NatsConfig::new(subject.clone());
            config.ack_timeout = args.outbox_delivery_timeout.mul_f64(0.8);
            NatsSink::check_subject(subject)
                .map_err(|e| anyhow::anyhow!("--outbox-subject: {e}"))?;
            NatsSink::check_servers(url).map_err(|e| anyhow::anyhow!("--outbox-nats: {e}"))?;
            Some(OutboxSink::nats(url.clone(), config))
        } else {
            None
        };
        Ok(Self {
            sink,
            relay: OutboxOptions::relay_config(
                args.outbox_delivery_timeout,
                args.outbox_max_attempts,
                args.outbox_max_backoff,
                args.outbox_keep_sent,
            ),
        })
    }
}

/// `--in-flight` with its `--wait-timeout`.
fn in_flight(policy: InFlight, wait_timeout: Duration) -> InFlightPolicy {
    match policy {
        InFlight::Wait => InFlightPolicy::Wait(wait_timeout),
        InFlight::Reject => InFlightPolicy::Reject,
    }
}

/// `idemkey serve`'s options; API keys, the first-sent skew and the outbox sink are checked.
impl TryFrom<&ServeArgs> for ServeOptions {
    type Error = anyhow::Error;

    fn try_from(args: &ServeArgs) -> anyhow::Result<Self> {
        Ok(Self {
            listen: args.listen,
            api_keys: args.all_api_keys().map_err(anyhow::Error::msg)?,
            database_url: args.db.database_url.clone(),
            secret: (&args.secret).into(),
            key_secret_in_database: args.key_secret_in_database,
            simulate_latency: args.simulate_latency(),
            retention: args.retention,
            in_flight: in_flight(args.in_flight, args.wait_timeout),
            purge_interval: args.purge_interval,
            outbox: OutboxOptions::try_from(&args.outbox)?,
            limits: args.limits.limits(),
            first_sent: args
                .first_sent
                .policy(args.retention)
                .map_err(anyhow::Error::msg)?,
        })
    }
}

/// `idemkey gateway`'s options; routes, answers, the upstream, the tenant source, the
/// reconciler's URL and the first-sent skew are checked.
impl TryFrom<&GatewayArgs> for GatewayOptions {
    type Error = anyhow::Error;

    fn try_from(args: &GatewayArgs) -> anyhow::Result<Self> {
        let mut routes = Vec::new();
        let required: Vec<&str> = if args.routes.is_empty() && args.optional_routes.is_empty() {
            vec!["POST *"]
        } else {
            args.routes.iter().map(String::as_str).collect()
        };
        for spec in required {
            routes.push(
                RouteRule::parse(spec, KeyRequirement::Required, &args.answers)
                    .map_err(anyhow::Error::msg)?,
            );
        }
        for spec in &args.optional_routes {
            routes.push(
                RouteRule::parse(spec, KeyRequirement::Optional, &args.answers)
                    .map_err(anyhow::Error::msg)?,
            );
        }
        if let Some(template) = &args.reconcile_url
            && !template.contains("{key}")
        {
            anyhow::bail!(
                "--reconcile-url must contain {{key}}, e.g. http://svc/v1/transfers?idempotency_key={{key}}"
            );
        }
        Ok(Self {
            listen: args.listen,
            upstream: Upstream::parse(&args.upstream).map_err(anyhow::Error::msg)?,
            routes,
            in_flight: in_flight(args.in_flight, args.wait_timeout),
            lease: args.lease,
            mark_at_reservation: args.point_of_no_return == PointOfNoReturn::WithReservation,
            connect_timeout: args.connect_timeout,
            upstream_idle_timeout: args.upstream_idle_timeout,
            upstream_timeout: args.upstream_timeout,
            max_request_body: args.max_request_body,
            max_stored_response: args.max_stored_response,
            retention: args.retention,
            tenants: args.tenant_source().map_err(anyhow::Error::msg)?,
            first_sent: args
                .first_sent
                .policy(args.retention)
                .map_err(anyhow::Error::msg)?,
            database_url: args.database_url.clone(),
            secret: (&args.secret).into(),
            key_secret_in_database: args.key_secret_in_database,
            reconcile_url: args.reconcile_url.clone(),
            reconcile_interval: args.reconcile_interval,
            simulate_delay_before_forward: args.simulate_delay_before_forward(),
            purge_interval: args.purge_interval,
            limits: args.limits.limits(),
        })
    }
}

impl From<StateArg> for RecordState {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Reserved => Self::Reserved,
            StateArg::Executing => Self::Executing,
            StateArg::Completed => Self::Completed,
            StateArg::Indeterminate => Self::Indeterminate,
        }
    }
}

impl From<MessageStateArg> for MessageState {
    fn from(state: MessageStateArg) -> Self {
        match state {
            MessageStateArg::Pending => Self::Pending,
            MessageStateArg::Sent => Self::Sent,
            MessageStateArg::Dead => Self::Dead,
        }
    }
}

impl KeysCommand {
    /// The database, the key secret and what to do with the records.
    pub fn into_parts(self) -> (DatabaseOptions, KeySecretSource, KeysAction) {
        match self {
            Self::List {
                db,
                secret,
                tenant,
                state,
                older_than,
                limit,
                json,
            } => (
                (&db).into(),
                (&secret).into(),
                KeysAction::List {
                    tenant,
                    state: state.map(Into::into),
                    older_than,
                    limit,
                    json,
                },
            ),
            Self::Show {
                db,
                secret,
                tenant,
                route,
                key,
            } => (
                (&db).into(),
                (&secret).into(),
                KeysAction::Show { tenant, route, key },
            ),
            Self::Evict {
                db,
                secret,
                tenant,
                route,
                key,
            } => (
                (&db).into(),
                (&secret).into(),
                KeysAction::Evict { tenant, route, key },
            ),
            Self::Resolve {
                db,
                secret,
                tenant,
                route,
                completed,
                released: _,
                status,
                body,
                content_type,
                note,
                key,
            } => (
                (&db).into(),
                (&secret).into(),
                KeysAction::Resolve {
                    tenant,
                    route,
                    completed,
                    status,
                    body,
                    content_type,
                    note,
                    key,
                },
            ),
            Self::Purge { db, secret, batch } => {
                ((&db).into(), (&secret).into(), KeysAction::Purge { batch })
            }
        }
    }
}

impl OutboxCommand {
    /// The database, and what to do with its outbox.
    pub fn into_parts(self) -> (DatabaseOptions, OutboxAction) {
        match self {
            Self::List {
                db,
                state,
                limit,
                json,
            } => (
                (&db).into(),
                OutboxAction::List {
                    state: state.map(Into::into),
                    limit,
                    json,
                },
            ),
            Self::Show { db, id } => ((&db).into(), OutboxAction::Show { id }),
            Self::Retry { db, note, id } => ((&db).into(), OutboxAction::Retry { id, note }),
            Self::Drop { db, note, id } => ((&db).into(), OutboxAction::Drop { id, note }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ops::RangeInclusive;

    use proptest::prelude::*;

    use super::*;

    type Parser = fn(&str) -> Result<Duration, String>;

    /// Every kind of duration flag, with the range it accepts.
    fn kinds() -> [(Parser, RangeInclusive<Duration>); 7] {
        [
            (parse_retention, Duration::from_secs(1)..=MAX_RETENTION),
            (parse_age, Duration::ZERO..=MAX_RETENTION),
            (parse_timeout, Duration::from_millis(1)..=MAX_TIMEOUT),
            (parse_idle_timeout, Duration::ZERO..=MAX_TIMEOUT),
            (parse_interval, Duration::from_millis(10)..=MAX_INTERVAL),
            (parse_lease, Duration::from_millis(300)..=MAX_TIMEOUT),
            (parse_skew, Duration::ZERO..=MAX_TIMEOUT),
        ]
    }

    proptest! {
        #[test]
        fn duration_flags_accept_their_range_and_round_trip(
            secs in prop_oneof![any::<u64>(), 0u64..400_000_000],
            nanos in 0u32..1_000_000_000,
        ) {
            let d = Duration::new(secs, nanos);
            let text = humantime::format_duration(d).to_string();
            for (parse, range) in kinds() {
                match parse(&text) {
                    Ok(parsed) => prop_assert!(parsed == d && range.contains(&d), "{text}"),
                    Err(e) => prop_assert!(!range.contains(&d), "{text}: {e}"),
                }
            }
        }

        #[test]
        fn no_flag_text_panics_a_parser(text in "\\PC{0,40}", digits in "[0-9]{1,40}[a-z]{0,8}") {
            for text in [&text, &digits] {
                for (parse, _) in kinds() {
                    let _ = parse(text);
                }
                let _ = parse_size(text);
            }
        }

        #[test]
        fn sizes_accept_1_byte_to_1_gib_and_round_trip(n in prop_oneof![any::<usize>(), 0usize..(2 << 30)]) {
            match parse_size(&n.to_string()) {
                Ok(parsed) => prop_assert!(parsed == n && (1..=MAX_SIZE).contains(&n)),
                Err(_) => prop_assert!(!(1..=MAX_SIZE).contains(&n)),
            }
        }
    }

    #[test]
    fn debug_of_the_parsed_command_line_shows_no_secret() {
        let db = "postgres://app:s3cret@h/db?sslmode=require&password=s3cret";
        let secrets = [
            "--key-secret",
            "s3cret-key",
            "--previous-key-secret",
            "s3cret-old",
        ];
        let keys = ["--api-key", "t=s3cret-t", "--api-keys-env", "u=s3cret-u"];
        let commands: [Vec<&str>; 5] = [
            [
                &["idemkey", "serve", "--database-url", db][..],
                &secrets,
                &keys,
            ]
            .concat()
            .into_iter()
            .chain(["--outbox-webhook", "https://h/hook/s3cret?token=s3cret"])
            .collect(),
            [
                &[
                    "idemkey",
                    "gateway",
                    "--upstream",
                    "http://u",
                    "--database-url",
                    db,
                ][..],
                &secrets,
                &keys,
            ]
            .concat(),
            [
                &["idemkey", "keys", "list", "--database-url", db][..],
                &secrets,
            ]
            .concat(),
            vec![
                "idemkey",
                "relay",
                "--database-url",
                db,
                "--outbox-nats",
                "nats://u:s3cret@n",
                "--outbox-subject",
                "s",
            ],
            vec!["idemkey", "bench", "--token", "s3cret"],
        ];
        for args in commands {
            let cli = <Cli as clap::Parser>::try_parse_from(&args).expect("valid arguments");
            let shown = format!("{cli:?}");
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
        }
    }

    #[test]
    fn the_bounds_themselves_are_accepted() {
        assert_eq!(parse_retention("10years"), Ok(MAX_RETENTION));
        assert_eq!(parse_retention("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_timeout("1day"), Ok(MAX_TIMEOUT));
        assert_eq!(parse_size("1024MiB"), Ok(MAX_SIZE));
    }
}
