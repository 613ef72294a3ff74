//! Where the key secret comes from: a flag, the environment or a file, kept apart from the
//! keyed hashes it protects; in the database only on SQLite's convenience default or when
//! told with `--key-secret-in-database`. Operator commands never create one.

use std::path::Path;

use anyhow::Context;
use idemkey_core::KeyHasher;
use idemkey_tower::IdempotencyLayer;
use rand::RngCore;

use crate::AppDb;
use crate::gateway::GatewayDb;

/// Where the key secret and, during a rotation, the previous one are given: each as a value
/// or as a file holding it (its trailing newline ignored), never both.
#[derive(Debug, Clone, Default)]
pub struct KeySecretSource {
    /// The secret keys are hashed (and the gateway's raw keys sealed) with.
    pub key_secret: Option<SecretString>,
    /// A file holding the key secret.
    pub key_secret_file: Option<std::path::PathBuf>,
    /// The secret used before `key_secret`, still accepted for look-ups.
    pub previous_key_secret: Option<SecretString>,
    /// A file holding the previous key secret.
    pub previous_key_secret_file: Option<std::path::PathBuf>,
}

/// The `server_settings` row a database-kept secret lives in.
const SETTING: &str = "key_hash_secret";

/// How the flags name the ways to give a secret, for error messages.
const THE_FLAGS: &str = "--key-secret (or IDEMKEY_KEY_SECRET) or --key-secret-file PATH";

/// The current key secret and, during a rotation, the previous one.
#[derive(Clone)]
pub struct KeySecrets {
    current: Vec<u8>,
    previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for KeySecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySecrets(..)")
    }
}

impl KeySecrets {
    /// Secrets given directly (tests, the demo).
    pub fn new(current: impl Into<Vec<u8>>, previous: Option<Vec<u8>>) -> Self {
        Self {
            current: current.into(),
            previous,
        }
    }

    /// The current secret: new records are hashed (and sealed) with it.
    pub fn current(&self) -> &[u8] {
        &self.current
    }

    /// The previous secret, accepted for look-ups.
    pub fn previous(&self) -> Option<&[u8]> {
        self.previous.as_deref()
    }

    /// The hasher of the current secret.
    pub fn hasher(&self) -> KeyHasher {
        KeyHasher::new(&self.current)
    }

    /// The hasher of the previous secret.
    pub fn previous_hasher(&self) -> Option<KeyHasher> {
        self.previous.as_deref().map(KeyHasher::new)
    }

    /// A layer on `store` that hashes keys with the current secret and, during a rotation,
    /// still finds records made under the previous one.
    pub fn layer<S>(&self, store: S) -> IdempotencyLayer<S> {
        let layer = IdempotencyLayer::new(store, self.hasher());
        match self.previous_hasher() {
            Some(previous) => layer.previous_key_hasher(previous),
            None => layer,
        }
    }
}

/// Who asks for the secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretUse {
    /// `serve` or `gateway`: may keep a secret in the database, on SQLite by default (with a
    /// warning), on PostgreSQL and MySQL only with `--key-secret-in-database`.
    Start {
        /// `--key-secret-in-database`.
        in_database: bool,
    },
    /// An operator command: reads a database-kept secret if there is one, never makes one.
    Open,
}

/// A URL as messages show it: its password and credential query parameters hidden.
pub(crate) use idemkey_core::redact_url as redacted;

/// The shortest key secret `serve`, `gateway` and `keys` accept, in bytes.
pub const MIN_SECRET_LEN: usize = 32;

/// A secret given on the command line or in the environment (a key secret, an API token, a
/// webhook URL): its `Debug` shows `***`, so that printing a configuration never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretString(String);

