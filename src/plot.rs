//! SVG plots of a shaped trace: the classic leaky-bucket picture, one panel
//! per client. Used by `sluice demo` (a live run) and `sluice simulate` (a
//! recorded trace run through the engine in virtual time).
//!
//! Each panel shows, over a shared time axis in seconds:
//! - the input: one tick per arrival, blue when admitted, red when refused
//!   (429), grey when its fate is unknown (the run ended first, or it
//!   failed);
//! - the queue level: waiting cost as a step line, with the capacity b as a
//!   dashed line;
//! - the output: one tick per departure (green).
//!
//! This module only draws: it knows nothing about HTTP, the engine or
//! clocks. The output is a self-contained SVG 1.1 document (valid XML, text
//! escaped), written without any dependency.

use std::fmt::Write as _;

/// A whole plot: a title, the shaping parameters, and one panel per client.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// First line of the header.
    pub title: String,
    /// Second line of the header (parameters, what was run).
    pub subtitle: String,
    /// Capacity b, drawn as a dashed line in every panel.
    pub capacity: u32,
    /// The end of the time axis in seconds (it starts at 0). Raised to the
    /// last event when an event comes later.
    pub end: f64,
    /// One panel per client, drawn top to bottom.
    pub panels: Vec<Panel>,
}

/// One client's requests.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// The client's name or key.
    pub name: String,
    /// Its requests, in any order.
    pub requests: Vec<Mark>,
    /// The queue level as measured, `(seconds, level)` steps in time
    /// order; `None`: derived from the requests with [`queue_steps`].
    pub queue: Option<Vec<(f64, u64)>>,
}

/// One request: when it arrived, what it cost, what became of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mark {
    /// Arrival, in seconds from the start.
    pub arrival: f64,
    /// Cost units (1 unless the route charges more).
    pub cost: u32,
    /// What happened to it.
    pub fate: Fate,
}

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fate {
    /// Forwarded at once (the client was idle): it never waited.
    Immediate {
        /// Departure, in seconds from the start.
        departure: f64,
    },
    /// Admitted, waited in the queue, then departed.
    Queued {
        /// Departure, in seconds from the start.
        departure: f64,
    },
    /// Refused at once (429).
    Rejected,
    /// Unknown: no departure and no refusal seen (failed, or the run ended).
    Unknown,
}

impl Fate {
    /// The departure time, if it departed.
    pub fn departure(self) -> Option<f64> {
        match self {
            Fate::Immediate { departure } | Fate::Queued { departure } => Some(departure),
            Fate::Rejected | Fate::Unknown => None,
        }
    }
}

