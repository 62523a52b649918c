"""Issue 18's SDK check with the official OpenAI Python SDK: the gateway
lists every chat model its workers serve, and each answers a chat, blocking
and streaming.

Run by node/tests/sdk_models.rs (one worker serving both models, then two
workers serving one each), which passes GCS_BASE_URL, GCS_KEY and
GCS_MODELS (the chat model ids, comma-separated). Answers are checked for
form and usage, not quality (the Gemma file may be a pretrained model).
Exits 1 on the first failure.
"""
import os

from openai import OpenAI

BASE = os.environ["GCS_BASE_URL"]
KEY = os.environ["GCS_KEY"]
MODELS = os.environ["GCS_MODELS"].split(",")
MSG = [{"role": "user", "content": "Name a colour."}]
MAX = 12

client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


def blocking(model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=MAX, temperature=0)
    assert r.object == "chat.completion" and r.model == model, r
    assert len(r.choices) == 1, r
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant", c
    assert isinstance(c.message.content, str) and c.message.content, r
    assert c.finish_reason in ("stop", "length"), c
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= MAX, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert (c.finish_reason == "length") == (u.completion_tokens == MAX), (c, u)
    return c.message.content, c.finish_reason, u


def streaming(model):
    s = client.chat.completions.create(model=model, messages=MSG, max_tokens=MAX, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, finishes, usage, ids, roles = "", [], None, set(), 0
    for ch in s:
        assert ch.object == "chat.completion.chunk" and ch.model == model, ch
        ids.add(ch.id)
        if ch.usage is not None:
            assert ch.choices == [] and usage is None, ch
            usage = ch.usage
            continue
        d = ch.choices[0]
        roles += d.delta.role == "assistant"
        text += d.delta.content or ""
        if d.finish_reason is not None:
            finishes.append(d.finish_reason)
    assert len(ids) == 1, ids
    assert roles == 1, roles
    assert len(finishes) == 1, finishes
    assert usage is not None, "no usage chunk"
    return text, finishes[0], usage


def main():
    listed = {m.id: m for m in client.models.list()}
    for model in MODELS:
        assert model in listed, (model, sorted(listed))
        assert listed[model].object == "model", listed[model]
        assert client.models.retrieve(model).id == model
    prompts = {}
    for model in MODELS:
        text, finish, u = blocking(model)
        s_text, s_finish, s_u = streaming(model)
        # Greedy on the same model and worker: the stream is the same answer.
        assert (s_text, s_finish) == (text, finish), (model, s_text, text)
        assert (s_u.prompt_tokens, s_u.completion_tokens) == (u.prompt_tokens, u.completion_tokens)
        prompts[model] = u.prompt_tokens
        print(f"{model}: {text!r} ({finish}; prompt {u.prompt_tokens}, "
              f"completion {u.completion_tokens} tokens), streamed alike", flush=True)
    # Each model's own chat template and tokenizer counted the prompt.
    assert len(set(prompts.values())) == len(prompts), prompts


if __name__ == "__main__":
    main()
