//! The Redis store for shared schedules: one server, or a Redis Cluster
//! (the client library's async cluster connection: slot routing, MOVED
//! and ASK followed, topology refreshed on failover).
//!
//! Admission is one Lua script per request (Redis `TIME`, so the store's
//! clock is the only clock). Scripts go as `EVALSHA` and, on `NOSCRIPT`,
//! once as `EVAL` to the same key's master (which also caches it there):
//! the script is loaded on each master as it is first used, and a node
//! that is down never blocks the others (the library's own fallback loads
//! a script on every node at once and fails when one is unreachable).
//!
//! The cap's slot calendar: a sorted set of the reserved slot numbers
//! (time / slot interval) of one capped upstream. A request takes the
//! first run of `cost` free slots from the one its own due time falls in
//! (departing at its due time if that slot is free, else at the start of
//! the slot it got): at most one departure per slot, so never more than R
//! per second, though two in neighbouring slots may come closer than 1/R.
//! Past slots are trimmed on every call.
//!
//! Every call runs on the runtime the store was made on (the daemon's main
//! runtime), as the PostgreSQL store's do: a lazy connection starts its
//! driver on the runtime of the task that first polls it, and a worker's
//! runtime, which ends with the drain, would take every other worker's
//! connection down with it.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::{TcpSettings, socket2::TcpKeepalive};
use redis::{Cmd, ErrorKind, IntoConnectionInfo, Pipeline, RedisFuture, ServerErrorKind, Value};
use tokio::runtime::Handle;
use tracing::info;

use super::{Ask, ClusterError, Reservation, Trouble};
use crate::config::RedisMode;

/// Admission: KEYS = client key, [slot calendar]; ARGV = step, capacity,
/// cost, tau, slot interval (0: uncapped), max_wait, deadline (µs; the
/// deadline on Redis's clock, 0: none). Returns {verdict, value, newD,
/// first slot, Redis's now}: verdict 1 = go after `value` µs; 0 = queue
/// full, retry after `value` µs; 2 = departure past max_wait (or past
/// more than 100,000 taken slots of the cap's calendar), retry after
/// `value` µs; 3 = run past the deadline, nothing done (the caller has
/// given up: a reservation made now would never be taken nor given back).
const ADMIT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local deadline = tonumber(ARGV[7] or '0')
if deadline > 0 and now > deadline then
  return {3, 0, 0, 0, now}
