//! SmolLM2 against llama.cpp fixtures: chat template, tokenizer ids and
//! greedy generations. Skips when the model or fixtures are absent.

mod common;

use gcs_engine::gguf::GgufFile;
use gcs_engine::tokenizer::GgufTokenizer;
use gcs_engine::{cpu_device, ChatMessage, Engine, SamplingParams};

// Model-dependent tests skip (with a message) when scripts/fetch-models.sh
// has not been run.
use serde_json::Value;

fn messages(p: &Value) -> Vec<ChatMessage> {
    p["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn tokenizer_and_template_match_llamacpp() {
    let (Some(path), Some(fx)) = (common::smollm_path(), common::fixture("smollm2_llamacpp.json"))
    else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    let tok = GgufTokenizer::from_gguf(&g).unwrap();
    let mut bad = Vec::new();
    for p in fx["prompts"].as_array().unwrap() {
        let idx = p["index"].as_u64().unwrap();
        let rendered = tok.apply_chat_template(&messages(p), true).unwrap();
        assert_eq!(
            rendered,
            p["rendered"].as_str().unwrap(),
            "prompt {idx}: template render differs"
        );
        let got = tok.encode(&rendered).unwrap();
        if got != ids(&p["prompt_tokens"]) {
            bad.push(format!("prompt {idx}: got {got:?}\n want {:?}", ids(&p["prompt_tokens"])));
        }
    }
    for t in fx["tokenize"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let special = t["special"].as_bool().unwrap();
        let got = tok.encode_with(text, special, false).unwrap();
        let want = ids(&t["tokens"]);
        if got != want {
            bad.push(format!("tokenize {text:?} special={special}: got {got:?}\n want {want:?}"));
        }
        if t["roundtrip"].as_bool() == Some(true) {
            assert_eq!(tok.decode_with(&want, special), text, "detokenize roundtrip");
        }
    }
    assert!(bad.is_empty(), "{} mismatches:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn greedy_matches_llamacpp() {
    let (Some(path), Some(fx)) = (common::smollm_path(), common::fixture("smollm2_llamacpp.json"))
    else {
        return;
    };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let prompts = fx["prompts"].as_array().unwrap();
    let mut matched = 0;
    let mut near_ties = 0;
    let mut report = Vec::new();
    for p in prompts {
        let idx = p["index"].as_u64().unwrap();
        let prompt = engine.prompt_tokens(&messages(p)).unwrap();
        assert_eq!(prompt, ids(&p["prompt_tokens"]), "prompt {idx} tokens");
        let mut streamed = String::new();
        let r = engine
            .generate_from_tokens(&prompt, 32, &SamplingParams::greedy(), &[], |d| {
                streamed.push_str(d);
                true
            })
            .unwrap();
        assert_eq!(streamed, r.text, "streamed deltas add up to the text");
        let want = ids(&p["greedy_tokens"]);
        if r.token_ids == want {
            matched += 1;
        } else {
            let at = r.token_ids.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let top2 = &p["step_top2"][at];
            // Ours at the divergence: the generated token, or the stop token
            // if we ended there.
            let ours = r.token_ids.get(at).copied().unwrap_or(engine.tokenizer.eos_id);
            let gap = top2[0]["logprob"].as_f64().unwrap() - top2[1]["logprob"].as_f64().unwrap();
            if gap < 0.3 {
                near_ties += 1;
            }
            report.push(format!(
                "prompt {idx}: we chose {ours}, llama.cpp's top-2 gap there {gap:.3} nats"
            ));
            report.push(format!(
                "prompt {idx}: diverges at step {at} (llama.cpp top2 there: {top2})\n  got  {:?}\n  want {:?}",
                r.text,
                p["greedy_text"].as_str().unwrap()
            ));
        }
    }
    eprintln!(
        "greedy: {matched}/{} prompts identical to llama.cpp over 32 tokens; {near_ties} of the other {} diverge at a near-tie \
         (llama.cpp's own top-2 there are < 0.3 nats apart)",
        prompts.len(),
        prompts.len() - matched
    );
    for r in &report {
        eprintln!("{r}");
    }
    // Free-running greedy decoding of a 4-bit 135M model is chaotic: one
    // flipped activation rounding changes logits by ~0.1 nats, so sequence
    // parity needs bit-identical arithmetic with the reference build (AMX
    // matmuls, ggml's f16 attention kernels, GCC-contracted RoPE). The
    // engine reproduces it: 20/20 when measured.
    assert!(matched >= 18, "only {matched}/20 greedy generations match llama.cpp");
    assert_eq!(matched + near_ties, prompts.len(), "a divergence that is not a near-tie");
}

/// Teacher-forced comparison: feed llama.cpp's own greedy tokens and check
/// at every step that our next-token distribution agrees with its top-2.
#[test]
fn teacher_forced_logits_match_llamacpp() {
    let (Some(path), Some(fx)) = (common::smollm_path(), common::fixture("smollm2_llamacpp.json"))
    else {
        return;
    };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let (mut steps, mut top1_agree, mut sum_err, mut max_err) = (0usize, 0usize, 0f64, 0f32);
    let mut near_tie_misses = 0usize;
    for p in fx["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_tokens"]);
        let mut forced = ids(&p["greedy_tokens"]);
        if let Some(stop) = p["stop_token_id"].as_u64() {
            forced.push(stop as u32);
        }
        let mut cache = gcs_engine::llama::KvCache::new();
        let mut logits = engine.step(&prompt, &mut cache).unwrap();
        for (k, top2) in p["step_top2"].as_array().unwrap().iter().enumerate() {
            // Log-sum-exp in f64 so that the error measured is ours, not
            // this loop's (the fixture rounds log-probs to 1e-7).
            let max = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            let want_id = top2[0]["id"].as_u64().unwrap() as usize;
            let want_lp = top2[0]["logprob"].as_f64().unwrap() as f32;
            let second_lp = top2[1]["logprob"].as_f64().unwrap() as f32;
            let err = (logits[want_id] as f64 - lse - want_lp as f64).abs() as f32;
            sum_err += err as f64;
            max_err = max_err.max(err);
            steps += 1;
            let ours = gcs_engine::sampling::argmax(&logits) as usize;
            if ours == want_id {
                top1_agree += 1;
            } else {
                let second_id = top2[1]["id"].as_u64().unwrap() as usize;
                if ours == second_id && want_lp - second_lp < 0.5 {
                    near_tie_misses += 1;
                }
            }
            if k < forced.len() {
                logits = engine.step(&[forced[k]], &mut cache).unwrap();
            }
        }
    }
    let mean = sum_err / steps as f64;
    eprintln!(
        "teacher-forced: {steps} steps, top-1 agreement {top1_agree}/{steps} ({near_tie_misses} of the misses are llama.cpp's #2 within 0.5 nats), \
         |Δ logprob| of llama.cpp's token: mean {mean:.2e}, max {max_err:.2e}"
    );
    // With bit-identical logits (tests/llamacpp_ops.rs) what remains is the
    // fixture's own f32 softmax over 49k logits and its 1e-7 rounding:
    // measured 530/530, mean 9.2e-5, max 2.8e-4. A single float-order
    // mismatch anywhere shows up as ~1e-2 (mean 0.036, max 0.37 before the
    // attention and RoPE orders were fixed).
    assert_eq!(top1_agree, steps, "top-1 agreement {top1_agree}/{steps}");
    assert!(mean < 5e-4, "mean logprob error {mean}");
    assert!(max_err < 2e-3, "max logprob error {max_err}");
}

