#!/usr/bin/env bash
# The GPU check of issue 17, in two halves (README "Serving on a GPU").
#
#   bash scripts/gpu-check.sh build    # here (Rust, the LLVM SDK): ~18 min cold, ~3 min warm
#   bash scripts/gpu-check.sh device   # on the GPU machine: < ~8 min, results in $OUT
#
# build: the release `--features cuda` gcs-node, stripped and xz'd, the
#   shared libraries it links beyond glibc (Debian's librocksdb and its
#   compressors: the device image has none), and SmolLM2's GGUF header
#   (metadata, tokenizer, tensor table; its 98 MB of weights do not fit the
#   64 MiB a device call carries) into .gpu-check/, which
#   .git/info/exclude ignores. Carry that folder to the device:
#     run(command="bash scripts/gpu-check.sh device", carry=[".gpu-check"], timeout_s=540)
# device: needs only bash, xz, python3 and the NVIDIA driver (no toolchain,
#   no network). Rebuilds a SmolLM2-shaped GGUF with synthetic weights
#   (scripts/gguf-synth.py; or uses .gpu-check/model.gguf / $GCS_CHECK_MODEL
#   if there), then
#   1. `gcs-node gpu-check`: CUDA decoder vs the CPU decoder on the 20
#      fixture prompts (greedy 32 tokens, teacher-forced top-1, max |Δ logit|
#      on 3), decode tok/s at batch 1, 8, 64, 256 through the batch
#      scheduler (decode graphs and the device's picks, then eagerly, side
#      by side; and every stream sampled at temperature 1 with one seed,
#      each token drawn on the device, then with top-p 0.9, each draw
#      finished from the device's best candidates, then with penalties and
#      a bias added on the device, then with those and logprobs compared
#      with the CPU engine's), the same parity and decode figures for the decoder in the
#      CPU's arithmetic (`exact`: GCS_GPU_EXACT), issue 17's naive burn
#      loop at the same batches, MiniLM
#      (synthetic weights, scripts/st-synth.py) on burn-cuda against the
#      CPU (least cosine, texts/s at 1, 32, 256), TTFT and prefill tok/s
#      of a 512-token prompt, and last (`dense`) layer 0's gate/up and the
#      LM head by the decoder's quantized kernel against f16 copies of the
#      weights by cubek's matmul routines (tensor cores), at each batch,
#      then the whole decoder on those copies (`dense_decoder`:
#      GCS_GPU_DENSE=1, parity and decode tok/s); if it fails,
#      again with GCS_GPU_GRAPHS=0 GCS_GPU_ARGMAX=0;
#   2. a served request: `gcs-node --role all --gpu 0` and one chat
#      completion through its OpenAI API (greedy, then seeded draws);
#   3. the same for Gemma 3 270M (Q5_0 and K-quant weights, gemma3's
#      layers), from its header with synthetic weights (gemma.json), and
#      where time is left again over f16 weights (GCS_GPU_DENSE=1,
#      gemma-dense.json).
#   GCS_CHECK_ARGS adds flags to step 1 (a rerun: `--naive-steps 0`).
#   Everything goes to $OUT (gpu-check.json, served.json, log.txt); each
#   step has its own timeout, and a failing step does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.gpu-check
models="${GCS_MODEL_DIR:-$HOME/.cache/gcs/models}"
model_src="${GCS_CHECK_SOURCE:-$models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}"
embed_src="$models/all-minilm-l6-v2"
gemma_src="$models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf"

