"""The official OpenAI Python SDK against a running GCS gateway.

Run by node/tests/http_api.rs, which starts the nodes and passes:
GCS_BASE_URL, GCS_KEY (unrestricted), GCS_KEY_EMBED (embeddings only),
GCS_KEY_RPM1 (1 request/minute), GCS_BASE_URL_EMPTY + GCS_KEY_EMPTY (a
gateway with no workers). Every check asserts; the first failure exits 1.
"""
import base64
import json
import math
import os
import struct
import sys
import threading
import time

import urllib.error
import urllib.request

import openai
from openai import OpenAI

BASE = os.environ["GCS_BASE_URL"]
KEY = os.environ["GCS_KEY"]
client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
CHAT = "gnus-auto"
EMBED = "gnus-embed"
MSG = [{"role": "user", "content": "Name three colours."}]
# SmolLM2's end-of-text, im_start and im_end tokens: banned, the model runs to max_tokens.
NO_EOS = {"0": -100, "1": -100, "2": -100}


class Raw:
    """A plain HTTP answer (urllib, so the check does not lean on the SDK)."""

    def __init__(self, status, headers, body):
        self.status_code, self.headers, self.text = status, headers, body

    def json(self):
        return json.loads(self.text)


def raw(method, url, body=None, headers=None):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Raw(r.status, r.headers, r.read().decode())
    except urllib.error.HTTPError as e:
        return Raw(e.code, e.headers, e.read().decode())


AUTH = {"Authorization": f"Bearer {KEY}"}


def check(name, fn):
    t = time.time()
    fn()
    print(f"PASS {name} ({time.time() - t:.2f}s)", flush=True)


def expect_error(exc_type, status, code, fn, param=None):
    try:
        fn()
    except exc_type as e:
        assert e.status_code == status, (e.status_code, e)
        assert e.code == code, (e.code, e)
        if param is not None:
            assert e.param == param, (e.param, e)
        body = e.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["code"], str), body
        return e
    raise AssertionError(f"expected {exc_type.__name__} {status}")


def models():
    ids = {m.id for m in client.models.list()}
    assert {CHAT, "smollm2-135m-instruct", EMBED}.issubset(ids), ids
    assert client.models.retrieve(CHAT).id == CHAT
    expect_error(openai.NotFoundError, 404, "model_not_found",
                 lambda: client.models.retrieve("no-such-model"))


blocking = {}


def chat_blocking():
    r = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=24, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant", r
    assert c.message.content, r
    assert c.finish_reason in ("stop", "length"), c
    u = r.usage
    assert 0 < u.completion_tokens <= 24 and u.prompt_tokens > 0, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    # The field is there and is a count of prompt tokens (never all of them:
    # at least the last one is computed to sample the first output token).
    cached = u.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached < u.prompt_tokens, u
    blocking["text"], blocking["tokens"] = c.message.content, u.completion_tokens


def chat_stream():
    s = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, finishes, usage, n = "", 0, None, 0
    for ch in s:
        n += 1
        assert ch.object == "chat.completion.chunk", ch
        if ch.usage is not None:
            assert ch.choices == [], ch
            usage = ch.usage
            continue
        d = ch.choices[0]
        text += d.delta.content or ""
        if d.finish_reason is not None:
            finishes += 1
    assert finishes == 1, finishes
    assert usage is not None and usage.completion_tokens == blocking["tokens"], usage
    assert text == blocking["text"], (text, blocking["text"])
    assert n >= 3, n


