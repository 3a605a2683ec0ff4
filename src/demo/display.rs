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

/// How to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    /// Redraw a chart in place (stdout is a terminal).
    pub live: bool,
    /// Use colours (live only; off with `NO_COLOR`).
    pub color: bool,
}

/// Columns of history shown in the live chart.
const HISTORY: usize = 20;
/// Width of a bar in the live chart.
const BAR: usize = 20;

const YELLOW: &str = "\x1b[33m";
const GREEN: &str = "\x1b[32m";
const MAGENTA: &str = "\x1b[35m";
const RED: &str = "\x1b[31m";
const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

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
    /// Lines of the last live frame (to move back over).
    drawn: usize,
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
            drawn: 0,
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
        if self.style.color {
            format!("{color}{text}{RESET}")
        } else {
            text.to_string()
        }
    }

    fn frame(&mut self, t: u64, sending: bool, counts: &[TickCounts]) -> io::Result<()> {
        let full = (self.rate * 3.0).max(1.0);
        let cap = f64::from(self.capacity.max(1));
        let mut lines = Vec::new();
        let when = if sending {
            format!("t = {t} s of {}", humantime::format_duration(self.duration))
        } else {
            format!(
                "t = {t} s: clients stopped at {}, queues draining",
                humantime::format_duration(self.duration)
            )
        };
        lines.push(format!(
            "{}   rate {}   capacity {}   {when}",
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
                "bar: in/out up to 3·r, queue up to b",
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
            let refused = format!("429s {:>3} (total {})", c.refused, c.refused_total);
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
        lines.push(self.paint(
            DIM,
            "in: sent by the client   out: reached the downstream   queue: waiting in sluice   429s: refused",
        ));

        if self.drawn > 0 {
            write!(self.out, "\x1b[{}A\r", self.drawn)?;
        }
        for l in &lines {
            writeln!(self.out, "\x1b[2K{l}")?;
        }
        self.drawn = lines.len();
        self.out.flush()
    }
}

/// A history strip: one block character per value, ' ' for zero, ▁..█
/// scaled to `full` (values above it show as █).
fn spark(values: impl Iterator<Item = f64>, full: f64) -> String {
    const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    values
        .map(|v| {
            if v <= 0.0 {
                ' '
            } else {
                let i = ((v / full) * 8.0).ceil().clamp(1.0, 8.0) as usize;
                LEVELS[i - 1]
            }
        })
        .collect()
}

/// A horizontal bar of `width` cells (eighths for the last one) for
/// `value` out of `full`; `▸` at the end when the value is above `full`.
fn bar(value: f64, full: f64, width: usize) -> String {
    const PARTS: [char; 7] = ['▏', '▎', '▍', '▌', '▋', '▊', '▉'];
    let over = value > full;
    let eighths = ((value.min(full) / full) * (width * 8) as f64).round() as usize;
    let mut s: String = "█".repeat(eighths / 8);
    if let Some(part) = (eighths % 8).checked_sub(1) {
        s.push(PARTS[part]);
    }
    let mut s = pad(&s, width);
    if over {
        s.push('▸');
    } else {
        s.push(' ');
    }
    s
}

/// Pad with spaces to `width` characters.
fn pad(s: &str, width: usize) -> String {
    let n = s.chars().count();
    let mut out = s.to_string();
    out.extend(std::iter::repeat_n(' ', width.saturating_sub(n)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_fill_in_eighths_and_mark_overflow() {
        assert_eq!(bar(0.0, 10.0, 4), "     ");
        assert_eq!(bar(10.0, 10.0, 4), "████ ");
        assert_eq!(bar(5.0, 10.0, 4), "██   ");
        assert_eq!(bar(30.0, 10.0, 4), "████▸");
        assert_eq!(bar(1.0, 16.0, 2), "▏  ");
    }

    #[test]
    fn sparks_scale_and_show_zero_as_blank() {
        assert_eq!(spark([0.0, 1.0, 15.0, 30.0].into_iter(), 15.0), " ▁██");
    }

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
        // 2 header lines, 3 per client, 1 legend.
        assert!(text.contains("\x1b[6A\r"), "{text:?}");
    }
}
