//! Benchmark: prefill tok/s, single-stream decode tok/s, TTFT, peak RSS,
//! embeddings/s, and continuous batching (aggregate decode tok/s and TTFT
//! at 1/4/8/16 concurrent sequences, prefix-cache TTFT speed-up).
//!
//! Usage: engine-bench [--gguf PATH] [--bert DIR] [--tokens N] [--prompt TEXT]
//!                     [--batch-tokens N] [--no-batch] [--constrained]
//!        engine-bench --model PATH [--model PATH ...] [--llama-bench PATH]
//!                     [--rounds N] [--threads N] [--tokens N] [--ctx N] [--json FILE]
//!
//! `--constrained` measures structured outputs instead: the grammar mask's
//! cost per token, and decode tok/s of constrained (JSON Schema) against
//! unconstrained sequences at batch 1 and 8, side by side.
//!
//! `--model PATH` (repeatable) compares models instead, each side by side
//! with llama.cpp when `--llama-bench PATH` is given
//! (`scripts/build-llama-native.sh` builds it): prefill tok/s at 64 and 512
//! tokens, TTFT of a 64-token prompt, steady-state decode tok/s at 1, 8 and
//! 16 streams, one stream after a `--ctx N`-token prompt (default 2000,
//! 0: skip; llama.cpp's `-d N`), peak RSS; `--rounds N` (default 3) alternating rounds,
//! medians; `--threads N` (default: rayon's); `--json FILE` writes them.

use std::time::{Duration, Instant};

#[path = "engine_bench/compare.rs"]
mod compare;
#[path = "engine_bench/ours.rs"]
mod ours;
#[path = "engine_bench/theirs.rs"]
mod theirs;

use gcs_engine::bert::Embedder;
use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, GenerateRequest, Prompt,
    SamplingParams, SeqEvent, SeqRequest,
};

