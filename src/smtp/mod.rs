//! The SMTP relay: listeners that applications (or a local Postfix, as
//! its `relayhost`) hand mail to, each message paced by the same admission
//! layer as HTTP requests and relayed to an upstream (a provider such as
//! Amazon SES, a smarthost, a partner MTA) at its departure.
//!
//! Hold, don't store: a message is answered with the upstream's own reply
//! to its end of data, never 250 before the upstream said so; a crash
//! loses nothing, since every message not answered 250 is still the
//! client's to retry. No spool.
//!
//! Split by job: [`session`] (one inbound connection: the protocol, the
//! admission, the hold), [`client`] (one upstream session), [`pool`] (an
//! upstream's sessions, and how its answers map to the client's), [`io`]
//! (plain or TLS streams and the input buffer), [`reply`].
//!
//! Sessions run on the daemon's multi-threaded runtime (mail is a few
//! messages a second, not the HTTP workers' load).

mod client;
mod data;
mod io;
mod pool;
pub mod reply;
mod session;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::http::{Concurrency, InFlight};
use arc_swap::ArcSwap;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::admission::{Admission, Policy, Protocol, Rule, RuleSpec, StageBudget};
use crate::config::{Config, MAX_HOLD, SmtpListener};
use pool::Pool;

/// One listener as sessions see it: its config, admission rule, upstream
/// pool and TLS acceptor.
pub(crate) struct Listener {
    pub cfg: SmtpListener,
    pub rule: Arc<Rule>,
    pub pool: Arc<Pool>,
    pub acceptor: Option<TlsAcceptor>,
}

/// A config's upstream pools, ready to install.
pub struct Pools(Vec<Arc<Pool>>);

/// Everything built from one config; swapped whole on reload.
struct Table {
    listeners: Vec<Arc<Listener>>,
    pools: Vec<Arc<Pool>>,
}

/// One SMTP listener as `/status` shows it.
#[derive(Debug, Clone)]
pub struct ListenerSummary {
    pub name: String,
    pub listen: Vec<SocketAddr>,
    pub upstream: String,
    pub rate_per_second: f64,
    pub capacity: u32,
}

/// The SMTP front end: bound listeners, the current table, and the
/// connection counts.
pub struct Front {
    admission: Arc<Admission>,
    budget: Arc<StageBudget>,
    roots: Arc<rustls::ClientConfig>,
    table: ArcSwap<Table>,
    /// Per listener, its name and configured addresses (a reload may not
    /// change them).
    listen: Vec<(String, Vec<SocketAddr>)>,
    /// The bound sockets, until [`Front::run`] takes them.
    sockets: Mutex<Vec<(String, std::net::TcpListener)>>,
    addrs: Vec<(String, SocketAddr)>,
    /// `max_connections` per listener, kept across reloads.
    slots: Mutex<Concurrency>,
    sessions: Arc<AtomicUsize>,
    /// Sessions open by client address (`max_connections_per_ip`).
    per_ip: Arc<PerIp>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts a session while it lives.
struct Open(Arc<AtomicUsize>);

/// Sessions open by client address (outside `allow_from`; IPv6 by /64),
/// so that one address cannot take every one of a listener's
/// `max_connections`
/// (Postfix's `smtpd_client_connection_count_limit`): an outsider refused
/// at the greeting kept its slot until its idle timeout, and a few hundred
/// such connections shut out the clients allowed to relay; with
/// `auth_file`, each guessed passwords in parallel. An address leaves the
/// map with its last session.
#[derive(Debug, Default)]
struct PerIp(Mutex<HashMap<IpAddr, usize>>);

impl PerIp {
    /// A place for one more session from `ip`, if it has fewer than
    /// `most` open.
    fn enter(self: &Arc<Self>, ip: IpAddr, most: usize) -> Option<PerIpPlace> {
        // An IPv6 client by its /64: one host (or one customer's network)
        // has a whole /64 to pick addresses from.
        let ip = match ip {
            IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from_bits(
                v6.to_bits() & !u128::from(u64::MAX),
            )),
            v4 => v4,
        };
        let mut open = lock(&self.0);
        let n = open.entry(ip).or_insert(0);
        if *n >= most {
            return None;
        }
        *n += 1;
        Some(PerIpPlace(self.clone(), ip))
    }
}

