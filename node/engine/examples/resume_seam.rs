//! The engine's share of an exact continuation's seam: how long
//! `BatchEngine::resume` takes to its first new token after `n` delivered
//! tokens (prompt prefill + the delivered tokens recomputed in decode
//! order, one chunked pass), against the uninterrupted run's gap between
//! two tokens. Also checks that every resumed run continues exactly.
//!
//! `cargo run --release -p gcs-engine --example resume_seam -- [model.gguf] [delivered] [runs]`

use std::time::{Duration, Instant};

use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, Prompt, SamplingOptions, SeqEvent,
    SeqRequest,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let default =
        format!("{home}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let path = args.get(1).cloned().unwrap_or(default);
    let delivered: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200);
    let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10);
    let engine = BatchEngine::start(Engine::load(&path, &cpu_device())?, BatchConfig::default());
    let ask = "Write a long story about a lighthouse keeper and a storm, with many details.";
    let mut req =
        SeqRequest::new(Prompt::Chat(vec![ChatMessage::new("user", ask)]), delivered + 20);
    req.sampling = SamplingOptions { temperature: 0.8, seed: 3, ..SamplingOptions::default() };
    req.ignore_eos = true;
    // The uninterrupted run: its tokens and the gaps between deltas.
    let s = engine.submit(req.clone())?;
    let (mut tokens, mut gaps) = (Vec::new(), Vec::new());
    let mut last = Instant::now();
    while let Some(ev) = s.recv() {
        match ev {
            SeqEvent::Delta { token_ids, .. } => {
                if !tokens.is_empty() {
                    gaps.push(last.elapsed());
                }
                last = Instant::now();
                tokens.extend(token_ids);
            }
            SeqEvent::Done(_) => break,
            SeqEvent::Error(e) => return Err(e.into()),
        }
    }
    // A tenant of its own per resume: nothing comes from the prefix cache,
    // as on a worker that never saw the job. Then one with the cache warm.
    let (mut firsts, mut cached) = (Vec::new(), Vec::new());
    for i in 0..=runs {
        let mut r = req.clone();
        if i < runs {
            r.tenant = format!("resume-{i}");
        }
        let t0 = Instant::now();
        let s = engine.resume(r, &tokens[..delivered])?;
        let mut got = Vec::new();
        let mut first = None;
        while let Some(ev) = s.recv() {
            match ev {
                SeqEvent::Delta { token_ids, .. } => {
                    first.get_or_insert_with(|| t0.elapsed());
                    got.extend(token_ids);
                }
                SeqEvent::Done(_) => break,
                SeqEvent::Error(e) => return Err(e.into()),
            }
        }
        assert_eq!(got, tokens[delivered..], "the resumed run continues exactly");
        if i < runs {
            firsts.extend(first)
        } else {
            cached.extend(first)
        }
    }
    // The same positions as a plain prompt (prefill order throughout): what
    // the recompute would cost without the decode-order rows.
    let prompt = engine.prompt_tokens(&[ChatMessage::new("user", ask)])?;
    let all: Vec<u32> = prompt.iter().chain(&tokens[..delivered]).copied().collect();
    let mut plain = Vec::new();
    for i in 0..runs.min(3) {
        let mut r = SeqRequest::new(Prompt::Tokens(all.clone()), 1);
        r.tenant = format!("plain-{i}");
        let t0 = Instant::now();
        let s = engine.submit(r)?;
        while let Some(ev) = s.recv() {
            if matches!(ev, SeqEvent::Done(_) | SeqEvent::Error(_)) {
                break;
            }
        }
        plain.push(t0.elapsed());
    }
    println!("prompt {} + delivered {delivered} tokens", prompt.len());
    let pct = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v[((v.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
    };
    println!(
        "delivered {delivered} tokens, {runs} resumes: first new token p50 {:.1} ms p99 {:.1} ms; \
         with the prefix cache warm {:.1} ms; uninterrupted inter-delta gap p50 {:.1} ms p99 {:.1} ms",
        pct(&mut firsts, 0.5),
        pct(&mut firsts, 0.99),
        pct(&mut cached, 0.5),
        pct(&mut gaps, 0.5),
        pct(&mut gaps, 0.99)
    );
    println!("the same positions prefilled as a prompt: p50 {:.1} ms", pct(&mut plain, 0.5));
    Ok(())
}
