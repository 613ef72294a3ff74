//! A TCP proxy for PostgreSQL's wire protocol that cuts connections around a `COMMIT`.
//!
//! [`PgFaultProxy`] sits between a PostgreSQL client (a connection pool) and the server and
//! copies bytes both ways. It reads the client's messages (protocol 3.0) just enough to see
//! a simple-query `COMMIT`; when a cut is armed ([`PgFaultProxy::cut_commits`]), it closes
//! both connections around that `COMMIT` as [`CommitCut`] says, so the client cannot know
//! whether its transaction committed. Everything else passes through untouched.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use idemkey_fault_proxy::accept_loop;

/// Where, around an armed `COMMIT`, a [`PgFaultProxy`] cuts the client's connection (and its
/// own connection to the server).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CommitCut {
    /// Before the `COMMIT` is forwarded: the server never sees it and rolls the transaction
    /// back when the connection closes.
    BeforeSend,
    /// Right after the `COMMIT` was forwarded, before any reply: the server has it in its
    /// socket and normally commits, but the client never hears.
    AfterSend,
    /// After the server's reply to the `COMMIT` arrived (the commit happened), which is
    /// withheld: the client never hears.
    AfterReply,
}

/// Counts of what a [`PgFaultProxy`] did, as returned by [`PgFaultProxy::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PgProxyStats {
    /// Client connections accepted.
    pub connections: u64,
    /// `COMMIT` messages seen from clients (cut or not).
    pub commits: u64,
    /// Connections cut around a `COMMIT`.
    pub commits_cut: u64,
    /// Connections cut by [`PgFaultProxy::cut_all`].
    pub connections_cut: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    commits: AtomicU64,
    commits_cut: AtomicU64,
    connections_cut: AtomicU64,
}

struct Shared {
    upstream: SocketAddr,
    counters: Counters,
    /// `COMMIT`s still to cut, and how.
    armed: std::sync::Mutex<(u64, CommitCut)>,
    /// Bumped on every cut, so [`PgFaultProxy::until_cut`] can wait without polling.
    cuts: watch::Sender<u64>,
    /// Bumped by [`PgFaultProxy::cut_all`]: every open connection closes.
    generation: watch::Sender<u64>,
}

impl Shared {
    /// Whether the `COMMIT` just seen is to be cut, and how (consumes one armed cut).
    fn take_cut(&self) -> Option<CommitCut> {
        let mut armed = self
            .armed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if armed.0 == 0 {
            return None;
        }
        armed.0 -= 1;
        Some(armed.1)
    }

    fn cut_done(&self) {
        self.counters.commits_cut.fetch_add(1, Ordering::Relaxed);
        self.cuts.send_modify(|n| *n += 1);
    }
}

