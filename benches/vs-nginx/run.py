#!/usr/bin/env python3
"""sluice vs nginx limit_req, side by side on this machine, loopback only, in
one run (driven by benches/vs-nginx/run.sh, which builds what it needs).

Each proxy runs in front of the same Rust downstream and is driven by wrk
(what operators use) and by our own load tool (benches/vs-nginx/e2e.rs).
The C spinner (floor.c) measures this machine's scheduling floor while
each pacing scenario runs, beside it (the same load, the same moment).
Just before each pacing scenario, `e2e direct` measures the end-to-end
floor: no proxy, one thread pacing requests straight to the same
downstream at the same rate, sleeping and spinning to each deadline.
The downstream records each arrival twice: when its handler runs, and as
the kernel stamped the request's bytes on receipt (SO_TIMESTAMPNS; on
loopback that is inside the sender's send), so the tables also give the
departures' precision without the downstream's own wake-up.
CPU per request comes from `perf stat` task-clock over the wrk run, split
into user and system time from /proc.

Writes every result as a JSON line to OUT/results.jsonl and prints the
markdown table (table.py). Every process it starts is ended by PID; every
load is bounded in count and time.
"""
import json
import os
import re
import resource
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benches"))
from procs import CpuMeter, children, free_port, nginx_conf, rss_kib, start, started, stop, wait_port, workdir  # noqa: E402
HERE = os.path.join(ROOT, "benches", "vs-nginx")
E2E, SLUICE, NGINX, FLOOR, OUT = sys.argv[1:6]
WORK = workdir("sluice-vs-nginx.")
RESULTS = os.path.join(OUT, "results.jsonl")
# Interleaved rounds of the 2-worker wrk pass-through and flood.
ROUNDS = 3


def record(entry):
    with open(RESULTS, "a") as f:
        f.write(json.dumps(entry) + "\n")
    print(json.dumps(entry), flush=True)


# === the proxies ===

class Proxy:
    def __init__(self, kind, workers, downstream):
        self.kind, self.workers, self.ds = kind, workers, downstream
        self.proc = None

    @property
    def name(self):
        return f"{self.kind}-{self.workers}w"

    def pids(self):
        if self.proc is None:
            return []
        return [self.proc.pid] + children(self.proc.pid)

    def start(self, rate, capacity):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if self.kind == "sluice":
            conf = os.path.join(WORK, "sluice.toml")
            with open(conf, "w") as f:
                f.write(f"""[server]
listen = ["127.0.0.1:{port}"]
max_connections = 60000
workers = {self.workers}
[[upstream]]
name = "ds"
url = "http://127.0.0.1:{self.ds}"
[[route]]
name = "r"
upstream = "ds"
key = "header:X-Client"
rate = "{rate}/s"
capacity = {capacity}
[limits]
max_queued = 1000000
""")
            self.proc = start([SLUICE, "--log-level", "error", "run", "--config", conf])
        else:
            conf = os.path.join(WORK, "nginx.conf")
            with open(conf, "w") as f:
                f.write(nginx_conf(self.workers, WORK, f"""  limit_req_zone $http_x_client zone=z:64m rate={rate}r/s;
  limit_req_status 429;
  upstream ds {{ server 127.0.0.1:{self.ds}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} backlog=65535;
    location / {{
      limit_req zone=z burst={capacity};
      proxy_pass http://ds;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
"""))
            self.proc = start([NGINX, "-c", conf, "-p", WORK])
        wait_port(port)
        time.sleep(0.3)

    def stop(self):
        if self.proc:
            stop(self.proc)
            started.remove(self.proc)
            self.proc = None


# === the loads ===

class ToolCpu:
    """The CPU a load tool used (user and system time of the children this
    driver waited for, from getrusage): `t = ToolCpu()`, run the tool to
    its end, then `t.per(responses)`. On 2 shared cores the tool's own cost
    per response is part of what every rate here measures."""

    def __init__(self):
        self.before = resource.getrusage(resource.RUSAGE_CHILDREN)

    def per(self, responses):
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        n = max(responses, 1)
        return {"tool_user_us_per_response": (after.ru_utime - self.before.ru_utime) * 1e6 / n,
                "tool_sys_us_per_response": (after.ru_stime - self.before.ru_stime) * 1e6 / n}


