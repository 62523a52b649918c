#!/usr/bin/env bash
# Builds llama.cpp natively (-DGGML_NATIVE=ON: this machine's AVX-512/VNNI)
# from the source bundle inside the pinned node-llama-cpp npm package, once,
# into ~/.cache/gcs/llama-native/<version>/; prints the llama-bench path.
# It is the bar the engine's speed is measured against (issue 18): the
# prebuilt CPU binaries in the npm package decode at half its speed.
# `engine-bench --llama-bench "$(bash scripts/build-llama-native.sh)"`.
# About 10 minutes on 2 cores; not part of CI. Needs git, g++, cmake (apt).
# GCS_LLAMA_TARGETS="llama-bench llama-cli" builds more targets.
# AMX is left out (-mno-amx-*) unless GCS_LLAMA_AMX=1: on this project's
# Sapphire Rapids VMs -march=native turns on ggml's AMX kernels, and
# llama-bench dies with SIGILL at their first `tileloadd` (in
# tinygemm_kernel_amx, under GOMP threads; a one-thread AMX probe passes);
# the AVX-512/VNNI kernels are what it runs then, and what the engine uses.
set -euo pipefail
cd "$(dirname "$0")/.."
NODE_LLAMA_CPP=3.21.1   # = llama.cpp release v0.4.0, the same as scripts/fixtures/llama-dump.sh
cache="${GCS_CACHE:-$HOME/.cache/gcs}"
out="$cache/llama-native/$NODE_LLAMA_CPP"
targets="${GCS_LLAMA_TARGETS:-llama-bench}"
amx="${GCS_LLAMA_AMX:-0}"
marker="$out/.ok-$(echo "$targets" | tr ' ' '+')-amx$amx"
if [ ! -e "$marker" ]; then
  nm="$cache/llama-dump/$NODE_LLAMA_CPP/npm/node_modules"
  bundle="$nm/node-llama-cpp/llama/gitRelease.bundle"
  if [ ! -f "$bundle" ]; then
    # Fetched the way llama-dump.sh fetches it (same directory, same pin).
    echo "fetching node-llama-cpp $NODE_LLAMA_CPP ..." >&2
    mkdir -p "$cache/llama-dump/$NODE_LLAMA_CPP/npm"
    (cd "$cache/llama-dump/$NODE_LLAMA_CPP/npm" && { [ -f package.json ] || npm init -y >/dev/null; } \
      && npm install --silent --ignore-scripts --omit=optional --no-audit --no-fund \
           "node-llama-cpp@$NODE_LLAMA_CPP" >&2)
  fi
  if ! command -v cmake >/dev/null; then
    echo "installing cmake (apt) ..." >&2
    if [ "$(id -u)" = 0 ]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
    "${apt_get[@]}" -o DPkg::Lock::Timeout=300 update -qq >&2 \
      && "${apt_get[@]}" -o DPkg::Lock::Timeout=300 install -y -qq cmake >/dev/null
  fi
  echo "building llama.cpp natively ($targets) into $out, ~10 min on 2 cores ..." >&2
  mkdir -p "$out"
  [ -d "$out/src/.git" ] || { rm -rf "$out/src"; git -c advice.detachedHead=false clone -q "$bundle" "$out/src" 2>/dev/null; }
  no_amx=""
  [ "$amx" = 1 ] || no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$out/src" -B "$out/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" >"$out/cmake.log" 2>&1 \
    || { tail -20 "$out/cmake.log" >&2; echo "error: cmake configure failed" >&2; exit 1; }
  # shellcheck disable=SC2086  # targets are separate words
  cmake --build "$out/build" --target $targets -j"$(nproc)" >"$out/build.log" 2>&1 \
    || { tail -20 "$out/build.log" >&2; echo "error: llama.cpp build failed" >&2; exit 1; }
  "$out/build/bin/llama-bench" --help >/dev/null 2>&1 \
    || { echo "error: $out/build/bin/llama-bench does not run" >&2; exit 1; }
  # A --help that runs proves little (the AMX build above passed it): one
  # tiny bench on the default model, when it is there.
  smol="${GCS_MODEL_DIR:-$cache/models}/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ -f "$smol" ]; then
    "$out/build/bin/llama-bench" -m "$smol" -t 2 -p 16 -n 4 -r 1 >"$out/smoke.log" 2>&1 \
      || { tail -5 "$out/smoke.log" >&2; echo "error: llama-bench failed on $smol" >&2; exit 1; }
  fi
  rm -f "$out"/.ok-*
  touch "$marker"
fi
echo "$out/build/bin/llama-bench"
