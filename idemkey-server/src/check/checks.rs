//! The checks: the plan, each check's requests, and how their answers are judged.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Barrier;

use super::{CheckError, CheckOptions, CheckResult, Level, Profile, Report, Verdict};

/// The draft's key-required rule (a missing key is 400).
const IETF_MISSING: &str = "IETF draft-ietf-httpapi-idempotency-key-header §2.7";
/// The draft's key syntax: a String structured-field item.
const IETF_SYNTAX: &str = "IETF draft-ietf-httpapi-idempotency-key-header §2.2";
/// The draft's fingerprint rule: the same key with another request is 422.
const IETF_FINGERPRINT: &str = "IETF draft-ietf-httpapi-idempotency-key-header §2.6";
/// The draft's concurrency rule: a request while the first runs is 409.
const IETF_CONCURRENT: &str = "IETF draft-ietf-httpapi-idempotency-key-header §2.7";
/// Stripe's idempotent requests.
const STRIPE: &str = "Stripe: Idempotent requests";
/// Stripe's key length; the IETF draft sets none.
const STRIPE_KEY_LENGTH: &str = "Stripe: Idempotent requests (keys up to 255 characters)";
/// OASIS Repeatable Requests: `Repeatability-First-Sent` and 412.
const OASIS: &str = "OASIS Repeatable Requests 1.0 §3";
/// The checker's own observations.
const FACTS: &str = "facts (no rule)";

/// The placeholder in `--body` replaced by a fresh UUID per key.
const UUID_PLACEHOLDER: &str = "{{uuid}}";
/// How often `lost-response` retries while the first attempt is still in flight.
const LOST_RETRIES: usize = 10;
/// How long `lost-response` keeps retrying at most.
const LOST_BOUND: Duration = Duration::from_secs(5);
/// The headers that mark a replay.
const REPLAY_MARKERS: [&str; 2] = ["idempotent-replayed", "idempotency-replayed"];
/// How much of a body `saw` quotes.
const QUOTE: usize = 160;

/// One answer, as the checks compare them.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn content_type(&self) -> &str {
        self.header("content-type").unwrap_or("")
    }

    fn replay_marker(&self) -> Option<String> {
        REPLAY_MARKERS
            .iter()
            .find_map(|name| self.header(name).map(|v| format!("{name}: {v}")))
    }

    /// Same status, content type and body bytes.
    fn same_as(&self, other: &Answer) -> bool {
        self.status == other.status
            && self.content_type() == other.content_type()
            && self.body == other.body
    }

    /// The status and the start of the body on one line (runs of whitespace, line breaks
    /// included, shown as one space).
    fn short(&self) -> String {
        let text = String::from_utf8_lossy(&self.body);
        let words: Vec<&str> = text.split_whitespace().collect();
        let text = words.join(" ");
        let mut quoted: String = text.chars().take(QUOTE).collect();
        if text.chars().count() > QUOTE {
            quoted.push('…');
        }
        format!("{} {quoted}", self.status.as_u16())
    }
}

/// Where the target is, as the raw connections need it.
#[derive(Debug, Clone)]
struct Target {
    url: reqwest::Url,
    /// `host:port`, for connecting and for the `Host` header.
    authority: String,
    /// The path and query the request line names.
    path: String,
}

fn target(url: &str, yes: bool) -> Result<Target, CheckError> {
    let parsed = reqwest::Url::parse(url)
        .map_err(|e| CheckError::BadArguments(format!("the URL {url:?} does not parse: {e}")))?;
    if parsed.scheme() != "http" {
        return Err(CheckError::BadArguments(format!(
            "the URL {url:?} is not http:// (the checker speaks plain HTTP/1.1; put it in front of a TLS terminator's plain side)"
        )));
    }
    let host = parsed
        .host_str()
        .ok_or_else(|| CheckError::BadArguments(format!("the URL {url:?} names no host")))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback && !yes {
        return Err(CheckError::NotLoopback {
            host: host.to_owned(),
        });
    }
    let port = parsed.port_or_known_default().unwrap_or(80);
    let authority = format!("{host}:{port}");
    let mut path = parsed.path().to_owned();
    if let Some(query) = parsed.query() {
        path.push('?');
        path.push_str(query);
    }
    Ok(Target {
        url: parsed,
        authority,
        path,
    })
}

/// The header pairs, checked as HTTP header names and values.
fn header_map(pairs: &[(String, String)], what: &str) -> Result<http::HeaderMap, CheckError> {
    let mut map = http::HeaderMap::new();
    for (name, value) in pairs {
        let name = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|e| CheckError::BadArguments(format!("{what} header name {name:?}: {e}")))?;
        let value = http::HeaderValue::from_str(value.trim())
            .map_err(|e| CheckError::BadArguments(format!("{what} header {name}'s value: {e}")))?;
        map.append(name, value);
    }
    Ok(map)
}

/// The body of one key: `{{uuid}}` replaced by a fresh UUID.
fn body_for_key(template: &str) -> String {
    template.replace(UUID_PLACEHOLDER, &uuid::Uuid::new_v4().to_string())
}

/// A fresh key.
fn fresh_key() -> String {
    format!("idemkey-check-{}", uuid::Uuid::new_v4())
}

