#!/usr/bin/env bash
# The one run command (README): builds and starts a local GCS node.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-models.sh >/dev/null
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gcs/target}"
# One build shared with the test command (same profile, same feature set:
# dependencies and the engine at -O3), so running after testing rebuilds nothing.
cargo build --locked --workspace --all-targets
exec "$CARGO_TARGET_DIR/debug/gcs-node" --role all "$@"