def logprobs():
    # Greedy: each chosen token is its position's most likely one.
    r = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3, logit_bias=NO_EOS)
    c = r.choices[0]
    lp = c.logprobs.content
    assert c.finish_reason == "length" and len(lp) == r.usage.completion_tokens == 8, (c, r.usage)
    assert "".join(t.token for t in lp) == c.message.content, (lp, c.message.content)
    for t in lp:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token, t
        assert len(t.top_logprobs) == 3, t
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and t.top_logprobs[0].token == t.token, t
        assert abs(tops[0] - t.logprob) < 1e-6, t
    s = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=8, temperature=0,
                                       logprobs=True, logit_bias=NO_EOS, stream=True)
    streamed, text = [], ""
    for ch in s:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            if ch.choices[0].logprobs is not None:
                streamed += ch.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in lp] and text == c.message.content, \
        (streamed, lp)
    assert all(t.top_logprobs == [] for t in streamed), streamed
    plain = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=4)
    assert plain.choices[0].logprobs is None, plain
    expect_error(openai.BadRequestError, 400, "invalid_value",
                 lambda: client.chat.completions.create(model=CHAT, messages=MSG, top_logprobs=2),
                 param="top_logprobs")
    # Legacy completions: parallel lists; the chosen token is always among
    # the top ones (greedy: the most likely); offsets count characters.
    legacy = client.completions.create(model=CHAT, prompt="The sky is", logprobs=2, max_tokens=6,
                                       temperature=0, logit_bias=NO_EOS)
    c, lg = legacy.choices[0], legacy.choices[0].logprobs
    n = legacy.usage.completion_tokens
    assert n == 6 and len(lg.tokens) == len(lg.token_logprobs) == len(lg.top_logprobs) \
        == len(lg.text_offset) == n, lg
    assert "".join(lg.tokens) == c.text, (lg.tokens, c.text)
    assert lg.text_offset == [len("".join(lg.tokens[:i])) for i in range(n)], lg.text_offset
    for tok, v, top in zip(lg.tokens, lg.token_logprobs, lg.top_logprobs):
        assert v <= 0 and top[tok] == v == max(top.values()) and len(top) == 2, (tok, v, top)
    s = client.completions.create(model=CHAT, prompt="The sky is", logprobs=2, max_tokens=6,
                                  temperature=0, logit_bias=NO_EOS, stream=True)
    toks, offsets, text = [], [], ""
    for ch in s:
        if ch.choices:
            text += ch.choices[0].text
            if ch.choices[0].logprobs is not None:
                toks += ch.choices[0].logprobs.tokens
                offsets += ch.choices[0].logprobs.text_offset
    assert (toks, offsets, text) == (lg.tokens, lg.text_offset, c.text), (toks, offsets, text)
    assert client.completions.create(model=CHAT, prompt="Hi", max_tokens=2).choices[0].logprobs \
        is None
    expect_error(openai.BadRequestError, 400, "invalid_value",
                 lambda: client.completions.create(model=CHAT, prompt="Hi", logprobs=21),
                 param="logprobs")


def n_choices():
    r = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=8, n=3,
                                       temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    assert all(c.message.content for c in r.choices), r.choices
    assert 3 <= r.usage.completion_tokens <= 24, r.usage
    s = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=8, n=2, seed=7,
                                       temperature=1.0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finishes, usage = ["", ""], [0, 0], None
    for ch in s:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] += c.finish_reason is not None
    assert finishes == [1, 1] and all(texts), (finishes, texts)
    assert usage and 2 <= usage.completion_tokens <= 16, usage
    # The same seed gives the same first choice, blocking or streamed.
    assert texts[0] == r.choices[0].message.content, (texts[0], r.choices[0].message.content)