/// The same body with one member's value changed: the first number is raised by one, else
/// the first string gets `-changed`, else the first member becomes `"changed"`.
fn other_body(body: &str) -> Option<String> {
    let mut value: serde_json::Value = serde_json::from_str(body).ok()?;
    let object = value.as_object_mut()?;
    let key = object
        .iter()
        .find(|(_, v)| v.is_number())
        .or_else(|| object.iter().find(|(_, v)| v.is_string()))
        .or_else(|| object.iter().next())
        .map(|(k, _)| k.clone())?;
    let member = object.get_mut(&key)?;
    *member = match member {
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => serde_json::Value::from(i.saturating_add(1)),
            (None, Some(f)) => serde_json::Value::from(f + 1.0),
            _ => serde_json::Value::from("changed"),
        },
        serde_json::Value::String(s) => serde_json::Value::from(format!("{s}-changed")),
        _ => serde_json::Value::from("changed"),
    };
    serde_json::to_string(&value).ok()
}

/// The same JSON re-serialized: top-level members in reverse order, spaces and a newline
/// around them.
fn reserialized(body: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    let object = value.as_object()?;
    let mut members: Vec<(&String, &serde_json::Value)> = object.iter().collect();
    let original: Vec<&String> = members.iter().map(|(k, _)| *k).collect();
    members.reverse();
    if members.iter().map(|(k, _)| *k).collect::<Vec<_>>() == original && members.len() > 1 {
        members.rotate_left(1);
    }
    let parts: Vec<String> = members
        .iter()
        .map(|(k, v)| {
            Some(format!(
                "  {} : {}",
                serde_json::to_string(k).ok()?,
                serde_json::to_string(v).ok()?
            ))
        })
        .collect::<Option<_>>()?;
    Some(format!("{{\n{}\n}}\n", parts.join(",\n")))
}

/// What every check shares: the target, the callers' clients, and the count of writes.
struct Ctx {
    options: CheckOptions,
    target: Target,
    headers: http::HeaderMap,
    other_headers: http::HeaderMap,
    client: reqwest::Client,
    other_client: reqwest::Client,
    writes: AtomicUsize,
    /// What `advertised` reports, gathered from every answer.
    facts: std::sync::Mutex<Facts>,
}

impl Ctx {
    fn note(&self, answer: &Answer) {
        if let Ok(mut facts) = self.facts.lock() {
            facts.note(answer);
        }
    }
}

/// The writes each check sends at most, in the order they run.
fn plan(options: &CheckOptions) -> usize {
    let fixed = 2 // replay-same-bytes
        + 1 // key-reused-other-body
        + 1 // reserialized-body
        + 1 // key-missing
        + 3 // key-empty, key-too-long, key-malformed
        + 2 // in-flight
        + 1 + LOST_RETRIES; // lost-response
    let scope = usize::from(!options.other_caller.is_empty());
    let oasis = usize::from(options.profile == Profile::Oasis);
    fixed + options.race + scope + oasis
}

/// Checks the options, plans, and runs every check.
pub(super) async fn run(
    options: CheckOptions,
    announce: impl FnOnce(usize),
) -> Result<Report, CheckError> {
    let target = target(&options.url, options.yes)?;
    if options.race < 2 {
        return Err(CheckError::BadArguments(format!(
            "--race {} releases too few attempts to race: give 2 or more",
            options.race
        )));
    }
    if options.timeout.is_zero() {
        return Err(CheckError::BadArguments(
            "the per-request timeout must be more than zero".to_owned(),
        ));
    }
    let sample = body_for_key(&options.body);
    match serde_json::from_str::<serde_json::Value>(&sample) {
        Ok(serde_json::Value::Object(map)) if !map.is_empty() => {}
        Ok(_) => {
            return Err(CheckError::BadArguments(
                "--body must be a JSON object with at least one member (the checker changes one member's value to make another request)".to_owned(),
            ));
        }
        Err(e) => {
            return Err(CheckError::BadArguments(format!("--body is not JSON: {e}")));
        }
    }
    if let Some(effects) = &options.effects {
        reqwest::Url::parse(effects).map_err(|e| {
            CheckError::BadArguments(format!("--effects {effects:?} does not parse: {e}"))
        })?;
    }
    let headers = header_map(&options.headers, "--header")?;
    let other_headers = header_map(&options.other_caller, "--other-caller")?;
    let planned = plan(&options);
    if planned > options.max_writes {
        return Err(CheckError::OverMaxWrites {
            planned,
            max: options.max_writes,
        });
    }
    announce(planned);
    let client = |timeout| {
        reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| CheckError::BadArguments(format!("the HTTP client: {e}")))
    };
    let ctx = Ctx {
        client: client(options.timeout)?,
        other_client: client(options.timeout)?,
        target,
        headers,
        other_headers,
        writes: AtomicUsize::new(0),
        facts: std::sync::Mutex::new(Facts::default()),
        options,
    };
    let mut checks = Vec::new();
    let replay = replay_same_bytes(&ctx).await?;
    checks.push(replay.result);
    checks.push(key_reused_other_body(&ctx, &replay.first).await);
    checks.push(reserialized_body(&ctx, &replay.first).await);
    checks.push(key_missing(&ctx).await);
    let syntax = (IETF_SYNTAX, Level::Required);
    checks.push(key_refused(&ctx, "key-empty", "", syntax).await);
    // The draft sets no length; Stripe's keys are at most 255 characters.
    let length = match ctx.options.profile {
        Profile::Stripe => (STRIPE_KEY_LENGTH, Level::Required),
        _ => (STRIPE_KEY_LENGTH, Level::Advisory),
    };
    let too_long = format!("{}-{}", fresh_key(), "x".repeat(256));
    checks.push(key_refused(&ctx, "key-too-long", &too_long, length).await);
    let malformed = format!("\"unterminated-{}", uuid::Uuid::new_v4());
    checks.push(key_refused(&ctx, "key-malformed", &malformed, syntax).await);
    checks.push(race_one_execution(&ctx).await);
    checks.push(in_flight(&ctx).await);
    checks.push(lost_response(&ctx).await);
    checks.push(scope(&ctx, &replay.first).await);
    checks.push(first_sent_expired(&ctx).await);
    let mut facts = ctx.facts.into_inner().unwrap_or_default();
    facts.expiry = replay.expiry;
    checks.push(advertised(&facts));
    Ok(Report {
        writes_planned: planned,
        writes_made: ctx.writes.load(Ordering::SeqCst),
        checks,
    })
}

