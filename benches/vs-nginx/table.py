"""Format the JSON lines of benches/vs-nginx/run.py as markdown: the machine,
one table per worker count (sluice and nginx with the same number of
workers, side by side, with ratios), the scheduling floor measured beside
each pacing scenario and the end-to-end floor (no proxy) just before it,
and the DESIGN section 6 targets checked against the 2-worker run (nginx's
configuration in the issue that set them)."""
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
nginx_version, rustc_version = sys.argv[2], sys.argv[3]


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def res(proxy, scenario):
    """The proxy's result for the scenario; for one run in rounds, each
    number the median over its rounds (and `rounds`, how many)."""
    matching = [r for r in rows if r["proxy"] == proxy and r["result"].get("scenario") == scenario]
    found = [r for r in matching if "error" not in r["result"]]
    if len(found) <= 1:
        return matching[0] if matching else None
    result = dict(found[0]["result"])
    for k, v in found[0]["result"].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vs = [r["result"].get(k) for r in found]
            if all(isinstance(x, (int, float)) for x in vs):
                result[k] = median(vs)
    result["rounds"] = len(found)
    return {"proxy": proxy, "rss_kib": median([r.get("rss_kib", 0) for r in found]), "result": result}


def get(proxy, scenario, *path):
    r = res(proxy, scenario)
    v = r if r is None else r["result"]
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v


def show(v, fmt):
    if v is None:
        return "n/a"
    return fmt.format(v) if isinstance(v, (int, float)) else str(v)


def ratio(a, b):
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
        return "n/a"
    return f"{a / b:.2f}"


METRICS = [
    # (label, scenario, path, format, better)
    ("seed: admitted (of 20; the rules say 13)", "seed", ("admitted_count",), "{}", "equal"),
    ("seed: smallest / largest downstream gap, ms (1/r = 200)", "seed", ("gaps",), "{}", "closer to 200"),
]
for rate in (100, 1000):
    sc = f"pacing-{rate}"
    METRICS += [
        (f"pacing {rate}/s, full queue (e2e): p50 abs(interval - 1/r), µs", sc, ("p50_us",), "{}", "lower"),
        (f"pacing {rate}/s, full queue (e2e): p99, µs", sc, ("p99_us",), "{}", "lower"),
        (f"pacing {rate}/s, full queue (e2e): max, µs", sc, ("max_us",), "{}", "lower"),
        (f"pacing {rate}/s, full queue (e2e): mean interval error, %", sc, ("mean_error_pct",), "{:+.3f}", "closer to 0"),
        (f"  same, stamped by the kernel on receipt (the departures, without the downstream's wake-up): p50 / p99, µs", sc, ("kernel_p",), "{}", "lower"),
        (f"  floor (C spinner, beside it): p50 / p99 lateness, µs", sc, ("floor_p",), "{}", ""),
        (f"  end-to-end floor (no proxy, a spinning sender, just before): p50 / p99, µs", sc, ("direct_p",), "{}", ""),
        (f"  end-to-end floor, stamped by the kernel: p50 / p99, µs", sc, ("direct_kernel_p",), "{}", ""),
    ]
METRICS += [
    ("pacing 1000/s, backlog b=50 under wrk -c32 (10 s): p50 abs(interval - 1/r), µs", "backlog-1000", ("p50_us",), "{}", "lower"),
    ("  same: p99, µs", "backlog-1000", ("p99_us",), "{}", "lower"),
    ("  same: mean interval error, %", "backlog-1000", ("mean_error_pct",), "{:+.3f}", "closer to 0"),
    ("  same, stamped by the kernel on receipt: p50 / p99, µs", "backlog-1000", ("kernel_p",), "{}", "lower"),
    ("  floor (C spinner, beside it): p50 / p99 lateness, µs", "backlog-1000", ("floor_p",), "{}", ""),
    ("  end-to-end floor (no proxy, a spinning sender, just before): p50 / p99, µs", "backlog-1000", ("direct_p",), "{}", ""),
    ("  end-to-end floor, stamped by the kernel: p50 / p99, µs", "backlog-1000", ("direct_kernel_p",), "{}", ""),
    ("idle pass-through, wrk -c16, requests/s", "passthrough-wrk", ("requests_per_s",), "{:.0f}", "higher"),
    ("  same: p50 latency, µs", "passthrough-wrk", ("p50_us",), "{:.0f}", "lower"),
    ("  same: p99 latency, µs", "passthrough-wrk", ("p99_us",), "{:.0f}", "lower"),
    ("  same: CPU per request (perf stat task-clock), µs", "passthrough-wrk", ("cpu_us_per_request",), "{:.1f}", "lower"),
    ("  same: user / system CPU per request, µs", "passthrough-wrk", ("user_sys",), "{}", "lower"),
    ("  same: context switches per request", "passthrough-wrk", ("context_switches_per_request",), "{:.2f}", "lower"),
    ("idle pass-through, own tool, 16 connections, requests/s", "passthrough-e2e", ("requests_per_s",), "{:.0f}", "higher"),
    ("  same: p99 latency, µs", "passthrough-e2e", ("p99_us",), "{}", "lower"),
    ("64-connection flood on one key, wrk: 429s per second", "flood-wrk", ("requests_per_s",), "{:.0f}", "higher"),
    ("  same: CPU per refusal, µs", "flood-wrk", ("cpu_us_per_request",), "{:.1f}", "lower"),
    ("  same: wrk's own user / system CPU per response, µs", "flood-wrk", ("tool_cpu",), "{}", ""),
    ("64-connection flood on one key, own tool: 429s per second", "flood-e2e", ("refused_per_s",), "{:.0f}", "higher"),
    ("  same: CPU per refusal, µs", "flood-e2e", ("cpu_us_per_request",), "{:.1f}", "lower"),
    ("  same: the own tool's user / system CPU per response, µs", "flood-e2e", ("tool_cpu",), "{}", ""),
    ("10,000 clients x 2 at once: answered 200", "many", ("ok",), "{}", "equal"),
    ("10,000 clients x 2 at once: seconds until all answered", "many", ("seconds",), "{:.2f}", "lower"),
    ("10,000 clients: proxy resident memory after, MiB", "many", ("rss_mib",), "{:.1f}", "lower"),
]


