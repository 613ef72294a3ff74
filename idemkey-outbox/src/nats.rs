//! The NATS JetStream sink: one JetStream publish per message, deduplicated by the stream.

use std::time::Duration;

use async_nats::jetstream::{self, context::Publish};
use idemkey_core::outbox::Message;
use tokio::sync::Mutex;

use crate::{DeliveryError, Sink, envelope};

/// How long the sink waits before it publishes again to a stream without a leader.
const LEADERLESS_RETRY: Duration = Duration::from_millis(50);

/// How a [`NatsSink`] publishes, and the stream it may create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsConfig {
    /// The subject every message is published to (no wildcards).
    pub subject: String,
    /// The stream to create when no stream captures [`subject`](Self::subject); `None`
    /// creates none, and the sink refuses to start (and deliveries fail) until the operator
    /// creates one. The default is [`NatsConfig::default_stream_name`] of the subject.
    pub create_stream: Option<String>,
    /// The duplicate window of a stream this sink creates, and the shortest it expects of a
    /// stream it adopts (which keeps its own; a shorter one is logged as a warning at
    /// connect): a redelivery later than this after the first copy is stored again. Make it
    /// at least the relay's [`RelayConfig::redelivery_horizon`](crate::RelayConfig::redelivery_horizon).
    pub duplicate_window: Duration,
    /// The replicas of a stream this sink creates: 1 on a single server, 3 (or 5) on a
    /// cluster, so that a stored message and its id survive the loss of a server. A stream
    /// with one replica in a cluster is logged as a warning at connect.
    pub replicas: usize,
    /// How long a publish waits for JetStream's acknowledgement, and a stream look-up for its
    /// answer.
    pub ack_timeout: Duration,
}

impl NatsConfig {
    /// JetStream's default duplicate window.
    pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
    /// The default [`ack_timeout`](Self::ack_timeout).
    pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(5);

    /// Publishes to `subject`; creates the stream [`default_stream_name`](Self::default_stream_name)
    /// when none captures it, with one replica and a two-minute duplicate window.
    pub fn new(subject: impl Into<String>) -> Self {
        let subject = subject.into();
        Self {
            create_stream: Some(Self::default_stream_name(&subject)),
            subject,
            duplicate_window: Self::DEFAULT_DUPLICATE_WINDOW,
            replicas: 1,
            ack_timeout: Self::DEFAULT_ACK_TIMEOUT,
        }
    }

    /// The name of the stream the sink creates for `subject` when none captures it:
    /// `OUTBOX_` and the subject in capitals, every character other than a letter, a digit,
    /// `-` or `_` replaced by `_` (a stream name has no `.`).
    ///
    /// ```
    /// use idemkey_outbox::NatsConfig;
    /// assert_eq!(NatsConfig::default_stream_name("payments.events"), "OUTBOX_PAYMENTS_EVENTS");
    /// ```
    pub fn default_stream_name(subject: &str) -> String {
        let tail: String = subject
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect();
        format!("OUTBOX_{tail}")
    }
}

/// What JetStream answered to one publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The stream that stored the message.
    pub stream: String,
    /// Its sequence in that stream (of the first copy, for a duplicate).
    pub sequence: u64,
    /// The stream already held a message with this `Nats-Msg-Id` within its duplicate
    /// window, and stored nothing.
    pub duplicate: bool,
}

