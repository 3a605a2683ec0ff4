//! Every metric sluice exports, in one place: names (with their units),
//! help text, label values and histogram buckets. No metric carries a
//! per-client label, so cardinality is bounded by the config.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use metrics::{Unit, describe_counter, describe_gauge};
use metrics_exporter_prometheus::{BuildError, PrometheusBuilder, PrometheusHandle};

/// Requests by route, protocol and outcome (see [`Outcome`]), counted
/// when answered.
pub const REQUESTS_TOTAL: &str = "sluice_requests_total";
/// Requests by route and protocol as they arrive on their route (before
/// any wait; those refused before admission, a missing key say,
/// included): the arrival rate, where `sluice_requests_total` is the rate
/// of answers.
pub const ARRIVALS_TOTAL: &str = "sluice_arrivals_total";
/// Requests a dry-run route would have refused (and forwarded anyway).
pub const DRY_RUN_REFUSALS_TOTAL: &str = "sluice_dry_run_refusals_total";
/// Requests waiting in queues, over all clients.
pub const QUEUED_REQUESTS: &str = "sluice_queued_requests";
/// `limits.max_queued`, beside the queue depth.
pub const QUEUED_REQUESTS_LIMIT: &str = "sluice_queued_requests_limit";
/// Client states held (clients with waiting requests or a future slot).
pub const ACTIVE_CLIENTS: &str = "sluice_active_clients";
/// Time from arrival to departure of forwarded requests, by route.
pub const QUEUE_WAIT_SECONDS: &str = "sluice_queue_wait_seconds";
/// Pacer precision: actual minus scheduled release time.
pub const RELEASE_LAG_SECONDS: &str = "sluice_release_lag_seconds";
/// Time until the upstream's response headers, by upstream.
pub const UPSTREAM_DURATION_SECONDS: &str = "sluice_upstream_duration_seconds";
/// Shared-schedule calls in cluster mode, by backend (`redis`,
/// `postgres`) and result (`ok`, `error`, `timeout`).
pub const CLUSTER_CALLS_TOTAL: &str = "sluice_cluster_calls_total";
/// Shared-schedule round-trip time in cluster mode, by backend.
pub const CLUSTER_DURATION_SECONDS: &str = "sluice_cluster_duration_seconds";
/// Requests decided by `on_failure` because the shared schedule failed, by
/// backend and policy.
pub const CLUSTER_FALLBACKS_TOTAL: &str = "sluice_cluster_fallbacks_total";
/// 429s (a full queue, `max_wait`) answered from the store's refusal of
/// the same client less than its Retry-After (and a second) before,
/// without a call, by backend.
pub const CLUSTER_REMEMBERED_REFUSALS_TOTAL: &str = "sluice_cluster_remembered_refusals_total";
/// 1 while the shared schedule answers and is usable as configured, else 0,
/// by backend.
pub const CLUSTER_HEALTHY: &str = "sluice_cluster_healthy";
/// Client connections open.
pub const CONNECTIONS: &str = "sluice_connections";
/// Bytes of request bodies staged while their requests wait.
pub const STAGED_BYTES: &str = "sluice_staged_bytes";
/// Upgrade tunnels open.
pub const TUNNELS: &str = "sluice_tunnels";
/// Bytes allocated and not yet freed, as the allocator counts them.
pub const MEMORY_ALLOCATED_BYTES: &str = "sluice_memory_allocated_bytes";
/// Bytes in pages the allocator holds resident.
pub const MEMORY_RESIDENT_BYTES: &str = "sluice_memory_resident_bytes";
/// An upstream's `max_concurrency` (read as scraped), by upstream.
pub const UPSTREAM_MAX_CONCURRENCY: &str = "sluice_upstream_max_concurrency";
/// Calls holding one of those slots (read as scraped), by upstream.
pub const UPSTREAM_IN_FLIGHT: &str = "sluice_upstream_in_flight";
/// Requests waiting for one of those slots (read as scraped), by upstream.
pub const UPSTREAM_WAITING: &str = "sluice_upstream_waiting";
/// Pauses an upstream asked for (429/503 with a retry time), by upstream.
pub const UPSTREAM_PAUSES_TOTAL: &str = "sluice_upstream_pauses_total";
/// Config reloads by result (`ok`, `error`).
pub const CONFIG_RELOADS_TOTAL: &str = "sluice_config_reloads_total";
/// Access log lines dropped: the writer fell behind.
pub const ACCESS_LOG_DROPPED_TOTAL: &str = "sluice_access_log_dropped_total";
/// Unix time of the last successful config load.
pub const CONFIG_LOADED_TIMESTAMP_SECONDS: &str = "sluice_config_loaded_timestamp_seconds";