build() {
  set -e
  bash scripts/setup-cuda.sh
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gcs/target}"
  cargo build --release --locked -p gcs-node --features cuda --bin gcs-node
  mkdir -p "$dir"
  exclude="$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >>"$exclude"
  strip -o "$dir/gcs-node" "$CARGO_TARGET_DIR/release/gcs-node"
  xz -T2 -6 -f "$dir/gcs-node"
  # The shared libraries it needs beyond glibc and the C++ runtime (Debian's
  # librocksdb and its compressors, .cargo/config.toml): the GPU machine's
  # image has none of them.
  rm -rf "$dir/lib" && mkdir -p "$dir/lib"
  ldd "$CARGO_TARGET_DIR/release/gcs-node" | awk '$3 ~ /^\// {print $3}' \
    | grep -Ev '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
    | xargs -r -I{} cp -L {} "$dir/lib/"
  tar -C "$dir" -cJf "$dir/libs.tar.xz" lib && rm -rf "$dir/lib"
  python3 scripts/gguf-synth.py header "$model_src" "$dir/smollm2.header"
  xz -6 -f "$dir/smollm2.header"
  # Gemma's header (~6 MB, 1.2 MB compressed) where it is fetched.
  rm -f "$dir/gemma.header.xz"
  if [ -f "$gemma_src" ]; then
    python3 scripts/gguf-synth.py header "$gemma_src" "$dir/gemma.header" && xz -6 -f "$dir/gemma.header"
  else
    echo "no $gemma_src: the device run skips Gemma (scripts/fetch-models.sh gemma3-270m)" >&2
  fi
  # MiniLM without its 90 MB of weights (scripts/st-synth.py rebuilds them there).
  rm -rf "$dir/minilm" && python3 scripts/st-synth.py header "$embed_src" "$dir/minilm"
  tar -C "$dir" -cJf "$dir/minilm.tar.xz" minilm && rm -rf "$dir/minilm"
  (cd "$dir" && sha256sum gcs-node.xz libs.tar.xz smollm2.header.xz minilm.tar.xz \
    $(ls gemma.header.xz 2>/dev/null) >SHA256SUMS)
  du -b "$dir"/* | sed 's/^/  /'
  echo "ready: carry $dir (the device run unpacks it)" >&2
}

# serve BIN MODEL ID JSON LOG PORT: `BIN --role all --gpu 0` serving MODEL as
# ID, a greedy chat completion then two seeded draws (OpenAI's default
# request, and top-p 0.9), the answers and timings into JSON, the node's log
# into LOG (what it advertised printed).
serve() {
  local bin=$1 model=$2 id=$3 json=$4 log=$5 port=$6 data key node rc
  data=$(mktemp -d)
  key=$("$bin" keys create --data-dir "$data" --tenant check --project gpu 2>>"$log")
  timeout 200 "$bin" --role all --gpu 0 --data-dir "$data" --no-mdns \
    --http "127.0.0.1:$port" --listen /ip4/127.0.0.1/tcp/0 --model "$model" --model-id "$id" \
    --heartbeat-ms 500 --first-token-timeout-ms 60000 >>"$log" 2>&1 &
  node=$!
  GCS_NODE_PID="$node" GCS_KEY="$key" GCS_PORT="$port" GCS_MODEL_ID="$id" timeout 150 python3 - "$json" <<'PY'
import json, os, sys, time, urllib.request
base, key = f"http://127.0.0.1:{os.environ['GCS_PORT']}/v1", os.environ["GCS_KEY"]
model = os.environ["GCS_MODEL_ID"]
def call(path, body=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())
t, err = time.time(), None
while True:
    try:
        if any(m["id"] == model for m in call("/models")["data"]):
            break
    except Exception as e:
        err = e
    try:
        os.kill(int(os.environ["GCS_NODE_PID"]), 0)
    except OSError:
        sys.exit(f"FAIL: the node exited ({err!r}); see its log")
    if time.time() - t > 120:
        sys.exit(f"FAIL: model never listed ({err!r})")
    time.sleep(1)
listed = time.time() - t
t = time.time()
r = call("/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                               "messages": [{"role": "user", "content": "Name a colour."}]})
r["check"] = {"listed_after_s": listed, "request_s": time.time() - t}
# Written after each answer: a step cut by its timeout keeps what it got.
def save():
    json.dump(r, open(sys.argv[1], "w"), indent=1)
save()
# OpenAI's default request (temperature 1), seeded: its tokens drawn on the device;
# then with a nucleus: each draw finished from the device's best candidates;
# then with penalties and a bias, added on the device before it draws; then
# those with logprobs (their candidates selected on the device before the
# additions); then a JSON object, its grammar's mask applied on the device.
penalized = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {"13": -2}}
logprobs = {**penalized, "logprobs": True, "top_logprobs": 3}
json_object = {"response_format": {"type": "json_object"}}
for name, extra in (("sampled", {}), ("nucleus", {"top_p": 0.9}), ("penalized", penalized),
                    ("logprobs", logprobs), ("json", json_object)):
    try:
        t = time.time()
        s = call("/chat/completions", {"model": model, "max_tokens": 16, "seed": 7,
                                       "messages": [{"role": "user", "content": "Name a colour."}],
                                       **extra})
        r["check"][name] = {"content": s["choices"][0]["message"]["content"],
                           "usage": s["usage"], "request_s": time.time() - t}
        if s["choices"][0].get("logprobs"):
            r["check"][name]["logprobs"] = s["choices"][0]["logprobs"]
    except Exception as e:
        r["check"][name] = {"error": repr(e)}
    save()
# The log gets each answer without its logprobs (16 tokens' alternatives
# are ~10 KB, most of what a device call's output tail shows); the JSON
# has them.
brief = {k: {kk: (f"{len(vv['content'])} tokens" if kk == "logprobs" else vv) for kk, vv in v.items()}
         if isinstance(v, dict) else v for k, v in r["check"].items()}
print("served:", json.dumps(r["choices"][0]["message"]["content"]), r["usage"], brief)
PY
  rc=$?
  kill "$node" 2>/dev/null; wait "$node" 2>/dev/null
  grep -E "GPU decoder loaded|worker accelerator|chat model ready|error" "$log" | head -20
  if [ "$(stat -c %s "$log")" -gt 4000000 ]; then
    xz -T4 -6 -k "$log" && truncate -s 4000000 "$log"
  fi
  rm -rf "$data"
  return $rc
}

device() {
  out="${OUT:-$PWD/gpu-check-out}"
  mkdir -p "$out"
  exec > >(tee "$out/log.txt") 2>&1
  t0=$(date +%s)
  work=/tmp/gcs-gpu-check
  rm -rf "$work" && mkdir -p "$work"
  (cd "$dir" && sha256sum -c SHA256SUMS) || { echo "FAIL: $dir is incomplete (run the build half)"; exit 1; }
  xz -dc "$dir/gcs-node.xz" >"$work/gcs-node" && chmod +x "$work/gcs-node"
  tar -C "$work" -xJf "$dir/libs.tar.xz"
  # burn-cuda finds the driver by name; NVRTC may live in the CUDA
  # toolkit or in Python's nvidia-* wheels.
  # The driver's own folder first; never the toolkit's stub or forward-
  # compatibility libcuda (a stub fails cuInit).
  libs=$( (ls -d /usr/local/nvidia/lib64 2>/dev/null
    find /usr/local/nvidia /usr/local/cuda* /usr/lib /opt \( -name 'libnvrtc.so*' -o -name 'libcuda.so*' \) 2>/dev/null \
      | grep -Ev '/(stubs|compat)/' | xargs -r -n1 dirname | sort -u) | awk '!seen[$0]++' | paste -sd: -)
  # The carried libraries last: the machine's own come first where it has them.
  export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$work/lib"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if ! "$work/gcs-node" --version; then
    ldd "$work/gcs-node"
    echo "FAIL: the binary does not start here"
    exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  model="${GCS_CHECK_MODEL:-}"
  if [ -z "$model" ] && [ -f "$dir/model.gguf" ]; then model="$dir/model.gguf"; fi
  weights=real
  if [ -z "$model" ]; then
    weights=synthetic
    model="$work/smollm2-synth.gguf"
    xz -dc "$dir/smollm2.header.xz" >"$work/smollm2.header"
    python3 scripts/gguf-synth.py synth "$work/smollm2.header" "$model" || echo "FAIL: synthesis"
  fi
  echo "== model: $model ($weights weights), $(( $(date +%s) - t0 )) s"
  embed_args=()
  if tar -C "$work" -xJf "$dir/minilm.tar.xz" && python3 scripts/st-synth.py synth "$work/minilm"; then
    embed_args=(--embed-dir "$work/minilm")
  else
    echo "FAIL: MiniLM synthesis (the embedder is not checked)"
  fi

  echo "== 1. gpu-check (decoder vs CPU, speed; decode graphs and device picks, then eager; sampled at temperature 1, at top-p 0.9, with penalties, with their logprobs)"
  # The check's own log goes aside: CubeCL logs a kernel it cannot compile
  # with its whole IR (the first device run's log passed 16 MiB and did not
  # come back). log.txt gets it without the IR lines, cut to 2 MB;
  # check.log.xz has all of it.
  check() {
    timeout "$1" "$work/gcs-node" gpu-check --model "$model" --gpu 0 \
      --prompts node/engine/tests/fixtures/smollm2_llamacpp.json "${embed_args[@]}" --out "$2" \
      ${GCS_CHECK_ARGS:-} \
      >>"$work/check.log" 2>&1
    local rc=$?
    grep -Ev '^[[:space:]]|^[{}]|^outlined_attributes|^![0-9]|^$' "$work/check.log" | head -c 2000000
    echo "(check.log: $(wc -l <"$work/check.log") lines, $(grep -c WARN "$work/check.log") WARN)"
    xz -T4 -6 -c "$work/check.log" >"$out/check.log.xz"
    return $rc
  }
  check 300 "$out/gpu-check.json"
  rc=$?
  echo "gpu-check exit $rc, $(( $(date +%s) - t0 )) s"
  if [ "$rc" -ne 0 ] && [ ! -s "$out/gpu-check.json" ]; then
    # The decoder phase itself failed (the report is written after each
    # phase): again without graphs and the device argmax.
    echo "== 1b. gpu-check with GCS_GPU_GRAPHS=0 GCS_GPU_ARGMAX=0"
    : >"$work/check.log"
    GCS_GPU_GRAPHS=0 GCS_GPU_ARGMAX=0 check 120 "$out/gpu-check-eager.json"
    echo "gpu-check (eager) exit $?, $(( $(date +%s) - t0 )) s"
  fi

  echo "== 2. served request (gcs-node --role all --gpu 0)"
  serve "$work/gcs-node" "$model" smollm2-check "$out/served.json" "$out/node.log" 18089
  echo "served exit $?, $(( $(date +%s) - t0 )) s"
  if [ -f "$dir/gemma.header.xz" ]; then
    echo "== 3. Gemma 3 270M served (synthetic weights)"
    xz -dc "$dir/gemma.header.xz" >"$work/gemma.header"
    python3 scripts/gguf-synth.py synth "$work/gemma.header" "$work/gemma-synth.gguf" || echo "FAIL: synthesis"
    serve "$work/gcs-node" "$work/gemma-synth.gguf" gemma-check "$out/gemma.json" "$out/gemma-node.log" 18090
    echo "gemma served exit $?, $(( $(date +%s) - t0 )) s"
    # Over f16 copies by cubek (GCS_GPU_DENSE=1; its 262,144-row LM head
    # is most of a step's work), where the call has time left.
    if [ $(( $(date +%s) - t0 )) -lt 420 ]; then
      echo "== 3b. Gemma served with GCS_GPU_DENSE=1"
      GCS_GPU_DENSE=1 serve "$work/gcs-node" "$work/gemma-synth.gguf" gemma-check \
        "$out/gemma-dense.json" "$out/gemma-dense-node.log" 18091
      echo "gemma (dense) served exit $?, $(( $(date +%s) - t0 )) s"
    fi
    rm -f "$work/gemma-synth.gguf"
  fi
  echo "== done in $(( $(date +%s) - t0 )) s; results in $out"
}

case "${1:-}" in
  build) build ;;
  device) device ;;
  *) echo "usage: $0 build|device" >&2; exit 2 ;;
esac
