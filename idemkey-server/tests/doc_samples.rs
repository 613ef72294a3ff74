//! The pages read on a forge as they are compiled and run: a Rust sample hides no line (a
//! forge shows rustdoc's `# use …` as written, so each sample is whole, `use` lines and
//! `main` in sight); the README stays a short front door; and `CONTRIBUTING.md` names every
//! package CI installs for the test suite.

use std::path::Path;

mod doc_pages;

use doc_pages::{pages, root};

/// The attributes rustdoc reads in a code block's info string; a block whose info string
/// has only these (or none) is Rust to rustdoc.
const RUSTDOC_ATTRIBUTES: &[&str] = &[
    "rust",
    "no_run",
    "ignore",
    "should_panic",
    "compile_fail",
    "test_harness",
    "standalone_crate",
];

/// Whether rustdoc takes a code block with this info string for Rust.
fn is_rust(info: &str) -> bool {
    info.split(',').map(str::trim).all(|word| {
        word.is_empty() || RUSTDOC_ATTRIBUTES.contains(&word) || word.starts_with("edition")
    })
}

/// The lines of the page's Rust code blocks, numbered from 1.
fn rust_lines(text: &str) -> Vec<(usize, &str)> {
    let mut lines = Vec::new();
    let mut block: Option<bool> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            block = match block {
                Some(_) => None,
                None => Some(is_rust(info)),
            };
        } else if block == Some(true) {
            lines.push((n + 1, line));
        }
    }
    lines
}

/// Whether rustdoc hides this line of a sample: `#` alone, or `# ` and the rest.
fn hidden(line: &str) -> bool {
    let line = line.trim_start();
    line == "#" || line.starts_with("# ")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn rust_samples_hide_no_line() {
    let mut found = Vec::new();
    for page in pages() {
        let name = page
            .strip_prefix(root())
            .unwrap_or(&page)
            .display()
            .to_string();
        for (n, line) in rust_lines(&read(&page)) {
            if hidden(line) {
                found.push(format!("{name}:{n}: {line}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a forge shows these lines rustdoc hides; write the sample whole instead:\n{}",
        found.join("\n")
    );
}

#[test]
fn readme_is_under_200_lines() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines < 200,
        "README.md has {lines} lines: it is the front door, the guide lives in docs/"
    );
}

#[test]
fn contributing_names_every_package_ci_installs() {
    let ci = read(&root().join(".ci/run"));
    let packages: Vec<&str> = ci
        .lines()
        .filter_map(|line| line.trim().strip_prefix("apt_install "))
        .flat_map(str::split_whitespace)
        .collect();
    assert!(
        packages.contains(&"postgresql"),
        "no `apt_install` line found in .ci/run: {packages:?}"
    );
    let contributing = read(&root().join("CONTRIBUTING.md"));
    let missing: Vec<&&str> = packages
        .iter()
        .filter(|package| !contributing.contains(&format!("`{package}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "CONTRIBUTING.md does not name these packages .ci/run installs: {missing:?}"
    );
}

#[test]
fn rust_blocks_are_told_apart() {
    let page = "```rust,no_run\n# use a;\n```\n```sh\n# comment\n```\n```\nlet x = 1;\n```\n";
    assert_eq!(rust_lines(page), vec![(2, "# use a;"), (8, "let x = 1;")]);
    assert!(hidden("    # fn main() {}") && hidden("#") && !hidden("#[tokio::main]"));
}
