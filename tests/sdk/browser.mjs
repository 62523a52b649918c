// A browser streams from the gateway: headless Chromium (Debian's package,
// driven by playwright-core) runs a page whose fetch() reads the SSE body as
// it arrives. The page is on the gateway's origin (Chromium's local-network
// rules stop a page elsewhere from calling 127.0.0.1 headless; CORS is
// checked with curl in streaming.py). Env: GCS_BASE_URL, GCS_KEY,
// GCS_JS_DIR, GCS_CHROMIUM.
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const require = createRequire(process.env.GCS_JS_DIR + "/package.json");
const { chromium } = require("playwright-core");

const browser = await chromium.launch({
  executablePath: process.env.GCS_CHROMIUM,
  args: ["--no-sandbox", "--headless=new"],
});
try {
  const page = await browser.newPage();
  await page.goto(process.env.GCS_BASE_URL.replace(/\/v1$/, "/health"));
  const result = await page.evaluate(async ({ base, key }) => {
    const t0 = performance.now();
    const r = await fetch(`${base}/chat/completions`, {
      method: "POST",
      headers: { "Authorization": `Bearer ${key}`, "Content-Type": "application/json" },
      // 128 tokens (EOS banned): at least ~0.4 s of decoding on 2 cores,
      // so a scheduling burst on a loaded machine cannot pass for
      // buffering (48 tokens spanned under 200 ms on a fast CPU).
      body: JSON.stringify({ model: "gnus-auto", stream: true, max_tokens: 128, temperature: 0,
        logit_bias: { "0": -100, "1": -100, "2": -100 },
        messages: [{ role: "user", content: "Tell a story about a lighthouse." }] }),
    });
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    const reads = [];
    let text = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      const s = dec.decode(value, { stream: true });
      text += s;
      if (s.includes('"content":')) reads.push(performance.now() - t0);
    }
    return { status: r.status, reads, text, requestId: r.headers.get("x-request-id") };
  }, { base: process.env.GCS_BASE_URL, key: process.env.GCS_KEY });
  assert.equal(result.status, 200);
  assert.ok(result.requestId?.startsWith("gcsapi_"), "x-request-id not exposed to the page");
  assert.ok(result.text.trimEnd().endsWith("data: [DONE]"), result.text.slice(-200));
  assert.ok(result.reads.length >= 10, `only ${result.reads.length} reads carried tokens: buffered`);
  const span = result.reads.at(-1) - result.reads[0];
  assert.ok(span > 200, `tokens arrived within ${span} ms: buffered`);
  console.log(`PASS browser: ${result.reads.length} reads with tokens, first at ${result.reads[0].toFixed(0)} ms, span ${span.toFixed(0)} ms`);
} finally {
  await browser.close();
}