/// The first key's request and answer, and the facts the later checks add to.
struct Replay {
    result: CheckResult,
    first: First,
    expiry: Vec<String>,
}

/// The key, body and first answer of `replay-same-bytes`, reused by later checks.
struct First {
    key: String,
    body: String,
    answer: Answer,
}

/// What `advertised` reports.
#[derive(Default)]
struct Facts {
    expiry: Vec<String>,
    /// Refusals (4xx), and how many of them were problem+json.
    refusals: usize,
    problem_json: usize,
    /// 409 answers, and how many carried `Retry-After`.
    conflicts: usize,
    retry_after: usize,
}

impl Facts {
    fn note(&mut self, answer: &Answer) {
        if answer.status.is_client_error() {
            self.refusals += 1;
            if !problem_note(answer).is_empty() {
                self.problem_json += 1;
            }
        }
        if answer.status == StatusCode::CONFLICT {
            self.conflicts += 1;
            if answer.header("retry-after").is_some() {
                self.retry_after += 1;
            }
        }
    }
}

impl Ctx {
    /// Sends one keyed write with `reqwest` as the caller (or the other caller); `key`
    /// `None` sends none, and `extra` headers are added.
    async fn send(
        &self,
        key: Option<&str>,
        body: &str,
        other: bool,
        extra: &[(&str, &str)],
    ) -> Result<Answer, String> {
        let (client, headers) = if other {
            (&self.other_client, &self.other_headers)
        } else {
            (&self.client, &self.headers)
        };
        let mut request = client
            .request(self.options.method.clone(), self.target.url.clone())
            .headers(headers.clone())
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        for (name, value) in extra {
            request = request.header(*name, *value);
        }
        self.writes.fetch_add(1, Ordering::SeqCst);
        let response = request.send().await.map_err(|e| describe(&e))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(|e| describe(&e))?;
        let answer = Answer {
            status,
            headers,
            body,
        };
        self.note(&answer);
        Ok(answer)
    }

    /// The request as HTTP/1.1 bytes, for the raw connections.
    fn raw_request(&self, key: &str, body: &str) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nidempotency-key: {key}\r\nconnection: close\r\n",
            self.options.method,
            self.target.path,
            self.target.authority,
            body.len()
        );
        for (name, value) in &self.headers {
            if let Ok(value) = value.to_str() {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body.as_bytes());
        bytes
    }

    async fn connect(&self) -> Result<TcpStream, String> {
        tokio::time::timeout(
            self.options.timeout,
            TcpStream::connect(&self.target.authority),
        )
        .await
        .map_err(|_| format!("connecting took over {:?}", self.options.timeout))?
        .map_err(|e| format!("connecting to {}: {e}", self.target.authority))
    }

    /// Reads the count of executions from `--effects`, if given.
    async fn effects(&self) -> Result<Option<u64>, String> {
        let Some(url) = &self.options.effects else {
            return Ok(None);
        };
        let response = self
            .client
            .get(url)
            .headers(self.headers.clone())
            .send()
            .await
            .map_err(|e| format!("--effects: {}", describe(&e)))?;
        let status = response.status();
        let value: serde_json::Value = response
            .json()
            .await
            .map_err(|e| format!("--effects answered {status}, not JSON: {e}"))?;
        value
            .as_u64()
            .or_else(|| {
                ["count", "total"]
                    .iter()
                    .find_map(|name| value.get(name).and_then(serde_json::Value::as_u64))
            })
            .map(Some)
            .ok_or_else(|| format!("--effects answered {value}, not a count"))
    }
}

/// A request error, with its cause.
fn describe(error: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn result(
    id: &'static str,
    rule: &'static str,
    level: Level,
    verdict: Verdict,
    saw: impl Into<String>,
) -> CheckResult {
    CheckResult {
        id,
        rule,
        level,
        verdict,
        saw: saw.into(),
    }
}

/// The executions between two counts, when `--effects` gave both.
fn executed(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after?.saturating_sub(before?))
}

/// `replay-same-bytes`, which is also the preflight: its first write must be a 2xx.
async fn replay_same_bytes(ctx: &Ctx) -> Result<Replay, CheckError> {
    const ID: &str = "replay-same-bytes";
    let rule = match ctx.options.profile {
        Profile::Stripe => STRIPE,
        _ => IETF_FINGERPRINT,
    };
    let before = ctx.effects().await.map_err(CheckError::BadArguments)?;
    let key = fresh_key();
    let body = body_for_key(&ctx.options.body);
    let first = ctx
        .send(Some(&key), &body, false, &[])
        .await
        .map_err(|e| CheckError::Unreachable(format!("{}: {e}", ctx.options.url)))?;
    if !first.status.is_success() {
        return Err(CheckError::NotKeyedWrite(format!(
            "a write with a fresh key and the given body was answered {} (a 2xx is needed to check replays; check --body and --header)",
            first.short()
        )));
    }
    let mut expiry = Vec::new();
    for name in ["idempotency-key-expires", "expires", "idempotency-expires"] {
        if let Some(value) = first.header(name) {
            expiry.push(format!("{name}: {value}"));
        }
    }
    let second = ctx.send(Some(&key), &body, false, &[]).await;
    let after = ctx.effects().await.map_err(CheckError::BadArguments)?;
    let result = match second {
        Err(e) => result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("the retry failed: {e}"),
        ),
        Ok(second) => {
            let marker = second
                .replay_marker()
                .unwrap_or_else(|| "no replay marker".to_owned());
            let count = executed(before, after);
            if !second.same_as(&first) {
                result(
                    ID,
                    rule,
                    Level::Required,
                    Verdict::Fail,
                    format!(
                        "the retry answered other bytes: first {}, retry {} ({marker})",
                        first.short(),
                        second.short()
                    ),
                )
            } else if count.is_some_and(|n| n != 1) {
                result(
                    ID,
                    rule,
                    Level::Required,
                    Verdict::Fail,
                    format!(
                        "the same bytes, but --effects counted {} executions",
                        count.unwrap_or_default()
                    ),
                )
            } else {
                result(
                    ID,
                    rule,
                    Level::Required,
                    Verdict::Pass,
                    format!(
                        "{} twice, the same bytes ({} bytes, {}); {marker}",
                        first.status.as_u16(),
                        first.body.len(),
                        if first.content_type().is_empty() {
                            "no content type"
                        } else {
                            first.content_type()
                        }
                    ),
                )
            }
        }
    };
    Ok(Replay {
        result,
        first: First {
            key,
            body,
            answer: first,
        },
        expiry,
    })
}