/// Publishes each message to a JetStream subject with the header `Nats-Msg-Id: <message id>`
/// and the [`envelope`] as payload, and returns only once JetStream acknowledged it: stored,
/// or recognised as a duplicate, which is an acknowledgement too. A redelivery within the
/// stream's duplicate window (two minutes by default) is thereby dropped by the stream.
///
/// The stream belongs to the operator: the sink publishes into whichever stream captures its
/// subject, and creates one ([`NatsConfig::create_stream`]) only when none does. No stream,
/// no answer in time, a lost connection: each is a [`DeliveryError`] the relay retries; the
/// client reconnects on its own.
///
/// ```no_run
/// # async fn run(store: idemkey_postgres::PgStore) -> Result<(), Box<dyn std::error::Error>> {
/// use idemkey_outbox::{NatsSink, Relay};
/// let sink = NatsSink::connect("nats://127.0.0.1:4222", "payments.events").await?;
/// let task = Relay::new(store, sink).spawn(); // delivers until `task` is dropped
/// # drop(task); Ok(()) }
/// ```
#[derive(Debug)]
pub struct NatsSink {
    jetstream: jetstream::Context,
    config: NatsConfig,
    /// The stream that captured the subject when last looked up.
    stream: Mutex<String>,
}

impl NatsSink {
    /// Connects to the NATS server at `url` (`nats://host:port`) and publishes to `subject`,
    /// with [`NatsConfig::new`]'s defaults.
    pub async fn connect(url: &str, subject: &str) -> Result<Self, DeliveryError> {
        Self::connect_with(url, NatsConfig::new(subject)).await
    }

    /// Connects to the NATS server at `url` and publishes as `config` says. `url` may list
    /// several servers of a cluster, separated by commas; the client also learns the
    /// cluster's other servers from the one it reaches, and reconnects to any of them.
    ///
    /// Fails when no server can be reached, JetStream is off, or no stream captures the
    /// subject and `config` creates none.
    pub async fn connect_with(url: &str, config: NatsConfig) -> Result<Self, DeliveryError> {
        validate_subject(&config.subject)?;
        let servers = parse_servers(url)?;
        let client = async_nats::ConnectOptions::new()
            .name("idemkey-outbox")
            .connection_timeout(config.ack_timeout)
            .connect(servers)
            .await
            .map_err(|e| {
                DeliveryError(format!(
                    "cannot connect to NATS at {}: {e}",
                    redact_urls(url)
                ))
            })?;
        Self::with_client(client, config).await
    }

    /// Publishes on an existing connection, as `config` says.
    pub async fn with_client(
        client: async_nats::Client,
        config: NatsConfig,
    ) -> Result<Self, DeliveryError> {
        validate_subject(&config.subject)?;
        let mut jetstream = jetstream::new(client);
        jetstream.set_timeout(config.ack_timeout);
        let sink = Self {
            jetstream,
            config,
            stream: Mutex::new(String::new()),
        };
        sink.find_or_create_stream().await?;
        sink.check_stream().await;
        Ok(sink)
    }

    /// Checks that `subject` can be published to: tokens separated by `.`, no wildcards, no
    /// spaces (the check [`connect`](Self::connect) makes), without connecting.
    pub fn check_subject(subject: &str) -> Result<(), DeliveryError> {
        validate_subject(subject)
    }

    /// Checks that `url` is one server URL or several separated by commas (the check
    /// [`connect_with`](Self::connect_with) makes), without connecting.
    ///
    /// ```
    /// use idemkey_outbox::NatsSink;
    /// assert!(NatsSink::check_servers("nats://10.0.0.1:4222, nats://10.0.0.2:4222").is_ok());
    /// assert!(NatsSink::check_servers("nats://10.0.0.1:4222,").is_err());
    /// ```
    pub fn check_servers(url: &str) -> Result<(), DeliveryError> {
        parse_servers(url).map(|_| ())
    }

    /// The subject messages are published to.
    pub fn subject(&self) -> &str {
        &self.config.subject
    }

    /// The stream that captured the subject when it was last looked up (at connect, and
    /// again after a publish found none).
    pub async fn stream(&self) -> String {
        self.stream.lock().await.clone()
    }

