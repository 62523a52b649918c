#!/usr/bin/env bash
# Type-checks the GPU build (`--features cuda`: burn-cuda, the engine's
# CUDA paths, gcs-node's --gpu probe) so it keeps compiling although no test
# machine has a GPU. CI runs it after scripts/test.sh (.ci/run); it is a
# separate step because a cold check of burn-cuda/cubecl costs many minutes
# on 2 cores (figures in specs/figures.md, "CUDA type-check"). Nothing is
# linked or run. Installs the LLVM SDK first (scripts/setup-cuda.sh, cached).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-cuda.sh
# The same target directory as the test run: build scripts and proc-macros
# are shared, and a repeat check is nearly free.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gcs/target}"
export CARGO_TERM_COLOR=never
# The engine only: every cuda-gated line is in it (gcs-node's `cuda` feature
# just forwards to it), and checking gcs-node too would re-check libp2p and
# the node's whole graph in check mode — about 10 more cold minutes.
cargo check -p gcs-engine --features cuda --all-targets --locked