/// `key-reused-other-body`: the first key with one member changed is refused.
async fn key_reused_other_body(ctx: &Ctx, first: &First) -> CheckResult {
    const ID: &str = "key-reused-other-body";
    let (rule, accepted): (&str, &[u16]) = match ctx.options.profile {
        Profile::Stripe => (STRIPE, &[400, 422]),
        _ => (IETF_FINGERPRINT, &[422]),
    };
    let Some(other) = other_body(&first.body) else {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Skipped,
            "the body has no member to change",
        );
    };
    let before = match ctx.effects().await {
        Ok(n) => n,
        Err(e) => return result(ID, rule, Level::Required, Verdict::Fail, e),
    };
    let answer = match ctx.send(Some(&first.key), &other, false, &[]).await {
        Ok(a) => a,
        Err(e) => {
            return result(
                ID,
                rule,
                Level::Required,
                Verdict::Fail,
                format!("the request failed: {e}"),
            );
        }
    };
    let after = ctx.effects().await.ok().flatten();
    let problem = problem_note(&answer);
    if answer.same_as(&first.answer) {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!(
                "another body under the same key got the first answer's bytes ({})",
                answer.short()
            ),
        );
    }
    if let Some(n) = executed(before, after).filter(|n| *n > 0) {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("{}; --effects counted {n} new executions", answer.short()),
        );
    }
    if accepted.contains(&answer.status.as_u16()) {
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Pass,
            format!("{}{problem}", answer.status.as_u16()),
        )
    } else {
        let want = accepted
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(" or ");
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("{} instead of {want}", answer.short()),
        )
    }
}

/// `, problem+json` when the answer is one.
fn problem_note(answer: &Answer) -> &'static str {
    if answer
        .content_type()
        .starts_with("application/problem+json")
    {
        ", problem+json"
    } else {
        ""
    }
}

/// `reserialized-body`: the same JSON, members reordered and spaced, under the first key.
async fn reserialized_body(ctx: &Ctx, first: &First) -> CheckResult {
    const ID: &str = "reserialized-body";
    let rule = IETF_FINGERPRINT;
    let Some(body) = reserialized(&first.body) else {
        return result(
            ID,
            rule,
            Level::Advisory,
            Verdict::Skipped,
            "the body cannot be re-serialized",
        );
    };
    match ctx.send(Some(&first.key), &body, false, &[]).await {
        Err(e) => result(
            ID,
            rule,
            Level::Advisory,
            Verdict::Info,
            format!("the request failed: {e}"),
        ),
        Ok(answer) if answer.same_as(&first.answer) => result(
            ID,
            rule,
            Level::Advisory,
            Verdict::Pass,
            "reordered members and whitespace are the same request: replayed",
        ),
        Ok(answer) => result(
            ID,
            rule,
            Level::Advisory,
            Verdict::Info,
            format!(
                "reordered members and whitespace are another request: {}",
                answer.short()
            ),
        ),
    }
}

/// `key-missing`: a write without a key.
async fn key_missing(ctx: &Ctx) -> CheckResult {
    const ID: &str = "key-missing";
    let body = body_for_key(&ctx.options.body);
    let answer = ctx.send(None, &body, false, &[]).await;
    if ctx.options.profile == Profile::Stripe {
        let saw = match answer {
            Ok(a) => format!("{} (keys are optional under Stripe's rules)", a.short()),
            Err(e) => format!("the request failed: {e}"),
        };
        return result(ID, STRIPE, Level::Advisory, Verdict::Info, saw);
    }
    match answer {
        Err(e) => result(
            ID,
            IETF_MISSING,
            Level::Required,
            Verdict::Fail,
            format!("the request failed: {e}"),
        ),
        Ok(a) if matches!(a.status.as_u16(), 400 | 428) => result(
            ID,
            IETF_MISSING,
            Level::Required,
            Verdict::Pass,
            format!("{}{}", a.status.as_u16(), problem_note(&a)),
        ),
        Ok(a) if a.status.is_client_error() => result(
            ID,
            IETF_MISSING,
            Level::Required,
            Verdict::Pass,
            format!(
                "{}{} (refused; the draft names 400)",
                a.status.as_u16(),
                problem_note(&a)
            ),
        ),
        Ok(a) => result(
            ID,
            IETF_MISSING,
            Level::Required,
            Verdict::Fail,
            format!("a write without a key was answered {}", a.short()),
        ),
    }
}

