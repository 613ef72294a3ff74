//! The release binary links no test-support code (STYLE.md 13): `idemkey-testkit` may appear
//! only under `[dev-dependencies]`, never among the server's normal dependencies, direct or
//! transitive.

use std::process::Command;

#[test]
fn release_dependencies_do_not_include_the_test_kit() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "idemkey-server",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "cargo tree failed:\n{stderr}");
    let tree = String::from_utf8_lossy(&output.stdout);
    // An empty or unrelated listing would make the check below pass vacuously.
    assert!(
        tree.lines().any(|line| line.starts_with("idemkey-server ")),
        "unexpected cargo tree output:\n{tree}"
    );
    let test_kit: Vec<&str> = tree
        .lines()
        .filter(|line| line.starts_with("idemkey-testkit "))
        .collect();
    assert!(
        test_kit.is_empty(),
        "the release binary depends on the test kit: {test_kit:?}; \
         idemkey-testkit belongs under [dev-dependencies] only"
    );
}
