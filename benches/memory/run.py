#!/usr/bin/env python3
"""Memory per held request, sluice beside nginx (driven by
benches/memory/run.sh, which builds what it needs).

Each proxy, 2 workers, in front of the same downstream (`e2e downstream`),
with a per-client limit that holds everything (sluice: 1/h with capacity
1,000,000; nginx: `limit_req` 1 r/m with burst 1,000,000, no nodelay):

  1. idle: resident memory (all processes) after one request, and the
     anonymous part of it (RssAnon: heap and stacks; the rest is the
     binary's and libraries' file pages);
  2. HTTP/1.1: 8,000 requests, one connection each
     (tests/clients/hold_http1.py), held; RSS once it stops changing
     (growing, then falling as the allocator purges what the burst
     freed: within 0.5 % for 10 s); the
     clients close; RSS 20 s later;
  3. HTTP/2: 100,000 streams from h2load (800 connections x 125 streams,
     within nginx's 128 streams per connection), held; the same readings.

Bytes per held request = (RSS held - RSS idle) / requests held. For
sluice, its allocator's own count (/status `memory`: allocated and
resident) at each of the three moments tells live memory from memory the
allocator keeps. Every
process it starts is ended by PID; every wait is bounded in time.
"""
import json
import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benches"))
from procs import children, free_port, nginx_conf, rss_kib, start, started, stop, wait_port, workdir  # noqa: E402
E2E, SLUICE, NGINX, NGINX_VERSION = sys.argv[1:5]
WORK = workdir("sluice-memory-bench.")
HOLD = os.path.join(ROOT, "tests", "clients", "hold_http1.py")
H1, H2 = 8_000, 100_000


class Proxy:
    def __init__(self, kind, ds):
        self.kind, self.ds, self.proc = kind, ds, None

    def start(self):
        # sluice takes HTTP/1.1 and HTTP/2 (prior knowledge) on one port;
        # nginx without TLS needs a port of each.
        self.port = free_port()
        self.h2_port = self.port
        if self.kind == "sluice":
            self.admin = free_port()
            conf = os.path.join(WORK, "sluice.toml")
            with open(conf, "w") as f:
                f.write(f"""[server]
listen = ["127.0.0.1:{self.port}"]
max_connections = 200000
workers = 2
[admin]
listen = "127.0.0.1:{self.admin}"
[[upstream]]
name = "ds"
url = "http://127.0.0.1:{self.ds}"
[[route]]
name = "hold"
upstream = "ds"
key = "header:X-Client"
rate = "1/h"
capacity = 1000000
[limits]
max_queued = 1000000
""")
            self.proc = start([SLUICE, "--log-level", "error", "run", "--config", conf])
        else:
            self.h2_port = free_port()
            conf = os.path.join(WORK, "nginx.conf")
            with open(conf, "w") as f:
                f.write(nginx_conf(2, WORK, f"""  limit_req_zone $http_x_client zone=z:64m rate=1r/m;
  limit_req_status 429;
  upstream ds {{ server 127.0.0.1:{self.ds}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{self.port} backlog=65535;
    listen 127.0.0.1:{self.h2_port} http2 backlog=65535;
    location / {{
      limit_req zone=z burst=1000000;
      proxy_pass http://ds;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
"""))
            self.proc = start([NGINX, "-c", conf, "-p", WORK])
        wait_port(self.port)
        wait_port(self.h2_port)
        time.sleep(0.5)

    def rss(self, field="VmRSS"):
        return rss_kib([self.proc.pid] + children(self.proc.pid), field)

    def status(self):
        """sluice's /status (None for nginx)."""
        if self.kind != "sluice":
            return None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/status", timeout=5) as r:
            return json.load(r)

    def queued(self):
        st = self.status()
        return None if st is None else st.get("queued")

    def allocator(self):
        """sluice's allocator: (allocated, resident) KiB, from /status."""
        st = self.status()
        m = (st or {}).get("memory") or {}
        if "allocated_bytes" not in m:
            return None
        return m["allocated_bytes"] // 1024, m["resident_bytes"] // 1024

    def stop(self):
        stop(self.proc)
        started.remove(self.proc)


def settled(proxy, within=120, steady=10):
    """RSS once it has stopped changing: first growing (less than 0.5 % in
    2 s), then falling too (within 0.5 % for `steady` seconds). jemalloc
    gives back the pages its freed memory leaves over about 10 s
    (dirty_decay_ms), so what a burst freed is gone from the figure."""
    end = time.time() + within
    last = proxy.rss()
    while time.time() < end:
        time.sleep(2)
        now = proxy.rss()
        if now <= last * 1.005:
            break
        last = now
    since, base = time.time(), proxy.rss()
    while time.time() < end and time.time() - since < steady:
        time.sleep(2)
        now = proxy.rss()
        if abs(now - base) > base * 0.005:
            since, base = time.time(), now
    return proxy.rss()


