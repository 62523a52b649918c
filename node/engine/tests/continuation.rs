//! Exact continuation: a sequence resumed from the tokens an uninterrupted
//! run delivered continues it bit for bit (needs the model; skips
//! otherwise).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use gcs_engine::attn::KvPool;
use gcs_engine::llama::PagedSeq;
use gcs_engine::sampling::argmax;
use gcs_engine::stop::StopMatcher;
use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, EngineError, FinishReason, Grammar,
    Logprobs, Prompt, SamplingOptions, SamplingParams, SeqEvent, SeqRequest, SeqResult, SeqStream,
};

struct Collected {
    tokens: Vec<u32>,
    deltas: Vec<String>,
    logprobs: Vec<Logprobs>,
    result: SeqResult,
}

fn collect(s: SeqStream) -> Collected {
    let (mut tokens, mut deltas, mut lps) = (Vec::new(), Vec::new(), Vec::new());
    loop {
        match s.recv_timeout(Duration::from_secs(120)).expect("event in time") {
            SeqEvent::Delta { text, token_ids, logprobs } => {
                tokens.extend(token_ids);
                deltas.push(text);
                lps.extend(logprobs);
            }
            SeqEvent::Done(result) => return Collected { tokens, deltas, logprobs: lps, result },
            SeqEvent::Error(e) => panic!("sequence failed: {e}"),
        }
    }
}

fn chat(q: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", q)]
}

/// The text a fresh sequence of `req` has released after `tokens`.
fn released(batch: &BatchEngine, stop: &[String], tokens: &[u32]) -> (String, usize) {
    let mut m = StopMatcher::new(stop);
    let mut text = String::new();
    let mut bytes = 0;
    for &t in tokens {
        let b = batch.tokenizer().token_bytes(t);
        bytes += b.len();
        text.push_str(&m.push(b).text);
    }
    (text, bytes)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn lp_bits(lps: &[Logprobs]) -> Vec<(u32, u32, Vec<(u32, u32)>)> {
    lps.iter()
        .map(|l| {
            let top = l.top.iter().map(|t| (t.token, t.logprob.to_bits())).collect();
            (l.chosen.token, l.chosen.logprob.to_bits(), top)
        })
        .collect()
}

/// The seam's logits: a prompt prefilled and the first `s` generated
/// tokens recomputed in decode order in one (chunked) forward pass equal,
/// bit for bit, the logits of the uninterrupted run after decoding those
/// tokens one step at a time. Recomputing them in prefill order (what a
/// plain prefill of prompt + delivered tokens does) does not.
#[test]
fn seam_logits_are_bit_identical() {
    let Some(path) = common::smollm_path() else { return };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let model = &engine.model;
    let table: Vec<u32> = (0..32).collect();
    let prompt =
        engine.prompt_tokens(&chat("Why is the sky blue? Answer in two sentences.")).unwrap();
    let p = prompt.len();
    let n = 24;
    // Uninterrupted: prefill, then one decode step per token.
    let mut pool = model.new_kv_pool(32);
    let one = |pool: &mut KvPool, tokens: &[u32], past: usize, decode_from: usize| -> Vec<f32> {
        let seq = PagedSeq { tokens, past, table: &table, decode_from };
        model.forward_paged(pool, &[seq]).unwrap()
    };
    let mut logits = one(&mut pool, &prompt, 0, p);
    let (mut gen, mut after) = (Vec::new(), Vec::new());
    for k in 0..n {
        let t = argmax(&logits);
        gen.push(t);
        logits = one(&mut pool, &[t], p + k, p);
        after.push(logits.clone()); // the logits that pick gen[k + 1]
    }
    let reference = engine
        .generate_from_tokens(&prompt, n + 1, &SamplingParams::greedy(), &[], |_| true)
        .unwrap();
    assert_eq!(reference.token_ids[..n], gen[..], "the paged run is the engine's greedy run");
    let mut prefill_order_differs = false;
    for s in [1, 2, 9, 16, 23] {
        let all: Vec<u32> = prompt.iter().chain(&gen[..s]).copied().collect();
        // Resumed: a fresh pool, prompt and delivered tokens in two chunks
        // that do not line up with the prompt's end.
        let mut pool = model.new_kv_pool(32);
        let cut = p - 3;
        one(&mut pool, &all[..cut], 0, p);
        let seam = one(&mut pool, &all[cut..], cut, p);
        assert_eq!(bits(&seam), bits(&after[s - 1]), "seam after {s} delivered tokens");
        let mut pool = model.new_kv_pool(32);
        let prefilled = one(&mut pool, &all, 0, all.len());
        prefill_order_differs |= bits(&prefilled) != bits(&after[s - 1]);
    }
    assert!(prefill_order_differs, "prefill order gives other bits for the delivered tokens");
}

fn sampled(temperature: f32, seed: u64) -> SamplingOptions {
    SamplingOptions { temperature, seed, ..SamplingOptions::default() }
}

fn load(cfg: BatchConfig) -> Option<BatchEngine> {
    let path = common::smollm_path()?;
    Some(BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg))
}