/// `key-empty`, `key-too-long`, `key-malformed`: refused with 4xx, nothing executed. Under
/// an advisory rule, a key taken is a fact (info), not a failure.
async fn key_refused(
    ctx: &Ctx,
    id: &'static str,
    key: &str,
    (rule, level): (&'static str, Level),
) -> CheckResult {
    let unmet = if level == Level::Required {
        Verdict::Fail
    } else {
        Verdict::Info
    };
    let body = body_for_key(&ctx.options.body);
    let before = match ctx.effects().await {
        Ok(n) => n,
        Err(e) => return result(id, rule, level, unmet, e),
    };
    let answer = match ctx.send(Some(key), &body, false, &[]).await {
        Ok(a) => a,
        Err(e) => {
            return result(id, rule, level, unmet, format!("the request failed: {e}"));
        }
    };
    let after = ctx.effects().await.ok().flatten();
    let length = key.chars().count();
    let shown = if key.is_empty() {
        "an empty key".to_owned()
    } else {
        let start: String = key.chars().take(24).collect();
        format!("a {length}-character key {start:?}…")
    };
    if let Some(n) = executed(before, after).filter(|n| *n > 0) {
        return result(
            id,
            rule,
            level,
            unmet,
            format!(
                "{shown} was answered {}; --effects counted {n} executions",
                answer.short()
            ),
        );
    }
    if answer.status.is_client_error() {
        result(
            id,
            rule,
            level,
            Verdict::Pass,
            format!(
                "{shown}: {}{}",
                answer.status.as_u16(),
                problem_note(&answer)
            ),
        )
    } else {
        result(
            id,
            rule,
            level,
            unmet,
            format!("{shown} was answered {}", answer.short()),
        )
    }
}

/// The in-flight answers a retry may get: 409, or 423/425/429/503 (with `Retry-After`).
fn in_flight_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 409 | 423 | 425 | 429 | 503)
}

/// `race-one-execution`: `race` attempts with one key over separate connections, released
/// together.
async fn race_one_execution(ctx: &Ctx) -> CheckResult {
    const ID: &str = "race-one-execution";
    let rule = IETF_CONCURRENT;
    let n = ctx.options.race;
    let key = fresh_key();
    let body = body_for_key(&ctx.options.body);
    let before = match ctx.effects().await {
        Ok(c) => c,
        Err(e) => return result(ID, rule, Level::Required, Verdict::Fail, e),
    };
    let barrier = Arc::new(Barrier::new(n));
    let mut attempts = Vec::with_capacity(n);
    for _ in 0..n {
        let request = build_request(ctx, &key, &body);
        let barrier = barrier.clone();
        let connect = ctx.connect();
        attempts.push(async move {
            let stream = connect.await;
            // Every attempt reaches the barrier, connected or not, so none waits forever.
            barrier.wait().await;
            send_on(stream?, request?).await
        });
    }
    ctx.writes.fetch_add(n, Ordering::SeqCst);
    let answers = match tokio::time::timeout(
        ctx.options.timeout.saturating_mul(2),
        futures::future::join_all(attempts),
    )
    .await
    {
        Ok(answers) => answers,
        Err(_) => {
            return result(
                ID,
                rule,
                Level::Required,
                Verdict::Fail,
                format!(
                    "the {n} attempts were not all answered within {:?}",
                    ctx.options.timeout * 2
                ),
            );
        }
    };
    let after = ctx.effects().await.ok().flatten();
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    let mut successes: Vec<&Answer> = Vec::new();
    let mut unexpected = Vec::new();
    let mut retry_after = 0;
    for answer in &answers {
        match answer {
            Ok(a) => {
                ctx.note(a);
                *counts.entry(a.status.as_u16().to_string()).or_default() += 1;
                if a.status.is_success() {
                    successes.push(a);
                } else if in_flight_status(a.status) {
                    if a.header("retry-after").is_some() {
                        retry_after += 1;
                    }
                } else {
                    unexpected.push(a.short());
                }
            }
            Err(e) => {
                *counts.entry("error".to_owned()).or_default() += 1;
                unexpected.push(e.clone());
            }
        }
    }
    let mut saw = counts
        .iter()
        .map(|(status, count)| format!("{count}× {status}"))
        .collect::<Vec<_>>()
        .join(", ");
    if retry_after > 0 {
        saw.push_str(&format!("; Retry-After on {retry_after}"));
    }
    let distinct = successes
        .iter()
        .enumerate()
        .filter(|(i, a)| successes[..*i].iter().all(|b| !b.same_as(a)))
        .count();
    let count = executed(before, after);
    if let Some(c) = count {
        saw.push_str(&format!("; --effects counted {c}"));
    }
    let verdict = if distinct > 1 || count.is_some_and(|c| c > 1) {
        saw.push_str(&format!(
            "; {distinct} different 2xx answers: more than one execution"
        ));
        Verdict::Fail
    } else if !unexpected.is_empty() {
        saw.push_str(&format!("; unexpected: {}", unexpected.join(" | ")));
        Verdict::Fail
    } else if successes.is_empty() {
        saw.push_str("; no attempt succeeded");
        Verdict::Fail
    } else {
        Verdict::Pass
    };
    result(ID, rule, Level::Required, verdict, saw)
}

/// One keyed write as a `hyper` request, for a connection of its own.
fn build_request(ctx: &Ctx, key: &str, body: &str) -> Result<http::Request<Full<Bytes>>, String> {
    let mut builder = http::Request::builder()
        .method(ctx.options.method.clone())
        .uri(&ctx.target.path)
        .header("host", &ctx.target.authority)
        .header("content-type", "application/json")
        .header("idempotency-key", key);
    for (name, value) in &ctx.headers {
        builder = builder.header(name, value);
    }
    builder
        .body(Full::new(Bytes::from(body.to_owned())))
        .map_err(|e| format!("building the request: {e}"))
}

