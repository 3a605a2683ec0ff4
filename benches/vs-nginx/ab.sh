#!/usr/bin/env bash
# Two sluice builds side by side on the pass-through load (wrk -t2 -c16,
# a new client key per request, 2 workers), one at a time, the order
# alternating every round: requests per second, p99, and user and system
# CPU per forwarded request from /proc/PID/stat. For a change whose
# effect is smaller than this machine's run-to-run spread.
#
#   bash benches/vs-nginx/ab.sh OLD_SLUICE NEW_SLUICE [ROUNDS]
#
# (Build the old one from a worktree: git worktree add /tmp/old REV &&
#  CARGO_TARGET_DIR=/tmp/old-target cargo build --release in it.)
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=$1 NEW=$2 ROUNDS=${3:-8}
command -v wrk >/dev/null 2>&1 || { echo "needs wrk" >&2; exit 1; }

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
cat >"$DIR/sluice.toml" <<EOF
[server]
listen = ["127.0.0.1:$LISTEN"]
workers = 2
[[upstream]]
name = "ds"
url = "http://127.0.0.1:$DS"
[[route]]
name = "r"
upstream = "ds"
key = "header:X-Client"
rate = "1000000/s"
capacity = 1000000
[limits]
max_queued = 1000000
EOF
LOAD=(-t2 -c16 -s benches/vs-nginx/keys.lua "http://127.0.0.1:$LISTEN/x")

echo "build round requests/s p99 user_us sys_us"
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
    timeout 10 wrk -d2 "${LOAD[@]}" >/dev/null
    read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$pid/stat")
    timeout 15 wrk -d5 --latency "${LOAD[@]}" >"$DIR/wrk.txt"
    read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$pid/stat")
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
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
  done
done