/// Resumed at several seams, greedy and seeded temperature 0.8 (also with
/// top-k/top-p and penalties) streams continue with exactly the tokens,
/// logprobs (bits) and text of the uninterrupted run; usage counts every
/// token once.
#[test]
fn resumed_streams_continue_exactly() {
    // Prefill chunks of 32 so resumed prefills split differently.
    let Some(batch) = load(BatchConfig { prefill_chunk: 32, ..BatchConfig::default() }) else {
        return;
    };
    let prompts = [
        "Write a haiku about the sea.",
        "Why is the sky blue? Explain it to a child in a few sentences.",
        "List three fruits and say one thing about each.",
    ];
    let samplings = [
        SamplingOptions::greedy(),
        sampled(0.8, 11),
        SamplingOptions {
            top_k: 40,
            top_p: 0.95,
            frequency_penalty: 0.4,
            presence_penalty: 0.3,
            ..sampled(0.8, 5)
        },
    ];
    let mut reqs = Vec::new();
    for q in prompts {
        for s in &samplings {
            let mut r = SeqRequest::new(Prompt::Chat(chat(q)), 40);
            r.sampling = s.clone();
            r.logprobs = Some(4);
            reqs.push(r);
        }
    }
    let streams: Vec<SeqStream> = reqs.iter().map(|r| batch.submit(r.clone()).unwrap()).collect();
    let full: Vec<Collected> = streams.into_iter().map(collect).collect();
    let mut pending = Vec::new();
    for (r, f) in reqs.iter().zip(&full) {
        let len = f.tokens.len();
        assert!(len >= 8, "a long enough run: {len}");
        for s in [1, len / 2, len - 1] {
            pending.push((r, f, s, batch.resume(r.clone(), &f.tokens[..s]).unwrap()));
        }
    }
    for (r, f, s, stream) in pending {
        let got = collect(stream);
        let what = format!("{:?} T={} seam {s}", r.prompt, r.sampling.temperature);
        assert_eq!(got.tokens, f.tokens[s..], "{what}");
        assert_eq!(lp_bits(&got.logprobs), lp_bits(&f.logprobs[s..]), "{what}");
        let (before, _) = released(&batch, &r.stop, &f.tokens[..s]);
        assert_eq!(
            before + &got.deltas.concat(),
            f.result.text,
            "{what}: no missing or extra text"
        );
        assert_eq!(got.result.text, f.result.text, "{what}");
        assert_eq!(got.result.completion_tokens, f.result.completion_tokens, "{what}");
        assert_eq!(got.result.resumed_tokens, s, "{what}");
        assert_eq!(got.result.finish_reason, f.result.finish_reason, "{what}");
        assert_eq!(got.result.prompt_tokens, f.result.prompt_tokens, "{what}");
    }
    // Different seeds do give other text (the check above is not vacuous).
    assert_ne!(full[1].tokens, full[2].tokens);
}

