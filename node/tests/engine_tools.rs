//! Tool calling on the real engine (SmolLM2 135M, its own GGUF template,
//! which has no tool section, so the fallback prompt is used): under a
//! `required` or named `tool_choice` every sampled answer, whatever the
//! seed, reads back ([`gcs_gateway::tools::parse`]) as calls of the
//! allowed tools whose arguments satisfy the tool's JSON Schema; the tools
//! reach the prompt; a tool round trip's history renders and runs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../tests/support/prereq.rs"]
mod prereq;

use std::sync::atomic::AtomicBool;

use gcs_gateway::payload::{
    Generation, JobRequest, Message, Prompt, Role, Sampling, Tool, ToolCall, ToolChoice, Tools,
};
use gcs_gateway::tools::parse::answer;
use gcs_node::jobs::engine_exec::EngineExecutor;
use gcs_node::jobs::executor::{ExecOutcome, ExecRequest, Executor};
use gcs_protocol::{ApiType, FinishReason};
use serde_json::Value;

fn model_dir() -> std::path::PathBuf {
    std::env::var_os("GCS_MODEL_DIR").map(Into::into).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gcs/models")
    })
}

fn executor() -> Option<EngineExecutor> {
    let entry = gcs_node::models::entry("smollm2-135m-instruct").expect("in the catalogue");
    if !entry.path(&model_dir()).is_file() {
        prereq::missing(
            &entry.path(&model_dir()).display().to_string(),
            "run scripts/fetch-models.sh",
        );
        return None;
    }
    Some(EngineExecutor::load(&model_dir(), &[entry.info()], 4).unwrap())
}

const WEATHER: &str = r#"{"type":"object","properties":{"city":{"type":"string","maxLength":24},
  "unit":{"enum":["celsius","fahrenheit"]},"days":{"type":"integer","minimum":1,"maximum":7}},
  "required":["city","unit","days"],"additionalProperties":false}"#;
const TIME: &str = r#"{"type":"object","properties":{"zone":{"type":"string","maxLength":16}},
  "required":["zone"],"additionalProperties":false}"#;

fn tools(choice: ToolChoice, max_calls: u8) -> Tools {
    let t = |name: &str, d: &str, p: &str| Tool {
        name: name.into(),
        description: Some(d.into()),
        parameters: p.into(),
        loose: false,
    };
    Tools {
        functions: vec![
            t("get_weather", "The weather forecast for a city", WEATHER),
            t("get_time", "The time in a time zone", TIME),
        ],
        choice,
        max_calls,
    }
}

fn chat(msgs: Vec<Message>, tools: Option<Tools>, seed: u64) -> Generation {
    Generation {
        prompt: Prompt::Chat(msgs),
        max_tokens: 96,
        sampling: Sampling { temperature: 1.0, seed: Some(seed), ..Sampling::default() },
        stop: vec![],
        logprobs: None,
        constraint: None,
        tools,
    }
}

fn ask() -> Vec<Message> {
    vec![Message::text(Role::User, "What is the weather in Paris this week?")]
}

fn run(exec: &EngineExecutor, g: Generation) -> (String, ExecOutcome) {
    let req = ExecRequest {
        api_type: ApiType::ChatCompletion,
        model: "smollm2-135m-instruct".into(),
        body: JobRequest::Generation(g).encode().unwrap(),
        cache_salt: "t".into(),
        priority: Default::default(),
    };
    let mut streamed = String::new();
    let out = exec
        .run(&req, &AtomicBool::new(false), &mut |t, _, _| {
            streamed.push_str(t);
            true
        })
        .unwrap();
    let text = out.body["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(streamed, text, "the streamed deltas are the result's text");
    (text, out)
}

/// The arguments satisfy the schema of `name` (checked by hand, not by the
/// grammar library that produced them).
fn check_arguments(name: &str, args: &str) {
    let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{args}: {e}"));
    let o = v.as_object().unwrap_or_else(|| panic!("{args}: not an object"));
    match name {
        "get_weather" => {
            assert_eq!(o.len(), 3, "{args}");
            assert!(o["city"].as_str().is_some_and(|c| c.chars().count() <= 24), "{args}");
            assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap()), "{args}");
            assert!((1..=7).contains(&o["days"].as_i64().unwrap()), "{args}");
        }
        "get_time" => {
            assert_eq!(o.len(), 1, "{args}");
            assert!(o["zone"].as_str().is_some_and(|z| z.chars().count() <= 16), "{args}");
        }
        other => panic!("a call of {other}, which is not a tool"),
    }
}

