#![allow(clippy::unwrap_used, clippy::panic)]
use super::*;
use crate::payload::{Message, Role};
use serde_json::json;

fn chat(v: Value) -> Result<Parsed, ApiError> {
    parse(ApiType::ChatCompletion, &serde_json::to_vec(&v).unwrap())
}

fn generation(p: Parsed) -> GenerationRequest {
    match p {
        Parsed::Generation(g) => g,
        Parsed::Embedding(_) => panic!("an embedding request"),
    }
}

fn embedding(p: Parsed) -> EmbeddingRequest {
    match p {
        Parsed::Embedding(e) => e,
        Parsed::Generation(_) => panic!("a generation request"),
    }
}

#[test]
fn a_plain_chat_request_parses() {
    let p = chat(json!({"model": "gnus-auto", "messages": [{"role": "user", "content": "hi"}],
                        "stream": true, "stream_options": {"include_usage": true},
                        "max_tokens": 7, "some_future_field": 1}))
    .unwrap();
    let p = generation(p);
    assert!(p.stream && p.include_usage);
    assert_eq!((u64::from(p.job.max_tokens), p.common.prompt_chars), (7, 2));
}

#[test]
fn max_completion_tokens_wins_over_max_tokens() {
    let p = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 7, "max_completion_tokens": 9}))
    .unwrap();
    assert_eq!(generation(p).job.max_tokens, 9);
}

#[test]
fn what_cannot_be_honoured_is_rejected_naming_the_param() {
    let m = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (json!({"messages": m}), "model"),
        (json!({"model": "m"}), "messages"),
        (json!({"model": "m", "messages": []}), "messages"),
        (json!({"model": "m", "messages": m, "temperature": 3}), "temperature"),
        (json!({"model": "m", "messages": m, "n": 9}), "n"),
        (json!({"model": "m", "messages": m, "stop": [1]}), "stop"),
        (json!({"model": "m", "messages": m, "logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"model": "m", "messages": m, "tools": [{"type": "function"}]}), "tools[0].function"),
        (
            json!({"model": "m", "messages": m, "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].tool_call_id",
        ),
        (json!({"model": "m", "messages": [{"role": "function", "content": "x"}]}), "messages[0].role"),
        (json!({"model": "m", "messages": m, "gnus": {"network": "moon"}}), "gnus.network"),
        (
            json!({"model": "m", "messages": m, "response_format": {"type": "xml"}}),
            "response_format.type",
        ),
    ];
    for (body, param) in cases {
        let e = chat(body.clone()).unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
    }
}

#[test]
fn malformed_json_is_a_400() {
    let e = parse(ApiType::ChatCompletion, b"{\"model\":").unwrap_err();
    assert_eq!((e.status.as_u16(), e.code.as_str()), (400, "invalid_json"));
}

#[test]
fn embeddings_take_strings_or_arrays_of_strings() {
    let p = parse(ApiType::Embedding, br#"{"model":"e","input":["a","bc"]}"#).unwrap();
    assert_eq!(embedding(p).job.inputs, vec!["a", "bc"]);
    let e = parse(ApiType::Embedding, br#"{"model":"e","input":[[1,2]]}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("input"));
    let p = parse(ApiType::Embedding, br#"{"model":"e","input":"x","encoding_format":"base64"}"#)
        .unwrap();
    assert!(embedding(p).base64);
}

#[test]
fn the_gnus_extension_sets_routing_and_timeouts() {
    let p = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "gnus": {"network": "hybrid", "privacy_mode": "enterprise",
                 "routing": {"claim_policy": "first_valid_claim", "replication_factor": 1},
                 "limits": {"max_cost_gnus": "auto", "wall_timeout_ms": 5000}}}))
    .unwrap();
    let p = p.common();
    assert_eq!(p.network, RoutingMode::Hybrid);
    assert_eq!(p.privacy, PrivacyLevel::PrivatePool);
    assert_eq!(p.timeouts.wall_ms, Some(5000));
}

#[test]
fn metadata_minimized_is_public_or_gateway_local_only() {
    let with = |network: &str| {
        chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "gnus": {"network": network, "privacy_mode": "metadata_minimized"}}))
    };
    let p = with("public").unwrap();
    assert_eq!(p.common().privacy, PrivacyLevel::MetadataMinimized);
    let p = with("gateway_local").unwrap();
    assert_eq!(p.common().network, RoutingMode::GatewayLocal);
    assert_eq!(p.common().privacy, PrivacyLevel::MetadataMinimized);
    for network in ["private", "hybrid", "local_only"] {
        let e = with(network).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("gnus.privacy_mode"), "{network}");
        assert!(e.message.contains(network), "{network}: {}", e.message);
    }
}

