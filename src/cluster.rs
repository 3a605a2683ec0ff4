//! Cluster mode: several sluice instances share each client's schedule D
//! in Redis, so one client's output stays smooth across the fleet.
//!
//! Admission is one atomic Lua script per request (EVALSHA, loaded once and
//! reloaded on NOSCRIPT by the client library) that reads Redis `TIME`,
//! applies the rules of DESIGN section 1 to the stored D, advances D, sets a
//! TTL just past it, and returns the delay or the retry-after. The instance
//! then holds the request until its departure with its own precise pacer.
//! With an upstream cap the upstream's schedule is updated in the same
//! script; its key shares a hash tag with the client keys of that upstream
//! so the script works on Redis Cluster.
//!
//! The waiting cost is derived from D − now, which is exact for unit
//! costs. A cancelled request gives its slot back only while it is still
//! the last one scheduled for its client (compare-and-set); otherwise the
//! slot is lost. Every call is bounded by `timeout`; failures follow
//! `on_failure`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use redis::Script;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tracing::{debug, warn};

use crate::config::{ClusterConfig, OnFailure};
use crate::metrics as m;

/// Admission: returns {verdict, value, newD, newG}. verdict 1 = go after
/// `value` µs; 0 = queue full, retry after `value` µs; 2 = departure past
/// max_wait, retry after `value` µs.
const ADMIT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local step = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local tau = tonumber(ARGV[4])
local gstep = tonumber(ARGV[5])
local max_wait = tonumber(ARGV[6])
local D = tonumber(redis.call('GET', KEYS[1]) or '0')
local own = D - tau
local waiting = 0
if own > now then
  waiting = math.floor((own - now + step - 1) / step) - 1
end
local d = math.max(own, now)
local G = 0
if gstep > 0 then
  G = tonumber(redis.call('GET', KEYS[2]) or '0')
  d = math.max(d, G)
end
if d > now and waiting + cost > cap then
  local at = own - (cap - cost + 1) * step
  if cost > cap then at = own end
  return {0, math.max(at - now, 1), 0, 0}
end
if max_wait > 0 and d - now > max_wait then
  return {2, d - max_wait - now, 0, 0}
end
local newD = math.max(D, d) + cost * step
redis.call('SET', KEYS[1], newD, 'PX', math.floor((newD - now) / 1000) + 1000)
local newG = 0
if gstep > 0 then
  newG = d + cost * gstep
  redis.call('SET', KEYS[2], newG, 'PX', math.floor((newG - now) / 1000) + 1000)
end
return {1, d - now, newD, newG}
";

/// Cancel: give the slot back if this reservation is still the last one.
const CANCEL: &str = r"
local D = tonumber(redis.call('GET', KEYS[1]) or '0')
local undone = 0
if D == tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], D - tonumber(ARGV[2]), 'KEEPTTL')
  undone = 1
end
if #KEYS > 1 then
  local G = tonumber(redis.call('GET', KEYS[2]) or '0')
  if G == tonumber(ARGV[3]) then
    redis.call('SET', KEYS[2], G - tonumber(ARGV[4]), 'KEEPTTL')
  end
end
return undone
";

/// Why a cluster call failed (then `on_failure` applies).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected reply from the admission script")]
    Reply,
}

/// One admission's parameters, in microseconds.
#[derive(Debug, Clone)]
pub struct Ask {
    /// Client key in Redis.
    pub key: String,
    /// Upstream key in Redis when the upstream is capped.
    pub global: Option<String>,
    pub step_us: u64,
    pub capacity: u32,
    pub cost: u32,
    pub tau_us: u64,
    pub global_step_us: u64,
    pub max_wait_us: u64,
}

/// What Redis decided.
#[derive(Debug)]
pub enum Verdict {
    /// Depart after `delay`; `reservation` undoes it if the client leaves.
    Go {
        delay: Duration,
        reservation: Reservation,
    },
    /// Queue full: 429.
    Full { retry_after: Duration },
    /// Departure past max_wait: 429.
    MaxWait { retry_after: Duration },
}

/// A reservation in Redis, for the compare-and-set cancel.
#[derive(Debug, Clone)]
pub struct Reservation {
    key: String,
    global: Option<String>,
    new_d: i64,
    undo: i64,
    new_g: i64,
    undo_g: i64,
}

/// The shared-schedule client.
pub struct Cluster {
    conn: ConnectionManager,
    admit: Script,
    cancel: Script,
    prefix: String,
    timeout: Duration,
    pub on_failure: OnFailure,
    pub instances: u32,
    healthy: AtomicBool,
    duration: std::sync::Arc<m::Histogram>,
}

