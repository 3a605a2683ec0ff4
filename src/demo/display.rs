//! What the demo prints once per tick.
//!
//! On a terminal: a small chart redrawn in place with ANSI escapes. Per
//! client, three rows (in, out, queue), each with a history strip (one
//! column per second) and a bar for the last second, so that a glance shows
//! spiky input above flat output. Not on a terminal (a pipe, a file, CI):
//! plain `key=value` lines, one per client per tick, with no escape codes.
//!
//! This module only formats; the numbers come from `record`.

use std::io::{self, Write};
use std::time::Duration;

use super::record::TickCounts;
use crate::term::{BOLD, DIM, Frame, GREEN, MAGENTA, RED, Style, YELLOW, bar, pad, spark};

/// Columns of history shown in the live chart.
const HISTORY: usize = 16;
/// Width of a bar in the live chart.
const BAR: usize = 14;

/// The tick printer.
pub struct Screen<'a> {
    out: &'a mut dyn Write,
    style: Style,
    names: Vec<&'static str>,
    /// r, per second (the scale of the in/out bars is 3·r).
    rate: f64,
    rate_text: String,
    capacity: u32,
    duration: Duration,
    /// Every tick so far, per client.
    history: Vec<Vec<TickCounts>>,
    frame: Frame,
    announced_drain: bool,
}