def derived(proxy, scenario, key):
    r = res(proxy, scenario)
    if r is None or "error" in r["result"]:
        return None
    x = r["result"]
    if key == "gaps":
        lo, hi = x.get("gap_min_ms"), x.get("gap_max_ms")
        return None if lo is None else f"{lo:.1f} / {hi:.1f}"
    if key == "floor_p":
        f = x.get("floor") or {}
        return None if not f else f"{f['p50_us']:.1f} / {f['p99_us']:.1f}"
    if key == "direct_p":
        f = x.get("direct") or {}
        return None if not f else f"{f['p50_us']} / {f['p99_us']}"
    if key == "kernel_p":
        k = x.get("kernel") or {}
        return None if not k else f"{k['p50_us']} / {k['p99_us']}"
    if key == "direct_kernel_p":
        k = (x.get("direct") or {}).get("kernel") or {}
        return None if not k else f"{k['p50_us']} / {k['p99_us']}"
    if key == "user_sys":
        u, s = x.get("user_us_per_request"), x.get("sys_us_per_request")
        return None if u is None else f"{u:.1f} / {s:.1f}"
    if key == "tool_cpu":
        u, s = x.get("tool_user_us_per_response"), x.get("tool_sys_us_per_response")
        return None if u is None else f"{u:.1f} / {s:.1f}"
    if key == "rss_mib":
        return r.get("rss_kib", 0) / 1024
    if scenario == "flood-wrk" and key == "requests_per_s":
        return x.get("non_2xx", 0) / max(x.get("seconds", 1), 1)
    return x.get(key)


def table(workers):
    s, n = f"sluice-{workers}w", f"nginx-{workers}w"
    out = [f"| metric | sluice, {workers} worker{'s' * (workers > 1)} | nginx, {workers} worker{'s' * (workers > 1)} | sluice/nginx | better |",
           "|---|---|---|---|---|"]
    for label, scenario, path, fmt, better in METRICS:
        a, b = derived(s, scenario, path[0]), derived(n, scenario, path[0])
        out.append(f"| {label} | {show(a, fmt)} | {show(b, fmt)} | {ratio(a, b)} | {better} |")
    return "\n".join(out)


def check(label, ok, measured):
    verdict = "n/a" if ok is None else ("met" if ok else "**missed**")
    return f"| {label} | {measured} | {verdict} |"