/// Hex of a key's bytes, safe inside a Redis key name.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Cluster {
    /// Set up the client; the connection is made lazily and re-made in the
    /// background, so sluice starts (and follows `on_failure`) even while
    /// Redis is down.
    pub fn new(cfg: &ClusterConfig) -> Result<Cluster, ClusterError> {
        let client = redis::Client::open(cfg.redis.as_str())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.timeout))
            .set_response_timeout(Some(cfg.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Cluster {
            conn,
            admit: Script::new(ADMIT),
            cancel: Script::new(CANCEL),
            prefix: cfg.key_prefix.clone(),
            timeout: cfg.timeout,
            on_failure: cfg.on_failure,
            instances: cfg.instances,
            healthy: AtomicBool::new(true),
            duration: m::histogram(m::REDIS_DURATION_SECONDS, &[]),
        })
    }

    /// Whether the last Redis call succeeded.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Redis key names for a client of `route` (and its capped upstream).
    /// With a cap, all clients of the upstream share its hash tag so that
    /// one script can touch both keys on Redis Cluster.
    pub fn keys(
        &self,
        route: &str,
        key: &[u8],
        capped_upstream: Option<&str>,
    ) -> (String, Option<String>) {
        let p = &self.prefix;
        match capped_upstream {
            Some(up) => (
                format!("{p}{{u:{up}}}:c:{route}:{}", hex(key)),
                Some(format!("{p}{{u:{up}}}:global")),
            ),
            None => (format!("{p}{{c:{route}:{}}}", hex(key)), None),
        }
    }

    fn record(&self, started: Instant, ok: bool, result: &'static str) {
        self.healthy.store(ok, Ordering::Relaxed);
        self.duration.record(started.elapsed());
        metrics::counter!(m::REDIS_CALLS_TOTAL, "result" => result).increment(1);
    }

    /// One admission round trip, bounded by the configured timeout.
    pub async fn admit(&self, ask: Ask) -> Result<Verdict, ClusterError> {
        let started = Instant::now();
        let mut inv = self.admit.prepare_invoke();
        inv.key(&ask.key);
        if let Some(g) = &ask.global {
            inv.key(g);
        }
        inv.arg(ask.step_us.max(1))
            .arg(ask.capacity)
            .arg(ask.cost)
            .arg(ask.tau_us)
            .arg(ask.global_step_us)
            .arg(ask.max_wait_us);
        let mut conn = self.conn.clone();
        let reply: Vec<i64> =
            match tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn)).await {
                Err(_) => {
                    self.record(started, false, "timeout");
                    return Err(ClusterError::Timeout(self.timeout));
                }
                Ok(Err(e)) => {
                    self.record(started, false, "error");
                    return Err(e.into());
                }
                Ok(Ok(r)) => r,
            };
        self.record(started, true, "ok");
        let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
        match reply.as_slice() {
            [1, delay, new_d, new_g] => Ok(Verdict::Go {
                delay: micros(*delay),
                reservation: Reservation {
                    key: ask.key,
                    global: ask.global,
                    new_d: *new_d,
                    undo: i64::from(ask.cost).saturating_mul(ask.step_us.max(1) as i64),
                    new_g: *new_g,
                    undo_g: i64::from(ask.cost).saturating_mul(ask.global_step_us as i64),
                },
            }),
            [0, retry, ..] => Ok(Verdict::Full {
                retry_after: micros(*retry),
            }),
            [2, retry, ..] => Ok(Verdict::MaxWait {
                retry_after: micros(*retry),
            }),
            _ => Err(ClusterError::Reply),
        }
    }

    /// Give a reservation back (the client left before its departure), in
    /// the background and bounded by the timeout.
    pub fn cancel(&self, r: Reservation) {
        let script = self.cancel.clone();
        let mut conn = self.conn.clone();
        let timeout = self.timeout;
        let call = async move {
            let mut inv = script.prepare_invoke();
            inv.key(&r.key);
            if let Some(g) = &r.global {
                inv.key(g);
            }
            inv.arg(r.new_d).arg(r.undo).arg(r.new_g).arg(r.undo_g);
            match tokio::time::timeout(timeout, inv.invoke_async::<i64>(&mut conn)).await {
                Ok(Ok(undone)) => debug!(undone, "cluster reservation withdrawn"),
                Ok(Err(e)) => warn!(error = %e, "cannot withdraw a cluster reservation"),
                Err(_) => warn!("withdrawing a cluster reservation timed out"),
            }
        };
        tokio::spawn(call);
    }
}
