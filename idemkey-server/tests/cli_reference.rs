//! References that cannot drift from the code.
//!
//! `docs/reference/cli.md` has a section per `idemkey` command (its heading is the command,
//! e.g. `` ## `idemkey keys list` ``) with a table `flag | environment variable | default |
//! accepted values | what it does`, and sections of shared flags (a heading of plain words,
//! e.g. `### Database flags`) that a command's section takes in by linking to them. Against
//! clap's command tree, every argument of every command has exactly one row, among its own and
//! its linked groups', and each row says:
//!
//! - the flag (`--name`) or, for a positional argument, its value name (`KEY`), first in code;
//! - the environment variable clap reads, in code, or `—`;
//! - clap's default first in code (`""` for an empty one), `off` for a switch, `—` without
//!   one; `required` when clap requires it;
//! - in the accepted values: a value enum's values, each in code, and nothing else in code;
//!   `repeatable` when the flag is; every range written `` `A` to `B` ``, `` at least `A` `` or
//!   `` at most `B` `` holds: clap accepts the bounds and refuses just past them.
//!
//! No row names an argument a command no longer has, and no section a command that is gone.
//!
//! `docs/reference/layer.md` has a table `setting | default | accepted values | what it does`:
//! one row per builder method of `IdempotencyLayer` (a `pub fn` taking `self` and returning
//! `Self`, read from `idemkey-tower/src/layer.rs`), and the defaults the layer exposes are
//! checked against its constants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use idemkey_server::cli::{Cli, parse_size};

mod doc_pages;

const CLI_PAGE: &str = "docs/reference/cli.md";
const LAYER_PAGE: &str = "docs/reference/layer.md";
const CLI_COLUMNS: [&str; 5] = [
    "flag",
    "environment variable",
    "default",
    "accepted values",
    "what it does",
];
const LAYER_COLUMNS: [&str; 4] = ["setting", "default", "accepted values", "what it does"];

/// A table row: its line (1-based) and its cells.
#[derive(Debug)]
struct Row {
    line: usize,
    cells: Vec<String>,
}

/// A heading and what follows it up to the next heading.
#[derive(Debug)]
struct Section {
    /// The heading's text, code marks dropped.
    title: String,
    line: usize,
    /// The header cells of its table (of the first, if several).
    columns: Vec<String>,
    rows: Vec<Row>,
    /// Same-page anchors its prose links to (`](#anchor)`).
    links: Vec<String>,
}

/// The text of `page`, one of the pages users read (so the other docs tests check it too).
fn read(page: &str) -> String {
    let path = doc_pages::root().join(page);
    assert!(
        doc_pages::pages().contains(&path),
        "{page} is not among the pages the docs tests read"
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The cells of a table line, split at unescaped `|`, trimmed, `\|` unescaped.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                chars.next();
                cells.last_mut().expect("a cell").push('|');
            }
            '|' => cells.push(String::new()),
            c => cells.last_mut().expect("a cell").push(c),
        }
    }
    cells.iter().map(|c| c.trim().to_owned()).collect()
}

/// The page's sections, outside fenced code blocks.
fn sections(text: &str) -> Vec<Section> {
    let lines: Vec<&str> = text.lines().collect();
    let mut sections: Vec<Section> = Vec::new();
    let mut fenced = false;
    for (i, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if line.starts_with('#') {
            let title = line.trim_start_matches('#').trim().replace('`', "");
            sections.push(Section {
                title,
                line: i + 1,
                columns: Vec::new(),
                rows: Vec::new(),
                links: Vec::new(),
            });
            continue;
        }
        let Some(section) = sections.last_mut() else {
            continue;
        };
        if line.trim_start().starts_with('|') {
            let is_separator = |l: &str| l.trim_start().starts_with("|-") || l.contains("|---");
            if is_separator(line) {
                continue;
            }
            if lines.get(i + 1).is_some_and(|next| is_separator(next)) {
                if section.columns.is_empty() {
                    section.columns = cells(line);
                }
                continue;
            }
            section.rows.push(Row {
                line: i + 1,
                cells: cells(line),
            });
        } else {
            let mut rest = *line;
            while let Some(at) = rest.find("](#") {
                rest = &rest[at + 3..];
                let end = rest.find(')').unwrap_or(rest.len());
                section.links.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
        }
    }
    sections
}

/// The texts of a cell's code spans, in order.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect()
}

