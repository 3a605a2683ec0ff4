//! Rates: how many cost units a client (or an upstream) may send per unit of
//! time, held as the interval between two cost units in nanoseconds.
//!
//! Parsed from the config's `"5/s"`, `"300/m"`, `"0.5/s"`, `"10/h"` and
//! `"100/d"` forms. The interval is what the engine schedules with, so it is
//! the stored form: `5/s` is exactly 200 ms per unit.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Nanoseconds on the engine's own time axis (an arbitrary origin chosen by
/// the caller; the engine never reads a clock).
pub type Nanos = u64;

/// The longest interval we accept (one unit per 30 days), so that schedule
/// arithmetic on [`Nanos`] cannot overflow in any realistic run.
const MAX_INTERVAL: Nanos = 30 * 86_400 * 1_000_000_000;

/// A validated, non-zero rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    interval: Nanos,
}

/// Why a rate string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    #[error("expected the form N/UNIT, such as 5/s or 300/m")]
    Form,
    #[error("'{0}' is not a positive number")]
    Count(String),
    #[error("unit must be s, m, h or d")]
    Unit,
    #[error("rate is too high: at most 1000000000/s (1 ns apart)")]
    TooFast,
    #[error("rate is too low: at least one per 30 days")]
    TooSlow,
}

impl Rate {
    /// The slowest rate accepted: one unit per 30 days.
    pub const SLOWEST: Rate = Rate {
        interval: MAX_INTERVAL,
    };

    /// A rate of one cost unit every `interval`.
    pub fn from_interval(interval: Duration) -> Result<Rate, RateError> {
        let nanos = u64::try_from(interval.as_nanos()).map_err(|_| RateError::TooSlow)?;
        Self::from_interval_nanos(nanos)
    }

    /// A rate of one cost unit every `nanos` nanoseconds.
    pub fn from_interval_nanos(nanos: Nanos) -> Result<Rate, RateError> {
        match nanos {
            0 => Err(RateError::TooFast),
            n if n > MAX_INTERVAL => Err(RateError::TooSlow),
            n => Ok(Rate { interval: n }),
        }
    }

    /// `count` cost units per second.
    pub fn per_second(count: f64) -> Result<Rate, RateError> {
        Self::per(count, 1_000_000_000.0)
    }

    fn per(count: f64, unit_nanos: f64) -> Result<Rate, RateError> {
        if !count.is_finite() || count <= 0.0 {
            return Err(RateError::Count(count.to_string()));
        }
        let exact = unit_nanos / count;
        // Faster than one unit per nanosecond cannot be scheduled: refused,
        // never rounded up to 1e9/s.
        if exact < 1.0 {
            return Err(RateError::TooFast);
        }
        let interval = exact.round();
        if interval > MAX_INTERVAL as f64 {
            return Err(RateError::TooSlow);
        }
        // In range 1..=MAX_INTERVAL, so the cast is exact enough and cannot wrap.
        Ok(Rate {
            interval: interval as Nanos,
        })
    }

    /// Nanoseconds between two cost units (T = 1/r).
    pub fn interval_nanos(self) -> Nanos {
        self.interval
    }

    /// One of `n` equal shares of this rate (each instance's share of a
    /// fleet's rate); past the slowest rate, the slowest, never a faster
    /// one.
    pub fn share(self, n: u32) -> Rate {
        let interval = self.interval_nanos().saturating_mul(u64::from(n));
        Rate::from_interval_nanos(interval).unwrap_or(Rate::SLOWEST)
    }

    /// Time between two cost units (T = 1/r).
    pub fn interval(self) -> Duration {
        Duration::from_nanos(self.interval)
    }

    /// Cost units per second.
    pub fn per_second_f64(self) -> f64 {
        1e9 / self.interval as f64
    }
}

impl FromStr for Rate {
    type Err = RateError;

    fn from_str(s: &str) -> Result<Rate, RateError> {
        let (count, unit) = s.trim().split_once('/').ok_or(RateError::Form)?;
        let count = count.trim();
        let value: f64 = count
            .parse()
            .map_err(|_| RateError::Count(count.to_string()))?;
        let unit_nanos = match unit.trim() {
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3_600e9,
            "d" => 86_400e9,
            _ => return Err(RateError::Unit),
        };
        Self::per(value, unit_nanos)
    }
}