#[test]
fn required_and_named_choices_always_give_calls_that_follow_the_schema() {
    let Some(exec) = executor() else { return };
    let mut cases = vec![];
    for seed in 0..3 {
        cases.push((ToolChoice::Required, 1, seed));
        cases.push((ToolChoice::Function("get_time".into()), 1, seed));
        cases.push((ToolChoice::Function("get_weather".into()), 1, seed));
    }
    cases.push((ToolChoice::Required, 3, 7));
    cases.push((ToolChoice::Function("get_time".into()), 3, 8));
    // Four at a time, so the engine batches them (each its own grammar).
    for group in cases.chunks(4) {
        std::thread::scope(|s| {
            for (choice, max_calls, seed) in group {
                let exec = &exec;
                s.spawn(move || {
                    let g = chat(ask(), Some(tools(choice.clone(), *max_calls)), *seed);
                    let (text, out) = run(exec, g);
                    let a = answer(&text, usize::from(*max_calls));
                    let what = format!("{choice:?} x{max_calls} seed {seed}: {text}");
                    assert!(a.content.is_empty(), "{what}");
                    assert!((1..=usize::from(*max_calls)).contains(&a.calls.len()), "{what}");
                    // A complete call set ends the answer (the grammar's end);
                    // only parallel calls may run into max_tokens.
                    let complete = out.finish_reason == FinishReason::Stop;
                    assert!(complete || *max_calls > 1, "{what}");
                    let n = if complete { a.calls.len() } else { a.calls.len() - 1 };
                    for (name, args) in &a.calls[..n] {
                        if let ToolChoice::Function(want) = choice {
                            assert_eq!(name, want, "{what}");
                        }
                        check_arguments(name, args);
                    }
                });
            }
        });
    }
}

#[test]
fn the_tools_are_in_the_prompt_and_a_round_trip_history_runs() {
    let Some(exec) = executor() else { return };
    let (_, plain) = run(&exec, chat(ask(), None, 1));
    let (_, with) = run(&exec, chat(ask(), Some(tools(ToolChoice::Auto, 1)), 1));
    assert!(
        with.input_tokens > plain.input_tokens + 100,
        "the fallback's tool section is rendered: {} vs {} prompt tokens",
        with.input_tokens,
        plain.input_tokens
    );
    let mut h = ask();
    h.push(Message {
        tool_calls: vec![ToolCall {
            id: "call_x_0_0".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris", "unit": "celsius", "days": 7}"#.into(),
        }],
        ..Message::text(Role::Assistant, "")
    });
    h.push(Message {
        tool_call_id: Some("call_x_0_0".into()),
        ..Message::text(Role::Tool, "Sunny all week, 18 to 22 degrees.")
    });
    // tool_choice none (no tools in the job): the history still renders.
    let (text, out) = run(&exec, chat(h.clone(), None, 2));
    assert!(out.output_tokens > 0 && out.input_tokens > plain.input_tokens + 20, "{text}");
    assert!(answer(&text, 1).calls.is_empty(), "no tools: no calls");
    // And with the tools again, a named call still follows the schema.
    let (text, _) = run(&exec, chat(h, Some(tools(ToolChoice::Function("get_time".into()), 1)), 3));
    let a = answer(&text, 1);
    assert_eq!(a.calls.len(), 1, "{text}");
    check_arguments(&a.calls[0].0, &a.calls[0].1);
}
