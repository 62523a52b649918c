//! Random JSON schemas on the real model (skips without it): for schemas
//! drawn from a small generator (nested objects, arrays, enums, bounded
//! strings and integers, booleans, `anyOf` with null) and random seeds,
//! every sampled answer parses and satisfies its schema. The generator's
//! seed is printed; `GCS_SCHEMA_SEED=N` replays a run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, FinishReason, Grammar, Prompt,
    SamplingOptions, SeqEvent, SeqRequest, SeqResult,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

/// A schema of the generator's subset, and what it admits.
#[derive(Debug, Clone)]
enum Node {
    Str(usize),
    Int(i64, i64),
    Bool,
    Enum(Vec<String>),
    OrNull(Box<Node>),
    Array(Box<Node>, usize),
    Object(Vec<(String, Node)>),
}

impl Node {
    fn random(rng: &mut ChaCha8Rng, depth: usize) -> Node {
        let leaf = depth == 0 || rng.random_bool(0.5);
        if leaf {
            return match rng.random_range(0..4) {
                0 => Node::Str(rng.random_range(1..10)),
                1 => {
                    let lo = rng.random_range(-50..50);
                    Node::Int(lo, lo + rng.random_range(0..200))
                }
                2 => Node::Bool,
                _ => Node::Enum(
                    (0..rng.random_range(1..4))
                        .map(|i| format!("v{i}_{}", rng.random_range(0..9)))
                        .collect(),
                ),
            };
        }
        match rng.random_range(0..3) {
            0 => Node::OrNull(Box::new(Node::random(rng, depth - 1))),
            1 => Node::Array(Box::new(Node::random(rng, depth - 1)), rng.random_range(1..3)),
            _ => Node::Object(
                (0..rng.random_range(1..4))
                    .map(|i| (format!("k{i}"), Node::random(rng, depth - 1)))
                    .collect(),
            ),
        }
    }

    fn schema(&self) -> Value {
        match self {
            Node::Str(n) => json!({"type": "string", "maxLength": n}),
            Node::Int(lo, hi) => json!({"type": "integer", "minimum": lo, "maximum": hi}),
            Node::Bool => json!({"type": "boolean"}),
            Node::Enum(v) => json!({"enum": v}),
            Node::OrNull(n) => json!({"anyOf": [n.schema(), {"type": "null"}]}),
            Node::Array(n, max) => json!({"type": "array", "items": n.schema(), "maxItems": max}),
            Node::Object(props) => {
                let p: serde_json::Map<String, Value> =
                    props.iter().map(|(k, n)| (k.clone(), n.schema())).collect();
                let req: Vec<&String> = props.iter().map(|(k, _)| k).collect();
                json!({"type": "object", "properties": p, "required": req,
                    "additionalProperties": false})
            }
        }
    }

    fn admits(&self, v: &Value) -> bool {
        match self {
            Node::Str(n) => v.as_str().is_some_and(|s| s.chars().count() <= *n),
            Node::Int(lo, hi) => v.as_i64().is_some_and(|i| (*lo..=*hi).contains(&i)),
            Node::Bool => v.is_boolean(),
            Node::Enum(e) => v.as_str().is_some_and(|s| e.iter().any(|x| x == s)),
            Node::OrNull(n) => v.is_null() || n.admits(v),
            Node::Array(n, max) => {
                v.as_array().is_some_and(|a| a.len() <= *max && a.iter().all(|x| n.admits(x)))
            }
            Node::Object(props) => v.as_object().is_some_and(|o| {
                o.len() == props.len()
                    && props.iter().all(|(k, n)| o.get(k).is_some_and(|x| n.admits(x)))
            }),
        }
    }
}

fn result(s: gcs_engine::SeqStream) -> SeqResult {
    loop {
        match s.recv_timeout(Duration::from_secs(180)).expect("event in time") {
            SeqEvent::Delta { .. } => {}
            SeqEvent::Done(r) => return r,
            SeqEvent::Error(e) => panic!("sequence failed: {e}"),
        }
    }
}

#[test]
fn sampled_answers_satisfy_random_schemas() {
    let Some(path) = common::smollm_path() else { return };
    let seed = std::env::var("GCS_SCHEMA_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    println!("schema generator seed {seed} (GCS_SCHEMA_SEED={seed} replays it)");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cfg = BatchConfig { prefill_chunk: 64, ..BatchConfig::default() };
    let batch = BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg);
    // The top level is an object, as response_format json_schema requires.
    let cases: Vec<(Node, u64)> = (0..16)
        .map(|_| {
            let props = (0..rng.random_range(1..4))
                .map(|i| (format!("f{i}"), Node::random(&mut rng, 2)))
                .collect();
            (Node::Object(props), rng.random())
        })
        .collect();
    let streams: Vec<_> = cases
        .iter()
        .map(|(node, s)| {
            let msgs = vec![ChatMessage::new("user", "Answer with a JSON document.")];
            let req = SeqRequest {
                sampling: SamplingOptions {
                    temperature: 1.0,
                    seed: *s,
                    ..SamplingOptions::default()
                },
                grammar: Some(Grammar::JsonSchema(node.schema().to_string())),
                ..SeqRequest::new(Prompt::Chat(msgs), 400)
            };
            batch.submit(req).unwrap()
        })
        .collect();
    for ((node, s), stream) in cases.iter().zip(streams) {
        let r = result(stream);
        let ctx = format!("seed {seed}, sample seed {s}, schema {}: {}", node.schema(), r.text);
        // Every bound is small, so the grammar closes within the budget.
        assert_eq!(r.finish_reason, FinishReason::Stop, "{ctx}");
        let v: Value = serde_json::from_str(&r.text).unwrap_or_else(|e| panic!("{e}: {ctx}"));
        assert!(node.admits(&v), "{ctx}");
    }
}