def e2e(*args):
    out = subprocess.run([E2E, *map(str, args)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"e2e {args}: {out.stderr.strip()}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def e2e_flood(proxy, ds, conns, seconds):
    """The flood by our own tool, with the proxy's CPU (as wrk's) and the
    tool's own CPU per response."""
    meter = CpuMeter(proxy.pids(), seconds, os.path.join(WORK, "perf.txt"))
    tool = ToolCpu()
    r = e2e("flood", proxy.url + "/x", ds, conns, seconds)
    responses = round((r.get("refused_per_s", 0) + r.get("forwarded_per_s", 0)) * seconds)
    r.update(tool.per(responses))
    r.update(meter.per(round(r.get("refused_per_s", 0) * seconds)))
    return r


class Floor:
    """The C spinner, running beside a scenario for `seconds` (1 ms
    deadlines): the lateness a bare process sees under the same load."""

    def __init__(self, seconds):
        self.proc = start([FLOOR, str(int(seconds * 1000)), "1000"],
                          stdout=subprocess.PIPE, text=True)

    def result(self):
        out, _ = self.proc.communicate(timeout=60)
        started.remove(self.proc)
        return json.loads(out)


def parse_latency(text):
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    if not m:
        return None
    v, unit = float(m.group(1)), m.group(2)
    return v * {"us": 1, "ms": 1e3, "s": 1e6}[unit]


def wrk(proxy, conns, seconds, key=None, script=None, perf=False):
    """One wrk run; with perf, `perf stat` task-clock and /proc CPU of the
    proxy over the same span."""
    args = ["wrk", "-t2", f"-c{conns}", f"-d{seconds}s", "--latency"]
    if script:
        args += ["-s", script]
    if key:
        args += ["-H", f"X-Client: {key}"]
    args.append(proxy.url + "/x")
    meter = CpuMeter(proxy.pids(), seconds, os.path.join(WORK, "perf.txt")) if perf else None
    tool = ToolCpu()
    out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 30).stdout
    res = {"tool": "wrk", "connections": conns, "seconds": seconds}
    m = re.search(r"(\d+) requests in", out)
    res["requests"] = int(m.group(1)) if m else 0
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    res["requests_per_s"] = float(m.group(1)) if m else 0.0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non_2xx"] = int(m.group(1)) if m else 0
    for p in ("50", "99"):
        m = re.search(rf"^\s+{p}%\s+(\S+)", out, re.M)
        res[f"p{p}_us"] = parse_latency(m.group(1)) if m else None
    res.update(tool.per(res["requests"]))
    if meter:
        res.update(meter.per(res["requests"]))
    return res


def scenario(proxy, name, rate, capacity, run):
    proxy.start(rate, capacity)
    try:
        result = run()
        result["scenario"] = name
        record({"proxy": proxy.name, "rss_kib": rss_kib(proxy.pids()), "result": result})
    except Exception as e:  # one failed scenario must not lose the rest
        where = traceback.extract_tb(e.__traceback__)[-1]
        error = f"{type(e).__name__}: {e} (run.py line {where.lineno})"
        record({"proxy": proxy.name, "result": {"scenario": name, "error": error}})
    finally:
        proxy.stop()


def main():
    ds = free_port()
    downstream = start([E2E, "downstream", str(ds)])
    wait_port(ds)
    keys = os.path.join(HERE, "keys.lua")
    proxies = [Proxy("sluice", 2, ds), Proxy("nginx", 2, ds), Proxy("sluice", 1, ds), Proxy("nginx", 1, ds)]
    try:
        for p in proxies:
            scenario(p, "seed", 5, 10, lambda: e2e("seed", p.url + "/x", ds))
            for rate, n in ((100, 500), (1000, 5000)):
                def pacing(rate=rate, n=n):
                    d = e2e("direct", ds, rate, n)
                    f = Floor(n / rate)
                    r = e2e("pacing", p.url + "/x", ds, rate, n)
                    r["floor"] = f.result()
                    r["direct"] = d
                    return r
                scenario(p, f"pacing-{rate}", rate, n, pacing)

            def backlog():
                d = e2e("direct", ds, 1000, 5000)
                e2e("clear", ds)
                f = Floor(10)
                w = wrk(p, 32, 10, key="backlog")
                r = e2e("intervals", ds, 1000)
                r["wrk"] = w
                r["floor"] = f.result()
                r["direct"] = d
                return r
            scenario(p, "backlog-1000", 1000, 50, backlog)
            if p.workers != 2:
                scenario(p, "passthrough-wrk", 1000000, 1000000,
                         lambda: wrk(p, 16, 6, script=keys, perf=True))
            scenario(p, "passthrough-e2e", 1000000, 1000000,
                     lambda: e2e("passthrough", p.url + "/x", ds, 16, 5))
            if p.workers != 2:
                scenario(p, "flood-wrk", 1, 1, lambda: wrk(p, 64, 6, key="flood", perf=True))
                scenario(p, "flood-e2e", 1, 1, lambda: e2e_flood(p, ds, 64, 5))
            scenario(p, "many", 1, 1, lambda: e2e("many", p.url + "/x", ds, 10000))
        # The targets' wrk figures (2 workers each), and the flood by our
        # own tool beside them: ROUNDS rounds, the two proxies alternating
        # within each round and the order alternating between rounds, so
        # that both see the same moments of this VM (one run each moved the
        # ratios by 10-15 % between two runs an hour apart, and the own
        # tool's flood ratio by 0.74-1.38 x between rounds of one hour);
        # the table gives each proxy's median.
        pair = [p for p in proxies if p.workers == 2]
        for i in range(ROUNDS):
            for p in (pair if i % 2 == 0 else pair[::-1]):
                scenario(p, "passthrough-wrk", 1000000, 1000000,
                         lambda: wrk(p, 16, 6, script=keys, perf=True))
                scenario(p, "flood-wrk", 1, 1, lambda: wrk(p, 64, 6, key="flood", perf=True))
                scenario(p, "flood-e2e", 1, 1, lambda: e2e_flood(p, ds, 64, 5))
        # Baseline: the downstream alone, for the latency a proxy adds.
        direct = Proxy("direct", 0, ds)
        direct.url = f"http://127.0.0.1:{ds}"
        record({"proxy": "direct", "result": dict(wrk(direct, 16, 5, script=keys), scenario="passthrough-wrk")})
    finally:
        for p in list(started):
            stop(p)


if __name__ == "__main__":
    main()