    /// Publishes `message` and waits for JetStream's acknowledgement.
    ///
    /// When nobody answers for the subject, the sink looks up its stream again (and creates
    /// it, if allowed and none captures the subject). When a stream does capture it and still
    /// nobody answers, the stream has no leader right now (a server is away, an election is
    /// in progress): the sink publishes again, with the same `Nats-Msg-Id`, every
    /// 50 ms until [`NatsConfig::ack_timeout`] has passed since the first try, then fails.
    pub async fn publish(&self, message: &Message) -> Result<Published, DeliveryError> {
        let deadline = tokio::time::Instant::now() + self.config.ack_timeout;
        let subject = &self.config.subject;
        match self.publish_once(message).await {
            Err(Failure::NoStream) => {}
            other => return other.map_err(|f| f.into_error(subject)),
        }
        // The stream went away since the sink looked, or has no leader: look (and maybe
        // create) again, then publish again until the deadline.
        self.find_or_create_stream().await?;
        loop {
            match self.publish_once(message).await {
                Err(Failure::NoStream) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(LEADERLESS_RETRY).await;
                }
                Err(Failure::NoStream) => {
                    let stream = self.stream().await;
                    return Err(DeliveryError(format!(
                        "the JetStream stream {stream:?} captures the subject {subject:?} but \
                         has no leader to store the message (a server is away or an election \
                         is in progress)"
                    )));
                }
                other => return other.map_err(|f| f.into_error(subject)),
            }
        }
    }

    async fn publish_once(&self, message: &Message) -> Result<Published, Failure> {
        use async_nats::jetstream::context::PublishErrorKind as Kind;
        let publish = Publish::build()
            .message_id(&message.id)
            .payload(envelope(message).into());
        let classify = |e: async_nats::jetstream::context::PublishError| match e.kind() {
            Kind::StreamNotFound => Failure::NoStream,
            Kind::TimedOut => Failure::Other(format!(
                "no acknowledgement from JetStream within {:?}",
                self.config.ack_timeout
            )),
            Kind::BrokenPipe => Failure::Other("the connection to NATS was lost".into()),
            _ => Failure::Other(e.to_string()),
        };
        let ack = self
            .jetstream
            .send_publish(self.config.subject.clone(), publish)
            .await
            .map_err(classify)?
            .await
            .map_err(classify)?;
        Ok(Published {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    /// Warns about what the stream the sink publishes into cannot hold: a duplicate window
    /// shorter than [`NatsConfig::duplicate_window`], one replica in a cluster. Best effort:
    /// a stream whose information does not come (no leader right now) is not checked.
    async fn check_stream(&self) {
        let name = self.stream().await;
        let info = match self.jetstream.get_stream(&name).await {
            Ok(stream) => stream.cached_info().clone(),
            Err(e) => {
                tracing::debug!(stream = %name, error = %e, "cannot read the JetStream stream's configuration; not checked");
                return;
            }
        };
        if info.config.duplicate_window < self.config.duplicate_window {
            tracing::warn!(
                stream = %name,
                duplicate_window = ?info.config.duplicate_window,
                expected = ?self.config.duplicate_window,
                "the JetStream stream's duplicate window is shorter than the outbox expects: a redelivery after it is stored again"
            );
        }
        let clustered = info.cluster.is_some_and(|cluster| cluster.name.is_some());
        if clustered && info.config.num_replicas <= 1 {
            tracing::warn!(
                stream = %name,
                "the JetStream stream has one replica in a cluster: while its server is away, nothing is delivered, and a lost store loses its messages and ids"
            );
        }
    }

    /// Finds the stream that captures the subject; creates the configured one if none does.
    async fn find_or_create_stream(&self) -> Result<(), DeliveryError> {
        use async_nats::jetstream::context::GetStreamByNameErrorKind as Kind;
        let subject = &self.config.subject;
        let mut stream = self.stream.lock().await;
        let name = match self.jetstream.stream_by_subject(subject.clone()).await {
            Ok(name) => name,
            Err(e) if matches!(e.kind(), Kind::NotFound) => {
                let Some(name) = &self.config.create_stream else {
                    return Err(DeliveryError(format!(
                        "no JetStream stream captures the subject {subject:?}, and creating \
                         one is off: the operator must create it"
                    )));
                };
                self.jetstream
                    .get_or_create_stream(jetstream::stream::Config {
                        name: name.clone(),
                        subjects: vec![subject.clone()],
                        duplicate_window: self.config.duplicate_window,
                        num_replicas: self.config.replicas,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| {
                        DeliveryError(format!(
                            "no JetStream stream captures the subject {subject:?}, and \
                             creating the stream {name:?} failed: {e}"
                        ))
                    })?;
                tracing::info!(stream = %name, subject = %subject, "created a JetStream stream for the outbox");
                name.clone()
            }
            Err(e) => {
                return Err(DeliveryError(format!(
                    "cannot look up the JetStream stream of the subject {subject:?} \
                     (JetStream is off, or its cluster has no leader right now): {e}"
                )));
            }
        };
        *stream = name;
        Ok(())
    }
}

/// Why one publish failed.
enum Failure {
    /// No stream captures the subject (the server answered "no responders").
    NoStream,
    Other(String),
}

impl Failure {
    fn into_error(self, subject: &str) -> DeliveryError {
        match self {
            Self::NoStream => DeliveryError(format!(
                "no JetStream stream captures the subject {subject:?}"
            )),
            Self::Other(text) => DeliveryError(text),
        }
    }
}

/// The servers of a comma-separated list of URLs; none of them empty.
fn parse_servers(url: &str) -> Result<Vec<async_nats::ServerAddr>, DeliveryError> {
    url.split(',')
        .map(|one| {
            let one = one.trim();
            if one.is_empty() {
                return Err(DeliveryError(format!(
                    "invalid NATS URL {:?}: an empty server in the list",
                    redact_urls(url)
                )));
            }
            one.parse::<async_nats::ServerAddr>()
                .map_err(|e| DeliveryError(format!("invalid NATS URL {:?}: {e}", redact_urls(url))))
        })
        .collect()
}

fn validate_subject(subject: &str) -> Result<(), DeliveryError> {
    let valid = !subject.is_empty()
        && !subject.contains(|c: char| c.is_whitespace())
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">");
    if valid {
        Ok(())
    } else {
        Err(DeliveryError(format!(
            "invalid NATS subject {subject:?}: tokens separated by `.`, no wildcards, no \
             whitespace"
        )))
    }
}

impl Sink for NatsSink {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        let published = self.publish(message).await?;
        if published.duplicate {
            tracing::debug!(message = %message.id, stream = %published.stream, "JetStream already held the message");
        }
        Ok(())
    }
}

/// A comma-separated list of NATS URLs, each with its password hidden.
fn redact_urls(urls: &str) -> String {
    urls.split(',')
        .map(|one| idemkey_core::redact_url(one.trim()))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_with_wildcards_or_gaps_are_refused() {
        for bad in ["", "a..b", "a.*", "a.>", "a b", ".a", "a."] {
            assert!(validate_subject(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "payments.events", "a-b.c_d.E1"] {
            assert!(validate_subject(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn a_server_list_is_checked_entry_by_entry() {
        let servers =
            parse_servers("nats://127.0.0.1:4222, 127.0.0.1:4223,nats://[::1]:4224").unwrap();
        assert_eq!(servers.len(), 3);
        for bad in [
            "",
            "nats://127.0.0.1:4222,",
            "nats://a:1,,nats://b:2",
            "nats://a:99999",
        ] {
            let e = parse_servers(bad).unwrap_err();
            assert!(e.0.starts_with("invalid NATS URL"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn the_default_stream_name_is_a_valid_stream_name() {
        assert_eq!(NatsConfig::default_stream_name("a.b*c"), "OUTBOX_A_B_C");
        assert_eq!(
            NatsConfig::new("orders.created").create_stream.as_deref(),
            Some("OUTBOX_ORDERS_CREATED")
        );
    }
}
