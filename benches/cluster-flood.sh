#!/usr/bin/env bash
# One client flooding one sluice instance in cluster mode (Redis on
# loopback), beside the same instance without a store, one at a time, the
# order alternating every round; with OLD_SLUICE, a third build in
# cluster mode beside them.
#
#   bash benches/cluster-flood.sh NEW_SLUICE [OLD_SLUICE] [ROUNDS]
#
# Load: wrk -t2 -c64 -d5s on one client key (route 1/s, capacity 1, 2
# workers, on_failure = "reject"): every request but about one a second
# is refused. Prints 429s per second, the proxy's CPU per request (user +
# system from /proc/PID/stat), and the store calls it made
# (sluice_cluster_calls_total). Needs wrk, redis-server, redis-cli, curl
# and python3 (the downstream, which sees a request a second).
set -euo pipefail
NEW=$1 OLD=${2:-} ROUNDS=${3:-3}
for tool in wrk redis-server curl python3; do
  command -v $tool >/dev/null 2>&1 || { echo "needs $tool" >&2; exit 1; }
done
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
RP=$(port) DP=$(port)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no >"$dir/redis.log" 2>&1 &
pids+=($!)
python3 -m http.server "$DP" --bind 127.0.0.1 >"$dir/ds.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.1; done
ticks=$(getconf CLK_TCK)
echo "cluster flood, $(date -u '+%F %H:%M') UTC; one client, wrk -t2 -c64 -d5s, 2 workers"
runs="local:$NEW cluster:$NEW"
[ -n "$OLD" ] && runs="$runs cluster-old:$OLD"
for round in $(seq "$ROUNDS"); do
  list=$runs
  [ $((round % 2)) = 0 ] && list=$(echo "$runs" | tr ' ' '\n' | tac | tr '\n' ' ')
  for run in $list; do
    mode=${run%%:*} bin=${run#*:}
    pp=$(port) ap=$(port)
    store=""
    [ "$mode" != local ] && store=$(printf '[cluster]\nredis = "redis://127.0.0.1:%s"\non_failure = "reject"\nkey_prefix = "f%s%s:"\n' "$RP" "$round" "$mode")
    cat >"$dir/sluice.toml" <<CFG
[server]
listen = ["127.0.0.1:$pp"]
workers = 2

[admin]
listen = "127.0.0.1:$ap"

$store

[[upstream]]
name = "api"
url = "http://127.0.0.1:$DP"

[[route]]
name = "default"
upstream = "api"
key = "header:X-Client"
rate = "1/s"
capacity = 1
CFG
    "$bin" run --config "$dir/sluice.toml" >"$dir/sluice.log" 2>&1 &
    s=$!
    pids+=($s)
    for _ in $(seq 100); do curl -sf "127.0.0.1:$ap/readyz" >/dev/null && break; sleep 0.05; done
    cpu0=$(awk '{print $14 + $15}' "/proc/$s/stat")
    out=$(timeout 30 wrk -t2 -c64 -d5s -H "X-Client: flood" "http://127.0.0.1:$pp/" 2>&1)
    cpu1=$(awk '{print $14 + $15}' "/proc/$s/stat")
    calls=$(curl -s "127.0.0.1:$ap/metrics" | awk '/^sluice_cluster_calls_total/ {n += $2} END {print n + 0}')
    kill "$s"
    wait "$s" 2>/dev/null || true
    echo "$out" | awk -v mode="$mode" -v round="$round" -v cpu=$((cpu1 - cpu0)) -v hz="$ticks" -v calls="$calls" '
      /requests in/ {n = $1; secs = $4 + 0}
      /Non-2xx/ {refused = $5}
      END {
        printf "round %d %-12s %8.0f 429/s  %5.1f us CPU per request  %7d store calls for %d requests\n",
          round, mode, refused / secs, cpu / hz * 1e6 / n, calls, n
      }'
  done
done
