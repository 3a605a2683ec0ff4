//! What the demo saw: every request a client sent (when, and how it was
//! answered), every arrival at the downstream (when, and for which
//! client), and each client's queue level sampled from sluice itself every
//! few milliseconds. The tick display, the summary and the plot read it.
//!
//! It only records and counts; it never decides anything.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::plot;

/// How one request ended, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// An HTTP response with this status.
    Status(u16),
    /// No response: the connection failed.
    Failed,
    /// Abandoned at the end of the demo (still waiting).
    Cancelled,
}

/// One request sent by a demo client.
#[derive(Debug, Clone)]
pub struct Sent {
    /// Index of the client (pattern) that sent it.
    pub client: usize,
    pub at: Instant,
    /// When its answer came back, and what it was.
    pub answer: Option<(Instant, Answer)>,
    /// When it reached the downstream, if it did.
    pub arrived: Option<Instant>,
}

/// One request as the downstream saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: Instant,
    /// The `X-Client` header.
    pub client: String,
}

/// One sample of one client's queue level.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    client: usize,
    /// Cost waiting in sluice's queue for this client.
    level: u64,
}

#[derive(Default)]
struct Inner {
    sent: Vec<Sent>,
    arrivals: Vec<Arrival>,
    samples: Vec<Sample>,
}

/// The shared log. Cheap to lock: every operation is a push or a scan of
/// a few thousand entries once a second.
#[derive(Default)]
pub struct Recorder {
    inner: Mutex<Inner>,
}

/// One client's numbers for one tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickCounts {
    /// Requests sent during the tick.
    pub input: u64,
    /// Requests that reached the downstream during the tick.
    pub output: u64,
    /// Requests waiting in sluice's queue at the tick's end (its last
    /// sample).
    pub queue: u64,
    /// 429s received during the tick.
    pub refused: u64,
    /// 429s received since the start.
    pub refused_total: u64,
}

/// A request that reached the downstream no later than this after it was
/// sent (or half of 1/r, if less) counts as forwarded at once; a later one
/// waited in the queue. Loopback and the proxy itself take well under it,
/// and a request that waits at all in the demo's patterns waits far longer.
const QUEUED_AFTER: Duration = Duration::from_millis(20);

/// Gaps between consecutive departures, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spacing {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

/// One client's totals, for the summary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientSummary {
    pub name: String,
    pub sent: u64,
    /// Reached the downstream.
    pub forwarded: u64,
    /// Answered 429.
    pub refused: u64,
    /// Neither forwarded nor refused (failed, other status, or still
    /// waiting at the end).
    pub other: u64,
    /// Highest queue level sampled.
    pub max_queue: u64,
    /// Gaps between consecutive departures of requests that both waited:
    /// the spacing the pacer sets to exactly 1/r, as the downstream saw it.
    pub queued_spacing: Option<Spacing>,
}

