#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what is missing, fetches the
# models, builds everything once in the test profile, runs every test. With
# CI=true (CI services set it) a test whose prerequisite is missing fails
# and names it instead of saying SKIP (tests/support/prereq.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# What the tests use (the OpenAI SDKs, nginx, Chromium, curl, openssl,
# libfaketime, ...). Captured first, so that a failing install stops here
# (`eval "$(...)"` would run an empty string and carry on).
deps_env=$(bash scripts/test-deps.sh)
eval "$deps_env"
bash scripts/fetch-models.sh >/dev/null
# llama.cpp's intermediate tensors for node/engine/tests/llamacpp_ops.rs.
GCS_LLAMA_DUMP=$(bash scripts/fixtures/llama-dump.sh)
export GCS_LLAMA_DUMP
# Keep the (large) target directory outside the clone so repeat runs, and
# fresh clones on the same machine, reuse it.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gcs/target}"
export CARGO_TERM_COLOR=never
# --all-targets: unit, integration, and benches run once in test mode (smoke).
cargo test --workspace --all-targets --locked
