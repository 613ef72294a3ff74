//! The Markdown pages users read, for the tests that check them: the README, the
//! contributors' guide and every page under `docs/`, however deep.

use std::path::{Path, PathBuf};

/// The workspace's root.
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_owned()
}

/// The README and `CONTRIBUTING.md`, then every `.md` under `docs/`, sorted.
pub(crate) fn pages() -> Vec<PathBuf> {
    let mut docs = Vec::new();
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/") {
            let path = entry.expect("docs/ entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "md") {
                docs.push(path);
            }
        }
    }
    docs.sort();
    [
        vec![root().join("README.md"), root().join("CONTRIBUTING.md")],
        docs,
    ]
    .concat()
}
