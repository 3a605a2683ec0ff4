//! The demo's clients: three send patterns, each request in its own task
//! so that queued requests wait concurrently, as real clients would.
//!
//! - `steady` sends evenly, a little below r: it is never queued, so it
//!   shows that an idle client passes with no added latency;
//! - `bursty` is quiet, then sends 3·b requests at once every few seconds:
//!   b of them queue, the rest get 429, and the queue drains at exactly r;
//! - `flood` sends evenly at 3·r: its queue stays full, it gets 429s
//!   continuously, and its output is still exactly r.
//!
//! Every loop ends at the demo's end; a request still waiting when the
//! demo stops is abandoned (its connection closes, so sluice withdraws it).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::sync::watch;

use super::downstream::SEQ_HEADER;
use super::record::{Answer, Recorder};

/// The HTTP client the demo's clients share (a keep-alive pool).
pub type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// Fastest a demo client sends, whatever the rate: 10,000 requests a
/// second. The schedule is absolute, so gaps below tokio's 1 ms timer
/// granularity come out as small batches, on time on average.
const MIN_GAP: Duration = Duration::from_micros(100);

/// Largest burst, whatever the capacity.
const MAX_BURST: u32 = 300;

/// How a client sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One request every `every`, starting at `first`.
    Even { first: Duration, every: Duration },
    /// `size` requests at once every `every`, starting at `first`.
    Bursts {
        first: Duration,
        every: Duration,
        size: u32,
    },
}

/// One demo client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// Sent as `X-Client`: the client key.
    pub name: &'static str,
    pub shape: Shape,
}

impl Pattern {
    /// What it does, in a few words ("4/s", "30 at once every 5s").
    pub fn describe(&self) -> String {
        match self.shape {
            Shape::Even { every, .. } => format!(
                "{} evenly",
                crate::shaper::rate::per_unit(1.0 / every.as_secs_f64())
            ),
            Shape::Bursts { every, size, .. } => {
                format!("{size} at once every {}", humantime::format_duration(every))
            }
        }
    }

    /// The send times, as offsets from the start, that fall before `end`.
    pub fn schedule(&self, end: Duration) -> Vec<Duration> {
        let mut times = Vec::new();
        let (first, every, size) = match self.shape {
            Shape::Even { first, every } => (first, every, 1),
            Shape::Bursts { first, every, size } => (first, every, size),
        };
        let every = every.max(MIN_GAP);
        let mut at = first;
        while at < end {
            times.extend(std::iter::repeat_n(at, size as usize));
            at += every;
        }
        times
    }
}

/// The three clients for rate interval `interval` (1/r) and capacity `b`,
/// sending for `duration` (the bursty one starts after 1 s, or halfway
/// through a shorter run, so that it always sends).
pub fn patterns(interval: Duration, capacity: u32, duration: Duration) -> Vec<Pattern> {
    let b = capacity.max(1);
    // Long enough for a full queue to drain, and at least 5 s.
    let drain = interval.saturating_mul(b);
    let every = (drain + drain / 2).max(Duration::from_secs(5));
    vec![
        Pattern {
            name: "steady",
            shape: Shape::Even {
                first: Duration::ZERO,
                every: (interval + interval / 4).max(MIN_GAP),
            },
        },
        Pattern {
            name: "bursty",
            shape: Shape::Bursts {
                first: Duration::from_secs(1).min(duration / 2),
                every,
                size: b.saturating_mul(3).clamp(3, MAX_BURST),
            },
        },
        Pattern {
            name: "flood",
            shape: Shape::Even {
                first: Duration::ZERO,
                every: (interval / 3).max(MIN_GAP),
            },
        },
    ]
}

/// Everything a sender needs.
#[derive(Clone)]
pub struct Target {
    pub http: HttpClient,
    pub proxy: SocketAddr,
    pub recorder: Arc<Recorder>,
    /// Turns true when the demo stops: requests still waiting give up.
    pub stop: watch::Receiver<bool>,
}

/// Send `pattern`'s requests on schedule from `start` until `end` (an
/// offset from `start`), each in its own task.
pub async fn drive(index: usize, pattern: Pattern, start: Instant, end: Duration, target: Target) {
    let start = tokio::time::Instant::from_std(start);
    for offset in pattern.schedule(end) {
        tokio::time::sleep_until(start + offset).await;
        // A timer that fires late must not send past the end.
        if *target.stop.borrow() || tokio::time::Instant::now() >= start + end {
            return;
        }
        let target = target.clone();
        tokio::spawn(send_one(index, pattern.name, target));
    }
}

/// Send one request and record its answer.
async fn send_one(index: usize, name: &'static str, target: Target) {
    let Target {
        http,
        proxy,
        recorder,
        mut stop,
    } = target;
    let seq = recorder.sent(index, Instant::now());
    let request = Request::get(format!("http://{proxy}/demo"))
        .header("x-client", name)
        .header(SEQ_HEADER, seq)
        .body(Empty::new());
    let Ok(request) = request else {
        recorder.answered(seq, Instant::now(), Answer::Failed);
        return;
    };
    let call = async {
        match http.request(request).await {
            Ok(response) => {
                let status = response.status().as_u16();
                let at = Instant::now();
                // Read the (small) body so the connection goes back to the pool.
                let _ = response.into_body().collect().await;
                (at, Answer::Status(status))
            }
            Err(_) => (Instant::now(), Answer::Failed),
        }
    };
    let (at, answer) = tokio::select! {
        done = call => done,
        _ = stop.wait_for(|s| *s) => (Instant::now(), Answer::Cancelled),
    };
    recorder.answered(seq, at, answer);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_patterns_are_below_at_and_above_the_rate() {
        let p = patterns(Duration::from_millis(200), 10, Duration::from_secs(15));
        let names: Vec<_> = p.iter().map(|p| p.name).collect();
        assert_eq!(names, ["steady", "bursty", "flood"]);
        assert_eq!(p[0].describe(), "4/s evenly");
        assert_eq!(p[1].describe(), "30 at once every 5s");
        assert_eq!(p[2].describe(), "15/s evenly");
        // Slow rates in their own unit, not rounded to "0/s".
        let slow = patterns(Duration::from_secs(3600), 10, Duration::from_secs(15));
        assert_eq!(slow[0].describe(), "19.2/d evenly");
    }

    #[test]
    fn schedules_stop_at_the_end() {
        let p = patterns(Duration::from_millis(200), 10, Duration::from_secs(15));
        let end = Duration::from_secs(3);
        assert_eq!(p[0].schedule(end).len(), 12);
        assert_eq!(p[1].schedule(end).len(), 30);
        assert!(p[2].schedule(end).iter().all(|t| *t < end));
        // 1/r ÷ 3 rounds down to whole nanoseconds: 45 or 46 fit.
        assert!((45..=46).contains(&p[2].schedule(end).len()));
    }

    #[test]
    fn in_a_short_run_the_bursty_client_still_sends() {
        let end = Duration::from_secs(1);
        let p = patterns(Duration::from_millis(200), 10, end);
        assert_eq!(p[1].schedule(end).len(), 30, "its burst comes at 500 ms");
    }
}
