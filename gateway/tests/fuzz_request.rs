//! Fuzzing the edge's request parsing and validation (`gcs_gateway::request::parse`)
//! with proptest: arbitrary bytes, arbitrary JSON documents, and valid chat,
//! completion and embeddings bodies with arbitrary mutations (a field set to
//! any value, removed, or the text cut or a byte flipped). Every input must
//! end in either a typed request whose job payload survives its versioned
//! CBOR round trip, or an OpenAI error envelope with a 4xx status — never a
//! panic, never a 5xx.
//!
//! CI runs 2000 cases per target (a few seconds). The long mode
//! runs each target for a time and prints the executions:
//!   GCS_FUZZ_SECS=600 cargo test --release -p gcs-gateway --test fuzz_request -- --nocapture
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gcs_gateway::payload::JobRequest;
use gcs_gateway::request::{parse, Parsed};
use gcs_protocol::ApiType;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Map, Value};

/// Field names the parser reads, so mutations hit real rules.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "input",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "n",
    "logprobs",
    "top_logprobs",
    "tools",
    "functions",
    "tool_choice",
    "parallel_tool_calls",
    "tool_calls",
    "tool_call_id",
    "function",
    "name",
    "arguments",
    "parameters",
    "strict",
    "response_format",
    "modalities",
    "echo",
    "best_of",
    "suffix",
    "encoding_format",
    "dimensions",
    "user",
    "gnus",
    "role",
    "content",
    "type",
    "text",
    "include_usage",
    "network",
    "privacy_mode",
    "routing",
    "limits",
    "first_token_timeout_ms",
    "idle_stream_timeout_ms",
    "wall_timeout_ms",
    "retrieval",
];

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        prop::sample::select(vec![
            0.0, -0.0, 1.0, 2.0, 2.0000001, -2.0, 100.0, 1e300, -1e300, 4096.0, 4097.0
        ])
        .prop_map(Value::from),
        prop::sample::select(vec![0i64, 1, -1, 8, 9, 20, 21, 4096, 4097, i64::MAX, i64::MIN])
            .prop_map(Value::from),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(FIELDS.to_vec()).prop_map(str::to_string),
        prop::sample::select(vec![
            "",
            "user",
            "system",
            "assistant",
            "developer",
            "tool",
            "function",
            "gnus-auto",
            "gnus-embed",
            "text",
            "image_url",
            "base64",
            "float",
            "none",
            "auto",
            "public",
            "private",
            "hybrid",
            "local_only",
            "first_valid_claim",
            "\u{0}",
            "\u{10FFFF}",
        ])
        .prop_map(str::to_string),
        ".{0,24}",
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((text(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn api() -> impl Strategy<Value = ApiType> {
    prop::sample::select(vec![ApiType::ChatCompletion, ApiType::Completion, ApiType::Embedding])
}

fn valid(api: ApiType) -> Value {
    match api {
        ApiType::ChatCompletion => json!({"model": "gnus-auto", "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 16, "temperature": 0.7,
            "top_p": 0.9, "n": 2, "stop": ["\n"], "seed": 3, "logprobs": true, "top_logprobs": 2,
            "logit_bias": {"42": -5}, "gnus": {"network": "hybrid", "limits": {"wall_timeout_ms": 5000}},
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                             "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "42"}],
            "tools": [{"type": "function", "function": {"name": "f", "strict": true,
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}},
                               "required": ["a"], "additionalProperties": false}}}],
            "tool_choice": "auto", "parallel_tool_calls": false}),
        ApiType::Completion => json!({"model": "gnus-auto", "prompt": "Once", "max_tokens": 8,
            "stop": "x", "echo": false, "best_of": 1}),
        ApiType::Embedding => json!({"model": "gnus-embed", "input": ["a", "b", "c"],
            "encoding_format": "base64"}),
    }
}

/// One change to a valid body.
#[derive(Clone, Debug)]
enum Mutation {
    Set(Vec<String>, Value),
    Remove(Vec<String>),
    Truncate(usize),
    Flip(usize, u8),
}

fn path() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(
        prop_oneof![
            prop::sample::select(FIELDS.to_vec()).prop_map(str::to_string),
            (0usize..4).prop_map(|i| i.to_string()),
        ],
        1..4,
    )
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (path(), json_value()).prop_map(|(p, v)| Mutation::Set(p, v)),
        2 => path().prop_map(Mutation::Remove),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
    ]
}

/// The node at `path` (array indices by number), created as objects.
fn at<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    let mut cur = v;
    for k in path {
        cur = match cur {
            Value::Array(a) => a.get_mut(k.parse::<usize>().ok()?)?,
            Value::Object(o) => o.entry(k.clone()).or_insert(Value::Null),
            _ => return None,
        };
    }
    Some(cur)
}