/// Sends `request` on `stream` (HTTP/1.1) and reads the whole answer.
async fn send_on(stream: TcpStream, request: http::Request<Full<Bytes>>) -> Result<Answer, String> {
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    let driver = tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("sending: {e}"));
    let answer = match response {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            body.collect()
                .await
                .map(|b| Answer {
                    status: parts.status,
                    headers: parts.headers,
                    body: b.to_bytes(),
                })
                .map_err(|e| format!("reading the answer: {e}"))
        }
        Err(e) => Err(e),
    };
    driver.abort();
    answer
}

/// `in-flight`: the first attempt's request is written on a connection of its own; the retry
/// is sent before that answer is read.
async fn in_flight(ctx: &Ctx) -> CheckResult {
    const ID: &str = "in-flight";
    let rule = IETF_CONCURRENT;
    let key = fresh_key();
    let body = body_for_key(&ctx.options.body);
    let mut stream = match ctx.connect().await {
        Ok(s) => s,
        Err(e) => return result(ID, rule, Level::Required, Verdict::Fail, e),
    };
    ctx.writes.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = stream.write_all(&ctx.raw_request(&key, &body)).await {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("writing the first attempt: {e}"),
        );
    }
    let retry = ctx.send(Some(&key), &body, false, &[]).await;
    let first = read_answer(stream, ctx.options.timeout).await;
    let (first, retry) = match (first, retry) {
        (Ok(f), Ok(r)) => (f, r),
        (Err(e), _) => {
            return result(
                ID,
                rule,
                Level::Required,
                Verdict::Fail,
                format!("the first attempt: {e}"),
            );
        }
        (_, Err(e)) => {
            return result(
                ID,
                rule,
                Level::Required,
                Verdict::Fail,
                format!("the retry: {e}"),
            );
        }
    };
    if retry.same_as(&first) {
        let how = retry
            .replay_marker()
            .unwrap_or_else(|| "no replay marker".to_owned());
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Pass,
            format!(
                "the retry got the first attempt's bytes ({}; {how}): it waited, or came after",
                first.status.as_u16()
            ),
        )
    } else if in_flight_status(retry.status) {
        let retry_after = retry.header("retry-after").map_or_else(
            || "no Retry-After".to_owned(),
            |v| format!("Retry-After: {v}"),
        );
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Pass,
            format!(
                "the retry was refused while the first ran: {}{} ({retry_after})",
                retry.status.as_u16(),
                problem_note(&retry)
            ),
        )
    } else if in_flight_status(first.status) && retry.status.is_success() {
        // The two raced to the server and the retry came first: still one execution.
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Pass,
            format!(
                "the retry reached the server first and ran; the first attempt was refused \
                 while it ran: {}{}",
                first.status.as_u16(),
                problem_note(&first)
            ),
        )
    } else if retry.status.is_success() && first.status.is_success() {
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!(
                "two different 2xx answers, two executions: first {}, retry {}",
                first.short(),
                retry.short()
            ),
        )
    } else {
        result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("first {}, retry {}", first.short(), retry.short()),
        )
    }
}

/// Reads a whole HTTP/1.1 answer from a connection the server closes after it
/// (`connection: close` was asked): status, headers, and a plain or chunked body.
async fn read_answer(mut stream: TcpStream, timeout: Duration) -> Result<Answer, String> {
    let mut raw = Vec::new();
    tokio::time::timeout(timeout, stream.read_to_end(&mut raw))
        .await
        .map_err(|_| format!("no whole answer within {timeout:?}"))?
        .map_err(|e| format!("reading the answer: {e}"))?;
    parse_answer(&raw)
}

fn parse_answer(raw: &[u8]) -> Result<Answer, String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP answer ({} bytes, no end of head)", raw.len()))?;
    let head =
        std::str::from_utf8(&raw[..end]).map_err(|_| "the answer's head is not text".to_owned())?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| format!("not an HTTP status line: {status_line:?}"))?;
    let mut headers = http::HeaderMap::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.trim().as_bytes()),
            http::HeaderValue::from_str(value.trim()),
        ) {
            headers.append(name, value);
        }
    }
    let rest = &raw[end + 4..];
    let chunked = headers
        .get("transfer-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(length) = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        rest.get(..length)
            .ok_or_else(|| {
                format!(
                    "the answer ended after {} of {length} body bytes",
                    rest.len()
                )
            })?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Answer {
        status,
        headers,
        body: Bytes::from(body),
    })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk without its size line")?;
        let size_text =
            std::str::from_utf8(&rest[..line_end]).map_err(|_| "a chunk size that is not text")?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("a chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest.get(..size).ok_or("the answer ended inside a chunk")?;
        body.extend_from_slice(chunk);
        rest = rest
            .get(size + 2..)
            .ok_or("the answer ended after a chunk")?;
    }
}

