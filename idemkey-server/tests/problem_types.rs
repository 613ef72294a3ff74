//! `docs/guide/contract.md` against every declared list of problem types: the registry of
//! `idemkey_core::problem` (the contract's and the gateway's), the HTTP server's
//! (`idemkey_server::problem::HTTP_SERVER`) and the payments API's own
//! (`idemkey_server::problem::PAYMENTS`): the same types, and in its tables the same status and
//! the same retry answer for each.

use std::collections::BTreeSet;

use idemkey_core::problem::{self, PROBLEM_TYPE_PREFIX, ProblemType};

fn contract() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/guide/contract.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// Every problem name the text mentions as `urn:idemkey:problem:NAME`.
fn mentioned(doc: &str) -> BTreeSet<&str> {
    doc.match_indices(PROBLEM_TYPE_PREFIX)
        .map(|(at, prefix)| {
            let rest = &doc[at + prefix.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// One row of a problem table: the type's name and the cells of its row by column title.
struct Row<'d> {
    line: usize,
    name: &'d str,
    status: Option<&'d str>,
    retry: Option<&'d str>,
}

/// The rows of every table whose first column is `type`.
fn rows(doc: &str) -> Vec<Row<'_>> {
    let mut header: Option<Vec<&str>> = None;
    let mut rows = Vec::new();
    for (i, line) in doc.lines().enumerate() {
        if !line.starts_with('|') {
            header = None;
            continue;
        }
        let cells = cells_of(line);
        match &header {
            None => header = Some(cells),
            Some(h) if h.first() == Some(&"type") => {
                let Some(name) = cells
                    .first()
                    .and_then(|c| c.strip_prefix('`'))
                    .and_then(|c| c.strip_suffix('`'))
                    .and_then(|c| c.strip_prefix(PROBLEM_TYPE_PREFIX))
                else {
                    continue; // the |---| line
                };
                let column = |title: &str| {
                    let at = h.iter().position(|t| *t == title)?;
                    cells.get(at).copied()
                };
                rows.push(Row {
                    line: i + 1,
                    name,
                    status: column("status"),
                    retry: column("retry?"),
                });
            }
            Some(_) => {}
        }
    }
    rows
}

fn cells_of(line: &str) -> Vec<&str> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(str::trim).collect()
}

/// Every declared problem type: the registry's lists, then the HTTP server's and the
/// payments API's.
fn declared() -> impl Iterator<Item = &'static ProblemType> {
    problem::REGISTRY
        .iter()
        .copied()
        .chain([
            idemkey_server::problem::HTTP_SERVER,
            idemkey_server::problem::PAYMENTS,
        ])
        .flatten()
}

/// What the doc and the declarations disagree on (empty: they agree).
fn discrepancies(doc: &str) -> Vec<String> {
    let mut found = Vec::new();
    let registry: BTreeSet<&str> = declared().map(|p| p.name).collect();
    for name in mentioned(doc) {
        if !registry.contains(name) {
            found.push(format!("the doc names `{name}`, which the registry lacks"));
        }
    }
    let rows = rows(doc);
    for p in declared() {
        let listed: Vec<&Row<'_>> = rows.iter().filter(|r| r.name == p.name).collect();
        let row = match listed[..] {
            [] => {
                found.push(format!("the registry has `{}`; no table lists it", p.name));
                continue;
            }
            [row] => row,
            _ => {
                found.push(format!("`{}` is listed more than once", p.name));
                continue;
            }
        };
        let status = p.status.to_string();
        if row.status != Some(status.as_str()) {
            found.push(format!(
                "line {}: `{}` has status {:?} in the doc, {status} in the registry",
                row.line, p.name, row.status
            ));
        }
        match row.retry {
            None => found.push(format!(
                "line {}: the table of `{}` has no retry? column",
                row.line, p.name
            )),
            Some(text) if text.starts_with("yes") != p.retry => found.push(format!(
                "line {}: `{}` says retry {text:?} in the doc, retry: {} in the registry",
                row.line, p.name, p.retry
            )),
            Some(_) => {}
        }
    }
    found
}

#[test]
fn the_contract_lists_exactly_the_registered_problem_types() {
    let found = discrepancies(&contract());
    assert!(
        found.is_empty(),
        "docs/guide/contract.md and the declared problem types disagree:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_catches_a_missing_row_a_wrong_status_a_wrong_retry_and_an_unknown_type() {
    let doc = contract();
    let disagree = |doc: &str, what: &str| {
        let found = discrepancies(doc);
        assert!(
            found.iter().any(|f| f.contains(what)),
            "expected a discrepancy about {what}, got {found:?}"
        );
    };

    let row = |name: &str| {
        doc.lines()
            .find(|l| l.starts_with(&format!("| `{PROBLEM_TYPE_PREFIX}{name}`")))
            .unwrap()
            .to_owned()
    };

    let without = doc.replace(&format!("{}\n", row("key-reused")), "");
    disagree(&without, "the registry has `key-reused`; no table lists it");

    let declined = doc.replace(&format!("{}\n", row("payment-declined")), "");
    disagree(
        &declined,
        "the registry has `payment-declined`; no table lists it",
    );

    let wrong_status = doc.replace(
        &row("upstream-outcome-unknown"),
        &row("upstream-outcome-unknown").replace("| 504 |", "| 500 |"),
    );
    disagree(&wrong_status, "`upstream-outcome-unknown` has status");

    let retried = doc.replace(
        &row("response-too-large"),
        &row("response-too-large").replace("| no: the same", "| yes: the same"),
    );
    disagree(&retried, "`response-too-large` says retry");

    let unknown = format!("{doc}\nSee also `{PROBLEM_TYPE_PREFIX}made-up`.\n");
    disagree(&unknown, "the doc names `made-up`");
}
