//! Gemma 3 270M (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K tensors): the file's
//! layout, its tokenizer and chat format, and greedy generations against
//! llama.cpp's (fixture `gemma3_llamacpp.json`, scripts/fixtures/README.md).

mod common;

use std::collections::BTreeMap;

use gcs_engine::gguf::{GgmlType, GgufFile};
use gcs_engine::tokenizer::GgufTokenizer;
use gcs_engine::{cpu_device, ChatMessage, Engine, SamplingParams};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// What the packaged file is: architecture, shapes, tensor types.
#[test]
fn gemma_file_layout() {
    let Some(path) = common::gemma_path() else { return };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "gemma3");
    let mut types = BTreeMap::new();
    for t in &g.tensors {
        *types.entry(format!("{:?}", t.ggml_type)).or_insert(0) += 1;
    }
    eprintln!("name {:?}, tensor types {types:?}", g.get_str("general.name").unwrap());
    for k in [
        "gemma3.block_count",
        "gemma3.embedding_length",
        "gemma3.attention.head_count",
        "gemma3.attention.head_count_kv",
        "gemma3.attention.key_length",
        "gemma3.attention.sliding_window",
        "gemma3.rope.freq_base",
        "gemma3.context_length",
    ] {
        eprintln!("{k} = {:?}", g.get(k).unwrap());
    }
    assert!(g.get("tokenizer.chat_template").is_none(), "the base model has no template");
    assert_eq!(g.tensor_info("blk.0.ffn_down.weight").unwrap().ggml_type, GgmlType::Q6_K);
    assert_eq!(g.tensor_info("blk.0.attn_output.weight").unwrap().ggml_type, GgmlType::Q4_K);
    assert_eq!(g.tensor_info("blk.0.attn_q.weight").unwrap().ggml_type, GgmlType::Q5_0);
    assert_eq!(g.tensor_info("token_embd.weight").unwrap().ggml_type, GgmlType::Q8_0);
    assert!(g.tensor_info("output.weight").is_err(), "tied embeddings");
}

#[test]
fn gemma_tokenizer_and_chat_format() {
    let Some(path) = common::gemma_path() else { return };
    let g = GgufFile::open(&path).unwrap();
    let tok = GgufTokenizer::from_gguf(&g).unwrap();
    let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi there!")];
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nBe brief.\n\nHi there!<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = tok.encode_chat(&msgs).unwrap();
    // One BOS (the template's), then <start_of_turn> = 105 and "user".
    assert_eq!(&ids[..2], &[2, 105]);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    assert_eq!(tok.decode_with(&ids, true), text);
    assert!(tok.stop_ids.contains(&106), "<end_of_turn> ends generation: {:?}", tok.stop_ids);
    for s in ["Hello world", "  two  spaces\n\nand lines", "naïve café ☕ 12345", "x"] {
        let enc = tok.encode_with(s, false, false).unwrap();
        assert_eq!(tok.decode(&enc), s, "roundtrip {s:?} via {enc:?}");
    }
}