/// `lost-response`: the first attempt's connection is closed right after its request is
/// written; the retry (past any 409 while the first still runs) must be a replay.
async fn lost_response(ctx: &Ctx) -> CheckResult {
    const ID: &str = "lost-response";
    let rule = match ctx.options.profile {
        Profile::Stripe => STRIPE,
        _ => IETF_FINGERPRINT,
    };
    let key = fresh_key();
    let body = body_for_key(&ctx.options.body);
    let before = match ctx.effects().await {
        Ok(c) => c,
        Err(e) => return result(ID, rule, Level::Required, Verdict::Fail, e),
    };
    let mut stream = match ctx.connect().await {
        Ok(s) => s,
        Err(e) => return result(ID, rule, Level::Required, Verdict::Fail, e),
    };
    ctx.writes.fetch_add(1, Ordering::SeqCst);
    if let Err(e) = stream.write_all(&ctx.raw_request(&key, &body)).await {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("writing the first attempt: {e}"),
        );
    }
    // The answer is lost: the connection is closed before anything is read.
    let _ = stream.shutdown().await;
    drop(stream);
    let started = Instant::now();
    let mut refusals = 0;
    let mut answer = None;
    for attempt in 0..LOST_RETRIES {
        match ctx.send(Some(&key), &body, false, &[]).await {
            Ok(a) if in_flight_status(a.status) => {
                refusals += 1;
                answer = Some(a);
                if started.elapsed() >= LOST_BOUND {
                    break;
                }
                // A short, growing pause while the first attempt finishes (bounded by the
                // attempt count and `LOST_BOUND`).
                tokio::time::sleep(Duration::from_millis(50 << attempt.min(4))).await;
            }
            Ok(a) => {
                answer = Some(a);
                break;
            }
            Err(e) => {
                return result(
                    ID,
                    rule,
                    Level::Required,
                    Verdict::Fail,
                    format!("the retry failed: {e}"),
                );
            }
        }
    }
    let after = ctx.effects().await;
    let Some(answer) = answer else {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            "no retry was answered",
        );
    };
    let waited = if refusals > 0 {
        format!(" after {refusals} in-flight answers")
    } else {
        String::new()
    };
    if in_flight_status(answer.status) {
        let first = never_answered(executed(before, after.ok().flatten()));
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!(
                "{refusals} retries in {:?} (at most {LOST_RETRIES}, {LOST_BOUND:?}) were all refused as in flight, the last {}: {first}",
                started.elapsed(),
                answer.short()
            ),
        );
    }
    let (verdict, saw) = match after {
        Ok(after) => judge_lost(&answer, executed(before, after), &waited),
        // The count asked for cannot be read: the check cannot tell one execution from two.
        Err(e) => (
            Verdict::Fail,
            format!("the retry got {}{waited}; after it, {e}", answer.short()),
        ),
    };
    result(ID, rule, Level::Required, verdict, saw)
}

/// `lost-response`'s verdict on the retry's answer (one past any in-flight answers), with the
/// executions `--effects` counted, if given; `waited` says how many in-flight answers came
/// before it. Only a 2xx keeps the answer: a refusal or a server error leaves the client
/// without it, however many times the write ran.
fn judge_lost(answer: &Answer, count: Option<u64>, waited: &str) -> (Verdict, String) {
    if !answer.status.is_success() {
        let counted = count.map_or_else(String::new, |n| {
            format!("; --effects counted {n} executions")
        });
        return (
            Verdict::Fail,
            format!(
                "the retry got {}{waited}{counted}: the client never gets the write's answer",
                answer.short()
            ),
        );
    }
    let marker = answer.replay_marker();
    match count {
        Some(1) => (
            Verdict::Pass,
            format!(
                "the retry got {}{waited}; --effects counted 1 execution",
                answer.status.as_u16()
            ),
        ),
        Some(n) => (
            Verdict::Fail,
            format!(
                "the retry got {}{waited}; --effects counted {n} executions",
                answer.short()
            ),
        ),
        None => match marker {
            Some(marker) => (
                Verdict::Pass,
                format!(
                    "the retry was a replay{waited}: {} ({marker})",
                    answer.status.as_u16()
                ),
            ),
            None => (
                Verdict::Skipped,
                format!(
                    "the retry got {}{waited} without a replay marker: the first attempt was dropped with its connection, or it ran too; one execution cannot be told from two without --effects",
                    answer.status.as_u16()
                ),
            ),
        },
    }
}

/// Why every retry after a lost answer was refused as in flight, as far as `--effects` tells:
/// the first attempt never finished, or it ran and its answer is not replayed (a replay
/// answered `409`, as some libraries do).
fn never_answered(count: Option<u64>) -> String {
    match count {
        None => "the first attempt never finished, or its answer is not replayed".to_owned(),
        Some(0) => "the first attempt never finished".to_owned(),
        Some(n) => {
            format!("--effects counted {n} executions, but no retry got an answer of its own")
        }
    }
}

/// `scope`: the other caller, same key and body, gets an answer of its own.
async fn scope(ctx: &Ctx, first: &First) -> CheckResult {
    const ID: &str = "scope";
    let rule = match ctx.options.profile {
        Profile::Stripe => STRIPE,
        _ => IETF_FINGERPRINT,
    };
    if ctx.options.other_caller.is_empty() {
        return result(
            ID,
            rule,
            Level::Required,
            Verdict::Skipped,
            "no --other-caller given",
        );
    }
    match ctx.send(Some(&first.key), &first.body, true, &[]).await {
        Err(e) => result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("the request failed: {e}"),
        ),
        Ok(a) if a.same_as(&first.answer) => result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!(
                "the other caller got the first caller's bytes: {}",
                a.short()
            ),
        ),
        Ok(a) if a.replay_marker().is_some() => result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!("the other caller got a replay: {}", a.short()),
        ),
        Ok(a) if a.status.is_success() => result(
            ID,
            rule,
            Level::Required,
            Verdict::Pass,
            format!(
                "the other caller got its own answer ({})",
                a.status.as_u16()
            ),
        ),
        Ok(a) => result(
            ID,
            rule,
            Level::Required,
            Verdict::Fail,
            format!(
                "the other caller's same request was answered {} (not executed for it)",
                a.short()
            ),
        ),
    }
}

