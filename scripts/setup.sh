#!/usr/bin/env bash
# Installs what building GCS needs beyond the Rust toolchain, on Debian/Ubuntu.
# Idempotent: does nothing when everything is present.
set -euo pipefail
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust (rustup) first" >&2; exit 1; }
pkgs=(clang libclang-dev librocksdb-dev)   # bindgen needs libclang; RocksDB is linked from Debian
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${missing[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
