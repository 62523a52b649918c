#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The grammar on a byte-level vocabulary (token id = byte), so a test
//! can walk a text byte by byte and see where it is refused.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv};
use llguidance::{Matcher, ParserFactory};

use super::*;
use crate::tools::parse::answer;

fn tool(name: &str, params: &str) -> Tool {
    Tool { name: name.into(), description: None, parameters: params.into(), loose: false }
}

const WEATHER: &str = r#"{"type":"object","properties":{"city":{"type":"string"},
    "unit":{"enum":["c","f"]}},"required":["city","unit"],"additionalProperties":false}"#;

fn tools(choice: ToolChoice, max_calls: u8) -> Tools {
    Tools {
        functions: vec![
            tool("get_weather", WEATHER),
            tool("now", r#"{"type":"object","properties":{},"additionalProperties":false}"#),
        ],
        choice,
        max_calls,
    }
}

fn matcher(g: &str) -> (Matcher, u32) {
    let env: TokEnv = Arc::new(ApproximateTokEnv::single_byte());
    let mut f = ParserFactory::new_simple(&env).unwrap();
    f.quiet();
    let p = f.create_parser(TopLevelGrammar::from_lark(g.to_string())).expect("compiles");
    (Matcher::new(Ok(p)), env.tok_trie().eos_token())
}

/// `Ok(accepting)` when the grammar takes all of `text`, `Err(i)` at the
/// first byte it refuses.
fn walk(g: &str, text: &str) -> Result<bool, usize> {
    let (mut m, eos) = matcher(g);
    for (i, b) in text.bytes().enumerate() {
        let mask = m.compute_mask_or_eos().unwrap();
        if !mask.is_allowed(u32::from(b)) {
            return Err(i);
        }
        m.consume_token(u32::from(b)).unwrap();
    }
    Ok(m.compute_mask_or_eos().unwrap().is_allowed(eos))
}

fn call(name: &str, args: &str) -> String {
    crate::tools::call_text(name, args)
}

#[test]
fn required_takes_exactly_a_valid_call_of_any_tool() {
    let g = lark(&tools(ToolChoice::Required, 1), None).unwrap();
    let w = call("get_weather", r#"{"city": "Paris", "unit": "c"}"#);
    assert_eq!(walk(&g, &w), Ok(true));
    assert_eq!(walk(&g, &call("now", "{}")), Ok(true));
    // Arguments off the schema, an unknown tool, text instead of a call.
    let bad = call("get_weather", r#"{"city": "Paris", "unit": "k"}"#);
    assert!(walk(&g, &bad).is_err());
    assert!(walk(&g, &call("rm_rf", "{}")).is_err());
    assert_eq!(walk(&g, "Sure"), Err(0));
    // One call only: a second is refused.
    assert!(walk(&g, &format!("{w}\n{w}")).is_err());
    // And what the grammar takes, the reader reads back.
    assert_eq!(answer(&w, 1).calls[0].1, r#"{"city": "Paris", "unit": "c"}"#);
}

#[test]
fn a_named_tool_admits_only_that_tool_up_to_max_calls() {
    let g = lark(&tools(ToolChoice::Function("now".into()), 3), None).unwrap();
    let n = call("now", "{}");
    assert_eq!(walk(&g, &format!("{n}\n{n}\n{n}")), Ok(true));
    assert!(walk(&g, &format!("{n}\n{n}\n{n}\n{n}")).is_err(), "a fourth call");
    assert!(walk(&g, &call("get_weather", r#"{"city": "x", "unit": "c"}"#)).is_err());
    assert!(lark(&tools(ToolChoice::Function("nope".into()), 1), None).is_err());
}

#[test]
fn auto_takes_text_or_calls_but_no_text_that_opens_a_call() {
    let g = lark(&tools(ToolChoice::Auto, 1), None).unwrap();
    assert_eq!(walk(&g, "It is sunny <b>today</b>."), Ok(true));
    assert_eq!(walk(&g, ""), Ok(true), "an empty answer");
    assert_eq!(walk(&g, &call("now", "{}")), Ok(true));
    // Once `<tool_call>` is written, only a call may follow.
    assert!(walk(&g, "<tool_call>\nhello").is_err());
}

#[test]
fn auto_text_follows_the_response_format() {
    let rf = Constraint::JsonSchema {
        name: "r".into(),
        schema: r#"{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}"#
            .into(),
    };
    let g = lark(&tools(ToolChoice::Auto, 1), Some(&rf)).unwrap();
    assert_eq!(walk(&g, r#"{"a": 1}"#), Ok(true));
    assert!(walk(&g, "free text").is_err());
    assert_eq!(walk(&g, &call("now", "{}")), Ok(true));
}

#[test]
fn a_loose_tool_takes_any_object() {
    let mut t = tools(ToolChoice::Required, 1);
    t.functions[0].loose = true;
    let g = lark(&t, None).unwrap();
    assert_eq!(walk(&g, &call("get_weather", r#"{"anything": [1, 2]}"#)), Ok(true));
    assert!(walk(&g, &call("get_weather", "[1]")).is_err());
}

#[test]
fn a_payload_with_unreadable_parameters_is_an_error_not_a_panic() {
    let mut t = tools(ToolChoice::Required, 1);
    t.functions[0].parameters = "{not json".into();
    assert!(lark(&t, None).is_err());
    t.functions[0].parameters = "[1]".into();
    assert!(lark(&t, None).is_err());
}
