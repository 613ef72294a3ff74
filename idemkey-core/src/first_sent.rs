//! The time of an operation's first attempt, stated on every attempt, so that a retry that
//! comes after its record may have expired is refused instead of run again.
//!
//! A record proves that an operation happened only while it is kept. A retry without a record
//! cannot tell "never ran" from "ran, and its record was purged"; a retry that states when
//! its first attempt was sent can: if that is longer ago than the retention (less a margin
//! for the clocks of client and server), its record may be gone, and the request is refused
//! (412 `first-sent-expired`) unless a live record still answers it.
//!
//! The header is `Repeatability-First-Sent` (OASIS Repeatable Requests 1.0), an HTTP date
//! (IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`).
//!
//! ```
//! use std::time::Duration;
//! use idemkey_core::{FirstSentPolicy, Timestamp};
//!
//! let policy = FirstSentPolicy::default(); // optional, 5 minutes of clock skew allowed
//! let now = Timestamp(1_700_000_000_000);
//! let day = Duration::from_secs(24 * 3600);
//!
//! // Read from the request's header fields.
//! let sent = policy.read([&b"Tue, 14 Nov 2023 22:13:20 GMT"[..]], now).unwrap();
//! assert_eq!(sent, Some(now));
//!
//! // Retention 24 h, margin 5 min: a first attempt 23 h 56 min ago is late.
//! assert!(!policy.is_late(now.minus(Duration::from_secs(23 * 3600)), now, day));
//! assert!(policy.is_late(now.minus(Duration::from_secs(23 * 3600 + 56 * 60)), now, day));
//! // For a 30 s retention the margin is a quarter of it: 7.5 s.
//! assert_eq!(policy.margin(Duration::from_secs(30)), Duration::from_millis(7500));
//! ```

use std::time::{Duration, UNIX_EPOCH};

use crate::Timestamp;

/// The request header that states when the operation's first attempt was sent.
pub const FIRST_SENT_HEADER: &str = "repeatability-first-sent";

/// The response header that says whether a request that stated its first attempt's time
/// was accepted (it ran, or its stored outcome was replayed) or rejected.
pub const REPEATABILITY_RESULT_HEADER: &str = "repeatability-result";

/// Whether a keyed request must state its first attempt's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FirstSentRequirement {
    /// A keyed request may state it (the default); without it, a retry after the retention
    /// runs again, as it always did.
    #[default]
    Optional,
    /// A keyed request without it is refused with 400 `first-sent-missing`.
    Required,
}

/// How a route reads and judges the first attempt's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstSentPolicy {
    /// Whether keyed requests must state it.
    pub requirement: FirstSentRequirement,
    /// How far the clocks of client and server may disagree: a time further ahead of the
    /// server's clock is refused (400 `first-sent-invalid`), and the window a late retry is
    /// judged by is shortened by up to this much.
    pub skew: Duration,
}

impl FirstSentPolicy {
    /// The default clock-skew allowance: 5 minutes.
    pub const DEFAULT_SKEW: Duration = Duration::from_secs(5 * 60);

    /// The margin taken off the retention before a first attempt counts as late: the skew
    /// allowance, but at most a quarter of the retention, so that a short retention keeps
    /// three quarters of its window.
    pub fn margin(&self, retention: Duration) -> Duration {
        self.skew.min(retention / 4)
    }

    /// Whether a first attempt sent at `first_sent` is too old at `now` for its record to be
    /// trusted to exist: `first_sent + retention - margin <= now`.
    pub fn is_late(&self, first_sent: Timestamp, now: Timestamp, retention: Duration) -> bool {
        first_sent.plus(retention.saturating_sub(self.margin(retention))) <= now
    }

    /// The first attempt's time from the request's `Repeatability-First-Sent` fields, checked
    /// against the route's requirement and against `now` plus the skew allowance.
    pub fn read<'a>(
        &self,
        fields: impl IntoIterator<Item = &'a [u8]>,
        now: Timestamp,
    ) -> Result<Option<Timestamp>, FirstSentError> {
        let mut fields = fields.into_iter();
        let Some(field) = fields.next() else {
            return match self.requirement {
                FirstSentRequirement::Optional => Ok(None),
                FirstSentRequirement::Required => Err(FirstSentError::Missing),
            };
        };
        if fields.next().is_some() {
            return Err(FirstSentError::Malformed);
        }
        let sent = parse(field).ok_or(FirstSentError::Malformed)?;
        let ahead = now.until(sent);
        if ahead > self.skew {
            return Err(FirstSentError::Future {
                ahead_secs: ahead.as_secs(),
                skew_secs: self.skew.as_secs(),
            });
        }
        Ok(Some(sent))
    }
}

