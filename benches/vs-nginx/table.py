"""Format the JSON lines of benches/vs-nginx/run.sh as a markdown table
with sluice/nginx ratios."""
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
nginx_version, rustc_version = sys.argv[2], sys.argv[3]


def find(proxy, scenario, **match):
    for r in rows:
        res = r["result"]
        if r["proxy"] == proxy and res["scenario"] == scenario and all(res.get(k) == v for k, v in match.items()):
            return r
    return None


def ratio(a, b):
    if a is None or b in (None, 0):
        return "n/a"
    return f"{a / b:.2f}"


lines = []
def metric(name, scenario, key, better, fmt="{:.1f}", **match):
    s, n = find("sluice", scenario, **match), find("nginx", scenario, **match)
    sv = s["result"].get(key) if s else None
    nv = n["result"].get(key) if n else None
    show = lambda v: "n/a" if v is None else (fmt.format(v) if isinstance(v, (int, float)) else str(v))
    lines.append(f"| {name} | {show(sv)} | {show(nv)} | {ratio(sv, nv)} | {better} |")


metric("seed: admitted (of 20; the rules say 13)", "seed", "admitted_count", "equal", fmt="{}")
metric("seed: smallest downstream gap, ms (1/r = 200)", "seed", "gap_min_ms", "closer to 200")
metric("seed: largest downstream gap, ms", "seed", "gap_max_ms", "closer to 200")
for rate in (100, 1000):
    for key, label in (("p50_us", "p50"), ("p99_us", "p99"), ("max_us", "max")):
        metric(f"pacing at {rate}/s, full queue: {label} abs(interval - 1/r), µs", "pacing", key, "lower", fmt="{}", rate=rate)
metric("pass-through, 16 connections: requests/s", "passthrough", "requests_per_s", "higher", fmt="{:.0f}")
metric("pass-through: p50 latency, µs", "passthrough", "p50_us", "lower", fmt="{}")
metric("pass-through: p99 latency, µs", "passthrough", "p99_us", "lower", fmt="{}")
metric("64-connection flood on one key: 429s per second", "flood", "refused_per_s", "higher", fmt="{:.0f}")
metric("10,000 clients x 2 at once: answered 200", "many", "ok", "equal", fmt="{}")
metric("10,000 clients x 2 at once: seconds until all answered", "many", "seconds", "lower", fmt="{:.2f}")
s, n = find("sluice", "many"), find("nginx", "many")
if s and n:
    lines.append(f"| 10,000 clients: proxy resident memory after, MiB | {s['rss_kib']/1024:.1f} | {n['rss_kib']/1024:.1f} | {ratio(s['rss_kib'], n['rss_kib'])} | lower |")
d = find("direct", "passthrough")

cpu = "unknown"
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except (OSError, StopIteration):
    pass
nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print(f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {nproc} cores ({cpu}), Linux {platform.release()}, "
      f"{nginx_version}, {rustc_version}; everything on loopback, proxy, load generator and downstream sharing the cores.")
print()
print("| metric | sluice | nginx | sluice/nginx | better |")
print("|---|---|---|---|---|")
print("\n".join(lines))
if d:
    r = d["result"]
    print()
    print(f"Downstream alone (no proxy), same load: {r['requests_per_s']:.0f} requests/s, p50 {r['p50_us']} µs, p99 {r['p99_us']} µs.")
print()
print("Reproduce: `bash benches/vs-nginx/run.sh` (installs Debian's nginx if missing; about 2 minutes).")