#[test]
fn the_job_carries_typed_parameters() {
    let p = generation(
        chat(json!({"model": "m", "max_completion_tokens": 5, "temperature": 0, "top_k": 3,
                "seed": -1, "stop": "\n", "logit_bias": {"7": -100}, "logprobs": true,
                "top_logprobs": 2, "n": 2,
                "messages": [{"role": "developer", "content": "be brief"},
                             {"role": "assistant", "content": null},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}]}))
        .unwrap(),
    );
    assert_eq!(p.budget_field, "max_completion_tokens");
    let g = &p.job;
    let msgs = [(Role::System, "be brief"), (Role::Assistant, ""), (Role::User, "ab")]
        .map(|(role, c)| Message::text(role, c));
    assert_eq!(g.prompt, Prompt::Chat(msgs.to_vec()));
    assert_eq!((g.max_tokens, g.stop.clone(), g.logprobs), (5, vec!["\n".to_string()], Some(2)));
    let s = &g.sampling;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.seed), (0.0, 1.0, 3, Some(u64::MAX)));
    assert_eq!(s.logit_bias.get(&7), Some(&-100.0));
    // Choice 1 runs with the next seed (wrapping), choice 0 with the request's.
    let seed = |r: JobRequest| match r {
        JobRequest::Generation(g) => g.sampling.seed,
        JobRequest::Embedding(_) => None,
    };
    assert_eq!((seed(p.choice(0)), seed(p.choice(1))), (Some(u64::MAX), Some(0)));
}

#[test]
fn a_completions_logprobs_is_its_number_of_alternatives() {
    let with = |v: serde_json::Value| {
        let body = json!({"model": "m", "prompt": "once", "logprobs": v}).to_string();
        parse(ApiType::Completion, body.as_bytes()).map(|p| generation(p).job.logprobs)
    };
    assert_eq!(with(json!(3)).unwrap(), Some(3));
    assert_eq!(with(json!(0)).unwrap(), Some(0));
    assert_eq!(with(json!(20)).unwrap(), Some(20));
    assert_eq!(with(json!(null)).unwrap(), None);
    assert_eq!(with(json!(false)).unwrap(), None);
    for bad in [json!(21), json!(true), json!(-1), json!(2.5), json!("3")] {
        let e = with(bad.clone()).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.code.as_str()),
            (Some("logprobs"), "invalid_value"),
            "{bad}"
        );
    }
    // Applied, so not refused under gnus.strict.
    let strict = json!({"model": "m", "prompt": "x", "logprobs": 2, "gnus": {"strict": true}});
    assert!(parse(ApiType::Completion, strict.to_string().as_bytes()).is_ok());
}