impl Default for FirstSentPolicy {
    fn default() -> Self {
        Self {
            requirement: FirstSentRequirement::Optional,
            skew: Self::DEFAULT_SKEW,
        }
    }
}

/// An HTTP date (IMF-fixdate, or one of the two obsolete forms every recipient accepts).
fn parse(field: &[u8]) -> Option<Timestamp> {
    let text = std::str::from_utf8(field).ok()?;
    let time = httpdate::parse_http_date(text.trim()).ok()?;
    let millis = time.duration_since(UNIX_EPOCH).ok()?.as_millis();
    Some(Timestamp(i64::try_from(millis).ok()?))
}

/// A `Repeatability-First-Sent` the route cannot accept; nothing was executed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FirstSentError {
    /// The route requires the header and the request had none.
    #[error(
        "this request requires a Repeatability-First-Sent header: the time its first attempt was sent"
    )]
    Missing,
    /// Not one HTTP date.
    #[error(
        "Repeatability-First-Sent must appear once, as an HTTP date such as \"Sun, 06 Nov 1994 08:49:37 GMT\""
    )]
    Malformed,
    /// Further ahead of the server's clock than the skew allowance.
    #[error(
        "Repeatability-First-Sent is {ahead_secs} s ahead of the server's clock, more than the {skew_secs} s allowed"
    )]
    Future {
        /// How far ahead, in seconds.
        ahead_secs: u64,
        /// The allowance, in seconds.
        skew_secs: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Timestamp = Timestamp(1_700_000_000_000); // Tue, 14 Nov 2023 22:13:20 GMT

    fn read(policy: FirstSentPolicy, fields: &[&str]) -> Result<Option<Timestamp>, FirstSentError> {
        policy.read(fields.iter().map(|f| f.as_bytes()), NOW)
    }

    #[test]
    fn reads_an_imf_fixdate() {
        let p = FirstSentPolicy::default();
        assert_eq!(read(p, &["Tue, 14 Nov 2023 22:13:20 GMT"]), Ok(Some(NOW)));
        assert_eq!(
            read(p, &["Tue, 14 Nov 2023 22:13:00 GMT"]),
            Ok(Some(NOW.minus(Duration::from_secs(20))))
        );
        assert_eq!(read(p, &[]), Ok(None));
    }

    #[test]
    fn refuses_malformed_repeated_and_future_times() {
        let p = FirstSentPolicy::default();
        for bad in [
            "",
            "yesterday",
            "1700000000",
            "Tue, 14 Nov 2023 25:13:20 GMT",
        ] {
            assert_eq!(read(p, &[bad]), Err(FirstSentError::Malformed), "{bad:?}");
        }
        let twice = ["Tue, 14 Nov 2023 22:13:20 GMT"; 2];
        assert_eq!(read(p, &twice), Err(FirstSentError::Malformed));
        // 5 minutes ahead is within the allowance, 6 are not.
        assert!(read(p, &["Tue, 14 Nov 2023 22:18:20 GMT"]).is_ok());
        assert_eq!(
            read(p, &["Tue, 14 Nov 2023 22:19:20 GMT"]),
            Err(FirstSentError::Future {
                ahead_secs: 360,
                skew_secs: 300
            })
        );
    }

    #[test]
    fn requires_the_header_where_the_route_says_so() {
        let p = FirstSentPolicy {
            requirement: FirstSentRequirement::Required,
            ..FirstSentPolicy::default()
        };
        assert_eq!(read(p, &[]), Err(FirstSentError::Missing));
        assert_eq!(read(p, &["Tue, 14 Nov 2023 22:13:20 GMT"]), Ok(Some(NOW)));
    }

    #[test]
    fn the_margin_stays_a_fraction_of_a_short_retention() {
        let p = FirstSentPolicy::default();
        let short = Duration::from_secs(30);
        assert_eq!(p.margin(short), Duration::from_millis(7_500));
        assert!(!p.is_late(NOW, NOW, short));
        assert!(!p.is_late(NOW.minus(Duration::from_secs(22)), NOW, short));
        assert!(p.is_late(NOW.minus(Duration::from_millis(22_500)), NOW, short));
        let day = Duration::from_secs(24 * 3600);
        assert_eq!(p.margin(day), FirstSentPolicy::DEFAULT_SKEW);
        assert!(p.is_late(NOW.minus(day), NOW, day));
        assert!(!p.is_late(NOW.minus(day - Duration::from_secs(301)), NOW, day));
    }
}