def completions():
    r = client.completions.create(model=CHAT, prompt="The sky is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text, r
    s = client.completions.create(model=CHAT, prompt="The sky is", max_tokens=8, temperature=0,
                                  stream=True)
    text = "".join(c.choices[0].text for c in s if c.choices)
    assert text == r.choices[0].text, (text, r.choices[0].text)


def embeddings():
    inputs = [f"sentence number {i} about {w}" for i, w in
              enumerate(["cats", "dogs", "rust", "tea", "rain", "maps", "jazz", "snow", "ants", "gold"])]
    r = client.embeddings.create(model=EMBED, input=inputs)
    assert len(r.data) == len(inputs), len(r.data)
    for i, d in enumerate(r.data):
        assert d.index == i and len(d.embedding) == 384, (i, len(d.embedding))
        assert abs(math.sqrt(sum(x * x for x in d.embedding)) - 1) < 1e-3
    one = client.embeddings.create(model=EMBED, input=inputs[7]).data[0].embedding
    cos = sum(a * b for a, b in zip(one, r.data[7].embedding))
    assert cos > 0.999, f"input 7 came back out of order or wrong (cos {cos})"
    b = client.embeddings.create(model=EMBED, input=inputs[7], encoding_format="base64")
    # The SDK decodes base64 itself when it asked for it; read the raw answer too.
    r64 = raw("POST", f"{BASE}/embeddings", {"model": EMBED, "input": inputs[7],
                                             "encoding_format": "base64"}, AUTH).json()
    floats = struct.unpack("<384f", base64.b64decode(r64["data"][0]["embedding"]))
    assert abs(floats[5] - one[5]) < 1e-6, (floats[5], one[5])
    assert len(b.data[0].embedding) in (384, 2048), len(b.data[0].embedding)


def cached_prefix():
    """A second request sharing a long prefix reports the reused KV tokens."""
    system = {"role": "system", "content": "You are a terse assistant for a shipping company. " * 8}
    first = client.chat.completions.create(model=CHAT, max_tokens=4, temperature=0,
                                           messages=[system, {"role": "user", "content": "Hi."}])
    second = client.chat.completions.create(model=CHAT, max_tokens=4, temperature=0,
                                            messages=[system, {"role": "user", "content": "Bye."}])
    c1 = first.usage.prompt_tokens_details.cached_tokens
    c2 = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens >= 64, first.usage
    assert c2 >= 48 and c2 < second.usage.prompt_tokens, (c1, c2, second.usage)
    print(f"  cached_tokens: first {c1}, second {c2} of {second.usage.prompt_tokens}")


def errors():
    bad = OpenAI(base_url=BASE, api_key="gnus_" + "0" * 64, max_retries=0)
    expect_error(openai.AuthenticationError, 401, "invalid_api_key",
                 lambda: bad.chat.completions.create(model=CHAT, messages=MSG))
    none = raw("POST", f"{BASE}/chat/completions", {"model": CHAT, "messages": MSG})
    assert none.status_code == 401 and none.json()["error"]["code"] == "invalid_api_key"
    expect_error(openai.NotFoundError, 404, "model_not_found",
                 lambda: client.chat.completions.create(model="no-such-model", messages=MSG))
    expect_error(openai.BadRequestError, 400, "invalid_value",
                 lambda: client.chat.completions.create(model=CHAT, messages=MSG, temperature=5),
                 param="temperature")
    expect_error(openai.BadRequestError, 400, "unsupported_parameter",
                 lambda: client.chat.completions.create(
                     model=CHAT, messages=[{"role": "user", "content": [
                         {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]),
                 param="messages[0].content[0].type")
    r = raw("POST", f"{BASE}/chat/completions", b'{"model": "x", "messages": [', AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    expect_error(openai.APIStatusError, 413, "request_too_large",
                 lambda: client.chat.completions.create(
                     model=CHAT, messages=[{"role": "user", "content": "x" * (5 << 20)}]))
    # Idempotency: the same key and body give the same answer; another body is a 422.
    h = {"Idempotency-Key": f"idem-{time.time()}"}
    a = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=4, temperature=0,
                                       extra_headers=h)
    b = client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=4, temperature=0,
                                       extra_headers=h)
    assert a.id == b.id and a.choices[0].message.content == b.choices[0].message.content, (a, b)
    expect_error(openai.UnprocessableEntityError, 422, "idempotency_key_reused",
                 lambda: client.chat.completions.create(model=CHAT, messages=MSG, max_tokens=5,
                                                        extra_headers=h))
    embed_only = OpenAI(base_url=BASE, api_key=os.environ["GCS_KEY_EMBED"], max_retries=0)
    expect_error(openai.PermissionDeniedError, 403, "permission_denied",
                 lambda: embed_only.chat.completions.create(model=CHAT, messages=MSG),
                 param="model")
    embed_only.embeddings.create(model=EMBED, input="allowed")
    rpm1 = OpenAI(base_url=BASE, api_key=os.environ["GCS_KEY_RPM1"], max_retries=0)
    rpm1.embeddings.create(model=EMBED, input="first")
    e = expect_error(openai.RateLimitError, 429, "rate_limit_exceeded",
                     lambda: rpm1.embeddings.create(model=EMBED, input="second"))
    assert int(e.response.headers["retry-after"]) >= 1, e.response.headers
    empty = OpenAI(base_url=os.environ["GCS_BASE_URL_EMPTY"], api_key=os.environ["GCS_KEY_EMPTY"],
                   max_retries=0)
    expect_error(openai.InternalServerError, 503, "gnus_no_capable_nodes",
                 lambda: empty.chat.completions.create(model=CHAT, messages=MSG))
    # The network serves the model, but no private node of this tenant and no
    # node of this gateway's swarm: said at once, not after a queue timeout.
    for network in ("private", "local_only"):
        t0 = time.time()
        expect_error(openai.InternalServerError, 503, "gnus_no_capable_nodes",
                     lambda: client.chat.completions.create(
                         model=CHAT, messages=MSG, extra_body={"gnus": {"network": network}}))
        assert time.time() - t0 < 2, f"{network}: the 503 took {time.time() - t0:.1f} s"
    expect_error(openai.APIStatusError, 504, "gnus_wall_timeout",
                 lambda: client.chat.completions.create(
                     model=CHAT, messages=MSG, max_tokens=3000, logit_bias=NO_EOS,
                     extra_body={"gnus": {"limits": {"wall_timeout_ms": 300}}}))


def metric(name):
    text = raw("GET", BASE.replace("/v1", "/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def usage_of(job_id, deadline_s=10):
    end = time.time() + deadline_s
    while time.time() < end:
        r = raw("GET", f"{BASE}/usage", None, AUTH).json()
        for u in r["data"]:
            if u["job_id"] == job_id:
                return u
        time.sleep(0.1)
    raise AssertionError(f"no usage record for {job_id}")


def abort_once():
    s = client.chat.completions.create(model=CHAT, max_tokens=1500, temperature=0,
                                       messages=[{"role": "user", "content": "Tell a long story."}],
                                       stream=True)
    job = s.response.headers["x-request-id"]
    got = 0
    for ch in s:
        if ch.choices and ch.choices[0].delta.content:
            got += 1
        if got == 5:
            break
    s.close()
    t0 = time.time()
    while metric("gcs_worker_active_jobs") > 0:
        assert time.time() - t0 < 1.0, "the worker still runs the job 1 s after the disconnect"
        time.sleep(0.02)
    stopped = time.time() - t0
    u = usage_of(job)
    assert u["cancellation_reason"] == "client_disconnected", u
    assert u["output_tokens_sent_to_client"] >= 5, u
    # The worker's own metering (it stopped a few tokens after the client
    # left) arrives with its cancelled result and updates the record.
    end = time.time() + 3
    while u["output_tokens_generated"] <= u["output_tokens_sent_to_client"] and time.time() < end:
        time.sleep(0.1)
        u = usage_of(job)
    assert u["output_tokens_generated"] >= u["output_tokens_sent_to_client"], u
    print(f"  worker idle {stopped * 1000:.0f} ms after disconnect; generated "
          f"{u['output_tokens_generated']}, delivered {u['output_tokens_sent_to_client']}")
    return u["output_tokens_generated"] > u["output_tokens_sent_to_client"]


def abort_mid_stream():
    billed_more = [abort_once() for _ in range(3)]
    assert any(billed_more), "generated never exceeded delivered after a disconnect"


def concurrent_streams():
    results, errs = [None] * 16, []

    def one(i):
        try:
            s = client.chat.completions.create(
                model=CHAT, max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Say something about the number {i}."}])
            text, fin, usage = "", 0, None
            for ch in s:
                if ch.usage:
                    usage = ch.usage
                elif ch.choices:
                    text += ch.choices[0].delta.content or ""
                    fin += ch.choices[0].finish_reason is not None
            results[i] = (text, fin, usage)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append((i, repr(e)))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs
    for i, (text, fin, usage) in enumerate(results):
        assert text and fin == 1 and usage and 0 < usage.completion_tokens <= 16, (i, text, usage)


def large_response():
    # Banning the end-of-text tokens makes the model run to max_tokens.
    s = client.chat.completions.create(
        model=CHAT, max_tokens=2000, temperature=0, stream=True,
        stream_options={"include_usage": True}, logit_bias=NO_EOS,
        messages=[{"role": "user", "content": "Write a very long essay about the sea."}])
    chunks, text, finish, usage = 0, "", None, None
    for ch in s:
        if ch.usage:
            usage = ch.usage
        elif ch.choices:
            chunks += 1
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    assert finish == "length", finish
    assert usage.completion_tokens == 2000, usage
    assert chunks > 1000 and len(text) > 2000, (chunks, len(text))


# Structured outputs (issue 19): constrained decoding on the worker. Strings,
# lists and numbers are bounded so a 135M model finishes inside max_tokens.
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from enum import Enum  # noqa: E402
from typing import List, Literal, Optional  # noqa: E402

from pydantic import BaseModel, Field  # noqa: E402

Short = Field(max_length=16)


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Short
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


class Address(BaseModel):
    city: str = Short
    zip: str = Field(max_length=8)


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)
    address: Address


class Shopping(BaseModel):
    items: List[str] = Field(max_length=4)


class Paint(BaseModel):
    colour: Colour
    glossy: bool


class Contact(BaseModel):
    name: str = Short
    email: Optional[str] = Field(max_length=24)
    phone: Optional[str] = Field(max_length=12)


class Step(BaseModel):
    n: int = Field(ge=1, le=9)
    text: str = Short


class Recipe(BaseModel):
    title: str = Short
    steps: List[Step] = Field(max_length=3)


class Weather(BaseModel):
    city: str = Short
    celsius: int = Field(ge=-50, le=60)
    sky: Literal["sunny", "cloudy", "rain"]


class Family(BaseModel):
    parent: Person
    pets: List[Pet] = Field(max_length=2)


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=100)


class Book(BaseModel):
    title: str = Short
    author: Optional[Person]
    year: int = Field(ge=1000, le=2100)


SCHEMA_PROMPTS = [
    (Pet, "Describe a pet."), (Pet, "Invent a dog that is five years old."),
    (Person, "Describe a person who lives in Paris."), (Person, "Invent a person."),
    (Shopping, "Write a short shopping list."), (Shopping, "What do I need to bake bread?"),
    (Paint, "Pick a paint for a kitchen."), (Paint, "Which colour is the sky?"),
    (Contact, "Give a contact card for Ann."), (Contact, "Contact details of a plumber."),
    (Recipe, "A recipe for toast."), (Recipe, "How to make tea."),
    (Weather, "The weather in London today."), (Weather, "The weather in Cairo."),
    (Family, "Describe a family with a cat."), (Family, "A family of one person and two pets."),
    (Verdict, "Is water wet?"), (Verdict, "Is the moon made of cheese?"),
    (Book, "Describe a famous book."), (Book, "Invent a book about the sea."),
]


def parse_one(i):
    model, prompt = SCHEMA_PROMPTS[i]
    r = client.chat.completions.parse(
        model=CHAT, max_tokens=160, temperature=0.7, seed=i, response_format=model,
        messages=[{"role": "user", "content": prompt + " Answer in JSON."}])
    c = r.choices[0]
    assert c.finish_reason == "stop", (i, c.finish_reason, c.message.content)
    assert isinstance(c.message.parsed, model), (i, c.message.content)
    # The SDK validated it; the text is also plain JSON of the schema's keys.
    assert list(json.loads(c.message.content)) == list(model.model_fields), c.message.content
    return c.message.parsed


def structured_outputs():
    # Concurrent, so the worker batches them (each has its own grammar state).
    with ThreadPoolExecutor(max_workers=10) as ex:
        parsed = list(ex.map(parse_one, range(len(SCHEMA_PROMPTS))))
    print(f"  {len(parsed)} parsed, e.g. {parsed[2]!r}")
    # Streamed: the deltas add up to a document of the schema.
    s = client.chat.completions.create(
        model=CHAT, max_tokens=160, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {
            "name": "verdict", "strict": True,
            "schema": openai.lib._pydantic.to_strict_json_schema(Verdict)}},
        messages=[{"role": "user", "content": "Is fire hot? Answer in JSON."}])
    text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
    Verdict.model_validate_json(text)


JSON_PROMPTS = [
    "Give the name and age of a cat as a JSON object.",
    "Return a JSON object with keys city and country for Paris.",
    "Answer in JSON with a key 'answer': what is 2+2?",
    "A JSON object describing a red apple with colour and weight.",
    "Describe a dog as JSON with name and breed.",
]


def json_object_one(i):
    # Greedy, then sampled with a seed: either way the text does not depend
    # on the batch it lands in. Any object is allowed, so strings are not
    # bounded: these prompts are ones the model answers briefly.
    for temperature in (0, 0.7):
        r = client.chat.completions.create(
            model=CHAT, max_tokens=160, temperature=temperature, seed=1,
            response_format={"type": "json_object"},
            messages=[{"role": "user", "content": JSON_PROMPTS[i]}])
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        assert isinstance(json.loads(c.message.content), dict), c.message.content


def json_object():
    with ThreadPoolExecutor(max_workers=5) as ex:
        list(ex.map(json_object_one, range(len(JSON_PROMPTS))))
    # What llguidance cannot compile is refused at the edge, naming the param.
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    expect_error(openai.BadRequestError, 400, "unsupported_parameter", lambda: client.chat.completions.create(
        model=CHAT, max_tokens=4, messages=MSG, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}), "response_format")


# --- Tool calling (issue 19) ---------------------------------------------
class GetWeather(BaseModel):
    """The current weather in a city."""
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The local time in a time zone."""
    zone: str = Field(max_length=16)


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
TOOL_MODELS = {"GetWeather": GetWeather, "GetTime": GetTime}
ASK = [{"role": "system", "content": "You can look up the weather and the time."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "GetTime"}}


def valid_call(call, only=None):
    """A call as the contract says: an id, type function, a tool's name, arguments a JSON
    string that validates against that tool's schema."""
    assert call.id.startswith("call_") and call.type == "function", call
    assert call.function.name in TOOL_MODELS and (only is None or call.function.name == only), call
    return TOOL_MODELS[call.function.name].model_validate_json(call.function.arguments)


def tool_result(message, call):
    """The next turn's history: the assistant's calls, then this call's result."""
    args = json.loads(call.function.arguments)
    result = {"GetWeather": {"temperature": 21, "sky": "clear"},
              "GetTime": {"time": "14:05"}}[call.function.name]
    return [message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({**args, **result})}]


def final_answer(history, choice):
    """After a tool result: text (or, under auto, another valid call)."""
    r = client.chat.completions.create(model=CHAT, messages=history, tools=TOOLS, tool_choice=choice,
                                       max_tokens=48, temperature=0)
    c = r.choices[0]
    if choice == "none":
        assert c.message.tool_calls is None and c.message.content, c
        assert c.finish_reason in ("stop", "length"), c
    elif c.message.tool_calls:
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls:
            valid_call(call)
    else:
        assert isinstance(c.message.content, str) and c.finish_reason in ("stop", "length"), c
    return c


def tools_blocking():
    for choice, only in (("required", None), (NAMED, "GetTime")):
        for seed in (1, 2):
            r = client.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=96,
                                               temperature=0.8, seed=seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            assert c.message.content is None and len(c.message.tool_calls) == 1, c.message
            valid_call(c.message.tool_calls[0], only)
            # The round trip: the result goes back and the model answers in text.
            final_answer(ASK + tool_result(c.message, c.message.tool_calls[0]), "none")
    # auto: the model chooses; either is a valid answer.
    r = client.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS, max_tokens=96,
                                       temperature=0)
    c = r.choices[0]
    print(f"  auto chose {'a call' if c.message.tool_calls else 'text'}")
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls:
            valid_call(call)
        final_answer(ASK + tool_result(c.message, c.message.tool_calls[0]), "auto")
    else:
        assert c.message.content is not None and c.finish_reason in ("stop", "length"), c
    # The SDK's own helper parses strict tools' arguments into the models.
    p = client.chat.completions.parse(model=CHAT, messages=ASK, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=96, temperature=0)
    parsed = p.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, (GetWeather, GetTime)), parsed
    # Parallel calls: up to 8, each valid, ids distinct.
    r = client.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0.8, seed=3)
    calls = r.choices[0].message.tool_calls or []
    assert 1 <= len(calls) <= 8 and len({c.id for c in calls}) == len(calls), r
    if r.choices[0].finish_reason == "tool_calls":
        for call in calls:
            valid_call(call)