/// The first code span, if the cell starts with one.
fn leading_code(cell: &str) -> Option<String> {
    cell.strip_prefix('`')
        .and_then(|rest| rest.split_once('`'))
        .map(|(code, _)| code.to_owned())
}

/// The anchor of a heading of plain words, as GitHub makes it.
fn anchor(title: &str) -> String {
    title.to_lowercase().replace(' ', "-")
}

/// What the reference must say about one argument.
#[derive(Debug)]
struct ArgFacts {
    /// `--name`, or a positional's value name.
    key: String,
    env: Option<String>,
    /// clap's default, joined by `,`; `None` without one.
    default: Option<String>,
    switch: bool,
    required: bool,
    repeatable: bool,
    /// A value enum's values (not a switch's `true`/`false`).
    values: Vec<String>,
    /// The argument as given on a command line: `--name` or nothing (positional).
    flag: Option<String>,
}

/// Every command with documented arguments: its path (`keys list`) and arguments (help,
/// version and hidden ones aside).
fn commands() -> Vec<(String, Vec<ArgFacts>)> {
    fn walk(cmd: &clap::Command, path: &str, found: &mut Vec<(String, Vec<ArgFacts>)>) {
        let args: Vec<ArgFacts> = cmd
            .get_arguments()
            .filter(|a| !a.is_hide_set() && !["help", "version"].contains(&a.get_id().as_str()))
            .map(|a| {
                let switch = matches!(a.get_action(), clap::ArgAction::SetTrue);
                let default: Vec<String> = a
                    .get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect();
                let positional_name = || {
                    a.get_value_names()
                        .and_then(|names| names.first())
                        .map(|n| n.to_string())
                        .unwrap_or_else(|| a.get_id().as_str().to_uppercase())
                };
                ArgFacts {
                    key: a
                        .get_long()
                        .map(|l| format!("--{l}"))
                        .unwrap_or_else(positional_name),
                    env: a.get_env().map(|e| e.to_string_lossy().into_owned()),
                    default: (!switch && !default.is_empty()).then(|| default.join(",")),
                    switch,
                    required: a.is_required_set(),
                    repeatable: matches!(a.get_action(), clap::ArgAction::Append),
                    values: if switch {
                        Vec::new()
                    } else {
                        a.get_possible_values()
                            .iter()
                            .filter(|v| !v.is_hide_set())
                            .map(|v| v.get_name().to_owned())
                            .collect()
                    },
                    flag: a.get_long().map(|l| format!("--{l}")),
                }
            })
            .collect();
        if !args.is_empty() {
            found.push((path.trim().to_owned(), args));
        }
        for sub in cmd.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()), found);
        }
    }
    let mut found = Vec::new();
    walk(&Cli::command(), "", &mut found);
    found
}

/// Whether clap takes `value` for the argument (`flag`, or a positional when `None`) of the
/// command at `path`: any error but a refused value counts as taken (a required argument
/// missing is found after every given value was parsed).
fn accepts(path: &str, flag: Option<&str>, value: &str) -> bool {
    let mut argv: Vec<String> = std::iter::once("idemkey")
        .chain(path.split(' '))
        .map(str::to_owned)
        .collect();
    argv.extend(flag.map(str::to_owned));
    argv.push(value.to_owned());
    match Cli::try_parse_from(&argv) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            ErrorKind::ValueValidation | ErrorKind::InvalidValue
        ),
    }
}

/// The values just below and just above a documented bound: an integer ±1, a duration ±1 ns,
/// a size ±1 byte; `None` where nothing is below (0).
fn around(bound: &str) -> Option<(Option<String>, String)> {
    if let Ok(n) = bound.parse::<u64>() {
        return Some((n.checked_sub(1).map(|n| n.to_string()), (n + 1).to_string()));
    }
    let step = |d: Duration| humantime::format_duration(d).to_string();
    if let Ok(d) = humantime::parse_duration(bound) {
        let below = d.checked_sub(Duration::from_nanos(1)).map(step);
        return Some((below, step(d + Duration::from_nanos(1))));
    }
    let n = parse_size(bound).ok()?;
    Some((n.checked_sub(1).map(|n| n.to_string()), (n + 1).to_string()))
}