/// A TCP proxy on `127.0.0.1` in front of one PostgreSQL server, which can cut a client's
/// connection right around a `COMMIT` (see [`CommitCut`]) or all connections at once.
///
/// It parses the client's side of the protocol only to find message boundaries and
/// simple-query `COMMIT`s (the way sqlx and libpq commit); the server's side is copied as is.
/// A session that negotiates TLS or GSS encryption is copied blind and never cut. Point the
/// client at [`addr`](Self::addr) (use `sslmode=disable` or a server without TLS).
///
/// ```
/// use idemkey_testkit::{CommitCut, PgFaultProxy};
///
/// # async fn example(postgres: std::net::SocketAddr) -> std::io::Result<()> {
/// let proxy = PgFaultProxy::start(postgres).await?;
/// // Connect the application to `proxy.addr()` instead of `postgres`, then:
/// proxy.cut_commits(CommitCut::AfterSend, 1); // the next COMMIT is sent, its answer lost
/// # Ok(())
/// # }
/// ```
///
/// Dropping the proxy stops accepting connections and closes every connection in progress.
pub struct PgFaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl PgFaultProxy {
    /// Starts a proxy on `127.0.0.1` (an ephemeral port) forwarding to `upstream`.
    ///
    /// Must be called within a Tokio runtime; the proxy runs on spawned tasks.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<PgFaultProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            counters: Counters::default(),
            armed: std::sync::Mutex::new((0, CommitCut::AfterSend)),
            cuts: watch::channel(0).0,
            generation: watch::channel(0).0,
        });
        let served = Arc::clone(&shared);
        let accept = tokio::spawn(accept_loop(listener, move |stream| {
            serve(stream, Arc::clone(&served))
        }));
        Ok(PgFaultProxy {
            addr,
            shared,
            accept,
        })
    }

    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Arms the next `count` `COMMIT`s (on any connection) to be cut as `how` says; replaces
    /// what was armed before. `count == 0` disarms.
    pub fn cut_commits(&self, how: CommitCut, count: u64) {
        let mut armed = self
            .shared
            .armed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *armed = (count, how);
    }

    /// How many armed cuts are still to happen.
    pub fn armed(&self) -> u64 {
        self.shared
            .armed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0
    }

    /// Closes every connection open now (the client's and the server's side), as a network
    /// failure would; new connections are accepted as before.
    pub fn cut_all(&self) {
        self.shared.generation.send_modify(|n| *n += 1);
    }

    /// Waits until `n` `COMMIT`s have been cut in all, or `timeout` passed; returns whether
    /// they were.
    pub async fn until_cut(&self, n: u64, timeout: Duration) -> bool {
        let mut cuts = self.shared.cuts.subscribe();
        tokio::time::timeout(timeout, cuts.wait_for(|cut| *cut >= n))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PgProxyStats {
        let c = &self.shared.counters;
        PgProxyStats {
            connections: c.connections.load(Ordering::Relaxed),
            commits: c.commits.load(Ordering::Relaxed),
            commits_cut: c.commits_cut.load(Ordering::Relaxed),
            connections_cut: c.connections_cut.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for PgFaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgFaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Drop for PgFaultProxy {
    fn drop(&mut self) {
        // The accept task owns the listener and every connection's task.
        self.accept.abort();
    }
}

/// One client connection, counted; its errors are the other side going away, with nobody to
/// report them to.
async fn serve(stream: TcpStream, shared: Arc<Shared>) {
    shared.counters.connections.fetch_add(1, Ordering::Relaxed);
    let _ = connection(stream, &shared).await;
}

/// Protocol codes of the untyped messages a client may send first.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
const CANCEL_REQUEST: u32 = 80_877_102;

/// Why a connection ended.
type Result<T = ()> = std::result::Result<T, std::io::Error>;

fn closed() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed")
}

async fn connection(client: TcpStream, shared: &Shared) -> Result {
    let _ = client.set_nodelay(true);
    let server = TcpStream::connect(shared.upstream).await?;
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let mut generation = shared.generation.subscribe();
    generation.mark_unchanged();

    // Startup: untyped messages (length, then a code), until the startup message proper.
    loop {
        let message = read_untyped(&mut client_read).await?;
        server_write.write_all(&message).await?;
        let code = u32::from_be_bytes([message[4], message[5], message[6], message[7]]);
        match code {
            SSL_REQUEST | GSSENC_REQUEST => {
                // One byte answers: `N` (go on in the clear) or `S`/`G` (encrypted).
                let mut answer = [0u8; 1];
                server_read.read_exact(&mut answer).await?;
                client_write.write_all(&answer).await?;
                if answer[0] != b'N' {
                    return blind(client_read, client_write, server_read, server_write).await;
                }
            }
            CANCEL_REQUEST => {
                return blind(client_read, client_write, server_read, server_write).await;
            }
            _ => break,
        }
    }

    // Typed messages from the client; the server's bytes are copied as they come.
    let mut pending = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 8192];
    let mut from_server = vec![0u8; 8192];
    loop {
        tokio::select! {
            read = client_read.read(&mut chunk) => {
                let n = read?;
                if n == 0 {
                    return Ok(());
                }
                pending.extend_from_slice(&chunk[..n]);
                while let Some(len) = typed_len(&pending) {
                    let message: Vec<u8> = pending.drain(..len).collect();
                    if !is_commit(&message) {
                        server_write.write_all(&message).await?;
                        continue;
                    }
                    shared.counters.commits.fetch_add(1, Ordering::Relaxed);
                    let Some(cut) = shared.take_cut() else {
                        server_write.write_all(&message).await?;
                        continue;
                    };
                    match cut {
                        CommitCut::BeforeSend => {}
                        CommitCut::AfterSend => server_write.write_all(&message).await?,
                        CommitCut::AfterReply => {
                            server_write.write_all(&message).await?;
                            until_ready_for_query(&mut server_read).await?;
                        }
                    }
                    shared.cut_done();
                    // Dropping both connections closes them: the client hears nothing.
                    return Ok(());
                }
            }
            read = server_read.read(&mut from_server) => {
                let n = read?;
                if n == 0 {
                    return Ok(());
                }
                client_write.write_all(&from_server[..n]).await?;
            }
            _ = generation.changed() => {
                shared.counters.connections_cut.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
    }
}

/// Reads one untyped message (a 4-byte length that counts itself, then the rest).
async fn read_untyped(from: &mut OwnedReadHalf) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await?;
    let total = u32::from_be_bytes(len) as usize;
    if !(8..=10_000).contains(&total) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a PostgreSQL startup message",
        ));
    }
    let mut message = vec![0u8; total];
    message[..4].copy_from_slice(&len);
    from.read_exact(&mut message[4..]).await?;
    Ok(message)
}

