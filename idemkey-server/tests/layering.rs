//! The library's layering (STYLE.md 10): clap's argument types live in `cli.rs` and the
//! binary alone. The library's modules take options of their own, which `cli.rs` converts
//! the parsed command line into, so they are usable (and testable) without a command line.

use std::path::{Path, PathBuf};

/// What a module that knows the command line names.
const CLAP: [&str; 3] = ["clap::", "crate::cli", "idemkey_server::cli"];

/// Every `.rs` file under `dir`, as paths relative to `root`, sorted.
fn sources(root: &Path, dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(root, &path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path.strip_prefix(root).expect("under the root").to_owned());
        }
    }
    found.sort();
}

/// The crate's `src/`, read at run time: `CARGO_MANIFEST_DIR` names the package the test
/// runs for.
fn src() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").expect("run by cargo");
    PathBuf::from(manifest).join("src")
}

/// The files under `src/` whose text (comments aside) contains one of `needles`, with the
/// first it contains.
fn naming(needles: &[&str]) -> Vec<(String, String)> {
    let root = src();
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    assert!(
        files.len() > 10,
        "no sources found under {}",
        root.display()
    );
    files
        .iter()
        .filter_map(|file| {
            let text = std::fs::read_to_string(root.join(file)).expect("read a source file");
            let code: String = text
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let name = file.to_string_lossy().replace('\\', "/");
            needles
                .iter()
                .find(|needle| code.contains(**needle))
                .map(|needle| (name, (*needle).to_owned()))
        })
        .collect()
}

#[test]
fn clap_types_stay_in_the_command_line_module() {
    let found = naming(&CLAP);
    let outside: Vec<&(String, String)> = found
        .iter()
        .filter(|(file, _)| !["cli.rs", "main.rs"].contains(&file.as_str()))
        .collect();
    assert!(
        outside.is_empty(),
        "library modules that name the command line's types (take options of their own, \
         converted in cli.rs): {outside:?}"
    );
}

/// What telling a database kind apart, or opening a kind's store, reads like.
const PICKS_A_STORE: [&str; 5] = [
    "starts_with(\"sqlite",
    "starts_with(\"postgres",
    "PgStore::connect(",
    "RusqliteStore::open",
    "SqliteStore::DEFAULT_BUSY_TIMEOUT",
];

#[test]
fn one_module_tells_database_kinds_apart() {
    let found = naming(&PICKS_A_STORE);
    let outside: Vec<&(String, String)> =
        found.iter().filter(|(file, _)| file != "db.rs").collect();
    assert!(
        outside.is_empty(),
        "modules that tell a database kind by its URL or open a kind's store themselves \
         (db.rs's `with_database` is the one place): {outside:?}"
    );
    assert!(
        found.iter().any(|(file, _)| file == "db.rs"),
        "db.rs no longer picks the stores: {found:?}"
    );
}
