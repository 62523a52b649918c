#!/usr/bin/env bash
# What the tests need beyond the Rust build, installed once (idempotent):
#   - Debian packages: nginx (edge-proxy buffering test), Chromium (browser
#     test), libfaketime and iproute2 (netsim's clock-skew and partition
#     scenarios), curl and openssl (the HTTP and HTTPS checks), python3-venv
#     and python3-pip (the SDK virtualenv, scripts/fetch-models.sh), node and
#     npm (the JavaScript SDK, the llama.cpp dump), git and g++ (the dump's
#     build). Their versions are the distribution release's; the log shows
#     the ones used (printed to stderr at the end);
#   - the official OpenAI Python SDK in a virtualenv, every package pinned in
#     tests/sdk/requirements.txt                         (~/.cache/gcs/venv)
#   - the official OpenAI JavaScript SDK and playwright-core, pinned below
#     (neither has dependencies)                         (~/.cache/gcs/js)
# Prints the environment the tests read (GCS_PYTHON, GCS_JS_DIR, GCS_NGINX,
# GCS_CHROMIUM) on stdout; fails (non-zero, nothing printed) when anything
# cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${GCS_CACHE:-$HOME/.cache/gcs}"
mkdir -p "$cache"
OPENAI_JS=7.59.0
PLAYWRIGHT=1.65.1

missing=()
for p in nginx chromium libfaketime iproute2; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# Tools that may come from elsewhere (pyenv's python3, NodeSource's node
# with its own npm) count as present; only what is absent comes from Debian.
for t in curl openssl git g++; do command -v "$t" >/dev/null || missing+=("$t"); done
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)   # also in setup.sh
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${missing[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The package starts a system nginx on port 80; the tests run their own.
  $sudo service nginx stop >/dev/null 2>&1 || true
fi

venv="$cache/venv"
reqs=tests/sdk/requirements.txt
if ! cmp -s "$reqs" "$venv/.requirements.txt"; then
  echo "installing the OpenAI Python SDK ($reqs) ..." >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs" >&2
  cp "$reqs" "$venv/.requirements.txt"
fi

js="$cache/js"
if [ "$(node -e "try{console.log(require('$js/node_modules/openai/package.json').version)}catch(e){}" 2>/dev/null)" != "$OPENAI_JS" ]; then
  echo "installing openai@$OPENAI_JS (JavaScript) ..." >&2
  mkdir -p "$js"
  (cd "$js" && { [ -f package.json ] || npm init -y >/dev/null; } && npm install --silent --save-exact --no-audit --no-fund "openai@$OPENAI_JS" >&2)
fi
if [ "$(node -e "try{console.log(require('$js/node_modules/playwright-core/package.json').version)}catch(e){}" 2>/dev/null)" != "$PLAYWRIGHT" ]; then
  echo "installing playwright-core@$PLAYWRIGHT ..." >&2
  (cd "$js" && npm install --silent --save-exact --no-audit --no-fund "playwright-core@$PLAYWRIGHT" >&2)
fi

nginx=$(command -v nginx || echo /usr/sbin/nginx)   # /usr/sbin may not be on a user's PATH
[ -x "$nginx" ] || { echo "error: nginx is still missing" >&2; exit 1; }
for t in chromium curl openssl node npm git g++; do
  command -v "$t" >/dev/null || { echo "error: $t is still missing" >&2; exit 1; }
done
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1 ] \
  || { echo "error: libfaketime is still missing" >&2; exit 1; }
{
  echo "test tools: $(python3 --version), node $(node --version), npm $(npm --version), $("$nginx" -v 2>&1)"
  echo "  $(chromium --version 2>/dev/null | head -1), $(curl --version | head -1 | cut -d' ' -f1-2), $(openssl version), $(g++ --version | head -1)"
  echo "  libfaketime $(dpkg-query -W -f='${Version}' libfaketime 2>/dev/null), iproute2 $(dpkg-query -W -f='${Version}' iproute2 2>/dev/null)"
} >&2

echo "export GCS_PYTHON=$venv/bin/python"
echo "export GCS_JS_DIR=$js"
echo "export GCS_NGINX=$nginx"
echo "export GCS_CHROMIUM=$(command -v chromium)"
