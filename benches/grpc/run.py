#!/usr/bin/env python3
"""gRPC unary calls through sluice (`protocol = "h2c"`) and through nginx
`grpc_pass`, side by side in one run on this machine, loopback only (driven
by benches/grpc/run.sh, which builds what it needs).

Both proxies front the same downstream, `e2e grpc-downstream` (a hyper
HTTP/2 server that answers every call with one message and
`grpc-status: 0` in trailers), with 2 workers each and a per-client limit
that never binds (sluice: a route at 1,000,000/s; nginx: `limit_req` at
1,000,000 r/s), so the figures are the cost of the gRPC path.

  1. floor: the C spinner's lateness to 1 ms deadlines (this VM's own
     scheduling floor), right before the loads.
  2. unary calls: h2load, 16 connections x 10 concurrent streams, 6 s, a
     5-byte gRPC request (an empty grpc.health.v1 HealthCheckRequest) with
     `content-type: application/grpc` and `te: trailers`; calls per second,
     mean and max call time, and CPU per call of the proxy (perf stat
     task-clock over the same span; user and system time from /proc).
  3. refusals: the same load on a limit of 1/s, burst 1, keyed by client
     address: answers per second and CPU per answer, then a grpcio client's
     view of one refused call (sluice: RESOURCE_EXHAUSTED with a pushback
     trailer; nginx: its 429, which gRPC maps to UNAVAILABLE).
  4. the downstream alone under the same h2load load, for reference.

Prints a markdown table. Every process it starts is ended by PID; every
load is bounded in time.
"""
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benches"))
from procs import CpuMeter, children, free_port, nginx_conf, start, started, stop, wait_port, workdir  # noqa: E402
E2E, SLUICE, NGINX, FLOOR, OUT, NGINX_VERSION, H2LOAD_VERSION = sys.argv[1:8]
WORK = workdir("sluice-grpc-bench.")
CLIENT = os.path.join(ROOT, "tests", "clients", "grpc_client.py")
METHOD = "/grpc.health.v1.Health/Check"
SECONDS = 6
results = {}


def emit(name, r):
    results[name] = r
    print(json.dumps({"scenario": name, **r}), file=sys.stderr, flush=True)


def sluice_conf(port, ds, limited):
    route = ('key = "ip"\nrate = "1/s"\ncapacity = 1' if limited
             else 'key = "header:X-Client"\non_missing_key = "ip"\nrate = "1000000/s"\ncapacity = 1000000')
    return f"""[server]
listen = ["127.0.0.1:{port}"]
max_connections = 60000
workers = 2
[[upstream]]
name = "ds"
url = "http://127.0.0.1:{ds}"
protocol = "h2c"
[[route]]
name = "r"
upstream = "ds"
{route}
[limits]
max_queued = 1000000
"""


def grpc_nginx_conf(port, ds, limited):
    zone = ("$binary_remote_addr zone=z:64m rate=1r/s" if limited
            else "$http_x_client zone=z:64m rate=1000000r/s")
    burst = 1 if limited else 1000000
    return nginx_conf(2, WORK, f"""  limit_req_zone {zone};
  limit_req_status 429;
  upstream ds {{ server 127.0.0.1:{ds}; keepalive 512; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port} http2 backlog=65535;
    location / {{
      limit_req zone=z burst={burst};
      grpc_pass grpc://ds;
    }}
  }}
""")


class Proxy:
    def __init__(self, kind, ds):
        self.kind, self.ds, self.proc = kind, ds, None

    def start(self, limited):
        self.port = free_port()
        conf = os.path.join(WORK, f"{self.kind}.conf")
        text = (sluice_conf if self.kind == "sluice" else grpc_nginx_conf)(self.port, self.ds, limited)
        with open(conf, "w") as f:
            f.write(text)
        if self.kind == "sluice":
            self.proc = start([SLUICE, "--log-level", "error", "run", "--config", conf])
        else:
            self.proc = start([NGINX, "-c", conf, "-p", WORK])
        wait_port(self.port)
        time.sleep(0.3)

    def pids(self):
        return [self.proc.pid] + children(self.proc.pid)

    def stop(self):
        stop(self.proc)
        started.remove(self.proc)


