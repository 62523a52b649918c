//! Constrained decoding on the real model (skips without it): every sampled
//! sequence under a grammar is a document of that grammar, whatever the
//! seed; a constrained sequence leaves its batch neighbours' tokens alone.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, FinishReason, Grammar, Prompt,
    SamplingOptions, SeqEvent, SeqRequest, SeqResult, SeqStream,
};
use serde_json::Value;

struct Collected {
    tokens: Vec<u32>,
    logprobs: Vec<gcs_engine::Logprobs>,
    result: SeqResult,
}

fn collect(s: SeqStream) -> Collected {
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        match s.recv_timeout(Duration::from_secs(120)).expect("event in time") {
            SeqEvent::Delta { token_ids, logprobs: lp, .. } => {
                tokens.extend(token_ids);
                logprobs.extend(lp);
            }
            SeqEvent::Done(result) => return Collected { tokens, logprobs, result },
            SeqEvent::Error(e) => panic!("sequence failed: {e}"),
        }
    }
}

fn load() -> Option<BatchEngine> {
    let path = common::smollm_path()?;
    let cfg = BatchConfig { prefill_chunk: 64, ..BatchConfig::default() };
    Some(BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg))
}

/// Bounded strings and numbers, so a 135M model finishes within the budget.
const PERSON: &str = r##"{"type":"object","properties":{
  "name":{"type":"string","maxLength":12},
  "age":{"type":"integer","minimum":0,"maximum":120},
  "role":{"enum":["admin","user","guest"]},
  "tags":{"type":"array","items":{"type":"string","maxLength":8},"maxItems":3},
  "boss":{"anyOf":[{"$ref":"#/$defs/ref"},{"type":"null"}]}},
 "required":["name","age","role","tags","boss"],"additionalProperties":false,
 "$defs":{"ref":{"type":"object","properties":{"id":{"type":"integer","minimum":0,"maximum":99}},
   "required":["id"],"additionalProperties":false}}}"##;

/// What the schema says, checked by hand (no validator crate needed).
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys == ["name", "age", "role", "tags", "boss"]
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 12)
        && o["age"].as_u64().is_some_and(|a| a <= 120)
        && ["admin", "user", "guest"].contains(&o["role"].as_str().unwrap_or(""))
        && o["tags"].as_array().is_some_and(|t| {
            t.len() <= 3 && t.iter().all(|x| x.as_str().is_some_and(|s| s.chars().count() <= 8))
        })
        && (o["boss"].is_null()
            || o["boss"].as_object().is_some_and(|b| {
                b.len() == 1 && b.get("id").and_then(Value::as_u64).is_some_and(|i| i <= 99)
            }))
}

fn person_request(seed: u64, max_tokens: usize) -> SeqRequest {
    let msgs = vec![ChatMessage::new(
        "user",
        "Describe a person as JSON with name, age, role, tags and boss.",
    )];
    SeqRequest {
        sampling: SamplingOptions {
            temperature: 1.0,
            top_p: 0.95,
            seed,
            ..SamplingOptions::default()
        },
        grammar: Some(Grammar::JsonSchema(PERSON.into())),
        ..SeqRequest::new(Prompt::Chat(msgs), max_tokens)
    }
}

#[test]
fn every_sampled_sequence_is_a_document_of_its_schema() {
    let Some(batch) = load() else { return };
    // n = 3 samples (each its own grammar state) for each of 4 seeds.
    let streams: Vec<SeqStream> =
        (0..4u64).flat_map(|s| batch.submit_n(person_request(s * 31, 160), 3).unwrap()).collect();
    for s in streams {
        let c = collect(s);
        assert_eq!(c.result.finish_reason, FinishReason::Stop, "{}", c.result.text);
        let v: Value = serde_json::from_str(&c.result.text)
            .unwrap_or_else(|e| panic!("{e}: {}", c.result.text));
        assert!(is_person(&v), "{}", c.result.text);
    }
}

#[test]
fn json_object_output_parses_with_logprobs_of_allowed_tokens_only() {
    let Some(batch) = load() else { return };
    let msgs = vec![ChatMessage::new("user", "Give me a JSON object about a cat.")];
    let req = SeqRequest {
        grammar: Some(Grammar::JsonObject),
        logprobs: Some(5),
        stop: vec!["\"zzz".into()],
        ..SeqRequest::new(Prompt::Chat(msgs), 120)
    };
    let c = collect(batch.submit(req).unwrap());
    let text = &c.result.text;
    if c.result.finish_reason == FinishReason::Stop {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v.is_object());
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
    assert_eq!(c.logprobs.len(), c.tokens.len());
    for lp in &c.logprobs {
        // The masked distribution: finite, normalised over allowed tokens.
        assert!(lp.chosen.logprob.is_finite() && lp.chosen.logprob <= 0.0);
        let mass: f32 = lp.top.iter().map(|t| t.logprob.exp()).sum();
        assert!(mass <= 1.0 + 1e-4, "{mass}");
        assert!(lp.top.iter().all(|t| t.logprob.is_finite()));
    }
    // The first token opens the object, whatever the model preferred.
    assert_eq!(batch.tokenizer().token_bytes(c.tokens[0])[0], b'{');
}

#[test]
fn a_constrained_sequence_does_not_change_its_neighbours() {
    let Some(batch) = load() else { return };
    let plain = |q: &str, seed| SeqRequest {
        sampling: SamplingOptions { temperature: 0.8, seed, ..SamplingOptions::default() },
        ..SeqRequest::new(Prompt::Chat(vec![ChatMessage::new("user", q)]), 24)
    };
    let qs = ["Name a colour.", "Write a haiku about the sea.", "What is two plus two?"];
    let alone: Vec<Vec<u32>> =
        qs.iter().map(|q| collect(batch.submit(plain(q, 5)).unwrap()).tokens).collect();
    let mut streams = Vec::new();
    for (i, q) in qs.iter().enumerate() {
        streams.push(batch.submit(plain(q, 5)).unwrap());
        streams.push(batch.submit(person_request(i as u64, 48)).unwrap());
    }
    let got: Vec<Collected> = streams.into_iter().map(collect).collect();
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(&got[2 * i].tokens, want, "{}", qs[i]);
    }
}

#[test]
fn a_schema_the_engine_cannot_compile_is_refused_at_submit() {
    let Some(batch) = load() else { return };
    let req = SeqRequest {
        grammar: Some(Grammar::JsonSchema(r##"{"$ref":"#/$defs/none"}"##.into())),
        ..SeqRequest::new(Prompt::Tokens(vec![1, 2, 3]), 4)
    };
    let e = batch.submit(req).unwrap_err();
    assert!(matches!(e, gcs_engine::EngineError::InvalidRequest(_)), "{e}");
}