impl<'a> Screen<'a> {
    pub fn new(
        out: &'a mut dyn Write,
        style: Style,
        names: Vec<&'static str>,
        rate: f64,
        rate_text: String,
        capacity: u32,
        duration: Duration,
    ) -> Screen<'a> {
        let history = vec![Vec::new(); names.len()];
        Screen {
            out,
            style,
            names,
            rate,
            rate_text,
            capacity,
            duration,
            history,
            frame: Frame::default(),
            announced_drain: false,
        }
    }

    /// Print free text above the chart (before the first tick).
    pub fn line(&mut self, text: &str) -> io::Result<()> {
        writeln!(self.out, "{text}")?;
        self.out.flush()
    }

    /// Show tick `t` (seconds since the start).
    pub fn tick(&mut self, t: u64, counts: &[TickCounts]) -> io::Result<()> {
        for (h, c) in self.history.iter_mut().zip(counts) {
            h.push(*c);
        }
        // Tick t covers the second (t − 1, t]: clients sent during it if it
        // began before the end.
        let sending = Duration::from_secs(t.saturating_sub(1)) < self.duration;
        if self.style.live {
            self.frame(t, sending, counts)
        } else {
            self.plain(t, sending, counts)
        }
    }

    fn plain(&mut self, t: u64, sending: bool, counts: &[TickCounts]) -> io::Result<()> {
        if !sending && !self.announced_drain {
            self.announced_drain = true;
            writeln!(
                self.out,
                "clients stopped at {}; queued requests drain at the rate",
                humantime::format_duration(self.duration)
            )?;
        }
        for (name, c) in self.names.iter().zip(counts) {
            writeln!(
                self.out,
                "t={t}s client={name} in={}/s out={}/s queue={}/{} 429s={} total_429s={}",
                c.input, c.output, c.queue, self.capacity, c.refused, c.refused_total
            )?;
        }
        self.out.flush()
    }

    fn paint(&self, color: &str, text: &str) -> String {
        self.style.paint(color, text)
    }

    fn frame(&mut self, t: u64, sending: bool, counts: &[TickCounts]) -> io::Result<()> {
        let full = (self.rate * 3.0).max(1.0);
        let cap = f64::from(self.capacity.max(1));
        let mut lines = Vec::new();
        // Every line fits 80 columns (a longer one is cut at the edge).
        let when = if sending {
            format!("t={t}s of {}", humantime::format_duration(self.duration))
        } else {
            format!("t={t}s, draining")
        };
        lines.push(format!(
            "{}  rate {}  capacity {}  {when}",
            self.paint(BOLD, "sluice demo"),
            self.rate_text,
            self.capacity
        ));
        lines.push(self.paint(
            DIM,
            &format!(
                "{:<14}{:<width$} {:>9}  {}",
                "",
                "history, 1 col = 1 s",
                "last 1 s",
                "bar: in/out to 3·r, queue to b",
                width = HISTORY
            ),
        ));
        for (i, name) in self.names.iter().enumerate() {
            let h = &self.history[i];
            let Some(c) = counts.get(i) else { continue };
            let recent = &h[h.len().saturating_sub(HISTORY)..];
            let spark_in = spark(recent.iter().map(|c| c.input as f64), full);
            let spark_out = spark(recent.iter().map(|c| c.output as f64), full);
            let spark_q = spark(recent.iter().map(|c| c.queue as f64), cap);
            lines.push(format!(
                "{}{:<6}{} {:>7}/s  {}",
                self.paint(BOLD, &format!("{name:<8}")),
                "in",
                self.paint(YELLOW, &pad(&spark_in, HISTORY)),
                c.input,
                self.paint(YELLOW, &bar(c.input as f64, full, BAR))
            ));
            lines.push(format!(
                "{:<8}{:<6}{} {:>7}/s  {}",
                "",
                "out",
                self.paint(GREEN, &pad(&spark_out, HISTORY)),
                c.output,
                self.paint(GREEN, &bar(c.output as f64, full, BAR))
            ));
            let refused = format!("429s {:>3} (all {})", c.refused, c.refused_total);
            let refused = if c.refused > 0 {
                self.paint(RED, &refused)
            } else {
                refused
            };
            lines.push(format!(
                "{:<8}{:<6}{} {:>9}  {}  {refused}",
                "",
                "queue",
                self.paint(MAGENTA, &pad(&spark_q, HISTORY)),
                format!("{}/{}", c.queue, self.capacity),
                self.paint(MAGENTA, &bar(c.queue as f64, cap, BAR)),
            ));
        }
        lines.push(self.paint(DIM, "in: sent by the client   out: reached the downstream"));
        lines.push(self.paint(DIM, "queue: waiting in sluice   429s: refused"));

        self.frame.draw(self.out, &lines)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_have_no_escape_codes() {
        let mut buf = Vec::new();
        let mut s = Screen::new(
            &mut buf,
            Style {
                live: false,
                color: false,
            },
            vec!["a", "b"],
            5.0,
            "5/s".into(),
            10,
            Duration::from_secs(2),
        );
        let c = TickCounts {
            input: 15,
            output: 5,
            queue: 10,
            refused: 9,
            refused_total: 20,
        };
        s.tick(1, &[c, TickCounts::default()]).unwrap();
        s.tick(3, &[c, c]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(!text.contains('\x1b'));
        assert_eq!(
            text.lines().next(),
            Some("t=1s client=a in=15/s out=5/s queue=10/10 429s=9 total_429s=20")
        );
        assert!(text.contains("clients stopped at 2s"));
        assert_eq!(text.lines().count(), 5);
    }

    #[test]
    fn live_frames_redraw_in_place() {
        let mut buf = Vec::new();
        let mut s = Screen::new(
            &mut buf,
            Style {
                live: true,
                color: true,
            },
            vec!["a"],
            5.0,
            "5/s".into(),
            10,
            Duration::from_secs(15),
        );
        s.tick(1, &[TickCounts::default()]).unwrap();
        s.tick(2, &[TickCounts::default()]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        // 2 header lines, 3 per client, 2 of legend.
        assert!(text.contains("\x1b[7A\r"), "{text:?}");
    }

    #[test]
    fn every_line_fits_80_columns() {
        let mut buf = Vec::new();
        let mut s = Screen::new(
            &mut buf,
            Style {
                live: true,
                color: false,
            },
            vec!["steady", "bursty", "flood"],
            5.0,
            "5/s (1/r = 200ms)".into(),
            10,
            Duration::from_secs(15),
        );
        let busy = TickCounts {
            input: 1500,
            output: 5,
            queue: 10,
            refused: 1495,
            refused_total: 99_999,
        };
        s.tick(16, &[busy; 3]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        // Without the cursor and erase codes, each line as it shows.
        let shown = text
            .replace("\x1b[?7l", "")
            .replace("\x1b[?7h", "")
            .replace("\x1b[2K", "");
        for line in shown.lines() {
            let width = line.chars().count();
            assert!(width <= 80, "{width} columns: {line:?}");
        }
    }
}