impl Recorder {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Note a request about to be sent; returns its sequence number (sent
    /// to the downstream in `X-Demo-Seq`).
    pub fn sent(&self, client: usize, at: Instant) -> usize {
        let mut inner = self.lock();
        inner.sent.push(Sent {
            client,
            at,
            answer: None,
            arrived: None,
        });
        inner.sent.len() - 1
    }

    /// Note the answer to request `seq`.
    pub fn answered(&self, seq: usize, at: Instant, answer: Answer) {
        if let Some(s) = self.lock().sent.get_mut(seq)
            && s.answer.is_none()
        {
            s.answer = Some((at, answer));
        }
    }

    /// Note an arrival at the downstream.
    pub fn arrived(&self, at: Instant, client: String, seq: Option<usize>) {
        let mut inner = self.lock();
        if let Some(s) = seq.and_then(|seq| inner.sent.get_mut(seq))
            && s.arrived.is_none()
        {
            s.arrived = Some(at);
        }
        inner.arrivals.push(Arrival { at, client });
    }

    /// Note client `client`'s queue level at `at`.
    pub fn sampled(&self, at: Instant, client: usize, level: u64) {
        self.lock().samples.push(Sample { at, client, level });
    }

    /// Each client's sampled queue level as steps `(seconds from start,
    /// level)`, starting at `(0, 0)`, one step per change.
    pub fn queue_steps(&self, clients: usize, start: Instant) -> Vec<Vec<(f64, u64)>> {
        let mut steps = vec![vec![(0.0, 0u64)]; clients];
        for x in &self.lock().samples {
            let Some(s) = steps.get_mut(x.client) else {
                continue;
            };
            if s.last().is_some_and(|last| last.1 != x.level) {
                s.push((x.at.saturating_duration_since(start).as_secs_f64(), x.level));
            }
        }
        steps
    }

    /// Whether every request sent so far has its answer.
    pub fn all_answered(&self) -> bool {
        self.lock().sent.iter().all(|s| s.answer.is_some())
    }

    /// Each client's numbers for the tick `(from, to]`.
    pub fn tick(&self, names: &[&str], from: Instant, to: Instant) -> Vec<TickCounts> {
        let inner = self.lock();
        let mut counts = vec![TickCounts::default(); names.len()];
        let within = |t: Instant| t > from && t <= to;
        for s in &inner.sent {
            let Some(c) = counts.get_mut(s.client) else {
                continue;
            };
            if within(s.at) {
                c.input += 1;
            }
            if let Some((at, Answer::Status(429))) = s.answer
                && at <= to
            {
                c.refused_total += 1;
                if at > from {
                    c.refused += 1;
                }
            }
        }
        for sample in inner.samples.iter().filter(|x| x.at <= to) {
            if let Some(c) = counts.get_mut(sample.client) {
                c.queue = sample.level;
            }
        }
        for a in &inner.arrivals {
            if within(a.at)
                && let Some(i) = names.iter().position(|n| *n == a.client)
            {
                counts[i].output += 1;
            }
        }
        counts
    }

    /// Each client's requests as plot marks, times in seconds from `start`.
    /// `interval` is 1/r (a request counts as queued when it reached the
    /// downstream later than min(`QUEUED_AFTER`, 1/r ÷ 2) after it was
    /// sent).
    pub fn marks(
        &self,
        clients: usize,
        start: Instant,
        interval: Duration,
    ) -> Vec<Vec<plot::Mark>> {
        let threshold = QUEUED_AFTER.min(interval / 2);
        let secs = |t: Instant| t.saturating_duration_since(start).as_secs_f64();
        let mut marks = vec![Vec::new(); clients];
        for s in &self.lock().sent {
            let fate = match (s.arrived, s.answer) {
                (Some(arrived), _) if arrived.saturating_duration_since(s.at) > threshold => {
                    plot::Fate::Queued {
                        departure: secs(arrived),
                    }
                }
                (Some(arrived), _) => plot::Fate::Immediate {
                    departure: secs(arrived),
                },
                (None, Some((_, Answer::Status(429)))) => plot::Fate::Rejected,
                (None, _) => plot::Fate::Unknown,
            };
            if let Some(m) = marks.get_mut(s.client) {
                m.push(plot::Mark {
                    arrival: secs(s.at),
                    cost: 1,
                    fate,
                });
            }
        }
        marks
    }
}

/// A client's summary from its marks and sampled queue steps.
pub fn summarize(name: &str, marks: &[plot::Mark], queue: &[(f64, u64)]) -> ClientSummary {
    let mut departures: Vec<(f64, bool)> = marks
        .iter()
        .filter_map(|m| match m.fate {
            plot::Fate::Immediate { departure } => Some((departure, false)),
            plot::Fate::Queued { departure } => Some((departure, true)),
            _ => None,
        })
        .collect();
    departures.sort_by(|a, b| a.0.total_cmp(&b.0));
    let gaps: Vec<f64> = departures
        .windows(2)
        .filter(|w| w[0].1 && w[1].1)
        .map(|w| w[1].0 - w[0].0)
        .collect();
    let queued_spacing = (!gaps.is_empty()).then(|| Spacing {
        mean: gaps.iter().sum::<f64>() / gaps.len() as f64,
        min: gaps.iter().copied().fold(f64::INFINITY, f64::min),
        max: gaps.iter().copied().fold(0.0, f64::max),
    });
    let count = |fate: plot::Fate| marks.iter().filter(|m| m.fate == fate).count() as u64;
    ClientSummary {
        name: name.to_string(),
        sent: marks.len() as u64,
        forwarded: departures.len() as u64,
        refused: count(plot::Fate::Rejected),
        other: count(plot::Fate::Unknown),
        max_queue: plot::max_level(queue),
        queued_spacing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tick_counts_input_output_queue_and_refusals() {
        let r = Recorder::default();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let a = r.sent(0, ms(100));
        let b = r.sent(0, ms(200));
        let c = r.sent(0, ms(300));
        r.arrived(ms(101), "x".into(), Some(a));
        r.answered(a, ms(102), Answer::Status(200));
        r.answered(c, ms(301), Answer::Status(429));
        r.sampled(ms(210), 0, 1);
        r.sampled(ms(1010), 0, 0);
        let t = r.tick(&["x"], t0, ms(1000));
        assert_eq!(
            t[0],
            TickCounts {
                input: 3,
                output: 1,
                queue: 1,
                refused: 1,
                refused_total: 1
            }
        );
        r.arrived(ms(1200), "x".into(), Some(b));
        let t = r.tick(&["x"], ms(1000), ms(2000));
        assert_eq!((t[0].input, t[0].output, t[0].queue), (0, 1, 0));
        assert_eq!((t[0].refused, t[0].refused_total), (0, 1));
    }

    #[test]
    fn queue_steps_keep_only_changes() {
        let r = Recorder::default();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        for (at, level) in [(10, 0), (20, 1), (30, 1), (40, 2), (50, 0)] {
            r.sampled(ms(at), 0, level);
        }
        let steps = r.queue_steps(1, t0);
        let levels: Vec<u64> = steps[0].iter().map(|s| s.1).collect();
        assert_eq!(levels, [0, 1, 2, 0]);
    }

    #[test]
    fn summary_measures_spacing_of_queued_departures() {
        let q = |a: f64, d: f64| plot::Mark {
            arrival: a,
            cost: 1,
            fate: plot::Fate::Queued { departure: d },
        };
        let marks = [
            plot::Mark {
                arrival: 0.0,
                cost: 1,
                fate: plot::Fate::Immediate { departure: 0.0 },
            },
            q(0.01, 0.2),
            q(0.02, 0.4),
            q(0.025, 0.6),
            plot::Mark {
                arrival: 0.04,
                cost: 1,
                fate: plot::Fate::Rejected,
            },
        ];
        let s = summarize("x", &marks, &[(0.0, 0), (0.01, 1), (0.02, 2), (0.2, 1)]);
        assert_eq!((s.sent, s.forwarded, s.refused, s.max_queue), (5, 4, 1, 2));
        let spacing = s.queued_spacing.unwrap();
        assert!((spacing.mean - 0.2).abs() < 1e-9, "{spacing:?}");
        assert!((spacing.min - 0.2).abs() < 1e-9 && (spacing.max - 0.2).abs() < 1e-9);
    }
}