/// What became of a request: the `outcome` label of [`REQUESTS_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Sent upstream and answered.
    Forwarded,
    /// Refused with 429 (queue full or max_wait).
    Rejected,
    /// Refused with 503 (max_clients / max_queued, or shutting down).
    Overloaded,
    /// The client left while queued; never forwarded.
    Cancelled,
    /// Still queued when the drain timeout passed; answered 503.
    Expired,
    /// The upstream failed (502) or timed out (504).
    UpstreamError,
    /// Refused before queueing: no route (404) or no key (400).
    Invalid,
}

impl Outcome {
    /// Every outcome, in index order.
    pub const ALL: [Outcome; 7] = [
        Outcome::Forwarded,
        Outcome::Rejected,
        Outcome::Overloaded,
        Outcome::Cancelled,
        Outcome::Expired,
        Outcome::UpstreamError,
        Outcome::Invalid,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Rejected => "rejected",
            Outcome::Overloaded => "overloaded",
            Outcome::Cancelled => "cancelled",
            Outcome::Expired => "expired",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Invalid => "invalid",
        }
    }
}

/// Seconds, for latency histograms: 10 µs to an hour (queue waits at slow
/// rates and SMTP holds run to minutes).
const LATENCY_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1_800.0, 3_600.0,
];

/// Seconds, for the pacer's release lag: 1 µs to 1 s (a stalled machine's
/// lag must show as what it was, not as "over 10 ms").
const LAG_BUCKETS: &[f64] = &[
    0.000_001, 0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001,
    0.002_5, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0,
];

// === histograms ===

/// A Prometheus histogram with fixed buckets: recording is a few relaxed
/// atomic adds, memory is fixed whatever the load and however rarely it
/// is scraped.
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (the last one is +Inf), not cumulative.
    counts: Box<[AtomicU64]>,
    /// Sum in seconds, the bits of an `f64`: nanoseconds in a `u64` wrap
    /// after 584 years of waits in all, which a backlog of 100 messages a
    /// second, each held 5 minutes, adds up in a week.
    sum_secs: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_secs: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Record one observation.
    pub fn record(&self, value: Duration) {
        let secs = value.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < secs);
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self
            .sum_secs
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + secs).to_bits())
            });
    }

    fn render(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let sum = f64::from_bits(self.sum_secs.load(Ordering::Relaxed));
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {cumulative}", braces(labels));
    }
}

struct Registered {
    name: &'static str,
    /// Rendered label pairs, such as `route="api",protocol="http"`.
    labels: String,
    histogram: Arc<Histogram>,
}

static HISTOGRAMS: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

