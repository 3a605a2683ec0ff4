#!/usr/bin/env bash
# Memory per held request, sluice beside nginx `limit_req` in one run on
# this machine, loopback only: resident memory while 8,000 HTTP/1.1
# requests (one connection each) and then 100,000 HTTP/2 streams (h2load,
# 800 connections x 125) are held in the queue, and 20 s after the clients
# left. Prints a markdown table, writes it to benches/memory/results.md and
# into BENCHMARKS.md (between its memory markers). About 5 minutes.
#
#   bash benches/memory/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update && apt-get install -y --no-install-recommends "${need[@]}"
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

cargo build --release --quiet
cargo build --release --quiet --bench e2e
E2E=$(ls -t target/release/deps/e2e-* | grep -v '\.d$' | head -1)
python3 benches/memory/run.py "$E2E" target/release/sluice "$NGINX" "$($NGINX -v 2>&1)" \
  | tee benches/memory/results.md
python3 benches/markers.py memory benches/memory/results.md
