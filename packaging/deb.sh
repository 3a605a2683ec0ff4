#!/usr/bin/env bash
# Build the Debian package: the release binary, then the man page and shell
# completions generated from it (so they match its --help), then
# `cargo deb --no-build` with the metadata in Cargo.toml. Prints the .deb's
# path last. Needs cargo-deb (`cargo install cargo-deb --locked`).
#
#   bash packaging/deb.sh && sudo dpkg -i target/debian/sluice_*.deb
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --locked
rm -rf target/deb-assets
mkdir -p target/deb-assets
bin="${CARGO_TARGET_DIR:-target}/release/sluice"
"$bin" man > target/deb-assets/sluice.1
for shell in bash zsh fish; do
  "$bin" completions "$shell" > "target/deb-assets/sluice.$shell"
done
cargo deb --no-build --strip --output target/debian/ | tail -1
