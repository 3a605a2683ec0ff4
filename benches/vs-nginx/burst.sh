#!/usr/bin/env bash
# Departures during a burst of new connections: two sluice builds side by
# side, one at a time, the order alternating every round. Each round is
# the vs-nginx `pacing` scenario at 1,000/s with N = 5,000 (one client key,
# capacity N, 2 workers): the load tool opens one connection per request,
# all at once, while the first requests already depart. Printed per build
# and round: the largest deviation of a downstream interval from 1/r
# (after the first 10, as `pacing` does), how many deviate by more than
# 5 and 10 ms, and the p99.
#
#   bash benches/vs-nginx/burst.sh OLD_SLUICE NEW_SLUICE [ROUNDS]
#
# (Build the old one from a worktree, as for ab.sh.)
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=$1 NEW=$2 ROUNDS=${3:-4}
RATE=1000 N=5000

cargo build --release --quiet --bench e2e
E2E=$(ls -t target/release/deps/e2e-* | grep -v '\.d$' | head -1)
DIR=$(mktemp -d /tmp/sluice-burst.XXXXXX)
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
cat >"$DIR/sluice.toml" <<CONF
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
rate = "$RATE/s"
capacity = $N
[limits]
max_queued = 1000000
CONF

echo "build round max_ms over_5ms over_10ms p99_us"
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
    rm -f "$DIR/times.txt"
    E2E_DUMP="$DIR/times.txt" timeout 60 "$E2E" pacing "http://127.0.0.1:$LISTEN/x" "$DS" "$RATE" "$N" >/dev/null
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
    python3 - "$which" "$round" "$RATE" "$DIR/times.txt" <<'PY'
import sys
which, rnd, rate, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t = [int(x) for x in open(path).read().split()]
period = 1_000_000 / rate
dev = sorted(abs((b - a) - period) for a, b in list(zip(t, t[1:]))[10:])
over = lambda ms: sum(1 for d in dev if d > ms * 1000)
print(f"{which} {rnd} {dev[-1] / 1000:.1f} {over(5)} {over(10)} {dev[int(len(dev) * 0.99)]:.0f}")
PY
  done
done