fn mutate(api: ApiType, muts: &[Mutation]) -> Vec<u8> {
    let mut v = valid(api);
    let mut bytes = None;
    for m in muts {
        match m {
            Mutation::Set(p, x) => {
                if let Some(slot) = at(&mut v, p) {
                    *slot = x.clone();
                }
            }
            Mutation::Remove(p) => {
                let (last, parent) = p.split_last().unwrap();
                if let Some(Value::Object(o)) = at(&mut v, parent) {
                    o.remove(last);
                }
            }
            Mutation::Truncate(i) => {
                let mut b = serde_json::to_vec(&v).unwrap();
                b.truncate(i % (b.len() + 1));
                bytes = Some(b);
            }
            Mutation::Flip(i, x) => {
                let mut b = bytes.take().unwrap_or_else(|| serde_json::to_vec(&v).unwrap());
                if !b.is_empty() {
                    let n = b.len();
                    b[i % n] ^= x;
                }
                bytes = Some(b);
            }
        }
    }
    bytes.unwrap_or_else(|| serde_json::to_vec(&v).unwrap())
}

/// Inputs that parsed into a typed request (the rest were refused).
static ACCEPTED: AtomicU64 = AtomicU64::new(0);

/// The property: a typed request whose payload round-trips, or a 4xx envelope.
fn check(api: ApiType, bytes: &[u8]) -> Result<(), TestCaseError> {
    let r = parse(api, bytes);
    if r.is_ok() {
        ACCEPTED.fetch_add(1, Ordering::Relaxed);
    }
    match r {
        Ok(Parsed::Generation(g)) => {
            prop_assert!(api != ApiType::Embedding);
            prop_assert!((1..=8).contains(&g.n));
            for i in 0..g.n {
                let job = g.choice(i);
                let back = JobRequest::decode(&job.encode().unwrap()).unwrap();
                prop_assert_eq!(back, job);
            }
        }
        Ok(Parsed::Embedding(e)) => {
            prop_assert_eq!(api, ApiType::Embedding);
            prop_assert!(!e.job.inputs.is_empty());
            let job = JobRequest::Embedding(e.job);
            prop_assert_eq!(JobRequest::decode(&job.encode().unwrap()).unwrap(), job);
        }
        Err(e) => {
            prop_assert!(
                e.status.is_client_error(),
                "{} for {:?}",
                e,
                String::from_utf8_lossy(bytes)
            );
            let body = e.body();
            let err = &body["error"];
            prop_assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", body);
            prop_assert!(err["type"].is_string() && err["code"].is_string(), "{}", body);
            prop_assert!(err.as_object().unwrap().contains_key("param"), "{}", body);
        }
    }
    Ok(())
}

/// Runs `strategy` through `check`: a few hundred cases, or for
/// `GCS_FUZZ_SECS` seconds; prints the executions.
fn fuzz<S: Strategy>(name: &str, strategy: S, f: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    let secs: Option<u64> = std::env::var("GCS_FUZZ_SECS").ok().and_then(|s| s.parse().ok());
    let execs = AtomicU64::new(0);
    let accepted = ACCEPTED.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let run = |cases: u32| {
        let config = Config { cases, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new(config);
        runner
            .run(&strategy, |v| {
                execs.fetch_add(1, Ordering::Relaxed);
                f(v)
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    };
    match secs {
        None => run(2000),
        Some(s) => {
            while t0.elapsed() < Duration::from_secs(s) {
                run(20_000);
            }
        }
    }
    // Tests run in parallel threads: the accepted count is approximate.
    eprintln!(
        "fuzz {name}: {} executions in {:.1} s (~{} parsed as requests), no failure",
        execs.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
        ACCEPTED.load(Ordering::Relaxed).saturating_sub(accepted)
    );
}

#[test]
fn arbitrary_bytes_are_a_request_or_a_4xx_envelope() {
    fuzz("bytes", (api(), prop::collection::vec(any::<u8>(), 0..256)), |(api, b)| check(api, &b));
}

#[test]
fn arbitrary_json_is_a_request_or_a_4xx_envelope() {
    fuzz("json", (api(), json_value()), |(api, v)| check(api, &serde_json::to_vec(&v).unwrap()));
}

#[test]
fn mutated_valid_bodies_are_a_request_or_a_4xx_envelope() {
    let s = (api(), prop::collection::vec(mutation(), 0..5));
    fuzz("mutations", s, |(api, muts)| check(api, &mutate(api, &muts)));
}

#[test]
fn the_unmutated_bodies_are_valid() {
    // The mutation target starts from requests that parse, so mutations
    // probe the rules rather than the first refusal.
    for api in [ApiType::ChatCompletion, ApiType::Completion, ApiType::Embedding] {
        assert!(parse(api, &serde_json::to_vec(&valid(api)).unwrap()).is_ok(), "{api:?}");
    }
}