/// The built-in Gemma template and the SentencePiece tokenizer give
/// llama.cpp's prompt tokens for the 20 fixture chats.
#[test]
fn gemma_prompts_tokenize_as_llamacpp() {
    let (Some(path), Some(fx)) = (common::gemma_path(), common::fixture("gemma3_llamacpp.json"))
    else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    let tok = GgufTokenizer::from_gguf(&g).unwrap();
    for p in fx["prompts"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = p["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let rendered = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(rendered, p["rendered"].as_str().unwrap(), "prompt {} render", p["index"]);
        assert_eq!(
            tok.encode_chat(&msgs).unwrap(),
            ids(&p["prompt_tokens"]),
            "prompt {}",
            p["index"]
        );
    }
}

/// Greedy generations of 32 tokens against llama.cpp's.
#[test]
fn gemma_greedy_matches_llamacpp() {
    let (Some(path), Some(fx)) = (common::gemma_path(), common::fixture("gemma3_llamacpp.json"))
    else {
        return;
    };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let prompts = fx["prompts"].as_array().unwrap();
    let mut matched = 0;
    let mut report = Vec::new();
    for p in prompts {
        let idx = p["index"].as_u64().unwrap();
        let prompt = ids(&p["prompt_tokens"]);
        let r = engine
            .generate_from_tokens(&prompt, 32, &SamplingParams::greedy(), &[], |_| true)
            .unwrap();
        let want = ids(&p["greedy_tokens"]);
        if r.token_ids == want {
            matched += 1;
        } else {
            let at = r.token_ids.iter().zip(&want).take_while(|(a, b)| a == b).count();
            report.push(format!(
                "prompt {idx}: diverges at step {at} (llama.cpp top2 there: {})\n  got  {:?}\n  want {:?}",
                p["step_top2"][at],
                r.text,
                engine.tokenizer.decode(&want)
            ));
        }
    }
    eprintln!("gemma greedy: {matched}/{} prompts identical to llama.cpp", prompts.len());
    for r in &report {
        eprintln!("{r}");
    }
    let need = prompts.len() * 9 / 10;
    assert!(matched >= need, "only {matched}/{} greedy generations match", prompts.len());
}

/// Teacher-forced: llama.cpp's own tokens fed back; at every step our
/// top-1 is its top-1 and our log-probabilities of its top-2 are its own.
#[test]
fn gemma_teacher_forced_logprobs_match_llamacpp() {
    let (Some(path), Some(fx)) = (common::gemma_path(), common::fixture("gemma3_llamacpp.json"))
    else {
        return;
    };
    let engine = Engine::load(&path, &cpu_device()).unwrap();
    let (mut steps, mut agree, mut max_err) = (0, 0, 0f64);
    // Four prompts keep this test short; the greedy test covers all twenty.
    for p in &fx["prompts"].as_array().unwrap()[..4] {
        let mut cache = gcs_engine::llama::KvCache::new();
        let mut feed = ids(&p["prompt_tokens"]);
        for (s, top2) in p["step_top2"].as_array().unwrap().iter().enumerate() {
            let logits = engine.step(&feed, &mut cache).unwrap();
            let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
            let ours =
                (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)));
            steps += 1;
            if ours == Some(top2[0]["id"].as_u64().unwrap() as usize) {
                agree += 1;
            }
            for t in top2.as_array().unwrap() {
                let id = t["id"].as_u64().unwrap() as usize;
                let err = (logits[id] as f64 - lse - t["logprob"].as_f64().unwrap()).abs();
                max_err = max_err.max(err);
            }
            let Some(next) = p["greedy_tokens"].get(s) else { break };
            feed = vec![next.as_u64().unwrap() as u32];
        }
    }
    eprintln!("gemma teacher-forced: top-1 {agree}/{steps}, max |Δ logprob| {max_err:.2e}");
    assert_eq!(agree, steps, "top-1 agreement");
    assert!(max_err < 1e-3, "log-probabilities differ by {max_err}");
}

/// The batch engine (paged K/V, chunked prefill, four sequences decoded
/// together) gives llama.cpp's greedy tokens too.
#[test]
fn gemma_batched_paged_matches_llamacpp() {
    let (Some(path), Some(fx)) = (common::gemma_path(), common::fixture("gemma3_llamacpp.json"))
    else {
        return;
    };
    let cfg = gcs_engine::BatchConfig { prefill_chunk: 16, ..gcs_engine::BatchConfig::default() };
    let batch = gcs_engine::BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg);
    let prompts = &fx["prompts"].as_array().unwrap()[4..8];
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            let req = gcs_engine::SeqRequest::new(
                gcs_engine::Prompt::Tokens(ids(&p["prompt_tokens"])),
                32,
            );
            batch.submit(req).unwrap()
        })
        .collect();
    for (p, s) in prompts.iter().zip(streams) {
        let mut got = Vec::new();
        loop {
            match s.recv_timeout(std::time::Duration::from_secs(120)).expect("event in time") {
                gcs_engine::SeqEvent::Delta { token_ids, .. } => got.extend(token_ids),
                gcs_engine::SeqEvent::Done(_) => break,
                gcs_engine::SeqEvent::Error(e) => panic!("sequence failed: {e}"),
            }
        }
        assert_eq!(got, ids(&p["greedy_tokens"]), "prompt {}", p["index"]);
    }
}