/// The queue level over time for one client: `(time, waiting cost from
/// then on)`, starting at `(0, 0)`. Only requests that waited count; at
/// equal times departures come before arrivals (a perfect pacer releases
/// what is due before it looks at a new arrival).
pub fn queue_steps(requests: &[Mark]) -> Vec<(f64, u64)> {
    // (time, order, delta): order 0 = departure, 1 = arrival.
    let mut events: Vec<(f64, u8, i64)> = Vec::new();
    for r in requests {
        if let Fate::Queued { departure } = r.fate {
            events.push((r.arrival, 1, i64::from(r.cost)));
            events.push((departure, 0, -i64::from(r.cost)));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut steps = vec![(0.0, 0u64)];
    let mut level: i64 = 0;
    for (t, _, delta) in events {
        level = (level + delta).max(0);
        let level = level.unsigned_abs();
        match steps.last_mut() {
            Some(last) if last.0 == t => last.1 = level,
            _ => steps.push((t, level)),
        }
    }
    steps
}

/// The highest queue level in `steps`.
pub fn max_level(steps: &[(f64, u64)]) -> u64 {
    steps.iter().map(|s| s.1).max().unwrap_or(0)
}

// === layout ===

const WIDTH: f64 = 960.0;
const LEFT: f64 = 84.0;
const RIGHT: f64 = 24.0;
const HEADER: f64 = 78.0;
const PANEL: f64 = 214.0;
const FOOTER: f64 = 12.0;
/// Offsets inside a panel, from its top.
const NAME_Y: f64 = 14.0;
const IN_TOP: f64 = 22.0;
const IN_BOTTOM: f64 = 38.0;
const PLOT_TOP: f64 = 46.0;
const PLOT_BOTTOM: f64 = 156.0;
const OUT_TOP: f64 = 164.0;
const OUT_BOTTOM: f64 = 180.0;
const AXIS_LABELS_Y: f64 = 194.0;

const BLUE: &str = "#1f77b4";
const RED: &str = "#d62728";
const GREEN: &str = "#2ca02c";
const GREY: &str = "#999999";
const QUEUE: &str = "#6a3d9a";

/// Most panels drawn; further clients are named in a note.
pub const MAX_PANELS: usize = 24;

/// Render `chart` as an SVG document.
pub fn svg(chart: &Chart) -> String {
    let end = chart_end(chart);
    let panels = &chart.panels[..chart.panels.len().min(MAX_PANELS)];
    let hidden = chart.panels.len() - panels.len();
    let height = HEADER + PANEL * panels.len().max(1) as f64 + FOOTER + 16.0;
    let x = |t: f64| LEFT + (t / end) * (WIDTH - LEFT - RIGHT);

    let mut s = String::new();
    let _ = writeln!(s, r##"<?xml version="1.0" encoding="UTF-8"?>"##);
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"##
    );
    let _ = writeln!(s, "<title>{}</title>", escape(&chart.title));
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"##
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="20" font-size="15" font-weight="bold">{}</text>"##,
        escape(&chart.title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="38" fill="#444">{}</text>"##,
        escape(&chart.subtitle)
    );
    let unknown = chart
        .panels
        .iter()
        .any(|p| p.requests.iter().any(|r| r.fate == Fate::Unknown));
    legend(&mut s, 58.0, unknown);

    if panels.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="{LEFT}" y="{}" fill="#444">no requests</text>"##,
            HEADER + 30.0
        );
    }
    for (i, panel) in panels.iter().enumerate() {
        let top = HEADER + PANEL * i as f64;
        draw_panel(&mut s, panel, chart, top, end, &x);
    }
    if hidden > 0 {
        let _ = writeln!(
            s,
            r##"<text x="{LEFT}" y="{}" fill="#444">{hidden} more clients not drawn</text>"##,
            height - 8.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The end of the time axis: the chart's, or the last event's, with a
/// little room after it.
fn chart_end(chart: &Chart) -> f64 {
    let last = chart
        .panels
        .iter()
        .flat_map(|p| {
            p.requests
                .iter()
                .flat_map(|r| [Some(r.arrival), r.fate.departure()])
                .chain(p.queue.iter().flatten().map(|s| Some(s.0)))
        })
        .flatten()
        .filter(|t| t.is_finite())
        .fold(0.0f64, f64::max);
    let end = if chart.end.is_finite() {
        chart.end.max(last)
    } else {
        last
    };
    if end > 0.0 { end * 1.02 } else { 1.0 }
}

/// The legend; the grey "no answer" entry only when some arrival has no
/// known fate.
fn legend(s: &mut String, y: f64, unknown: bool) {
    // (colour, label, drawn as a line, dashed)
    let mut items: Vec<(&str, &str, bool, bool)> = vec![
        (BLUE, "arrival, admitted", false, false),
        (RED, "arrival, refused (429)", false, false),
    ];
    if unknown {
        items.push((GREY, "arrival, no answer", false, false));
    }
    items.extend([
        (GREEN, "departure (forwarded)", false, false),
        (QUEUE, "queue level", true, false),
        (RED, "capacity b", true, true),
    ]);
    let mut x = LEFT;
    for (color, label, is_line, dashed) in items {
        if is_line {
            let dash = if dashed {
                r##" stroke-dasharray="4 3""##
            } else {
                ""
            };
            let _ = writeln!(
                s,
                r##"<line x1="{x}" y1="{}" x2="{}" y2="{}" stroke="{color}" stroke-width="2"{dash}/>"##,
                y - 4.0,
                x + 16.0,
                y - 4.0
            );
        } else {
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{}" x2="{}" y2="{y}" stroke="{color}" stroke-width="2"/>"##,
                x + 8.0,
                y - 10.0,
                x + 8.0
            );
        }
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{y}">{}</text>"##,
            x + 20.0,
            escape(label)
        );
        x += 22.0 + label.len() as f64 * 6.0 + 14.0;
    }
}

fn draw_panel(
    s: &mut String,
    panel: &Panel,
    chart: &Chart,
    top: f64,
    end: f64,
    x: &impl Fn(f64) -> f64,
) {
    let right = WIDTH - RIGHT;
    let admitted = panel
        .requests
        .iter()
        .filter(|r| r.fate.departure().is_some())
        .count();
    let rejected = panel
        .requests
        .iter()
        .filter(|r| r.fate == Fate::Rejected)
        .count();
    let capacity = chart.capacity;
    let steps = match &panel.queue {
        Some(q) => q.clone(),
        None => queue_steps(&panel.requests),
    };
    let peak = max_level(&steps);
    let _ = writeln!(s, r##"<g class="panel">"##);
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{}" font-size="13" font-weight="bold">{}</text>"##,
        top + NAME_Y,
        escape(&panel.name)
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="end" fill="#444">{} in, {admitted} out, {rejected} refused, max queue {peak}</text>"##,
        right,
        top + NAME_Y,
        panel.requests.len()
    );

    // Input row.
    row_label(s, "in", top + (IN_TOP + IN_BOTTOM) / 2.0);
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{y}" x2="{right}" y2="{y}" stroke="#ccc"/>"##,
        y = top + IN_BOTTOM
    );
    let mut ticks = [String::new(), String::new(), String::new()];
    for r in &panel.requests {
        let (i, y1) = match r.fate {
            Fate::Immediate { .. } | Fate::Queued { .. } => (0, top + IN_TOP),
            Fate::Rejected => (1, top + IN_TOP + 6.0),
            Fate::Unknown => (2, top + IN_TOP + 6.0),
        };
        let _ = write!(
            ticks[i],
            "M{:.2} {:.2}V{:.2}",
            x(r.arrival),
            y1,
            top + IN_BOTTOM
        );
    }
    // Arrivals that land on the same spot (a burst) are labelled with
    // their number and how many of them were refused.
    let mut xs: Vec<(i64, bool)> = panel
        .requests
        .iter()
        .map(|r| {
            (
                (x(r.arrival) * 2.0).round() as i64,
                r.fate == Fate::Rejected,
            )
        })
        .collect();
    xs.sort_unstable();
    // (half-pixel, arrivals, refused)
    let mut spots: Vec<(i64, usize, usize)> = Vec::new();
    for (px, refused) in xs {
        match spots.last_mut() {
            Some((last, n, r)) if *last == px => {
                *n += 1;
                *r += usize::from(refused);
            }
            _ => spots.push((px, 1, usize::from(refused))),
        }
    }
    for (px, n, refused) in spots.into_iter().filter(|s| s.1 >= 3) {
        let detail = if refused > 0 {
            format!(" ({refused} refused)")
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            r##"<text x="{:.2}" y="{:.2}" font-size="9" fill="#444">×{n}{detail}</text>"##,
            px as f64 / 2.0 + 3.0,
            top + IN_TOP + 9.0
        );
    }
    for (d, color) in ticks.iter().zip([BLUE, RED, GREY]) {
        if !d.is_empty() {
            let _ = writeln!(
                s,
                r##"<path d="{d}" stroke="{color}" stroke-width="1.2" fill="none"/>"##
            );
        }
    }

    // Queue level plot.
    let ymax = (peak.max(u64::from(capacity)).max(1)) as f64;
    let y = |level: f64| top + PLOT_BOTTOM - (level / ymax) * (PLOT_BOTTOM - PLOT_TOP - 6.0);
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{}" width="{}" height="{}" fill="#fafafa" stroke="#bbb"/>"##,
        top + PLOT_TOP,
        right - LEFT,
        PLOT_BOTTOM - PLOT_TOP
    );
    let step = nice_step(ymax, 4.0).max(1.0);
    for k in 0.. {
        let level = f64::from(k) * step;
        if level > ymax + 1e-9 {
            break;
        }
        let yy = y(level);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.2}" x2="{right}" y2="{yy:.2}" stroke="#e4e4e4"/>"##
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{:.2}" text-anchor="end">{}</text>"##,
            LEFT - 4.0,
            yy + 4.0,
            level
        );
    }
    let mid = top + (PLOT_TOP + PLOT_BOTTOM) / 2.0;
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{mid}" text-anchor="middle" transform="rotate(-90 {} {mid})">queue</text>"##,
        LEFT - 34.0,
        LEFT - 34.0
    );
    let cy = y(f64::from(capacity));
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{cy:.2}" x2="{right}" y2="{cy:.2}" stroke="{RED}" stroke-width="1" stroke-dasharray="4 3"/>"##
    );
    let mut d = String::new();
    for (i, &(t, level)) in steps.iter().enumerate() {
        let level = level as f64;
        if i == 0 {
            let _ = write!(d, "M{:.2} {:.2}", x(t), y(level));
        } else {
            let _ = write!(d, "H{:.2}V{:.2}", x(t), y(level));
        }
    }
    let _ = write!(d, "H{:.2}", x(end));
    let _ = writeln!(
        s,
        r##"<path d="{d}" stroke="{QUEUE}" stroke-width="1.8" fill="none"/>"##
    );

    // Output row.
    row_label(s, "out", top + (OUT_TOP + OUT_BOTTOM) / 2.0);
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{y}" x2="{right}" y2="{y}" stroke="#ccc"/>"##,
        y = top + OUT_TOP
    );
    let mut d = String::new();
    for t in panel.requests.iter().filter_map(|r| r.fate.departure()) {
        let _ = write!(
            d,
            "M{:.2} {:.2}V{:.2}",
            x(t),
            top + OUT_TOP,
            top + OUT_BOTTOM
        );
    }
    if !d.is_empty() {
        let _ = writeln!(
            s,
            r##"<path d="{d}" stroke="{GREEN}" stroke-width="1.2" fill="none"/>"##
        );
    }

    // Time axis.
    let axis = top + OUT_BOTTOM + 2.0;
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{axis}" x2="{right}" y2="{axis}" stroke="#333"/>"##
    );
    let step = nice_step(end, 12.0);
    for k in 0.. {
        let t = f64::from(k) * step;
        if t > end + 1e-9 {
            break;
        }
        let xx = x(t);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.2}" y1="{axis}" x2="{xx:.2}" y2="{}" stroke="#333"/>"##,
            axis + 4.0
        );
        let _ = writeln!(
            s,
            r##"<text x="{xx:.2}" y="{}" text-anchor="middle">{}</text>"##,
            top + AXIS_LABELS_Y,
            trim_number(t)
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{right}" y="{}" text-anchor="end" fill="#444">time (s)</text>"##,
        top + AXIS_LABELS_Y + 13.0
    );
    let _ = writeln!(s, "</g>");
}