/// The ranges an accepted-values cell states, as (lowest, highest) bounds: `` `A` to `B` ``,
/// `` at least `A` ``, `` at most `B` ``.
fn ranges(cell: &str) -> Vec<(Option<String>, Option<String>)> {
    let mut found = Vec::new();
    // Odd parts are code; the text between two of them says how they relate.
    let parts: Vec<&str> = cell.split('`').collect();
    let mut i = 1;
    while i < parts.len() {
        let before = parts[i - 1].trim_end();
        let code = parts[i].to_owned();
        if i + 2 < parts.len() && parts[i + 1].trim() == "to" {
            found.push((Some(code), Some(parts[i + 2].to_owned())));
            i += 4;
            continue;
        }
        if before.ends_with("at least") {
            found.push((Some(code), None));
        } else if before.ends_with("at most") {
            found.push((None, Some(code)));
        }
        i += 2;
    }
    found
}

/// What is wrong with `row` as the reference of `arg` of `idemkey PATH`.
fn check_row(path: &str, arg: &ArgFacts, row: &Row, problems: &mut Vec<String>) {
    let at = format!("{CLI_PAGE}:{}: `{}` (idemkey {path})", row.line, arg.key);
    let [_, env, default, accepted, _] = &row.cells[..] else {
        problems.push(format!("{at}: the row needs 5 cells: {:?}", row.cells));
        return;
    };
    let env_wanted = arg
        .env
        .as_ref()
        .map(|e| format!("`{e}`"))
        .unwrap_or_else(|| "—".to_owned());
    if *env != env_wanted {
        problems.push(format!(
            "{at}: its environment variable cell must be {env_wanted}, not {env:?}"
        ));
    }
    match (&arg.default, arg.switch) {
        (_, true) => {
            if !default.starts_with("off") {
                problems.push(format!(
                    "{at}: a switch: its default cell must start with `off`, not {default:?}"
                ));
            }
        }
        (Some(value), false) => {
            let wanted = if value.is_empty() { "\"\"" } else { value };
            if leading_code(default).as_deref() != Some(wanted) {
                problems.push(format!(
                    "{at}: its default is `{wanted}` in the code: start the default cell with `{wanted}` (in code), not {default:?}"
                ));
            }
        }
        (None, false) => {
            if !default.starts_with('—') {
                problems.push(format!(
                    "{at}: clap gives it no default: start the default cell with `—` (then say what happens without it), not {default:?}"
                ));
            }
        }
    }
    if arg.required != default.contains("required") {
        problems.push(format!(
            "{at}: it is {}required: the default cell must {}say `required`",
            if arg.required { "" } else { "not " },
            if arg.required { "" } else { "not " }
        ));
    }
    if arg.repeatable != accepted.contains("repeatable") {
        problems.push(format!(
            "{at}: it is {}repeatable: the accepted values cell must {}say `repeatable`",
            if arg.repeatable { "" } else { "not " },
            if arg.repeatable { "" } else { "not " }
        ));
    }
    if !arg.values.is_empty() {
        let shown = code_spans(accepted);
        if shown != arg.values {
            problems.push(format!(
                "{at}: it takes {} (in this order): list exactly these, each in code, in the accepted values cell, not {shown:?}",
                arg.values
                    .iter()
                    .map(|v| format!("`{v}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        return;
    }
    for (low, high) in ranges(accepted) {
        for (bound, is_low) in [(low, true), (high, false)] {
            let Some(bound) = bound else { continue };
            let Some((below, above)) = around(&bound) else {
                problems.push(format!(
                    "{at}: the bound `{bound}` is not an integer, a duration (e.g. 10ms) or a size (e.g. 1MiB)"
                ));
                continue;
            };
            if !accepts(path, arg.flag.as_deref(), &bound) {
                problems.push(format!(
                    "{at}: `{bound}` is documented as accepted, and is refused"
                ));
            }
            let past = if is_low { below } else { Some(above) };
            if let Some(past) = past
                && accepts(path, arg.flag.as_deref(), &past)
            {
                problems.push(format!(
                    "{at}: `{past}`, just past the documented bound `{bound}`, is accepted: fix the range"
                ));
            }
        }
    }
}

/// Every problem of the command-line reference.
fn cli_problems(text: &str) -> Vec<String> {
    let sections = sections(text);
    let mut problems = Vec::new();
    let mut groups: BTreeMap<String, &Section> = BTreeMap::new();
    let mut command_sections: BTreeMap<String, &Section> = BTreeMap::new();
    for section in &sections {
        let tabled = !section.columns.is_empty();
        if tabled && section.columns != CLI_COLUMNS {
            problems.push(format!(
                "{CLI_PAGE}:{}: the table's columns must be {CLI_COLUMNS:?}, not {:?}",
                section.line, section.columns
            ));
        }
        if let Some(path) = section.title.strip_prefix("idemkey ") {
            if command_sections.insert(path.to_owned(), section).is_some() {
                problems.push(format!(
                    "{CLI_PAGE}:{}: a second section for `idemkey {path}`",
                    section.line
                ));
            }
        } else if tabled {
            if !section
                .title
                .chars()
                .all(|c| c.is_alphanumeric() || c == ' ' || c == '-')
            {
                problems.push(format!(
                    "{CLI_PAGE}:{}: a group's heading is plain words (it is linked to)",
                    section.line
                ));
            }
            groups.insert(anchor(&section.title), section);
        }
    }
    let commands = commands();
    let mut used_groups = BTreeSet::new();
    for (path, args) in &commands {
        let Some(section) = command_sections.get(path.as_str()) else {
            problems.push(format!(
                "{CLI_PAGE}: add a section `## `idemkey {path}`` with a row for each of {}",
                args.iter()
                    .map(|a| a.key.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            continue;
        };
        let included: Vec<&Section> = section
            .links
            .iter()
            .filter_map(|link| groups.get(link).copied())
            .collect();
        used_groups.extend(
            section
                .links
                .iter()
                .filter(|l| groups.contains_key(*l))
                .cloned(),
        );
        // Every row the command's section takes in, with where it comes from.
        let rows: Vec<(&Section, &Row)> = std::iter::once(*section)
            .chain(included.iter().copied())
            .flat_map(|s| s.rows.iter().map(move |r| (s, r)))
            .collect();
        let key_of = |row: &Row| {
            row.cells
                .first()
                .and_then(|c| leading_code(c))
                .and_then(|c| c.split_whitespace().next().map(str::to_owned))
                .unwrap_or_default()
        };
        for arg in args {
            let matching: Vec<&(&Section, &Row)> =
                rows.iter().filter(|(_, r)| key_of(r) == arg.key).collect();
            match matching[..] {
                [] => problems.push(format!(
                    "{CLI_PAGE}, section `idemkey {path}` (line {}): add a row for `{}` (environment variable: {}; default: {})",
                    section.line,
                    arg.key,
                    arg.env.as_deref().unwrap_or("none"),
                    if arg.switch {
                        "off".to_owned()
                    } else {
                        arg.default.clone().map(|d| format!("`{d}`")).unwrap_or_else(|| "none".to_owned())
                    }
                )),
                [(_, row)] => check_row(path, arg, row, &mut problems),
                _ => problems.push(format!(
                    "{CLI_PAGE}, `idemkey {path}`: `{}` has {} rows (lines {:?}); keep one",
                    arg.key,
                    matching.len(),
                    matching.iter().map(|(_, r)| r.line).collect::<Vec<_>>()
                )),
            }
        }
        for (from, row) in &rows {
            let key = key_of(row);
            if !args.iter().any(|a| a.key == key) {
                let whose = if std::ptr::eq(*from, *section) {
                    String::new()
                } else {
                    format!(" (in the group `{}` it links to)", from.title)
                };
                problems.push(format!(
                    "{CLI_PAGE}:{}: `idemkey {path}` has no argument `{key}`{whose}: remove the row, or fix its first cell",
                    row.line
                ));
            }
        }
    }
    for (path, section) in &command_sections {
        let exists = commands.iter().any(|(p, _)| p == path);
        if !exists && !section.rows.is_empty() {
            problems.push(format!(
                "{CLI_PAGE}:{}: there is no command `idemkey {path}` with arguments: remove the section",
                section.line
            ));
        }
    }
    for (anchor, section) in &groups {
        if !used_groups.contains(anchor) {
            problems.push(format!(
                "{CLI_PAGE}:{}: no command's section links to the group `{}` (#{anchor}): link it or remove it",
                section.line, section.title
            ));
        }
    }
    problems
}

#[test]
fn the_command_line_reference_has_every_flag_of_every_command() {
    let problems = cli_problems(&read(CLI_PAGE));
    assert!(
        problems.is_empty(),
        "{CLI_PAGE} disagrees with the command line:\n{}",
        problems.join("\n")
    );
}

#[test]
fn a_missing_or_stale_row_is_reported() {
    let text = read(CLI_PAGE);
    let limit = text
        .lines()
        .find(|l| l.starts_with("| `--batch`"))
        .expect("the --batch row of keys purge");
    let without = text.replacen(&format!("{limit}\n"), "", 1);
    let problems = cli_problems(&without);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("`idemkey keys purge`") && p.contains("add a row for `--batch`")),
        "{problems:#?}"
    );
    let stale = text.replacen(limit, &limit.replace("--batch", "--batch-size"), 1);
    let problems = cli_problems(&stale);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("no argument `--batch-size`")),
        "{problems:#?}"
    );
    let wrong_default = text.replacen(limit, &limit.replace("`1000`", "`500`"), 1);
    assert!(
        cli_problems(&wrong_default)
            .iter()
            .any(|p| p.contains("its default is `1000`")),
    );
    let wrong_range = text.replacen(limit, &limit.replace("at least `1`", "at least `2`"), 1);
    assert!(
        cli_problems(&wrong_range)
            .iter()
            .any(|p| p.contains("just past the documented bound `2`")),
    );
}

#[test]
fn ranges_are_read_from_the_accepted_values_cell() {
    assert_eq!(
        ranges("a duration, `1ms` to `1day`; at most `10`, at least `2`"),
        [
            (Some("1ms".to_owned()), Some("1day".to_owned())),
            (None, Some("10".to_owned())),
            (Some("2".to_owned()), None),
        ]
    );
    assert_eq!(
        around("1ms"),
        Some((Some("999us 999ns".to_owned()), "1ms 1ns".to_owned()))
    );
    assert_eq!(around("0s").map(|(below, _)| below), Some(None));
    assert_eq!(
        around("1024MiB"),
        Some((Some("1073741823".to_owned()), "1073741825".to_owned()))
    );
}

/// The builder methods of `IdempotencyLayer`: each `pub fn` of `layer.rs` that takes `self`
/// and returns `Self`.
fn layer_settings() -> BTreeSet<String> {
    let path = doc_pages::root().join("idemkey-tower/src/layer.rs");
    let source = std::fs::read_to_string(&path).expect("read idemkey-tower/src/layer.rs");
    let mut found = BTreeSet::new();
    let mut rest = source.as_str();
    while let Some(at) = rest.find("pub fn ") {
        rest = &rest[at + "pub fn ".len()..];
        let end = rest.find('{').unwrap_or(rest.len());
        let signature: String = rest[..end].split_whitespace().collect::<Vec<_>>().join(" ");
        let name: String = signature
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let params = signature
            .split_once('(')
            .map_or("", |(_, p)| p.trim_start());
        let takes_self = params.starts_with("self") || params.starts_with("mut self");
        if takes_self && signature.ends_with("-> Self") {
            found.insert(name);
        }
    }
    found
}

#[test]
fn the_layer_reference_has_every_setting_with_its_default() {
    use idemkey_core::FirstSentPolicy;
    use idemkey_tower::{InFlightPolicy, KeyRequirement};

    let text = read(LAYER_PAGE);
    let sections = sections(&text);
    let table = sections
        .iter()
        .find(|s| s.columns == LAYER_COLUMNS)
        .unwrap_or_else(|| panic!("{LAYER_PAGE}: no table with the columns {LAYER_COLUMNS:?}"));
    let method_of = |row: &Row| {
        let code = row
            .cells
            .first()
            .and_then(|c| leading_code(c))
            .unwrap_or_default();
        code.trim_start_matches('.')
            .split('(')
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let documented: BTreeMap<String, &Row> = table.rows.iter().map(|r| (method_of(r), r)).collect();
    let settings = layer_settings();
    assert!(
        settings.len() > 10,
        "the scan of layer.rs found {settings:?}"
    );
    let mut problems = Vec::new();
    for setting in &settings {
        if !documented.contains_key(setting) {
            problems.push(format!("{LAYER_PAGE}: add a row for `.{setting}(…)`"));
        }
    }
    for (method, row) in &documented {
        if !settings.contains(method) {
            problems.push(format!(
                "{LAYER_PAGE}:{}: `IdempotencyLayer` has no setting `.{method}`: remove the row",
                row.line
            ));
        }
    }

    // The defaults the layer exposes.
    let in_flight = match InFlightPolicy::default() {
        InFlightPolicy::Wait(d) => d,
        InFlightPolicy::Reject => panic!("the default in-flight policy is no longer a wait"),
    };
    let defaults = [
        (
            "requirement",
            LayerDefault::Named(format!("{:?}", KeyRequirement::default())),
        ),
        ("in_flight", LayerDefault::Wait(in_flight)),
        (
            "retention",
            LayerDefault::Duration(idemkey_tower::DEFAULT_RETENTION),
        ),
        (
            "first_sent",
            LayerDefault::Named(format!("{:?}", FirstSentPolicy::default().requirement)),
        ),
        (
            "first_sent_skew",
            LayerDefault::Duration(FirstSentPolicy::DEFAULT_SKEW),
        ),
        (
            "max_request_body",
            LayerDefault::Size(idemkey_tower::DEFAULT_MAX_REQUEST_BODY),
        ),
        (
            "max_stored_response",
            LayerDefault::Size(idemkey_tower::DEFAULT_MAX_STORED_RESPONSE),
        ),
        (
            "replay_cache",
            LayerDefault::Count(idemkey_tower::REPLAY_CACHE_DEFAULT_ENTRIES),
        ),
    ];
    for (method, default) in &defaults {
        let Some(row) = documented.get(*method) else {
            continue;
        };
        let cell = row.cells.get(1).map(String::as_str).unwrap_or("");
        if !leading_code(cell).is_some_and(|code| default.is(&code)) {
            problems.push(format!(
                "{LAYER_PAGE}:{}: the default of `.{method}` is `{}` in the code: start its default cell with it (in code), not {cell:?}",
                row.line,
                default.shown()
            ));
        }
    }
    if let Some(row) = documented.get("replay_cache") {
        let bytes = size_text(idemkey_tower::REPLAY_CACHE_MAX_BYTES);
        if !row.cells.iter().any(|c| code_spans(c).contains(&bytes)) {
            problems.push(format!(
                "{LAYER_PAGE}:{}: the replay cache holds at most `{bytes}`: say so in its row",
                row.line
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{LAYER_PAGE} disagrees with the layer:\n{}",
        problems.join("\n")
    );
}

/// A default of the layer, as its page's default cell writes it.
enum LayerDefault {
    /// A variant's name, e.g. `Required`.
    Named(String),
    /// `Wait(5s)`.
    Wait(Duration),
    /// A duration, e.g. `24h`.
    Duration(Duration),
    /// A size, e.g. `1MiB`.
    Size(usize),
    /// A count, e.g. `100000`.
    Count(usize),
}

impl LayerDefault {
    /// Whether `code`, the cell's leading code, says this default.
    fn is(&self, code: &str) -> bool {
        let duration = |s: &str, d: Duration| humantime::parse_duration(s).ok() == Some(d);
        match self {
            Self::Named(name) => code == name,
            Self::Wait(d) => code
                .strip_prefix("Wait(")
                .and_then(|s| s.strip_suffix(')'))
                .is_some_and(|s| duration(s, *d)),
            Self::Duration(d) => duration(code, *d),
            Self::Size(n) => parse_size(code) == Ok(*n),
            Self::Count(n) => code.parse() == Ok(*n),
        }
    }

    /// The default as the page may write it.
    fn shown(&self) -> String {
        match self {
            Self::Named(name) => name.clone(),
            Self::Wait(d) => format!("Wait({})", humantime::format_duration(*d)),
            Self::Duration(d) => humantime::format_duration(*d).to_string(),
            Self::Size(n) => size_text(*n),
            Self::Count(n) => n.to_string(),
        }
    }
}

/// A size as the docs write it: `64MiB`, `1KiB`, or bytes.
fn size_text(n: usize) -> String {
    match n {
        n if n % (1024 * 1024) == 0 => format!("{}MiB", n / (1024 * 1024)),
        n if n % 1024 == 0 => format!("{}KiB", n / 1024),
        n => n.to_string(),
    }
}
