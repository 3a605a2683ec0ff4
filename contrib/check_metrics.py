#!/usr/bin/env python3
"""Check that every metric the monitoring assets use is one sluice exports.

Collects the metric names in the Grafana dashboard's queries
(contrib/grafana/sluice-dashboard.json: every panel's targets[].expr, rows
included, and the template variables' queries) and in the alert rules'
`expr`s (contrib/prometheus/sluice-alerts.yml): names matching
`sluice_[a-z_]+`, with a `_bucket`, `_sum` or `_count` suffix stripped, plus
`up` when a rule uses it. Then reads a Prometheus text exposition (a
`/metrics` scrape) and checks that each sluice_* name appears in it, as a
`# TYPE <name>` line or a sample `<name>{...} v` / `<name> v`. `up` is
listed but not checked: Prometheus adds it when it scrapes.

    python3 contrib/check_metrics.py metrics.txt     # exit 0, or 1 listing what is missing
    curl -s 127.0.0.1:9090/metrics | python3 contrib/check_metrics.py -
    python3 contrib/check_metrics.py --list          # only print the names used

Exit status: 0 all present, 1 some missing, 2 usage or input error.
Standard library only (PyYAML is used for the rules when installed).
"""

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "sluice-dashboard.json"
RULES = HERE / "prometheus" / "sluice-alerts.yml"

NAME = re.compile(r"(?<![A-Za-z0-9_:])sluice_[a-z_]+")
UP = re.compile(r"(?<![A-Za-z0-9_:])up(?![A-Za-z0-9_:])")
SUFFIXES = ("_bucket", "_sum", "_count")
SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{|\s)")


def base(name):
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def dashboard_exprs(path):
    """Every query string in the dashboard: panel targets (nested rows too)
    and template variable queries."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    exprs = []

    def panels(items):
        for panel in items or []:
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    exprs.append(target["expr"])
            panels(panel.get("panels"))

    panels(doc.get("panels"))
    for var in (doc.get("templating") or {}).get("list") or []:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        for q in (query, var.get("definition")):
            if isinstance(q, str) and q:
                exprs.append(q)
    return exprs


def rules_exprs(path):
    """The `expr` of every rule, with PyYAML when present, else by a small
    reader of `expr:` keys (inline, or `|` / `>` block scalars)."""
    text = path.read_text(encoding="utf-8")
    try:
        import yaml  # type: ignore
    except ImportError:
        yaml = None
    if yaml is not None:
        doc = yaml.safe_load(text) or {}
        return [
            str(rule["expr"])
            for group in doc.get("groups") or []
            for rule in group.get("rules") or []
            if "expr" in rule
        ]
    exprs = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(?:-\s+)?expr:\s*(.*?)\s*$", lines[i])
        i += 1
        if not m:
            continue
        indent, value = len(m.group(1)), m.group(2)
        if value and value[0] not in "|>":
            exprs.append(value.strip("'\""))
            continue
        block = []
        while i < len(lines):
            line = lines[i]
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break
            block.append(line.strip())
            i += 1
        exprs.append("\n".join(block))
    return exprs


def strip_strings(expr):
    """Drop quoted label values, so `job="sluice_x"` is not read as a name."""
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)


def used_names(exprs):
    names, up = set(), False
    for expr in exprs:
        code = strip_strings(expr)
        names.update(base(n) for n in NAME.findall(code))
        up = up or bool(UP.search(code))
    return names, up


def exposed_names(text):
    names = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "TYPE":
                names.add(parts[2])
            continue
        m = SAMPLE.match(line)
        if m:
            names.add(m.group(1))
            names.add(base(m.group(1)))
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Check that every metric used by contrib's dashboard and alert rules "
        "appears in a Prometheus text exposition."
    )
    ap.add_argument("metrics", nargs="?", help="a /metrics scrape in Prometheus text format ('-': stdin)")
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD, help="default: %(default)s")
    ap.add_argument("--rules", type=Path, default=RULES, help="default: %(default)s")
    ap.add_argument("--list", action="store_true", help="only print the names used, check nothing")
    ap.add_argument(
        "--optional",
        action="append",
        default=[],
        metavar="NAME",
        help="report NAME if missing but do not fail on it (repeatable), e.g. cluster "
        "metrics on an instance without [cluster]",
    )
    args = ap.parse_args(argv)
    if not args.list and not args.metrics:
        ap.error("a metrics file is required (or --list)")

    try:
        exprs = dashboard_exprs(args.dashboard) + rules_exprs(args.rules)
    except (OSError, ValueError) as e:
        print(f"check_metrics: {e}", file=sys.stderr)
        return 2
    names, up = used_names(exprs)
    if not names:
        print("check_metrics: no sluice_* names found in the dashboard or rules", file=sys.stderr)
        return 2

    if args.list:
        for name in sorted(names):
            print(name)
        if up:
            print("up")
        return 0

    try:
        if args.metrics == "-":
            text = sys.stdin.read()
        else:
            text = Path(args.metrics).read_text(encoding="utf-8")
    except OSError as e:
        print(f"check_metrics: {e}", file=sys.stderr)
        return 2
    exposed = exposed_names(text)

    optional = set(args.optional)
    missing, tolerated = [], []
    print(f"checked {len(names)} metric names used by {args.dashboard.name} and {args.rules.name}:")
    for name in sorted(names):
        if name in exposed:
            status = "ok"
        elif name in optional:
            status = "MISSING (optional)"
            tolerated.append(name)
        else:
            status = "MISSING"
            missing.append(name)
        print(f"  {name:45} {status}")
    if up:
        print(f"  {'up':45} not checked (added by Prometheus at scrape time)")

    if missing:
        print(
            f"check_metrics: {len(missing)} metric(s) not in {args.metrics}: {', '.join(missing)}",
            file=sys.stderr,
        )
        return 1
    if tolerated:
        print(f"all required names present ({len(tolerated)} optional missing: {', '.join(tolerated)})")
    else:
        print("all present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
