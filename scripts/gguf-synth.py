#!/usr/bin/env python3
"""A GGUF file's header without its weights, and a file of the same shape
with synthetic weights rebuilt from it (scripts/gpu-check.sh).

The GPU check runs on a machine that can receive at most 64 MiB and
reach no network; SmolLM2's weights are 98 MB. The header (metadata, the
tokenizer, the tensor table: ~2 MB, <1 MB compressed; Gemma 3: ~6 MB) travels instead, and
the device rebuilds a file of exactly the model's shapes and types with
seeded random blocks: speed is the real model's, CPU/GPU agreement is
measured on the same weights, and the tokenizer is the real one (the text
a request returns is noise).

  gguf-synth.py header MODEL.gguf OUT.header    # here: header bytes + tensor table
  gguf-synth.py synth OUT.header OUT.gguf       # there: header + synthetic data
"""
import json
import struct
import sys

# ggml type -> (block elements, block bytes); only what the GPU decoder
# uploads (Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K) and the f32/f16 norms.
TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
# Where a block's f16 scale sits, and the scale that gives weights of about
# +-0.075 (std ~0.043) from its random quants: Q4_0/Q4_1 d * q (q to 15),
# Q5_0 d * (q - 16), Q8_0 d * q (q to 127), Q4_K/Q5_K d * sc * q - dmin * m
# (6-bit sc and m, q to 15 or 31), Q6_K d * sc * q (int8 sc, q to 32).
SCALE_AT = {"Q6_K": 208}
SCALE = {"Q8_0": 8.0 / 128.0, "Q5_0": 0.5, "Q4_K": 1.0 / 63, "Q5_K": 0.5 / 63, "Q6_K": 0.25 / 127}
MAGIC = b"GGUF"
FORMAT = "gcs-gguf-header/1"


def read_header(f):
    """(header bytes up to the data section, tensor table, data offset)."""
    def take(n):
        b = f.read(n)
        if len(b) != n:
            raise SystemExit("truncated GGUF header")
        return b

    def u32():
        return struct.unpack("<I", take(4))[0]

    def u64():
        return struct.unpack("<Q", take(8))[0]

    def string():
        return take(u64()).decode("utf-8", "replace")

    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(t):
        if t in scalar:
            return take(scalar[t])
        if t == 8:
            return string()
        if t == 9:
            et, n = u32(), u64()
            return [value(et) for _ in range(n)]
        raise SystemExit(f"unknown GGUF value type {t}")

    if take(4) != MAGIC:
        raise SystemExit("not a GGUF file")
    version = u32()
    if version < 2:
        raise SystemExit(f"GGUF version {version} is too old")
    n_tensors, n_kv = u64(), u64()
    alignment = 32
    for _ in range(n_kv):
        key, t = string(), u32()
        v = value(t)
        if key == "general.alignment":
            alignment = struct.unpack("<I", v)[0]
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [u64() for _ in range(u32())]
        ty, off = u32(), u64()
        if ty not in TYPES:
            raise SystemExit(f"{name}: ggml type {ty} has no synthetic form here (not a GPU type)")
        _, be, bb = TYPES[ty]
        n = 1
        for d in dims:
            n *= d
        if n % be:
            raise SystemExit(f"{name}: {n} elements are not whole blocks")
        tensors.append({"name": name, "type": ty, "offset": off, "bytes": n // be * bb})
    end = f.tell()
    data = (end + alignment - 1) // alignment * alignment
    return end, data, alignment, tensors


def header(model, out):
    with open(model, "rb") as f:
        end, data, alignment, tensors = read_header(f)
        f.seek(0)
        head = f.read(data)
    table = {"format": FORMAT, "data_offset": data, "tensors": tensors}
    blob = json.dumps(table).encode()
    with open(out, "wb") as o:
        # [u64 table length][table json][the file's first data_offset bytes]
        o.write(struct.pack("<Q", len(blob)) + blob + head)
    census = {}
    for t in tensors:
        census[TYPES[t["type"]][0]] = census.get(TYPES[t["type"]][0], 0) + 1
    size = data + max(t["offset"] + t["bytes"] for t in tensors)
    print(f"{len(tensors)} tensors {census}, data at {data}, file {size} bytes; header {len(head)} bytes")


def synth(hdr, out, seed=17):
    import random

    with open(hdr, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        table = json.loads(f.read(n))
        head = f.read()
    if table.get("format") != FORMAT:
        raise SystemExit(f"{hdr}: not a {FORMAT} file")
    data = table["data_offset"]
    if len(head) != data:
        raise SystemExit(f"{hdr}: header of {len(head)} bytes, expected {data}")
    rng = random.Random(seed)
    with open(out, "wb") as o:
        o.write(head)
        for t in sorted(table["tensors"], key=lambda t: t["offset"]):
            o.seek(data + t["offset"])
            name, _, bb = TYPES[t["type"]]
            nb = t["bytes"] // bb
            if name in ("F32", "F16"):
                # Norm weights (and any float tensor): about 1.
                code = "f" if name == "F32" else "e"
                o.write(struct.pack(f"<{nb}{code}", *(1.0 + 0.05 * rng.uniform(-1, 1) for _ in range(nb))))
                continue
            blk = bytearray(rng.randbytes(nb * bb))
            # Weights of about +-0.075 (std ~0.043): activations stay O(1)
            # through RMSNorm'd layers and the logits keep a spread.
            scale, at = SCALE.get(name, 1.0), SCALE_AT.get(name, 0)
            d = struct.pack(f"<{nb}e", *(scale * 0.01 * (0.8 + 0.4 * rng.random()) for _ in range(nb)))
            blk[at::bb], blk[at + 1::bb] = d[0::2], d[1::2]
            if name == "Q4_1":  # w = d * q + m, q in 0..15
                m = struct.pack("<e", -0.075)
                blk[2::bb], blk[3::bb] = m[0:1] * nb, m[1:2] * nb
            if name in ("Q4_K", "Q5_K"):  # the mins' scale, as d
                blk[2::bb], blk[3::bb] = d[0::2], d[1::2]
            o.write(blk)
        # Up to the last tensor's end (a writer may have left no slack).
        o.truncate(data + max(t["offset"] + t["bytes"] for t in table["tensors"]))
    print(f"wrote {out}: {len(table['tensors'])} tensors of synthetic weights (seed {seed})")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("header", "synth"):
        raise SystemExit(__doc__)
    (header if sys.argv[1] == "header" else synth)(sys.argv[2], sys.argv[3])
