#!/usr/bin/env bash
# sluice vs nginx limit_req (burst, no nodelay), side by side on this
# machine, loopback only, in one run: wrk and our own load tool, the C
# spinner's scheduling floor, perf stat CPU per request. Writes the table
# to benches/vs-nginx/results.md and into BENCHMARKS.md (between its
# vs-nginx markers). About 9 minutes.
#
#   bash benches/vs-nginx/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v perf >/dev/null 2>&1 || need+=(linux-perf)
command -v cc >/dev/null 2>&1 || need+=(gcc)
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update && apt-get install -y --no-install-recommends "${need[@]}"
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

cargo build --release --quiet
cargo build --release --quiet --bench e2e
E2E=$(ls -t target/release/deps/e2e-* | grep -v '\.d$' | head -1)
OUT=$(mktemp -d /tmp/sluice-vs-nginx-out.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
cc -O2 -o "$OUT/floor" benches/vs-nginx/floor.c

python3 benches/vs-nginx/run.py "$E2E" target/release/sluice "$NGINX" "$OUT/floor" "$OUT"
python3 benches/vs-nginx/table.py "$OUT/results.jsonl" "$($NGINX -v 2>&1)" "$(rustc -V)" | tee benches/vs-nginx/results.md
python3 benches/markers.py vs-nginx benches/vs-nginx/results.md