def stream_calls(**kw):
    """Streams one answer; returns (calls by index, content, finish), checking OpenAI's
    order: a call's first delta has its index, id, type, name and empty arguments."""
    s = client.chat.completions.create(model=CHAT, stream=True, **kw)
    calls, content, finish = {}, "", None
    for ch in s:
        if not ch.choices:
            continue
        d = ch.choices[0]
        content += d.delta.content or ""
        for t in d.delta.tool_calls or []:
            if t.index not in calls:
                assert t.id and t.type == "function" and t.function.name, t
                assert t.function.arguments == "", t
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
            else:
                assert t.id is None and t.function.name is None, t
                calls[t.index]["arguments"] += t.function.arguments or ""
        if d.finish_reason is not None:
            assert finish is None, "one finish chunk"
            finish = d.finish_reason
    return calls, content, finish


def tools_stream():
    kw = dict(messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=96, temperature=0)
    for choice, only in (("required", None), (NAMED, "GetTime")):
        calls, content, finish = stream_calls(tool_choice=choice, **kw)
        assert finish == "tool_calls" and content == "" and list(calls) == [0], (calls, finish)
        c = calls[0]
        assert only is None or c["name"] == only, c
        TOOL_MODELS[c["name"]].model_validate_json(c["arguments"])
        # The same request, blocking: the same call (the signed text is read the same way).
        b = client.chat.completions.create(model=CHAT, tool_choice=choice, **kw).choices[0].message.tool_calls[0]
        assert (b.function.name, b.function.arguments) == (c["name"], c["arguments"]), (b, c)
        # Round trip, streamed: the result back, a text answer.
        msg = {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}]}
        history = ASK + [msg, {"role": "tool", "tool_call_id": c["id"], "content": "21 C, clear"}]
        calls2, text, finish2 = stream_calls(messages=history, tools=TOOLS, tool_choice="none",
                                             max_tokens=32, temperature=0)
        assert calls2 == {} and text and finish2 in ("stop", "length"), (calls2, text, finish2)
    # auto, streamed: text or a valid call.
    calls, content, finish = stream_calls(tool_choice="auto", **kw)
    if calls:
        assert finish == "tool_calls", finish
        for c in calls.values():
            TOOL_MODELS[c["name"]].model_validate_json(c["arguments"])
    else:
        assert finish in ("stop", "length"), finish
    # The SDK's stream helper sees argument deltas and a parsed result.
    with client.chat.completions.stream(model=CHAT, tool_choice="required", **kw) as st:
        done = [e for e in st if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and isinstance(done[0].parsed_arguments, (GetWeather, GetTime)), done


def tools_errors():
    bad = lambda **kw: client.chat.completions.create(model=CHAT, messages=ASK, max_tokens=4, **kw)  # noqa: E731
    expect_error(openai.BadRequestError, 400, "invalid_value",
                 lambda: bad(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "Nope"}}),
                 param="tool_choice")
    expect_error(openai.BadRequestError, 400, "invalid_value",
                 lambda: bad(tools=[{"type": "function", "function": {"name": "has space"}}]),
                 param="tools[0].function.name")
    expect_error(openai.BadRequestError, 400, "invalid_value", lambda: bad(tool_choice="required"),
                 param="tool_choice")
    # gnus.strict: what GCS ignores is refused by name instead.
    bad(prediction={"type": "content", "content": "x"})
    expect_error(openai.BadRequestError, 400, "unsupported_parameter",
                 lambda: bad(prediction={"type": "content", "content": "x"},
                             extra_body={"gnus": {"strict": True}}),
                 param="prediction")


CHECKS = {
    "models": models, "chat_blocking": chat_blocking, "chat_stream": chat_stream,
    "completions": completions, "n_choices": n_choices, "embeddings": embeddings,
    "logprobs": logprobs,
    "cached_prefix": cached_prefix,
    "errors": errors,
    "abort_mid_stream": abort_mid_stream, "concurrent_streams": concurrent_streams,
    "large_response": large_response,
    "structured_outputs": structured_outputs, "json_object": json_object,
    "tools_blocking": tools_blocking, "tools_stream": tools_stream, "tools_errors": tools_errors,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CHECKS)
    for n in names:
        try:
            check(n, CHECKS[n])
        except Exception as e:  # noqa: BLE001 - the harness reads the message
            print(f"FAIL {n}: {e!r}", flush=True)
            raise SystemExit(1)