impl fmt::Display for Rate {
    /// Renders in the largest unit that counts at least one, to three
    /// decimals at most: `5/s`, `0.5/s` as `30/m`, `10/h`, `1/d`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&per_unit(self.per_second_f64()))
    }
}

/// A rate given in units per second, written as [`Rate`] writes itself
/// (for rates read back from the admin API).
pub fn per_unit(per_second: f64) -> String {
    let (value, unit) = [(1.0, "s"), (60.0, "m"), (3_600.0, "h")]
        .into_iter()
        .map(|(secs, unit)| (per_second * secs, unit))
        .find(|(v, _)| *v >= 1.0)
        .unwrap_or((per_second * 86_400.0, "d"));
    let text = format!("{value:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}/{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_slower_by_the_count_and_never_past_the_slowest() {
        let r = |s: &str| s.parse::<Rate>().map_err(|e| e.to_string());
        assert_eq!(r("20/s").map(|x| x.share(4)), r("5/s"));
        assert_eq!(r("20/s").map(|x| x.share(1)), r("20/s"));
        assert_eq!(r("1/h").map(|x| x.share(10_000)), Ok(Rate::SLOWEST));
    }

    #[test]
    fn writes_itself_in_the_unit_that_counts() {
        let shown = |s: &str| s.parse::<Rate>().map(|r| r.to_string()).unwrap_or_default();
        assert_eq!(shown("5/s"), "5/s");
        assert_eq!(shown("0.5/s"), "30/m");
        assert_eq!(shown("10/h"), "10/h");
        assert_eq!(shown("1/d"), "1/d");
        assert_eq!(shown("2/m"), "2/m");
        assert_eq!(shown("1000/s"), "1000/s");
        assert_eq!(per_unit(0.0), "0/d");
    }

    #[test]
    fn parses_every_unit() {
        assert_eq!("5/s".parse::<Rate>().unwrap().interval_nanos(), 200_000_000);
        assert_eq!(
            "300/m".parse::<Rate>().unwrap().interval_nanos(),
            200_000_000
        );
        assert_eq!(
            "0.5/s".parse::<Rate>().unwrap().interval_nanos(),
            2_000_000_000
        );
        assert_eq!(
            "10/h".parse::<Rate>().unwrap().interval_nanos(),
            360_000_000_000
        );
        assert_eq!(
            "100/d".parse::<Rate>().unwrap().interval_nanos(),
            864_000_000_000
        );
    }

    #[test]
    fn unknown_unit_is_refused() {
        assert_eq!("5/x".parse::<Rate>(), Err(RateError::Unit));
        assert_eq!("5/sec".parse::<Rate>(), Err(RateError::Unit));
    }

    #[test]
    fn zero_negative_and_garbage_counts_are_refused() {
        assert!(matches!("0/s".parse::<Rate>(), Err(RateError::Count(_))));
        assert!(matches!("-3/s".parse::<Rate>(), Err(RateError::Count(_))));
        assert!(matches!("abc/s".parse::<Rate>(), Err(RateError::Count(_))));
        assert!(matches!("NaN/s".parse::<Rate>(), Err(RateError::Count(_))));
        assert_eq!("5".parse::<Rate>(), Err(RateError::Form));
    }

    #[test]
    fn extremes_are_refused() {
        assert_eq!("3000000000/s".parse::<Rate>(), Err(RateError::TooFast));
        // Regression: 2e9/s rounded to a 1 ns interval (1e9/s) and passed.
        assert_eq!("2000000000/s".parse::<Rate>(), Err(RateError::TooFast));
        assert_eq!(
            "1000000000/s".parse::<Rate>().map(|r| r.interval_nanos()),
            Ok(1)
        );
        assert_eq!(
            "1/d".parse::<Rate>().map(|r| r.interval_nanos()),
            Ok(86_400_000_000_000)
        );
        assert_eq!("0.01/d".parse::<Rate>(), Err(RateError::TooSlow));
    }
}