/// One session's place in [`PerIp`], given back when dropped.
struct PerIpPlace(Arc<PerIp>, IpAddr);

impl Drop for PerIpPlace {
    fn drop(&mut self) {
        let mut open = lock(&(self.0).0);
        if let Some(n) = open.get_mut(&self.1) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.1);
            }
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Front {
    /// Build the table and bind every `[[smtp]]` listener.
    pub fn bind(
        config: &Config,
        admission: Arc<Admission>,
        budget: Arc<StageBudget>,
        roots: Arc<rustls::ClientConfig>,
    ) -> Result<Front, crate::http::ServeError> {
        let mut sockets = Vec::new();
        let mut addrs = Vec::new();
        for l in &config.smtp {
            for &addr in &l.listen {
                let socket = crate::http::listener(addr)
                    .and_then(|s| s.set_nonblocking(true).map(|()| s))
                    .map_err(|source| crate::http::ServeError::Bind { addr, source })?;
                addrs.push((l.name.clone(), socket.local_addr().unwrap_or(addr)));
                sockets.push((l.name.clone(), socket));
            }
        }
        let front = Front {
            admission,
            budget,
            roots,
            table: ArcSwap::from_pointee(Table {
                listeners: Vec::new(),
                pools: Vec::new(),
            }),
            listen: config
                .smtp
                .iter()
                .map(|l| (l.name.clone(), l.listen.clone()))
                .collect(),
            sockets: Mutex::new(sockets),
            addrs,
            slots: Mutex::new(Concurrency::default()),
            sessions: Arc::new(AtomicUsize::new(0)),
            per_ip: Arc::default(),
        };
        let pools = front
            .prepare(config)
            .map_err(crate::http::ServeError::Client)?;
        front.install(config, pools);
        Ok(front)
    }

    /// What can fail in applying `config`, done first: its upstreams'
    /// pools (nothing changes until [`Front::install`]). A reload cannot
    /// add, remove or move listeners ([`Front::same_listeners`]): their
    /// sockets need a restart. An upstream whose settings did not change keeps its pool, its open
    /// sessions and its `max_connections` count.
    pub fn prepare(&self, config: &Config) -> Result<Pools, String> {
        let running = self.table.load();
        let pools = config
            .smtp_upstreams
            .iter()
            .map(|u| match running.pools.iter().find(|p| p.config() == u) {
                Some(p) => Ok(p.clone()),
                None => Pool::new(u, &self.roots),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pools(pools))
    }

    /// Whether `config` has the listeners running (names and addresses):
    /// they are bound at start, and a reload cannot change them. Their
    /// order, and the order of a listener's addresses, do not matter (a
    /// session finds its listener by name).
    pub fn same_listeners(&self, config: &Config) -> bool {
        same_listeners(&self.listen, &config.smtp)
    }

    /// Apply `config` with its prepared pools: its policies go to the
    /// engine, and new transactions use its table; messages in hand
    /// finish with the one they started with.
    pub fn install(&self, config: &Config, Pools(pools): Pools) {
        let specs: Vec<RuleSpec<'_>> = config
            .smtp
            .iter()
            .map(|l| {
                let up = &config.smtp_upstreams[l.upstream];
                RuleSpec {
                    name: &l.name,
                    protocol: Protocol::Smtp,
                    upstream: &up.name,
                    cap: up.rate,
                    // An upstream's throttling reply pauses it.
                    pausable: true,
                    policy: Policy {
                        rate: l.rate,
                        capacity: l.capacity,
                        burst: l.burst,
                        max_wait: Some(u64::try_from(l.max_wait.as_nanos()).unwrap_or(u64::MAX)),
                    },
                    dry_run: false,
                }
            })
            .collect();
        let rules = self.admission.rules(&specs);
        let listeners = config
            .smtp
            .iter()
            .zip(rules)
            .map(|(l, rule)| {
                Arc::new(Listener {
                    cfg: l.clone(),
                    rule,
                    pool: pools[l.upstream].clone(),
                    acceptor: l.tls.clone().map(TlsAcceptor::from),
                })
            })
            .collect();
        let table = Table { listeners, pools };
        // Resized in place: the sessions open across the reload count
        // against the new limit (a fresh semaphore would not count them).
        let mut slots = lock(&self.slots);
        let mut next = slots.clone();
        for l in &table.listeners {
            next.get(&l.cfg.name, l.cfg.max_connections);
        }
        slots.commit(next);
        self.table.store(Arc::new(table));
    }

    fn listener(&self, name: &str) -> Option<Arc<Listener>> {
        self.table
            .load()
            .listeners
            .iter()
            .find(|l| l.cfg.name == name)
            .cloned()
    }

    fn slots(&self, name: &str) -> Option<Arc<InFlight>> {
        lock(&self.slots).current(name)
    }

    /// The addresses bound, by listener (useful with port 0).
    pub fn local_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.addrs.clone()
    }

    /// Sessions open now.
    pub fn sessions(&self) -> usize {
        self.sessions.load(Ordering::Relaxed)
    }

    /// The listeners of the running config.
    pub fn summaries(&self) -> Vec<ListenerSummary> {
        self.table
            .load()
            .listeners
            .iter()
            .map(|l| ListenerSummary {
                name: l.cfg.name.clone(),
                listen: self
                    .addrs
                    .iter()
                    .filter(|(n, _)| *n == l.cfg.name)
                    .map(|(_, a)| *a)
                    .collect(),
                upstream: l.pool.config().name.clone(),
                rate_per_second: l.rule.policy().rate.per_second_f64(),
                capacity: l.rule.policy().capacity,
            })
            .collect()
    }

    /// The rules of the running config (to name queues in `/status`).
    pub fn rules(&self) -> Vec<Arc<Rule>> {
        self.table
            .load()
            .listeners
            .iter()
            .map(|l| l.rule.clone())
            .collect()
    }

    /// The longest a relay under way may still take (the drain's grace
    /// for relays in flight when it gives up): its reply to the end of
    /// data is waited for until 9 minutes after the client's end of data
    /// ([`MAX_HOLD`]), past the upstream's `relay_timeout` if need be, since
    /// a relay cut after its end of data could be delivered twice.
    pub fn longest_relay(&self) -> Duration {
        let pools = &self.table.load().pools;
        let timeout = pools.iter().map(|p| p.config().relay_timeout).max();
        timeout.map_or(Duration::ZERO, |t| t.max(MAX_HOLD))
    }

    /// Every upstream, with how long it stays paused if it is.
    pub fn upstreams(&self) -> Vec<(String, Option<Duration>)> {
        let table = self.table.load();
        table
            .pools
            .iter()
            .map(|p| {
                let name = p.config().name.clone();
                let paused = table
                    .listeners
                    .iter()
                    .filter(|l| l.pool.config().name == name)
                    .find_map(|l| self.admission.paused_for(&l.rule));
                (name, paused)
            })
            .collect()
    }

    /// Accept on every listener until `stop`; sessions are tracked by
    /// `sessions` (the drain waits for them).
    pub fn run(self: &Arc<Self>, stop: &CancellationToken, sessions: &TaskTracker) {
        let sockets = std::mem::take(&mut *lock(&self.sockets));
        for (name, socket) in sockets {
            let listener = match TcpListener::from_std(socket) {
                Ok(l) => l,
                Err(e) => {
                    warn!(listener = %name, error = %e, "cannot register an SMTP listener");
                    continue;
                }
            };
            if let Ok(addr) = listener.local_addr() {
                info!(listener = %name, %addr, "SMTP relay listening");
            }
            tokio::spawn(
                self.clone()
                    .accept(name, listener, stop.clone(), sessions.clone()),
            );
        }
    }

    async fn accept(
        self: Arc<Self>,
        name: String,
        listener: TcpListener,
        stop: CancellationToken,
        sessions: TaskTracker,
    ) {
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "SMTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (Some(l), Some(slots)) = (self.listener(&name), self.slots(&name)) else {
                continue;
            };
            // At max_connections, or at max_connections_per_ip for this
            // address: said so, and closed (RFC 5321 3.1). The clients
            // `allow_from` trusts are not counted by address (Postfix
            // exempts `$mynetworks` alike): an application's many
            // sessions from one host are what the relay is for.
            let hostname = &l.cfg.hostname;
            let trusted = l.cfg.allows(peer.ip());
            let place = if trusted {
                None
            } else {
                match self.per_ip.enter(peer.ip(), l.cfg.max_connections_per_ip) {
                    Some(place) => Some(place),
                    None => {
                        debug!(%peer, listener = %name, "too many connections from this address");
                        let text = format!(
                            "421 4.7.0 {hostname} Too many connections from your address, try again later\r\n"
                        );
                        sessions.spawn(refuse(tcp, text));
                        continue;
                    }
                }
            };
            let Some(permit) = slots.try_take() else {
                let text =
                    format!("421 4.3.2 {hostname} Too many connections, try again later\r\n");
                sessions.spawn(refuse(tcp, text));
                continue;
            };
            self.sessions.fetch_add(1, Ordering::Relaxed);
            let open = Open(self.sessions.clone());
            let (front, stop) = (self.clone(), stop.clone());
            sessions.spawn(async move {
                session::serve(front, l, tcp, peer, stop).await;
                drop(permit);
                drop(place);
                drop(open);
            });
        }
    }
}

