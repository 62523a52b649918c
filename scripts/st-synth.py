#!/usr/bin/env python3
"""A safetensors model's folder without its weights, and the same folder
with synthetic weights rebuilt from it (scripts/gpu-check.sh: the BERT
embedder on the GPU). Like gguf-synth.py for the chat model: MiniLM's
90 MB of weights do not fit a device call, its shapes, config and
tokenizer (~0.5 MB) do.

  st-synth.py header MODEL_DIR OUT_DIR   # here: config, tokenizer, tensor table
  st-synth.py synth OUT_DIR              # there: model.safetensors, seeded weights

F32 tensors get small normal values (LayerNorm weights about 1, biases
about 0); I64 tensors (position ids) get 0, 1, 2, ...
"""
import json
import random
import shutil
import struct
import sys
from pathlib import Path

SMALL = ["config.json", "tokenizer.json", "sentence_bert_config.json"]
HEADER = "model.safetensors.header"


def header(src, out):
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in SMALL:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    with open(src / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = f.read(n)
    (out / HEADER).write_bytes(struct.pack("<Q", n) + head)
    print(f"{out}: {len(json.loads(head)) - 1} tensors, header {n} bytes")


def values(name, count, rng):
    if name.endswith("LayerNorm.weight") or name.endswith(".gamma"):
        return [1.0 + 0.02 * rng.gauss(0, 1) for _ in range(count)]
    if name.endswith("bias") or name.endswith(".beta"):
        return [0.02 * rng.gauss(0, 1) for _ in range(count)]
    return [0.05 * rng.gauss(0, 1) for _ in range(count)]


def synth(out, seed=23):
    out = Path(out)
    raw = (out / HEADER).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    table = json.loads(raw[8 : 8 + n])
    rng = random.Random(seed)
    try:
        import numpy as np
    except ImportError:
        np = None
    with open(out / "model.safetensors", "wb") as f:
        f.write(raw[: 8 + n])
        base = 8 + n
        for name, t in sorted(
            ((k, v) for k, v in table.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
        ):
            start, end = t["data_offsets"]
            count = 1
            for d in t["shape"]:
                count *= d
            f.seek(base + start)
            if t["dtype"] == "I64":
                f.write(struct.pack(f"<{count}q", *range(count)))
            elif t["dtype"] == "F32":
                if np is not None:
                    g = np.random.default_rng(rng.randrange(1 << 30))
                    if name.endswith("LayerNorm.weight") or name.endswith(".gamma"):
                        a = 1.0 + 0.02 * g.standard_normal(count)
                    elif name.endswith("bias") or name.endswith(".beta"):
                        a = 0.02 * g.standard_normal(count)
                    else:
                        a = 0.05 * g.standard_normal(count)
                    f.write(a.astype("<f4").tobytes())
                else:
                    f.write(struct.pack(f"<{count}f", *values(name, count, rng)))
            else:
                raise SystemExit(f"{name}: dtype {t['dtype']} has no synthetic form here")
            if f.tell() != base + end:
                raise SystemExit(f"{name}: wrote {f.tell() - base - start} bytes, table says {end - start}")
    print(f"wrote {out / 'model.safetensors'} (seed {seed})")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "header":
        header(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "synth":
        synth(sys.argv[2])
    else:
        raise SystemExit(__doc__)