use ours::peak_rss_mib;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let mut gguf =
        format!("{home}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut bert = format!("{home}/.cache/gcs/models/all-minilm-l6-v2");
    let mut n_tokens = 128usize;
    let mut prompt =
        "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
            .to_string();
    let mut batch_tokens = 64usize;
    let mut batch = true;
    let mut constrained = false;
    let mut compare = compare::Args {
        models: vec![],
        llama_bench: None,
        rounds: 3,
        tokens: 128,
        ctx: 2000,
        threads: 0,
        json: None,
    };
    let mut measure_one = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--gguf" => gguf = args.next().ok_or("--gguf needs a path")?,
            "--bert" => bert = args.next().ok_or("--bert needs a dir")?,
            "--tokens" => n_tokens = args.next().ok_or("--tokens needs N")?.parse()?,
            "--prompt" => prompt = args.next().ok_or("--prompt needs text")?,
            "--batch-tokens" => {
                batch_tokens = args.next().ok_or("--batch-tokens needs N")?.parse()?
            }
            "--no-batch" => batch = false,
            "--constrained" => constrained = true,
            "--model" => compare.models.push(args.next().ok_or("--model needs a path")?),
            "--llama-bench" => {
                compare.llama_bench = Some(args.next().ok_or("--llama-bench needs a path")?)
            }
            "--rounds" => compare.rounds = args.next().ok_or("--rounds needs N")?.parse()?,
            "--ctx" => compare.ctx = args.next().ok_or("--ctx needs N")?.parse()?,
            "--threads" => compare.threads = args.next().ok_or("--threads needs N")?.parse()?,
            "--json" => compare.json = Some(args.next().ok_or("--json needs a file")?),
            // One round of --model in a child process (compare.rs).
            "--measure-one" => measure_one = Some(args.next().ok_or("--measure-one needs a path")?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if let Some(path) = measure_one {
        let r = ours::measure(&path, n_tokens, compare.ctx)?;
        println!("{}{}", ours::MARK, serde_json::to_string(&r)?);
        return Ok(());
    }
    if !compare.models.is_empty() {
        compare.tokens = n_tokens;
        if compare.threads == 0 {
            compare.threads = rayon::current_num_threads();
        }
        compare.rounds = compare.rounds.max(1);
        return compare::run(&compare);
    }
    println!("threads: {}", rayon::current_num_threads());
    let device = cpu_device();
    if constrained {
        return constrained_bench(Engine::load(&gguf, &device)?, n_tokens);
    }

    let t = Instant::now();
    let engine = Engine::load(&gguf, &device)?;
    println!(
        "load: {:.2}s, quantized weights {:.1} MB",
        t.elapsed().as_secs_f64(),
        engine.model.weight_bytes() as f64 / 1e6
    );

    // Prefill throughput on a longer prompt (the chat prompt repeated).
    let long: String = std::iter::repeat_n(prompt.as_str(), 8).collect::<Vec<_>>().join(" ");
    let ids = engine.prompt_tokens(&[ChatMessage::new("user", long)])?;
    let mut cache = gcs_engine::llama::KvCache::new();
    let t = Instant::now();
    engine.step(&ids, &mut cache)?;
    let dt = t.elapsed().as_secs_f64();
    println!("prefill: {} tokens in {:.3}s = {:.1} tok/s", ids.len(), dt, ids.len() as f64 / dt);

    // Single-stream decode; ignore EOS so the token count is fixed.
    let req = GenerateRequest {
        messages: vec![ChatMessage::new("user", prompt.clone())],
        max_tokens: n_tokens,
        sampling: SamplingParams::greedy(),
        extra_stop_ids: vec![],
    };
    let prompt_ids = engine.prompt_tokens(&req.messages)?;
    // Warm-up run (page faults, thread pool start).
    engine.generate_from_tokens(&prompt_ids, 4, &req.sampling, &[], |_| true)?;
    let mut first: Option<f64> = None;
    let t = Instant::now();
    let r = engine.generate_from_tokens(&prompt_ids, n_tokens, &req.sampling, &[], |_| {
        first.get_or_insert(t.elapsed().as_secs_f64());
        true
    })?;
    let decoded = r.completion_tokens.saturating_sub(1).max(1);
    println!(
        "generate: prompt {} tok, {} tok generated ({:?}); TTFT (prefill) {:.1} ms, first delta at {:.1} ms",
        r.prompt_tokens,
        r.completion_tokens,
        r.finish_reason,
        r.prefill_secs * 1e3,
        first.unwrap_or(f64::NAN) * 1e3
    );
    println!(
        "decode: {:.1} tok/s single stream ({} steps in {:.3}s)",
        decoded as f64 / r.decode_secs,
        decoded,
        r.decode_secs
    );
    println!("sample output: {:?}", r.text.chars().take(200).collect::<String>());

    if std::path::Path::new(&bert).join("model.safetensors").exists() {
        let emb = Embedder::load(&bert, &device)?;
        let texts: Vec<String> = (0..32)
            .map(|i| format!("This is sentence number {i} about distributed inference networks."))
            .collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        emb.embed(&refs[..4])?;
        let t = Instant::now();
        let mut n = 0;
        for chunk in refs.chunks(16) {
            n += emb.embed(chunk)?.len();
        }
        let dt = t.elapsed().as_secs_f64();
        println!("embeddings: {n} texts in {dt:.3}s = {:.1} emb/s (batch 16)", n as f64 / dt);
    } else {
        println!("embeddings: skipped, {bert} missing");
    }
    if batch {
        batch_bench(Engine::load(&gguf, &device)?, batch_tokens)?;
    }
    println!("peak RSS: {:.1} MiB", peak_rss_mib());
    Ok(())
}

/// Per-request timings: (TTFT, end, completion tokens, cached tokens).
type Timing = (f64, f64, usize, usize);

/// Submit all requests at once and wait for them; returns their timings
/// and the wall time.
fn run_requests(
    be: &BatchEngine,
    reqs: Vec<SeqRequest>,
) -> Result<(Vec<Timing>, f64), Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let streams = reqs.into_iter().map(|r| be.submit(r)).collect::<Result<Vec<_>, _>>()?;
    let out = std::thread::scope(|sc| {
        let hs: Vec<_> = streams
            .into_iter()
            .map(|s| {
                sc.spawn(move || {
                    let mut ttft = f64::NAN;
                    loop {
                        match s.recv_timeout(Duration::from_secs(600)) {
                            Ok(SeqEvent::Delta { token_ids, .. }) => {
                                if ttft.is_nan() && !token_ids.is_empty() {
                                    ttft = t0.elapsed().as_secs_f64();
                                }
                            }
                            Ok(SeqEvent::Done(r)) => {
                                let end = t0.elapsed().as_secs_f64();
                                return Some((ttft, end, r.completion_tokens, r.cached_tokens));
                            }
                            _ => return None,
                        }
                    }
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().ok().flatten()).collect::<Vec<_>>()
    });
    Ok((out, t0.elapsed().as_secs_f64()))
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN)
}

fn batch_bench(engine: Engine, tokens: usize) -> Result<(), Box<dyn std::error::Error>> {
    let be = BatchEngine::start(engine, BatchConfig::default());
    let topics = [
        "a lighthouse",
        "the ocean",
        "a robot",
        "a forest",
        "the moon",
        "a city",
        "a cat",
        "winter",
    ];
    let req = |i: usize, tenant: &str| SeqRequest {
        ignore_eos: true,
        tenant: tenant.into(),
        ..SeqRequest::new(
            Prompt::Chat(vec![ChatMessage::new(
                "user",
                format!("Write a long story about {} (variant {i}).", topics[i % topics.len()]),
            )]),
            tokens,
        )
    };
    run_requests(&be, (0..2).map(|i| req(i, "warm")).collect())?;
    for c in [1usize, 4, 8, 16] {
        let (r, wall) = run_requests(&be, (0..c).map(|i| req(i, &format!("c{c}-{i}"))).collect())?;
        let total: usize = r.iter().map(|x| x.2).sum();
        let mut ttft: Vec<f64> = r.iter().map(|x| x.0).collect();
        let first_all = ttft.iter().copied().fold(0.0, f64::max);
        let decode = (total - r.len()) as f64 / (wall - first_all).max(1e-9);
        println!(
            "batch c={c:2}: {total} tokens in {wall:.2}s = {:.1} tok/s aggregate (incl. prefill), \
             {decode:.1} tok/s decode after all first tokens; TTFT p50 {:.0} ms p99 {:.0} ms",
            total as f64 / wall,
            pct(&mut ttft, 0.5) * 1e3,
            pct(&mut ttft, 0.99) * 1e3,
        );
    }
    // Prefix cache: a long shared system prompt, cold then warm.
    let sys = "You are the assistant of a city library. ".repeat(24);
    let pre = |q: &str| SeqRequest {
        tenant: "prefix".into(),
        ..SeqRequest::new(
            Prompt::Chat(vec![
                ChatMessage::new("system", sys.clone()),
                ChatMessage::new("user", q),
            ]),
            1,
        )
    };
    let (cold, _) = run_requests(&be, vec![pre("When do you open?")])?;
    let (warm, _) = run_requests(&be, vec![pre("Can I borrow ten books?")])?;
    if let (Some(c), Some(w)) = (cold.first(), warm.first()) {
        println!(
            "prefix cache: TTFT cold {:.1} ms, warm {:.1} ms ({} cached tokens) = {:.1}x speed-up",
            c.0 * 1e3,
            w.0 * 1e3,
            w.3,
            c.0 / w.0
        );
    }
    Ok(())
}

/// Items with structure, enums, bounded strings and numbers; at least 500
/// of them, so no sequence can end before its token budget.
const BENCH_SCHEMA: &str = r#"{"type":"array","minItems":500,"items":{"type":"object",
  "properties":{"name":{"type":"string","maxLength":12},"kind":{"enum":["cat","dog","bird"]},
  "age":{"type":"integer","minimum":0,"maximum":30}},
  "required":["name","kind","age"],"additionalProperties":false}}"#;