/// Say `text` (a 421) to a connection not taken, within a second, and
/// close it.
async fn refuse(mut tcp: tokio::net::TcpStream, text: String) {
    let _ = tokio::time::timeout(Duration::from_secs(1), tcp.write_all(text.as_bytes())).await;
}

/// Whether `config` names the listeners of `running`, each with the same
/// addresses, in any order.
fn same_listeners(running: &[(String, Vec<SocketAddr>)], config: &[SmtpListener]) -> bool {
    let sorted = |listen: &[SocketAddr]| {
        let mut listen = listen.to_vec();
        listen.sort_unstable();
        listen
    };
    config.len() == running.len()
        && config.iter().all(|l| {
            running
                .iter()
                .find(|(name, _)| *name == l.name)
                .is_some_and(|(_, listen)| sorted(listen) == sorted(&l.listen))
        })
}

#[cfg(test)]
mod tests {
    use super::{PerIp, same_listeners};
    use std::sync::Arc;

    #[test]
    fn an_ipv6_client_is_counted_by_its_64() {
        let open = Arc::new(PerIp::default());
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        let first = open.enter(ip("2001:db8:1:2::1"), 1);
        assert!(first.is_some());
        assert!(open.enter(ip("2001:db8:1:2:ffff::9"), 1).is_none());
        assert!(open.enter(ip("2001:db8:1:3::1"), 1).is_some());
        assert!(open.enter(ip("192.0.2.1"), 1).is_some());
        drop(first);
        assert!(open.enter(ip("2001:db8:1:2::7"), 1).is_some());
    }
    use crate::config::Config;
    use std::net::SocketAddr;

