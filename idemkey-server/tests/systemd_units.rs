//! The systemd units shipped in `contrib/systemd/`, held to the binary they start.
//!
//! Each unit's `ExecStart` runs as systemd would run it: in a clean environment holding the
//! unit's `Environment=` and then its `EnvironmentFile=` (the example shipped beside the unit,
//! its database URL and API keys given test values), its `LoadCredential=` files in a
//! directory of their own for `%d`, with the real `idemkey` in place of the unit's path, a
//! SQLite file for the database and a free loopback port for `--listen` (the gateway's
//! `--upstream` is a counting upstream on loopback). It must listen, answer `GET /healthz`
//! 200 (the gateway then forwards a keyed write once), and on the unit's `KillSignal` exit 0
//! within its `TimeoutStopSec`. A flag the binary does not have stops it before it listens,
//! and a variable in an environment file that the command does not read is refused by name:
//! either fails the test.
//!
//! Where `systemd-analyze` is installed, each unit (its binary path pointed at the real one)
//! must also pass `systemd-analyze verify` without a warning; where it is not (a container
//! without systemd), that check is skipped and the run above is the test. The lines
//! `docs/guide/deployment.md` quotes from a unit must be lines of it.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::gateway::Upstream;
use common::spawn_announcing;

/// Where the units and their environment files are.
fn contrib() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .join("contrib/systemd")
}

/// A unit file's settings, in order, each `Key=value` with its continuation lines joined.
#[derive(Debug)]
struct Unit {
    name: String,
    settings: Vec<(String, String)>,
}

impl Unit {
    fn read(name: &str) -> Self {
        let text = std::fs::read_to_string(contrib().join(name))
            .unwrap_or_else(|e| panic!("read contrib/systemd/{name}: {e}"));
        let mut settings = Vec::new();
        let mut pending = String::new();
        for line in text.lines() {
            let line = line.trim();
            if pending.is_empty() && (line.is_empty() || line.starts_with(['#', ';', '['])) {
                continue;
            }
            if let Some(continued) = line.strip_suffix('\\') {
                pending.push_str(continued);
                pending.push(' ');
                continue;
            }
            pending.push_str(line);
            let (key, value) = pending
                .split_once('=')
                .unwrap_or_else(|| panic!("{name}: {pending:?} is not Key=value"));
            settings.push((key.trim().to_owned(), value.trim().to_owned()));
            pending.clear();
        }
        Self {
            name: name.to_owned(),
            settings,
        }
    }

    /// Every value of `key`, in order.
    fn all(&self, key: &str) -> Vec<&str> {
        self.settings
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The one value of `key`.
    fn one(&self, key: &str) -> &str {
        match self.all(key)[..] {
            [value] => value,
            ref values => panic!("{}: {key}= is set {} times", self.name, values.len()),
        }
    }

    /// `TimeoutStopSec`: a time span (`45s`, `1min 30s`) or plain seconds.
    fn stop_timeout(&self) -> Duration {
        let value = self.one("TimeoutStopSec");
        value
            .parse::<u64>()
            .map(Duration::from_secs)
            .or_else(|_| humantime::parse_duration(value))
            .unwrap_or_else(|e| panic!("{}: TimeoutStopSec={value}: {e}", self.name))
    }
}

/// `NAME=value` lines of an environment file, comments and blank lines left out.
fn environment_file(path: &Path) -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with(['#', ';']))
        .map(|line| {
            let (name, value) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{}: {line:?} is not NAME=value", path.display()));
            (name.trim().to_owned(), value.trim().to_owned())
        })
        .collect()
}

/// The environment variables `idemkey SUBCOMMAND` reads, as its `--help` names them, and
/// `RUST_LOG` (the log filter).
fn variables_read(subcommand: &str) -> Vec<String> {
    let help = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args([subcommand, "--help"])
        .output()
        .expect("run idemkey --help");
    assert!(help.status.success(), "idemkey {subcommand} --help");
    let help = String::from_utf8(help.stdout).expect("UTF-8 help");
    let mut names: Vec<String> = help
        .split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.split(['=', ']'])
                .next()
                .expect("a variable's name")
                .to_owned()
        })
        .collect();
    names.push("RUST_LOG".to_owned());
    names
}

/// The value a test gives a variable of the shipped environment files, if it changes it.
fn test_value(name: &str, dir: &Path) -> Option<String> {
    match name {
        "IDEMKEY_DATABASE_URL" => Some(format!("sqlite:{}", dir.join("idemkey.db").display())),
        "IDEMKEY_API_KEYS" => Some(format!("t1={}", common::TOKEN1)),
        _ => None,
    }
}