fn row_label(s: &mut String, label: &str, y: f64) {
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="end">{label}</text>"##,
        LEFT - 6.0,
        y + 4.0
    );
}

/// A round step (1, 2 or 5 times a power of ten) that cuts `span` into at
/// most about `parts` pieces.
fn nice_step(span: f64, parts: f64) -> f64 {
    if span.is_nan() || span <= 0.0 || span.is_infinite() {
        return 1.0;
    }
    let raw = span / parts;
    let magnitude = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * magnitude >= raw {
            return m * magnitude;
        }
    }
    10.0 * magnitude
}

/// A tick label: no trailing zeros, no float noise.
fn trim_number(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// Escape text for XML content and attributes; characters XML 1.0 cannot
/// hold (most control characters) become U+FFFD.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(' '),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(arrival: f64, fate: Fate) -> Mark {
        Mark {
            arrival,
            cost: 1,
            fate,
        }
    }

    #[test]
    fn queue_level_counts_only_requests_that_waited() {
        let steps = queue_steps(&[
            mark(0.0, Fate::Immediate { departure: 0.0 }),
            mark(0.1, Fate::Queued { departure: 0.2 }),
            mark(0.15, Fate::Queued { departure: 0.4 }),
            mark(0.3, Fate::Rejected),
        ]);
        assert_eq!(
            steps,
            vec![(0.0, 0), (0.1, 1), (0.15, 2), (0.2, 1), (0.4, 0)]
        );
    }

    #[test]
    fn departure_at_an_arrival_instant_is_counted_first() {
        let steps = queue_steps(&[
            mark(0.1, Fate::Queued { departure: 0.4 }),
            mark(0.4, Fate::Queued { departure: 0.6 }),
        ]);
        assert_eq!(max_level(&steps), 1);
    }

    #[test]
    fn text_is_escaped_for_xml() {
        assert_eq!(
            escape("a<b & \"c\"\u{1}"),
            "a&lt;b &amp; &quot;c&quot;\u{FFFD}"
        );
    }

    #[test]
    fn nice_steps_are_round() {
        assert_eq!(nice_step(15.0, 12.0), 2.0);
        assert_eq!(nice_step(3.0, 12.0), 0.5);
        assert_eq!(nice_step(10.0, 4.0), 5.0);
        assert_eq!(trim_number(2.5), "2.5");
        assert_eq!(trim_number(0.30000000000000004), "0.3");
    }

    #[test]
    fn empty_chart_is_still_a_document() {
        let s = svg(&Chart {
            title: "t".into(),
            subtitle: "s".into(),
            capacity: 0,
            end: 0.0,
            panels: Vec::new(),
        });
        assert!(s.starts_with("<?xml") && s.trim_end().ends_with("</svg>"));
    }
}