#[test]
fn a_completion_prompt_is_text_with_defaults() {
    let p = parse(ApiType::Completion, br#"{"model":"m","prompt":["once"]}"#).unwrap();
    let p = generation(p);
    assert_eq!(p.job.prompt, Prompt::Text("once".into()));
    assert_eq!((p.job.max_tokens, p.job.logprobs, p.budget_field), (256, None, "max_tokens"));
    assert_eq!(p.job.sampling, Sampling::default());
    assert_eq!(p.choice(0).api_type(), ApiType::Completion);
}

fn with_format(rf: serde_json::Value) -> Result<GenerationRequest, ApiError> {
    chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": rf}))
    .map(generation)
}

#[test]
fn response_format_becomes_the_jobs_constraint() {
    use crate::payload::Constraint;
    assert_eq!(with_format(json!({"type": "text"})).unwrap().job.constraint, None);
    assert_eq!(
        with_format(json!({"type": "json_object"})).unwrap().job.constraint,
        Some(Constraint::JsonObject)
    );
    // The strict-mode subset: required properties, additionalProperties
    // false, enums, anyOf with null, arrays, nested objects, $defs/$ref.
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
        "required": ["name", "kind", "tags", "next"], "additionalProperties": false,
        "$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}},
            "required": ["v"], "additionalProperties": false}}});
    let g = with_format(json!({"type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": true}}))
    .unwrap();
    let Some(Constraint::JsonSchema { name, schema: text }) = g.job.constraint else {
        panic!("a schema constraint")
    };
    assert_eq!(name, "thing");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), schema);
}

#[test]
fn a_schema_that_cannot_be_compiled_is_a_400_naming_response_format() {
    let cases = [
        (json!({"type": "json_schema"}), "response_format.json_schema"),
        (json!({"type": "json_schema", "json_schema": {"schema": {}}}), "response_format.json_schema.name"),
        (json!({"type": "json_schema", "json_schema": {"name": "a b"}}), "response_format.json_schema.name"),
        (json!({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
            "response_format.json_schema.schema"),
        (json!({"type": "json_schema", "json_schema": {"name": "a",
            "schema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}}}}),
            "response_format"),
        (json!({"type": "json_schema", "json_schema": {"name": "a",
            "schema": {"type": "nonsense"}}}), "response_format"),
        (json!({"type": "json_schema", "json_schema": {"name": "a",
            "schema": {"description": "x".repeat(crate::payload::MAX_SCHEMA_BYTES)}}}),
            "response_format.json_schema.schema"),
        (json!("json_object"), "response_format"),
    ];
    for (rf, param) in cases {
        let e = with_format(rf.clone()).unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{rf}");
        assert_eq!(e.param.as_deref(), Some(param), "{rf}: {e}");
    }
}

/// The seed each choice's signed payload carries, read back from its bytes.
fn payload_seeds(g: &GenerationRequest) -> Vec<Option<u64>> {
    (0..g.n)
        .map(|i| match JobRequest::decode(&g.choice(i).encode().unwrap()).unwrap() {
            JobRequest::Generation(j) => j.sampling.seed,
            JobRequest::Embedding(_) => panic!("a generation payload"),
        })
        .collect()
}

#[test]
fn every_sampled_request_gets_a_seed_at_admission() {
    let body = |extra: Value| {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        generation(chat(v).unwrap())
    };
    let admit = |extra: Value, key: &str| {
        let mut g = body(extra);
        g.assign_seed(key);
        payload_seeds(&g)
    };
    let fresh = crate::admit::fresh_idempotency_key;
    // Unseeded and sampled (OpenAI's default temperature is 1): each
    // admission gets its own seed, in the payload; the choices still differ.
    let (a, b) = (admit(json!({}), &fresh()), admit(json!({"temperature": 0.8}), &fresh()));
    assert!(a.iter().chain(&b).all(Option::is_some), "{a:?} {b:?}");
    assert_ne!(a[0], b[0]);
    assert_ne!(a[0], a[1]);
    // A client's idempotency key gives the same seed again, so its retry
    // carries the same payload bytes.
    assert_eq!(admit(json!({}), "client-key-1"), admit(json!({}), "client-key-1"));
    assert_ne!(admit(json!({}), "client-key-1"), admit(json!({}), "client-key-2"));
    // A client seed is kept; greedy requests stay unseeded.
    assert_eq!(admit(json!({"seed": 42}), &fresh()), vec![Some(42), Some(43)]);
    assert_eq!(admit(json!({"temperature": 0}), &fresh()), vec![None, None]);
}
