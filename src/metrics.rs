//! Every metric sluice exports, in one place: names (with their units),
//! help text, label values and histogram buckets. No metric carries a
//! per-client label, so cardinality is bounded by the config.

use std::sync::OnceLock;

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

/// Requests by route, protocol and outcome (see [`Outcome`]).
pub const REQUESTS_TOTAL: &str = "sluice_requests_total";
/// Requests a dry-run route would have refused (and forwarded anyway).
pub const DRY_RUN_REFUSALS_TOTAL: &str = "sluice_dry_run_refusals_total";
/// Requests waiting in queues, over all clients.
pub const QUEUED_REQUESTS: &str = "sluice_queued_requests";
/// Client states held (clients with waiting requests or a future slot).
pub const ACTIVE_CLIENTS: &str = "sluice_active_clients";
/// Time from arrival to departure of forwarded requests, by route.
pub const QUEUE_WAIT_SECONDS: &str = "sluice_queue_wait_seconds";
/// Pacer precision: actual minus scheduled release time.
pub const RELEASE_LAG_SECONDS: &str = "sluice_release_lag_seconds";
/// Time until the upstream's response headers, by upstream.
pub const UPSTREAM_DURATION_SECONDS: &str = "sluice_upstream_duration_seconds";
/// Redis calls in cluster mode by result (`ok`, `error`, `timeout`).
pub const REDIS_CALLS_TOTAL: &str = "sluice_redis_calls_total";
/// Redis round-trip time in cluster mode.
pub const REDIS_DURATION_SECONDS: &str = "sluice_redis_duration_seconds";
/// Requests decided by `on_failure` because Redis failed, by policy.
pub const REDIS_FALLBACKS_TOTAL: &str = "sluice_redis_fallbacks_total";
/// Config reloads by result (`ok`, `error`).
pub const CONFIG_RELOADS_TOTAL: &str = "sluice_config_reloads_total";
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

/// Seconds, for latency histograms: 10 µs to 60 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Seconds, for the pacer's release lag: 1 µs to 10 ms.
const LAG_BUCKETS: &[f64] = &[
    0.000_001, 0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.005,
    0.01,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Install the process-wide Prometheus recorder (once) and describe every
/// metric; returns the handle that renders `/metrics`.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(RELEASE_LAG_SECONDS.into()), LAG_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    describe();
    Ok(HANDLE.get_or_init(|| handle).clone())
}

fn describe() {
    describe_counter!(
        REQUESTS_TOTAL,
        Unit::Count,
        "Requests by route, protocol and outcome."
    );
    describe_gauge!(
        QUEUED_REQUESTS,
        Unit::Count,
        "Requests waiting in queues, over all clients."
    );
    describe_gauge!(ACTIVE_CLIENTS, Unit::Count, "Client states held.");
    describe_histogram!(
        QUEUE_WAIT_SECONDS,
        Unit::Seconds,
        "Time from arrival to departure of forwarded requests."
    );
    describe_histogram!(
        RELEASE_LAG_SECONDS,
        Unit::Seconds,
        "Pacer precision: actual minus scheduled release time."
    );
    describe_histogram!(
        UPSTREAM_DURATION_SECONDS,
        Unit::Seconds,
        "Time until the upstream's response headers."
    );
    describe_counter!(
        CONFIG_RELOADS_TOTAL,
        Unit::Count,
        "Config reloads by result."
    );
    describe_gauge!(
        CONFIG_LOADED_TIMESTAMP_SECONDS,
        Unit::Seconds,
        "Unix time of the last successful config load."
    );
}