def targets():
    s, n = "sluice-2w", "nginx-2w"
    d = lambda p, sc, k: derived(p, sc, k)
    out = ["| target (issue 10 / DESIGN 6), 2 workers each | measured | verdict |", "|---|---|---|"]
    rs, rn = d(s, "passthrough-wrk", "requests_per_s"), d(n, "passthrough-wrk", "requests_per_s")
    out.append(check("idle pass-through req/s >= 1.2 x nginx (wrk)", None if None in (rs, rn) else rs >= 1.2 * rn, f"{ratio(rs, rn)} x"))
    ps, pn = d(s, "passthrough-wrk", "p99_us"), d(n, "passthrough-wrk", "p99_us")
    out.append(check("pass-through p99 <= nginx's (wrk)", None if None in (ps, pn) else ps <= pn, f"{show(ps, '{:.0f}')} vs {show(pn, '{:.0f}')} µs"))
    cs, cn = d(s, "passthrough-wrk", "cpu_us_per_request"), d(n, "passthrough-wrk", "cpu_us_per_request")
    out.append(check("CPU per forwarded request <= nginx's", None if None in (cs, cn) else cs <= cn, f"{show(cs, '{:.1f}')} vs {show(cn, '{:.1f}')} µs"))
    fs, fn = d(s, "flood-wrk", "requests_per_s"), d(n, "flood-wrk", "requests_per_s")
    out.append(check("429/s under the 64-connection flood >= 1.5 x nginx (wrk)", None if None in (fs, fn) else fs >= 1.5 * fn, f"{ratio(fs, fn)} x"))
    for sc, label in (("pacing-100", "100/s"), ("pacing-1000", "1,000/s"), ("backlog-1000", "1,000/s under wrk")):
        p50 = d(s, sc, "p50_us")
        e2e_floor = (get(s, sc, "direct") or {}).get("p50_us")
        out.append(check(f"pacing {label}: p50 abs(interval - 1/r) <= 20 µs", None if p50 is None else p50 <= 20,
                         f"{show(p50, '{}')} µs (end-to-end floor {show(e2e_floor, '{}')} µs)"))
        p99, p99n = d(s, sc, "p99_us"), d(n, sc, "p99_us")
        f = (get(s, sc, "floor") or {}).get("p99_us")
        ok = None if None in (p99, p99n, f) else (p99 <= p99n and p99 <= 1.5 * max(f, 1.0))
        out.append(check(f"pacing {label}: p99 <= nginx's and <= 1.5 x floor p99", ok,
                         f"{show(p99, '{}')} µs; nginx {show(p99n, '{}')} µs; floor p99 {show(f, '{:.1f}')} µs"))
        k, kn = (get(s, sc, "kernel") or {}).get("p99_us"), (get(n, sc, "kernel") or {}).get("p99_us")
        ok = None if None in (k, kn, f) else (k <= kn and k <= 1.5 * max(f, 1.0))
        out.append(check(f"  the same p99 as the kernel stamped the arrivals (for reference)", ok,
                         f"{show(k, '{}')} µs; nginx {show(kn, '{}')} µs"))
        me = d(s, sc, "mean_error_pct")
        out.append(check(f"pacing {label}: mean interval within 0.5 % of 1/r", None if me is None else abs(me) <= 0.5, show(me, "{:+.3f} %")))
    return "\n".join(out)


cpu = "unknown"
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except (OSError, StopIteration):
    pass
nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print(f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {nproc} cores ({cpu}), Linux {platform.release()}, "
      f"{nginx_version}, {rustc_version}, wrk 4.1; everything on loopback, proxy, load generator and downstream sharing the cores.")
print()
rounds = get("sluice-2w", "passthrough-wrk", "rounds")
print("Targets, checked against this run" + (
    f" (the wrk pass-through and flood figures with 2 workers: each proxy's median of {rounds} interleaved rounds):"
    if rounds else ":"))
print()
print(targets())
print()
print("Both proxies with 2 workers (nginx `worker_processes 2`, sluice `workers = 2`, the default on this machine):")
print()
print(table(2))
if rounds:
    def each(proxy, scenario, key, fmt):
        found = [r["result"] for r in rows if r["proxy"] == proxy and r["result"].get("scenario") == scenario
                 and "error" not in r["result"]]
        if scenario == "flood-wrk" and key == "requests_per_s":
            vals = [x.get("non_2xx", 0) / max(x.get("seconds", 1), 1) for x in found]
        elif key == "tool_total":
            vals = [x["tool_user_us_per_response"] + x["tool_sys_us_per_response"]
                    if "tool_user_us_per_response" in x else None for x in found]
        else:
            vals = [x.get(key) for x in found]
        return " / ".join(show(v, fmt) for v in vals)
    print()
    print("The rounds behind the medians (2 workers, in the order run):")
    print()
    print("| round values | sluice | nginx |")
    print("|---|---|---|")
    for label, sc, key, fmt in (("pass-through requests/s", "passthrough-wrk", "requests_per_s", "{:.0f}"),
                                ("pass-through p99, µs", "passthrough-wrk", "p99_us", "{:.0f}"),
                                ("pass-through CPU per request, µs", "passthrough-wrk", "cpu_us_per_request", "{:.1f}"),
                                ("flood 429s per second", "flood-wrk", "requests_per_s", "{:.0f}"),
                                ("flood CPU per refusal, µs", "flood-wrk", "cpu_us_per_request", "{:.1f}"),
                                ("  wrk's own CPU per response (user + system), µs", "flood-wrk", "tool_total", "{:.1f}"),
                                ("flood by our own tool, 429s per second", "flood-e2e", "refused_per_s", "{:.0f}"),
                                ("  its CPU per refusal, µs", "flood-e2e", "cpu_us_per_request", "{:.1f}"),
                                ("  the tool's own CPU per response (user + system), µs", "flood-e2e", "tool_total", "{:.1f}")):
        print(f"| {label} | {each('sluice-2w', sc, key, fmt)} | {each('nginx-2w', sc, key, fmt)} |")
print()
print("Both with 1 worker:")
print()
print(table(1))
d = res("direct", "passthrough-wrk")
if d:
    r = d["result"]
    print()
    print(f"Downstream alone (no proxy), same wrk load: {r['requests_per_s']:.0f} requests/s, p50 {r['p50_us']:.0f} µs, p99 {r['p99_us']:.0f} µs.")
errors = [r for r in rows if "error" in r["result"]]
for r in errors:
    print(f"\nScenario {r['result']['scenario']} failed for {r['proxy']}: {r['result']['error']}")
print()
print("Reproduce: `bash benches/vs-nginx/run.sh` (installs nginx, wrk and perf if missing; about 9 minutes).")
