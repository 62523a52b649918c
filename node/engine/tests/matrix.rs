//! The model matrix: every supported architecture (llama, qwen2, gemma3) ×
//! weight format (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K
//! and a Q4_K_M-like mix) as a small synthetic GGUF (tests/common/synth.rs:
//! random blocks from a printed seed, a tiny SentencePiece vocabulary),
//! loaded by `Engine::load` and compared with what llama.cpp computed on the
//! same bytes (fixtures `matrix/<arch>-<type>.json`, made by
//! `scripts/fixtures/matrix_reference.sh`): the prompt's tokenization, every
//! logit of the prefill step, the top-5 logits of every teacher-forced step
//! and the free-running greedy tokens. Files of an unknown architecture or
//! tensor type are refused at load with an error naming them.

mod common;
#[path = "common/synth.rs"]
mod synth;

use std::path::PathBuf;

use gcs_engine::llama::KvCache;
use gcs_engine::{cpu_device, Engine, FinishReason, SamplingParams};
use serde_json::Value;
use synth::WType;

/// How far our logits may be from llama.cpp's, by weight format. Where the
/// engine follows llama.cpp's kernel arithmetic (the quantized types, whose
/// activations are quantized the same way) the logits agree to float
/// rounding; F32, F16 and BF16 weights are dequantized to f32 here, while
/// llama.cpp rounds the activations to the weight type (F16/BF16) or sums
/// in another order (F32), so those get the rounding of that type.
fn tolerance(ty: WType) -> f32 {
    match ty {
        WType::F32 => 1e-2,
        WType::F16 => 5e-2,
        WType::BF16 => 0.3,
        // Bit-identical: the engine follows llama.cpp's kernels exactly.
        _ => 0.0,
    }
}

/// A top-2 gap under this (nats) is a near-tie: greedy choices past it may
/// legitimately differ between two correct implementations.
fn near_tie(ty: WType) -> f32 {
    4.0 * tolerance(ty)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("gcs-matrix-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What one combination measured, for the summary table.
struct Row {
    name: String,
    logits0_max: f32,
    steps_max: f32,
    free_run: String,
}

fn check(arch: &str, ty: WType, dir: &std::path::Path) -> Option<Row> {
    let name = format!("{arch}-{}", ty.name());
    let fx = common::fixture(&format!("matrix/{name}.json"))?;
    let seed = synth::seed(arch, ty);
    assert_eq!(fx["seed"].as_str(), Some(format!("{seed:#018x}").as_str()), "{name}: seed");
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, synth::gguf(arch, ty)).unwrap();
    let e = Engine::load(&path, &cpu_device()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(e.card.arch, arch);
    assert_eq!(e.card.name.as_deref(), Some(format!("matrix-{name}").as_str()));
    assert_eq!((e.card.context_tokens, e.card.vocab), (synth::CONTEXT, synth::vocab().len()));

    let prompt = e.tokenizer.encode_with(synth::PROMPT, true, false).unwrap();
    assert_eq!(prompt, ids(&fx["prompt_tokens"]), "{name}: prompt tokens (llama.cpp's SPM)");

    let tol = tolerance(ty);
    // Teacher-forced: llama.cpp's tokens in, our logits compared at each step.
    let want_greedy = ids(&fx["greedy_tokens"]);
    let steps = fx["steps"].as_array().unwrap();
    let mut cache = KvCache::new();
    let mut logits = e.step(&prompt, &mut cache).unwrap();
    let logits0: Vec<f32> =
        fx["logits0"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert_eq!(logits.len(), logits0.len());
    let logits0_max = logits.iter().zip(&logits0).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(logits0_max <= tol, "{name}: prefill logits differ by {logits0_max} > {tol}");
    let mut steps_max = 0f32;
    let mut first_tie = None;
    for (s, step) in steps.iter().enumerate() {
        let top: Vec<(u32, f32)> = step
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
            .collect();
        for &(id, want) in &top {
            steps_max = steps_max.max((logits[id as usize] - want).abs());
        }
        let gap = top[0].1 - top[1].1;
        if gap < near_tie(ty) {
            first_tie.get_or_insert(s);
        } else {
            let ours = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap();
            assert_eq!(ours as u32, top[0].0, "{name}: argmax at step {s} (gap {gap})");
        }
        if let Some(&t) = want_greedy.get(s) {
            logits = e.step(&[t], &mut cache).unwrap();
        }
    }
    assert!(steps_max <= tol, "{name}: top-5 logits differ by {steps_max} > {tol}");

    // Free-running greedy generation through the engine's own loop.
    let max_new = fx["max_new"].as_u64().unwrap() as usize;
    let greedy = SamplingParams::greedy();
    let got = e.generate_from_tokens(&prompt, max_new, &greedy, &[], |_| true).unwrap();
    let free_run = match first_tie {
        None => {
            assert_eq!(got.token_ids, want_greedy, "{name}: greedy tokens");
            let stop = if got.finish_reason == FinishReason::Stop { "eos" } else { "length" };
            assert_eq!(Some(stop), fx["stop"].as_str(), "{name}: finish");
            format!("{}/{} identical", got.token_ids.len(), want_greedy.len())
        }
        Some(t) => {
            let n = t.min(want_greedy.len());
            assert_eq!(
                got.token_ids[..n],
                want_greedy[..n],
                "{name}: greedy tokens before the tie"
            );
            format!("{n} identical up to a near-tie at step {t}")
        }
    };
    Some(Row { name, logits0_max, steps_max, free_run })
}

#[test]
fn every_architecture_and_format_matches_llama_cpp() {
    let dir = scratch();
    let mut rows = Vec::new();
    for arch in synth::ARCHS {
        for ty in synth::WTYPES {
            eprintln!("{arch}-{}: seed {:#018x}", ty.name(), synth::seed(arch, ty));
            match check(arch, ty, &dir) {
                Some(r) => rows.push(r),
                None => return,
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    eprintln!("| combination | max |Δ| prefill logits | max |Δ| top-5, all steps | greedy |");
    for r in &rows {
        eprintln!("| {} | {:.2e} | {:.2e} | {} |", r.name, r.logits0_max, r.steps_max, r.free_run);
    }
    assert_eq!(rows.len(), synth::ARCHS.len() * synth::WTYPES.len());
}

#[test]
fn unknown_architectures_and_tensor_types_are_refused_by_name() {
    let dir = scratch().join("refused");
    std::fs::create_dir_all(&dir).unwrap();
    let mamba = dir.join("mamba.gguf");
    std::fs::write(&mamba, synth::gguf("mamba", WType::Q8_0)).unwrap();
    let err = Engine::load(&mamba, &cpu_device()).unwrap_err().to_string();
    assert!(err.contains("unsupported architecture \"mamba\""), "{err}");
    assert!(err.contains("llama, qwen2, gemma3"), "the error lists what is supported: {err}");

    // IQ2_XXS (16) and Q2_K (10) are real ggml types this engine cannot run.
    for (id, ty_name) in [(16u32, "IQ2_XXS"), (10, "Q2_K")] {
        let p = dir.join(format!("{ty_name}.gguf"));
        let bytes = synth::gguf_retyped("qwen2", WType::Q4_K, Some(("blk.1.ffn_up.weight", id)));
        std::fs::write(&p, bytes).unwrap();
        let err = Engine::load(&p, &cpu_device()).unwrap_err().to_string();
        assert!(err.contains(ty_name) && err.contains("blk.1.ffn_up.weight"), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
