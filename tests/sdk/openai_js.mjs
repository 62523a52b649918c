// The official OpenAI JavaScript SDK against a running GCS gateway.
// Run by node/tests/http_api.rs with GCS_BASE_URL, GCS_KEY and
// NODE_PATH-free resolution from GCS_JS_DIR. Exits 1 on the first failure.
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const require = createRequire(process.env.GCS_JS_DIR + "/package.json");
const OpenAI = require("openai").default ?? require("openai");

const client = new OpenAI({ baseURL: process.env.GCS_BASE_URL, apiKey: process.env.GCS_KEY, maxRetries: 0 });
const CHAT = "gnus-auto";
const MSG = [{ role: "user", content: "Name three colours." }];

async function check(name, fn) {
  const t = Date.now();
  try {
    await fn();
  } catch (e) {
    console.log(`FAIL ${name}: ${e?.stack ?? e}`);
    process.exit(1);
  }
  console.log(`PASS ${name} (${((Date.now() - t) / 1000).toFixed(2)}s)`);
}

let blocking;
await check("models", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.ok(ids.includes(CHAT) && ids.includes("gnus-embed"), ids.join(","));
  assert.equal((await client.models.retrieve(CHAT)).id, CHAT);
});
await check("chat_blocking", async () => {
  blocking = await client.chat.completions.create({ model: CHAT, messages: MSG, max_tokens: 24, temperature: 0 });
  assert.ok(blocking.choices[0].message.content.length > 0);
  assert.ok(blocking.usage.completion_tokens > 0);
});
await check("chat_stream", async () => {
  const s = await client.chat.completions.create({
    model: CHAT, messages: MSG, max_tokens: 24, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  let text = "", finishes = 0, usage = null;
  for await (const ch of s) {
    if (ch.usage) { assert.deepEqual(ch.choices, []); usage = ch.usage; continue; }
    text += ch.choices[0].delta.content ?? "";
    if (ch.choices[0].finish_reason) finishes++;
  }
  assert.equal(finishes, 1);
  assert.equal(text, blocking.choices[0].message.content);
  assert.equal(usage.completion_tokens, blocking.usage.completion_tokens);
});
await check("completions", async () => {
  const r = await client.completions.create({ model: CHAT, prompt: "The sky is", max_tokens: 8, temperature: 0 });
  assert.ok(r.choices[0].text.length > 0);
});
await check("embeddings", async () => {
  const r = await client.embeddings.create({ model: "gnus-embed", input: ["a cat", "a dog", "tea", "rain", "snow"] });
  assert.equal(r.data.length, 5);
  r.data.forEach((d, i) => { assert.equal(d.index, i); assert.equal(d.embedding.length, 384); });
});
await check("errors", async () => {
  const bad = new OpenAI({ baseURL: process.env.GCS_BASE_URL, apiKey: "gnus_nope", maxRetries: 0 });
  await assert.rejects(bad.chat.completions.create({ model: CHAT, messages: MSG }),
    (e) => e.status === 401 && e.code === "invalid_api_key");
  await assert.rejects(client.chat.completions.create({ model: "no-such-model", messages: MSG }),
    (e) => e.status === 404 && e.code === "model_not_found");
  await assert.rejects(client.chat.completions.create({ model: CHAT, messages: MSG, top_p: 7 }),
    (e) => e.status === 400 && e.param === "top_p");
});
await check("abort_mid_stream", async () => {
  const ac = new AbortController();
  const s = await client.chat.completions.create(
    // Greedy, as the Python SDK's abort test: sampled at temperature 1 the
    // story sometimes ended after 4 deltas (CI, 2026-12-05).
    { model: CHAT, messages: [{ role: "user", content: "Tell a long story." }], max_tokens: 1500,
      temperature: 0, stream: true },
    { signal: ac.signal });
  let n = 0;
  try {
    for await (const ch of s) {
      if (ch.choices[0]?.delta?.content) n++;
      if (n === 5) { ac.abort(); break; }
    }
  } catch (e) {
    // Some SDK versions end the iteration on abort, others throw an abort error.
    assert.ok(e.name === "AbortError" || e.constructor.name === "APIUserAbortError", String(e));
  }
  assert.equal(n, 5);
  const t0 = Date.now();
  for (;;) {
    const m = await (await fetch(process.env.GCS_BASE_URL.replace("/v1", "/metrics"))).text();
    const active = Number(/^gcs_worker_active_jobs (\d+)/m.exec(m)[1]);
    if (active === 0) break;
    assert.ok(Date.now() - t0 < 1000, "worker still busy 1 s after abort");
    await new Promise((r) => setTimeout(r, 20));
  }
});
// Tool calling (issue 19): the SDK's own tool loop, streamed, then a final answer.
const getTime = (calls) => ({
  type: "function",
  function: {
    name: "get_time", description: "The local time in a time zone",
    parameters: {
      type: "object", properties: { zone: { type: "string", maxLength: 16 } },
      required: ["zone"], additionalProperties: false,
    },
    strict: true,
    parse: JSON.parse,
    function: (args) => { calls.push(args); return { time: "14:05" }; },
  },
});
await check("run_tools", async () => {
  const calls = [];
  const ask = [{ role: "user", content: "What time is it in Tokyo?" }];
  // A named choice: one call, its result appended, the runner ends.
  const runner = client.chat.completions.runTools({
    model: CHAT, messages: ask, max_tokens: 96, temperature: 0, stream: true,
    tool_choice: { type: "function", function: { name: "get_time" } }, tools: [getTime(calls)],
  });
  await runner.done();
  assert.equal(calls.length, 1);
  assert.equal(typeof calls[0].zone, "string");
  const history = runner.messages;
  const call = history.find((m) => m.role === "assistant").tool_calls[0];
  assert.ok(call.id.startsWith("call_") && call.function.name === "get_time", JSON.stringify(call));
  assert.equal(history.at(-1).role, "tool");
  assert.equal(history.at(-1).tool_call_id, call.id);
  // The round trip's last step: the result in, a text answer out.
  const done = await client.chat.completions.create({
    model: CHAT, messages: history, tools: [getTime([])].map(({ type, function: f }) => (
      { type, function: { name: f.name, parameters: f.parameters } })),
    tool_choice: "none", max_tokens: 24, temperature: 0,
  });
  assert.ok(done.choices[0].message.content.length > 0);
  // auto, blocking, at most three rounds: every call the loop ran had parseable arguments.
  const auto = client.chat.completions.runTools(
    { model: CHAT, messages: ask, max_tokens: 96, temperature: 0, tools: [getTime(calls)] },
    { maxChatCompletions: 3 });
  await auto.done();
  for (const c of calls) assert.equal(typeof c.zone, "string");
});
