//! The time of an operation's first attempt, stated on every attempt, so that a retry that
//! comes after its record may have expired is refused instead of run again.
//!
//! A record proves that an operation happened only while it is kept. A retry without a record
//! cannot tell "never ran" from "ran, and its record was purged"; a retry that states when
//! its first attempt was sent can: if that is longer ago than the retention (less a margin
//! for the clocks of client and server), its record may be gone, and the request is refused
//! (412 `first-sent-expired`) unless a live record still answers it.
//!
//! The margin is also how far ahead of the server's clock a stated time may be: a client
//! whose clock runs fast states times that far ahead, and its first attempt's record expires
//! a retention after the server received it, so its retries must count as late that much
//! earlier. One quantity for both is what keeps a retry the server accepts inside its
//! record's life.
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
//! let sent = policy.read([&b"Tue, 14 Nov 2023 22:13:20 GMT"[..]], now, day).unwrap();
//! assert_eq!(sent, Some(now));
//!
//! // Retention 24 h, margin 5 min: a first attempt 23 h 56 min ago is late.
//! assert!(!policy.is_late(now.minus(Duration::from_secs(23 * 3600)), now, day));
//! assert!(policy.is_late(now.minus(Duration::from_secs(23 * 3600 + 56 * 60)), now, day));
//! // For a 30 s retention the margin is a quarter of it: 7.5 s, and a time 8 s ahead is
//! // refused.
//! let short = Duration::from_secs(30);
//! assert_eq!(policy.margin(short), Duration::from_millis(7500));
//! let ahead = [&b"Tue, 14 Nov 2023 22:13:28 GMT"[..]];
//! assert!(policy.read(ahead, now, short).is_err());
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
    /// How far the clocks of client and server may disagree, at most a quarter of the
    /// retention ([`margin`](Self::margin)): a time further ahead of the server's clock is
    /// refused (400 `first-sent-invalid`), and the window a late retry is judged by is
    /// shortened by as much.
    pub skew: Duration,
}

impl FirstSentPolicy {
    /// The default clock-skew allowance: 5 minutes.
    pub const DEFAULT_SKEW: Duration = Duration::from_secs(5 * 60);

    /// The skew allowance a `retention` holds: how far ahead of the server's clock a stated
    /// time may be, and the margin taken off the retention before a first attempt counts as
    /// late. The skew, but at most a quarter of the retention, so that a short retention
    /// keeps three quarters of its window.
    pub fn margin(&self, retention: Duration) -> Duration {
        self.skew.min(retention / 4)
    }

    /// Whether a first attempt sent at `first_sent` is too old at `now` for its record to be
    /// trusted to exist: `first_sent + retention - margin <= now`.
    pub fn is_late(&self, first_sent: Timestamp, now: Timestamp, retention: Duration) -> bool {
        first_sent.plus(retention.saturating_sub(self.margin(retention))) <= now
    }