impl SecretString {
    /// The secret itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for SecretString {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl std::str::FromStr for SecretString {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

/// A URL that may carry credentials (a database's or a NATS server's): used as the text it
/// is (it dereferences to `str`), but its `Debug` shows it [redacted](idemkey_core::redact_url).
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL itself, credentials included.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl std::ops::Deref for SecretUrl {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for SecretUrl {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl std::str::FromStr for SecretUrl {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl std::fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", redacted(&self.0))
    }
}

fn no_secret_to_start(url: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "no key secret: on a database server the secret must live apart from the keyed \
         hashes in `{url}`; pass {THE_FLAGS}, or --key-secret-in-database to keep it in the \
         database anyway"
    )
}

/// `serve` and `gateway`, before they connect to `url`, whose store is `S`: on a database
/// that is not embedded (PostgreSQL, MySQL), a secret must be given unless
/// `--key-secret-in-database` says to keep it there. Fails fast, before any migration.
pub fn check_before_start<S: GatewayDb>(
    url: &str,
    args: &KeySecretSource,
    in_database: bool,
) -> anyhow::Result<()> {
    if !S::EMBEDDED && args.key_secret.is_none() && args.key_secret_file.is_none() && !in_database {
        return Err(no_secret_to_start(&redacted(url)));
    }
    check_given(args)
}

/// Every command that takes a key secret, before it opens anything: a given secret must be
/// readable and at least [`MIN_SECRET_LEN`] bytes long.
pub fn check_given(args: &KeySecretSource) -> anyhow::Result<()> {
    given_secrets(args).map(drop)
}

/// A secret's bytes.
type Secret = Vec<u8>;

/// The secrets `args` give: the current one (at least [`MIN_SECRET_LEN`] bytes) and the
/// previous one. The previous one may be shorter: rotating away from a short secret is how
/// an installation gets a long one.
fn given_secrets(args: &KeySecretSource) -> anyhow::Result<(Option<Secret>, Option<Secret>)> {
    let current = given(
        args.key_secret.as_ref().map(SecretString::expose),
        args.key_secret_file.as_deref(),
        "key-secret",
    )?;
    if let Some(secret) = &current
        && secret.len() < MIN_SECRET_LEN
    {
        anyhow::bail!(
            "the key secret is {} bytes long; it must be at least {MIN_SECRET_LEN} random bytes. \
             Make one with `openssl rand -hex 32` or `head -c 32 /dev/urandom | base64`",
            secret.len()
        );
    }
    let previous = given(
        args.previous_key_secret.as_ref().map(SecretString::expose),
        args.previous_key_secret_file.as_deref(),
        "previous-key-secret",
    )?;
    Ok((current, previous))
}

/// A secret from its flag or its file; both at once is an error.
fn given(value: Option<&str>, file: Option<&Path>, flag: &str) -> anyhow::Result<Option<Vec<u8>>> {
    let secret = match (value, file) {
        (Some(_), Some(_)) => {
            anyhow::bail!("give either --{flag} (or its environment variable) or --{flag}-file")
        }
        (Some(value), None) => value.as_bytes().to_vec(),
        (None, Some(path)) => {
            let mut bytes = std::fs::read(path)
                .with_context(|| format!("cannot read --{flag}-file {}", path.display()))?;
            while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                bytes.pop();
            }
            bytes
        }
        (None, None) => return Ok(None),
    };
    if secret.is_empty() {
        anyhow::bail!("the --{flag} is empty");
    }
    Ok(Some(secret))
}

/// What `serve` does with its database before it starts: run the migrations, then read (or,
/// where allowed, make) the key secrets it serves with. (`gateway` runs only idemkey's and
/// the settings' migrations first.)
pub async fn migrate_for_start<S: AppDb>(
    db: &S,
    url: &str,
    args: &KeySecretSource,
    in_database: bool,
) -> anyhow::Result<KeySecrets> {
    db.migrate_all().await.context("migrations failed")?;
    key_secrets(db, url, args, SecretUse::Start { in_database }).await
}

/// The key secrets for `db` (at `url`), as `args` and `usage` say.
///
/// A given secret wins. Without one, `serve`/`gateway` keep (or make) one in the database
/// where allowed, and operator commands read the database-kept one or fail. The previous
/// secret is the given one, or else, when a secret is given and the database keeps another
/// (a secret being moved out of the database), the database-kept one.
pub async fn key_secrets<S: GatewayDb>(
    db: &S,
    url: &str,
    args: &KeySecretSource,
    usage: SecretUse,
) -> anyhow::Result<KeySecrets> {
    let url = redacted(url);
    let (given_current, given_previous) = given_secrets(args)?;
    let stored = db
        .setting(SETTING)
        .await
        .with_context(|| format!("cannot read the key secret kept in `{url}`"))?;
    let current = match (given_current.clone(), usage) {
        (Some(secret), _) => secret,
        (None, SecretUse::Open) => stored.clone().with_context(|| {
            format!(
                "no key secret: none was given and `{url}` keeps none (a server started with \
                 a given secret keeps none there); pass {THE_FLAGS} with the secret \
                 `idemkey serve` uses"
            )
        })?,
        (None, SecretUse::Start { in_database }) => {
            if !S::EMBEDDED && !in_database {
                return Err(no_secret_to_start(&url));
            }
            let secret = match stored.clone() {
                Some(secret) => secret,
                None => {
                    let mut fresh = [0u8; 32];
                    rand::thread_rng().fill_bytes(&mut fresh);
                    db.setting_or_init(SETTING, &fresh)
                        .await
                        .context("cannot store the key secret")?
                }
            };
            if !in_database {
                eprintln!(
                    "warning: the key secret is kept in `{url}`, beside the keyed hashes it \
                     protects: a copy of the database holds both. To move it out, start with \
                     {THE_FLAGS}; records made under the database-kept secret stay reachable \
                     until they expire (docs/guide/operating.md, \"Key secret\")."
                );
            }
            secret
        }
    };
    let previous = match given_previous {
        Some(previous) => Some(previous),
        // Moving a database-kept secret out: it is the previous one.
        None if given_current.is_some() => stored.filter(|s| *s != current),
        None => None,
    };
    if previous.as_ref() == Some(&current) {
        anyhow::bail!("the previous key secret is the same as the current one");
    }
    Ok(KeySecrets { current, previous })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_secret_files_without_their_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "s3cret\n").unwrap();
        assert_eq!(
            given(None, Some(&path), "key-secret").unwrap().as_deref(),
            Some(&b"s3cret"[..])
        );
        assert!(given(Some("a"), Some(&path), "key-secret").is_err());
        std::fs::write(&path, "\n").unwrap();
        assert!(given(None, Some(&path), "key-secret").is_err());
        assert_eq!(given(None, None, "key-secret").unwrap(), None);
    }
}