/// What systemd would start for `unit`, with test values: the command (the real binary,
/// its arguments) and the environment.
fn command_line(unit: &Unit, dir: &Path, upstream: Option<&str>) -> Command {
    // The credentials, each a test value in a directory of its own (`%d`).
    let credentials = dir.join("credentials");
    std::fs::create_dir(&credentials).expect("credentials directory");
    for credential in unit.all("LoadCredential") {
        let (name, _) = credential.split_once(':').unwrap_or((credential, ""));
        std::fs::write(credentials.join(name), format!("{}\n", "5e".repeat(32)))
            .expect("write a credential");
    }

    let exec = unit
        .one("ExecStart")
        .trim_start_matches(['-', '@', ':', '+', '!']);
    assert!(
        !exec.contains(['"', '\'', '$']),
        "{}: ExecStart has quotes or variables, which this test does not expand: {exec}",
        unit.name
    );
    let exec = exec.replace("%d", &credentials.display().to_string());
    assert!(
        !exec.contains('%'),
        "{}: ExecStart has a specifier other than %d: {exec}",
        unit.name
    );
    let mut words: Vec<String> = exec.split_whitespace().map(str::to_owned).collect();
    let program = words.remove(0);
    assert!(
        program.starts_with('/') && program.ends_with("/idemkey"),
        "{}: ExecStart starts {program}, not an absolute path to idemkey",
        unit.name
    );
    let subcommand = words.first().expect("a subcommand").clone();
    let mut replace = |flag: &str, value: &str| {
        let at = words
            .iter()
            .position(|w| w == flag)
            .unwrap_or_else(|| panic!("{}: ExecStart has no {flag}", unit.name));
        words[at + 1] = value.to_owned();
    };
    replace("--listen", "127.0.0.1:0");
    if let Some(upstream) = upstream {
        replace("--upstream", upstream);
    }

    // Environment= first; an EnvironmentFile= overrides it, as in systemd.
    let mut env = BTreeMap::new();
    for assignments in unit.all("Environment") {
        for assignment in assignments.split_whitespace() {
            let (name, value) = assignment.split_once('=').expect("NAME=value");
            env.insert(name.to_owned(), value.to_owned());
        }
    }
    let read = variables_read(&subcommand);
    for file in unit.all("EnvironmentFile") {
        let file = Path::new(file.trim_start_matches('-'));
        let shipped = contrib().join(file.file_name().expect("a file name"));
        for (name, value) in environment_file(&shipped) {
            assert!(
                read.contains(&name),
                "{}: {} sets {name}, which `idemkey {subcommand}` does not read",
                unit.name,
                shipped.display()
            );
            env.insert(name.clone(), test_value(&name, dir).unwrap_or(value));
        }
    }
    for name in env.keys() {
        assert!(
            read.contains(name),
            "{}: {name}, which `idemkey {subcommand}` does not read",
            unit.name
        );
    }

    let mut command = Command::new(env!("CARGO_BIN_EXE_idemkey"));
    command
        .args(&words)
        .env_clear()
        .envs(env)
        .current_dir(dir)
        .stderr(std::fs::File::create(dir.join("stderr.log")).expect("log file"));
    command
}

/// A unit's command running, its `/healthz` answered 200.
struct Running<'u> {
    unit: &'u Unit,
    child: common::Killed,
    /// `http://127.0.0.1:PORT`.
    base: String,
    dir: tempfile::TempDir,
}