def measure(proxy, what, n, load):
    proxy.start()
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{proxy.port}/warm", headers={"X-Client": "warm"}), timeout=5).read()
        idle = proxy.rss()
        idle_anon = proxy.rss("RssAnon")
        alloc = {"idle": proxy.allocator()}
        client = load(proxy)
        held = settled(proxy)
        queued = proxy.queued()
        alloc["held"] = proxy.allocator()
        if client.stdin:
            client.stdin.close()
        time.sleep(1)
        stop(client)
        started.remove(client)
        time.sleep(20)
        after = proxy.rss()
        after_anon = proxy.rss("RssAnon")
        alloc["after"] = proxy.allocator()
        return {"idle_kib": idle, "held_kib": held, "after_kib": after, "queued": queued,
                "idle_anon_kib": idle_anon, "after_anon_kib": after_anon,
                "bytes_per_request": (held - idle) * 1024 / n, "allocator_kib": alloc}
    finally:
        proxy.stop()


def h1(proxy):
    p = start(["python3", HOLD, "127.0.0.1", str(proxy.port), str(H1)],
              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    return p


def h2(proxy):
    return start(["h2load", "-c", "800", "-m", "125", "-n", str(H2), "-H", "x-client: k",
                  f"http://127.0.0.1:{proxy.h2_port}/hold"],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    ds = free_port()
    start([E2E, "downstream", str(ds)])
    wait_port(ds)
    res = {}
    try:
        for kind in ("sluice", "nginx"):
            for what, n, load in (("HTTP/1.1", H1, h1), ("HTTP/2", H2, h2)):
                r = measure(Proxy(kind, ds), what, n, load)
                res[(kind, what)] = r
                print(json.dumps({"proxy": kind, "what": what, **r}), file=sys.stderr, flush=True)
    finally:
        for p in list(started):
            stop(p)

    print(f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {os.cpu_count()} cores, "
          f"{NGINX_VERSION}, sluice release build with jemalloc; 2 workers each; loopback.")
    print()
    print("| held in the queue | sluice | nginx | sluice/nginx | target (issue 12) |")
    print("|---|---|---|---|---|")
    for what, n, target in (("HTTP/1.1", H1, 4096), ("HTTP/2", H2, 2048)):
        s, g = res[("sluice", what)], res[("nginx", what)]
        print(f"| {what}, {n:,} requests: bytes per held request | {s['bytes_per_request']:,.0f} | "
              f"{g['bytes_per_request']:,.0f} | {s['bytes_per_request'] / g['bytes_per_request']:.2f} | "
              f"<= {target:,}: {'met' if s['bytes_per_request'] <= target else '**missed**'} |")
        print(f"|   same: RSS idle / held, MiB | {s['idle_kib'] / 1024:.1f} / {s['held_kib'] / 1024:.1f} | "
              f"{g['idle_kib'] / 1024:.1f} / {g['held_kib'] / 1024:.1f} | n/a | |")
        sa, ga = s["after_kib"] / s["idle_kib"], g["after_kib"] / g["idle_kib"]
        print(f"|   same: RSS 20 s after the clients left, x idle | {sa:.2f} | {ga:.2f} | n/a | "
              f"<= 1.50: {'met' if sa <= 1.5 else '**missed**'} |")
        print(f"|   same: of which anonymous (RssAnon: heap, stacks), idle / 20 s after, MiB | "
              f"{s['idle_anon_kib'] / 1024:.1f} / {s['after_anon_kib'] / 1024:.1f} | "
              f"{g['idle_anon_kib'] / 1024:.1f} / {g['after_anon_kib'] / 1024:.1f} | n/a | |")
        print(f"|   same: requests sluice held (/status queued) | {s['queued']} | n/a | | |")
        a = s.get("allocator_kib") or {}
        if all(a.get(k) for k in ("idle", "held", "after")):
            cells = ", ".join(f"{k} {a[k][0] / 1024:.1f} / {a[k][1] / 1024:.1f}" for k in ("idle", "held", "after"))
            print(f"|   same: sluice's allocator, allocated / resident MiB | {cells} | n/a | | |")
    print()
    print("Reproduce: `bash benches/memory/run.sh` (installs nginx and h2load if missing; about 5 minutes).")


if __name__ == "__main__":
    main()
