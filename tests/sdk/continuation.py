"""Issue 16's user check with the official OpenAI Python SDK: stream a
500-token answer, kill -9 the worker at token 200, get the same 500 tokens
as an uninterrupted run.

Usage: continuation.py TEMPERATURE
Run by node/tests/sdk_continuation.rs, which starts a gateway and two
workers and passes GCS_BASE_URL, GCS_KEY and GCS_WORKER_PIDS (the workers'
process ids, comma-separated). Streams once as the reference, then again
and SIGKILLs the lease holder when the client has received KILL_AT tokens;
asserts equal text, finish reason and usage, and no exception. The last
line it prints is `KILLED <pid>`. Exits 1 on the first failure.
"""
import json
import os
import signal
import sys
import time
import urllib.request

from openai import OpenAI

BASE = os.environ["GCS_BASE_URL"]
KEY = os.environ["GCS_KEY"]
PIDS = [int(p) for p in os.environ["GCS_WORKER_PIDS"].split(",")]
TEMPERATURE = float(sys.argv[1])
MAX_TOKENS = 500
KILL_AT = 200
# The holder is found by CPU time between these two points (workers serve
# no HTTP; an idle worker only heartbeats), so the stream is not paused.
SAMPLE_AT = 170
# SmolLM2's end-of-text, im_start and im_end: banned, so the answer runs to
# max_tokens (the gateway has no ignore_eos; logit_bias is OpenAI's way).
NO_EOS = {"0": -100, "1": -100, "2": -100}
MSG = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]

client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


def cpu_ticks(pid):
    """User + system CPU ticks of a process (Linux /proc); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(rest[11]) + int(rest[12])


def metric(name):
    with urllib.request.urlopen(BASE.replace("/v1", "/metrics"), timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def usage_record(job_id, deadline_s=10):
    end = time.time() + deadline_s
    req = urllib.request.Request(f"{BASE}/usage", headers={"Authorization": f"Bearer {KEY}"})
    while time.time() < end:
        with urllib.request.urlopen(req, timeout=10) as r:
            for u in json.loads(r.read())["data"]:
                if u["job_id"] == job_id:
                    return u
        time.sleep(0.1)
    raise AssertionError(f"no usage record for {job_id}")


def stream(kill):
    """One streamed answer: text, token count, finish reason, usage, the
    largest gap between two deltas (and after which token), the holder at
    token KILL_AT and whether it was killed."""
    s = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=MSG, max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE, seed=1234, logit_bias=NO_EOS, stream=True,
        stream_options={"include_usage": True})
    out = {"text": "", "tokens": 0, "finish": [], "usage": None, "gap": 0.0, "gap_at": 0,
           "holder": None, "killed": None, "seam": None, "job": s.response.headers["x-request-id"]}
    last, before = None, None
    for ch in s:
        assert ch.object == "chat.completion.chunk", ch
        if ch.usage is not None:
            assert ch.choices == [], ch
            out["usage"] = ch.usage
            continue
        d = ch.choices[0]
        if d.finish_reason is not None:
            out["finish"].append(d.finish_reason)
        if not d.delta.content:
            continue
        now = time.monotonic()
        if out["killed"] is not None and out["seam"] is None:
            out["seam"] = now - last
        if last is not None and now - last > out["gap"]:
            out["gap"], out["gap_at"] = now - last, out["tokens"]
        last = now
        out["text"] += d.delta.content
        out["tokens"] += 1
        if out["tokens"] == SAMPLE_AT:
            before = [cpu_ticks(p) for p in PIDS]
        if out["tokens"] == KILL_AT:
            busy = [cpu_ticks(p) - b for p, b in zip(PIDS, before)]
            i = max(range(len(PIDS)), key=lambda i: busy[i])
            assert sum(b * 3 > busy[i] for b in busy) == 1, f"one busy worker: {busy}"
            out["holder"] = PIDS[i]
            if kill:
                os.kill(PIDS[i], signal.SIGKILL)
                out["killed"] = PIDS[i]
    return out


def counts(u):
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def main():
    t = time.time()
    ref = stream(kill=False)
    ref_s = time.time() - t
    assert ref["finish"] == ["length"], ref["finish"]
    assert ref["tokens"] == MAX_TOKENS, ref["tokens"]
    assert ref["usage"] is not None and ref["usage"].completion_tokens == MAX_TOKENS, ref["usage"]
    started = metric("gcs_continuations_started_total")
    succeeded = metric("gcs_continuations_succeeded_total")
    t = time.time()
    seen = stream(kill=True)
    seen_s = time.time() - t
    assert seen["killed"] is not None, "the holder was never killed"
    assert seen["text"] == ref["text"], "the continued text differs from the uninterrupted run's"
    assert seen["tokens"] == ref["tokens"], (seen["tokens"], ref["tokens"])
    assert seen["finish"] == ["length"], seen["finish"]
    assert seen["usage"] is not None, "no usage chunk"
    assert counts(seen["usage"]) == counts(ref["usage"]), (seen["usage"], ref["usage"])
    assert metric("gcs_continuations_started_total") == started + 1, "it did not continue"
    assert metric("gcs_continuations_succeeded_total") == succeeded + 1
    rec = usage_record(seen["job"])
    assert rec["output_tokens_sent_to_client"] == MAX_TOKENS, rec
    assert not rec["failed_after_partial_output"] and rec["cancellation_reason"] is None, rec
    print(f"T={TEMPERATURE}: reference {ref['tokens']} tokens in {ref_s:.1f}s "
          f"(largest gap {ref['gap'] * 1000:.0f} ms); killed holder at token {KILL_AT}, "
          f"{seen['tokens']} tokens in {seen_s:.1f}s, byte-equal; seam gap (token "
          f"{KILL_AT} to {KILL_AT + 1}) {seen['seam'] * 1000:.0f} ms, largest gap "
          f"{seen['gap'] * 1000:.0f} ms after token {seen['gap_at']}; the survivor "
          f"{'ran' if ref['holder'] != seen['killed'] else 'did not run'} the reference "
          f"(its prefix cache {'may hold' if ref['holder'] != seen['killed'] else 'lacks'} "
          f"the delivered tokens)", flush=True)
    print(f"KILLED {seen['killed']}", flush=True)


if __name__ == "__main__":
    main()