/// Seams inside a multi-byte UTF-8 character and inside a stop string
/// (held back, not yet complete), a constrained (JSON) request, and the
/// refusals of states no run could have delivered.
#[test]
fn resume_mid_character_mid_stop_string_and_grammar() {
    let Some(batch) = load(BatchConfig { prefill_chunk: 16, ..BatchConfig::default() }) else {
        return;
    };
    // 1. A seam inside a character.
    let mut r = SeqRequest::new(
        Prompt::Chat(chat("Write 'thank you' in Japanese, Chinese and Korean scripts.")),
        48,
    );
    r.sampling = sampled(0.8, 3);
    let full = collect(batch.submit(r.clone()).unwrap());
    let split: Vec<usize> = (1..full.tokens.len())
        .filter(|&s| {
            let b: Vec<u8> = full.tokens[..s]
                .iter()
                .flat_map(|&t| batch.tokenizer().token_bytes(t).to_vec())
                .collect();
            std::str::from_utf8(&b).is_err()
        })
        .collect();
    assert!(!split.is_empty(), "the run splits a character between tokens: {:?}", full.result.text);
    for &s in split.iter().take(3) {
        let got = collect(batch.resume(r.clone(), &full.tokens[..s]).unwrap());
        assert_eq!(got.tokens, full.tokens[s..], "seam {s}");
        let (before, _) = released(&batch, &r.stop, &full.tokens[..s]);
        assert_eq!(before + &got.deltas.concat(), full.result.text, "seam {s}");
    }

    // 2. A seam inside a stop string spanning two tokens: its first part is
    // held back when the worker is lost; the resumed sequence completes it
    // and stops without releasing any of it.
    let mut plain = SeqRequest::new(Prompt::Chat(chat("Write a haiku about the sea.")), 32);
    plain.sampling = sampled(0.8, 21);
    let text_run = collect(batch.submit(plain.clone()).unwrap());
    let tok_text = |t: u32| String::from_utf8(batch.tokenizer().token_bytes(t).to_vec()).ok();
    let mut tested = false;
    for j in 4..text_run.tokens.len() - 2 {
        let (Some(a), Some(b)) = (tok_text(text_run.tokens[j]), tok_text(text_run.tokens[j + 1]))
        else {
            continue;
        };
        if a.trim().is_empty() || b.trim().is_empty() {
            continue;
        }
        let stop = vec![format!("{a}{b}")];
        let req = SeqRequest { stop: stop.clone(), ..plain.clone() };
        let run = collect(batch.submit(req.clone()).unwrap());
        if run.result.finish_reason != FinishReason::Stop || run.tokens.len() < 2 {
            continue;
        }
        let s = run.tokens.len() - 1;
        let (before, bytes) = released(&batch, &stop, &run.tokens[..s]);
        if before.len() >= bytes {
            continue; // nothing held back at this seam
        }
        let got = collect(batch.resume(req.clone(), &run.tokens[..s]).unwrap());
        assert_eq!(got.tokens, run.tokens[s..], "stop {stop:?}");
        assert_eq!(got.result.finish_reason, FinishReason::Stop);
        assert_eq!(before + &got.deltas.concat(), run.result.text, "stop {stop:?}");
        assert_eq!(got.result.text, run.result.text);
        // The completed stop string cannot be resumed from.
        let err = batch.resume(req, &run.tokens).unwrap_err();
        assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
        tested = true;
        break;
    }
    assert!(tested, "found a two-token stop string held back at a seam");

    // 3. A constrained request.
    if batch.grammars().is_some() {
        let mut g = SeqRequest::new(Prompt::Chat(chat("Describe a cat as a JSON object.")), 40);
        g.grammar = Some(Grammar::JsonObject);
        g.sampling = sampled(0.8, 8);
        let full = collect(batch.submit(g.clone()).unwrap());
        assert!(full.tokens.len() >= 4);
        for s in [1, full.tokens.len() / 2] {
            let got = collect(batch.resume(g.clone(), &full.tokens[..s]).unwrap());
            assert_eq!(got.tokens, full.tokens[s..], "json seam {s}");
            assert_eq!(got.result.text, full.result.text);
        }
        // A token the grammar does not allow first is refused.
        let not_json = batch.tokenizer().encode("Hello").unwrap();
        assert!(batch.resume(g, &not_json).is_err());
    }

    // 4. Refusals: a stop token, as many tokens as max_tokens, a bad id.
    let eos = batch.tokenizer().eos_id;
    let e = batch.resume(plain.clone(), &[text_run.tokens[0], eos]).unwrap_err();
    assert!(matches!(e, EngineError::InvalidRequest(_)), "{e}");
    let long: Vec<u32> = text_run.tokens.iter().copied().cycle().take(32).collect();
    assert!(batch.resume(plain.clone(), &long).is_err(), "max_tokens already reached");
    assert!(batch.resume(plain.clone(), &[u32::MAX]).is_err());
    // Resuming from nothing is a plain run.
    let fresh = collect(batch.resume(plain, &[]).unwrap());
    assert_eq!(fresh.tokens, text_run.tokens);
}