fn constrained_bench(engine: Engine, tokens: usize) -> Result<(), Box<dyn std::error::Error>> {
    use gcs_engine::constraint::GrammarCompiler;
    use gcs_engine::Grammar;
    let grammar = Grammar::JsonSchema(BENCH_SCHEMA.into());
    // Mask cost alone: walk a document of the schema token by token.
    let gc = GrammarCompiler::new(&engine.tokenizer)?;
    let t = Instant::now();
    let mut g = gc.compile(&grammar)?;
    println!("grammar compile: {:.2} ms", t.elapsed().as_secs_f64() * 1e3);
    let item = r#"{"name": "Rex", "kind": "dog", "age": 4}"#;
    let doc = format!("[{}", vec![item; 40].join(", "));
    let ids = engine.tokenizer.encode_with(&doc, false, false)?;
    let eos = engine.tokenizer.eos_id;
    let (mut total, mut worst) = (0.0f64, 0.0f64);
    for &id in &ids {
        let t = Instant::now();
        let m = g.mask(eos)?;
        let dt = t.elapsed().as_secs_f64();
        total += dt;
        worst = worst.max(dt);
        if !m.allows(id) {
            return Err(format!("token {id} not allowed by the bench grammar").into());
        }
        g.commit(id)?;
    }
    println!(
        "mask: {} tokens, mean {:.1} us, worst {:.1} us per token",
        ids.len(),
        total / ids.len() as f64 * 1e6,
        worst * 1e6
    );
    let be = BatchEngine::start(engine, BatchConfig::default());
    let req = |i: usize, constrained: bool| SeqRequest {
        ignore_eos: true,
        tenant: format!("bench-{i}-{constrained}"),
        grammar: constrained.then(|| grammar.clone()),
        ..SeqRequest::new(
            Prompt::Chat(vec![ChatMessage::new(
                "user",
                format!("List pets as JSON (variant {i}): name, kind and age."),
            )]),
            tokens,
        )
    };
    run_requests(&be, (0..2).map(|i| req(i, true)).collect())?;
    for c in [1usize, 8] {
        let mut line = format!("batch c={c}:");
        for constrained in [false, true] {
            let (r, wall) = run_requests(&be, (0..c).map(|i| req(i, constrained)).collect())?;
            let total: usize = r.iter().map(|x| x.2).sum();
            let first_all = r.iter().map(|x| x.0).fold(0.0, f64::max);
            let decode = (total - r.len()) as f64 / (wall - first_all).max(1e-9);
            let what = if constrained { "constrained" } else { "unconstrained" };
            line.push_str(&format!(" {what} {decode:.1} tok/s ({total} tokens);"));
        }
        println!("{line}");
    }
    Ok(())
}
