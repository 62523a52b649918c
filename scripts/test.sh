#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what is missing, fetches the
# models, builds everything once in the test profile, runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-models.sh >/dev/null
# The OpenAI SDKs (Python, JavaScript) and nginx for the HTTP tests.
eval "$(bash scripts/test-deps.sh)"
# Keep the (large) target directory outside the clone so repeat runs, and
# fresh clones on the same machine, reuse it.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gcs/target}"
export CARGO_TERM_COLOR=never
# --all-targets: unit, integration, and benches run once in test mode (smoke).
cargo test --workspace --all-targets --locked
