//! Benchmark: prefill tok/s, single-stream decode tok/s, TTFT, peak RSS,
//! embeddings/s.
//!
//! Usage: engine-bench [--gguf PATH] [--bert DIR] [--tokens N] [--prompt TEXT]

use std::time::Instant;

use gcs_engine::bert::Embedder;
use gcs_engine::{cpu_device, ChatMessage, Engine, GenerateRequest, SamplingParams};

fn peak_rss_mib() -> f64 {
    // VmHWM is the peak resident set size of this process.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let mut gguf =
        format!("{home}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut bert = format!("{home}/.cache/gcs/models/all-minilm-l6-v2");
    let mut n_tokens = 128usize;
    let mut prompt =
        "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
            .to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--gguf" => gguf = args.next().ok_or("--gguf needs a path")?,
            "--bert" => bert = args.next().ok_or("--bert needs a dir")?,
            "--tokens" => n_tokens = args.next().ok_or("--tokens needs N")?.parse()?,
            "--prompt" => prompt = args.next().ok_or("--prompt needs text")?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    println!("threads: {}", rayon::current_num_threads());
    let device = cpu_device();

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
    println!("peak RSS: {:.1} MiB", peak_rss_mib());
    Ok(())
}
