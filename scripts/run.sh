#!/usr/bin/env bash
# The one run command (README): builds and starts a local GCS node.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-models.sh >/dev/null
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gcs/target}"
# The dev profile builds dependencies at -O3 and shares the test build.
exec cargo run --locked -p gcs-node --bin gcs-node -- --role all "$@"