impl<'u> Running<'u> {
    /// Starts `unit` as [`command_line`] makes it; returns once it has printed `announce`
    /// and answered `GET /healthz` 200.
    async fn start(unit: &'u Unit, upstream: Option<&str>, announce: &'static str) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let command = command_line(unit, dir.path(), upstream);
        let (child, base) = spawn_announcing(command, announce).await;
        let mut running = Self {
            unit,
            child,
            base: String::new(),
            dir,
        };
        running.base = base.unwrap_or_else(|e| {
            panic!(
                "{}: its ExecStart did not start ({e}); stderr:\n{}",
                unit.name,
                running.log()
            )
        });
        let health = reqwest::get(format!("{}/healthz", running.base))
            .await
            .expect("GET /healthz");
        assert_eq!(
            health.status(),
            200,
            "{}: /healthz; stderr:\n{}",
            unit.name,
            running.log()
        );
        running
    }

    /// What the process wrote on stderr.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// Sends the unit's `KillSignal`; the process must exit 0 within its `TimeoutStopSec`.
    async fn stop(self) {
        let Self {
            unit, child, dir, ..
        } = self;
        let log = || std::fs::read_to_string(dir.path().join("stderr.log")).unwrap_or_default();
        let signal = unit.one("KillSignal");
        let pid = child.0.id().to_string();
        let sent = Command::new("kill")
            .args(["-s", signal.trim_start_matches("SIG"), &pid])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -s {signal} {pid}");
        let stop = unit.stop_timeout();
        let waiting = tokio::task::spawn_blocking(move || {
            let mut child = child;
            let status = child.0.wait();
            (child, status)
        });
        let Ok(waited) = tokio::time::timeout(stop, waiting).await else {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            panic!(
                "{}: still running {stop:?} (TimeoutStopSec) after {signal}; stderr:\n{}",
                unit.name,
                log()
            );
        };
        let (_child, status) = waited.expect("the waiting task");
        let status = status.expect("wait for the process");
        assert_eq!(
            status.code(),
            Some(0),
            "{}: exit status {status:?} after {signal}; stderr:\n{}",
            unit.name,
            log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_unit_starts_answers_health_and_stops_on_its_signal() {
    let unit = Unit::read("idemkey-serve.service");
    Running::start(&unit, None, "idemkey listening on ")
        .await
        .stop()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_unit_starts_forwards_and_stops_on_its_signal() {
    let unit = Unit::read("idemkey-gateway.service");
    let upstream = Upstream::start();
    let gateway =
        Running::start(&unit, Some(&upstream.base), "idemkey gateway listening on ").await;
    // The unit's flags and environment make a gateway that forwards a keyed write once.
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/transfers", gateway.base))
        .bearer_auth(common::TOKEN1)
        .header("idempotency-key", "unit-1")
        .json(&serde_json::json!({"amount": 1}))
        .send()
        .await
        .expect("POST through the gateway");
    assert_eq!(answer.status(), 201, "stderr:\n{}", gateway.log());
    assert_eq!(upstream.effects("unit-1"), 1);
    gateway.stop().await;
}

/// The lines the deployment guide quotes from the units are lines of those units: each `ini`
/// block that starts `# contrib/systemd/NAME` quotes NAME.
#[test]
fn the_guide_quotes_the_units_as_they_are() {
    let guide = contrib().join("../../docs/guide/deployment.md");
    let text = std::fs::read_to_string(&guide).expect("read docs/guide/deployment.md");
    let mut quoted = 0;
    for block in text.split("```ini\n").skip(1) {
        let block = block.split("```").next().expect("a block");
        let mut lines = block.lines();
        let Some(name) = lines
            .next()
            .and_then(|l| l.strip_prefix("# contrib/systemd/"))
        else {
            continue;
        };
        let unit = std::fs::read_to_string(contrib().join(name))
            .unwrap_or_else(|e| panic!("the guide quotes {name}: {e}"));
        let unit: Vec<&str> = unit.lines().map(str::trim).collect();
        for line in lines.map(str::trim).filter(|l| !l.is_empty()) {
            assert!(
                unit.contains(&line),
                "docs/guide/deployment.md quotes {line:?}, which {name} does not have"
            );
            quoted += 1;
        }
    }
    assert!(quoted > 0, "the guide quotes no unit");
}

/// The directories of `PATH` that hold `program`.
fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

#[test]
fn the_units_pass_systemd_analyze_verify_where_it_is_installed() {
    let Some(analyze) = on_path("systemd-analyze") else {
        eprintln!("systemd-analyze is not installed: skipped");
        return;
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    for name in ["idemkey-serve.service", "idemkey-gateway.service"] {
        let text = std::fs::read_to_string(contrib().join(name)).expect("read the unit");
        let unit = Unit::read(name);
        let program = unit
            .one("ExecStart")
            .split_whitespace()
            .next()
            .expect("a program");
        let copy = dir.path().join(name);
        std::fs::write(&copy, text.replace(program, env!("CARGO_BIN_EXE_idemkey")))
            .expect("write the unit's copy");
        let output = Command::new(&analyze)
            .args(["verify", "--man=no"])
            .arg(&copy)
            .stdin(Stdio::null())
            .output()
            .expect("run systemd-analyze");
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && said.trim().is_empty(),
            "systemd-analyze verify {name}: {:?}\n{said}",
            output.status
        );
    }
}
