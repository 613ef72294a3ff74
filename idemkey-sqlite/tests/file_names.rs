//! A store names its file by its path: a `%` or `?` in the name is part of it, for the
//! store and for the migrations run on the same file.

use idemkey_sqlite::RusqliteStore;

#[tokio::test]
async fn migrations_run_on_the_file_the_store_names_whatever_its_characters() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for name in ["a%41.db", "b?mode=ro.db", "c%3Fx.db"] {
        let path = dir.path().join(name);
        let store = RusqliteStore::open(&path).expect("the store opens");
        store.migrate().await.expect("the migrations run");
        let tables: i64 = store
            .with_connection(|c| {
                c.query_row(
                    "SELECT count(*) FROM sqlite_master WHERE name = 'idemkey_records'",
                    [],
                    |r| r.get(0),
                )
            })
            .expect("the store reads its file");
        assert_eq!(tables, 1, "{name}: the migrations ran on another file");
    }
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .expect("the directory lists")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| !n.ends_with("-wal") && !n.ends_with("-shm"))
        .collect();
    files.sort();
    assert_eq!(files, ["a%41.db", "b?mode=ro.db", "c%3Fx.db"]);
}