    /// The first attempt's time from the request's `Repeatability-First-Sent` fields, checked
    /// against the route's requirement and against `now` plus the skew allowance that
    /// `retention` holds ([`margin`](Self::margin)). A valid date however old is read: it is
    /// for [`is_late`](Self::is_late) to judge.
    pub fn read<'a>(
        &self,
        fields: impl IntoIterator<Item = &'a [u8]>,
        now: Timestamp,
        retention: Duration,
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
        let allowed = self.margin(retention);
        if ahead > allowed {
            return Err(FirstSentError::Future { ahead, allowed });
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

/// 400 Gregorian years, in milliseconds: after them the calendar, weekdays included, repeats.
const CYCLE_MS: i64 = 146_097 * 86_400_000;

/// The years 1970 to 9999, which `httpdate` reads and writes.
const FIRST_YEAR: u16 = 1970;

/// Where the four digits of the year are in an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`)
/// and in asctime's form (`Sun Nov  6 08:49:37 1994`); RFC 850's two-digit year never names
/// one before 1970.
fn year_digits(text: &str) -> Option<std::ops::Range<usize>> {
    match text.len() {
        29 => Some(12..16),
        24 => Some(20..24),
        _ => None,
    }
}

/// An HTTP date (IMF-fixdate, or one of the two obsolete forms every recipient accepts). A
/// date before 1970, which `httpdate` does not read, is read as the same day whole 400-year
/// cycles later, then moved back by them.
fn parse(field: &[u8]) -> Option<Timestamp> {
    let text = std::str::from_utf8(field).ok()?.trim();
    let since_epoch = |text: &str| {
        let time = httpdate::parse_http_date(text).ok()?;
        let millis = time.duration_since(UNIX_EPOCH).ok()?.as_millis();
        i64::try_from(millis).ok()
    };
    if let Some(millis) = since_epoch(text) {
        return Some(Timestamp(millis));
    }
    let digits = year_digits(text)?;
    let year = text.get(digits.clone())?;
    if !year.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let year: u16 = year.parse().ok()?;
    if year >= FIRST_YEAR {
        return None;
    }
    let cycles = (FIRST_YEAR - year).div_ceil(400);
    let later = format!(
        "{}{:04}{}",
        &text[..digits.start],
        year + 400 * cycles,
        &text[digits.end..]
    );
    Some(Timestamp(
        since_epoch(&later)? - i64::from(cycles) * CYCLE_MS,
    ))
}

/// 0000-01-01T00:00:00Z, the first time an HTTP date spells.
const YEAR_ZERO: Timestamp = Timestamp(-62_167_219_200_000);

/// `time` as an HTTP date (IMF-fixdate), a time before 1970 included (which `httpdate` does
/// not write): the form a request states its first attempt's time in, for answers that
/// repeat it. A time before the year 0 is written as its first second, one past
/// [`Timestamp::MAX_FORMATTABLE`] as that.
pub fn http_date(time: Timestamp) -> String {
    if time.0 >= 0 {
        return httpdate::fmt_http_date(time.to_system_time());
    }
    let time = time.0.max(YEAR_ZERO.0);
    let cycles = (CYCLE_MS - 1 - time) / CYCLE_MS; // the fewest that reach 1970
    let later = httpdate::fmt_http_date(Timestamp(time + cycles * CYCLE_MS).to_system_time());
    let digits = 12..16;
    let year: i64 = later[digits.clone()].parse().unwrap_or_default();
    format!(
        "{}{:04}{}",
        &later[..digits.start],
        year - 400 * cycles,
        &later[digits.end..]
    )
}

/// `d` in seconds (`2 s`, `2.5 s`).
fn seconds(d: &Duration) -> String {
    format!("{} s", d.as_secs_f64())
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
    /// Further ahead of the server's clock than the skew allowance the retention holds
    /// ([`FirstSentPolicy::margin`]).
    #[error(
        "Repeatability-First-Sent is {} ahead of the server's clock, more than the {} allowed",
        seconds(ahead),
        seconds(allowed)
    )]
    Future {
        /// How far ahead.
        ahead: Duration,
        /// The allowance.
        allowed: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Timestamp = Timestamp(1_700_000_000_000); // Tue, 14 Nov 2023 22:13:20 GMT

    const DAY: Duration = Duration::from_secs(24 * 3600);

    /// What `policy` reads at [`NOW`] for a day's retention.
    fn read(policy: FirstSentPolicy, fields: &[&str]) -> Result<Option<Timestamp>, FirstSentError> {
        read_for(policy, fields, DAY)
    }

    fn read_for(
        policy: FirstSentPolicy,
        fields: &[&str],
        retention: Duration,
    ) -> Result<Option<Timestamp>, FirstSentError> {
        policy.read(fields.iter().map(|f| f.as_bytes()), NOW, retention)
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
                ahead: Duration::from_secs(360),
                allowed: Duration::from_secs(300),
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

    /// 1920-01-01T00:00:00Z: 18 263 days before the epoch.
    const JAN_1920: Timestamp = Timestamp(-18_263 * 86_400_000);

    #[test]
    fn a_valid_date_before_1970_is_very_old_not_malformed() {
        let p = FirstSentPolicy::default();
        let day = Duration::from_secs(24 * 3600);
        for field in ["Thu, 01 Jan 1920 00:00:00 GMT", "Thu Jan  1 00:00:00 1920"] {
            let sent = read(p, &[field]);
            assert_eq!(sent, Ok(Some(JAN_1920)), "{field:?}");
            assert!(p.is_late(JAN_1920, NOW, day), "{field:?}");
        }
        assert_eq!(
            read(p, &["Sat, 01 Jan 0000 00:00:00 GMT"]),
            Ok(Some(Timestamp(-62_167_219_200_000)))
        );
        assert_eq!(
            read(p, &["Wed, 31 Dec 1969 23:59:59 GMT"]),
            Ok(Some(Timestamp(-1_000)))
        );
        // Written back as read, for the answers that repeat it.
        for date in [
            "Thu, 01 Jan 1920 00:00:00 GMT",
            "Sat, 01 Jan 0000 00:00:00 GMT",
            "Wed, 31 Dec 1969 23:59:59 GMT",
            "Tue, 29 Feb 1916 12:30:05 GMT",
            "Tue, 14 Nov 2023 22:13:20 GMT",
        ] {
            let time = read(p, &[date]).unwrap().unwrap();
            assert_eq!(http_date(time), date);
        }
        assert_eq!(
            http_date(Timestamp(i64::MIN)),
            "Sat, 01 Jan 0000 00:00:00 GMT"
        );
        // Still not dates: a wrong weekday, a day the year does not have, the year 1900's
        // 29 February.
        for bad in [
            "Mon, 01 Jan 1920 00:00:00 GMT",
            "Sun, 30 Feb 1920 00:00:00 GMT",
            "Thu, 29 Feb 1900 00:00:00 GMT",
            "Thu, 01 Jan 19x0 00:00:00 GMT",
        ] {
            assert_eq!(read(p, &[bad]), Err(FirstSentError::Malformed), "{bad:?}");
        }
    }

    /// Retention 8 s, the default 5 min skew: a client 290 s fast states a first-sent time
    /// 290 s ahead. Accepted, its retries would not count as late until 290 s after its
    /// record expired, and a retry in between would run again.
    #[test]
    fn a_fast_client_clock_is_never_charged_twice() {
        let p = FirstSentPolicy::default();
        let retention = Duration::from_secs(8);
        let fast = NOW.plus(Duration::from_secs(290));
        let date = http_date(fast);
        let refused = read_for(p, &[&date], retention);
        assert_eq!(
            refused,
            Err(FirstSentError::Future {
                ahead: Duration::from_secs(290),
                allowed: Duration::from_secs(2),
            })
        );
        assert_eq!(
            refused.unwrap_err().to_string(),
            "Repeatability-First-Sent is 290 s ahead of the server's clock, more than the 2 s allowed"
        );
        // Any time accepted at the first attempt is late once its record has expired.
        let allowed = NOW.plus(p.margin(retention));
        let date = http_date(allowed);
        assert_eq!(read_for(p, &[&date], retention), Ok(Some(allowed)));
        assert!(p.is_late(allowed, NOW.plus(retention), retention));
        let beyond = http_date(allowed.plus(Duration::from_secs(1)));
        assert!(read_for(p, &[&beyond], retention).is_err());
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
