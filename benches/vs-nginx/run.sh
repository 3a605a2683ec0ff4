#!/usr/bin/env bash
# sluice vs nginx limit_req (burst, no nodelay), side by side on this
# machine, loopback only, in one run. Prints a markdown table with the
# machine, versions and ratios, writes it to benches/vs-nginx/results.md and
# into BENCHMARKS.md (between its vs-nginx markers). Every process it starts
# is ended by PID.
#
#   bash benches/vs-nginx/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update && apt-get install -y --no-install-recommends nginx-light || apt-get install -y --no-install-recommends nginx
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

cargo build --release --quiet
cargo build --release --quiet --bench e2e
E2E=$(ls -t target/release/deps/e2e-* | grep -v '\.d$' | head -1)
SLUICE=target/release/sluice

DIR=$(mktemp -d /tmp/sluice-vs-nginx.XXXXXX)
mkdir -p "$DIR/tmp"
PIDS=()
PROXY_PID=""
cleanup() {
  for p in "${PIDS[@]}" $PROXY_PID; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 did not open" >&2; return 1; }

DS=$(free_port)
"$E2E" downstream "$DS" & PIDS+=($!)
wait_port "$DS"

start_sluice() { # rate capacity
  local port; port=$(free_port)
  cat > "$DIR/sluice.toml" <<EOF
[server]
listen = ["127.0.0.1:$port"]
max_connections = 60000
[[upstream]]
name = "ds"
url = "http://127.0.0.1:$DS"
[[route]]
name = "r"
upstream = "ds"
key = "header:X-Client"
rate = "$1/s"
capacity = $2
[limits]
max_queued = 1000000
EOF
  "$SLUICE" --log-level error run --config "$DIR/sluice.toml" & PROXY_PID=$!
  wait_port "$port"; URL="http://127.0.0.1:$port"
}
start_nginx() { # rate burst
  local port; port=$(free_port)
  cat > "$DIR/nginx.conf" <<EOF
worker_processes 2;
worker_rlimit_nofile 200000;
pid $DIR/nginx.pid;
error_log $DIR/nginx-error.log error;
daemon off;
events { worker_connections 60000; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $DIR/tmp/body; proxy_temp_path $DIR/tmp/proxy;
  fastcgi_temp_path $DIR/tmp/fcgi; uwsgi_temp_path $DIR/tmp/uwsgi; scgi_temp_path $DIR/tmp/scgi;
  limit_req_zone \$http_x_client zone=z:64m rate=$1r/s;
  limit_req_status 429;
  upstream ds { server 127.0.0.1:$DS; keepalive 512; }
  server {
    listen 127.0.0.1:$port backlog=65535;
    location / {
      limit_req zone=z burst=$2;
      proxy_pass http://ds;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF
  "$NGINX" -c "$DIR/nginx.conf" -p "$DIR" & PROXY_PID=$!
  wait_port "$port"; URL="http://127.0.0.1:$port"
}
stop_proxy() { kill "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true; PROXY_PID=""; }
rss_kib() { # total RSS of a process and its children
  local total=0
  for p in $1 $(pgrep -P "$1" || true); do
    total=$((total + $(awk '/VmRSS/ {print $2}' /proc/"$p"/status 2>/dev/null || echo 0)))
  done
  echo "$total"
}

OUT="$DIR/results.jsonl"
run() { # proxy scenario rate capacity args...
  local proxy=$1 scenario=$2 rate=$3 cap=$4; shift 4
  if [ "$proxy" = sluice ]; then start_sluice "$rate" "$cap"; else start_nginx "$rate" "$cap"; fi
  local line
  line=$("$E2E" "$scenario" "$URL/x" "$DS" "$@")
  local rss; rss=$(rss_kib "$PROXY_PID")
  stop_proxy
  echo "{\"proxy\":\"$proxy\",\"rss_kib\":$rss,\"result\":$line}" | tee -a "$OUT"
}

for proxy in sluice nginx; do
  run "$proxy" seed 5 10
  run "$proxy" pacing 100 400 100 400
  run "$proxy" pacing 1000 3000 1000 3000
  run "$proxy" passthrough 1000000 1000000 16 5
  run "$proxy" flood 1 1 64 5
  run "$proxy" many 1 1 10000
done
# Baseline: the downstream alone, for the latency a proxy adds.
echo "{\"proxy\":\"direct\",\"rss_kib\":0,\"result\":$("$E2E" passthrough "http://127.0.0.1:$DS/x" "$DS" 16 5)}" | tee -a "$OUT"

python3 benches/vs-nginx/table.py "$OUT" "$($NGINX -v 2>&1)" "$(rustc -V)" | tee benches/vs-nginx/results.md
# Put the table into BENCHMARKS.md, between its vs-nginx markers.
python3 - <<'PY'
import re
doc = open("BENCHMARKS.md").read()
table = open("benches/vs-nginx/results.md").read()
begin = "<!-- vs-nginx:begin (written by benches/vs-nginx/run.sh) -->\n"
end = "<!-- vs-nginx:end -->"
if begin in doc and end in doc:
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    open("BENCHMARKS.md", "w").write(head + begin + table + end + tail)
    print("BENCHMARKS.md updated")
else:
    print("BENCHMARKS.md has no vs-nginx markers; table left in benches/vs-nginx/results.md")
PY
