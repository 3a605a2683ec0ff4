//! Terminal output shared by `sluice demo` and `sluice top`: whether to
//! draw live (stdout is a terminal) or print plain lines, colours, history
//! strips and bars, and redrawing a frame in place.

use std::io::{self, IsTerminal, Write};

pub const YELLOW: &str = "\x1b[33m";
pub const GREEN: &str = "\x1b[32m";
pub const MAGENTA: &str = "\x1b[35m";
pub const RED: &str = "\x1b[31m";
pub const DIM: &str = "\x1b[2m";
pub const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

/// How to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    /// Redraw a frame in place (stdout is a terminal).
    pub live: bool,
    /// Use colours (live only; off with `NO_COLOR`).
    pub color: bool,
}

impl Style {
    /// Live on a terminal whose `TERM` is not `dumb`; plain lines on a
    /// pipe, a file or CI. Colours unless `NO_COLOR` is set.
    pub fn detect(stdout: &io::Stdout) -> Style {
        let live = stdout.is_terminal() && std::env::var("TERM").map_or(true, |t| t != "dumb");
        let color = live && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        Style { live, color }
    }

    /// `text` in `color` when colours are on.
    pub fn paint(&self, color: &str, text: &str) -> String {
        if self.color {
            format!("{color}{text}{RESET}")
        } else {
            text.to_string()
        }
    }
}

/// A frame redrawn in place: each `draw` moves back over the last one.
/// Lines wider than the terminal are cut at its edge rather than wrapped
/// (auto-wrap off while the frame is written, DECAWM): a wrapped line
/// would take two rows where the next draw moves back over one, and the
/// frames would pile up down an 80-column terminal.
#[derive(Debug, Default)]
pub struct Frame {
    drawn: usize,
}

impl Frame {
    pub fn draw(&mut self, out: &mut dyn Write, lines: &[String]) -> io::Result<()> {
        write!(out, "\x1b[?7l")?;
        if self.drawn > 0 {
            write!(out, "\x1b[{}A\r", self.drawn)?;
        }
        for l in lines {
            writeln!(out, "\x1b[2K{l}")?;
        }
        // A shorter frame leaves no stale lines below it.
        for _ in lines.len()..self.drawn {
            writeln!(out, "\x1b[2K")?;
        }
        self.drawn = lines.len().max(self.drawn);
        write!(out, "\x1b[?7h")?;
        out.flush()
    }
}

/// A history strip: one block character per value, ' ' for zero, ▁..█
/// scaled to `full` (values above it show as █).
pub fn spark(values: impl Iterator<Item = f64>, full: f64) -> String {
    const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    values
        .map(|v| {
            // A NaN (from a peer's numbers) draws blank too.
            if v.is_nan() || v <= 0.0 {
                ' '
            } else {
                // Clamped as an integer: a NaN ratio casts to 0.
                let i = ((v / full) * 8.0).ceil() as usize;
                LEVELS[i.clamp(1, 8) - 1]
            }
        })
        .collect()
}

/// A horizontal bar of `width` cells (eighths for the last one) for
/// `value` out of `full`; `▸` at the end when the value is above `full`.
pub fn bar(value: f64, full: f64, width: usize) -> String {
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
pub fn pad(s: &str, width: usize) -> String {
    let n = s.chars().count();
    let mut out = s.to_string();
    out.extend(std::iter::repeat_n(' ', width.saturating_sub(n)));
    out
}

/// `s` in exactly `width` columns: padded, or cut with an ellipsis.
pub fn fit(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return pad(s, width);
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
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
        assert_eq!(spark([f64::NAN, -1.0].into_iter(), 15.0), "  ");
    }

    #[test]
    fn frames_move_back_over_the_last_one() {
        let mut buf = Vec::new();
        let mut f = Frame::default();
        f.draw(&mut buf, &["a".into(), "b".into(), "c".into()])
            .unwrap();
        f.draw(&mut buf, &["a".into()]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(text.contains("\x1b[3A\r"), "{text:?}");
        // The second frame clears the two lines it no longer uses.
        assert_eq!(text.matches("\x1b[2K").count(), 6);
        // Each frame is written with auto-wrap off, and turns it back on.
        assert!(text.starts_with("\x1b[?7l"), "{text:?}");
        assert!(text.ends_with("\x1b[?7h"), "{text:?}");
        assert_eq!(text.matches("\x1b[?7l").count(), 2);
    }
}