/// Several sequences decoded in one forward call (the continuous-batching
/// path) give the same logits as decoding each alone.
#[test]
fn batched_decode_matches_single_sequence() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let a = engine.prompt_tokens(&[ChatMessage::new("user", "Name a colour.")]).unwrap();
    let b = engine
        .prompt_tokens(&[ChatMessage::new("user", "What is two plus two? Answer briefly please.")])
        .unwrap();
    let (mut ca, mut cb) = (gcs_engine::llama::KvCache::new(), gcs_engine::llama::KvCache::new());
    let la = engine.step(&a, &mut ca).unwrap();
    let lb = engine.step(&b, &mut cb).unwrap();
    let (ta, tb) = (gcs_engine::sampling::argmax(&la), gcs_engine::sampling::argmax(&lb));
    // Reference: each sequence alone.
    let (mut ra, mut rb) = (ca.clone(), cb.clone());
    let single_a = engine.step(&[ta], &mut ra).unwrap();
    let single_b = engine.step(&[tb], &mut rb).unwrap();
    // Batched: both in one call.
    let logits = engine
        .model
        .forward(&mut [
            gcs_engine::llama::SeqInput { tokens: &[ta], cache: &mut ca },
            gcs_engine::llama::SeqInput { tokens: &[tb], cache: &mut cb },
        ])
        .unwrap();
    let v: Vec<f32> = logits.into_data().try_into_vec::<f32>().unwrap();
    let vocab = single_a.len();
    assert_eq!(v.len(), 2 * vocab);
    // Same arithmetic per row, so results are identical.
    assert_eq!(&v[..vocab], &single_a[..]);
    assert_eq!(&v[vocab..], &single_b[..]);
    assert_eq!(ca.len(), a.len() + 1);
    assert_eq!(cb.len(), b.len() + 1);
}

/// End-to-end chat generation with sampling: seeded runs are reproducible,
/// deltas add up to the text, counts are reported and max_tokens holds.
#[test]
fn sampled_generation_is_reproducible() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let req = gcs_engine::GenerateRequest {
        messages: vec![ChatMessage::new("user", "Tell me a short fact about the moon.")],
        max_tokens: 24,
        sampling: SamplingParams { temperature: 0.8, top_p: 0.95, top_k: 40, seed: 7 },
        extra_stop_ids: vec![],
    };
    let run = || {
        let mut deltas = Vec::new();
        let r = engine
            .generate(&req, |d| {
                deltas.push(d.to_string());
                true
            })
            .unwrap();
        assert_eq!(deltas.concat(), r.text);
        r
    };
    let (a, b) = (run(), run());
    assert_eq!(a.token_ids, b.token_ids);
    assert!(a.completion_tokens > 0 && a.completion_tokens <= 24);
    assert_eq!(a.prompt_tokens, engine.prompt_tokens(&req.messages).unwrap().len());
    assert!(!a.text.trim().is_empty());
    // Cancelling from the callback stops generation.
    let mut n = 0;
    let r = engine
        .generate(&req, |_| {
            n += 1;
            n < 3
        })
        .unwrap();
    assert_eq!(r.finish_reason, gcs_engine::FinishReason::Cancelled);
}
