#!/usr/bin/env bash
# gRPC unary calls through sluice (`protocol = "h2c"`) beside nginx
# `grpc_pass`, in one run on this machine, loopback only: h2load (nghttp2)
# drives both in front of the same gRPC downstream; perf stat gives the CPU
# per call. Prints a markdown table and writes it to
# benches/grpc/results.md and into BENCHMARKS.md (between its grpc
# markers). Under a minute.
#
#   bash benches/grpc/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
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
OUT=$(mktemp -d /tmp/sluice-grpc-bench-out.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
cc -O2 -o "$OUT/floor" benches/vs-nginx/floor.c

python3 benches/grpc/run.py "$E2E" target/release/sluice "$NGINX" "$OUT/floor" "$OUT" \
  "$($NGINX -v 2>&1)" "$(h2load --version | head -1)" | tee benches/grpc/results.md
python3 benches/markers.py grpc benches/grpc/results.md
