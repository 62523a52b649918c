//! Timed profile of single-stream decode steps: wall time per op of one
//! step (quant::profile), the step itself and sampling, for the table in
//! node/engine/README.md.
//!
//! usage: cargo run --release -p gcs-engine --example decode_profile -- [GGUF] [STEPS] [PAST] [paged]
//!
//! Decodes STEPS tokens (default 128) after a PAST-token prompt (default
//! 64) through `Llama::forward` with the contiguous cache (the
//! `Engine::generate` path), or with `paged` through `Llama::forward_paged`
//! on a K/V pool (the batch engine's path), alternating timed and untimed
//! steps so the probes' own cost shows as the difference of the two step
//! times.

use std::time::Instant;

use gcs_engine::gguf::GgufFile;
use gcs_engine::llama::{KvCache, Llama, PagedSeq, SeqInput};
use gcs_engine::par::SpinPool;
use gcs_engine::quant::profile;
use gcs_engine::sampling::{Sampler, SamplingOptions};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| {
        format!(
            "{}/.cache/gcs/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into())
        )
    });
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(128);
    let past: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let paged = args.next().as_deref() == Some("paged");
    let g = GgufFile::open(&path).expect("open GGUF");
    let m = Llama::from_gguf(&g, &gcs_engine::cpu_device()).expect("load model");
    let kind = if paged { "paged" } else { "contiguous" };
    println!(
        "{path}: {} threads, {past}-token prompt, {steps} steps, {kind} K/V",
        rayon::current_num_threads()
    );
    let mut cache = KvCache::new();
    let table: Vec<u32> = (0..(past + steps + 1).div_ceil(16) as u32).collect();
    let mut pool = m.new_kv_pool(if paged { table.len() } else { 0 });
    let prompt: Vec<u32> = (0..past as u32).map(|i| 1000 + 7 * i).collect();
    let mut pos = 0;
    // As the batch engine's step loop runs a forward pass.
    let threads = SpinPool::for_rayon();
    // One step: the contiguous cache, or the pool's next position.
    let mut step = |toks: &[u32]| -> Vec<f32> {
        if paged {
            let seq = PagedSeq { tokens: toks, past: pos, table: &table, decode_from: past };
            pos += toks.len();
            rayon::scope(|_| threads.install(|| m.forward_paged(&mut pool, &[seq])))
                .expect("paged step")
        } else {
            let logits =
                m.forward(&mut [SeqInput { tokens: toks, cache: &mut cache }]).expect("step");
            logits.into_data().try_into_vec::<f32>().expect("f32 logits")
        }
    };
    // The prompt (prefill) with the probes on, as its own table.
    profile::enable(true);
    let t = Instant::now();
    for chunk in prompt.chunks(512) {
        let _ = step(chunk);
    }
    let prefill_ns = t.elapsed().as_nanos();
    profile::enable(false);
    println!(
        "prefill of {past} tokens: {:.1} ms ({:.1} tok/s)",
        prefill_ns as f64 / 1e6,
        past as f64 * 1e9 / prefill_ns as f64
    );
    print_table(profile::take(), prefill_ns, 1.0, "prefill (timed)");
    let mut sampler = Sampler::new(SamplingOptions {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 40,
        seed: 1,
        ..SamplingOptions::greedy()
    });
    let (mut timed_ns, mut plain_ns, mut sample_ns) = (0u128, 0u128, 0u128);
    let mut tok = 2000u32;
    for i in 0..steps {
        let timed = i % 2 == 0;
        profile::enable(timed);
        let t = Instant::now();
        let logits = step(&[tok]);
        let dt = t.elapsed().as_nanos();
        profile::enable(false);
        if timed {
            timed_ns += dt;
            let t = Instant::now();
            tok = sampler.sample(&logits);
            sample_ns += t.elapsed().as_nanos();
        } else {
            plain_ns += dt;
            tok = sampler.sample(&logits);
        }
    }
    let n_timed = steps.div_ceil(2) as f64;
    let per = |ns: u128| ns as f64 / 1e6 / n_timed;
    let step = per(timed_ns);
    print_table(profile::take(), timed_ns, n_timed, "decode step (timed)");
    println!(
        "| sampling (T 0.8, top-k 40, top-p 0.95), after the step | {:.3} | | 1 |",
        per(sample_ns)
    );
    let plain = plain_ns as f64 / 1e6 / (steps / 2).max(1) as f64;
    println!(
        "untimed steps: {plain:.3} ms ({:.1} tok/s); timed steps {step:.3} ms; probe cost ≈ {:.3} ms",
        1e3 / plain,
        step - plain
    );
}

/// The profile's rows over `total_ns` of wall time, per `per` passes.
fn print_table(mut rows: Vec<(String, u64, u64)>, total_ns: u128, per: f64, what: &str) {
    let ms = |ns: u128| ns as f64 / 1e6 / per;
    rows.sort_by_key(|r| std::cmp::Reverse(r.1));
    let booked: u64 = rows.iter().map(|r| r.1).sum();
    println!("| op | ms / pass | share | calls / pass |");
    println!("|---|---:|---:|---:|");
    for (name, ns, calls) in &rows {
        println!(
            "| {name} | {:.3} | {:.1}% | {:.0} |",
            ms(*ns as u128),
            100.0 * *ns as f64 / total_ns as f64,
            *calls as f64 / per
        );
    }
    let rest = total_ns.saturating_sub(booked as u128);
    println!(
        "| unbooked (logits to host, allocation, loop) | {:.3} | {:.1}% | |",
        ms(rest),
        100.0 * rest as f64 / total_ns as f64
    );
    println!("| **{what}** | **{:.3}** | 100% | |", ms(total_ns));
}