/// The length of the first complete typed message in `buffer` (a type byte, then a 4-byte
/// length that counts itself), if it is complete.
fn typed_len(buffer: &[u8]) -> Option<usize> {
    let len = buffer.get(1..5)?;
    let total = 1 + u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    (buffer.len() >= total).then_some(total)
}

/// Whether `message` is a simple query (`Q`) with a `COMMIT` (or `END`) among its
/// statements: alone, or sent after other statements in the same message (as
/// `idemkey-postgres` sends the completion and the `COMMIT` together).
fn is_commit(message: &[u8]) -> bool {
    if message.first() != Some(&b'Q') {
        return false;
    }
    let text = &message[5..];
    let text = text.strip_suffix(&[0]).unwrap_or(text);
    statements(&String::from_utf8_lossy(text)).any(|statement| {
        let word = statement
            .trim_start()
            .split(|c: char| !c.is_ascii_alphabetic())
            .next()
            .unwrap_or("");
        word.eq_ignore_ascii_case("commit") || word.eq_ignore_ascii_case("end")
    })
}

/// The statements of a simple query's text: split at the `;`s outside string literals
/// (`'…'`, with `''` inside, and `E'…'`, where a backslash escapes the next character).
fn statements(text: &str) -> impl Iterator<Item = &str> {
    let mut bounds = Vec::new();
    let (mut quoted, mut escapes, mut previous) = (false, false, ' ');
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' if quoted && escapes => {
                chars.next();
            }
            '\'' => {
                if !quoted {
                    escapes = previous.eq_ignore_ascii_case(&'e');
                }
                quoted = !quoted;
            }
            ';' if !quoted => bounds.push(i),
            _ => {}
        }
        previous = c;
    }
    bounds.push(text.len());
    let mut start = 0;
    bounds.into_iter().map(move |end| {
        let statement = &text[start..end];
        start = (end + 1).min(text.len());
        statement
    })
}

/// Reads (and drops) the server's messages up to and including `ReadyForQuery` (`Z`).
async fn until_ready_for_query(server: &mut OwnedReadHalf) -> Result {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        while let Some(len) = typed_len(&buffer) {
            let kind = buffer[0];
            buffer.drain(..len);
            if kind == b'Z' {
                return Ok(());
            }
        }
        let n = server.read(&mut chunk).await?;
        if n == 0 {
            return Err(closed());
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// Copies both ways without looking (an encrypted session, a cancel request).
async fn blind(
    mut client_read: OwnedReadHalf,
    mut client_write: OwnedWriteHalf,
    mut server_read: OwnedReadHalf,
    mut server_write: OwnedWriteHalf,
) -> Result {
    tokio::select! {
        r = tokio::io::copy(&mut client_read, &mut server_write) => r.map(drop),
        r = tokio::io::copy(&mut server_read, &mut client_write) => r.map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(text: &str) -> Vec<u8> {
        let mut m = vec![b'Q'];
        m.extend_from_slice(&((4 + text.len() + 1) as u32).to_be_bytes());
        m.extend_from_slice(text.as_bytes());
        m.push(0);
        m
    }

    #[test]
    fn finds_commits_among_queries() {
        assert!(is_commit(&query("COMMIT")));
        assert!(is_commit(&query("  commit;")));
        assert!(is_commit(&query("END")));
        assert!(!is_commit(&query("BEGIN")));
        assert!(!is_commit(&query("SELECT 'COMMIT'")));
        assert!(!is_commit(&query("COMMITTED")));
        assert!(is_commit(&query(
            r"SELECT f(E'a;b\\'';c', 1); COMMIT; BEGIN"
        )));
        assert!(!is_commit(&query(r"SELECT f(E'x\'; COMMIT; '); BEGIN")));
        assert!(!is_commit(&query("SELECT f('x''; COMMIT; '); BEGIN")));
        assert!(is_commit(&query("BEGIN; SELECT 1;\nend")));
        let mut parse = query("COMMIT");
        parse[0] = b'P';
        assert!(!is_commit(&parse));
    }

    #[test]
    fn frames_typed_messages() {
        let mut two = query("BEGIN");
        let first = two.len();
        two.extend(query("COMMIT"));
        assert_eq!(typed_len(&two), Some(first));
        assert_eq!(typed_len(&two[..first - 1]), None);
        assert_eq!(typed_len(&two[..3]), None);
    }
}