/// The histogram `name` with `labels` (created once; the same handle for
/// the same name and labels, so reloads keep their counts).
pub fn histogram(name: &'static str, labels: &[(&str, &str)]) -> Arc<Histogram> {
    let labels = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect::<Vec<_>>()
        .join(",");
    let mut all = HISTOGRAMS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = all.iter().find(|r| r.name == name && r.labels == labels) {
        return r.histogram.clone();
    }
    let bounds = if name == RELEASE_LAG_SECONDS {
        LAG_BUCKETS
    } else {
        LATENCY_BUCKETS
    };
    let histogram = Arc::new(Histogram::new(bounds));
    all.push(Registered {
        name,
        labels,
        histogram: histogram.clone(),
    });
    histogram
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Help text of each histogram family.
const HISTOGRAM_HELP: &[(&str, &str)] = &[
    (
        QUEUE_WAIT_SECONDS,
        "Time from arrival to departure of forwarded requests.",
    ),
    (
        RELEASE_LAG_SECONDS,
        "Pacer precision: actual minus scheduled release time.",
    ),
    (
        UPSTREAM_DURATION_SECONDS,
        "Time until the upstream's response headers.",
    ),
    (
        CLUSTER_DURATION_SECONDS,
        "Round-trip time of shared-schedule calls.",
    ),
];

fn render_histograms(out: &mut String) {
    let all = HISTOGRAMS.lock().unwrap_or_else(|e| e.into_inner());
    for &(family, help) in HISTOGRAM_HELP {
        let members: Vec<&Registered> = all.iter().filter(|r| r.name == family).collect();
        if members.is_empty() {
            continue;
        }
        let _ = writeln!(out, "# HELP {family} {help}");
        let _ = writeln!(out, "# TYPE {family} histogram");
        for r in members {
            r.histogram.render(family, &r.labels, out);
        }
    }
}

// === the exporter ===

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Install the process-wide Prometheus recorder (once) and describe every
/// metric; returns the handle that renders `/metrics`.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let handle = PrometheusBuilder::new().install_recorder()?;
    describe();
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// The `/metrics` text: counters and gauges from the recorder, the
/// histograms, then each capped upstream's slots (`slots`: its name, its
/// `max_concurrency`, and the calls holding and waiting for a slot),
/// read as scraped, so that an upstream a reload removed leaves no series.
pub fn render(handle: &PrometheusHandle, slots: &[(String, usize, (usize, usize))]) -> String {
    let mut out = handle.render();
    render_histograms(&mut out);
    render_slots(slots, &mut out);
    out
}

/// The gauge families of [`render`]'s `slots`.
/// Each family is described even with no capped upstream (no samples),
/// so that its name is there for dashboards to find.
fn render_slots(slots: &[(String, usize, (usize, usize))], out: &mut String) {
    type Pick = fn(&(String, usize, (usize, usize))) -> usize;
    let families: [(&str, &str, Pick); 3] = [
        (
            UPSTREAM_MAX_CONCURRENCY,
            "upstream.max_concurrency: the most calls in flight, by upstream.",
            |s| s.1,
        ),
        (
            UPSTREAM_IN_FLIGHT,
            "Calls holding one of an upstream's max_concurrency slots, by upstream.",
            |s| s.2.0,
        ),
        (
            UPSTREAM_WAITING,
            "Requests released by the shaper and waiting for an upstream's max_concurrency slot, by upstream.",
            |s| s.2.1,
        ),
    ];
    for (family, help, pick) in families {
        let _ = writeln!(out, "# HELP {family} {help}");
        let _ = writeln!(out, "# TYPE {family} gauge");
        for s in slots {
            let _ = writeln!(out, "{family}{{upstream=\"{}\"}} {}", escape(&s.0), pick(s));
        }
    }
}

fn describe() {
    describe_counter!(
        REQUESTS_TOTAL,
        Unit::Count,
        "Requests by route, protocol and outcome."
    );
    describe_counter!(
        ARRIVALS_TOTAL,
        Unit::Count,
        "Requests by route and protocol as they arrive, before any wait: the input rate."
    );
    describe_counter!(
        DRY_RUN_REFUSALS_TOTAL,
        Unit::Count,
        "Requests a dry-run route would have refused (and forwarded anyway)."
    );
    describe_gauge!(
        QUEUED_REQUESTS,
        Unit::Count,
        "Requests waiting in queues, over all clients."
    );
    describe_gauge!(
        QUEUED_REQUESTS_LIMIT,
        Unit::Count,
        "limits.max_queued: past it, new requests are refused (503, SMTP 421)."
    );
    describe_gauge!(ACTIVE_CLIENTS, Unit::Count, "Client states held.");
    describe_gauge!(
        CONNECTIONS,
        Unit::Count,
        "Client connections open, by protocol (HTTP connections, SMTP sessions)."
    );
    describe_gauge!(
        STAGED_BYTES,
        Unit::Bytes,
        "Bytes of request bodies staged while their requests wait."
    );
    describe_gauge!(
        MEMORY_ALLOCATED_BYTES,
        Unit::Bytes,
        "Bytes allocated and not yet freed, as the allocator (jemalloc) counts them."
    );
    describe_gauge!(
        MEMORY_RESIDENT_BYTES,
        Unit::Bytes,
        "Bytes in pages the allocator holds resident; minus allocated: kept for reuse or not yet returned."
    );
    describe_gauge!(
        TUNNELS,
        Unit::Count,
        "Upgrade tunnels (WebSocket and other protocol switches) open; bounded by server.max_tunnels."
    );
    describe_counter!(
        CLUSTER_CALLS_TOTAL,
        Unit::Count,
        "Shared-schedule calls by backend and result."
    );
    describe_counter!(
        CLUSTER_FALLBACKS_TOTAL,
        Unit::Count,
        "Requests decided by on_failure because the shared schedule failed."
    );
    describe_counter!(
        CLUSTER_REMEMBERED_REFUSALS_TOTAL,
        Unit::Count,
        "429s (a full queue, max_wait) answered without a call: the store refused the same client less than its Retry-After (and 1 s) before."
    );
    describe_gauge!(
        CLUSTER_HEALTHY,
        Unit::Count,
        "1 while the shared schedule answers and is usable as configured."
    );
    describe_counter!(
        UPSTREAM_PAUSES_TOTAL,
        Unit::Count,
        "Pauses upstreams asked for (429 or 503 with a retry time), by upstream."
    );
    describe_counter!(
        CONFIG_RELOADS_TOTAL,
        Unit::Count,
        "Config reloads by result."
    );
    describe_counter!(
        ACCESS_LOG_DROPPED_TOTAL,
        Unit::Count,
        "Access log lines dropped because the writer fell behind (server.access_log)."
    );
    describe_gauge!(
        CONFIG_LOADED_TIMESTAMP_SECONDS,
        Unit::Seconds,
        "Unix time of the last successful config load."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histograms_sum_does_not_wrap() {
        let h = Histogram::new(&[1.0]);
        // Three waits of 200 years: past what u64 nanoseconds hold.
        let long = Duration::from_secs(200 * 365 * 86_400);
        for _ in 0..3 {
            h.record(long);
        }
        h.record(Duration::from_nanos(500));
        let mut out = String::new();
        h.render("w", "", &mut out);
        let sum: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("w_sum "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{out}"));
        let want = 3.0 * long.as_secs_f64();
        assert!(
            (sum - want).abs() / want < 1e-9,
            "{sum} against {want}: {out}"
        );
    }

    #[test]
    fn histograms_render_cumulative_buckets_sum_and_count() {
        let h = histogram("test_seconds", &[("route", "a\"b")]);
        h.record(Duration::from_micros(20));
        h.record(Duration::from_secs(100));
        let mut out = String::new();
        h.render("test_seconds", r#"route="a\"b""#, &mut out);
        assert!(
            out.contains(r#"test_seconds_bucket{route="a\"b",le="0.00001"} 0"#),
            "{out}"
        );
        assert!(
            out.contains(r#"test_seconds_bucket{route="a\"b",le="0.000025"} 1"#),
            "{out}"
        );
        assert!(
            out.contains(r#"test_seconds_bucket{route="a\"b",le="60"} 1"#),
            "{out}"
        );
        assert!(
            out.contains(r#"test_seconds_bucket{route="a\"b",le="+Inf"} 2"#),
            "{out}"
        );
        assert!(
            out.contains(r#"test_seconds_count{route="a\"b"} 2"#),
            "{out}"
        );
        assert!(
            out.contains(r#"test_seconds_sum{route="a\"b"} 100.00002"#),
            "{out}"
        );
    }
}
