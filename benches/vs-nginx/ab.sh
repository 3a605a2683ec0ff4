#!/usr/bin/env bash
# Two sluice builds side by side, one at a time, the order alternating
# every round. For a change whose effect is smaller than this machine's
# run-to-run spread.
#
#   bash benches/vs-nginx/ab.sh OLD_SLUICE NEW_SLUICE [ROUNDS] [MODE]
#
# MODE `passthrough` (the default): the pass-through load (wrk -t2 -c16,
# a new client key per request, 2 workers): requests per second, p99, and
# user and system CPU per forwarded request from /proc/PID/stat.
#
# MODE `burst`: departures during a burst of new connections, the
# vs-nginx `pacing` scenario at 1,000/s with N = 5,000 (one client key,
# capacity N, 2 workers): the load tool opens one connection per request,
# all at once, while the first requests already depart.
#
# MODE `pacing`: the same scenario at RATE (default 100/s) with N requests
# (default 500): bash ab.sh OLD NEW ROUNDS pacing RATE N.
#
# Both print, over the downstream's intervals after the first 10 (as
# `pacing` does): the p50, p90 and p99 deviation from 1/r in µs, the
# largest in ms, and how many deviate by more than 5 and 10 ms; then the
# p50 and p99 of the same intervals as the kernel stamped them on receipt
# (the sender's departures, without the downstream's wake-up).
#
# (Build the old one from a worktree: git worktree add /tmp/old REV &&
#  CARGO_TARGET_DIR=/tmp/old-target cargo build --release in it.)
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=$1 NEW=$2 ROUNDS=${3:-8} MODE=${4:-passthrough}
case $MODE in
  passthrough) command -v wrk >/dev/null 2>&1 || { echo "needs wrk" >&2; exit 1; } ;;
  burst) RATE=1000 N=5000 ;;
  pacing) RATE=${5:-100} N=${6:-500} ;;
  *) echo "MODE is passthrough, burst or pacing" >&2; exit 2 ;;
esac
if [ "$MODE" = pacing ] && ! { [ "$RATE" -gt 0 ] && [ "$N" -ge 20 ]; } 2>/dev/null; then
  echo "pacing needs RATE > 0 and N >= 20 (the first 10 intervals are skipped)" >&2
  exit 2
fi

cargo build --release --quiet --bench e2e
E2E=$(ls -t target/release/deps/e2e-* | grep -v '\.d$' | head -1)
DIR=$(mktemp -d /tmp/sluice-ab.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
DS=$(port)
LISTEN=$(port)
"$E2E" downstream "$DS" >"$DIR/ds.log" 2>&1 &
PIDS+=($!)
if [ "$MODE" != passthrough ]; then
  SHAPE="rate = \"$RATE/s\"
capacity = $N"
else
  SHAPE='rate = "1000000/s"
capacity = 1000000'
fi
cat >"$DIR/sluice.toml" <<EOF
[server]
listen = ["127.0.0.1:$LISTEN"]
max_connections = 60000
workers = 2
[[upstream]]
name = "ds"
url = "http://127.0.0.1:$DS"
[[route]]
name = "r"
upstream = "ds"
key = "header:X-Client"
$SHAPE
[limits]
max_queued = 1000000
EOF
LOAD=(-t2 -c16 -s benches/vs-nginx/keys.lua "http://127.0.0.1:$LISTEN/x")

# One round of the pass-through load against the sluice at PID.
passthrough() {
  local which=$1 round=$2 pid=$3
  timeout 10 wrk -d2 "${LOAD[@]}" >/dev/null
  read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$pid/stat")
  timeout 15 wrk -d5 --latency "${LOAD[@]}" >"$DIR/wrk.txt"
  read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$pid/stat")
  python3 - "$which" "$round" "$u0" "$s0" "$u1" "$s1" "$(getconf CLK_TCK)" "$DIR/wrk.txt" <<'EOF'
import re, sys
which, rnd, u0, s0, u1, s1, hz, path = sys.argv[1:]
out = open(path).read()
req = int(re.search(r"(\d+) requests in", out).group(1))
rps = re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)
p99 = re.search(r"\s99%\s+(\S+)", out).group(1)
us = lambda a, b: (int(b) - int(a)) * 1e6 / int(hz) / req
print(f"{which} {rnd} {float(rps):.0f} {p99} {us(u0, u1):.2f} {us(s0, s1):.2f}")
EOF
}

# One round of the pacing scenario, its arrivals read back.
paced() {
  local which=$1 round=$2
  rm -f "$DIR/times.txt"
  E2E_DUMP="$DIR/times.txt" timeout 60 "$E2E" pacing "http://127.0.0.1:$LISTEN/x" "$DS" "$RATE" "$N" >/dev/null
  python3 - "$which" "$round" "$RATE" "$DIR/times.txt" <<'EOF'
import sys
which, rnd, rate, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rows = [[int(x) for x in l.split()] for l in open(path) if l.strip()]
period = 1_000_000 / rate
def devs(t):
    return sorted(abs((b - a) - period) for a, b in list(zip(t, t[1:]))[10:])
dev = devs(sorted(r[0] for r in rows))
over = lambda ms: sum(1 for d in dev if d > ms * 1000)
pct = lambda d, p: d[int(len(d) * p)]
kernel = sorted(r[1] for r in rows)
k = devs(kernel) if kernel[0] > 0 else None
ks = f"{pct(k, 0.5):.0f} {pct(k, 0.99):.0f}" if k else "n/a n/a"
print(f"{which} {rnd} {pct(dev, 0.5):.0f} {pct(dev, 0.9):.0f} {pct(dev, 0.99):.0f} {dev[-1] / 1000:.1f} {over(5)} {over(10)} {ks}")
EOF
}

if [ "$MODE" != passthrough ]; then
  echo "build round p50_us p90_us p99_us max_ms over_5ms over_10ms kernel_p50_us kernel_p99_us"
else
  echo "build round requests/s p99 user_us sys_us"
fi
for round in $(seq 1 "$ROUNDS"); do
  if ((round % 2)); then order="old new"; else order="new old"; fi
  for which in $order; do
    if [ "$which" = old ]; then bin=$OLD; else bin=$NEW; fi
    "$bin" --log-level error run --config "$DIR/sluice.toml" >"$DIR/sluice.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 50); do
      (exec 3<>"/dev/tcp/127.0.0.1/$LISTEN") 2>/dev/null && break
      sleep 0.1
    done
    if [ "$MODE" != passthrough ]; then
      paced "$which" "$round"
    else
      passthrough "$which" "$round" "$pid"
    fi
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
