#!/usr/bin/env bash
# SMTP relay: sluice's pacing precision at the upstream (1/s, 10/s, 100/s),
# Postfix's default_destination_rate_delay beside it, messages per second
# with pacing off (sluice vs direct vs Postfix), and the README's Postfix
# relayhost recipe checked end to end (none lost, none duplicated). One run,
# loopback only, about 2 minutes. Needs root for the private Postfix
# instance (skipped otherwise).
#
#   bash benches/smtp/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
command -v postfix >/dev/null 2>&1 || [ -x /usr/sbin/postfix ] || need+=(postfix)
command -v cc >/dev/null 2>&1 || need+=(gcc)
/usr/bin/python3 -c 'import aiosmtpd' >/dev/null 2>&1 || need+=(python3-aiosmtpd)
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  # "Local only": Postfix listens on loopback; the bench runs its own instance.
  echo "postfix postfix/main_mailer_type select Local only" | debconf-set-selections
  apt-get update && apt-get install -y --no-install-recommends "${need[@]}"
fi
export PATH="$PATH:/usr/sbin"

cargo build --release --quiet
OUT=$(mktemp -d /tmp/sluice-smtp-bench-out.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
cc -O2 -o "$OUT/floor" benches/vs-nginx/floor.c
/usr/bin/python3 benches/smtp/run.py target/release/sluice "$OUT/floor" "$OUT"
echo "results: $OUT/results.jsonl"
