#![allow(clippy::unwrap_used, clippy::panic)]
use serde_json::json;

use crate::payload::{JobRequest, Prompt, Role, ToolChoice};
use crate::request::{parse, Parsed};
use gcs_protocol::ApiType;

fn weather() -> serde_json::Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": false}, "strict": true}})
}

fn chat(
    extra: serde_json::Value,
) -> Result<crate::request::GenerationRequest, crate::error::ApiError> {
    let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "Paris?"}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    match parse(ApiType::ChatCompletion, &serde_json::to_vec(&b).unwrap())? {
        Parsed::Generation(g) => Ok(g),
        Parsed::Embedding(_) => panic!("embedding"),
    }
}

#[test]
fn tools_and_each_tool_choice_are_carried_in_the_job() {
    let g = chat(json!({"tools": [weather()]})).unwrap();
    let t = g.job.tools.clone().unwrap();
    assert_eq!((t.choice.clone(), t.max_calls), (ToolChoice::Auto, 8), "auto, parallel by default");
    assert_eq!(t.functions[0].name, "get_weather");
    assert_eq!(t.functions[0].description.as_deref(), Some("Weather now"));
    assert!(!t.functions[0].loose);
    assert!(g.common.prompt_chars > "Paris?".len(), "the tools count as prompt");
    for (choice, want) in [
        (json!("required"), ToolChoice::Required),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            ToolChoice::Function("get_weather".into()),
        ),
    ] {
        let g = chat(json!({"tools": [weather()], "tool_choice": choice,
                            "parallel_tool_calls": false}))
        .unwrap();
        let t = g.job.tools.unwrap();
        assert_eq!((t.choice, t.max_calls), (want, 1));
    }
    // `none`: no tools in the job (the model answers text).
    assert!(chat(json!({"tools": [weather()], "tool_choice": "none"}))
        .unwrap()
        .job
        .tools
        .is_none());
    // The payload is version 3 and survives the wire.
    let job = chat(json!({"tools": [weather()]})).unwrap().choice(0);
    assert_eq!(JobRequest::decode(&job.encode().unwrap()).unwrap(), job);
}

#[test]
fn a_tool_round_trip_history_parses() {
    let g = chat(json!({"tools": [weather()], "messages": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}))
    .unwrap();
    let Prompt::Chat(m) = &g.job.prompt else { panic!("chat") };
    assert_eq!(m[1].tool_calls[0].arguments, "{\"city\": \"Paris\"}");
    assert_eq!((m[1].content.as_str(), m[1].role), ("", Role::Assistant));
    assert_eq!((m[2].role, m[2].tool_call_id.as_deref()), (Role::Tool, Some("call_1")));
}

#[test]
fn bad_tools_are_400s_naming_the_param() {
    let many: Vec<serde_json::Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    let cases = [
        (json!({"tools": {"a": 1}}), "tools"),
        (json!({"tools": many}), "tools"),
        (json!({"tools": [{"type": "code_interpreter"}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "x".repeat(65)}}]}),
            "tools[0].function.name",
        ),
        (json!({"tools": [weather(), weather()]}), "tools[1].function.name"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "string"}}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true,
            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "tool_choice",
        ),
        (json!({"tools": [weather()], "tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": [weather()], "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].id",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": {"a": 1}}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}),
            "messages[0].tool_call_id",
        ),
    ];
    for (extra, param) in cases {
        let e = chat(extra.clone()).unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{extra}");
        assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e}");
    }
}

#[test]
fn a_schema_that_does_not_compile_holds_a_non_strict_tool_to_any_object() {
    let loose = json!({"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}}});
    let t = chat(json!({"tools": [loose]})).unwrap().job.tools.unwrap();
    assert!(t.functions[0].loose);
    // No parameters: a function of none.
    let bare = json!({"type": "function", "function": {"name": "now"}});
    let t = chat(json!({"tools": [bare]})).unwrap().job.tools.unwrap();
    let p: serde_json::Value = serde_json::from_str(&t.functions[0].parameters).unwrap();
    assert_eq!(p["additionalProperties"], false);
}

#[test]
fn the_same_tools_again_are_not_compiled_again() {
    // Names no other test uses: the cache is per process.
    let tools: Vec<serde_json::Value> = (0..32)
        .map(|i| {
            let mut t = weather();
            t["function"]["name"] = json!(format!("cached_{i}"));
            t
        })
        .collect();
    let compiles = || crate::request::format::LARK_COMPILES.with(|n| n.get());
    let admit = || {
        let before = compiles();
        chat(json!({"tools": tools.clone(), "tool_choice": "required"})).unwrap();
        compiles() - before
    };
    assert_eq!(admit(), 1, "the first admission compiles the whole grammar once");
    assert_eq!(admit(), 0, "the same tools again are not compiled");
}