/// `first-sent-expired`: under `oasis`, a fresh key first sent in 2000 is refused with 412.
async fn first_sent_expired(ctx: &Ctx) -> CheckResult {
    const ID: &str = "first-sent-expired";
    if ctx.options.profile != Profile::Oasis {
        return result(
            ID,
            OASIS,
            Level::Required,
            Verdict::Skipped,
            "oasis profile only",
        );
    }
    let key = fresh_key();
    let body = body_for_key(&ctx.options.body);
    let extra = [
        ("repeatability-request-id", key.as_str()),
        ("repeatability-first-sent", "Sat, 01 Jan 2000 00:00:00 GMT"),
    ];
    match ctx.send(Some(&key), &body, false, &extra).await {
        Err(e) => result(
            ID,
            OASIS,
            Level::Required,
            Verdict::Fail,
            format!("the request failed: {e}"),
        ),
        Ok(a) if a.status == StatusCode::PRECONDITION_FAILED => result(
            ID,
            OASIS,
            Level::Required,
            Verdict::Pass,
            format!("412{}", problem_note(&a)),
        ),
        Ok(a) => result(
            ID,
            OASIS,
            Level::Required,
            Verdict::Fail,
            format!(
                "Repeatability-First-Sent in 2000 was answered {}",
                a.short()
            ),
        ),
    }
}

/// `advertised`: facts about what the endpoint tells its clients.
fn advertised(facts: &Facts) -> CheckResult {
    let mut saw = vec![format!(
        "{} of {} refusals problem+json",
        facts.problem_json, facts.refusals
    )];
    if facts.conflicts > 0 {
        saw.push(format!(
            "Retry-After on {} of {} 409s",
            facts.retry_after, facts.conflicts
        ));
    }
    if facts.expiry.is_empty() {
        saw.push("no expiry or retention header on the first answer".to_owned());
    } else {
        saw.push(facts.expiry.join(", "));
    }
    let saw = saw.join("; ");
    result("advertised", FACTS, Level::Advisory, Verdict::Info, saw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunked_answer_is_read_whole() {
        let raw = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3;x=y\r\n:1}\r\n0\r\n\r\n";
        let answer = parse_answer(raw).expect("parses");
        assert_eq!(answer.status, StatusCode::CREATED);
        assert_eq!(answer.content_type(), "application/json");
        assert_eq!(&answer.body[..], b"{\"a\":1}");
    }

    #[test]
    fn a_sized_answer_is_cut_at_its_length_and_a_short_one_refused() {
        let answer =
            parse_answer(b"HTTP/1.1 409 Conflict\r\ncontent-length: 2\r\nretry-after: 1\r\n\r\n{}")
                .expect("parses");
        assert_eq!(answer.status, StatusCode::CONFLICT);
        assert_eq!(answer.header("retry-after"), Some("1"));
        assert_eq!(&answer.body[..], b"{}");
        let short = parse_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab");
        assert!(short.is_err_and(|e| e.contains("2 of 5")));
    }

    #[test]
    fn retries_all_refused_say_whether_the_first_attempt_ran() {
        assert_eq!(never_answered(Some(0)), "the first attempt never finished");
        assert!(never_answered(Some(1)).contains("counted 1 executions"));
        assert!(never_answered(None).contains("or its answer is not replayed"));
    }

    #[test]
    fn a_lost_answer_is_kept_only_by_a_2xx_retry() {
        let answer = |raw: &[u8]| parse_answer(raw).expect("parses");
        let created = answer(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}");
        assert_eq!(judge_lost(&created, Some(1), "").0, Verdict::Pass);
        assert_eq!(judge_lost(&created, Some(2), "").0, Verdict::Fail);
        assert_eq!(judge_lost(&created, None, "").0, Verdict::Skipped);
        // The write ran once, but the retry's answer is a refusal: the client never learns
        // the outcome.
        let refused = answer(b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-length: 2\r\n\r\n{}");
        let (verdict, saw) = judge_lost(&refused, Some(1), " after 1 in-flight answers");
        assert_eq!(verdict, Verdict::Fail, "{saw}");
        assert!(saw.contains("422"), "{saw}");
        let broken = answer(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(judge_lost(&broken, None, "").0, Verdict::Fail);
    }

    #[test]
    fn a_quoted_body_is_one_line() {
        let answer = parse_answer(
            b"HTTP/1.1 417 Expectation Failed\r\ncontent-length: 41\r\n\r\n<html>\n<body>\n  <pre>Misuse</pre>\n</body>",
        )
        .expect("parses");
        assert_eq!(
            answer.short(),
            "417 <html> <body> <pre>Misuse</pre> </body>"
        );
    }

    #[test]
    fn another_body_changes_one_member_and_a_reserialized_one_none() {
        let body = r#"{"amount": 500, "currency": "EUR"}"#;
        let other: serde_json::Value =
            serde_json::from_str(&other_body(body).expect("changed")).expect("JSON");
        assert_eq!(other, serde_json::json!({"amount": 501, "currency": "EUR"}));
        let same = reserialized(body).expect("re-serialized");
        assert_ne!(same, body);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&same).expect("JSON"),
            serde_json::from_str::<serde_json::Value>(body).expect("JSON")
        );
    }

    #[test]
    fn only_loopback_targets_run_without_yes() {
        for url in [
            "http://127.0.0.1:1/x",
            "http://localhost/x",
            "http://[::1]:8080/x",
        ] {
            assert!(target(url, false).is_ok(), "{url}");
        }
        assert!(matches!(
            target("http://10.0.0.1/x", false),
            Err(CheckError::NotLoopback { .. })
        ));
        assert!(target("http://10.0.0.1/x", true).is_ok());
        assert!(matches!(
            target("https://127.0.0.1/x", false),
            Err(CheckError::BadArguments(_))
        ));
    }
}
