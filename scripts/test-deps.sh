#!/usr/bin/env bash
# What the HTTP/SDK tests need beyond the Rust build, installed once into
# ~/.cache/gcs (idempotent; versions pinned):
#   - the official OpenAI Python SDK in a virtualenv   (~/.cache/gcs/venv)
#   - the official OpenAI JavaScript SDK               (~/.cache/gcs/js)
#   - nginx (Debian's package) for the edge-proxy buffering test
#   - Chromium (Debian's package) + playwright-core for the browser test
#   - libfaketime and iproute2 (Debian packages) for netsim's clock-skew and
#     partition scenarios
# Prints the environment the tests read (GCS_PYTHON, GCS_JS_DIR, GCS_NGINX).
set -euo pipefail
cache="${GCS_CACHE:-$HOME/.cache/gcs}"
mkdir -p "$cache"
OPENAI_PY=3.57.0
OPENAI_JS=7.59.0
PLAYWRIGHT=1.65.1

missing=()
for p in nginx chromium libfaketime iproute2; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${missing[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The package starts a system nginx on port 80; the tests run their own.
  $sudo service nginx stop >/dev/null 2>&1 || true
fi

venv="$cache/venv"
if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_PY')" 2>/dev/null; then
  echo "installing openai==$OPENAI_PY (Python) ..." >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "openai==$OPENAI_PY" >&2
fi

js="$cache/js"
if [ "$(node -e "try{console.log(require('$js/node_modules/openai/package.json').version)}catch(e){}" 2>/dev/null)" != "$OPENAI_JS" ]; then
  echo "installing openai@$OPENAI_JS (JavaScript) ..." >&2
  mkdir -p "$js"
  (cd "$js" && { [ -f package.json ] || npm init -y >/dev/null; } && npm install --silent --no-audit --no-fund "openai@$OPENAI_JS" >&2)
fi
if [ "$(node -e "try{console.log(require('$js/node_modules/playwright-core/package.json').version)}catch(e){}" 2>/dev/null)" != "$PLAYWRIGHT" ]; then
  echo "installing playwright-core@$PLAYWRIGHT ..." >&2
  (cd "$js" && npm install --silent --no-audit --no-fund "playwright-core@$PLAYWRIGHT" >&2)
fi

echo "export GCS_PYTHON=$venv/bin/python"
echo "export GCS_JS_DIR=$js"
echo "export GCS_NGINX=$(command -v nginx || echo /usr/sbin/nginx)"
echo "export GCS_CHROMIUM=$(command -v chromium || echo /usr/bin/chromium)"