end
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
local first = -1
if gstep > 0 then
  -- (string.format: Lua's own number-to-text keeps only 14 digits)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('(%d', math.floor(now / gstep)))
  -- the first run of `cost` free slots from the one d falls in: a free
  -- slot lets d stand; a later one moves d to its start
  local s = math.floor(d / gstep)
  local scanned = 0
  while true do
    local taken = redis.call('ZRANGEBYSCORE', KEYS[2], s, '+inf', 'LIMIT', 0, 256)
    local moved = false
    for _, m in ipairs(taken) do
      local v = tonumber(m)
      if v >= s + cost then break end
      if v >= s then s = v + 1; moved = true end
    end
    if not moved then break end
    scanned = scanned + #taken
    if scanned > 100000 then
      -- over 100,000 slots taken in a row from d on, and `s` not known
      -- free: refused as a departure too far ahead (a slot booked twice
      -- would let the upstream get more than R)
      return {2, math.max(s * gstep - now, 1), 0, 0, now}
    end
  end
  first = s
  d = math.max(d, s * gstep)
end
if d > now and waiting + cost > cap then
  local at = own - (cap - cost + 1) * step
  if cost > cap then at = own end
  return {0, math.max(at - now, 1), 0, 0, now}
end
if max_wait > 0 and d - now > max_wait then
  return {2, d - max_wait - now, 0, 0, now}
end
local newD = math.max(D, d) + cost * step
redis.call('SET', KEYS[1], newD, 'PX', math.floor((newD - now) / 1000) + 1000)
if gstep > 0 then
  for i = 0, cost - 1 do
    redis.call('ZADD', KEYS[2], first + i, first + i)
  end
  local until_ms = math.floor(((first + cost) * gstep - now) / 1000) + 1000
  if redis.call('PTTL', KEYS[2]) < until_ms then
    redis.call('PEXPIRE', KEYS[2], until_ms)
  end
end
return {1, d - now, newD, first, now}
";

/// Cancel: KEYS = client key, its holes, [slot calendar]; ARGV = newD,
/// undo, first slot, cost. The client's D goes back while this
/// reservation is its last, and then past every hole it comes to: the
/// reservations given back while a later one was still ahead of them
/// (kept by their newD; several calls late together are given back in
/// the order they were made, each but the last behind a later one). The
/// cap slots always go back.
const CANCEL: &str = r"
local D = tonumber(redis.call('GET', KEYS[1]) or '0')
local newD = tonumber(ARGV[1])
local undone = 0
if D == newD then
  D = D - tonumber(ARGV[2])
  while true do
    local field = string.format('%d', D)
    local undo = redis.call('HGET', KEYS[2], field)
    if not undo then break end
    redis.call('HDEL', KEYS[2], field)
    D = D - tonumber(undo)
  end
  redis.call('SET', KEYS[1], string.format('%d', D), 'KEEPTTL')
  undone = 1
elseif D > newD then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
end
if #KEYS > 2 then
  local first = tonumber(ARGV[3])
  for i = 0, tonumber(ARGV[4]) - 1 do
    redis.call('ZREM', KEYS[3], first + i)
  end
end
return undone
";

/// A script: its text and SHA1 (for `EVALSHA`).
struct Lua {
    body: &'static str,
    sha: String,
}

impl Lua {
    fn new(body: &'static str) -> Lua {
        Lua {
            body,
            sha: redis::Script::new(body).get_hash().to_owned(),
        }
    }
}

/// A connection to one server or to a cluster, cheap to clone.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The Redis store.
pub struct Redis {
    nodes: Vec<String>,
    mode: RedisMode,
    /// CA certificates (PEM) for `rediss://` nodes, else the system's.
    ca: Option<Vec<u8>>,
    /// The password from `password_file`, for every node.
    password: Option<String>,
    timeout: Duration,
    /// Made at start (a standalone connection until `auto` has asked).
    conn: ArcSwap<Option<Conn>>,
    admit: Lua,
    cancel: Lua,
    /// Why the store cannot be used as configured, while it cannot.
    problem: super::Problem,
    /// What the background check writes ([`super::health_key`]).
    health: String,
    /// The runtime every call runs on (the caller's, when made outside one).
    runtime: Option<Handle>,
    /// Redis's clock less our monotonic one (µs) as the last admission
    /// saw it: Redis's `TIME` when it ran, less our clock when it was sent
    /// (so no less than the true difference; a stall makes it larger,
    /// never smaller). `i64::MIN` until the first.
    offset_us: AtomicI64,
}

/// Every connection to Redis: no Nagle delay on the small script calls
/// (several share one connection), and a dead peer is noticed within
/// seconds rather than after the kernel's 15 minutes of retransmissions.
/// A host that vanished without a reset (powered off, a partition) leaves
/// the calls that time out unanswered; without a TCP user timeout the
/// connection manager would never see an error that makes it reconnect.
/// The timeout covers unacknowledged data only, which a live server's
/// kernel acknowledges at once even while Redis itself is busy.
fn tcp_settings() -> TcpSettings {
    TcpSettings::default()
        .set_nodelay(true)
        .set_user_timeout(Duration::from_secs(5))
        .set_keepalive(
            TcpKeepalive::new()
                .with_time(Duration::from_secs(10))
                .with_interval(Duration::from_secs(2))
                .with_retries(3),
        )
}

/// A node's URL as logs and `/status` show it: a password in it replaced
/// by `***`.
fn shown(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &rest[..at];
    let user = userinfo.split(':').next().unwrap_or_default();
    let secret = if userinfo.contains(':') { ":***" } else { "" };
    format!("{scheme}://{user}{secret}@{}", &rest[at + 1..])
}

/// What `INFO` says of a node.
#[derive(Debug, Clone, Copy)]
struct Node {
    cluster: bool,
    replica: bool,
}

impl Redis {
    /// `secrets`: CA certificates (PEM) for `rediss://` nodes, and the
    /// password from `password_file`.
    pub fn new(
        nodes: &[String],
        mode: RedisMode,
        (ca, password): (Option<Vec<u8>>, Option<String>),
        timeout: Duration,
        prefix: &str,
    ) -> Redis {
        Redis {
            password,
            health: super::health_key(prefix),
            runtime: Handle::try_current().ok(),
            nodes: nodes.to_vec(),
            mode,
            ca,
            timeout,
            conn: ArcSwap::from_pointee(None),
            admit: Lua::new(ADMIT),
            cancel: Lua::new(CANCEL),
            problem: super::Problem::default(),
            offset_us: AtomicI64::new(i64::MIN),
        }
    }

    /// A client for `url`, trusting `ca` for TLS when given.
    fn client(&self, url: &str) -> redis::RedisResult<redis::Client> {
        let mut info = url.into_connection_info()?.set_tcp_settings(tcp_settings());
        if let Some(password) = &self.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        match &self.ca {
            Some(ca) => redis::Client::build_with_tls(info, self.certs(ca)),
            None => redis::Client::open(info),
        }
    }

    fn certs(&self, ca: &[u8]) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca.to_vec()),
        }
    }

    fn standalone(&self) -> Result<Conn, ClusterError> {
        let url = self
            .nodes
            .first()
            .ok_or_else(|| ClusterError::Setup("no redis node".into()))?;
        let client = self.client(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(super::connect_limit(self.timeout)))
            .set_response_timeout(Some(super::orphan_limit(self.timeout)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        Ok(Conn::Single(ConnectionManager::new_lazy_with_config(
            client, config,
        )?))
    }

    /// A cluster connection from the seed nodes; connects in the
    /// background. Retries are short (a pacer cannot wait seconds); the
    /// caller waits for the timeout at most, the call itself runs on to
    /// [`super::orphan_limit`].
    fn cluster(&self) -> Result<Conn, ClusterError> {
        let mut builder = ClusterClientBuilder::new(self.nodes.iter().map(String::as_str))
            .tcp_settings(tcp_settings());
        if let Some(password) = &self.password {
            builder = builder.password(password.clone());
        }
        if let Some(ca) = &self.ca {
            builder = builder.certs(self.certs(ca));
        }
        let client = builder
            .connection_timeout(super::connect_limit(self.timeout))
            .response_timeout(super::orphan_limit(self.timeout))
            .overall_response_timeout(Some(super::orphan_limit(self.timeout)))
            .retries(2)
            .min_retry_wait(5)
            .max_retry_wait(50)
            .build()?;
        let config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(super::connect_limit(self.timeout))
            .set_response_timeout(super::orphan_limit(self.timeout));
        Ok(Conn::Cluster(
            client.get_pending_async_connection_with_config(config),
        ))
    }

    fn conn(&self) -> Result<Conn, ClusterError> {
        (**self.conn.load())
            .clone()
            .ok_or_else(|| ClusterError::Setup("not connected yet".into()))
    }

    /// Whether the node at `url` runs in cluster mode (`INFO cluster`), and
    /// whether it is a replica (`INFO replication`).
    async fn node_info(&self, url: &str) -> Result<Node, ClusterError> {
        let limit = super::connect_limit(self.timeout);
        tokio::time::timeout(limit, self.ask_node_info(url))
            .await
            .map_err(|_| ClusterError::Timeout(limit))?
    }

    async fn ask_node_info(&self, url: &str) -> Result<Node, ClusterError> {
        let client = self.client(url)?;
        let mut c = client.get_multiplexed_async_connection().await?;
        // One section each: INFO with several is Redis 7's.
        let cluster: String = redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut c)
            .await?;
        let replication: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await?;
        Ok(Node {
            cluster: cluster.lines().any(|l| l.trim() == "cluster_enabled:1"),
            replica: replication.lines().any(|l| l.trim() == "role:slave"),
        })
    }

    /// `CLUSTER INFO` of one node: whether its cluster covers every slot
    /// ([`Trouble::Partial`] when it answers that it does not).
    async fn cluster_state(&self, url: &str) -> Result<(), Trouble> {
        let limit = self.timeout.max(Duration::from_secs(1));
        tokio::time::timeout(limit, self.ask_cluster_state(url))
            .await
            .map_err(|_| {
                Trouble::Unavailable(format!(
                    "{} did not answer CLUSTER INFO within {limit:?}",
                    shown(url)
                ))
            })?
    }

    async fn ask_cluster_state(&self, url: &str) -> Result<(), Trouble> {
        let down = |e: redis::RedisError| Trouble::Unavailable(e.to_string());
        let client = self
            .client(url)
            .map_err(|e| Trouble::Unavailable(e.to_string()))?;
        let mut c = client
            .get_multiplexed_async_connection()
            .await
            .map_err(down)?;
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut c)
            .await
            .map_err(down)?;
        let field = |name: &str| {
            info.lines().find_map(|l| {
                l.trim()
                    .strip_prefix(name)?
                    .strip_prefix(':')
                    .map(str::to_owned)
            })
        };
        let state = field("cluster_state").unwrap_or_default();
        let ok = field("cluster_slots_ok")
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0);
        if state == "ok" && ok == 16_384 {
            Ok(())
        } else {
            let why = format!(
                "the Redis Cluster at {} does not cover every slot (cluster_state:{state}, {ok} of 16384 slots ok)",
                shown(url)
            );
            // `cluster_state:fail` (`cluster-require-full-coverage yes`,
            // the default): Redis refuses every slot, the whole store is
            // down. `ok` with slots missing: only their clients fail.
            Err(if state == "ok" {
                Trouble::Partial(why)
            } else {
                Trouble::Unavailable(why)
            })
        }
    }

    /// Decide the mode (`auto`), make the connection, and check that the
    /// store is what the config says: a standalone server for
    /// `standalone`, a cluster covering all 16384 slots for `cluster`.
    pub async fn check(&self) -> Result<(), String> {
        self.problem.begin();
        // Ask the seeds in turn: with several (a cluster), the first one
        // down (a master that failed over to its replica) says nothing
        // about the store. Standalone connects to the first only.
        let seeds = match self.mode {
            RedisMode::Standalone => &self.nodes[..self.nodes.len().min(1)],
            _ => &self.nodes[..],
        };
        let mut answered = None;
        let mut failed = None;
        for (i, url) in seeds.iter().enumerate() {
            match self.node_info(url).await {
                // A later seed stands in for the first only as a node of
                // the same cluster: a standalone connection is made to
                // the first seed.
                Ok(n) if i == 0 || n.cluster => {
                    answered = Some((url.clone(), n));
                    break;
                }
                Ok(_) => {
                    failed.get_or_insert((
                        url.clone(),
                        ClusterError::Setup("not a cluster node, and not the first seed".into()),
                    ));
                }
                Err(e) => {
                    failed.get_or_insert((url.clone(), e));
                }
            }
        }
        let (first, cluster_node) = match (answered, failed) {
            (Some((url, n)), _) => (url, Some(n)),
            (None, failed) => {
                let (url, e) = failed.map_or_else(
                    || (String::new(), "no redis node".to_string()),
                    |(url, e)| (url, e.to_string()),
                );
                let node = shown(&url);
                // Unreachable now: connect as configured (auto: as one
                // server, or as a cluster when given several seeds) and
                // let the background check decide again.
                if self.conn.load().is_none() {
                    let conn = match self.mode {
                        RedisMode::Cluster => self.cluster(),
                        RedisMode::Auto if self.nodes.len() > 1 => self.cluster(),
                        _ => self.standalone(),
                    };
                    if let Ok(conn) = conn {
                        self.conn.store(Arc::new(Some(conn)));
                    }
                }
                return self.set_problem(Some(Trouble::Unavailable(format!(
                    "cannot reach {node}: {e}"
                ))));
            }
        };
        let node = shown(&first);
        if let Some(Node {
            cluster: false,
            replica: true,
        }) = cluster_node
        {
            // Every script would fail with READONLY.
            return self.set_problem(Some(Trouble::Misconfigured(format!(
                "{node} is a replica (read-only): point cluster.redis at its master"
            ))));
        }
        let cluster_node = cluster_node.map(|n| n.cluster);
        let cluster = match (self.mode, cluster_node) {
            (RedisMode::Standalone, Some(true)) => {
                return self.set_problem(Some(Trouble::Misconfigured(format!(
                    "{node} is a Redis Cluster node but cluster.mode = \"standalone\": set mode = \"cluster\" (or \"auto\")"
                ))));
            }
            (RedisMode::Cluster, Some(false)) => {
                return self.set_problem(Some(Trouble::Misconfigured(format!(
                    "{node} is not a cluster node but cluster.mode = \"cluster\": set mode = \"standalone\" (or \"auto\")"
                ))));
            }
            (_, c) => c == Some(true),
        };
        let same_kind = matches!(
            (&**self.conn.load(), cluster),
            (Some(Conn::Cluster(_)), true) | (Some(Conn::Single(_)), false)
        );
        if !same_kind {
            let conn = if cluster {
                self.cluster()
            } else {
                self.standalone()
            };
            match conn {
                Ok(conn) => {
                    info!(
                        redis = %node,
                        mode = if cluster { "cluster" } else { "standalone" },
                        "shared schedules in Redis"
                    );
                    self.conn.store(Arc::new(Some(conn)));
                }
                Err(e) => return self.set_problem(Some(Trouble::Misconfigured(e.to_string()))),
            }
        }
        if cluster && let Err(trouble) = self.cluster_state(&first).await {
            // A master down without a replica: its clients follow
            // on_failure, the others are shaped as before.
            return self.set_problem(Some(trouble));
        }
        if let Err(e) = self.write_probe().await {
            return self.set_problem(Some(Trouble::Unavailable(format!(
                "{node} takes no writes: {e}"
            ))));
        }
        self.set_problem(None)
    }

    /// Write the health key, as an admission writes (a Redis out of
    /// memory under `noeviction` refuses every script and still answers
    /// INFO). It lapses a minute after the last check.
    async fn write_probe(&self) -> Result<(), ClusterError> {
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("SET");
        cmd.arg(&self.health).arg(1).arg("PX").arg(60_000);
        let work = async move { Ok::<(), ClusterError>(cmd.query_async(&mut conn).await?) };
        let limit = super::connect_limit(self.timeout);
        tokio::time::timeout(limit, self.on_runtime(work))
            .await
            .map_err(|_| ClusterError::Timeout(limit))?
    }

    fn set_problem(&self, problem: Option<Trouble>) -> Result<(), String> {
        self.problem.set(problem)
    }

    /// Re-check every few seconds, so a fixed topology is seen. A check
    /// that took longer than the period (unreachable seeds, each asked
    /// with its own timeout) is followed by a full period, not by checks
    /// back to back.
    pub async fn watch(&self) {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let _ = self.check().await;
        }
    }

    pub(super) fn problem(&self) -> &super::Problem {
        &self.problem
    }

    /// Run a script: `EVALSHA`, then `EVAL` once on `NOSCRIPT` (routed by
    /// the first key, like the `EVALSHA`).
    async fn run<T: redis::FromRedisValue + Send + 'static>(
        &self,
        lua: &Lua,
        keys: &[&str],
        args: &[i64],
    ) -> Result<T, ClusterError> {
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&lua.sha).arg(keys.len()).arg(keys).arg(args);
        let mut eval = redis::cmd("EVAL");
        eval.arg(lua.body).arg(keys.len()).arg(keys).arg(args);
        let work = async move {
            match cmd.query_async(&mut conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    Ok(eval.query_async(&mut conn).await?)
                }
                r => Ok(r?),
            }
        };
        self.on_runtime(work).await
    }

    /// Run `work` on the store's runtime (see the module's note).
    async fn on_runtime<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T, ClusterError>> + Send + 'static,
    ) -> Result<T, ClusterError> {
        match &self.runtime {
            Some(runtime) => runtime
                .spawn(work)
                .await
                .map_err(|e| ClusterError::Setup(format!("redis call: {e}")))?,
            None => work.await,
        }
    }

    pub async fn admit(&self, ask: &Ask) -> Result<Vec<i64>, ClusterError> {
        let mut keys = vec![ask.key.as_str()];
        if let Some(s) = &ask.slots {
            keys.push(s);
        }
        let us = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        // A call Redis runs after the caller stopped waiting for its
        // answer (Redis paused or stalled past `orphan_limit`: the client
        // library gives up, the command still runs when Redis resumes)
        // reserves nothing: its reservation could never be given back.
        // On one server only: a Redis Cluster's masters keep clocks of
        // their own, and one learned offset could refuse every call to a
        // master whose clock is behind another's.
        let sent = monotonic_us();
        let offset = self.offset_us.load(Ordering::Relaxed);
        let single = matches!(**self.conn.load(), Some(Conn::Single(_)));
        let deadline = if offset == i64::MIN || !single {
            0
        } else {
            let limit =
                us(u64::try_from(super::orphan_limit(self.timeout).as_micros())
                    .unwrap_or(u64::MAX));
            sent.saturating_add(limit).saturating_add(offset).max(1)
        };
        let args = [
            us(ask.step_us.max(1)),
            i64::from(ask.capacity),
            i64::from(ask.cost),
            us(ask.tau_us),
            us(if ask.slots.is_some() {
                ask.slot_us.max(1)
            } else {
                0
            }),
            us(ask.max_wait_us),
            deadline,
        ];
        let reply: Vec<i64> = self.run(&self.admit, &keys, &args).await?;
        if let Some(&now) = reply.get(4) {
            self.offset_us
                .store(now.saturating_sub(sent), Ordering::Relaxed);
        }
        Ok(reply)
    }

    pub async fn cancel(&self, r: &Reservation) -> Result<(), ClusterError> {
        let holes = super::holes_key(&r.key);
        let mut keys = vec![r.key.as_str(), holes.as_str()];
        if let Some(s) = &r.slots {
            keys.push(s);
        }
        let args = [r.new_d, r.undo, r.first_slot, i64::from(r.cost)];
        self.run::<i64>(&self.cancel, &keys, &args)
            .await
            .map(|_| ())
    }
}

/// Our monotonic clock in µs since its first read. The offset learned
/// from Redis's `TIME` is against it, so a step of this machine's wall
/// clock (NTP, a VM resumed) leaves every deadline where it was: against
/// the wall clock, a step back by more than the orphan limit made every
/// call in flight miss its deadline until the next reply.
fn monotonic_us() -> i64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(std::time::Instant::now);
    i64::try_from(origin.elapsed().as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn a_password_in_a_node_url_is_never_shown() {
        assert_eq!(
            shown("redis://:s3cret@10.0.0.5:6379"),
            "redis://:***@10.0.0.5:6379"
        );
        assert_eq!(
            shown("rediss://app:s3cret@cache.example:6380/0"),
            "rediss://app:***@cache.example:6380/0"
        );
        assert_eq!(shown("redis://app@h:6379"), "redis://app@h:6379");
        assert_eq!(
            shown("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(shown("not a url"), "not a url");
    }
}
