// Reference decode speed of llama.cpp on the same GGUF, for comparison with
// engine-bench. Needs node-llama-cpp installed somewhere (prebuilt binaries):
//   NODE_LLAMA_CPP=/path/to/node_modules/node-llama-cpp node bench/llamacpp_decode.mjs
const lib = process.env.NODE_LLAMA_CPP ?? "node-llama-cpp";
const {getLlama, LlamaCompletion} = await import(lib.startsWith("/") ? `${lib}/dist/index.js` : lib);
const home = process.env.HOME ?? "/root";
const modelPath = process.env.GGUF ?? `${home}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf`;
const llama = await getLlama({gpu: false, build: "never"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({threads: 2, contextSize: 2048});
const text = "<|im_start|>user\nWrite a detailed story about a lighthouse keeper who finds a message in a bottle.<|im_end|>\n<|im_start|>assistant\n";
for (let run = 0; run < 2; run++) {
  const seq = context.getSequence();
  const comp = new LlamaCompletion({contextSequence: seq});
  let n = 0, tFirst = null;
  const t0 = performance.now();
  await comp.generateCompletion(text, {maxTokens: 128, temperature: 0, onToken: (t) => { n += t.length; if (tFirst === null) tFirst = performance.now(); }});
  const t1 = performance.now();
  console.log(`run ${run}: TTFT ${(tFirst - t0).toFixed(1)} ms, decode ${((n - 1) / ((t1 - tFirst) / 1000)).toFixed(1)} tok/s (${n} tokens)`);
  seq.dispose();
}
process.exit(0);