    fn config(listeners: &[(&str, &[&str])]) -> Config {
        let mut text =
            String::from("[[smtp_upstream]]\nname = \"relay\"\nurl = \"smtp://127.0.0.1:2600\"\n");
        for (name, listen) in listeners {
            let listen: Vec<String> = listen.iter().map(|a| format!("\"{a}\"")).collect();
            text += &format!(
                "[[smtp]]\nname = \"{name}\"\nlisten = [{}]\nupstream = \"relay\"\n\
                 key = \"global\"\nrate = \"5/s\"\ncapacity = 10\n",
                listen.join(", ")
            );
        }
        match Config::from_toml(&text) {
            Ok(c) => c,
            Err(problems) => panic!("{problems:?}"),
        }
    }

    #[test]
    fn listeners_are_compared_by_name_and_addresses_in_any_order() {
        let addr = |a: &str| a.parse::<SocketAddr>().unwrap();
        let running = vec![
            (
                "a".to_owned(),
                vec![addr("127.0.0.1:2601"), addr("[::1]:2601")],
            ),
            ("b".to_owned(), vec![addr("127.0.0.1:2602")]),
        ];
        let same = config(&[
            ("b", &["127.0.0.1:2602"]),
            ("a", &["[::1]:2601", "127.0.0.1:2601"]),
        ]);
        assert!(same_listeners(&running, &same.smtp));
        let moved = config(&[("a", &["127.0.0.1:2601"]), ("b", &["127.0.0.1:2603"])]);
        assert!(!same_listeners(&running, &moved.smtp));
        let renamed = config(&[
            ("a", &["127.0.0.1:2601", "[::1]:2601"]),
            ("c", &["127.0.0.1:2602"]),
        ]);
        assert!(!same_listeners(&running, &renamed.smtp));
        let fewer = config(&[("a", &["127.0.0.1:2601", "[::1]:2601"])]);
        assert!(!same_listeners(&running, &fewer.smtp));
    }
}
