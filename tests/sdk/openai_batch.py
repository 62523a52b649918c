"""The official OpenAI Python SDK's Files + Batch flow against a running GCS
gateway (specs/batch.md).

Run by node/tests/http_api.rs with GCS_BASE_URL and GCS_KEY (the same
environment as openai_python.py). A chat batch and an embeddings batch are
uploaded with client.files.create, run with client.batches.create, polled
with client.batches.retrieve and downloaded with client.files.content; each
result must equal the same request sent on its own (greedy decoding).
Every check asserts; the first failure exits 1.
"""
import concurrent.futures
import io
import json
import math
import os
import time
import urllib.request

import openai
from openai import OpenAI

BASE = os.environ["GCS_BASE_URL"]
KEY = os.environ["GCS_KEY"]
client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
CHAT = "gnus-auto"
EMBED = "gnus-embed"
CHAT_LINES = int(os.environ.get("GCS_BATCH_CHAT_LINES", "20"))
EMBED_LINES = int(os.environ.get("GCS_BATCH_EMBED_LINES", "4"))
# The requests sent alone, for comparison: this many at once (each is its
# own request; greedy answers do not depend on what runs beside them).
ALONE_CLIENTS = 8
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def check(name, fn):
    t = time.time()
    fn()
    print(f"PASS {name} ({time.time() - t:.2f}s)", flush=True)


def jsonl(lines):
    return io.BytesIO("".join(json.dumps(l) + "\n" for l in lines).encode())


def chat_body(i):
    return {"model": CHAT, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": f"Say a word about the number {i}."}]}


def embed_body(i):
    return {"model": EMBED, "input": [f"sentence number {i}", f"another sentence {i}"]}


def sent_alone(fn, bodies):
    """Each body sent on its own through `fn`, in input order."""
    with concurrent.futures.ThreadPoolExecutor(ALONE_CLIENTS) as pool:
        return list(pool.map(lambda b: fn(**b), bodies))


def wait(batch_id, timeout=600):
    deadline = time.time() + timeout
    seen = set()
    while True:
        b = client.batches.retrieve(batch_id)
        seen.add(b.status)
        if b.status in TERMINAL:
            return b, seen
        assert time.time() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)


def usage_records(query):
    req = urllib.request.Request(f"{BASE.rstrip('/')}/usage?{query}",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"]


def outputs(file_id):
    text = client.files.content(file_id).text
    return {l["custom_id"]: l for l in map(json.loads, text.splitlines())}


def run_batch(endpoint, bodies):
    lines = [{"custom_id": f"c-{i}", "method": "POST", "url": endpoint, "body": b}
             for i, b in enumerate(bodies)]
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    assert f.id.startswith("file-") and f.purpose == "batch" and f.bytes > 0, f
    assert client.files.retrieve(f.id).filename == "input.jsonl"
    assert f.id in [x.id for x in client.files.list()]
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint,
                              completion_window="24h", metadata={"suite": "sdk"})
    assert b.status == "validating" and b.metadata == {"suite": "sdk"}, b
    b, seen = wait(b.id)
    assert b.status == "completed", b
    # A small batch can pass through in_progress and finalizing between two
    # polls, so the record's timestamps, not the polls, prove it did.
    assert b.in_progress_at is not None and b.finalizing_at is not None, b
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at, b
    assert seen <= {"validating", "in_progress", "finalizing", "completed"}, seen
    rc = b.request_counts
    assert (rc.total, rc.completed, rc.failed) == (len(bodies), len(bodies), 0), rc
    assert b.error_file_id is None, b
    out = outputs(b.output_file_id)
    assert sorted(out) == sorted(l["custom_id"] for l in lines), out.keys()
    for l in out.values():
        assert l["response"]["status_code"] == 200 and l["error"] is None, l
    return b, out


def chat_batch():
    bodies = [chat_body(i) for i in range(CHAT_LINES)]
    b, out = run_batch("/v1/chat/completions", bodies)
    completion = 0
    for i, alone in enumerate(sent_alone(client.chat.completions.create, bodies)):
        got = out[f"c-{i}"]["response"]["body"]
        assert got["object"] == "chat.completion", got
        assert got["choices"][0]["message"]["content"] == alone.choices[0].message.content, \
            (i, got["choices"][0]["message"]["content"], alone.choices[0].message.content)
        assert got["usage"]["completion_tokens"] == alone.usage.completion_tokens, (got, alone)
        completion += alone.usage.completion_tokens
    assert b.usage.output_tokens == completion, (b.usage, completion)
    assert b.usage.total_tokens == b.usage.input_tokens + completion > completion, b.usage
    # Metered like API work, under the batch's id (specs/batch.md, "Metering").
    recs = usage_records(f"batch_id={b.id}&limit=1000")
    assert len(recs) == len(bodies), (len(recs), len(bodies))
    assert all(r["batch_id"] == b.id for r in recs), recs[:2]
    sent = sum(r["output_tokens_sent_to_client"] for r in recs)
    assert sent == completion, (sent, completion)
    solo = [r for r in usage_records("limit=1000") if r["batch_id"] is None]
    assert len(solo) >= len(bodies), len(solo)
    assert b.id in [x.id for x in client.batches.list(limit=100)]


def embeddings_batch():
    bodies = [embed_body(i) for i in range(EMBED_LINES)]
    _, out = run_batch("/v1/embeddings", bodies)
    for i, alone in enumerate(sent_alone(client.embeddings.create, bodies)):
        got = out[f"c-{i}"]["response"]["body"]["data"]
        assert len(got) == len(alone.data) == 2, got
        for g, a in zip(got, alone.data):
            d = max(abs(x - y) for x, y in zip(g["embedding"], a.embedding))
            assert d < 1e-4, (i, d)
            assert math.isclose(sum(x * x for x in g["embedding"]), 1.0, rel_tol=1e-3)


def validation_failure():
    lines = [{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": embed_body(0)},
             {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": embed_body(1)},
             {"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", "body": chat_body(0)}]
    f = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    b, _ = wait(b.id, 30)
    assert b.status == "failed", b
    codes = [(e.code, e.line) for e in b.errors.data]
    assert codes == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3)], codes


def cancel_and_delete():
    lines = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": chat_body(i)} for i in range(40)]
    f = client.files.create(file=("cancel.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled"), c
    b, _ = wait(b.id, 60)
    assert b.status == "cancelled", b
    assert b.request_counts.completed < 40, b.request_counts
    try:
        client.batches.cancel(b.id)
        raise AssertionError("a cancelled batch was cancelled again")
    except openai.ConflictError:
        pass
    d = client.files.delete(f.id)
    assert d.deleted and d.id == f.id, d
    try:
        client.files.retrieve(f.id)
        raise AssertionError("a deleted file is still there")
    except openai.NotFoundError:
        pass


def upload_bounds():
    try:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
        raise AssertionError("purpose fine-tune was accepted")
    except openai.BadRequestError as e:
        assert e.param == "purpose", e.body


check(f"embeddings batch of {EMBED_LINES} equals the requests sent alone", embeddings_batch)
check(f"chat batch of {CHAT_LINES} equals the requests sent alone", chat_batch)
check("a bad input fails validation with per-line errors", validation_failure)
check("cancel, then delete the input file", cancel_and_delete)
check("upload bounds", upload_bounds)