def floor():
    out = subprocess.run([FLOOR, "3000", "1000"], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def h2load(port, pids=None):
    """One h2load run of unary calls; with pids, the CPU they used."""
    body = os.path.join(WORK, "request.bin")
    with open(body, "wb") as f:
        f.write(b"\x00\x00\x00\x00\x00")  # uncompressed, 0-byte message
    args = ["h2load", "-t1", "-c16", "-m10", "-D", str(SECONDS), "-d", body,
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            "-H", "x-client: bench", f"http://127.0.0.1:{port}{METHOD}"]
    meter = CpuMeter(pids, SECONDS, os.path.join(WORK, "perf.txt")) if pids else None
    out = subprocess.run(args, capture_output=True, text=True, timeout=SECONDS + 60).stdout
    res = {}
    m = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
    if not m:
        raise RuntimeError(f"h2load output not understood:\n{out}")
    res["done"], res["succeeded"], res["failed"] = int(m.group(2)), int(m.group(3)), int(m.group(4))
    m = re.search(r"status codes: (\d+) 2xx, \d+ 3xx, (\d+) 4xx, (\d+) 5xx", out)
    res["2xx"], res["4xx"], res["5xx"] = (int(m.group(i)) for i in (1, 2, 3)) if m else (0, 0, 0)
    res["per_s"] = res["done"] / SECONDS
    m = re.search(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)", out)
    if m:
        res["min"], res["max"], res["mean"] = m.group(1), m.group(2), m.group(3)
    if meter:
        res.update(meter.per(res["done"]))
    return res


def grpc_view(port):
    """What a grpcio client sees for three calls at once (key: its address)."""
    out = subprocess.run(["/usr/bin/python3", CLIENT, "--target", f"127.0.0.1:{port}", "unary",
                          "--count", "3", "--deadline-ms", "3000"],
                         capture_output=True, text=True, timeout=30).stdout
    calls = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    codes = sorted(c["code"] for c in calls)
    pushback = [c["trailers"].get("grpc-retry-pushback-ms") for c in calls
                if c["trailers"].get("grpc-retry-pushback-ms")]
    return {"codes": codes, "pushback_ms": pushback}


def run(proxy, limited, name):
    proxy.start(limited)
    try:
        r = h2load(proxy.port, proxy.pids())
        if not limited:
            r["check"] = grpc_view(proxy.port)
        else:
            r["refused_view"] = grpc_view(proxy.port)
        emit(name, r)
    except Exception as e:  # one failed scenario must not lose the rest
        emit(name, {"error": str(e)})
    finally:
        proxy.stop()


def show(v, fmt="{:.0f}"):
    return "n/a" if v is None else fmt.format(v)


def ratio(a, b):
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def main():
    ds = free_port()
    downstream = start([E2E, "grpc-downstream", str(ds)])
    wait_port(ds)
    try:
        emit("floor", floor())
        for kind in ("sluice", "nginx"):
            run(Proxy(kind, ds), False, f"{kind}-unary")
            run(Proxy(kind, ds), True, f"{kind}-refused")
        emit("direct", h2load(ds))
    finally:
        for p in list(started):
            stop(p)
    del downstream

    g = lambda name, key: results.get(name, {}).get(key)
    f = results.get("floor", {})
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {os.cpu_count()} cores, "
          f"{NGINX_VERSION}, {H2LOAD_VERSION}; loopback, proxy, h2load and downstream sharing the cores. "
          f"Floor (C spinner, 1 ms deadlines, right before): p50 {show(f.get('p50_us'), '{:.1f}')} µs, "
          f"p99 {show(f.get('p99_us'), '{:.1f}')} µs lateness.")
    print()
    print("| gRPC unary calls, h2load -c16 -m10, 6 s, 2 workers each | sluice (h2c upstream) | nginx grpc_pass | sluice/nginx | better |")
    print("|---|---|---|---|---|")
    rows = [
        ("calls per second", "unary", "per_s", "{:.0f}", "higher"),
        ("calls failed (h2load) / non-2xx", "unary", None, None, "lower"),
        ("CPU per call (perf stat task-clock), µs", "unary", "cpu_us_per_request", "{:.1f}", "lower"),
        ("user / system CPU per call, µs", "unary", "user_sys", None, "lower"),
        ("context switches per call", "unary", "context_switches_per_request", "{:.2f}", "lower"),
        ("call time min / mean / max (h2load)", "unary", "times", None, "lower"),
        ("a grpcio client's 3 calls at once, after the load", "unary", "check", None, "all OK"),
        ("refusals (limit 1/s, burst 1): answers per second", "refused", "per_s", "{:.0f}", "higher"),
        ("  same: CPU per answer, µs", "refused", "cpu_us_per_request", "{:.1f}", "lower"),
        ("  a grpcio client's 3 calls at once, right after the flood", "refused", "refused_view", None, "RESOURCE_EXHAUSTED"),
    ]
    for label, sc, key, fmt, better in rows:
        cells = []
        nums = []
        for kind in ("sluice", "nginx"):
            r = results.get(f"{kind}-{sc}", {})
            if "error" in r:
                cells.append("failed: " + r["error"].splitlines()[0])
                nums.append(None)
            elif key is None:
                cells.append(f"{r.get('failed', 'n/a')} / {r.get('4xx', 0) + r.get('5xx', 0)}")
                nums.append(None)
            elif key == "user_sys":
                u, s = r.get("user_us_per_request"), r.get("sys_us_per_request")
                cells.append("n/a" if u is None else f"{u:.1f} / {s:.1f}")
                nums.append(None)
            elif key == "times":
                cells.append(" / ".join(r.get(k, "n/a") for k in ("min", "mean", "max")))
                nums.append(None)
            elif key in ("check", "refused_view"):
                v = r.get(key) or {}
                text = ", ".join(v.get("codes", [])) or "n/a"
                if v.get("pushback_ms"):
                    text += f" (pushback {', '.join(v['pushback_ms'])} ms)"
                cells.append(text)
                nums.append(None)
            else:
                v = r.get(key)
                cells.append(show(v, fmt))
                nums.append(v)
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio(*nums) if None not in nums else 'n/a'} | {better} |")
    d = results.get("direct", {})
    if "per_s" in d:
        print()
        print(f"The downstream alone, same h2load load: {d['per_s']:.0f} calls/s, call time mean {d.get('mean', 'n/a')}.")
    print()
    print("Reproduce: `bash benches/grpc/run.sh` (installs nginx, h2load and perf if missing; under a minute).")


if __name__ == "__main__":
    main()
